// The data-parallel gradient reduction that the train step calls (parallel/ implements it:
// DDP, FSDP, HSDP). A single process passes none, so its step runs no collective at all.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace titan {

class GradSync {
 public:
  virtual ~GradSync() = default;
  // After the last backward: makes every rank's gradients the sum over the ranks.
  virtual void reduce_gradients(const std::vector<at::Tensor>& params) = 0;
  // Sums the local squared gradient norm (0-d fp32) over the ranks, in place.
  virtual void reduce_norm_sq(at::Tensor& norm_sq) = 0;
};

}  // namespace titan
