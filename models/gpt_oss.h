// GPT-OSS (torchtitan 0.2.2's gpt_oss): pre-norm blocks whose attention has biases on q, k, v
// and o, a learned per-head sink logit in the softmax denominator, grouped-query heads of
// head_dim 64 and a sliding window of 128 keys on the even layers (full causal attention on
// the odd ones), YaRN / NTK-by-parts RoPE in the rotate-half layout with its mscale on cos and
// sin, and a MoE layer in every block: a router with a bias (softmax, top-k renormalized, no
// shared expert, scores applied after the experts) over experts with biases and the clamped
// SwiGLU (moe/experts.h ExpertsExtras). The output is untied.
#pragma once

#include <string>
#include <vector>

#include "core/train/documents.h"
#include "models/layers.h"
#include "models/moe_model.h"

namespace titan {

// torchtitan 0.2.2's GptOssModelArgs; the defaults are its dataclass defaults (the 20b and
// 120b flavors only change n_layers and the MoE arguments).
struct GptOssArgs {
  int64_t max_seq_len = 131072;  // the flavor's; build_model sets the run's sequence length
  int64_t vocab_size = 201088;
  int64_t dim = 2880;
  int64_t moe_inter_dim = 2880;
  int64_t n_layers = 24;
  double norm_eps = 1e-5;
  double swiglu_limit = 7.0;
  double swiglu_alpha = 1.702;  // torchtitan's swiglu() default, not a model arg there
  int64_t head_dim = 64;
  int64_t n_heads = 64;
  int64_t n_kv_heads = 8;
  int64_t sliding_window_size = 128;  // keys per query (itself included) on the even layers
  AttnMask attn_mask = AttnMask::Causal;
  AttnType attn_type = AttnType::Flex;
  // YaRN: NTK-by-parts between the rotations of ntk_beta and ntk_alpha turns per
  // original_seq_len, frequencies divided by rope_factor below, mscale 0.1 ln(factor) + 1.
  int64_t original_seq_len = 4096;
  double rope_theta = 150000.0;
  double rope_factor = 32;
  double ntk_alpha = 1.0;
  double ntk_beta = 32.0;
  MoEArgs moe;
};

GptOssArgs gpt_oss_flavor(const std::string& flavor);  // throws UserError
std::vector<std::string> gpt_oss_flavor_names();

// torchtitan's precompute_rope_cache as tables (max_seq_len, head_dim / 2) fp32, mscale
// included: throws UserError when the NTK-by-parts range is empty (0 < low < high < hd/2 - 1
// fails).
RopeTables gpt_oss_rope_tables(const GptOssArgs& a, at::Device device);

// Attention with a sink: softmax over [q k^T * scale, sink[h]] per query row, the sink's
// column dropped before the values. q (B, T, H, D), k and v (B, T, Hkv, D), sinks (H) ->
// (B, T, H * D). window > 0: a query attends only keys i - j < window; docs (block-causal):
// only keys of its document. One masked softmax in fp32 over (B, H, T, T + 1): static shapes,
// no host read (the CPU path, and for now the CUDA one). q_first > 0 (generation with a KV
// cache, no docs): the queries sit at positions q_first.., and k, v hold q_first + T positions.
at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& sinks, double scale, int64_t window,
                          const Documents* docs, int64_t q_first = 0);

class GptOss : public MoETransformer {
 public:
  GptOss(const GptOssArgs& args, at::Device device);  // throws UserError for bad args
  const ModelInfo& info() const override { return info_; }
  const GptOssArgs& args() const { return args_; }
  // torchtitan's TransformerBlock.use_sliding_attention: layer_id % 2 == 0.
  static bool sliding(int64_t layer) { return layer % 2 == 0; }

 protected:
  at::Tensor forward_embed(const at::Tensor& tokens) override;
  Head forward_final(const at::Tensor& h) override;

 private:
  at::Tensor block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w);
  at::Tensor attention(int64_t layer, const at::Tensor& h, const std::vector<at::Tensor>& w) const;
  void declare_tp_plan();

  GptOssArgs args_;
  ModelInfo info_;
  RopeTables rope_;
  int64_t tok_emb_ = -1, norm_ = -1, output_ = -1;
  // Per block (kAt* below), then the MoE layer's weights from kMoE.
  std::vector<std::vector<int64_t>> layers_;
};

}  // namespace titan
