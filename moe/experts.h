// Routed experts: one SwiGLU per expert, weights in torchtitan's GroupedExperts layout
// w1, w3: (E, hidden, dim), w2: (E, dim, hidden). Two backends compute the same thing:
//   grouped_mm  at::_grouped_mm over the aligned layout; no host sync (CUDA SM90+, bf16)
//   loop        one GEMM per expert; one device-to-host copy of the counts per forward
// (docs/moe.md).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "moe/dispatch.h"

namespace titan {

enum class ExpertsBackend { GroupedMM, Loop };
const char* experts_backend_name(ExpertsBackend b);

// Resolves moe.experts_backend ("auto", "grouped_mm" or "loop") for `device`: auto picks
// grouped_mm on a CUDA device of compute capability >= 9.0 and loop otherwise. Logs the choice
// and the reason. Throws UserError when grouped_mm is asked for where it cannot run.
ExpertsBackend select_experts_backend(const std::string& requested, at::Device device);
// Compute capability major*10+minor of a CUDA device; 0 when CUDA is unavailable.
int cuda_compute_capability(at::Device device);

// Rows per group that the backend needs: 8 for grouped_mm (16 bytes of bf16), 0 for loop.
int64_t experts_alignment(ExpertsBackend b);

// The loop backend's one host sync: the per-expert counts as host integers.
std::vector<int64_t> counts_to_host(const at::Tensor& counts);

// x_padded: (M, D) rows in d's aligned layout (permute_tokens with an aligned dispatch).
// Returns (M, D) in x_padded's dtype, padding rows zero. On CUDA the GEMMs run in bf16 (as torchtitan does); elsewhere in x's dtype, where
// at::_grouped_mm falls back to a per-group loop (tests and benchmarks only).
at::Tensor grouped_experts(const at::Tensor& x_padded, const at::Tensor& w1, const at::Tensor& w2,
                           const at::Tensor& w3, const Dispatch& d);
// host_counts: rows per expert (sum N). An autograd function whose backward reuses the host
// counts, so backward adds no sync.
at::Tensor loop_experts(const at::Tensor& x_sorted, const at::Tensor& w1, const at::Tensor& w2,
                        const at::Tensor& w3, const std::vector<int64_t>& host_counts);

}  // namespace titan
