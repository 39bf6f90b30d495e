#include "app/phase_timer.h"

#include <c10/util/Exception.h>

#if __has_include(<ATen/cuda/CUDAEvent.h>)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#define TITAN_PHASE_TIMER_CUDA 1
#endif

namespace titan {

#ifdef TITAN_PHASE_TIMER_CUDA
struct PhaseTimer::CudaMarks {
  // steps[i][p]: the event of phase p of the i-th step since the last take(); kept, not
  // destroyed, so steady state creates no events.
  std::vector<std::array<at::cuda::CUDAEvent, 3>> steps;
  size_t used = 0;
  bool skipped = false;  // a mark during stream capture: that step is not timed
};
#else
struct PhaseTimer::CudaMarks {};
#endif

PhaseTimer::PhaseTimer(bool cuda) : cuda_(cuda) {
#ifdef TITAN_PHASE_TIMER_CUDA
  if (cuda_) cuda_marks_ = std::make_unique<CudaMarks>();
#else
  TORCH_CHECK(!cuda_, "PhaseTimer: this build has no CUDA headers");
#endif
}

PhaseTimer::~PhaseTimer() = default;

void PhaseTimer::mark(Phase p) {
  if (!cuda_) {
    if (p == kStart) host_.emplace_back();
    TORCH_CHECK(!host_.empty(), "PhaseTimer: mark before kStart");
    host_.back()[p] = std::chrono::steady_clock::now();
    return;
  }
#ifdef TITAN_PHASE_TIMER_CUDA
  auto& m = *cuda_marks_;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (p == kStart) {
    // Timing events may not be recorded into a CUDA graph: a captured step goes untimed.
    m.skipped = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
    if (m.skipped) return;
    if (m.used == m.steps.size())
      m.steps.push_back({at::cuda::CUDAEvent(cudaEventDefault), at::cuda::CUDAEvent(cudaEventDefault),
                         at::cuda::CUDAEvent(cudaEventDefault)});
    ++m.used;
  }
  if (m.skipped || m.used == 0) return;
  m.steps[m.used - 1][p].record(stream);
#endif
}

PhaseTimer::Totals PhaseTimer::take() {
  Totals t;
  if (!cuda_) {
    auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    for (auto& s : host_) {
      t.fwdbwd_ms += ms(s[kStart], s[kForwardBackwardDone]);
      t.opt_ms += ms(s[kForwardBackwardDone], s[kOptimizerDone]);
    }
    t.steps = static_cast<int64_t>(host_.size());
    host_.clear();
    return t;
  }
#ifdef TITAN_PHASE_TIMER_CUDA
  auto& m = *cuda_marks_;
  if (m.used > 0) m.steps[m.used - 1][kOptimizerDone].synchronize();
  for (size_t i = 0; i < m.used; ++i) {
    auto& s = m.steps[i];
    t.fwdbwd_ms += s[kStart].elapsed_time(s[kForwardBackwardDone]);
    t.opt_ms += s[kForwardBackwardDone].elapsed_time(s[kOptimizerDone]);
  }
  t.steps = static_cast<int64_t>(m.used);
  m.used = 0;
#endif
  return t;
}

}  // namespace titan
