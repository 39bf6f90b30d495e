// Llama-3's Hugging Face name map and config.json (transformers' LlamaForCausalLM); the
// folder handling is models/hf_interop.cpp's.
#include "models/hf_interop.h"

#include <string>
#include <vector>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "models/hf_interop_detail.h"

namespace titan {

using namespace hf_detail;

std::vector<HfTensorMap> llama3_hf_map(const Llama3Args& a) {
  std::vector<HfTensorMap> m;
  auto add = [&](const std::string& ours, const std::string& hf, HfTransform t = HfTransform::kNone,
                 int64_t heads = 0) {
    m.push_back({ours, {hf}, t, heads});
  };
  add("tok_embeddings.weight", "model.embed_tokens.weight");
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    add(p + "attention_norm.weight", h + "input_layernorm.weight");
    add(p + "attention.wq.weight", h + "self_attn.q_proj.weight", HfTransform::kRopePermute,
        a.n_heads);
    add(p + "attention.wk.weight", h + "self_attn.k_proj.weight", HfTransform::kRopePermute,
        a.n_kv_heads);
    add(p + "attention.wv.weight", h + "self_attn.v_proj.weight");
    add(p + "attention.wo.weight", h + "self_attn.o_proj.weight");
    add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight");
    add_hf_swiglu(m, p + "feed_forward.", h + "mlp.");
  }
  add("norm.weight", "model.norm.weight");
  if (!a.tie_embeddings) add("output.weight", "lm_head.weight");
  return m;
}

nlohmann::ordered_json llama3_hf_config(const Llama3Args& a, at::ScalarType dtype) {
  nlohmann::ordered_json rope_scaling = nullptr;
  if (a.rope_scaling.factor != 1.0) {
    rope_scaling = {{"rope_type", "llama3"},
                    {"factor", a.rope_scaling.factor},
                    {"low_freq_factor", a.rope_scaling.low_freq_factor},
                    {"high_freq_factor", a.rope_scaling.high_freq_factor},
                    {"original_max_position_embeddings", a.rope_scaling.original_max_seq_len}};
  }
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", a.dim},
          {"intermediate_size", llama_ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier)},
          {"num_attention_heads", a.n_heads},
          {"num_hidden_layers", a.n_layers},
          {"num_key_value_heads", a.n_kv_heads},
          {"head_dim", a.dim / a.n_heads},
          {"rms_norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_scaling", rope_scaling},
          {"vocab_size", a.vocab_size},
          {"tie_word_embeddings", a.tie_embeddings},
          {"max_position_embeddings", a.max_seq_len},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"attention_dropout", 0.0},
          {"mlp_bias", false},
          {"torch_dtype", hf_dtype_name(dtype)}};
}

void export_llama3_hf(const Llama3& model, const std::string& dir, const HfExportOptions& opts) {
  export_hf(model.params(), llama3_hf_map(model.args()), llama3_hf_config(model.args(), opts.dtype),
            dir, opts);
}

namespace {

// Weight shapes cannot tell a folder's head count from ours (dim 256 is 16 heads of 16 or 8
// of 32), yet the q/k permutation depends on it; config.json can, so its structural fields
// must agree. Fields that only change the computation, not the weights, warn.
void check_llama3_hf_config(const Llama3Args& a, const std::string& dir) {
  const nlohmann::ordered_json cfg =
      read_hf_config(dir, "the folder's head counts cannot be checked against the model");
  if (cfg.is_null()) return;
  const std::string path = strip_slashes(dir) + "/config.json";
  require_same_fields(cfg, llama3_hf_config(a, at::kFloat),
                      {"hidden_size", "intermediate_size", "num_attention_heads",
                       "num_key_value_heads", "num_hidden_layers", "vocab_size", "head_dim"},
                      path);
  warn_rope_theta_and_eps(cfg, a.rope_theta, a.norm_eps, path);
}

}  // namespace

HfImportStats import_llama3_hf(Llama3& model, const std::string& dir) {
  check_llama3_hf_config(model.args(), dir);
  return import_hf(model.params(), llama3_hf_map(model.args()), dir);
}

}  // namespace titan
