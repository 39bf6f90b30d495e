// Times the phases of every training step the same way, without synchronizing inside the
// step: CUDA events on the compute stream on a GPU (device time of each phase), the host
// clock on the CPU (where the host runs the kernels itself). The sums are read on log steps,
// after the log line's own synchronization, so a captured step records nothing extra.
#pragma once

#include <array>
#include <chrono>
#include <memory>
#include <vector>

namespace titan {

class PhaseTimer {
 public:
  enum Phase { kStart = 0, kForwardBackwardDone = 1, kOptimizerDone = 2 };
  struct Totals {
    double fwdbwd_ms = 0, opt_ms = 0;
    int64_t steps = 0;
  };

  explicit PhaseTimer(bool cuda);
  ~PhaseTimer();
  void mark(Phase p);
  // The phases' totals over the steps marked since the last take(); waits for the last
  // CUDA event, so call it where the host waits for the device anyway (a log step).
  Totals take();

 private:
  struct CudaMarks;  // CUDA events, reused from step to step
  bool cuda_;
  std::unique_ptr<CudaMarks> cuda_marks_;
  std::vector<std::array<std::chrono::steady_clock::time_point, 3>> host_;
};

}  // namespace titan
