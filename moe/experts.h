// Routed experts: one SwiGLU per expert, weights in torchtitan's GroupedExperts layout
// w1, w3: (E, hidden, dim), w2: (E, dim, hidden). The backends compute the same thing:
//   grouped_mm  the grouped experts op with at::_grouped_mm (CUDA 9.x/10.x); no host sync
//   cutlass     the grouped experts op with the device-scheduled CUTLASS grouped GEMM (CUDA
//               SM80 and up); no host sync
//   loop        one GEMM per expert; one device-to-host copy of the counts per forward (the
//               named syncing reference)
// (docs/moe.md).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "core/train/expert_exchange.h"
#include "moe/dispatch.h"
#include "moe/float8_grouped_gemm.h"
#include "moe/grouped_gemm.h"

namespace titan {

enum class ExpertsBackend { GroupedMM, Cutlass, Loop };
const char* experts_backend_name(ExpertsBackend b);
// The grouped kernel of a grouped backend for tensors on `device` (Cpu off CUDA).
GroupedKernel grouped_kernel(ExpertsBackend b, at::Device device);

// The GEMM sizes and compute dtype of a model's routed experts: what the grouped kernels
// need (sizes multiples of 8, bf16). The default (bf16, dim and hidden 8: every kernel fits)
// is for tests and callers that know no model.
struct ExpertsGemmShape {
  int64_t dim = 8, hidden = 8;
  at::ScalarType dtype = at::kBFloat16;
};

// A resolved moe.experts_backend and why; fell_back: a kernel was asked for (or auto would
// have picked it) that the device has but the shapes or dtype cannot use.
struct ExpertsChoice {
  ExpertsBackend backend = ExpertsBackend::Loop;
  std::string reason;
  bool fell_back = false;
};

// Resolves moe.experts_backend ("auto", "grouped_mm", "cutlass" or "loop") for a device of
// compute capability cc (0: the CPU). auto: grouped_mm on CUDA 9.x and 10.x, cutlass on every
// other CUDA GPU from 8.0 up (when the build holds it), loop on the CPU (where reading the
// counts is a memory read, not a device sync) and below 8.0. A grouped kernel whose device
// fits but whose shapes (not multiples of 8) or dtype (not bf16) do not is never chosen:
// the choice falls back to the other grouped kernel, else the loop, and says why (the loop
// then exits 2 under compile.enable: check_compile_config). Throws UserError when grouped_mm
// or cutlass is asked for on a device that cannot run it at all.
// static_step (compile.enable): on the CPU, auto picks grouped_mm's layout with the CPU kernel,
// the static step a captured GPU step runs (the loop's counts would break the capture check).
ExpertsChoice choose_experts_backend(const std::string& requested, int cc, bool static_step,
                                     const ExpertsGemmShape& shape, bool cutlass_built);
// The same for `device`, logged (a warning when it fell back).
ExpertsBackend select_experts_backend(const std::string& requested, at::Device device,
                                      bool static_step = false, const ExpertsGemmShape& shape = {});
// Compute capability major*10+minor of a CUDA device; 0 when CUDA is unavailable.
int cuda_compute_capability(at::Device device);

// Rows per group that the backend needs: 8 for the grouped backends (16 bytes of bf16), 0 for
// loop.
int64_t experts_alignment(ExpertsBackend b);

// GPT-OSS's additions to the routed experts (torchtitan's GptOssGroupedExperts): per-expert
// biases b1, b3 (E, hidden) and b2 (E, dim) on the three GEMMs, and its clamped SwiGLU
//   a = min(h1, limit) * sigmoid(alpha * min(h1, limit)) * (clamp(h3, -limit, limit) + 1)
// (h1 is torchtitan's x_glu, mlp1's even rows; h3 its x_linear, the odd rows). With no bias
// and limit 0 the experts are the plain SwiGLU of the functions above.
struct ExpertsExtras {
  at::Tensor b1, b2, b3;  // compute forms, or undefined
  double limit = 0, alpha = 1.702;
  bool active() const { return b1.defined() || limit > 0; }
};

// The clamped SwiGLU above, in h1's dtype (limit > 0); limit 0: silu(h1) * h3.
at::Tensor clamped_swiglu(const at::Tensor& h1, const at::Tensor& h3, double limit, double alpha);

// The experts with `ex` over rows grouped by offs (E) int32 (the aligned layout, as
// grouped_experts): composed autograd over one grouped GEMM op per product (its backward two
// grouped GEMMs), the biases gathered per row from the group each row falls in. Rows past
// offs[E-1] come back zero. Static shapes, no host read.
at::Tensor grouped_experts_extras(const at::Tensor& x_padded, const at::Tensor& w1,
                                  const at::Tensor& w2, const at::Tensor& w3,
                                  const ExpertsExtras& ex, const at::Tensor& offs,
                                  ExpertsBackend b);
// The same per expert over rows split by host_counts (the loop backend), plain autograd.
at::Tensor loop_experts_extras(const at::Tensor& x_sorted, const at::Tensor& w1,
                               const at::Tensor& w2, const at::Tensor& w3, const ExpertsExtras& ex,
                               const std::vector<int64_t>& host_counts);

// counts_to_host (core/train/expert_exchange.h) is the loop backend's one host read.

// The grouped experts op: one autograd function, h = silu(x w1^T) * (x w3^T), y = h w2^T per
// group, over rows grouped by offs (E) int32 cumulative end rows on x's device (rows past
// offs[E-1] are not computed; the aligned layout's last group runs to M). Its backward is
// five grouped GEMMs (two NN for dx, three TN for the weight gradients) plus the SwiGLU's
// elementwise gradient, with the same kernel. x (M, D) and the weights in one dtype: bf16 for
// the CUDA kernels. Saves x, the weights and the two hidden pre-activations.
// float8 (model.converters "quantize.grouped_mm.float8"): all eight GEMMs, forward and
// backward, are float8 grouped GEMMs (moe/float8_grouped_gemm.h) with that kernel; the
// emulation runs its dequantized operands through `k`.
at::Tensor grouped_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                          const at::Tensor& w3, const at::Tensor& offs, GroupedKernel k,
                          std::optional<Float8GroupedKernel> float8 = std::nullopt);

// x_padded: (M, D) rows in d's aligned layout (permute_tokens with an aligned dispatch).
// Returns (M, D) in x_padded's dtype, padding rows zero. On CUDA the GEMMs run in bf16 (as
// torchtitan does); on the CPU in x's dtype, through at::_grouped_mm's CPU kernel.
at::Tensor grouped_experts(const at::Tensor& x_padded, const at::Tensor& w1, const at::Tensor& w2,
                           const at::Tensor& w3, const Dispatch& d,
                           ExpertsBackend b = ExpertsBackend::GroupedMM,
                           std::optional<Float8GroupedKernel> float8 = std::nullopt);
// The same over explicit offsets (E) int32: rows past offs[E-1] are left unwritten.
at::Tensor grouped_experts(const at::Tensor& x_padded, const at::Tensor& w1, const at::Tensor& w2,
                           const at::Tensor& w3, const at::Tensor& offs, ExpertsBackend b,
                           std::optional<Float8GroupedKernel> float8 = std::nullopt);
// host_counts: rows per expert (sum N). An autograd function whose backward reuses the host
// counts, so backward adds no sync.
at::Tensor loop_experts(const at::Tensor& x_sorted, const at::Tensor& w1, const at::Tensor& w2,
                        const at::Tensor& w3, const std::vector<int64_t>& host_counts);

}  // namespace titan
