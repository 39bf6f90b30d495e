// DeepSeek-V3's Hugging Face name map and config.json (transformers'
// DeepseekV3ForCausalLM); the folder handling is models/hf_interop.cpp's.
#include "models/hf_interop.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "models/hf_interop_detail.h"

namespace titan {

using namespace hf_detail;

std::vector<HfTensorMap> deepseek_v3_hf_map(const DeepSeekV3HfLayout& d) {
  std::vector<HfTensorMap> m;
  auto add = [&](const std::string& ours, const std::string& hf) {
    m.push_back({ours, {hf}, HfTransform::kNone, 0});
  };
  add("tok_embeddings.weight", "model.embed_tokens.weight");
  for (int64_t l = 0; l < d.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    add(p + "attention_norm.weight", h + "input_layernorm.weight");
    if (d.q_lora) {
      add(p + "attention.wq_a.weight", h + "self_attn.q_a_proj.weight");
      add(p + "attention.q_norm.weight", h + "self_attn.q_a_layernorm.weight");
      add(p + "attention.wq_b.weight", h + "self_attn.q_b_proj.weight");
    } else {
      add(p + "attention.wq.weight", h + "self_attn.q_proj.weight");
    }
    add(p + "attention.wkv_a.weight", h + "self_attn.kv_a_proj_with_mqa.weight");
    add(p + "attention.kv_norm.weight", h + "self_attn.kv_a_layernorm.weight");
    add(p + "attention.wkv_b.weight", h + "self_attn.kv_b_proj.weight");
    add(p + "attention.wo.weight", h + "self_attn.o_proj.weight");
    add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight");
    if (l < d.n_dense_layers) {
      add_hf_swiglu(m, p + "feed_forward.", h + "mlp.");
      continue;
    }
    add(p + "moe.router.gate.weight", h + "mlp.gate.weight");
    if (d.expert_bias) {
      // fp32 in any export, as in DeepSeek's release and in transformers' memory: the bias
      // decides expert choices by small margins that bf16 would round away.
      add(p + "moe.expert_bias", h + "mlp.gate.e_score_correction_bias");
      m.back().keep_fp32 = true;
    }
    // torchtitan's grouped experts have no ".weight" suffix.
    for (auto [w, proj] : {std::pair<const char*, const char*>{"w1", "gate_proj"},
                           {"w2", "down_proj"},
                           {"w3", "up_proj"}}) {
      HfTensorMap e{p + "moe.experts." + w, {}, HfTransform::kSplitExperts, 0};
      for (int64_t k = 0; k < d.n_experts; ++k)
        e.hf.push_back(h + "mlp.experts." + std::to_string(k) + "." + proj + ".weight");
      m.push_back(std::move(e));
    }
    if (d.shared_experts) add_hf_swiglu(m, p + "moe.shared_experts.", h + "mlp.shared_experts.");
  }
  add("norm.weight", "model.norm.weight");
  if (!d.tie_embeddings) add("output.weight", "lm_head.weight");
  return m;
}

std::vector<HfTensorMap> deepseek_v3_hf_map(int64_t n_layers, int64_t n_dense_layers,
                                            int64_t n_experts, bool q_lora) {
  DeepSeekV3HfLayout d;
  d.n_layers = n_layers;
  d.n_dense_layers = n_dense_layers;
  d.n_experts = n_experts;
  d.q_lora = q_lora;
  return deepseek_v3_hf_map(d);
}

DeepSeekV3HfLayout deepseek_v3_hf_layout(const DeepSeekV3Args& a) {
  DeepSeekV3HfLayout d;
  d.n_layers = a.n_layers;
  d.n_dense_layers = a.n_dense_layers;
  d.n_experts = a.moe.num_experts;
  d.q_lora = a.q_lora_rank > 0;
  d.shared_experts = a.moe.num_shared_experts > 0;
  d.expert_bias = true;  // every MoE layer has one (zero while balancing is off)
  d.tie_embeddings = false;
  return d;
}

nlohmann::ordered_json deepseek_v3_hf_config(const DeepSeekV3Args& a, at::ScalarType dtype) {
  // Our model switches YaRN on when its sequences are longer than original_seq_len, and then
  // also scales the softmax by mscale^2 (mla_softmax_scale). transformers does the same for
  // rope_type "yarn": mscale_all_dim gives the softmax factor, and mscale = mscale_all_dim
  // makes its extra cos/sin factor get_mscale(mscale) / get_mscale(mscale_all_dim) exactly 1.
  const bool yarn = a.max_seq_len > a.original_seq_len;
  nlohmann::ordered_json rope_scaling = nullptr;
  int64_t max_positions = a.max_seq_len;
  if (yarn) {
    rope_scaling = {{"rope_type", "yarn"},
                    {"factor", a.rope_factor},
                    {"original_max_position_embeddings", a.original_seq_len},
                    {"beta_fast", a.beta_fast},
                    {"beta_slow", a.beta_slow},
                    {"mscale", a.mscale},
                    {"mscale_all_dim", a.mscale}};
    // As DeepSeek's own config.json (4096 x 40 = 163840): the length YaRN extends to. The
    // frequencies do not depend on it.
    max_positions = std::max<int64_t>(
        a.max_seq_len, static_cast<int64_t>(std::llround(a.original_seq_len * a.rope_factor)));
  }
  const MoEArgs& moe = a.moe;
  // No groups is one group that is always kept: the same choices.
  const int64_t n_group = moe.num_expert_groups > 0 ? moe.num_expert_groups : 1;
  const int64_t topk_group = moe.num_expert_groups > 0 ? moe.num_limited_groups : 1;
  return {{"architectures", {"DeepseekV3ForCausalLM"}},
          {"model_type", "deepseek_v3"},
          {"vocab_size", a.vocab_size},
          {"hidden_size", a.dim},
          {"intermediate_size", a.inter_dim},
          {"moe_intermediate_size", a.moe_inter_dim},
          {"num_hidden_layers", a.n_layers},
          {"num_attention_heads", a.n_heads},
          {"num_key_value_heads", a.n_heads},
          {"q_lora_rank", a.q_lora_rank > 0 ? nlohmann::ordered_json(a.q_lora_rank) : nullptr},
          {"kv_lora_rank", a.kv_lora_rank},
          {"qk_nope_head_dim", a.qk_nope_head_dim},
          {"qk_rope_head_dim", a.qk_rope_head_dim},
          {"v_head_dim", a.v_head_dim},
          {"n_routed_experts", moe.num_experts},
          {"n_shared_experts", moe.num_shared_experts},
          {"num_experts_per_tok", moe.top_k},
          {"n_group", n_group},
          {"topk_group", topk_group},
          {"routed_scaling_factor", moe.route_scale},
          {"norm_topk_prob", moe.route_norm},
          // DeepSeek's keys (transformers ignores both): the score function, and selection by
          // biased scores with groups ranked by their top-2 sum.
          {"scoring_func", moe.score_func == ScoreFunc::Sigmoid ? "sigmoid" : "softmax"},
          {"topk_method", "noaux_tc"},
          {"first_k_dense_replace", a.n_dense_layers},
          {"num_nextn_predict_layers", 0},
          {"hidden_act", "silu"},
          {"rms_norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_scaling", rope_scaling},
          {"rope_interleave", true},
          {"max_position_embeddings", max_positions},
          {"attention_bias", false},
          {"attention_dropout", 0.0},
          {"tie_word_embeddings", false},
          {"torch_dtype", hf_dtype_name(dtype)}};
}

NamedTensors deepseek_v3_hf_tensors(const DeepSeekV3& model) {
  NamedTensors r = named(model.params());
  for (MoELayer* m : model.moe_layers())
    r.emplace_back(m->prefix() + "expert_bias", m->expert_bias);
  return r;
}

HfImportTargets deepseek_v3_hf_targets(const DeepSeekV3& model) {
  HfImportTargets r = hf_targets(model.params());
  for (MoELayer* m : model.moe_layers())
    r.push_back({m->prefix() + "expert_bias", m->expert_bias, m->expert_bias.sizes().vec(), 0});
  return r;
}

namespace {

// What our DeepSeek-V3 can compute that DeepseekV3ForCausalLM cannot represent at all.
void require_deepseek_v3_exportable(const DeepSeekV3Args& a, const std::string& what) {
  if (a.moe.gate_bias)
    throw UserError(what +
                    ": deepseek_v3 with a router gate bias has no Hugging Face "
                    "DeepseekV3 equivalent; allowed: gate_bias = false (every flavor)");
}

// Structural config.json fields must match (UserError); routing and RoPE fields only change
// the computation, so a difference warns.
void check_deepseek_v3_hf_config(const DeepSeekV3Args& a, const std::string& dir) {
  const nlohmann::ordered_json cfg =
      read_hf_config(dir,
                     "the folder's head counts and head dims cannot be checked against "
                     "the model");
  if (cfg.is_null()) return;
  const std::string path = strip_slashes(dir) + "/config.json";
  const nlohmann::ordered_json want = deepseek_v3_hf_config(a, at::kFloat);
  require_same_fields(
      cfg, want,
      {"hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
       "num_attention_heads", "num_key_value_heads", "vocab_size", "q_lora_rank", "kv_lora_rank",
       "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
       "first_k_dense_replace"},
      path);
  if (cfg.contains("rope_interleave") && cfg["rope_interleave"] == false)
    throw UserError(path +
                    ": rope_interleave = false (rotate-half RoPE layout); allowed: true, "
                    "DeepSeek's interleaved layout, which is the only one imported");
  for (const char* key : {"num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                          "norm_topk_prob", "scoring_func"}) {
    if (cfg.contains(key) && !cfg[key].is_null() && cfg[key] != want[key])
      log_warn(path + ": " + key + " = " + cfg[key].dump() + " but this model uses " +
               want[key].dump() + "; the weights load, the routing differs");
  }
  warn_rope_theta_and_eps(cfg, a.rope_theta, a.norm_eps, path);
}

}  // namespace

void export_deepseek_v3_hf(const DeepSeekV3& model, const std::string& dir,
                           const HfExportOptions& opts) {
  const DeepSeekV3Args& a = model.args();
  require_deepseek_v3_exportable(a, "export to Hugging Face");
  if (a.moe.score_func != ScoreFunc::Sigmoid)
    log_warn(
        "export to Hugging Face: this deepseek_v3 model routes with softmax scores; "
        "config.json says scoring_func = \"softmax\", but transformers' "
        "DeepseekV3ForCausalLM always routes with sigmoid, so it will not reproduce this "
        "model's outputs (the weights are exported as they are)");
  export_hf(deepseek_v3_hf_tensors(model), deepseek_v3_hf_map(deepseek_v3_hf_layout(a)),
            deepseek_v3_hf_config(a, opts.dtype), dir, opts);
}

HfImportStats import_deepseek_v3_hf(DeepSeekV3& model, const std::string& dir) {
  const DeepSeekV3Args& a = model.args();
  require_deepseek_v3_exportable(a, "import from Hugging Face");
  check_deepseek_v3_hf_config(a, dir);
  // DeepSeek-V3's release appends its multi-token-prediction module as model.layers.61.*.
  const std::string layers = "model.layers.";
  auto mtp = [&](const std::string& name) {
    if (name.compare(0, layers.size(), layers) != 0) return false;
    size_t end = 0;
    int64_t l = -1;
    try {
      l = std::stoll(name.substr(layers.size()), &end);
    } catch (const std::exception&) {
      return false;
    }
    return end > 0 && l >= a.n_layers;
  };
  return import_hf(deepseek_v3_hf_targets(model), deepseek_v3_hf_map(deepseek_v3_hf_layout(a)), dir,
                   mtp);
}

}  // namespace titan
