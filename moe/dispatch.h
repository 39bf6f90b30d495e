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
  // of `align` rows (at least `align`), groups back to back in expert order.
  int64_t align = 0;
  int64_t padded_rows = 0;  // M = round_up(N + E * align, align): static, an upper bound
  at::Tensor rows;          // (N,) int64: row in the aligned layout of each sorted row
  at::Tensor offs;          // (E,) int32: cumulative end row of each group; offs[E-1] = M
};

// experts: (T, K) int64 expert choices. align = 0 skips the aligned layout.
Dispatch plan_dispatch(const at::Tensor& experts, int64_t num_experts, int64_t align);

// x: (T, D) -> (N, D): token rows in expert order (each token K times).
at::Tensor permute_tokens(const at::Tensor& x, const Dispatch& d);
// y: (N, D) in expert order -> (T, K, D) back in slot order.
at::Tensor unpermute_tokens(const at::Tensor& y, const Dispatch& d);
// y: (N, D) in expert order, weights: (N,) fp32 per row or undefined (all 1) -> (T, D) in y's
// dtype: out[t] = sum of weights[i] * y[i] over the K rows i of token t, accumulated in fp32
// by one index_add into (T, D). Replaces a zero (N, D) scatter plus a (T, K, D) reduction.
at::Tensor combine_tokens(const at::Tensor& y, const at::Tensor& weights, const Dispatch& d);
// (N, D) in expert order -> (M, D) aligned layout; padding rows are zero.
at::Tensor pad_groups(const at::Tensor& x_sorted, const Dispatch& d);
// (M, D) aligned layout -> (N, D) in expert order.
at::Tensor unpad_groups(const at::Tensor& y_padded, const Dispatch& d);

}  // namespace titan
