// Pure data parallelism (replication): every rank holds the whole model, gradients are
// summed over the ranks in flat buckets after backward (docs/distributed.md).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "core/trainer.h"
#include "models/model.h"
#include "parallel/process_group.h"

namespace titan {

class DataParallel : public GradSync {
 public:
  // Buckets hold at most bucket_bytes of fp32 gradients (one parameter larger than that gets
  // a bucket of its own).
  DataParallel(ProcessGroup& pg, const std::vector<at::Tensor>& params,
               int64_t bucket_bytes = 25 << 20);

  // Copies rank 0's parameters and model buffers to every rank, so the replicas start equal
  // whatever each rank's initialization or checkpoint load did.
  void broadcast_state(Model& model);

  // SUM, not mean: train_step divides each rank's loss by the global token count already.
  void reduce_gradients(const std::vector<at::Tensor>& params) override;
  // No-op: after reduce_gradients every replica holds the full summed gradient, so the
  // local squared norm is the global one; summing it over ranks would count it dp times.
  void reduce_norm_sq(at::Tensor&) override {}

  // The number of buckets, for the startup log.
  size_t num_buckets() const { return buckets_.size(); }

 private:
  ProcessGroup& pg_;
  std::vector<std::vector<size_t>> buckets_;  // parameter indices per bucket
};

}  // namespace titan
