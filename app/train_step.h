// One training step for every executor: the plain step, the pipeline's, the captured
// step's warm-up, capture and replay, the re-run after an expert-parallel overflow, the
// exact-only steps and the CPU capture check (docs/design.md, "One step").
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

#include "app/ep_capacity.h"
#include "app/phase_timer.h"
#include "core/config/config.h"
#include "core/train/grad_sync.h"
#include "core/data/loader.h"
#include "core/train/model.h"
#include "core/train/optimizer.h"

namespace titan {

// What the phases compute with, fixed for a run: the objective's normalization and the
// clipping threshold.
struct StepObjective {
  double global_tokens = 1;  // label tokens of the whole step, over every rank and micro-batch
  int64_t dp_degree = 1;     // data-parallel ranks whose gradients GradSync sums
  double max_norm = 0;       // <= 0: measure the norm, do not clip
};

// Test seams inside the step (debug.* keys, docs/design.md "Test seams"). Product behaviour
// never depends on them.
struct StepTestHooks {
  // debug.plant_error = "host_read": read each micro-batch's loss on the host, the capture
  // break the CPU check must refuse (exit 2).
  bool plant_host_read = false;
};

// What drives one step from outside the phases, each its own thing: the step's lr, the phase
// timer and the expert-parallel capacity control.
struct StepDrivers {
  double lr = 0;
  PhaseTimer* timer = nullptr;  // marks the phase boundaries (never synchronizes); null: none
  // Expert parallelism: the static exchange's overflow check and re-run between the phases
  // (app/ep_capacity.h), and the exchange's metrics; null without expert parallelism.
  EpCapacityControl* ep = nullptr;
};

struct StepResult {
  at::Tensor loss;       // 0-d: this rank's summed token loss / global token count
  at::Tensor grad_norm;  // 0-d: global gradient norm before clipping
};

// The step's inputs in buffers allocated once and refilled with copy_ every step, so the
// step reads the same device addresses each time (what a captured CUDA graph needs).
class StepInputs {
 public:
  // Copies `fresh` into the buffers (allocating them on the first call, or if the shapes
  // change) and returns them.
  const std::vector<MicroBatch>& stage(const std::vector<MicroBatch>& fresh);
  int64_t allocations() const { return allocations_; }  // buffer (re)allocations so far

 private:
  std::vector<MicroBatch> bufs_;
  int64_t allocations_ = 0;
};

// What an executor of the step plugs in: how forward and backward run over the micro-batches
// and which groups reduce. Two implementations: the whole model's (PlainStepPhases) and a
// pipeline's (PipelineStepPhases, app/pipeline_step.h). The optimizer phase is not theirs: it
// exists once (StepPhases::optimizer) over the parameters and norm group they name.
class StepPhases {
 public:
  StepPhases(Model& model, Optimizer& opt, GradSync* sync, const StepObjective& objective,
             const StepTestHooks& hooks = {})
      : model_(model), opt_(opt), sync_(sync), objective_(objective), hooks_(hooks) {}
  virtual ~StepPhases() = default;

  // Forward and backward of every micro-batch (gradient accumulation); returns this rank's
  // summed loss share (0-d, on the device). The objective is the mean token loss of the
  // global batch plus the mean over its sequences of the model's auxiliary loss, whatever the
  // layout: each rank's share is divided by the global token count and by (micro-batches x
  // dp ranks), and GradSync sums the shares.
  virtual at::Tensor forward_backward(const std::vector<MicroBatch>& micro) = 0;
  // Finishes the gradient reduction over the data-parallel ranks (no-op without GradSync).
  void reduce_gradients();
  // Norm (over every rank holding a share of the parameters), clipping, AdamW, zeroing the
  // gradients, the model's post-step update; returns the global gradient norm before
  // clipping (0-d, on the device).
  at::Tensor optimizer();

  Model& model() { return model_; }
  Optimizer& opt() { return opt_; }
  void set_objective(const StepObjective& o) { objective_ = o; }

 protected:
  // The parameters this rank steps (the whole model's, or its stages').
  virtual std::vector<at::Tensor> stepped_params() { return model_.params().tensors(); }
  // Sums the squared norm over the ranks holding other parameters than GradSync's groups
  // (a pipeline's other stages); GradSync's own groups are reduced before.
  virtual void reduce_norm_sq_beyond_sync(at::Tensor&) {}

  Model& model_;
  Optimizer& opt_;
  GradSync* sync_;
  StepObjective objective_;
  StepTestHooks hooks_;
};

class PlainStepPhases : public StepPhases {
 public:
  using StepPhases::StepPhases;
  at::Tensor forward_backward(const std::vector<MicroBatch>& micro) override;
};

// How the step's two parts run (the two CUDA graphs' contents): eagerly (the plain and
// pipeline steps, warm-up, the exact-only steps), under the CPU capture check, recorded into
// CUDA graphs or replayed from them (app/compiled_step.cpp). `part` is what the one step
// would run; an executor may run it, record it or replay what it recorded.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  // Forward+backward, the gradient reduction and the overflow flag's reduction.
  virtual at::Tensor forward_backward(const std::function<at::Tensor()>& part) { return part(); }
  // Host work between the two parts: the overflow flag's read and an overflowed step's eager
  // re-run (outside both graphs, and outside the checked step).
  virtual void between(const std::function<void()>& host_work) { host_work(); }
  // Norm, clipping, the optimizer and the post-step updates.
  virtual at::Tensor optimizer(const std::function<at::Tensor()>& part) { return part(); }
};

// The one training step, for every executor (docs/design.md, "One step"): write the lr,
// mark the start, forward+backward and the gradient reduction (with the expert-parallel
// overflow flag's reduction), settle the expert exchange (an overflowed step's re-run),
// mark, the optimizer phase, mark. The lr reaches the optimizer as a device tensor written
// before the step's work, as a captured step writes it before each replay. Nothing here reads
// a device value: the loss and the norm stay on the device for the caller to read when it
// logs, and the phase times are events the caller reads then (PhaseTimer). `time(ms)
// fwdbwd` is therefore forward, backward, the gradient reduction and the settle.
StepResult run_step(StepPhases& phases, const std::vector<MicroBatch>& micro, const StepDrivers& d,
                    StepExecutor& ex);
// Eagerly (the default executor).
StepResult run_step(StepPhases& phases, const std::vector<MicroBatch>& micro, const StepDrivers& d);

// The whole model's eager step: run_step over PlainStepPhases (the parity tests' entry).
StepResult train_step(Model& model, Optimizer& opt, const std::vector<MicroBatch>& micro,
                      const StepObjective& objective, const StepDrivers& d,
                      GradSync* sync = nullptr, const StepTestHooks& hooks = {});

// The planted capture break (StepTestHooks::plant_host_read): a host read of the loss after
// the output layer.
void plant_host_read(const at::Tensor& loss);

// Sets the model's recompute policy from activation_checkpoint.mode and
// selective_ac_option, as a training run does (the trainer and `titan-train estimate`).
// Returns "none", "full", "op" or "every N".
std::string apply_activation_checkpointing(Model& model, const ActivationCheckpointSection& ac);

}  // namespace titan
