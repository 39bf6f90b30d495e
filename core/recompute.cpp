#include "core/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace titan {

namespace {

thread_local int g_recompute_depth = 0;

struct CheckpointBlock : public torch::autograd::Function<CheckpointBlock> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                int64_t fn_ptr, const at::Tensor& x,
                                                at::TensorList weights) {
    ctx->saved_data["fn"] = fn_ptr;
    std::vector<at::Tensor> to_save{x};
    to_save.insert(to_save.end(), weights.begin(), weights.end());
    ctx->save_for_backward(to_save);
    const auto& fn = *reinterpret_cast<const BlockFn*>(fn_ptr);
    at::NoGradGuard no_grad;
    return {fn(x, weights.vec())};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto& fn = *reinterpret_cast<const BlockFn*>(ctx->saved_data["fn"].toInt());
    auto saved = ctx->get_saved_variables();
    // Recompute on detached inputs with grad enabled, then differentiate the local graph.
    std::vector<at::Tensor> inputs;
    for (auto& s : saved) inputs.push_back(s.detach().requires_grad_(s.requires_grad()));
    at::Tensor x = inputs[0];
    std::vector<at::Tensor> w(inputs.begin() + 1, inputs.end());
    at::Tensor y;
    {
      at::AutoGradMode grad(true);
      ++g_recompute_depth;
      try {
        y = fn(x, w);
      } catch (...) {
        --g_recompute_depth;
        throw;
      }
      --g_recompute_depth;
    }
    std::vector<at::Tensor> need;
    std::vector<size_t> where;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].requires_grad()) need.push_back(inputs[i]), where.push_back(i);
    auto grads = torch::autograd::grad({y}, need, {grad_out[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    torch::autograd::variable_list out(inputs.size() + 1);  // [fn_ptr, x, w...]
    for (size_t j = 0; j < where.size(); ++j) out[where[j] + 1] = grads[j];
    return out;
  }
};

}  // namespace

at::Tensor checkpoint_block(const BlockFn& fn, const at::Tensor& x,
                            const std::vector<at::Tensor>& weights) {
  if (!at::GradMode::is_enabled()) return fn(x, weights);
  return CheckpointBlock::apply(reinterpret_cast<int64_t>(&fn), x, at::TensorList(weights))[0];
}

bool is_recomputing() {
  return g_recompute_depth > 0;
}

}  // namespace titan
