#include "core/functional.h"

#include "core/ops.h"
#include "core/recompute.h"

namespace titan {

at::Tensor project(const at::Tensor& x, const at::Tensor& w) {
  return op_tape_active() ? tape_project(x, w) : at::linear(x, w);
}

at::Tensor causal_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale, bool enable_gqa) {
  if (op_tape_active()) return tape_causal_sdpa(q, k, v, scale, enable_gqa);
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, scale, enable_gqa);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  // One fused autograd node (core/ops.h): fp32 math, saves only x, w and the inverse RMS.
  return ops::rms_norm(x, w, eps);
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3) {
  // silu(a) * b as one node: silu(a) is neither stored for backward nor materialized twice.
  // The GEMMs go through project() so op-level checkpointing can save them.
  return project(ops::swiglu_act(project(x, w1), project(x, w3)), w2);
}

at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(at::kFloat), labels.reshape({-1}), {},
                                at::Reduction::Sum);
}

}  // namespace titan
