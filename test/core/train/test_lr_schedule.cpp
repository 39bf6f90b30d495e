// LR schedule: warmup, stable and decay phases against hand-computed values.
#include <catch2/catch.hpp>

#include <cmath>

#include "core/train/lr_schedule.h"

using namespace titan;

namespace {
LRSchedulerSection sec(int64_t warmup, double ratio, const char* type, double floor) {
  LRSchedulerSection s;
  s.warmup_steps = warmup;
  s.decay_ratio = ratio;
  s.decay_type = type;
  s.min_lr_factor = floor;
  return s;
}
}  // namespace

// torchtitan's schedule (components/lr_scheduler.py, v0.2.2) as LambdaLR applies it: optimizer
// step n (1-based) uses lr_lambda(n - 1). The comparison with torchtitan's own builder over 20
// training steps is test/app/test_torchtitan_compare.cpp.
TEST_CASE("lr: warmup then linear decay over the rest", "[lr]") {
  LRSchedule s(sec(10, -1, "linear", 0.0), 1.0, 110);
  CHECK(s.warmup_steps() == 10);
  CHECK(s.stable_steps() == 0);
  CHECK(s.decay_steps() == 100);
  CHECK(s.lr(1) == Approx(0.1));
  CHECK(s.lr(10) == Approx(1.0));
  CHECK(s.lr(11) == Approx(1.0));  // torchtitan holds the peak one step before decaying
  CHECK(s.lr(12) == Approx(0.99));
  CHECK(s.lr(61) == Approx(0.5));
  CHECK(s.lr(110) == Approx(0.01));  // progress 99/100 at the last step
}

TEST_CASE("lr: warmup-stable-decay with a floor and each decay shape", "[lr]") {
  // 100 steps: 10 warmup, decay_ratio 0.5 -> 50 decay, 40 stable (+1 at the peak).
  for (const char* type : {"linear", "sqrt", "cosine"}) {
    LRSchedule s(sec(10, 0.5, type, 0.1), 2.0, 100);
    INFO(type);
    CHECK(s.stable_steps() == 40);
    CHECK(s.lr(30) == Approx(2.0));
    CHECK(s.lr(51) == Approx(2.0));
    auto expect = [&](double p) {
      double adj = std::string(type) == "linear" ? 1 - p
                   : std::string(type) == "sqrt" ? 1 - std::sqrt(p)
                                                 : 0.5 * (1 + std::cos(M_PI * p));
      return 2.0 * (0.1 + 0.9 * adj);
    };
    CHECK(s.lr(76) == Approx(expect(25.0 / 50.0)));
    CHECK(s.lr(100) == Approx(expect(49.0 / 50.0)));
    CHECK(s.lr(100) > 0.2);  // the floor min_lr_factor * peak comes one step after the run
    for (int64_t k = 52; k < 100; ++k) CHECK(s.lr(k + 1) < s.lr(k));  // monotone decay
  }
}

TEST_CASE("lr: no warmup, warmup longer than the run, decay rounded half to even", "[lr]") {
  LRSchedule a(sec(0, -1, "linear", 0.0), 1.0, 4);
  CHECK(a.lr(1) == Approx(1.0));
  CHECK(a.lr(2) == Approx(0.75));
  LRSchedule b(sec(50, -1, "linear", 0.0), 1.0, 10);
  CHECK(b.warmup_steps() == 10);
  CHECK(b.lr(5) == Approx(0.5));
  // Python's round(2.5) == 2 and round(3.5) == 4.
  CHECK(LRSchedule(sec(2, 0.125, "linear", 0.0), 1.0, 20).decay_steps() == 2);
  CHECK(LRSchedule(sec(2, 0.175, "linear", 0.0), 1.0, 20).decay_steps() == 4);
}
