// Qwen3's Hugging Face name map and config.json (transformers' Qwen3ForCausalLM and
// Qwen3MoeForCausalLM); the folder handling is models/hf_interop.cpp's.
//
// No weight is permuted: our Qwen3 applies RoPE in the rotate-half layout (apply_rope_half),
// as transformers does, so q_proj, k_proj and the per-head q_norm / k_norm weights keep their
// order (torchtitan's qwen3 state-dict adapter renames only). The routed experts split into
// model.layers.N.mlp.experts.K.{gate,up,down}_proj.weight, Qwen3-MoE's released layout; the
// expert-bias buffer of aux-loss-free balancing has no Hugging Face name (transformers' router
// has no bias), so an export of a model trained with it routes by the unbiased scores there.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "models/hf_interop.h"
#include "models/hf_interop_detail.h"

namespace titan {

using namespace hf_detail;

std::vector<HfTensorMap> qwen3_hf_map(const Qwen3Args& a) {
  std::vector<HfTensorMap> m;
  auto add = [&](const std::string& ours, const std::string& hf) {
    m.push_back({ours, {hf}, HfTransform::kNone, 0});
  };
  add("tok_embeddings.weight", "model.embed_tokens.weight");
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    add(p + "attention_norm.weight", h + "input_layernorm.weight");
    add(p + "attention.wq.weight", h + "self_attn.q_proj.weight");
    add(p + "attention.wk.weight", h + "self_attn.k_proj.weight");
    add(p + "attention.wv.weight", h + "self_attn.v_proj.weight");
    add(p + "attention.wo.weight", h + "self_attn.o_proj.weight");
    if (a.qk_norm) {
      add(p + "attention.q_norm.weight", h + "self_attn.q_norm.weight");
      add(p + "attention.k_norm.weight", h + "self_attn.k_norm.weight");
    }
    add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight");
    if (!a.moe_enabled) {
      add_hf_swiglu(m, p + "feed_forward.", h + "mlp.");
      continue;
    }
    add(p + "moe.router.gate.weight", h + "mlp.gate.weight");
    for (auto [w, proj] : {std::pair<const char*, const char*>{"w1", "gate_proj"},
                           {"w2", "down_proj"},
                           {"w3", "up_proj"}}) {
      HfTensorMap e{p + "moe.experts." + w, {}, HfTransform::kSplitExperts, 0};
      for (int64_t k = 0; k < a.moe.num_experts; ++k)
        e.hf.push_back(h + "mlp.experts." + std::to_string(k) + "." + proj + ".weight");
      m.push_back(std::move(e));
    }
  }
  add("norm.weight", "model.norm.weight");
  if (!a.tie_embeddings) add("output.weight", "lm_head.weight");
  return m;
}

nlohmann::ordered_json qwen3_hf_config(const Qwen3Args& a, at::ScalarType dtype) {
  nlohmann::ordered_json c = {
      {"architectures", {a.moe_enabled ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"}},
      {"model_type", a.moe_enabled ? "qwen3_moe" : "qwen3"},
      {"hidden_size", a.dim},
      {"intermediate_size", a.hidden_dim},
      {"num_attention_heads", a.n_heads},
      {"num_hidden_layers", a.n_layers},
      {"num_key_value_heads", a.n_kv_heads},
      {"head_dim", a.head_dim},
      {"rms_norm_eps", a.norm_eps},
      {"rope_theta", a.rope_theta},
      {"rope_scaling", nullptr},
      {"vocab_size", a.vocab_size},
      {"tie_word_embeddings", a.tie_embeddings},
      {"max_position_embeddings", a.max_seq_len},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"use_sliding_window", false},
      {"torch_dtype", hf_dtype_name(dtype)}};
  if (a.moe_enabled) {
    c["moe_intermediate_size"] = a.moe_inter_dim;
    c["num_experts"] = a.moe.num_experts;
    c["num_experts_per_tok"] = a.moe.top_k;
    c["norm_topk_prob"] = a.moe.route_norm;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = nlohmann::ordered_json::array();
  }
  return c;
}

namespace {

// What transformers' Qwen3-MoE cannot express: it routes by softmax, top-k, optionally
// renormalized, with no shared expert, no router bias and no route scale.
void check_qwen3_moe_exportable(const Qwen3Args& a) {
  const MoEArgs& m = a.moe;
  if (m.score_func != ScoreFunc::Softmax || m.num_shared_experts != 0 || m.gate_bias ||
      m.route_scale != 1.0 || m.num_expert_groups != 0 || m.score_before_experts)
    throw UserError(
        "qwen3 MoE with sigmoid routing, shared experts, a router bias, a route "
        "scale, expert groups or scores before the experts has no Qwen3MoeForCausalLM "
        "form; allowed: the qwen3 MoE flavors' routing");
}

// Weight shapes cannot tell every structural field (head_dim with the head counts, MoE top_k),
// and another architecture's folder may even share names; config.json can.
void check_qwen3_hf_config(const Qwen3Args& a, const std::string& dir) {
  const nlohmann::ordered_json cfg =
      read_hf_config(dir, "the folder's architecture cannot be checked against the model");
  if (cfg.is_null()) return;
  const std::string path = strip_slashes(dir) + "/config.json";
  const nlohmann::ordered_json want = qwen3_hf_config(a, at::kFloat);
  if (!cfg.contains("model_type") || cfg["model_type"] != want["model_type"])
    throw UserError(path + ": model_type = " +
                    (cfg.contains("model_type") ? cfg["model_type"].dump() : "(missing)") +
                    "; allowed: " + want["model_type"].dump() + " (model.name = qwen3, flavor " +
                    (a.moe_enabled ? "with" : "without") + " MoE)");
  require_same_fields(cfg, want,
                      {"hidden_size", "num_attention_heads", "num_key_value_heads",
                       "num_hidden_layers", "vocab_size", "head_dim"},
                      path);
  if (a.moe_enabled)
    require_same_fields(
        cfg, want,
        {"moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob"}, path);
  else
    require_same_fields(cfg, want, {"intermediate_size"}, path);
  warn_rope_theta_and_eps(cfg, a.rope_theta, a.norm_eps, path);
}

}  // namespace

void export_qwen3_hf(const Qwen3& model, const std::string& dir, const HfExportOptions& opts) {
  const Qwen3Args& a = model.args();
  if (a.moe_enabled) {
    check_qwen3_moe_exportable(a);
    if (a.moe.load_balance_coeff > 0)
      for (const MoELayer* l : model.moe_layers())
        if (l->expert_bias.defined() && l->expert_bias.abs().max().item<double>() > 0) {
          log_warn(
              "export to Hugging Face: qwen3's expert-bias buffers (aux-loss-free load "
              "balancing) are non-zero but Qwen3MoeForCausalLM has no router bias; it "
              "will choose experts by the unbiased scores");
          break;
        }
  }
  export_hf(model.params(), qwen3_hf_map(a), qwen3_hf_config(a, opts.dtype), dir, opts);
}

HfImportStats import_qwen3_hf(Qwen3& model, const std::string& dir) {
  check_qwen3_hf_config(model.args(), dir);
  return import_hf(model.params(), qwen3_hf_map(model.args()), dir);
}

}  // namespace titan
