// The grouped GEMMs of the experts op (moe/experts.h), over groups of rows given by int32
// cumulative end offsets on the tensor's device, with one kernel per device (docs/moe.md):
//   GroupedMM  at::_grouped_mm: CUDA compute capability 9.x and 10.x (CUTLASS 3.x inside
//              LibTorch; sync-free only there)
//   Cutlass    the device-scheduled CUTLASS 2.x grouped GEMM (moe/grouped_gemm_cutlass.cu):
//              any CUDA GPU from SM80 up, bf16 with fp32 accumulation
//   Cpu        at::_grouped_mm's CPU kernel (one GEMM per group; reading CPU offsets is no sync)
// None of them reads the offsets on the host of a CUDA device.
#pragma once

#include <ATen/ATen.h>

#include "moe/grouped_gemm_kernels.h"

namespace titan {

using moe_detail::GemmForm;

enum class GroupedKernel { GroupedMM, Cutlass, Cpu };
const char* grouped_kernel_name(GroupedKernel k);

// Whether this build holds the CUTLASS kernel (nvcc and the nvidia-cutlass headers found).
bool cutlass_grouped_gemm_built();

// The products of grouped_gemm_kernels.h: a (M, .), b (E, N, K) for NT and NN, b (M, K) for
// TN; offs (E) int32 on a's device. On CUDA the operands must be bf16 (Cutlass) or bf16 /
// fp32 as at::_grouped_mm allows; on CPU the Cpu kernel runs whatever `k` says.
at::Tensor grouped_gemm(GemmForm form, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& offs, GroupedKernel k);

}  // namespace titan
