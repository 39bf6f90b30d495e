#include "app/preemption.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <csignal>

namespace titan {
namespace {

std::atomic<int> g_signal{0};
extern "C" void on_preempt(int sig) {
  g_signal.store(sig);
}

// Ctrl-C stops like a pre-emption (finish the step, save, exit 0). A second Ctrl-C, for a
// user who will not wait for the save, ends the process at once by the default action (the
// shell sees 130); the checkpoint being written stays a step-N.tmp-PID folder, never a
// checkpoint. signal() and raise() are async-signal-safe.
extern "C" void on_interrupt(int sig) {
  if (g_signal.exchange(sig) == SIGINT) {
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
  }
}

}  // namespace

void install_preemption_handlers() {
  std::signal(SIGTERM, on_preempt);
  std::signal(SIGUSR1, on_preempt);
  std::signal(SIGINT, on_interrupt);
}

int preemption_signal() {
  return g_signal.load();
}

PreemptionAgreement::PreemptionAgreement(std::function<void(at::Tensor&)> allreduce_max,
                                         at::Device device)
    : allreduce_max_(std::move(allreduce_max)), device_(device) {}

int PreemptionAgreement::poll(int64_t step) {
  const int sig = preemption_signal();
  if (!allreduce_max_) return sig;
  at::Tensor f = at::full({}, sig, at::TensorOptions().dtype(at::kInt).device(device_));
  allreduce_max_(f);
  Pending p;
  p.step = step;
  if (f.is_cpu()) {
    p.host = f;
  } else {
    p.host = at::empty({}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    p.host.copy_(f, /*non_blocking=*/true);
    p.ready = std::make_unique<c10::Event>(device_.type());
    p.ready->record(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
  }
  pending_.push_back(std::move(p));
  if (pending_.front().step + kLag > step) return 0;
  Pending& due = pending_.front();
  if (due.ready) due.ready->synchronize();  // recorded kLag steps ago
  const int agreed = due.host.item<int>();
  pending_.pop_front();
  return agreed;
}

}  // namespace titan
