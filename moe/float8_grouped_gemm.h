// Float8 grouped GEMMs of the routed experts (docs/float8.md, "MoE experts"): the three
// products of moe/grouped_gemm.h with both operands cast to float8 e4m3 by torchao 0.18's
// rowwise recipe for grouped GEMMs (torchao.prototype.moe_training, _Float8GroupedMM):
// every scale is taken over the GEMM's reduction dimension and rounded down to a power of 2.
//   NT  a (M, K) . b[g]^T, b (E, N, K)   a per row (amax over K), b per expert and output
//                                         column (amax over K)                 forward
//   NN  a (M, N) . b[g],   b (E, N, K)   a per row (amax over N), b per expert and output
//                                         column (amax over N)                 input gradient
//   TN  a_g^T . b_g, a (M, N), b (M, K)  a and b per group and column (amax over the
//                                         group's rows)                        weight gradient
// Scales are device tensors from the current amax; the group of a row comes from a
// searchsorted of `offs` on the device: no host read, no data-dependent shape.
//
// Kernels:
//   ScaledGroupedMm  ATen's at::_scaled_grouped_mm (rowwise scales, bf16 output, fast
//                    accumulation, as torchao calls it): CUDA compute capability 9.0, bf16,
//                    GEMM sizes multiples of 16, groups of multiples of 16 rows.
//   Emulated         dequantize (float8 / scale; exact in bf16 and fp32, the scales being
//                    powers of 2), then the high-precision grouped GEMM of the experts'
//                    kernel (moe/grouped_gemm.h): in fp32 on the CPU (torchao's emulation),
//                    in the operands' dtype (bf16) on CUDA, rounded to the operands' dtype.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "moe/grouped_gemm.h"

namespace titan {

enum class Float8GroupedKernel { ScaledGroupedMm, Emulated };
const char* float8_grouped_kernel_name(Float8GroupedKernel k);

// Rows per expert group that float8 grouped GEMMs need (torchtitan's FP8_GROUP_ALIGNMENT_SIZE:
// 16 bytes of float8).
constexpr int64_t kFloat8GroupAlignment = 16;

// The kernel for experts of GEMM sizes dim x hidden computing in `dtype` on a device of
// compute capability cc (0: the CPU); `why` gets the reason (for the start-up line).
Float8GroupedKernel choose_float8_grouped_kernel(int cc, int64_t dim, int64_t hidden,
                                                 at::ScalarType dtype, std::string* why);

// One float8 grouped GEMM (shapes as grouped_gemm's). a, b: fp32 or bf16, one dtype; offs
// (E) int32 on a's device; rows past offs[E-1] belong to no group. Returns a's dtype
// (ScaledGroupedMm: bf16 operands only). `k`: the high-precision kernel the emulation uses.
at::Tensor float8_grouped_gemm(GemmForm form, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& offs, GroupedKernel k, Float8GroupedKernel f8);

}  // namespace titan
