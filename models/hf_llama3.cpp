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

namespace {

int64_t hf_int(const nlohmann::ordered_json& cfg, const char* key, const std::string& path) {
  if (!cfg.contains(key) || !cfg[key].is_number_integer() || cfg[key].get<int64_t>() <= 0)
    throw UserError(path + ": " + key + " is " + (cfg.contains(key) ? cfg[key].dump() : "missing") +
                    "; expected a positive integer (a LlamaForCausalLM config.json)");
  return cfg[key].get<int64_t>();
}

double hf_double(const nlohmann::ordered_json& cfg, const char* key, double fallback) {
  return cfg.contains(key) && cfg[key].is_number() ? cfg[key].get<double>() : fallback;
}

}  // namespace

Llama3Args llama3_args_from_hf_config(const std::string& dir) {
  const std::string path = strip_slashes(dir) + "/config.json";
  const nlohmann::ordered_json cfg = read_hf_config(dir, "");
  if (cfg.is_null())
    throw UserError("Hugging Face folder '" + dir + "': no config.json to read the model's "
                    "dimensions from; allowed: a folder with LlamaForCausalLM's config.json");
  if (cfg.contains("model_type") && cfg["model_type"] != "llama")
    throw UserError(path + ": model_type = " + cfg["model_type"].dump() +
                    "; allowed: \"llama\" (model.name = llama3)");
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (cfg.contains(key) && cfg[key] == true)
      throw UserError(path + ": " + key + " = true; allowed: false (Llama-3 has no biases)");
  if (cfg.contains("hidden_act") && cfg["hidden_act"] != "silu")
    throw UserError(path + ": hidden_act = " + cfg["hidden_act"].dump() + "; allowed: \"silu\"");
  Llama3Args a;
  a.dim = hf_int(cfg, "hidden_size", path);
  a.n_layers = hf_int(cfg, "num_hidden_layers", path);
  a.n_heads = hf_int(cfg, "num_attention_heads", path);
  a.n_kv_heads = cfg.contains("num_key_value_heads") && !cfg["num_key_value_heads"].is_null()
                     ? hf_int(cfg, "num_key_value_heads", path)
                     : a.n_heads;
  a.vocab_size = hf_int(cfg, "vocab_size", path);
  if (a.dim % a.n_heads != 0 || a.n_heads % a.n_kv_heads != 0)
    throw UserError(path + ": hidden_size " + std::to_string(a.dim) + ", " +
                    std::to_string(a.n_heads) + " heads, " + std::to_string(a.n_kv_heads) +
                    " KV heads; allowed: heads dividing hidden_size, KV heads dividing heads");
  if (cfg.contains("head_dim") && !cfg["head_dim"].is_null() &&
      cfg["head_dim"] != a.dim / a.n_heads)
    throw UserError(path + ": head_dim = " + cfg["head_dim"].dump() +
                    "; allowed: hidden_size / num_attention_heads = " +
                    std::to_string(a.dim / a.n_heads));
  // Our FFN width is round_up(int(multiplier * int(8 * dim / 3)), multiple_of): with
  // multiple_of = intermediate_size and a multiplier that brings int(8 * dim / 3) to it (or
  // just below, by rounding), any width comes out exactly.
  const int64_t ffn = hf_int(cfg, "intermediate_size", path);
  a.multiple_of = ffn;
  a.ffn_dim_multiplier =
      static_cast<double>(ffn) / static_cast<double>(static_cast<int64_t>(8 * a.dim / 3));
  if (llama_ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier) != ffn)
    throw UserError(path + ": intermediate_size = " + std::to_string(ffn) +
                    " cannot be expressed; this is a bug, please report it");
  a.norm_eps = hf_double(cfg, "rms_norm_eps", a.norm_eps);
  a.rope_theta = hf_double(cfg, "rope_theta", a.rope_theta);
  if (cfg.contains("rope_parameters") && cfg["rope_parameters"].is_object())
    a.rope_theta = hf_double(cfg["rope_parameters"], "rope_theta", a.rope_theta);
  const nlohmann::ordered_json rs = cfg.contains("rope_scaling") ? cfg["rope_scaling"] : nullptr;
  if (rs.is_null()) {
    a.rope_scaling.factor = 1.0;
  } else {
    const std::string type = rs.value("rope_type", rs.value("type", std::string()));
    if (type != "llama3")
      throw UserError(path + ": rope_scaling type " + rs.dump() +
                      "; allowed: none or \"llama3\"");
    a.rope_scaling.factor = hf_double(rs, "factor", a.rope_scaling.factor);
    a.rope_scaling.low_freq_factor = hf_double(rs, "low_freq_factor", 1.0);
    a.rope_scaling.high_freq_factor = hf_double(rs, "high_freq_factor", 4.0);
    a.rope_scaling.original_max_seq_len = static_cast<int64_t>(
        hf_double(rs, "original_max_position_embeddings", 8192));
  }
  a.tie_embeddings = cfg.value("tie_word_embeddings", false);
  if (cfg.contains("max_position_embeddings") && cfg["max_position_embeddings"].is_number_integer())
    a.max_seq_len = cfg["max_position_embeddings"].get<int64_t>();
  return a;
}

std::string llama3_matching_flavor(const Llama3Args& a) {
  for (const std::string& name : llama3_flavor_names()) {
    const Llama3Args f = llama3_flavor(name);
    if (f.dim == a.dim && f.n_layers == a.n_layers && f.n_heads == a.n_heads &&
        f.n_kv_heads == a.n_kv_heads && f.vocab_size == a.vocab_size &&
        f.tie_embeddings == a.tie_embeddings &&
        llama_ffn_hidden(f.dim, f.multiple_of, f.ffn_dim_multiplier) ==
            llama_ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier))
      return name;
  }
  return "";
}

std::string describe_llama3_args(const Llama3Args& a) {
  return "dim " + std::to_string(a.dim) + ", " + std::to_string(a.n_layers) + " layers, " +
         std::to_string(a.n_heads) + " heads (" + std::to_string(a.n_kv_heads) + " KV), ffn " +
         std::to_string(llama_ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier)) +
         ", vocab " + std::to_string(a.vocab_size) +
         (a.tie_embeddings ? ", tied embeddings" : "") + ", rope_theta " +
         std::to_string(static_cast<int64_t>(a.rope_theta));
}

HfImportStats import_llama3_hf(Llama3& model, const std::string& dir) {
  check_llama3_hf_config(model.args(), dir);
  return import_hf(model.params(), llama3_hf_map(model.args()), dir);
}

}  // namespace titan
