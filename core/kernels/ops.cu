// CUDA kernels of core/kernels/ops: one thread block per row for the row reductions (RMSNorm), one
// thread per element or pair otherwise. fp32 math, fp32 or bf16 activations (Elem).
// Launched on the current stream; the caller has set the device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

#include "core/kernels/ops_kernels.h"

namespace titan::ops::detail {
namespace {

using bf16 = c10::BFloat16;

template <class T>
__device__ __forceinline__ float ld(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}
template <class T>
__device__ __forceinline__ void st(T* p, int64_t i, float v) {
  p[i] = static_cast<T>(v);
}

// Sum over the block; every thread gets the result. blockDim.x is a multiple of 32, <= 1024.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // warp_sums may still be read by a previous call
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  float s = lane < warps ? warp_sums[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

int row_threads(int64_t n) {
  int t = 32;
  while (t < 512 && t < n) t *= 2;
  return t;
}

template <class T>
__global__ void rms_fwd_kernel(RmsNormFwdArgs a) {
  const int64_t r = blockIdx.x, D = a.D;
  const T* x = static_cast<const T*>(a.x.data) + r * a.x.row_stride;
  T* y = static_cast<T*>(a.y) + r * D;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = ld(x, i);
    ss += v * v;
  }
  const float rs = 1.f / sqrtf(block_sum(ss) / static_cast<float>(D) + a.eps);
  if (threadIdx.x == 0) a.rstd[r] = rs;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) st(y, i, ld(x, i) * rs * a.w[i]);
}

template <class T>
__global__ void rms_bwd_dx_kernel(RmsNormBwdArgs a) {
  const int64_t r = blockIdx.x, D = a.D;
  const T* x = static_cast<const T*>(a.x.data) + r * a.x.row_stride;
  const T* g = static_cast<const T*>(a.g.data) + r * a.g.row_stride;
  T* dx = static_cast<T*>(a.dx) + r * D;
  const float rs = a.rstd[r];
  float dot = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) dot += ld(g, i) * a.w[i] * ld(x, i);
  const float c = rs * rs * rs * block_sum(dot) / static_cast<float>(D);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    st(dx, i, rs * (ld(g, i) * a.w[i]) - c * ld(x, i));
}

// grid (ceil(D / blockDim), parts): thread = one column of one block of rows.
template <class T>
__global__ void rms_bwd_dw_kernel(RmsNormBwdArgs a, int64_t rows, float* parts,
                                  int64_t rows_per_part) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= a.D) return;
  const int64_t r0 = blockIdx.y * rows_per_part;
  const int64_t r1 = r0 + rows_per_part < rows ? r0 + rows_per_part : rows;
  const T* x = static_cast<const T*>(a.x.data);
  const T* g = static_cast<const T*>(a.g.data);
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r)
    acc += ld(g, r * a.g.row_stride + col) * (ld(x, r * a.x.row_stride + col) * a.rstd[r]);
  parts[blockIdx.y * a.D + col] = acc;
}

template <class T>
__global__ void rope_kernel(RopeArgs a) {
  const int64_t r = blockIdx.x, half = a.D / 2;
  const int64_t h = r % a.H, t = (r / a.H) % a.T, b = r / (a.H * a.T);
  const T* x = static_cast<const T*>(a.x) + b * a.sb + t * a.st + h * a.sh;
  T* y = static_cast<T*>(a.y) + r * a.D;
  const float* c = a.cos + t * half;
  const float* s = a.sin + t * half;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float e = ld(x, 2 * i), o = ld(x, 2 * i + 1), cv = c[i], sv = a.inverse ? -s[i] : s[i];
    st(y, 2 * i, e * cv - o * sv);
    st(y, 2 * i + 1, e * sv + o * cv);
  }
}

template <class T>
__global__ void swiglu_fwd_kernel(SwigluArgs s, int64_t n) {
  const T* A = static_cast<const T*>(s.a.data);
  const T* B = static_cast<const T*>(s.b.data);
  T* Y = static_cast<T*>(s.out0);
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / s.F, i = k % s.F;
    const float a = ld(A, r * s.a.row_stride + i), b = ld(B, r * s.b.row_stride + i);
    st(Y, k, a / (1.f + expf(-a)) * b);
  }
}

template <class T>
__global__ void swiglu_bwd_kernel(SwigluArgs s, int64_t n) {
  const T* A = static_cast<const T*>(s.a.data);
  const T* B = static_cast<const T*>(s.b.data);
  const T* G = static_cast<const T*>(s.g.data);
  T* DA = static_cast<T*>(s.out0);
  T* DB = static_cast<T*>(s.out1);
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / s.F, i = k % s.F;
    const float a = ld(A, r * s.a.row_stride + i), b = ld(B, r * s.b.row_stride + i);
    const float g = ld(G, r * s.g.row_stride + i);
    const float sig = 1.f / (1.f + expf(-a));
    st(DA, k, g * b * sig * (1.f + a * (1.f - sig)));
    st(DB, k, g * (a * sig));
  }
}

unsigned elementwise_blocks(int64_t n, int threads) {
  const int64_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::min<int64_t>(want, 65535LL * 16));
}

}  // namespace

void rms_norm_fwd_cuda(const RmsNormFwdArgs& a, int64_t rows) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int threads = row_threads(a.D);
  if (a.elem == Elem::kFloat)
    rms_fwd_kernel<float><<<static_cast<unsigned>(rows), threads, 0, stream>>>(a);
  else
    rms_fwd_kernel<bf16><<<static_cast<unsigned>(rows), threads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rms_norm_bwd_cuda(const RmsNormBwdArgs& a, int64_t rows, float* dw_parts, int64_t parts,
                       int64_t rows_per_part) {
  auto stream = at::cuda::getCurrentCUDAStream();
  if (a.dx) {
    const int threads = row_threads(a.D);
    if (a.elem == Elem::kFloat)
      rms_bwd_dx_kernel<float><<<static_cast<unsigned>(rows), threads, 0, stream>>>(a);
    else
      rms_bwd_dx_kernel<bf16><<<static_cast<unsigned>(rows), threads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (dw_parts && parts > 0) {
    const int threads = 256;
    dim3 grid(static_cast<unsigned>((a.D + threads - 1) / threads), static_cast<unsigned>(parts));
    if (a.elem == Elem::kFloat)
      rms_bwd_dw_kernel<float><<<grid, threads, 0, stream>>>(a, rows, dw_parts, rows_per_part);
    else
      rms_bwd_dw_kernel<bf16><<<grid, threads, 0, stream>>>(a, rows, dw_parts, rows_per_part);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void rope_cuda(const RopeArgs& a) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t rows = a.B * a.T * a.H;
  const int threads = std::min(row_threads(a.D / 2), 128);
  if (a.elem == Elem::kFloat)
    rope_kernel<float><<<static_cast<unsigned>(rows), threads, 0, stream>>>(a);
  else
    rope_kernel<bf16><<<static_cast<unsigned>(rows), threads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_fwd_cuda(const SwigluArgs& s, int64_t rows) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = rows * s.F;
  const int threads = 256;
  if (s.elem == Elem::kFloat)
    swiglu_fwd_kernel<float><<<elementwise_blocks(n, threads), threads, 0, stream>>>(s, n);
  else
    swiglu_fwd_kernel<bf16><<<elementwise_blocks(n, threads), threads, 0, stream>>>(s, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swiglu_bwd_cuda(const SwigluArgs& s, int64_t rows) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = rows * s.F;
  const int threads = 256;
  if (s.elem == Elem::kFloat)
    swiglu_bwd_kernel<float><<<elementwise_blocks(n, threads), threads, 0, stream>>>(s, n);
  else
    swiglu_bwd_kernel<bf16><<<elementwise_blocks(n, threads), threads, 0, stream>>>(s, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace titan::ops::detail
