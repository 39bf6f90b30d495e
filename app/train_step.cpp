#include "app/train_step.h"

#include <chrono>

#include "core/functional.h"

namespace titan {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

}  // namespace

StepResult train_step(Model& model, AdamW& opt, const std::vector<MicroBatch>& micro,
                      const StepOptions& o, GradSync* grad_sync) {
  const auto t0 = Clock::now();
  // The auxiliary loss of a micro-batch is a mean over its sequences; the step's is the
  // mean over all sequences of every rank, and the ranks' gradients are summed.
  const double aux_div = static_cast<double>(micro.size()) * static_cast<double>(o.dp_degree);
  at::Tensor total;
  for (const auto& mb : micro) {
    // Fused, chunked output projection + loss: the (B, T, V) logits never exist.
    at::Tensor loss = model.token_loss_sum(mb.tokens, mb.labels) / o.global_tokens;
    at::Tensor aux = model.aux_loss();
    at::Tensor objective = aux.defined() ? loss + aux / aux_div : loss;
    objective.backward();
    total = total.defined() ? total + loss.detach() : loss.detach();
  }
  const bool sync = o.time_phases && !total.is_cpu();
  if (sync) (void)total.cpu();  // named sync: phase timing on log steps only
  StepResult r;
  r.fwdbwd_ms = ms_since(t0);
  const auto t1 = Clock::now();
  auto params = model.params().tensors();
  if (grad_sync) grad_sync->reduce_gradients(params);
  at::Tensor norm_sq = grad_norm_sq(params);
  // After the gradient all-reduce every rank holds the same full gradient, so the local norm
  // already is the global one under pure replication; the hook exists for sharded layouts.
  if (grad_sync) grad_sync->reduce_norm_sq(norm_sq);
  at::Tensor norm = at::sqrt(norm_sq);
  clip_grad_norm(params, o.max_norm, norm);
  opt.step(o.lr);
  opt.zero_grad();
  model.after_optimizer_step();
  if (sync) (void)norm.cpu();
  r.opt_ms = ms_since(t1);
  r.loss = total;
  r.grad_norm = norm;
  return r;
}

}  // namespace titan
