#include "parallel/expert_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

namespace titan {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t n = 0;
  for (int64_t x : v) n += x;
  return n;
}

// Differentiable row all-to-all: the gradient travels back along the reversed splits.
struct AllToAll : public torch::autograd::Function<AllToAll> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t pg_ptr,
                               std::vector<int64_t> out_splits, std::vector<int64_t> in_splits) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(pg_ptr);
    ctx->saved_data["pg"] = pg_ptr;
    ctx->saved_data["out"] = out_splits;
    ctx->saved_data["in"] = in_splits;
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = sum_of(out_splits);
    at::Tensor out = at::empty(shape, x.options());
    pg.all_to_all(out, x.contiguous(), out_splits, in_splits);
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(ctx->saved_data["pg"].toInt());
    auto out_splits = ctx->saved_data["out"].toIntVector();
    auto in_splits = ctx->saved_data["in"].toIntVector();
    std::vector<int64_t> shape = g[0].sizes().vec();
    shape[0] = sum_of(in_splits);
    at::Tensor gx = at::empty(shape, g[0].options());
    pg.all_to_all(gx, g[0].contiguous(), in_splits, out_splits);
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct Plan {
  std::vector<int64_t> in_splits, out_splits;  // rows sent to / received from each rank
  at::Tensor inv;                              // [expert][src] order -> [src][expert] order
};

class ProcessGroupExchange : public ExpertExchange {
 public:
  explicit ProcessGroupExchange(ProcessGroup& pg) : pg_(pg) {}
  int64_t size() const override { return pg_.size(); }
  int64_t rank() const override { return pg_.rank(); }

  Received dispatch(const at::Tensor& x_sorted, const at::Tensor& counts,
                    const std::vector<int64_t>* known_splits) override {
    const int64_t P = pg_.size(), E = counts.size(0), El = E / P;
    TORCH_CHECK(El * P == E, "expert parallelism: ", E, " experts over ", P, " ranks");
    Received r;
    if (known_splits) {
      TORCH_CHECK(static_cast<int64_t>(known_splits->size()) == 2 * E,
                  "expert parallelism: cached splits for another expert count");
      r.splits = *known_splits;
    } else {
      r.splits = exchange_counts(counts, P, El);
    }
    const int64_t* c = r.splits.data();
    at::Tensor recv_counts =
        at::tensor(std::vector<int64_t>(r.splits.begin() + E, r.splits.end()),
                   at::TensorOptions().dtype(at::kLong))
            .to(x_sorted.device());
    auto plan = std::make_shared<Plan>();
    plan->in_splits.assign(static_cast<size_t>(P), 0);
    plan->out_splits.assign(static_cast<size_t>(P), 0);
    r.local_counts.assign(static_cast<size_t>(El), 0);
    for (int64_t s = 0; s < P; ++s)
      for (int64_t j = 0; j < El; ++j) {
        plan->in_splits[static_cast<size_t>(s)] += c[s * El + j];
        plan->out_splits[static_cast<size_t>(s)] += c[E + s * El + j];
        r.local_counts[static_cast<size_t>(j)] += c[E + s * El + j];
      }
    // 3. Rows out: x_sorted is in expert order, so each destination's rows are contiguous.
    at::Tensor recv = AllToAll::apply(x_sorted, reinterpret_cast<int64_t>(&pg_), plan->out_splits,
                                      plan->in_splits)[0];  // (R, D): [src][local expert]
    // 4. Regroup [src][expert] -> [expert][src].
    auto [perm, inv] = regroup(recv_counts, P, El, recv.size(0));
    plan->inv = inv;
    r.rows = recv.index_select(0, perm);
    r.plan = plan;
    return r;
  }

  // 1. recv_counts[src * El + j] = rows rank src sends to local expert j. 2. The expert-
  // parallel host sync: the row splits must be host integers. Returns send (E) then recv (E).
  std::vector<int64_t> exchange_counts(const at::Tensor& counts, int64_t P, int64_t El) {
    at::NoGradGuard ng;
    at::Tensor send_counts = counts.to(at::kLong).contiguous();
    at::Tensor recv_counts = at::empty_like(send_counts);
    const std::vector<int64_t> even(static_cast<size_t>(P), El);
    pg_.all_to_all(recv_counts, send_counts, even, even);
    at::Tensor both = at::cat({send_counts, recv_counts}).to(at::kCPU);
    return std::vector<int64_t>(both.data_ptr<int64_t>(), both.data_ptr<int64_t>() + both.numel());
  }

  at::Tensor combine(const at::Tensor& y, const Received& r) override {
    const auto& plan = *static_cast<const Plan*>(r.plan.get());
    at::Tensor y_recv = y.index_select(0, plan.inv);  // back to [src][expert]
    return AllToAll::apply(y_recv, reinterpret_cast<int64_t>(&pg_), plan.in_splits,
                           plan.out_splits)[0];
  }

 private:
  // recv: (P * El) int64 on the device, recv[s * El + j] rows from source s for local
  // expert j; R = their sum (known on the host). Returns the gather index that turns
  // [src][expert] blocks into [expert][src] blocks, and its inverse, built on the device
  // from the counts (no host loop over rows, no host-to-device copy of R indices).
  static std::pair<at::Tensor, at::Tensor> regroup(const at::Tensor& recv, int64_t P, int64_t El,
                                                   int64_t R) {
    at::NoGradGuard ng;
    at::Tensor start = at::cumsum(recv, 0) - recv;                // block starts, [src][expert]
    at::Tensor len_t = recv.view({P, El}).t().reshape({-1});      // sizes in [expert][src] order
    at::Tensor start_t = start.view({P, El}).t().reshape({-1});   // their source starts
    at::Tensor dest_start = at::cumsum(len_t, 0) - len_t;         // where each block lands
    // Output row i of block b sits at dest_start[b] + o and reads source row start_t[b] + o.
    at::Tensor iota = at::arange(R, recv.options());
    at::Tensor perm = iota + at::repeat_interleave(start_t - dest_start, len_t, /*dim=*/0,
                                                   /*output_size=*/R);
    at::Tensor inv = at::empty_like(perm).index_put_({perm}, iota);
    return {perm, inv};
  }

  ProcessGroup& pg_;
};

}  // namespace

std::shared_ptr<ExpertExchange> make_expert_exchange(ProcessGroup& ep_group) {
  return std::make_shared<ProcessGroupExchange>(ep_group);
}

}  // namespace titan
