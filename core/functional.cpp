#include "core/functional.h"

namespace titan {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  // ATen's kernel upcasts internally; one op instead of five keeps the autograd graph small.
  return at::rms_norm(x, {x.size(-1)}, w.to(x.scalar_type()), eps);
}

at::Tensor swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                  const at::Tensor& w3) {
  return at::linear(at::silu(at::linear(x, w1)) * at::linear(x, w3), w2);
}

at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(at::kFloat), labels.reshape({-1}), {},
                                at::Reduction::Sum);
}

}  // namespace titan
