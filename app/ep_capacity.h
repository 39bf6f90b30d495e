// Dropless capture with bounded buffers (docs/moe.md, "Dropless capture"): the static
// expert-parallel exchange runs at a finite capacity; a step in which any (source,
// destination) pair had more rows than that is detected on the device, agreed over the ep
// group and the world, read once on the host between the forward+backward and the
// optimizer phases, and run again eagerly with the exact exchange, so its result is the
// exact exchange's and no token is dropped. Repeated overflows grow the capacity up to a
// cap; past the cap the run continues eagerly with the exact exchange.
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/data/loader.h"
#include "core/train/expert_exchange.h"
#include "core/train/grad_sync.h"
#include "core/train/model.h"
#include "core/train/optimizer.h"

namespace titan {

class StepPhases;

struct EpCapacityPolicy {
  // Re-run overflowed steps (the static exchange with moe.ep_drop_policy = "none" at a finite
  // factor). false: nothing is checked (the exact exchange, a drop policy, or the worst-case
  // capacity); the metrics still report the pair load.
  bool rerun = false;
  double max_factor = 4;   // moe.ep_capacity_factor_max: the memory cap of the growth
  double growth = 1.5;     // capacity factor x this on growth
  int64_t grow_after = 4;  // overflows within `window` steps that grow the capacity
  int64_t window = 100;
  // The flag's max over every rank a re-run involves, after the ep group's: the re-run's
  // collectives span FSDP's shard groups (several ep groups share one) and, under pipeline
  // parallelism, every stage (the schedule's transfers). The trainer passes an all-reduce
  // over the world; unset, the ep group's agreement stands.
  std::function<void(at::Tensor&)> agree;
};

class EpCapacityControl {
 public:
  EpCapacityControl(std::shared_ptr<ExpertExchange> ex, const EpCapacityPolicy& p);

  // The end of the forward+backward phase, inside the captured work (graph 1 on CUDA): the
  // overflow of every micro-batch and MoE layer, agreed over the ep group (and the policy's
  // `agree`), into one device flag. No host read. Nothing when not checking.
  void reduce_overflow();
  // Between the phases: reads the flag (the step's one small host read). On an overflow
  // every rank discards the step's gradients and MoE counts and runs `phases`'
  // forward+backward and gradient reduction again with the exact exchange on the same
  // micro-batches (the whole model's, or a pipeline's schedule); returns that run's loss,
  // else `loss`. Then applies the growth policy.
  at::Tensor settle(StepPhases& phases, const std::vector<MicroBatch>& micro,
                    const at::Tensor& loss);

  // Past the capacity cap: every step runs eagerly with the exact exchange (no capture).
  bool exact_only() const { return exact_only_; }
  // The capacity in use, part of the capture key: a change re-captures.
  std::string capture_key() const;
  // Per log step: moe_ep_overflows, moe_ep_reruns (steps since the last call),
  // moe_ep_capacity_factor, moe_ep_capacity_rows, moe_ep_buffer_bytes, moe_ep_exact_only,
  // and moe_ep_peak_pair_load (the most rows one rank sent one destination in a step since
  // the last call, over the balanced share N / P: with overflow checks the maximum over the
  // ep ranks, else this rank's own, measured by every exchange). Resets the counts.
  std::map<std::string, double> take_metrics();

  int64_t overflows() const { return overflows_total_; }

 private:
  void grow();

  std::shared_ptr<ExpertExchange> ex_;
  EpCapacityPolicy p_;
  at::Tensor flag_;  // this step's agreed (2) [rows over capacity, peak pair rows]
  bool exact_only_ = false;
  int64_t steps_ = 0;
  std::deque<int64_t> recent_;  // steps that overflowed, within the window
  int64_t overflows_ = 0, reruns_ = 0, overflows_total_ = 0, peak_rows_ = 0;
};

}  // namespace titan
