// One optimizer step, shared by the Trainer and the parity tests.
#pragma once

#include <ATen/ATen.h>

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

struct StepOptions {
  double global_tokens = 1;  // label tokens of the whole step, over every rank and micro-batch
  int64_t dp_degree = 1;     // data-parallel ranks whose gradients GradSync sums
  double lr = 0;
  double max_norm = 0;       // <= 0: measure the norm, do not clip
  PhaseTimer* timer = nullptr;  // marks the phase boundaries (never synchronizes)
  // Expert parallelism: the static exchange's overflow check and re-run between the phases
  // (app/ep_capacity.h), and the exchange's metrics; nullptr without expert parallelism.
  EpCapacityControl* ep = nullptr;
  // Test hook (TITAN_PLANT_ERROR=host_read): read each micro-batch's loss on the host.
  bool plant_host_read = false;
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

// Forward and backward over the micro-batches (gradient accumulation), the gradient
// reduction over data-parallel ranks (`sync`, none for one process), clipping, AdamW, then the
// model's own post-step update (MoE expert bias). With `o.ep`, between the gradient reduction
// and the optimizer the static exchange's overflow flag is read and an overflowed step's
// forward+backward run again with the exact exchange (app/ep_capacity.h). The step's objective is the mean token
// loss of the global batch plus the mean over its sequences of the model's auxiliary loss,
// whatever the layout: each rank's share is divided by the global token count and by
// (micro-batches x dp ranks) respectively, and `sync` sums the shares. Nothing here reads
// device values: the loss and the norm stay on the device for the caller to read when it
// logs, and the phase times are events the caller reads then (PhaseTimer).
StepResult train_step(Model& model, Optimizer& opt, const std::vector<MicroBatch>& micro,
                      const StepOptions& o, GradSync* sync = nullptr);

// The step's phases, as train_step runs them and as the captured step (app/captured_step.h)
// records them into its two graphs. None reads a device value or a host scalar that changes
// between steps; the lr is read from the optimizer's device tensor (AdamW::set_lr).
// forward_backward returns the summed loss share (0-d, on the device).
at::Tensor forward_backward(Model& model, const std::vector<MicroBatch>& micro,
                            const StepOptions& o, GradSync* sync);
// Finishes the gradient reduction over data-parallel ranks (no-op without `sync`).
void reduce_gradients(Model& model, GradSync* sync);
// Norm, clipping, AdamW, zeroing the gradients, the model's post-step update; returns the
// global gradient norm before clipping (0-d, on the device).
at::Tensor optimizer_phase(Model& model, Optimizer& opt, const StepOptions& o, GradSync* sync);

// The three phases of a step as a unit, for the runners that hold them in their own order
// (the capture check and the CUDA graphs of app/compiled_step.h): the functions above for a
// whole model (PlainStepPhases), or a pipeline's (app/pipeline_step.h).
class StepPhases {
 public:
  virtual ~StepPhases() = default;
  virtual at::Tensor forward_backward(const std::vector<MicroBatch>& micro,
                                      const StepOptions& o) = 0;
  virtual void reduce_gradients() = 0;
  virtual at::Tensor optimizer(const StepOptions& o) = 0;
};

class PlainStepPhases : public StepPhases {
 public:
  PlainStepPhases(Model& model, Optimizer& opt, GradSync* sync)
      : model_(model), opt_(opt), sync_(sync) {}
  at::Tensor forward_backward(const std::vector<MicroBatch>& micro, const StepOptions& o) override {
    return titan::forward_backward(model_, micro, o, sync_);
  }
  void reduce_gradients() override { titan::reduce_gradients(model_, sync_); }
  at::Tensor optimizer(const StepOptions& o) override {
    return optimizer_phase(model_, opt_, o, sync_);
  }

 private:
  Model& model_;
  Optimizer& opt_;
  GradSync* sync_;
};

// Test hook (StepOptions::plant_host_read, TITAN_PLANT_ERROR=host_read): a host read of the
// loss after the output layer, the break the capture check must refuse (exit 2).
void plant_host_read(const at::Tensor& loss);

// Sets the model's recompute policy from activation_checkpoint.mode and
// selective_ac_option, as a training run does (the trainer and `titan-train estimate`).
// Returns "none", "full", "op" or "every N".
std::string apply_activation_checkpointing(Model& model, const ActivationCheckpointSection& ac);

}  // namespace titan
