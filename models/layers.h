// Building blocks shared by the model families: RMSNorm, RoPE, causal attention, SwiGLU,
// initializers and block recomputation for activation checkpointing.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace titan {

// x: (..., D), w: (D). Computed in fp32, returned in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

struct RopeScaling {
  double factor = 1.0;  // 1: no scaling. Llama-3.1 uses 8, Llama-3.2 uses 32.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_seq_len = 8192;
};

// Rotary embedding table e^(i * t * freq): (max_seq_len, head_dim / 2), complex64.
struct RopeTables {
  at::Tensor cis;
};
RopeTables rope_tables(int64_t head_dim, int64_t max_seq_len, double theta,
                       const RopeScaling& scaling, at::Device device);

// Rotates adjacent pairs (x[2i], x[2i+1]) of the last dim, as torchtitan's complex form does.
// x: (B, T, H, D); tables are sliced to T. Computed in fp32, returned in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

// Causal self-attention core. q: (B, T, H, Dqk), k: (B, T, Hkv, Dqk), v: (B, T, Hkv, Dv) ->
// (B, T, H * Dv). Hkv divides H (grouped-query attention).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale);

// w2(silu(x w1^T) * (x w3^T)). x: (..., D); w1, w3: (F, D); w2: (D, F).
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3);

// In-place truncated normal on a CPU fp32 tensor: N(mean, std) clipped to [a, b] by
// inverse-CDF sampling from `gen`.
void trunc_normal_(at::Tensor& t, double mean, double std, double a, double b, at::Generator& gen);

// Activation checkpointing: runs fn(x, weights) without saving activations and recomputes
// it in backward. `fn` must outlive the backward pass (blocks keep theirs in the model).
// While a block is being recomputed, is_recomputing() is true, so side effects such as MoE
// token counting happen once per forward, not twice.
using BlockFn = std::function<at::Tensor(const at::Tensor& x, const std::vector<at::Tensor>& w)>;
at::Tensor checkpoint_block(const BlockFn& fn, const at::Tensor& x,
                            const std::vector<at::Tensor>& weights);
bool is_recomputing();

}  // namespace titan
