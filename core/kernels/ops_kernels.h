// Internal to core/kernels/ops: raw-pointer argument blocks shared by the CPU kernels (built once per
// instruction set, core/kernels/ops_cpu_*.cpp) and the CUDA kernels (core/kernels/ops.cu). No ATen types here,
// so the AVX2 translation unit and nvcc see nothing they would compile differently.
#pragma once

#include <cstdint>

namespace titan::ops::detail {

// Element type of activations. Weights, tables and statistics are always fp32.
enum class Elem : int { kFloat = 0, kBFloat16 = 1 };

// A 2-D view of rows: row r starts at data + r * row_stride elements; within a row,
// elements are contiguous. Lets kernels read chunks of fused projections in place.
struct Rows {
  const void* data = nullptr;
  int64_t row_stride = 0;
};

struct RmsNormFwdArgs {
  Rows x;               // (rows, D)
  const float* w;       // (D)
  void* y;              // (rows, D) contiguous, x's dtype
  float* rstd;          // (rows): 1 / sqrt(mean(x^2) + eps)
  int64_t D;
  float eps;
  Elem elem;
};

struct RmsNormBwdArgs {
  Rows x, g;            // (rows, D) each
  const float* w;       // (D)
  const float* rstd;    // (rows)
  void* dx;             // (rows, D) contiguous, or null when not needed
  int64_t D;
  Elem elem;
};

// x: (B, T, H, D) with unit stride in D; pairs (x[2i], x[2i+1]) rotate by angle t * f_i.
struct RopeArgs {
  const void* x;
  int64_t B, T, H, D;
  int64_t sb, st, sh;   // strides of x in elements
  const float* cos;     // (>= T, D / 2) contiguous
  const float* sin;
  void* y;              // (B, T, H, D) contiguous
  bool inverse;         // backward: rotate by -angle
  Elem elem;
};

struct SwigluArgs {
  Rows a, b, g;         // (rows, F) each; g only in backward
  void* out0;           // forward: silu(a) * b; backward: da. (rows, F) contiguous
  void* out1;           // backward: db; unused in forward
  int64_t F;
  Elem elem;
};

// CPU kernels over a range of rows [r0, r1); the caller splits rows across threads.
// rms_norm_bwd adds sum_r g * x * rstd over its rows into dw_part (D floats) when non-null.
struct CpuKernels {
  const char* isa;
  void (*rms_norm_fwd)(const RmsNormFwdArgs&, int64_t r0, int64_t r1);
  void (*rms_norm_bwd)(const RmsNormBwdArgs&, int64_t r0, int64_t r1, float* dw_part);
  void (*rope)(const RopeArgs&, int64_t r0, int64_t r1);  // rows of (B * T * H)
  void (*swiglu_fwd)(const SwigluArgs&, int64_t r0, int64_t r1);
  void (*swiglu_bwd)(const SwigluArgs&, int64_t r0, int64_t r1);
};

const CpuKernels* cpu_kernels_default();
const CpuKernels* cpu_kernels_avx2();  // null where not built (non-x86 hosts)

// Tests run every kernel set: ops called on this thread use k until reset with null (the
// automatic choice by ATen's CPU capability).
void set_thread_cpu_kernels(const CpuKernels* k);

#ifdef TITAN_HAVE_NVCC
// CUDA launchers on the current stream of the current device (the caller sets the device).
// rms_norm_bwd_cuda writes dw partial sums (parts, D) with rows_per_part rows each.
void rms_norm_fwd_cuda(const RmsNormFwdArgs&, int64_t rows);
void rms_norm_bwd_cuda(const RmsNormBwdArgs&, int64_t rows, float* dw_parts, int64_t parts,
                       int64_t rows_per_part);
void rope_cuda(const RopeArgs&);
void swiglu_fwd_cuda(const SwigluArgs&, int64_t rows);
void swiglu_bwd_cuda(const SwigluArgs&, int64_t rows);
#endif

}  // namespace titan::ops::detail
