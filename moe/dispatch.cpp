#include "moe/dispatch.h"

#include <torch/csrc/autograd/custom_function.h>

namespace titan {

namespace {

// The aligned layout's index maps, from the rows of the sorted slots: which slot and token
// each of the M rows holds, and which rows are padding. Device arithmetic with static sizes
// (the M - N padding rows come first in a stable descending sort of the padding mask).
void plan_aligned_maps(Dispatch& d, int64_t T) {
  const int64_t M = d.padded_rows, N = d.order.size(0);
  auto idx = d.order.options();
  d.padded_order = at::zeros({M}, idx).index_copy_(0, d.rows, d.order);
  at::Tensor is_pad = at::ones({M}, idx.dtype(at::kInt)).index_fill_(0, d.rows, 0);
  d.gather_tokens = d.padded_order.div(d.top_k, "floor");
  d.scatter_tokens = d.gather_tokens.masked_fill(is_pad.to(at::kBool), T);
  auto [flags, by_pad] = at::sort(is_pad, /*stable=*/true, /*dim=*/0, /*descending=*/true);
  d.pad_rows = by_pad.narrow(0, 0, M - N);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x (T, D) -> (M, D): one gather by token, padding rows zeroed in place (M - N rows).
// Backward: one index_add of the (M, D) gradient into a (T + 1, D) buffer whose spare last
// row takes the padding rows, then shrunk to its first T rows.
struct PaddedPermute : public torch::autograd::Function<PaddedPermute> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gather,
                            const at::Tensor& scatter, const at::Tensor& pad_rows) {
    ctx->saved_data["rows"] = x.size(0);
    ctx->saved_data["scatter"] = scatter;
    // No rows at all (an expert-parallel rank that collapsed routing sends nothing): every
    // row is padding, and a gather from an empty x would be refused (index_select needs a
    // non-empty source even for the padding rows' index 0).
    if (x.size(0) == 0) return at::zeros({gather.size(0), x.size(1)}, x.options());
    at::Tensor out = x.index_select(0, gather);
    out.index_fill_(0, pad_rows, 0);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const int64_t T = ctx->saved_data["rows"].toInt();
    const at::Tensor& g = go[0];
    at::Tensor dx = at::zeros({T + 1, g.size(1)}, g.options())
                        .index_add_(0, ctx->saved_data["scatter"].toTensor(), g)
                        .resize_({T, g.size(1)});  // drops the spare row, keeps the storage
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// y (M, D) [* weights (M,)] -> (T, D): one index_add into a (T + 1, D) fp32 buffer (padding
// rows land in the spare row). Backward: one gather of the (T, D) gradient, padding rows
// zeroed in place. Unweighted: `weights` is an empty placeholder (a custom Function takes no
// undefined tensor).
struct PaddedCombine : public torch::autograd::Function<PaddedCombine> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& weights,
                            const at::Tensor& gather, const at::Tensor& scatter,
                            const at::Tensor& pad_rows, int64_t T) {
    const bool weighted = weights.numel() > 0;
    at::Tensor src = y.to(at::kFloat);  // no copy in fp32
    if (weighted) src = src * weights.unsqueeze(1);
    // resize_ drops the spare row in place: the result is no view (a view made inside a
    // custom Function could not be modified in place later).
    at::Tensor out = at::zeros({T + 1, y.size(1)}, src.options())
                         .index_add_(0, scatter, src)
                         .resize_({T, y.size(1)})
                         .to(y.scalar_type());
    ctx->saved_data["gather"] = gather;
    ctx->saved_data["pad_rows"] = pad_rows;
    ctx->saved_data["weighted"] = weighted;
    if (weighted) ctx->save_for_backward({y, weights});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const at::Tensor& gather = ctx->saved_data["gather"].toTensor();
    const at::Tensor& pad_rows = ctx->saved_data["pad_rows"].toTensor();
    if (!ctx->saved_data["weighted"].toBool()) {
      // Unweighted, the gradient is the gathered output gradient as is: gather it in its own
      // dtype (an fp32 round trip of bf16 values would change nothing).
      at::Tensor dy = go[0].index_select(0, gather).index_fill_(0, pad_rows, 0);  // (M, D)
      return {dy, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    at::Tensor gs = go[0].to(at::kFloat).index_select(0, gather).index_fill_(0, pad_rows, 0);
    auto saved = ctx->get_saved_variables();
    const at::Tensor &y = saved[0], &w = saved[1];
    at::Tensor dw = ctx->needs_input_grad(1) ? (gs * y.to(at::kFloat)).sum(1) : at::Tensor();
    at::Tensor dy = (gs * w.unsqueeze(1)).to(y.scalar_type());
    return {dy, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

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
  plan_aligned_maps(d, experts.size(0));
  return d;
}

at::Tensor permute_tokens(const at::Tensor& x, const Dispatch& d) {
  if (d.align > 0) return PaddedPermute::apply(x, d.gather_tokens, d.scatter_tokens, d.pad_rows);
  return x.index_select(0, d.tokens);  // (N, D)
}

at::Tensor permute_slots(const at::Tensor& per_slot, const Dispatch& d) {
  // No slots (N = 0): the aligned layout is all padding, which takes slot 0's value (none).
  if (per_slot.numel() == 0 && d.align > 0) return at::zeros({d.padded_rows}, per_slot.options());
  return per_slot.reshape({-1}).index_select(0, d.align > 0 ? d.padded_order : d.order);
}

at::Tensor combine_tokens(const at::Tensor& y, const at::Tensor& weights, const Dispatch& d) {
  const int64_t T = d.order.size(0) / d.top_k;
  if (d.align > 0)
    return PaddedCombine::apply(y, weights.defined() ? weights : at::empty({0}, y.options()),
                                d.gather_tokens, d.scatter_tokens, d.pad_rows, T);
  at::Tensor src = y.to(at::kFloat);  // (N, D), no copy in fp32
  if (weights.defined()) src = src * weights.unsqueeze(1);
  // index_add's gradient to src is a gather of the (T, D) gradient: no (N, D) zeros either way.
  return at::zeros({T, y.size(1)}, src.options()).index_add(0, d.tokens, src).to(y.scalar_type());
}

at::Tensor unpermute_tokens(const at::Tensor& y, const Dispatch& d) {
  TORCH_CHECK(d.align == 0, "unpermute_tokens: takes rows in expert order, not aligned");
  const int64_t N = y.size(0), D = y.size(1);
  // Scatter with unique indices: its gradient is a gather.
  at::Tensor out = at::index_put(at::zeros({N, D}, y.options()), {d.order}, y);
  return out.view({N / d.top_k, d.top_k, D});
}

at::Tensor unpad_groups(const at::Tensor& y_padded, const Dispatch& d) {
  return y_padded.index_select(0, d.rows);
}

}  // namespace titan
