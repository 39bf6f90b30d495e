// GPT-OSS's Hugging Face names and config.json (transformers' GptOssForCausalLM); the folder
// handling is models/hf_interop.cpp's.
//
// Names map one to one except the experts: transformers keeps mlp.experts.gate_up_proj
// (E, dim, 2 hidden) with the gate (our w1) on the even and the up projection (our w3) on the
// odd columns, gate_up_proj_bias (E, 2 hidden) likewise, and down_proj (E, hidden, dim), the
// transpose of our w2 (E, dim, hidden). An export writes those from ours; an import reads them
// into temporaries of the same expert rows and splits them back. No RoPE permutation (both
// rotate halves). The expert-bias buffer of aux-loss-free balancing has no name there.
#include <string>
#include <utility>
#include <vector>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "models/hf_interop.h"
#include "models/hf_interop_detail.h"

namespace titan {

using namespace hf_detail;

namespace {

// Our synthetic names for transformers' expert tensors (never parameters).
const char* const kGateUp = "experts.gate_up_proj";
const char* const kGateUpBias = "experts.gate_up_proj_bias";
const char* const kDown = "experts.down_proj";

bool is_split_expert(const std::string& name) {
  for (const char* leaf :
       {"experts.w1", "experts.w3", "experts.w1_bias", "experts.w3_bias", "experts.w2"})
    if (name.size() >= std::string(leaf).size() &&
        name.compare(name.size() - std::string(leaf).size(), std::string::npos, leaf) == 0)
      return true;
  return false;
}

// (E, H, D) x2 -> (E, D, 2H): a on the even, b on the odd columns of the last dim.
at::Tensor interleave_columns(const at::Tensor& a, const at::Tensor& b) {
  return at::stack({a, b}, 2).reshape({a.size(0), 2 * a.size(1), a.size(2)}).transpose(1, 2);
}

}  // namespace

std::vector<HfTensorMap> gpt_oss_hf_map(const GptOssArgs& a) {
  std::vector<HfTensorMap> m;
  auto add = [&](const std::string& ours, const std::string& hf) {
    m.push_back({ours, {hf}, HfTransform::kNone, 0});
  };
  add("tok_embeddings.weight", "model.embed_tokens.weight");
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    add(p + "attention_norm.weight", h + "input_layernorm.weight");
    for (auto [ours, hf] : {std::pair<const char*, const char*>{"wq", "q_proj"},
                            {"wk", "k_proj"},
                            {"wv", "v_proj"},
                            {"wo", "o_proj"}}) {
      add(p + "attention." + ours + ".weight", h + "self_attn." + hf + ".weight");
      add(p + "attention." + ours + ".bias", h + "self_attn." + hf + ".bias");
    }
    add(p + "attention.sinks", h + "self_attn.sinks");
    add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight");
    add(p + "moe.router.gate.weight", h + "mlp.router.weight");
    add(p + "moe.router.gate.bias", h + "mlp.router.bias");
    add(p + "moe." + kGateUp, h + "mlp.experts.gate_up_proj");
    add(p + "moe." + kGateUpBias, h + "mlp.experts.gate_up_proj_bias");
    add(p + "moe." + kDown, h + "mlp.experts.down_proj");
    add(p + "moe.experts.w2_bias", h + "mlp.experts.down_proj_bias");
  }
  add("norm.weight", "model.norm.weight");
  add("output.weight", "lm_head.weight");
  return m;
}

nlohmann::ordered_json gpt_oss_hf_config(const GptOssArgs& a, at::ScalarType dtype) {
  nlohmann::ordered_json layer_types = nlohmann::ordered_json::array();
  for (int64_t l = 0; l < a.n_layers; ++l)
    layer_types.push_back(GptOss::sliding(l) ? "sliding_attention" : "full_attention");
  // transformers derives YaRN's factor as max_position_embeddings / original (when the
  // original is given): the positions are the original times the factor, as the release's.
  const auto max_pos =
      static_cast<int64_t>(static_cast<double>(a.original_seq_len) * a.rope_factor);
  return {{"architectures", {"GptOssForCausalLM"}},
          {"model_type", "gpt_oss"},
          {"hidden_size", a.dim},
          {"intermediate_size", a.moe_inter_dim},
          {"num_attention_heads", a.n_heads},
          {"num_key_value_heads", a.n_kv_heads},
          {"head_dim", a.head_dim},
          {"num_hidden_layers", a.n_layers},
          {"num_local_experts", a.moe.num_experts},
          {"num_experts_per_tok", a.moe.top_k},
          {"experts_per_token", a.moe.top_k},
          {"vocab_size", a.vocab_size},
          {"rms_norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_scaling",
           {{"rope_type", "yarn"},
            {"factor", a.rope_factor},
            {"beta_fast", a.ntk_beta},
            {"beta_slow", a.ntk_alpha},
            {"original_max_position_embeddings", a.original_seq_len},
            {"truncate", false}}},
          {"max_position_embeddings", max_pos},
          {"initial_context_length", a.original_seq_len},
          {"sliding_window", a.sliding_window_size},
          {"layer_types", layer_types},
          {"swiglu_limit", a.swiglu_limit},
          {"attention_bias", true},
          {"attention_dropout", 0.0},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", false},
          {"output_router_logits", false},
          {"router_aux_loss_coef", 0.0},
          {"torch_dtype", hf_dtype_name(dtype)}};
}

void export_gpt_oss_hf(const GptOss& model, const std::string& dir, const HfExportOptions& opts) {
  const GptOssArgs& a = model.args();
  for (const MoELayer* l : model.moe_layers())
    if (l->expert_bias.defined() && l->expert_bias.abs().max().item<double>() > 0) {
      log_warn(
          "export to Hugging Face: gpt_oss's expert-bias buffers (aux-loss-free load balancing) "
          "are non-zero but GptOssForCausalLM has no place for them; it will choose experts by "
          "the router's scores alone");
      break;
    }
  NamedTensors t;
  for (const auto& p : model.params().all())
    if (!is_split_expert(p.name)) t.emplace_back(p.name, p.value.detach());
  const ParamStore& s = model.params();
  auto get = [&](const std::string& n) { return s[s.index_of(n)].value.detach(); };
  for (const MoELayer* l : model.moe_layers()) {
    const std::string e = l->prefix() + "experts.";
    t.emplace_back(l->prefix() + kGateUp, interleave_columns(get(e + "w1"), get(e + "w3")));
    t.emplace_back(l->prefix() + kGateUpBias, interleave_columns(get(e + "w1_bias").unsqueeze(2),
                                                                 get(e + "w3_bias").unsqueeze(2))
                                                  .squeeze(1));
    t.emplace_back(l->prefix() + kDown, get(e + "w2").transpose(1, 2));
  }
  export_hf(t, gpt_oss_hf_map(a), gpt_oss_hf_config(a, opts.dtype), dir, opts);
}

HfImportStats import_gpt_oss_hf(GptOss& model, const std::string& dir) {
  const GptOssArgs& a = model.args();
  const nlohmann::ordered_json cfg =
      read_hf_config(dir, "the folder's architecture cannot be checked against the model");
  if (!cfg.is_null()) {
    const std::string path = strip_slashes(dir) + "/config.json";
    if (!cfg.contains("model_type") || cfg["model_type"] != "gpt_oss")
      throw UserError(path + ": model_type = " +
                      (cfg.contains("model_type") ? cfg["model_type"].dump() : "(missing)") +
                      "; allowed: \"gpt_oss\" (model.name = gpt_oss)");
    if (cfg.contains("quantization_config") && cfg["quantization_config"].is_object())
      throw UserError(path + ": quantization_config = " + cfg["quantization_config"].dump() +
                      ": MXFP4 (or other quantized) expert weights are not dequantized on import "
                      "yet; allowed: a folder of bf16/fp16/fp32 weights (e.g. transformers' "
                      "save_pretrained of the dequantized model)");
    require_same_fields(
        cfg, gpt_oss_hf_config(a, at::kFloat),
        {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
         "head_dim", "num_hidden_layers", "num_local_experts", "num_experts_per_tok", "vocab_size",
         "sliding_window"},
        path);
    warn_rope_theta_and_eps(cfg, a.rope_theta, a.norm_eps, path);
  }
  // Every parameter but the split experts straight; those through temporaries of the same
  // expert rows (this rank's under FSDP), split after the read.
  ParamStore& s = model.params();
  HfImportTargets targets;
  for (HfImportTarget& t : hf_targets(s))
    if (!is_split_expert(t.name)) targets.push_back(std::move(t));
  struct Pending {
    std::string prefix;
    at::Tensor gate_up, gate_up_bias, down;
  };
  std::vector<Pending> pending;
  const int64_t E = a.moe.num_experts, H = a.moe_inter_dim, D = a.dim;
  for (const MoELayer* l : model.moe_layers()) {
    const Param& w1 = s[s.index_of(l->prefix() + "experts.w1")];
    if (w1.value.is_meta()) continue;  // another pipeline stage's
    if (w1.tp_dim >= 0)
      throw UserError(
          "a Hugging Face import into gpt_oss with expert tensor parallelism: its fused "
          "gate_up_proj is not split by hidden rows on import yet; allowed: "
          "parallelism.expert_tensor_parallel_degree = 1 for the initial load");
    const at::Tensor rows = w1.valid(w1.value);
    const int64_t n = rows.size(0), o = w1.dim0_offset;
    const auto opts = rows.options();
    Pending p{l->prefix(), at::empty({n, D, 2 * H}, opts), at::empty({n, 2 * H}, opts),
              at::empty({n, H, D}, opts)};
    targets.push_back({p.prefix + kGateUp, p.gate_up, {E, D, 2 * H}, o});
    targets.push_back({p.prefix + kGateUpBias, p.gate_up_bias, {E, 2 * H}, o});
    targets.push_back({p.prefix + kDown, p.down, {E, H, D}, o});
    pending.push_back(std::move(p));
  }
  HfImportStats stats = import_hf(targets, gpt_oss_hf_map(a), dir);
  at::NoGradGuard ng;
  for (const Pending& p : pending) {
    auto dst = [&](const std::string& leaf) {
      const Param& q = s[s.index_of(p.prefix + "experts." + leaf)];
      return q.valid(q.value);
    };
    dst("w1").copy_(p.gate_up.narrow(2, 0, 2 * H).slice(2, 0, 2 * H, 2).transpose(1, 2));
    dst("w3").copy_(p.gate_up.slice(2, 1, 2 * H, 2).transpose(1, 2));
    dst("w1_bias").copy_(p.gate_up_bias.slice(1, 0, 2 * H, 2));
    dst("w3_bias").copy_(p.gate_up_bias.slice(1, 1, 2 * H, 2));
    dst("w2").copy_(p.down.transpose(1, 2));
  }
  return stats;
}

}  // namespace titan
