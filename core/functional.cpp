#include "core/functional.h"

#include "core/ops.h"

namespace titan {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  // One fused autograd node (core/ops.h): fp32 math, saves only x, w and the inverse RMS.
  return ops::rms_norm(x, w, eps);
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3) {
  // silu(a) * b as one node: silu(a) is neither stored for backward nor materialized twice.
  return at::linear(ops::swiglu_act(at::linear(x, w1), at::linear(x, w3)), w2);
}

at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(at::kFloat), labels.reshape({-1}), {},
                                at::Reduction::Sum);
}

}  // namespace titan
