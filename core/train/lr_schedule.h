// Warmup-stable-decay learning-rate schedule with a floor (torchtitan semantics, 1-based steps).
#pragma once

#include <cstdint>
#include <string>

#include "core/config/config.h"

namespace titan {

class LRSchedule {
 public:
  LRSchedule(const LRSchedulerSection& s, double peak_lr, int64_t total_steps);
  // Learning rate for optimizer step `step` (1-based).
  double lr(int64_t step) const { return peak_ * factor(step); }
  double factor(int64_t step) const;
  int64_t warmup_steps() const { return warmup_; }
  int64_t stable_steps() const { return stable_; }
  int64_t decay_steps() const { return decay_; }

 private:
  double peak_;
  int64_t warmup_, stable_, decay_;
  std::string type_;
  double min_factor_;
};

}  // namespace titan
