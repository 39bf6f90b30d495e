// Layers that both the dense models (models/) and the MoE layer (moe/) use, so they live
// below both (RMSNorm, the SwiGLU feed-forward), and the training loss.
#pragma once

#include <ATen/ATen.h>

namespace titan {

// x w^T: the GEMM of every linear layer without bias. x: (..., D); w: (O, D) -> (..., O).
// Models route their linear layers through this (not at::linear) so that op-level
// activation checkpointing (core/train/recompute.h) can save or replay the result, and so
// that a weight marked for float8 (core/train/float8_linears.h) runs its GEMMs in float8.
at::Tensor project(const at::Tensor& x, const at::Tensor& w);

// Causal scaled dot-product attention, as at::scaled_dot_product_attention with
// is_causal = true. q: (B, H, T, Dqk), k: (B, Hkv, T, Dqk), v: (B, Hkv, T, Dv) -> (B, H, T, Dv);
// Hkv < H (grouped-query attention) needs enable_gqa, which reads each kv head in place.
// Routed through here for op-level activation checkpointing, like project().
at::Tensor causal_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale, bool enable_gqa = false);

// Attention under an explicit mask (context parallel: a rank's queries against the gathered
// keys, mask (Tq, Tk) bool, true = attend). Not on the op-checkpointing tape: op-level
// checkpointing recomputes it. On the meta device (estimate) it holds what a flash kernel
// saves, as causal_sdpa.
at::Tensor masked_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& mask, double scale, bool enable_gqa = false);

// x: (..., D), w: (D). Computed in fp32, returned in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// w2(silu(x w1^T) * (x w3^T)). x: (..., D); w1, w3: (F, D); w2: (D, F).
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3);

// Sum over tokens of the cross-entropy, computed in fp32. logits: (B, T, V); labels: (B, T).
at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace titan
