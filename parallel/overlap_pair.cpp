#include "parallel/overlap_pair.h"

#include <ATen/Context.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

namespace titan {
namespace {

constexpr int kForward = 0, kBackward = 1;

struct Pair {
  std::mutex mu;
  std::condition_variable cv;
  int turn = kForward;
  bool ended[2] = {false, false};
  std::thread::id forward_thread;
  int64_t passes = 0;

  // Gives the turn to the other half (unless it ended); unless `ending`, waits for it back.
  void pass(int me, bool ending) {
    std::unique_lock<std::mutex> lk(mu);
    if (ending) ended[me] = true;
    const int other = 1 - me;
    if (ended[other]) return;
    turn = other;
    ++passes;
    cv.notify_all();
    if (!ending) cv.wait(lk, [&] { return turn == me || ended[other]; });
  }
  void wait_first_turn(int me) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return turn == me || ended[1 - me]; });
  }
};

std::atomic<Pair*> g_pair{nullptr};

// The caller's current CUDA device and stream, if there is a GPU: CUDA's current stream is per
// thread and not part of ATen's thread-local state, and the backward half must queue its
// kernels where the forward half's go (torchtitan sets the same for its backward thread).
std::optional<c10::Stream> current_cuda_stream() {
  if (!at::globalContext().hasCUDA()) return std::nullopt;
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  return cuda.getStream(cuda.getDevice());
}

}  // namespace

int64_t run_overlapped_pair(const std::function<void()>& forward,
                            const std::function<void()>& backward) {
  Pair pair;
  pair.forward_thread = std::this_thread::get_id();
  Pair* none = nullptr;
  TORCH_CHECK(g_pair.compare_exchange_strong(none, &pair), "overlapped pairs do not nest");
  std::exception_ptr error[2];
  const at::ThreadLocalState state;
  const std::optional<c10::Stream> stream = current_cuda_stream();
  std::thread back([&] {
    at::ThreadLocalStateGuard guard(state);
    std::optional<c10::StreamGuard> on_stream;
    if (stream) on_stream.emplace(*stream);
    pair.wait_first_turn(kBackward);
    try {
      backward();
    } catch (...) {
      error[kBackward] = std::current_exception();
    }
    pair.pass(kBackward, /*ending=*/true);
  });
  try {
    forward();
  } catch (...) {
    error[kForward] = std::current_exception();
  }
  pair.pass(kForward, /*ending=*/true);
  back.join();
  g_pair.store(nullptr);
  for (const auto& e : error)
    if (e) std::rethrow_exception(e);
  return pair.passes;
}

void overlap_turn() {
  Pair* p = g_pair.load();
  if (!p) return;
  p->pass(std::this_thread::get_id() == p->forward_thread ? kForward : kBackward,
          /*ending=*/false);
}

}  // namespace titan
