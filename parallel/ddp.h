// Pure data parallelism (replication): every rank holds the whole model and gradients are
// summed over the ranks in flat buckets, each all-reduced during backward as soon as its
// last gradient is accumulated (docs/distributed.md).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/train/grad_sync.h"
#include "core/train/model.h"
#include "parallel/flat_grad_allreduce.h"
#include "parallel/process_group.h"

namespace titan {

class DataParallel : public GradSync {
 public:
  // Buckets hold at most bucket_bytes of fp32 gradients (one parameter larger than that gets
  // a bucket of its own), filled in reverse parameter order (about the order backward
  // produces them). Gradients are all-reduced in reduce_dtype
  // (training.mixed_precision_reduce) and land in the fp32 gradients. Installs a
  // post-accumulate-grad hook on each parameter (removed by the destructor); without
  // `overlap` there are no hooks and every bucket is reduced after backward.
  DataParallel(ProcessGroup& pg, const std::vector<at::Tensor>& params,
               at::ScalarType reduce_dtype = at::kFloat, int64_t bucket_bytes = 25 << 20,
               bool overlap = true);
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Copies rank 0's parameters and model buffers to every rank, so the replicas start equal
  // whatever each rank's initialization or checkpoint load did.
  void broadcast_state(Model& model);

  // Only the last micro-batch's backward starts bucket all-reduces; earlier ones accumulate.
  void begin_micro_batch(bool last) override;
  // Starts the buckets backward did not complete (a parameter without a gradient: an idle
  // MoE expert, zeros), waits for every bucket and writes the sums into the gradients.
  // SUM, not mean: train_step divides each rank's loss by the global token count already.
  void reduce_gradients(const std::vector<at::Tensor>& params) override;
  // No-op: after reduce_gradients every replica holds the full summed gradient, so the
  // local squared norm is the global one; summing it over ranks would count it dp times.
  void reduce_norm_sq(at::Tensor&) override {}

  // "N gradient buckets, all-reduce in float32", for the startup log.
  std::string describe() const;

  // Called by the hook when parameter i's gradient has been accumulated.
  void grad_ready(size_t i);

 private:
  struct Bucket {
    std::vector<size_t> params;  // parameter indices, in reverse parameter order
    int64_t ready = 0;           // how many of them have their gradient this backward
    FlatGradAllReduce flat;
  };
  std::vector<at::Tensor> tensors_of(const Bucket& b) const;  // its parameters, in order
  void launch(Bucket& b);

  ProcessGroup& pg_;
  at::ScalarType reduce_dtype_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // parameter -> its bucket
  std::vector<bool> seen_;         // parameter -> its hook fired this backward
  // Buckets are launched strictly in order (the same on every rank): next_ is the first one
  // not launched yet.
  size_t next_ = 0;
  bool last_micro_batch_ = true;
  bool overlap_ = true;
};

}  // namespace titan
