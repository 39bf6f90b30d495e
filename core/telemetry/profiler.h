// Kineto traces of chosen training steps (profiling.* keys, torchtitan's names, schedule and
// file layout): every profile_freq steps, the last profiler_active steps are recorded after
// profiler_warmup steps with the profiler prepared, and the window is written as one Chrome
// trace, <dump_folder>/<save_traces_folder>/iteration_<last step>/rank<R>_trace.json, which
// Perfetto and chrome://tracing load (docs/performance.md).
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/config/config.h"

namespace titan {

class StepProfiler {
 public:
  enum class Phase { Wait, Warmup, Active };

  // cuda: also record the GPU kernels (CUPTI), not only the host side.
  StepProfiler(const ProfilingSection& cfg, std::string dump_folder, int64_t rank, bool cuda);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  bool enabled() const { return cfg_.enable_profiling; }
  // Where step `step` (1-based, absolute: a resumed run keeps the schedule) falls.
  static Phase phase(const ProfilingSection& cfg, int64_t step);
  // The trace file of the window ending at `step`.
  std::string trace_path(int64_t step) const;

  // Around each training step: prepares or starts recording before it, and after the last
  // step of a window writes the trace. Returns the file written, or "".
  void before_step(int64_t step);
  std::string after_step(int64_t step);
  // After the run's last step: a window cut short by the end of training is still written.
  std::string finish(int64_t last_step);

 private:
  std::string save(int64_t step);

  const ProfilingSection cfg_;
  const std::string root_;
  const int64_t rank_;
  const bool cuda_;
  bool prepared_ = false, recording_ = false;
  std::string step_name_;                     // "ProfilerStep#N", outlives step_scope_
  std::unique_ptr<at::RecordFunction> step_scope_;  // the step's span in the trace
};

}  // namespace titan
