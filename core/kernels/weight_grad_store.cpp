#include "core/kernels/weight_grad_store.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <unordered_map>
#include <utility>

namespace titan {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Process-wide, not thread-local: on CUDA the autograd engine runs backward nodes on its
// device thread, not on the thread that called backward. One backward runs at a time.
std::atomic<WeightGradStore*> g_store{nullptr};
thread_local bool g_split_forward = false;

// y = x w^T. Its backward is autograd's for at::linear without bias (x folded to 2-D, one
// mm each), so a fused backward gives the same bits as at::linear's; under a deferring
// store grad_w's GEMM waits for W with grad_out (M, O) and x (M, D) stashed.
struct DeferrableLinear : public torch::autograd::Function<DeferrableLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    return at::linear(x, w);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1];
    const at::Tensor g = grad_out[0].reshape({-1, w.size(0)});  // (M, O)
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = g.mm(w).view(x.sizes());
    if (ctx->needs_input_grad(1)) {
      const at::Tensor x2 = x.reshape({-1, x.size(-1)});  // (M, D)
      if (WeightGradStore* store = weight_grad_deferral())
        store->add(w, [g, x2] { return g.t().mm(x2); });
      else
        dw = g.t().mm(x2);
    }
    return {dx, dw};
  }
};

}  // namespace

void WeightGradStore::add(const at::Tensor& weight, std::function<at::Tensor()> grad) {
  weights_.push_back(weight);
  grads_.push_back(std::move(grad));
}

void WeightGradStore::flush() {
  std::vector<at::Tensor> roots, sums;
  std::unordered_map<const c10::TensorImpl*, size_t> slot;
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < weights_.size(); ++i) {
      at::Tensor g = grads_[i]();
      auto [it, fresh] = slot.emplace(weights_[i].unsafeGetTensorImpl(), roots.size());
      if (fresh) {
        roots.push_back(weights_[i]);
        sums.push_back(std::move(g));
      } else {
        sums[it->second].add_(g);
      }
    }
  }
  std::vector<std::function<void()>> after = std::move(after_);
  clear();  // the stash goes before the backward allocates
  if (!roots.empty()) torch::autograd::backward(roots, sums);
  for (auto& fn : after) fn();
}

void WeightGradStore::clear() {
  weights_.clear();
  grads_.clear();
  after_.clear();
}

std::vector<std::pair<at::Tensor, std::function<at::Tensor()>>> WeightGradStore::take_from(
    size_t first) {
  std::vector<std::pair<at::Tensor, std::function<at::Tensor()>>> out;
  for (size_t i = first; i < weights_.size(); ++i)
    out.emplace_back(std::move(weights_[i]), std::move(grads_[i]));
  weights_.resize(std::min(first, weights_.size()));
  grads_.resize(weights_.size());
  return out;
}

void WeightGradStore::after_flush(std::function<void()> fn) {
  after_.push_back(std::move(fn));
}

DeferWeightGrads::DeferWeightGrads(WeightGradStore* store) : prev_(g_store.load()) {
  g_store = store;
}
DeferWeightGrads::~DeferWeightGrads() {
  g_store = prev_;
}

NoWeightGradDeferral::NoWeightGradDeferral() : prev_(g_store.load()) {
  g_store = nullptr;
}
NoWeightGradDeferral::~NoWeightGradDeferral() {
  g_store = prev_;
}

WeightGradStore* weight_grad_deferral() {
  return g_store;
}

SplitBackwardForward::SplitBackwardForward(bool on) : prev_(g_split_forward) {
  g_split_forward = on;
}
SplitBackwardForward::~SplitBackwardForward() {
  g_split_forward = prev_;
}

bool split_backward_forward() {
  return g_split_forward;
}

at::Tensor deferrable_linear(const at::Tensor& x, const at::Tensor& w) {
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || w.requires_grad()) || x.is_meta())
    return at::linear(x, w);
  return DeferrableLinear::apply(x, w);
}

}  // namespace titan
