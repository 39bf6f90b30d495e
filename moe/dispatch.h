// Token dispatch: the (token, choice) slots sorted by expert, and the aligned layout that
// grouped GEMMs need. Everything is computed on the device with static shapes: no .item(),
// no nonzero(), no host sync (docs/moe.md).
#pragma once

#include <ATen/ATen.h>

namespace titan {

struct Dispatch {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  at::Tensor order;   // (N,) int64, N = T*K: slot t*K + k of each row in expert order (stable)
  at::Tensor counts;  // (E,) int64: rows per expert
  at::Tensor tokens;  // (N,) int64: the token (order / K) of each row in expert order
  // The aligned layout (align > 0): each expert's group padded with zero rows to a multiple
  // of `align` rows (at least `align`), groups back to back in expert order. With it,
  // permute_tokens writes the aligned layout directly and combine_tokens reads it directly:
  // one gather each way, no separate pad or unpad copy (docs/moe.md).
  int64_t align = 0;
  int64_t padded_rows = 0;  // M = round_up(N + E * align, align): static, an upper bound
  at::Tensor rows;          // (N,) int64: row in the aligned layout of each sorted row
  at::Tensor offs;          // (E,) int32: cumulative end row of each group; offs[E-1] = M
  at::Tensor padded_order;  // (M,) int64: slot of each aligned row; padding rows: slot 0
  at::Tensor gather_tokens;   // (M,) int64: token of each aligned row; padding rows: 0
  at::Tensor scatter_tokens;  // (M,) int64: the same, but padding rows: T (a spare row)
  at::Tensor pad_rows;        // (M - N,) int64: the padding rows, ascending

  // Rows of the layout permute_tokens produces: N, or M when aligned.
  int64_t layout_rows() const { return align > 0 ? padded_rows : order.size(0); }
};

// experts: (T, K) int64 expert choices. align = 0 skips the aligned layout.
Dispatch plan_dispatch(const at::Tensor& experts, int64_t num_experts, int64_t align);

// x: (T, D) -> token rows in expert order (each token K times): (N, D), or the aligned
// layout (M, D) with zero padding rows when d is aligned. One gather; its backward is one
// index_add into (T, D).
at::Tensor permute_tokens(const at::Tensor& x, const Dispatch& d);
// per_slot: (T, K) or (N,) values per (token, choice) slot -> the same layout as
// permute_tokens: (N,) or (M,) (padding rows take slot 0's value).
at::Tensor permute_slots(const at::Tensor& per_slot, const Dispatch& d);
// y: (N, D) in expert order -> (T, K, D) back in slot order (unaligned dispatch only).
at::Tensor unpermute_tokens(const at::Tensor& y, const Dispatch& d);
// y: rows in permute_tokens' layout ((N, D), or (M, D) when aligned), weights: per row in
// the same layout, fp32, or undefined (all 1) -> (T, D) in y's dtype: out[t] = sum of
// weights[i] * y[i] over the K rows i of token t, accumulated in fp32 by one index_add into
// (T, D); padding rows are skipped (their gradient is zero). Replaces a zero (N, D) scatter
// plus a (T, K, D) reduction, and, aligned, an unpad copy.
at::Tensor combine_tokens(const at::Tensor& y, const at::Tensor& weights, const Dispatch& d);
// (M, D) aligned layout -> (N, D) in expert order (expert parallelism, whose rows arrive
// already in expert order).
at::Tensor unpad_groups(const at::Tensor& y_padded, const Dispatch& d);

}  // namespace titan
