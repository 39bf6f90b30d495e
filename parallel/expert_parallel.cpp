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

  Received dispatch(const at::Tensor& x_sorted, const at::Tensor& counts) override {
    const int64_t P = pg_.size(), E = counts.size(0), El = E / P;
    TORCH_CHECK(El * P == E, "expert parallelism: ", E, " experts over ", P, " ranks");
    // 1. Counts: recv_counts[src * El + j] = rows rank src sends to local expert j.
    at::Tensor send_counts = counts.to(at::kLong).contiguous();
    at::Tensor recv_counts = at::empty({E}, send_counts.options());
    const std::vector<int64_t> even(static_cast<size_t>(P), El);
    {
      at::NoGradGuard ng;
      pg_.all_to_all(recv_counts, send_counts, even, even);
    }
    // 2. The expert-parallel host sync: the row splits must be host integers.
    at::Tensor both = at::cat({send_counts, recv_counts}).to(at::kCPU);
    const int64_t* c = both.data_ptr<int64_t>();
    auto plan = std::make_shared<Plan>();
    plan->in_splits.assign(static_cast<size_t>(P), 0);
    plan->out_splits.assign(static_cast<size_t>(P), 0);
    Received r;
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
    auto [perm, inv] = regroup(c + E, P, El, x_sorted.device());
    plan->inv = inv;
    r.rows = recv.index_select(0, perm);
    r.plan = plan;
    return r;
  }

  at::Tensor combine(const at::Tensor& y, const Received& r) override {
    const auto& plan = *static_cast<const Plan*>(r.plan.get());
    at::Tensor y_recv = y.index_select(0, plan.inv);  // back to [src][expert]
    return AllToAll::apply(y_recv, reinterpret_cast<int64_t>(&pg_), plan.in_splits,
                           plan.out_splits)[0];
  }

 private:
  // recv[s * El + j]: rows from source s for local expert j. Returns the gather index that
  // turns [src][expert] blocks into [expert][src] blocks, and its inverse.
  static std::pair<at::Tensor, at::Tensor> regroup(const int64_t* recv, int64_t P, int64_t El,
                                                   at::Device device) {
    std::vector<int64_t> block_start(static_cast<size_t>(P * El));
    int64_t pos = 0;
    for (int64_t s = 0; s < P * El; ++s) {
      block_start[static_cast<size_t>(s)] = pos;
      pos += recv[s];
    }
    std::vector<int64_t> perm;
    perm.reserve(static_cast<size_t>(pos));
    for (int64_t j = 0; j < El; ++j)
      for (int64_t s = 0; s < P; ++s) {
        const int64_t b = block_start[static_cast<size_t>(s * El + j)];
        for (int64_t i = 0; i < recv[s * El + j]; ++i) perm.push_back(b + i);
      }
    std::vector<int64_t> inv(perm.size());
    for (size_t i = 0; i < perm.size(); ++i)
      inv[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
    const auto idx = at::TensorOptions().dtype(at::kLong);
    return {at::tensor(perm, idx).to(device), at::tensor(inv, idx).to(device)};
  }

  ProcessGroup& pg_;
};

}  // namespace

std::shared_ptr<ExpertExchange> make_expert_exchange(ProcessGroup& ep_group) {
  return std::make_shared<ProcessGroupExchange>(ep_group);
}

}  // namespace titan
