#include "parallel/expert_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/base/log.h"
#include "core/train/recompute.h"
#include "parallel/overlap_pair.h"

namespace titan {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t n = 0;
  for (int64_t x : v) n += x;
  return n;
}
// An all-to-all that, inside DualPipeV's overlapped pair, lets the pair's other half compute
// while it is in flight (parallel/overlap_pair.h). `in` stays alive until the wait.
void all_to_all_turn(ProcessGroup& pg, at::Tensor& out, const at::Tensor& in,
                     const std::vector<int64_t>& out_splits,
                     const std::vector<int64_t>& in_splits) {
  CommWork work = pg.all_to_all_start(out, in, out_splits, in_splits);
  overlap_turn();
  work.wait();
}

// Differentiable row all-to-all: the gradient travels back along the reversed splits.
// `saved`: the output of an op-level checkpoint's forward (then no communication), or nothing.
struct AllToAll : public torch::autograd::Function<AllToAll> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t pg_ptr,
                               std::vector<int64_t> out_splits, std::vector<int64_t> in_splits,
                               at::TensorList saved) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(pg_ptr);
    ctx->saved_data["pg"] = pg_ptr;
    ctx->saved_data["out"] = out_splits;
    ctx->saved_data["in"] = in_splits;
    if (!saved.empty()) return {saved[0].detach()};
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = sum_of(out_splits);
    at::Tensor out = at::empty(shape, x.options());
    all_to_all_turn(pg, out, x.contiguous(), out_splits, in_splits);
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(ctx->saved_data["pg"].toInt());
    auto out_splits = ctx->saved_data["out"].toIntVector();
    auto in_splits = ctx->saved_data["in"].toIntVector();
    std::vector<int64_t> shape = g[0].sizes().vec();
    shape[0] = sum_of(in_splits);
    at::Tensor gx = at::empty(shape, g[0].options());
    all_to_all_turn(pg, gx, g[0].contiguous(), in_splits, out_splits);
    variable_list r{gx};
    r.resize(5);  // pg, splits and the optional saved output: none
    return r;
  }
};

// The rows' all-to-all. Under op-level checkpointing its result is saved in the forward and
// handed back in the recompute, which then does not communicate (docs/moe.md).
at::Tensor rows_all_to_all(ProcessGroup& pg, const at::Tensor& x,
                           const std::vector<int64_t>& out_splits,
                           const std::vector<int64_t>& in_splits) {
  const auto pg_ptr = reinterpret_cast<int64_t>(&pg);
  if (op_tape_recording()) {
    at::Tensor y = AllToAll::apply(x, pg_ptr, out_splits, in_splits, at::TensorList())[0];
    op_tape_save({y});
    return y;
  }
  std::vector<at::Tensor> saved;
  if (op_tape_replaying()) saved = op_tape_restore(1);
  return AllToAll::apply(x, pg_ptr, out_splits, in_splits, at::TensorList(saved))[0];
}

// Exact: the host split sizes. Static: the gather index that brings the returned rows home.
struct Plan {
  bool fixed = false;
  std::vector<int64_t> in_splits, out_splits;  // rows sent to / received from each rank
  at::Tensor back;                             // static: (N) slot of each row, P*C if dropped
  int64_t capacity = 0;
};

class ProcessGroupExchange : public ExpertExchange {
 public:
  ProcessGroupExchange(ProcessGroup& pg, const EpExchangeOptions& o) : pg_(pg), opt_(o) {}
  int64_t size() const override { return pg_.size(); }
  int64_t rank() const override { return pg_.rank(); }

  Received dispatch(const at::Tensor& x_sorted, const at::Tensor& counts, const at::Tensor& probs,
                    int64_t top_k, bool training, const Received* known) override {
    const int64_t P = pg_.size(), E = counts.size(0), El = E / P;
    TORCH_CHECK(El * P == E, "expert parallelism: ", E, " experts over ", P, " ranks");
    rows_ = x_sorted.size(0);
    top_k_ = top_k;
    El_ = El;
    row_bytes_ = x_sorted.size(1) * static_cast<int64_t>(x_sorted.element_size());
    if (!logged_) {  // once, at the first dispatch: what the receive buffers cost
      logged_ = true;
      log_info(ep_buffer_summary(opt_, x_sorted.size(0), top_k, P, El, x_sorted.size(1),
                                 x_sorted.element_size()));
    }
    Received r;
    if (is_static()) return dispatch_static(x_sorted, counts, probs, top_k, training, known, r, P, El);
    // 1. recv_counts[src * El + j] = rows rank src sends to local expert j: a constant-size
    //    all-to-all that stays on the device (a recompute reuses the forward's).
    r.recv_counts = known ? known->recv_counts : exchange_counts(counts, P, El);
    return dispatch_exact(x_sorted, counts, known, training, r, P, El);
  }

  at::Tensor combine(const at::Tensor& y, const Received& r) override {
    const auto& plan = *static_cast<const Plan*>(r.plan.get());
    if (!plan.fixed)  // y is in arrival order, which is the reverse all-to-all's send order
      return rows_all_to_all(pg_, y, plan.in_splits, plan.out_splits);
    const std::vector<int64_t> even(static_cast<size_t>(pg_.size()), plan.capacity);
    at::Tensor home = rows_all_to_all(pg_, y, even, even);
    // Dropped rows read the appended zero row.
    return at::cat({home, at::zeros({1, home.size(1)}, home.options())})
        .index_select(0, plan.back);
  }

  bool is_static() const override { return opt_.fixed && !exact_; }
  void force_exact(bool on) override { exact_ = on; }
  double capacity_factor() const override { return opt_.capacity_factor; }
  void set_capacity_factor(double f) override { opt_.capacity_factor = f; }
  int64_t capacity_rows() const override {
    return rows_ ? ep_static_capacity(rows_, top_k_, pg_.size(), El_, opt_.capacity_factor) : 0;
  }
  int64_t buffer_bytes() const override { return pg_.size() * capacity_rows() * row_bytes_; }
  int64_t routed_rows() const override { return rows_; }

  at::Tensor reduce_overflow() override {
    if (!overflow_.defined()) return at::Tensor();
    at::NoGradGuard ng;
    if (!agreed_.defined()) agreed_ = at::empty_like(overflow_);
    agreed_.copy_(overflow_);
    pg_.allreduce(agreed_, ReduceOp::Max);
    overflow_.zero_();
    return agreed_;
  }

  int64_t take_static_peak_rows() override {
    if (!overflow_.defined()) return 0;
    at::NoGradGuard ng;
    const int64_t p = overflow_[1].item<int64_t>();  // the log step's read
    overflow_.zero_();  // in place: a captured step's dispatches add into this tensor
    return p;
  }

  int64_t take_exact_peak_rows() override {
    const int64_t p = exact_peak_;
    exact_peak_ = 0;
    return p;
  }

 private:
  at::Tensor exchange_counts(const at::Tensor& counts, int64_t P, int64_t El) {
    at::NoGradGuard ng;
    at::Tensor send_counts = counts.to(at::kLong).contiguous();
    at::Tensor recv_counts = at::empty_like(send_counts);
    const std::vector<int64_t> even(static_cast<size_t>(P), El);
    all_to_all_turn(pg_, recv_counts, send_counts, even, even);
    return recv_counts;
  }

  // 2. The exact exchange's host read (the one named sync of expert parallelism per layer and
  //    forward): the split sizes; then the rows in variable splits.
  Received dispatch_exact(const at::Tensor& x_sorted, const at::Tensor& counts,
                          const Received* known, bool training, Received& r, int64_t P,
                          int64_t El) {
    const int64_t E = P * El;
    r.splits =
        known ? known->splits : counts_to_host(at::cat({counts.to(at::kLong), r.recv_counts}));
    TORCH_CHECK(static_cast<int64_t>(r.splits.size()) == 2 * E,
                "expert parallelism: cached splits for another expert count");
    const int64_t* c = r.splits.data();
    auto plan = std::make_shared<Plan>();
    plan->in_splits.assign(static_cast<size_t>(P), 0);
    plan->out_splits.assign(static_cast<size_t>(P), 0);
    r.host_local_counts.assign(static_cast<size_t>(El), 0);
    for (int64_t s = 0; s < P; ++s)
      for (int64_t j = 0; j < El; ++j) {
        plan->in_splits[static_cast<size_t>(s)] += c[s * El + j];
        plan->out_splits[static_cast<size_t>(s)] += c[E + s * El + j];
        r.host_local_counts[static_cast<size_t>(j)] += c[E + s * El + j];
      }
    if (training)  // the pair load the static exchange would have had to hold (metrics)
      for (int64_t n : plan->in_splits) exact_peak_ = std::max(exact_peak_, n);
    // 3. Rows out: x_sorted is in expert order, so each destination's rows are contiguous.
    r.rows = rows_all_to_all(pg_, x_sorted, plan->out_splits,
                             plan->in_splits);  // (R, D): [src][local expert]
    // 4. The local expert of each row, from the device counts (R is a host integer here).
    at::NoGradGuard ng;
    at::Tensor ids = at::arange(El, r.recv_counts.options()).repeat({P});
    r.local_expert = at::repeat_interleave(ids, r.recv_counts, /*dim=*/0,
                                           /*output_size=*/r.rows.size(0));
    r.plan = plan;
    return r;
  }

  // The static exchange: every pair sends `capacity` rows, the rows of the source's block for
  // that destination that it keeps (in expert order), the rest zero. Which rows a full pair
  // keeps: the first by position (policy none: the pass is re-run exactly if any pair
  // overflowed, so the choice never reaches the weights), or the highest router probability
  // (policy probs). The sender counts per expert the rows it keeps and sends those counts,
  // so the receiver lays out the slots without knowing the policy. Nothing is read on the
  // host; every size is static (N, P, C).
  Received dispatch_static(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& probs,
                           int64_t top_k, bool training, const Received* known, Received& r,
                           int64_t P, int64_t El) {
    const int64_t N = x.size(0), D = x.size(1), E = P * El;
    const int64_t C = ep_static_capacity(N, top_k, P, El, opt_.capacity_factor);
    auto plan = std::make_shared<Plan>();
    plan->fixed = true;
    plan->capacity = C;
    at::Tensor send_idx;
    {
      at::NoGradGuard ng;
      auto idx = counts.options().dtype(at::kLong);
      at::Tensor cnt = counts.to(at::kLong);
      at::Tensor per_dest = cnt.view({P, El}).sum(1);         // (P) rows for each rank
      at::Tensor dest_start = per_dest.cumsum(0) - per_dest;  // (P) their first row
      at::Tensor rows = at::arange(N, idx);
      at::Tensor expert = at::searchsorted(cnt.cumsum(0), rows, false, true);  // (N)
      at::Tensor dest = expert.div(El, "floor");                               // (N)
      // Each row's rank in its destination's block: its position, or (probs) its place in
      // the block sorted by probability, highest first (a stable sort by probability, then a
      // stable sort by destination, which keeps that order inside each block).
      at::Tensor rank_in_block;
      if (opt_.drop_policy == EpDropPolicy::Probs && probs.defined()) {
        at::Tensor by_prob =
            std::get<1>(at::sort(probs.to(at::kFloat), /*stable=*/true, 0, /*descending=*/true));
        at::Tensor order = by_prob.index_select(
            0, std::get<1>(at::sort(dest.index_select(0, by_prob), /*stable=*/true, 0, false)));
        at::Tensor d_order = dest.index_select(0, order);
        rank_in_block =
            at::empty_like(rows).index_copy_(0, order, rows - dest_start.index_select(0, d_order));
      } else {
        rank_in_block = rows - dest_start.index_select(0, dest);
      }
      at::Tensor keep = rank_in_block < C;  // (N) bool
      at::Tensor keep_l = keep.to(at::kLong);
      // Place of each kept row among its block's kept rows, in expert order: slot dest*C + it.
      at::Tensor kc = at::cat({at::zeros({1}, idx), keep_l.cumsum(0)});  // (N + 1)
      at::Tensor kpos = kc.narrow(0, 0, N) - kc.index_select(0, dest_start.index_select(0, dest));
      plan->back = at::where(keep, dest * C + kpos, at::full({}, P * C, idx));
      // Slot (p, q) reads its kept row, or the appended zero row N: the inverse of `back`,
      // where each dropped row lands in a spare slot of its own past P*C (no duplicate index),
      // cut off after.
      send_idx = at::full({P * C + N}, N, idx)
                     .index_copy_(0, at::where(keep, plan->back, P * C + rows), rows)
                     .narrow(0, 0, P * C);
      r.dropped = (per_dest - C).clamp_min(0).sum();
      // The kept rows per expert go to their ranks instead of the counts: slot q of source s
      // belongs to the local expert whose cumulative kept rows first exceed q; El past them.
      at::Tensor kept = at::zeros({E}, idx).index_add_(0, expert, keep_l);
      r.recv_counts = known ? known->recv_counts : exchange_counts(kept, P, El);
      at::Tensor kept_end = r.recv_counts.view({P, El}).cumsum(1);  // (P, El), each <= C
      at::Tensor q = at::arange(C, idx);
      r.local_expert = at::searchsorted(kept_end, q.unsqueeze(0).expand({P, C}).contiguous(),
                                        /*out_int32=*/false, /*right=*/true)
                           .reshape({-1});
      if (training) {  // the step's overflow and its peak pair load, agreed at the step's end
        if (!overflow_.defined()) overflow_ = at::zeros({2}, idx);
        overflow_.select(0, 0).add_(r.dropped);
        at::Tensor peak = overflow_.select(0, 1);
        // amax over a dim, not max(): the CPU's all-element max fills its result from a host
        // value, which the capture check rightly reads as a scalar changing between steps.
        peak.copy_(at::maximum(peak, per_dest.amax(0)));
      }
    }
    at::Tensor send = at::cat({x, at::zeros({1, D}, x.options())}).index_select(0, send_idx);
    const std::vector<int64_t> even(static_cast<size_t>(P), C);
    r.rows = rows_all_to_all(pg_, send, even, even);  // (P*C, D)
    r.has_empty_slots = true;
    r.plan = plan;
    return r;
  }

  ProcessGroup& pg_;
  EpExchangeOptions opt_;
  bool logged_ = false;
  bool exact_ = false;  // force_exact
  int64_t rows_ = 0, top_k_ = 1, El_ = 1, row_bytes_ = 0;  // of the last dispatch
  at::Tensor overflow_, agreed_;  // (2) int64: [rows over capacity, peak pair rows]
  int64_t exact_peak_ = 0;
};

std::string mib(double bytes) {
  std::ostringstream os;
  os.precision(bytes < 10 * 1048576.0 ? 2 : 0);
  os << std::fixed << bytes / 1048576.0 << " MiB";
  return os.str();
}

}  // namespace

int64_t ep_static_capacity(int64_t n, int64_t top_k, int64_t P, int64_t El, double factor) {
  const int64_t worst = n / std::max<int64_t>(top_k, 1) * std::min(top_k, El);
  if (!std::isfinite(factor)) return worst;
  const double c = std::ceil(factor * static_cast<double>(n) / static_cast<double>(P));
  return std::max<int64_t>(1, std::min<int64_t>(worst, static_cast<int64_t>(c)));
}

int64_t ep_static_buffer_bytes(int64_t n, int64_t top_k, int64_t P, int64_t El, int64_t dim,
                               int64_t elem_bytes, double factor) {
  return P * ep_static_capacity(n, top_k, P, El, factor) * dim * elem_bytes;
}

std::string ep_buffer_summary(const EpExchangeOptions& o, int64_t n, int64_t top_k, int64_t P,
                              int64_t El, int64_t dim, int64_t elem_bytes) {
  const double row = static_cast<double>(dim * elem_bytes);
  const int64_t worst = ep_static_capacity(n, top_k, P, El, INFINITY);
  const int64_t cap = ep_static_capacity(n, top_k, P, El, o.capacity_factor);
  std::ostringstream os;
  os << "=> MoE expert-parallel exchange = " << (o.fixed ? "static" : "exact")
     << "; receive buffer per MoE layer and forward, " << n << " routed rows of " << dim
     << " over " << P << " ranks: static " << P * cap << " rows = " << mib(P * cap * row)
     << " (capacity " << cap << " rows per pair";
  if (std::isfinite(o.capacity_factor))
    os << ", factor " << o.capacity_factor;
  else
    os << ", the no-overflow worst case";
  os << "), static worst case " << mib(P * worst * row) << ", exact " << mib(n * row)
     << " when balanced, up to " << mib(P * worst * row);
  if (o.fixed)
    os << (o.drop_policy == EpDropPolicy::Probs
               ? "; rows over capacity are dropped, lowest router probability first "
                 "(moe.ep_drop_policy = probs)"
               : "; a step that overflows is run again with the exact exchange (no drops)");
  return os.str();
}

std::shared_ptr<ExpertExchange> make_expert_exchange(ProcessGroup& ep_group,
                                                     const EpExchangeOptions& options) {
  return std::make_shared<ProcessGroupExchange>(ep_group, options);
}

}  // namespace titan
