// core/kernels/ops CPU kernels built for AVX2 + FMA (CMakeLists.txt sets -mavx2 -mfma and ATen's
// CPU_CAPABILITY=AVX2 for this file only, without the precompiled header); core/kernels/ops.cpp
// picks them when ATen's own CPU capability is AVX2 or AVX512.
#ifdef TITAN_OPS_AVX2
#define TITAN_OPS_TABLE cpu_kernels_avx2
#define TITAN_OPS_ISA "avx2"
#include "core/kernels/ops_cpu_kernels.h"
#else
#include "core/kernels/ops_kernels.h"
namespace titan::ops::detail {
const CpuKernels* cpu_kernels_avx2() {
  return nullptr;
}
}  // namespace titan::ops::detail
#endif
