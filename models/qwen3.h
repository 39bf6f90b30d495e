// Qwen3 (dense and MoE): Llama-style pre-norm blocks with a head_dim independent of dim, a
// per-head RMSNorm on q and k before RoPE (QK-norm), RoPE in the rotate-half layout (x[i] with
// x[i + hd/2], Hugging Face's and torchtitan's qwen3 convention, unlike Llama's adjacent pairs),
// tied embeddings in the small flavors, and in the MoE flavors a MoE layer in every block
// (softmax routing, top-k renormalized, no shared expert, scores applied after the experts).
#pragma once

#include <string>
#include <vector>

#include "models/layers.h"
#include "models/moe_model.h"

namespace titan {

// torchtitan 0.2.2's Qwen3ModelArgs; the defaults are its dataclass defaults.
struct Qwen3Args {
  int64_t dim = 1024;
  int64_t n_layers = 28;
  int64_t n_heads = 16;
  int64_t n_kv_heads = 8;
  int64_t vocab_size = 151936;
  int64_t head_dim = 128;     // independent of dim / n_heads
  int64_t hidden_dim = 3072;  // the dense feed-forward's hidden size
  double norm_eps = 1e-6;
  double rope_theta = 1000000;
  bool qk_norm = true;
  int64_t max_seq_len = 4096;  // the flavor's; build_model sets the run's sequence length
  bool depth_init = true;
  bool tie_embeddings = false;  // torchtitan's enable_weight_tying
  bool moe_enabled = false;     // every block's feed-forward is a MoE layer
  int64_t moe_inter_dim = 768;  // each routed expert's hidden size
  MoEArgs moe;
};

Qwen3Args qwen3_flavor(const std::string& flavor);  // throws UserError
std::vector<std::string> qwen3_flavor_names();

// Rotate-half RoPE: for x (B, T, H, D) and tables (>= T, D/2), rows 0..T-1 are used;
// out[..., i] = x[i] cos - x[i + D/2] sin, out[..., i + D/2] = x[i + D/2] cos + x[i] sin.
// Math in fp32, returned in x's dtype.
at::Tensor apply_rope_half(const at::Tensor& x, const RopeTables& rope);

class Qwen3 : public MoETransformer {
 public:
  Qwen3(const Qwen3Args& args, at::Device device);  // throws UserError for bad args
  const ModelInfo& info() const override { return info_; }
  const Qwen3Args& args() const { return args_; }

 protected:
  at::Tensor forward_embed(const at::Tensor& tokens) override;
  Head forward_final(const at::Tensor& h) override;

 private:
  at::Tensor block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w);
  at::Tensor attention(const at::Tensor& h, const std::vector<at::Tensor>& w) const;
  void declare_tp_plan();

  Qwen3Args args_;
  ModelInfo info_;
  RopeTables rope_;
  int64_t tok_emb_ = -1, norm_ = -1, output_ = -1;
  at::Tensor tied_emb_;  // tied output: the embedding's compute form, from embed to head
  // Per block: attention_norm, wq, wk, wv, wo, ffn_norm, [q_norm, k_norm,] then the dense
  // feed-forward's w1, w2, w3 or the MoE layer's weights (from index ffn_at_).
  std::vector<std::vector<int64_t>> layers_;
  size_t ffn_at_ = 6;
};

}  // namespace titan
