// DualPipeV's overlapped forward + backward pairs (parallel/overlap_pair.h): the turns fall
// exactly at the collectives, one half runs at a time, an ended or failed half lets the other
// run on alone, and the backward thread gets the caller's ATen thread-local state. The
// schedule side: DualPipeV's pairs are marked, lowered with both receives before and both
// sends after, and still pass the deadlock check.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/overlap_pair.h"
#include "parallel/pipeline_schedule.h"
#include "test_util.h"

using namespace titan;

namespace {

// Each half appends its events; `overlap_turn()` stands where a collective would wait.
struct Log {
  std::mutex mu;
  std::vector<std::string> events;
  std::atomic<int> running{0}, most{0};
  void add(const std::string& e) {
    const int now = ++running;
    most = std::max(most.load(), now);
    {
      std::lock_guard<std::mutex> lk(mu);
      events.push_back(e);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // room for a racing half
    --running;
  }
};

}  // namespace

TEST_CASE("overlap pair: the halves take turns at the collectives, forward first",
          "[pp][overlap]") {
  Log log;
  std::thread::id fwd_id, bwd_id;
  const int64_t turns = run_overlapped_pair(
      [&] {
        fwd_id = std::this_thread::get_id();
        log.add("f1");
        overlap_turn();
        log.add("f2");
        overlap_turn();
        log.add("f3");
        overlap_turn();  // the backward has ended: returns at once
        log.add("f4");
      },
      [&] {
        bwd_id = std::this_thread::get_id();
        log.add("b1");
        overlap_turn();
        log.add("b2");
      });
  CHECK(log.events == std::vector<std::string>{"f1", "b1", "f2", "b2", "f3", "f4"});
  CHECK(log.most == 1);  // never both at once
  CHECK(turns == 4);     // f1->b1, b1->f2, f2->b2, and b's end
  CHECK(fwd_id == std::this_thread::get_id());
  CHECK(bwd_id != fwd_id);
  // Outside a pair a collective's turn is a no-op.
  overlap_turn();
}

TEST_CASE("overlap pair: a failed half lets the other finish, and its error comes back",
          "[pp][overlap]") {
  std::vector<std::string> done;
  CHECK_THROWS_WITH(run_overlapped_pair(
                        [&] {
                          overlap_turn();
                          done.push_back("f");
                          overlap_turn();
                          done.push_back("f again");
                        },
                        [&] { throw std::runtime_error("backward failed"); }),
                    "backward failed");
  CHECK(done == std::vector<std::string>{"f", "f again"});
  // The pair is over: another can start.
  CHECK(run_overlapped_pair([] {}, [] {}) == 1);
}

TEST_CASE("overlap pair: the backward thread inherits grad mode", "[pp][overlap]") {
  bool bwd_grad = true;
  {
    at::NoGradGuard ng;
    run_overlapped_pair([] {}, [&] { bwd_grad = at::GradMode::is_enabled(); });
  }
  CHECK_FALSE(bwd_grad);
}

TEST_CASE("overlap pair: on a GPU the backward thread queues on the caller's stream",
          "[pp][overlap][gpu]") {
  // CUDA's current stream is per thread and not in ATen's thread-local state: a plain new
  // thread sees the default stream, the pair's backward must see the caller's side stream.
  if (!at::globalContext().hasCUDA()) TITAN_SKIP("no CUDA device");
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  const c10::Device dev(c10::DeviceType::CUDA, 0);
  const c10::Stream side = cuda.getStreamFromGlobalPool(dev);
  c10::StreamGuard on_side(side);
  std::optional<c10::Stream> in_pair, in_plain;
  run_overlapped_pair([] {}, [&] { in_pair = cuda.getStream(dev); });
  std::thread([&] { in_plain = cuda.getStream(dev); }).join();
  REQUIRE(in_pair.has_value());
  CHECK(*in_pair == side);
  CHECK(*in_plain != side);  // what the pair's guard fixes
}

TEST_CASE("overlap pair: DualPipeV's pairs are marked and lowered around both halves",
          "[pp][overlap]") {
  for (int64_t p : {2, 3, 4}) {
    for (int64_t m : {2 * p, 2 * p + 3, 4 * p}) {
      INFO("p " << p << " m " << m);
      const PipelineSchedule s = make_schedule("DualPipeV", p, 2, m);
      const PipelineSchedule low = add_transfers(s);
      for (int64_t r = 0; r < p; ++r) {
        // Steps 4 and 5 of the generator: 2 (m - 2p + r + 1) + (p - r - 1) pairs.
        int64_t pairs = 0;
        const auto& row = low.ranks[static_cast<size_t>(r)];
        for (size_t i = 0; i < row.size(); ++i) {
          if (!row[i].paired) continue;
          ++pairs;
          REQUIRE(row[i].type == ActionType::kForward);
          REQUIRE(i + 1 < row.size());
          const Action& b = row[i + 1];  // the backward right after, another stage
          CHECK(b.type == ActionType::kBackward);
          CHECK(b.stage != row[i].stage);
          // Both halves' receives come before the forward, their sends after the backward.
          for (size_t k = 0; k < row.size(); ++k) {
            const Action& t = row[k];
            const bool of_f = t.stage == row[i].stage && t.microbatch == row[i].microbatch &&
                              (t.type == ActionType::kRecvF || t.type == ActionType::kSendF);
            const bool of_b = t.stage == b.stage && t.microbatch == b.microbatch &&
                              (t.type == ActionType::kRecvB || t.type == ActionType::kSendB);
            if (!of_f && !of_b) continue;
            const bool recv = t.type == ActionType::kRecvF || t.type == ActionType::kRecvB;
            CHECK((recv ? k < i : k > i + 1));
          }
        }
        CHECK(pairs == 2 * (m - 2 * p + r + 1) + (p - r - 1));
      }
      // Both lowerings pass the deadlock check; unpaired, each SEND leaves right after its
      // compute, so the bubble is never larger.
      PipelineSchedule plain = s;
      for (auto& row : plain.ranks)
        for (Action& a : row) a.paired = false;
      const double paired_bubble = check_schedule(s).bubble_fraction;
      const double plain_bubble = check_schedule(plain).bubble_fraction;
      CHECK(plain_bubble <= paired_bubble + 1e-12);
      if (p == 4 && m == 8)
        std::cout << "[pp] DualPipeV p 4 m 8 bubble: paired " << paired_bubble << ", plain "
                  << plain_bubble << std::endl;
    }
  }
}
