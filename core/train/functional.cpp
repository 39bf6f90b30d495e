#include "core/train/functional.h"

#include <torch/csrc/autograd/custom_function.h>

#include "core/kernels/ops.h"
#include "core/kernels/weight_grad_store.h"
#include "core/train/float8_linears.h"
#include "core/train/recompute.h"

namespace titan {
namespace {

// Shapes only, for the meta device (titan-train estimate): SDPA's meta kernel would pick the
// math backend and hold the (T, T) scores, which no flash kernel does. This node holds what
// the CPU and CUDA flash kernels save for backward: q, k, v, the output and the fp32
// log-sum-exp per query and head, and gives empty gradients of the right shapes.
struct MetaFlashAttention : torch::autograd::Function<MetaFlashAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v) {
    std::vector<int64_t> shape = q.sizes().vec();
    shape.back() = v.size(-1);
    at::Tensor out = at::empty(shape, q.options());
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    ctx->save_for_backward({q, k, v, out, lse});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    auto s = ctx->get_saved_variables();
    return {at::empty_like(s[0]), at::empty_like(s[1]), at::empty_like(s[2])};
  }
};

}  // namespace

at::Tensor project(const at::Tensor& x, const at::Tensor& w) {
  // A weight marked by Model::weight() for float8 (core/train/float8_linears.h). Op-level
  // checkpointing is refused with float8 (validate_config), so the tape never sees one.
  if (std::optional<Float8Weight> f8 = float8_weight_of(w))
    return float8::float8_linear(x, w, at::Tensor(), f8->opts,
                                 f8->pre.data.defined() ? &f8->pre : nullptr, f8->tp);
  if (op_tape_active()) return tape_project(x, w);
  // A zero-bubble schedule's stage forward, or a block recomputed in its I: a backward that
  // can leave grad_w for the W (core/kernels/weight_grad_store.h).
  return split_backward_forward() || weight_grad_deferral() ? deferrable_linear(x, w)
                                                            : at::linear(x, w);
}

at::Tensor causal_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale, bool enable_gqa) {
  if (op_tape_active()) return tape_causal_sdpa(q, k, v, scale, enable_gqa);
  if (q.is_meta()) return MetaFlashAttention::apply(q, k, v);
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, scale, enable_gqa);
}

at::Tensor masked_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& mask, double scale, bool enable_gqa) {
  if (q.is_meta()) return MetaFlashAttention::apply(q, k, v);
  return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, /*is_causal=*/false,
                                          scale, enable_gqa);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  // One fused autograd node (core/kernels/ops.h): fp32 math, saves only x, w and the inverse RMS.
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
