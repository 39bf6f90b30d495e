#include "moe/dispatch.h"

namespace titan {

Dispatch plan_dispatch(const at::Tensor& experts, int64_t num_experts, int64_t align) {
  TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == at::kLong,
              "plan_dispatch: experts must be (T, K) int64");
  Dispatch d;
  d.num_experts = num_experts;
  d.top_k = experts.size(1);
  const int64_t N = experts.numel();
  at::Tensor flat = experts.reshape({-1});
  // Stable, so rows of one expert keep token order (torchtitan's argsort(stable=True)).
  auto [sorted, order] = at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  d.order = order;
  d.tokens = order.div(d.top_k, "floor");
  // ends[e] = number of rows with expert <= e: a binary search per expert, no histogram
  // kernel (histc does not take int64 on CPU; bincount syncs for its output size).
  at::Tensor ids = at::arange(num_experts, experts.options());
  at::Tensor ends = at::searchsorted(sorted, ids, /*out_int32=*/false, /*right=*/true);  // (E,)
  at::Tensor starts = at::cat({at::zeros({1}, ends.options()), ends.slice(0, 0, num_experts - 1)});
  d.counts = ends - starts;
  if (align <= 0) return d;

  d.align = align;
  d.padded_rows = (N + num_experts * align + align - 1) / align * align;
  // Each group is rounded up to `align` rows and never empty (torchtitan pads empty experts
  // to `align` too), so sum(padded) <= N + E * align <= M.
  at::Tensor padded = (at::clamp_min(d.counts, align) + (align - 1)).div(align, "floor") * align;
  at::Tensor padded_ends = at::cumsum(padded, 0);      // (E,)
  at::Tensor shift = (padded_ends - padded) - starts;  // (E,): where each group moves
  d.rows = at::arange(N, experts.options()) + shift.index_select(0, sorted);
  // The last group runs to M so no output row is left uninitialized by the grouped GEMM.
  at::Tensor offs = padded_ends.to(at::kInt);
  offs.select(0, num_experts - 1).fill_(static_cast<int>(d.padded_rows));
  d.offs = offs;
  return d;
}

at::Tensor permute_tokens(const at::Tensor& x, const Dispatch& d) {
  return x.index_select(0, d.tokens);  // (N, D)
}

at::Tensor combine_tokens(const at::Tensor& y, const at::Tensor& weights, const Dispatch& d) {
  const int64_t T = y.size(0) / d.top_k;
  at::Tensor src = y.to(at::kFloat);  // (N, D), no copy in fp32
  if (weights.defined()) src = src * weights.unsqueeze(1);
  // index_add's gradient to src is a gather of the (T, D) gradient: no (N, D) zeros either way.
  return at::zeros({T, y.size(1)}, src.options()).index_add(0, d.tokens, src).to(y.scalar_type());
}

at::Tensor unpermute_tokens(const at::Tensor& y, const Dispatch& d) {
  const int64_t N = y.size(0), D = y.size(1);
  // Scatter with unique indices: its gradient is a gather.
  at::Tensor out = at::index_put(at::zeros({N, D}, y.options()), {d.order}, y);
  return out.view({N / d.top_k, d.top_k, D});
}

at::Tensor pad_groups(const at::Tensor& x_sorted, const Dispatch& d) {
  TORCH_CHECK(d.align > 0, "pad_groups: dispatch planned without alignment");
  return at::index_put(at::zeros({d.padded_rows, x_sorted.size(1)}, x_sorted.options()), {d.rows},
                       x_sorted);
}

at::Tensor unpad_groups(const at::Tensor& y_padded, const Dispatch& d) {
  return y_padded.index_select(0, d.rows);
}

}  // namespace titan
