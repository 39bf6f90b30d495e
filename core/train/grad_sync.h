// The data-parallel gradient reduction that the train step calls (parallel/ implements it:
// DDP, FSDP, HSDP). A single process passes none, so its step runs no collective at all.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace titan {

class GradSync {
 public:
  virtual ~GradSync() = default;
  // Before each micro-batch's forward: `last` marks the step's last one. Layouts that reduce
  // during backward (DDP buckets, HSDP's replica all-reduce) start those reductions only in
  // the last backward; earlier ones only accumulate.
  virtual void begin_micro_batch(bool last) { (void)last; }
  // After the last backward: makes every rank's gradients the sum over the ranks, waiting
  // for whatever reductions the backward started.
  virtual void reduce_gradients(const std::vector<at::Tensor>& params) = 0;
  // Sums the local squared gradient norm (0-d fp32) over the ranks, in place.
  virtual void reduce_norm_sq(at::Tensor& norm_sq) = 0;
  // After the optimizer has updated the parameters (in the optimizer phase, captured with
  // it): FSDP's precomputed float8 scales are taken here (docs/float8.md). Default: nothing.
  virtual void after_optimizer_step() {}
};

}  // namespace titan
