// Hugging Face weight import/export: maps between our parameter names and layouts
// (torchtitan's) and the ones transformers uses for a model family, and reads/writes the HF
// folder layout (sharded safetensors + model.safetensors.index.json + config.json).
//
// A family is described by a list of HfTensorMap entries, one per tensor of ours; the generic
// export_hf/import_hf helpers (hf_interop.cpp) do the folder handling, so a family's functions
// (hf_llama3.cpp, hf_deepseek_v3.cpp) only build the map and its config.json.
#pragma once

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/deepseek_v3.h"
#include "models/gpt_oss.h"
#include "models/llama3.h"
#include "models/qwen3.h"
#include "core/train/model.h"

namespace titan {

enum class HfTransform {
  kNone,
  // Meta/torchtitan RoPE rotates adjacent pairs (x[2i], x[2i+1]) of a head; HF Llama rotates
  // halves (x[i], x[i + d/2]). The q/k projection rows are permuted per head on export (and
  // back on import) so both compute the same attention scores.
  kRopePermute,
  // Our tensor stacks experts on dim 0 ([E, ...]); HF stores one tensor per expert.
  kSplitExperts,
};

struct HfTensorMap {
  std::string ours;             // our name, e.g. "layers.0.attention.wq.weight"
  std::vector<std::string> hf;  // one HF name; kSplitExperts: one per expert, in expert order
  HfTransform transform = HfTransform::kNone;
  int64_t rope_heads = 0;  // kRopePermute: heads in the projection (n_heads or n_kv_heads)
  // Written as float32 whatever the export dtype: state that transformers itself keeps in fp32
  // and that rounding would change the meaning of (DeepSeek's e_score_correction_bias).
  bool keep_fp32 = false;
};

struct HfExportOptions {
  at::ScalarType dtype = at::kFloat;    // float32, bfloat16 or float16
  int64_t max_shard_bytes = 2LL << 30;  // a shard holds at least one tensor, whatever its size
};

// Checks that no name of ours and no HF name appears twice, and that each entry's shape of
// HF names fits its transform. Programming errors: c10::Error.
void validate_hf_map(const std::vector<HfTensorMap>& map);

// Our tensor -> its HF tensors (same dtype and device), in map.hf order.
std::vector<at::Tensor> to_hf_layout(const HfTensorMap& m, const at::Tensor& ours);
// The HF tensors of one entry -> our layout (the inverse of to_hf_layout).
at::Tensor from_hf_layout(const HfTensorMap& m, const std::vector<at::Tensor>& hf);

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes `tensors` (every one must have a map entry, and every map entry a tensor) under
// their HF names into `dir`: model-0000K-of-0000N.safetensors shards,
// model.safetensors.index.json and `config` as config.json. Atomic: everything is written to
// `dir`.tmp-<pid>, then renamed to `dir`. A non-empty existing `dir` is a UserError.
void export_hf(const NamedTensors& tensors, const std::vector<HfTensorMap>& map,
               const nlohmann::ordered_json& config, const std::string& dir,
               const HfExportOptions& opts);
void export_hf(const ParamStore& params, const std::vector<HfTensorMap>& map,
               const nlohmann::ordered_json& config, const std::string& dir,
               const HfExportOptions& opts);

// HF tensor names an import skips on purpose (true: skip), e.g. modules we do not train.
using HfSkip = std::function<bool(const std::string& hf_name)>;

// One tensor of ours an import fills: `dst` holds global rows [row_offset, row_offset +
// dst.size(0)) of a tensor of `full_shape` (all of it when unsharded; a rank's valid rows
// of an FSDP shard otherwise, see Param in core/train/model.h).
struct HfImportTarget {
  std::string name;
  at::Tensor dst;
  std::vector<int64_t> full_shape;
  int64_t row_offset = 0;
};
using HfImportTargets = std::vector<HfImportTarget>;

// Whole tensors (row_offset 0, full_shape = their shape).
HfImportTargets hf_targets(const NamedTensors& tensors);
// Every parameter's valid rows (p.valid(p.value)) at its dim0_offset, with full_shape(). A
// parameter left on the meta device (another pipeline stage's) is checked against the folder
// by import_hf but not read.
HfImportTargets hf_targets(const ParamStore& params);

// What an import read: the bytes of tensor data it read from the files (only the rows its
// targets hold) and the bytes of every mapped HF tensor in the folder (the whole model).
struct HfImportStats {
  int64_t bytes_read = 0;
  int64_t bytes_total = 0;
  // "read X of Y MiB of Hugging Face tensor data"
  std::string describe() const;
};

// Reads the HF folder `dir` (model.safetensors.index.json + shards, or one model.safetensors)
// into the targets (copy_ into the live tensors, converting dtype and device). Every mapped HF
// tensor must be present with the right (whole) shape and a floating dtype, and no other
// tensor may be present (rotary inv_freq buffers and names `skip` accepts aside); everything
// is checked before any tensor is modified. A float8 e4m3 tensor (DeepSeek-V3's release) needs
// its `<name>_scale_inv` block scales and is dequantized on load (models/hf_fp8.h). Violations are
// UserErrors naming the HF tensor, its file, found and expected.
//
// Only the HF rows a target needs are read and converted: for its rows [o, o + n), rows
// [o, o + n) of the HF tensor (kNone), the HF rows they come from (kRopePermute; read as the
// contiguous runs they form, at most two per head), or the HF tensors of experts [o, o + n)
// (kSplitExperts). A sharded model therefore reads about 1/shards of the folder per rank.
HfImportStats import_hf(const HfImportTargets& targets, const std::vector<HfTensorMap>& map,
                        const std::string& dir, const HfSkip& skip = {});
HfImportStats import_hf(const NamedTensors& tensors, const std::vector<HfTensorMap>& map,
                        const std::string& dir, const HfSkip& skip = {});
HfImportStats import_hf(ParamStore& params, const std::vector<HfTensorMap>& map,
                        const std::string& dir);

// ---- Llama-3 ----------------------------------------------------------------------------------

std::vector<HfTensorMap> llama3_hf_map(const Llama3Args& args);
// transformers' LlamaConfig for `args`; `dtype` becomes torch_dtype.
nlohmann::ordered_json llama3_hf_config(const Llama3Args& args, at::ScalarType dtype);
void export_llama3_hf(const Llama3& model, const std::string& dir, const HfExportOptions& opts);
HfImportStats import_llama3_hf(Llama3& model, const std::string& dir);
// The Llama-3 architecture a Hugging Face folder's config.json describes (LlamaForCausalLM of
// any size: hidden_size, layers, heads, KV heads, intermediate_size, vocab_size, RoPE theta and
// llama3 scaling, tied embeddings). model.flavor = "hf:DIR" and convert-hf --flavor hf use it.
// UserError for what the model cannot express (a head_dim other than hidden / heads, biases).
Llama3Args llama3_args_from_hf_config(const std::string& dir);
// The built-in flavor with `a`'s dimensions, or "" (a custom one).
std::string llama3_matching_flavor(const Llama3Args& a);
// "dim 2048, 16 layers, 32 heads (8 KV), ffn 8192, vocab 128256": for the log.
std::string describe_llama3_args(const Llama3Args& a);

// ---- DeepSeek-V3 --------------------------------------------------------------------------------

struct DeepSeekV3HfLayout {
  int64_t n_layers = 0;
  int64_t n_dense_layers = 0;  // layers [0, n_dense_layers) use a dense feed-forward, then MoE
  int64_t n_experts = 0;
  bool q_lora = false;          // q_lora_rank > 0: wq_a, q_norm, wq_b instead of wq
  bool shared_experts = true;   // n_shared_experts > 0
  bool expert_bias = true;      // load-balancing bias buffer (HF e_score_correction_bias)
  bool tie_embeddings = false;  // no output.weight / lm_head.weight
};

// torchtitan's deepseek_v3 names <-> transformers' DeepseekV3ForCausalLM names. Experts
// (layers.N.moe.experts.w1 [E, hidden, dim], w3 [E, hidden, dim], w2 [E, dim, hidden]) split
// into model.layers.N.mlp.experts.K.{gate,up,down}_proj.weight, the layout of DeepSeek's own
// checkpoints (transformers fuses them into gate_up_proj when it loads). The expert bias
// (layers.N.moe.expert_bias) is model.layers.N.mlp.gate.e_score_correction_bias, kept in fp32.
//
// No RoPE permutation of any weight: our MLA rotates adjacent pairs (x[2i], x[2i+1]) of the
// rope dims, as DeepSeek's reference code does. transformers' DeepseekV3Attention with
// rope_interleave = true (its default, and what config.json says) reads the rope dims of
// q_proj / q_b_proj and kv_a_proj_with_mqa in that same interleaved order
// (apply_rotary_pos_emb_interleave rotates (x[0::2], x[1::2]) pairwise and writes the results
// de-interleaved, as halves, to both q and k alike, which leaves q.k unchanged). The no-rope
// dims are never rotated, so nothing else moves either. test_hf_interop.cpp checks this against
// transformers' logits, and that rope_interleave = false gives clearly different ones.
std::vector<HfTensorMap> deepseek_v3_hf_map(const DeepSeekV3HfLayout& layout);
std::vector<HfTensorMap> deepseek_v3_hf_map(int64_t n_layers, int64_t n_dense_layers,
                                            int64_t n_experts, bool q_lora);
DeepSeekV3HfLayout deepseek_v3_hf_layout(const DeepSeekV3Args& args);
// transformers' DeepseekV3Config for `args` (config.json); `dtype` becomes torch_dtype. YaRN
// (rope_scaling) is written when args.max_seq_len > args.original_seq_len, as our model then
// uses it. Also writes DeepSeek's own scoring_func and topk_method keys, which transformers
// ignores (it always routes with sigmoid) but other runtimes read.
nlohmann::ordered_json deepseek_v3_hf_config(const DeepSeekV3Args& args, at::ScalarType dtype);
// The tensors the map covers, live: the parameters and every MoE layer's expert bias.
NamedTensors deepseek_v3_hf_tensors(const DeepSeekV3& model);
// The same as import targets: each parameter's valid rows (sharded or not) and the whole
// expert-bias buffers (never sharded).
HfImportTargets deepseek_v3_hf_targets(const DeepSeekV3& model);
// A softmax-routed model (the debugmodel, 16B and 236B flavors) exports fine, but transformers'
// DeepseekV3ForCausalLM routes with sigmoid whatever config.json says, so it computes another
// function of the same weights there: the export logs a warning.
void export_deepseek_v3_hf(const DeepSeekV3& model, const std::string& dir,
                           const HfExportOptions& opts);
// Also checks config.json's structural fields against the model (UserError) and warns about
// routing or RoPE settings that differ. Tensors of multi-token-prediction modules
// (model.layers.<n_layers and up>.*, in DeepSeek-V3's release) are skipped.
HfImportStats import_deepseek_v3_hf(DeepSeekV3& model, const std::string& dir);

// ---- Qwen3
// ---------------------------------------------------------------------------------------

// torchtitan's qwen3 names <-> transformers' Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM
// (MoE flavors) names; no permutation (both rotate halves), experts split one tensor per
// expert (models/hf_qwen3.cpp).
std::vector<HfTensorMap> qwen3_hf_map(const Qwen3Args& args);
nlohmann::ordered_json qwen3_hf_config(const Qwen3Args& args, at::ScalarType dtype);
// UserError for a MoE routing Qwen3MoeForCausalLM cannot express; warns when the expert-bias
// buffers (which transformers has no place for) are non-zero.
void export_qwen3_hf(const Qwen3& model, const std::string& dir, const HfExportOptions& opts);
// Also checks config.json's model_type ("qwen3" or "qwen3_moe", as the flavor) and structural
// fields against the model: a folder of another architecture is a UserError.
HfImportStats import_qwen3_hf(Qwen3& model, const std::string& dir);

// ---- GPT-OSS ---------------------------------------------------------------------------------

// torchtitan's gpt_oss names <-> transformers' GptOssForCausalLM names (models/hf_gpt_oss.cpp):
// one to one except the experts, whose fused gate_up_proj (E, dim, 2 hidden; gate on the even
// columns) and down_proj (E, hidden, dim) map to our w1, w3 and w2 (through the synthetic names
// <layer>.moe.experts.gate_up_proj, gate_up_proj_bias and down_proj).
std::vector<HfTensorMap> gpt_oss_hf_map(const GptOssArgs& args);
nlohmann::ordered_json gpt_oss_hf_config(const GptOssArgs& args, at::ScalarType dtype);
// Warns when the expert-bias buffers (which transformers has no place for) are non-zero.
void export_gpt_oss_hf(const GptOss& model, const std::string& dir, const HfExportOptions& opts);
// Checks config.json (model_type "gpt_oss", structural fields); a quantization_config (the
// release's MXFP4 experts) is a UserError: no dequantization yet.
HfImportStats import_gpt_oss_hf(GptOss& model, const std::string& dir);

// ---- Any model ---------------------------------------------------------------------------------

// model.name values with a Hugging Face mapping: llama3, deepseek_v3, qwen3, gpt_oss.
std::vector<std::string> hf_supported_models();
bool hf_supported(const Model& model);
// A UserError that starts with `what` and names model.name and the supported ones, unless
// hf_supported(model).
void require_hf_supported(const Model& model, const std::string& what);
// The live tensors a model's Hugging Face folder holds, under our names: the parameters, and
// for deepseek_v3 the expert-bias buffers too (what convert-hf reads and writes).
NamedTensors hf_tensors(const Model& model);
// Dispatch on the model family to export_llama3_hf / export_deepseek_v3_hf and the imports;
// other families are UserErrors (require_hf_supported). The import works on a sharded model
// too (after FSDP has cut the parameters): each rank reads only its own rows.
void export_model_hf(const Model& model, const std::string& dir, const HfExportOptions& opts);
HfImportStats import_model_hf(Model& model, const std::string& dir);

// "float32" | "bfloat16" | "float16" -> dtype; otherwise a UserError naming `what`.
at::ScalarType hf_export_dtype(const std::string& name, const std::string& what);

}  // namespace titan
