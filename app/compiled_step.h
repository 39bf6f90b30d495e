// compile.enable = true: the train step captured as CUDA graphs, or checked for capture on
// the CPU (docs/compile.md).
//
// On CUDA the step is two graphs in one private memory pool: (1) forward and backward of
// every micro-batch with the gradient collectives (DDP buckets, FSDP/HSDP gathers and
// reductions) inside, ending when the gradients are reduced; (2) the gradient norm, clipping,
// the fused AdamW step, zeroing the gradients and the MoE bias update. The first
// `warmup` steps run eagerly on the capture stream (lazy state: gradients, optimizer state,
// NCCL communicators, the bf16 weight casts); the next step is captured, then every step
// replays. The lr is written into the optimizer's device tensor before each replay; inputs
// are the StepInputs buffers (refilled asynchronously from the loader's pinned batches); the
// loss and the gradient norm are the graphs' static outputs, read by the log step only. A
// change of the input shapes or buffers re-captures.
//
// On the CPU the same step runs eagerly under CaptureCheck (core/train/capture_check.h),
// which exits 2 naming the op and module that would break capture.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "app/train_step.h"
#include "core/train/capture_check.h"
#include "parallel/comm_record.h"

namespace titan {

// Refuses (UserError, exit 2, naming the key to change) what the captured step cannot hold:
// the loop experts backend (host reads of the counts), the for-loop AdamW (host reads of the
// step count), expert parallelism's variable-split exchange (host split sizes), and
// compile.components other than torchtitan's default ["model", "loss"] (the whole step is
// captured, model and loss together). `moe_model`: the model has routed experts;
// `loop_experts`: their backend resolved to the loop.
void check_compile_config(const JobConfig& cfg, bool moe_model, bool loop_experts);

// The executor of the one step (app/train_step.h) that compile.enable selects: it runs the
// step's phases eagerly for the warm-up steps (on CUDA on the capture stream; on the CPU
// one step, the check's warm-up), then records them into the two graphs and replays them
// (CUDA) or runs them under the capture check (CPU); past the expert-parallel capacity cap
// every step runs eagerly. The same phases (the whole model's or a pipeline's) in every case.
class CompiledStep {
 public:
  // `warmup_steps`: the eager steps before a capture on CUDA; the CPU check warms up one.
  CompiledStep(StepPhases& phases, bool cuda, int64_t warmup_steps = 3);
  ~CompiledStep();

  // One training step on the staged (static) inputs: eager warm-up, capture or replay on
  // CUDA; the eager warm-up, then the step under the capture check on the CPU (whose
  // UserError ends the run).
  StepResult step(const std::vector<MicroBatch>& micro, const StepDrivers& d);
  // debug.capture_check_context (CPU): the ops printed around a capture break.
  void set_capture_check_context(int64_t n) {
    if (check_) check_->set_context_ops(n);
  }

  // CPU: the check's one line ("capture check: N ops per step, static") once a step has
  // been compared with the reference, then empty. CUDA: "captured the train step ..." once.
  std::string take_report();
  // Cumulative counts since construction, for the metrics (compile_captures, ...). CUDA:
  // captures (re-captures too) and replays of the step's graphs; a capture replays at once,
  // so W warm-up steps and one capture over N steps give N - W replays. CPU: 0 and 0, and
  // checked_steps, the steps the capture check compared with its reference (step 1 is the
  // eager warm-up, step 2 the reference: N - 2 over N steps of one shape); 0 on CUDA.
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  int64_t checked_steps() const { return check_ ? check_->steps_compared() : 0; }
  // The collectives one replay runs (those the capture issued; empty before a capture, or
  // when the step has none): ProcessGroup::comm_counts gains them on every replay.
  const CommRecord& comm_record() const { return comm_; }

 private:
  StepResult step_cuda(const std::vector<MicroBatch>& micro, const StepDrivers& d);
  void capture(const std::vector<MicroBatch>& micro, const StepDrivers& d);

  StepPhases& phases_;
  bool cuda_;
  int64_t warmup_;
  std::unique_ptr<CaptureCheck> check_;  // CPU
  struct Graphs;                         // CUDA
  std::unique_ptr<Graphs> graphs_;
  std::string key_;   // input shapes and addresses (and the ep capacity) of the current capture
  int64_t warm_ = 0;  // eager warm-up steps run for key_
  int64_t captures_ = 0, replays_ = 0;
  CommRecord comm_;  // CUDA: the current capture's collectives
  bool reported_ = false;
  std::string report_;
};

// The inputs' shapes and buffer addresses: a change needs a new capture (CPU check: a new
// reference step).
std::string step_inputs_key(const std::vector<MicroBatch>& micro);

}  // namespace titan
