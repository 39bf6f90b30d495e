// Internal to moe/grouped_gemm: the raw-pointer interface of the device-scheduled CUTLASS
// grouped GEMM (moe/grouped_gemm_cutlass.cu). No ATen or CUDA types, so nvcc compiles the
// CUTLASS translation unit without LibTorch's headers (docs/moe.md).
#pragma once

#include <cstdint>

namespace titan::moe_detail {

// The three products of the experts op, each over E groups of rows given by int32 cumulative
// end offsets `offs` (E) on the device (group g = rows [offs[g-1], offs[g]), offs[-1] = 0):
//   NT  out (M, N) bf16, out_g = a_g (m_g, K) . b[g]^T,  b (E, N, K)   forward
//   NN  out (M, K) bf16, out_g = a_g (m_g, N) . b[g],    b (E, N, K)   input gradient
//   TN  out (E, N, K),   out[g] = a_g^T (N, m_g) . b_g (m_g, K), a (M, N), b (M, K)
//                                                                       weight gradient
// All operands are contiguous row-major bf16; accumulation in fp32.
enum class GemmForm : int { NT = 0, NN = 1, TN = 2 };

struct GroupedGemmArgs {
  GemmForm form = GemmForm::NT;
  const void* a = nullptr;
  const void* b = nullptr;
  const int32_t* offs = nullptr;  // (E) device
  void* out = nullptr;
  int64_t E = 0, M = 0, N = 0, K = 0;  // M: rows of the grouped operand(s)
  void* workspace = nullptr;           // grouped_gemm_workspace_bytes(E), device, 16-aligned
  void* stream = nullptr;              // cudaStream_t
};

// Bytes of device workspace that one call needs for E groups (problem sizes, pointers,
// leading dimensions: written on the device from offs, never read on the host).
int64_t grouped_gemm_workspace_bytes(int64_t E);
// Launches the setup kernel and the grouped GEMM on args.stream: two launches, no host
// synchronization, a grid sized from the device's occupancy only. Returns nullptr, or
// what went wrong.
const char* cutlass_grouped_gemm_bf16(const GroupedGemmArgs& args);

}  // namespace titan::moe_detail
