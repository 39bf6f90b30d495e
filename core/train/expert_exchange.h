// Expert parallelism as the MoE layer sees it: its routed rows go out to the ranks that hold
// their experts and come back after the experts ran. moe/ calls this interface; parallel/
// implements it over an ep process group (parallel/expert_parallel.h), so neither layer
// includes the other.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/train/capture_check.h"

namespace titan {

// The one device-to-host read of per-expert counts in a training step: the MoE loop
// backend's counts, or the exact expert-parallel exchange's split sizes (docs/moe.md). The
// counts as host integers.
inline std::vector<int64_t> counts_to_host(const at::Tensor& counts) {
  TITAN_HOST_READ_SCOPE();  // the capture check names this read
  at::Tensor c = counts.to(at::kCPU, at::kLong).contiguous();  // the sync
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

class ExpertExchange {
 public:
  // What dispatch() received, and what combine() needs to send the outputs home.
  struct Received {
    // (R, D): the rows from each source rank in turn, each source's rows by local expert.
    at::Tensor rows;
    // (R) int64 on the device: the local expert of each row; El (the local expert count)
    // marks an empty slot of the static exchange, whose row is zero.
    at::Tensor local_expert;
    bool has_empty_slots = false;  // static exchange
    // Exact exchange: rows per local expert, the host integers it read anyway; empty under
    // the static exchange (which reads nothing on the host).
    std::vector<int64_t> host_local_counts;
    // Static exchange: this rank's rows dropped over capacity in this dispatch, a device
    // scalar (int64); undefined under the exact exchange.
    at::Tensor dropped;
    // What a later dispatch of the same routing may reuse (activation checkpointing's
    // recompute): the counts received from each (source, local expert) on the device (E),
    // and, exact, the host split sizes (E sent, E received).
    at::Tensor recv_counts;
    std::vector<int64_t> splits;
    std::shared_ptr<void> plan;  // the exchange's own bookkeeping
  };

  virtual ~ExpertExchange() = default;
  virtual int64_t size() const = 0;  // ep ranks; rank r holds experts [r*E/size, (r+1)*E/size)
  virtual int64_t rank() const = 0;
  // x_sorted: (N, D) rows in global expert order, N = tokens * top_k; counts: (E) rows per
  // expert (device); probs: (N) the router probability (gate weight) of each row, which the
  // static exchange's drop policy ranks by. known: an earlier Received of the same counts (a
  // recompute); its counts are reused, so the counts exchange (and, exact, its host read) is
  // skipped. training: a training forward's first dispatch of these rows (not a recompute,
  // not an evaluation), whose rows over capacity count as the step's overflow.
  virtual Received dispatch(const at::Tensor& x_sorted, const at::Tensor& counts,
                            const at::Tensor& probs, int64_t top_k, bool training,
                            const Received* known) = 0;
  // y: (R, D) expert outputs in the order of Received::rows -> (N, D) in x_sorted's order
  // (rows dropped over capacity: zero).
  virtual at::Tensor combine(const at::Tensor& y, const Received& r) = 0;

  // ---- The static exchange's bounded capacity (docs/moe.md, "Dropless capture").
  // Rows travel in fixed-capacity splits: the static exchange, not switched to exact.
  virtual bool is_static() const { return false; }
  // true: the exact exchange runs instead of the static one until called with false (the
  // eager re-run of a step that overflowed, or a run past the capacity cap).
  virtual void force_exact(bool on) { (void)on; }
  virtual double capacity_factor() const { return 0; }
  virtual void set_capacity_factor(double factor) { (void)factor; }
  // Rows per (source, destination) pair at the current factor, and the static receive
  // buffer's bytes per MoE layer and forward (P * capacity rows); 0 before the first dispatch.
  virtual int64_t capacity_rows() const { return 0; }
  virtual int64_t buffer_bytes() const { return 0; }
  // A collective over the ep group, at the end of a step's forward+backward (inside the
  // captured work): (2) int64 on the device, the maximum over ep ranks of [rows over capacity
  // in this rank's training dispatches since the last call, the most rows any of them sent
  // one destination]; the accumulators restart. Undefined when no static dispatch ran.
  virtual at::Tensor reduce_overflow() { return at::Tensor(); }
  // Exact exchange: the most rows a training dispatch sent one destination since the last
  // call (host, read anyway with the splits); 0 under the static exchange.
  virtual int64_t take_exact_peak_rows() { return 0; }
  // Static exchange: the most rows a training dispatch of this rank sent one destination since
  // the last call or the last reduce_overflow() (which restarts it), read on the host (a log
  // step's read, outside the captured work); the accumulators restart. 0 when no static
  // dispatch ran. What reports the pair load where no overflow is checked (the worst-case
  // capacity, a drop policy), which never calls reduce_overflow().
  virtual int64_t take_static_peak_rows() { return 0; }
  // Rows routed per rank in the last dispatch (N), for the metrics' balanced share N / P.
  virtual int64_t routed_rows() const { return 0; }
};

}  // namespace titan
