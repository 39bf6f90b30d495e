#include "core/train/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace titan {

LRSchedule::LRSchedule(const LRSchedulerSection& s, double peak_lr, int64_t total_steps)
    : peak_(peak_lr), type_(s.decay_type), min_factor_(s.min_lr_factor) {
  warmup_ = std::min<int64_t>(s.warmup_steps, total_steps);
  // Python's round(): halves go to the even neighbour (nearbyint in the default rounding mode).
  decay_ = s.decay_ratio < 0 ? total_steps - warmup_
                             : static_cast<int64_t>(std::nearbyint(s.decay_ratio * total_steps));
  decay_ = std::min(decay_, total_steps - warmup_);  // warmup wins when both do not fit
  stable_ = total_steps - warmup_ - decay_;
}

double LRSchedule::factor(int64_t step) const {
  // torchtitan's linear_warmup_stable_decay, which LambdaLR evaluates at step - 1 for optimizer
  // step `step`: warmup reaches 1 at step W; the peak then holds for S + 1 steps (torchtitan's
  // stable phase is N + 1 - W - D steps long), so the decay's first step has progress 1/D and
  // the last step (D - 1)/D: the floor itself is reached one step after the run ends.
  if (step <= warmup_) return static_cast<double>(step) / static_cast<double>(warmup_);
  if (step <= warmup_ + stable_ + 1 || decay_ == 0) return 1.0;
  double progress = static_cast<double>(std::min(step - warmup_ - stable_ - 1, decay_)) /
                    static_cast<double>(decay_);
  double adj = 1.0;
  if (type_ == "linear")
    adj = 1.0 - progress;
  else if (type_ == "sqrt")
    adj = 1.0 - std::sqrt(progress);
  else
    adj = 0.5 * (1.0 + std::cos(M_PI * progress));  // cosine
  return min_factor_ + (1.0 - min_factor_) * adj;
}

}  // namespace titan
