// One all-reduce over several parameters' gradients: flattened into one buffer in the reduce
// dtype, summed over a group, and written back. DDP's buckets and HSDP's replica reduction
// both use it.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "parallel/process_group.h"

namespace titan {

struct FlatGradAllReduce {
  at::Tensor buf;  // flat, reduce dtype, while in flight
  CommWork work;

  // Concatenates the gradients of `params` (a parameter without one, e.g. an expert no token
  // reached on this rank, contributes zeros) into `buf` as `dtype` and starts its sum over
  // `pg`. `buf` must stay untouched until finish().
  void start(ProcessGroup& pg, const std::vector<at::Tensor>& params, at::ScalarType dtype);
  // Waits, then writes the sums (as fp32) back into the gradients of `params`, in the order
  // start() read them: copied into a gradient that exists, set where there is none. Drops
  // `buf`.
  void finish(const std::vector<at::Tensor>& params);
};

}  // namespace titan
