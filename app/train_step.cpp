#include "app/train_step.h"

#include <ATen/record_function.h>

#include <algorithm>

#include "core/train/capture_check.h"
#include "core/train/functional.h"

namespace titan {

const std::vector<MicroBatch>& StepInputs::stage(const std::vector<MicroBatch>& fresh) {
  const bool same = bufs_.size() == fresh.size() &&
                    std::equal(fresh.begin(), fresh.end(), bufs_.begin(), [](auto& a, auto& b) {
                      return a.tokens.sizes() == b.tokens.sizes() &&
                             a.labels.sizes() == b.labels.sizes() &&
                             a.tokens.device() == b.tokens.device();
                    });
  if (!same) {  // the first step (or a new batch shape): allocate once
    bufs_.clear();
    for (auto& mb : fresh)
      bufs_.push_back({at::empty_like(mb.tokens, at::MemoryFormat::Contiguous),
                       at::empty_like(mb.labels, at::MemoryFormat::Contiguous)});
    ++allocations_;
  }
  for (size_t i = 0; i < fresh.size(); ++i) {
    // Asynchronous on CUDA (the loader's copies are on the same stream).
    bufs_[i].tokens.copy_(fresh[i].tokens, /*non_blocking=*/true);
    bufs_[i].labels.copy_(fresh[i].labels, /*non_blocking=*/true);
  }
  return bufs_;
}

void plant_host_read(const at::Tensor& loss) {
  ModuleScope scope("output");
  (void)loss.item<double>();
}

at::Tensor PlainStepPhases::forward_backward(const std::vector<MicroBatch>& micro) {
  RECORD_USER_SCOPE("titan::forward_backward");  // named spans in profiler traces
  // The auxiliary loss of a micro-batch is a mean over its sequences; the step's is the
  // mean over all sequences of every rank, and the ranks' gradients are summed.
  const double aux_div =
      static_cast<double>(micro.size()) * static_cast<double>(objective_.dp_degree);
  at::Tensor total;
  for (size_t k = 0; k < micro.size(); ++k) {
    const MicroBatch& mb = micro[k];
    if (sync_) sync_->begin_micro_batch(k + 1 == micro.size());
    // Fused, chunked output projection + loss: the (B, T, V) logits never exist.
    at::Tensor loss = model_.token_loss_sum(mb.tokens, mb.labels) / objective_.global_tokens;
    if (hooks_.plant_host_read) plant_host_read(loss);
    at::Tensor aux = model_.aux_loss();
    at::Tensor objective = aux.defined() ? loss + aux / aux_div : loss;
    objective.backward();
    total = total.defined() ? total + loss.detach() : loss.detach();
  }
  return total;
}

void StepPhases::reduce_gradients() {
  if (!sync_) return;
  RECORD_USER_SCOPE("titan::reduce_gradients");
  sync_->reduce_gradients(stepped_params());
}

at::Tensor StepPhases::optimizer() {
  RECORD_USER_SCOPE("titan::optimizer");
  const std::vector<at::Tensor> params = stepped_params();
  at::Tensor norm_sq = grad_norm_sq(params);
  // After a gradient all-reduce every replica holds the same full gradient, so the local
  // norm already is the global one under pure replication; GradSync sums the shards' shares
  // under sharded layouts, and a pipeline adds its other stages'.
  if (sync_) sync_->reduce_norm_sq(norm_sq);
  reduce_norm_sq_beyond_sync(norm_sq);
  at::Tensor norm = at::sqrt(norm_sq);
  clip_grad_norm(params, objective_.max_norm, norm);
  opt_.step();               // reads the lr written by set_lr before the step
  model_.weights_updated();  // the fused kernel bumps no version counter (model.h)
  opt_.zero_grad();
  model_.after_optimizer_step();
  if (sync_) sync_->after_optimizer_step();
  return norm;
}

StepResult run_step(StepPhases& phases, const std::vector<MicroBatch>& micro, const StepDrivers& d,
                    StepExecutor& ex) {
  auto mark = [&d](PhaseTimer::Phase p) {
    if (d.timer) d.timer->mark(p);
  };
  phases.opt().set_lr(d.lr);
  mark(PhaseTimer::kStart);
  StepResult r;
  r.loss = ex.forward_backward([&] {
    at::Tensor loss = phases.forward_backward(micro);
    phases.reduce_gradients();
    if (d.ep) d.ep->reduce_overflow();  // the flag's all-reduce ends the first graph
    return loss;
  });
  if (d.ep) ex.between([&] { r.loss = d.ep->settle(phases, micro, r.loss); });
  mark(PhaseTimer::kForwardBackwardDone);
  r.grad_norm = ex.optimizer([&] { return phases.optimizer(); });
  mark(PhaseTimer::kOptimizerDone);
  return r;
}

StepResult run_step(StepPhases& phases, const std::vector<MicroBatch>& micro,
                    const StepDrivers& d) {
  StepExecutor eager;
  return run_step(phases, micro, d, eager);
}

StepResult train_step(Model& model, Optimizer& opt, const std::vector<MicroBatch>& micro,
                      const StepObjective& objective, const StepDrivers& d, GradSync* sync,
                      const StepTestHooks& hooks) {
  PlainStepPhases phases(model, opt, sync, objective, hooks);
  return run_step(phases, micro, d);
}

// torchtitan's per_op_sac_force_recompute_mm_shapes_by_fqns: the GEMMs whose weight has the
// shape of a parameter named "<fqn>.weight" (in any block) are recomputed, not saved.
static OpCheckpointPolicy op_checkpoint_policy(const Model& model,
                                               const ActivationCheckpointSection& ac) {
  OpCheckpointPolicy p;
  for (const auto& prm : model.params().all())
    for (const auto& fqn : ac.per_op_sac_force_recompute_mm_shapes_by_fqns) {
      if (prm.name.find(fqn + ".weight") == std::string::npos) continue;
      std::vector<int64_t> shape = prm.sharded() ? prm.global_shape : prm.value.sizes().vec();
      if (shape.size() == 2) p.force_recompute_shapes.push_back(shape);
    }
  return p;
}

std::string apply_activation_checkpointing(Model& model, const ActivationCheckpointSection& ac) {
  if (ac.mode == "full") {
    model.set_recompute_policy([](int64_t) { return true; });
    return "full";
  }
  if (ac.mode != "selective") return "none";
  if (ac.selective_ac_option == "op") {
    model.set_op_checkpointing(op_checkpoint_policy(model, ac));
    return "op";
  }
  const int64_t every = std::stoll(ac.selective_ac_option);
  model.set_recompute_policy([every](int64_t l) { return (l + 1) % every == 0; });
  return "every " + std::to_string(every);
}

}  // namespace titan
