// The CPU capture check (compile.enable = true without CUDA; docs/compile.md).
//
// A CUDA graph replays the kernels of one captured step with the shapes, scalars and
// addresses of that step, and cannot contain a host synchronization. On the CPU there is no
// graph, so the step runs eagerly and this checks the step's properties that capture relies
// on: every step after the warm-up dispatches the same sequence of ops (name, input shapes
// and dtypes, host scalar arguments), no op reads a device value on the host, and no
// collective changes size. Ops are seen through a thread-local RecordFunction callback
// (which the autograd engine carries into backward); each is attributed to the module that
// ran it (ModuleScope), backward ops to the module whose forward created their node.
#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace titan {

// Names the module the enclosed ops belong to ("layers.3", then "attention" inside it: ops
// are attributed to "layers.3.attention"). Free unless a capture check is recording on
// this thread.
class ModuleScope {
 public:
  explicit ModuleScope(const char* name);
  ModuleScope(const char* prefix, int64_t index);  // "layers", 3 -> "layers.3"
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

 private:
  bool pushed_ = false;
};

// Marks a named host read of device values (the loop experts' counts, the exchange's split
// sizes, the phase timing's wait): a span in profiler traces, and a capture break for the
// check.
#define TITAN_HOST_READ_SCOPE() RECORD_USER_SCOPE("titan::host_read")

// True while a CaptureCheck exists in this process (compile.enable on the CPU): code with a
// faster data-dependent CPU path (block-causal attention's key ranges, models/attention.cpp)
// then runs the static one CUDA would capture, so the check sees the captured step.
bool capture_check_active();

// One dispatched op of a recorded step.
struct CapturedOp {
  std::string name;     // "aten::mm", or a user scope ("titan::collective:all-reduce")
  std::string shapes;   // input tensors' dtypes and sizes, int lists: "f32[4,8] i64[4]"
  std::string scalars;  // host scalar arguments: "0.001 1"
  std::string module;   // "layers.1.moe", "layers.1.moe (backward)", or "" (the step itself)
};

// Thrown (as a UserError, exit 2) when a step breaks capture.
class CaptureCheck {
 public:
  // Steps before the reference step are warm-up (lazy state, first-step allocations).
  explicit CaptureCheck(int64_t warmup_steps = 1);
  ~CaptureCheck();

  // Around one training step. `inputs_key` describes the step's input shapes: a change
  // starts a new reference (a real capture re-captures then), it is not a break.
  void begin_step(const std::string& inputs_key);
  // Compares the step with the reference; throws UserError naming the op, the module and
  // the reason on a break. Returns true once a step has been compared and found equal.
  bool end_step();
  // Stops and restarts recording inside a step, around work that runs between the two
  // captured graphs on CUDA (the host read of the expert-parallel overflow flag and an
  // overflowed step's eager re-run, docs/moe.md): it is outside both graphs, so it is not
  // part of the checked step.
  void pause();
  void resume();

  const std::vector<CapturedOp>& reference() const { return reference_; }
  int64_t ops_per_step() const { return static_cast<int64_t>(reference_.size()); }
  int64_t steps_compared() const { return compared_; }
  // Debugging aid (debug.capture_check_context): on a break, print the N ops before and
  // after the first difference in both steps to stderr.
  void set_context_ops(int64_t n) { context_ops_ = n; }
  // "capture check: N ops per step, static"
  std::string summary() const;

  struct Recording;  // the per-thread recorder, public for the callbacks

 private:
  [[noreturn]] void fail(const std::string& what) const;
  void start_recording();

  int64_t warmup_;
  int64_t context_ops_ = 0;
  int64_t step_ = 0;  // steps begun since the reference was reset
  int64_t compared_ = 0;
  std::string key_;
  std::vector<CapturedOp> reference_;
  std::unique_ptr<Recording> rec_;
};

}  // namespace titan
