// Pre-emption (SIGTERM, SIGINT (Ctrl-C), or SIGUSR1 as Slurm sends with --signal): the current step finishes,
// a checkpoint is saved, and the process exits 0. With several ranks, the ranks must agree on
// the step they stop at, since one leaving alone would make the others fail in the next
// collective.
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <functional>
#include <memory>

#include <c10/core/Event.h>

namespace titan {

// SIGTERM, SIGUSR1 and SIGINT set a flag that preemption_signal() reads; a second SIGINT
// ends the process at once (killed by SIGINT, status 130 in a shell).
void install_preemption_handlers();
int preemption_signal();  // 0 when none arrived

class PreemptionAgreement {
 public:
  // allreduce_max: the MAX over every rank, in place; empty for a single process.
  PreemptionAgreement(std::function<void(at::Tensor&)> allreduce_max, at::Device device);
  // After each step: the signal every rank stops at after this step, or 0. Each step
  // all-reduces this rank's flag and starts copying the result to the host without waiting;
  // the value is read kLag steps later, when the copy has long finished, so no step waits for
  // the device. Every rank reads the same step's value at the same step.
  int poll(int64_t step);

  static constexpr int64_t kLag = 2;

 private:
  struct Pending {
    int64_t step = 0;
    at::Tensor host;                    // the all-reduced flag, on the host
    std::unique_ptr<c10::Event> ready;  // CUDA: the device-to-host copy's completion
  };
  std::function<void(at::Tensor&)> allreduce_max_;
  at::Device device_;
  std::deque<Pending> pending_;
};

}  // namespace titan
