#include "models/registry.h"

#include "core/base/errors.h"
#include "models/deepseek_v3.h"
#include "models/gpt_oss.h"
#include "models/llama3.h"
#include "models/llama4.h"
#include "models/moe_model.h"
#include "models/qwen3.h"

namespace titan {

std::vector<std::string> model_flavors(const std::string& name) {
  if (name == "llama3") return llama3_flavor_names();
  if (name == "llama4") return llama4_flavor_names();
  if (name == "deepseek_v3") return deepseek_v3_flavor_names();
  if (name == "qwen3") return qwen3_flavor_names();
  if (name == "gpt_oss") return gpt_oss_flavor_names();
  return {};
}

int64_t model_vocab_size(const JobConfig& cfg) {
  if (cfg.model.name == "llama3") return llama3_flavor(cfg.model.flavor).vocab_size;
  if (cfg.model.name == "llama4") return llama4_flavor(cfg.model.flavor).vocab_size;
  if (cfg.model.name == "deepseek_v3") return deepseek_v3_flavor(cfg.model.flavor).vocab_size;
  if (cfg.model.name == "qwen3") return qwen3_flavor(cfg.model.flavor).vocab_size;
  if (cfg.model.name == "gpt_oss") return gpt_oss_flavor(cfg.model.flavor).vocab_size;
  throw UserError("model.name = \"" + cfg.model.name +
                  "\" is not a model; allowed: llama3, llama4, deepseek_v3, qwen3, gpt_oss");
}

DocumentOptions model_document_options(const JobConfig& cfg, int64_t eos_id) {
  DocumentOptions o;
  if (cfg.model.name == "llama3") {
    const Llama3Args a = llama3_flavor(cfg.model.flavor);
    o.mask = a.attn_mask, o.type = a.attn_type;
  } else if (cfg.model.name == "llama4") {
    const Llama4Args a = llama4_flavor(cfg.model.flavor);
    o.mask = a.attn_mask, o.type = a.attn_type;
  } else if (cfg.model.name == "deepseek_v3") {
    const DeepSeekV3Args a = deepseek_v3_flavor(cfg.model.flavor);
    o.mask = a.attn_mask, o.type = a.attn_type;
  } else if (cfg.model.name == "gpt_oss") {
    const GptOssArgs a = gpt_oss_flavor(cfg.model.flavor);
    o.mask = a.attn_mask, o.type = a.attn_type;
  }
  if (cfg.model.attn_mask_type != "flavor")
    o.mask = parse_attn_mask(cfg.model.attn_mask_type, "model.attn_mask_type");
  if (cfg.model.attn_type != "flavor")
    o.type = parse_attn_type(cfg.model.attn_type, "model.attn_type");
  if (cfg.model.name == "gpt_oss" && cfg.model.document_positions)
    throw UserError(
        "model.document_positions = true with model.name = \"gpt_oss\": GPT-OSS's YaRN RoPE "
        "does not restart positions per document yet; allowed with gpt_oss: false "
        "(the block-causal mask and model.document_loss work)");
  o.positions = cfg.model.document_positions;
  o.loss = cfg.model.document_loss;
  o.eos_id = eos_id;
  return o;
}

namespace {

// What GPT-OSS cannot run yet, refused by key (docs/models.md): context parallelism (its
// sliding windows and sinks have no cp attention; torchtitan 0.2.2 refuses it too) and float8
// grouped GEMMs (its experts' biases and clamped SwiGLU run through the composed experts path).
void check_gpt_oss_layout(const JobConfig& cfg) {
  if (cfg.parallelism.context_parallel_degree > 1)
    throw UserError("parallelism.context_parallel_degree = " +
                    std::to_string(cfg.parallelism.context_parallel_degree) +
                    " with model.name = \"gpt_oss\": its sliding-window attention with sinks "
                    "has no context-parallel form yet; allowed with gpt_oss: 1");
  if (float8_grouped_enabled(cfg))
    throw UserError(
        "model.converters = \"quantize.grouped_mm.float8\" with model.name = \"gpt_oss\": "
        "its experts' biases and clamped SwiGLU have no float8 grouped GEMM path yet; allowed "
        "with gpt_oss: no grouped float8 converter");
}

}  // namespace

std::unique_ptr<Model> build_model(const JobConfig& cfg, at::Device device, bool defer_params) {
  DeferParams defer(defer_params);
  std::unique_ptr<Model> m;
  // model.n_layers > 0 keeps the flavor's width and truncates (or extends) its depth:
  // benchmarks of a large flavor's real layers on one device.
  auto depth = [&cfg](int64_t flavor_layers) {
    return cfg.model.n_layers > 0 ? cfg.model.n_layers : flavor_layers;
  };
  if (cfg.model.name == "llama3") {
    Llama3Args a = llama3_flavor(cfg.model.flavor);
    a.n_layers = depth(a.n_layers);
    m = std::make_unique<Llama3>(a, device);
  } else if (cfg.model.name == "llama4") {
    Llama4Args a = llama4_flavor(cfg.model.flavor);
    a.n_layers = depth(a.n_layers);
    // Like torchtitan's update_from_config: the RoPE table covers the run's sequences.
    a.max_seq_len = run_max_seq_len(cfg);
    configure_moe(a.moe, cfg, device, a.dim, llama4_expert_hidden(a));
    m = std::make_unique<Llama4>(a, device);
  } else if (cfg.model.name == "deepseek_v3") {
    DeepSeekV3Args a = deepseek_v3_flavor(cfg.model.flavor);
    a.n_layers = depth(a.n_layers);
    // As torchtitan: YaRN and its softmax mscale apply when the run's sequences are longer
    // than original_seq_len.
    a.max_seq_len = run_max_seq_len(cfg);
    configure_moe(a.moe, cfg, device, a.dim, a.moe_inter_dim);
    m = std::make_unique<DeepSeekV3>(a, device);
  } else if (cfg.model.name == "qwen3") {
    Qwen3Args a = qwen3_flavor(cfg.model.flavor);
    a.n_layers = depth(a.n_layers);
    // torchtitan's update_from_config: the RoPE table covers the run's sequences.
    a.max_seq_len = run_max_seq_len(cfg);
    if (a.moe_enabled) configure_moe(a.moe, cfg, device, a.dim, a.moe_inter_dim);
    m = std::make_unique<Qwen3>(a, device);
  } else if (cfg.model.name == "gpt_oss") {
    GptOssArgs a = gpt_oss_flavor(cfg.model.flavor);
    a.n_layers = depth(a.n_layers);
    check_gpt_oss_layout(cfg);
    // torchtitan's update_from_config: the RoPE table covers the run's sequences.
    a.max_seq_len = run_max_seq_len(cfg);
    configure_moe(a.moe, cfg, device, a.dim, a.moe_inter_dim);
    m = std::make_unique<GptOss>(a, device);
  } else {
    throw UserError("model.name = \"" + cfg.model.name +
                    "\" is not a model; allowed: llama3, llama4, deepseek_v3, qwen3, gpt_oss");
  }
  if (auto* moe = dynamic_cast<MoETransformer*>(m.get())) check_float8_grouped_fqns(cfg, *moe);
  if (!defer_params) m->init_weights(static_cast<uint64_t>(cfg.debug.seed));
  return m;
}

}  // namespace titan
