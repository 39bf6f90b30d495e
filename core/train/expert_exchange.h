// Expert parallelism as the MoE layer sees it: its routed rows go out to the ranks that hold
// their experts and come back after the experts ran. moe/ calls this interface; parallel/
// implements it over an ep process group (parallel/expert_parallel.h), so neither layer
// includes the other.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace titan {

class ExpertExchange {
 public:
  // What dispatch() received: this rank's rows, grouped by local expert, and what combine()
  // needs to send the outputs home.
  struct Received {
    at::Tensor rows;                    // (R, D): rows of local expert 0, then 1, ...
    std::vector<int64_t> local_counts;  // rows per local expert (host integers)
    std::shared_ptr<void> plan;         // the exchange's own bookkeeping
    // Rows this rank sends to each expert (E), then rows it receives from each (source,
    // local expert) (E): the host integers the exchange read, to pass back as known_splits.
    std::vector<int64_t> splits;
  };

  virtual ~ExpertExchange() = default;
  virtual int64_t size() const = 0;  // ep ranks; rank r holds experts [r*E/size, (r+1)*E/size)
  virtual int64_t rank() const = 0;
  // x_sorted: (N, D) rows in global expert order; counts: (E) rows per expert (device).
  // known_splits: a Received::splits of an earlier dispatch with the same counts (activation
  // checkpointing's recompute); then the counts exchange and its host read are skipped.
  virtual Received dispatch(const at::Tensor& x_sorted, const at::Tensor& counts,
                            const std::vector<int64_t>* known_splits) = 0;
  // y: (R, D) expert outputs in the order of Received::rows -> (N, D) in x_sorted's order.
  virtual at::Tensor combine(const at::Tensor& y, const Received& r) = 0;
};

}  // namespace titan
