// Pure data parallelism (replication): every rank holds the whole model, gradients are
// summed over the ranks in flat buckets after backward (docs/distributed.md).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/grad_sync.h"
#include "core/model.h"
#include "parallel/process_group.h"

namespace titan {

class DataParallel : public GradSync {
 public:
  // Buckets hold at most bucket_bytes of fp32 gradients (one parameter larger than that gets
  // a bucket of its own). Gradients are all-reduced in reduce_dtype
  // (training.mixed_precision_reduce) and land in the fp32 gradients.
  DataParallel(ProcessGroup& pg, const std::vector<at::Tensor>& params,
               at::ScalarType reduce_dtype = at::kFloat, int64_t bucket_bytes = 25 << 20);

  // Copies rank 0's parameters and model buffers to every rank, so the replicas start equal
  // whatever each rank's initialization or checkpoint load did.
  void broadcast_state(Model& model);

  // SUM, not mean: train_step divides each rank's loss by the global token count already.
  void reduce_gradients(const std::vector<at::Tensor>& params) override;
  // No-op: after reduce_gradients every replica holds the full summed gradient, so the
  // local squared norm is the global one; summing it over ranks would count it dp times.
  void reduce_norm_sq(at::Tensor&) override {}

  // "N gradient buckets, all-reduce in float32", for the startup log.
  std::string describe() const;

 private:
  ProcessGroup& pg_;
  at::ScalarType reduce_dtype_;
  std::vector<std::vector<size_t>> buckets_;  // parameter indices per bucket
};

}  // namespace titan
