// Expert parallelism's token exchange over an ep process group: the implementation of
// core/train/expert_exchange.h that the MoE layers call (docs/moe.md, docs/distributed.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "core/train/expert_exchange.h"
#include "parallel/process_group.h"

namespace titan {

// What the static exchange does with the rows of a (source, destination) pair past its
// capacity (docs/moe.md): None drops nothing in the end (the trainer re-runs an overflowed step
// with the exact exchange, so the static pass's choice is never used); Probs drops them for
// good, lowest router probability first (Megatron's `probs` token-drop policy).
enum class EpDropPolicy { None, Probs };

struct EpExchangeOptions {
  // Static: the counts travel in a constant-size all-to-all (E int64 per rank), the rows in
  // equal splits of `capacity` rows per (source, destination) pair, and the receiver builds
  // its layout on the device: no host read, fixed shapes. Exact: the split sizes are read on
  // the host once per layer and forward (counts_to_host) and the rows travel in
  // variable splits.
  bool fixed = false;
  // Static: rows per pair = min(ceil(factor * N / P), the worst case N / K * min(K, E / P)),
  // N = T * K routed rows of this rank; inf: the worst case, which never overflows. (The
  // trainer sets moe.ep_capacity_factor, whose default is finite.)
  double capacity_factor = INFINITY;
  EpDropPolicy drop_policy = EpDropPolicy::None;
};

// Rows per (source, destination) pair of the static exchange for n routed rows of top_k
// choices each, over P ranks holding El experts each.
int64_t ep_static_capacity(int64_t n, int64_t top_k, int64_t P, int64_t El, double factor);

// Bytes of the static exchange's receive buffer per MoE layer and forward (P pairs of
// capacity rows of `dim` values of `elem_bytes`): what one direction of the exchange holds,
// the rows out (and, as large, the outputs home and their gradients in backward).
int64_t ep_static_buffer_bytes(int64_t n, int64_t top_k, int64_t P, int64_t El, int64_t dim,
                               int64_t elem_bytes, double factor);

// The start-up line that states what each exchange's receive buffer costs per MoE layer and
// forward, for n routed rows of `dim` values of `elem_bytes` bytes.
std::string ep_buffer_summary(const EpExchangeOptions& o, int64_t n, int64_t top_k, int64_t P,
                              int64_t El, int64_t dim, int64_t elem_bytes);

// Rank r of the ep group holds experts [r*E/P, (r+1)*E/P). dispatch() sends each rank the rows
// of its experts through a differentiable all-to-all; combine() sends the outputs back.
// Within an expert, rows keep source-rank order and each source's own order.
std::shared_ptr<ExpertExchange> make_expert_exchange(ProcessGroup& ep_group,
                                                     const EpExchangeOptions& options);

}  // namespace titan
