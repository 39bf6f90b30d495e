// Fused building-block ops with explicit backward passes: RMSNorm, rotary embedding and the
// SwiGLU activation. Each is one autograd node that saves only what its backward needs, with
// a vectorized CPU kernel (AVX2 or portable, chosen at run time like ATen's) and a CUDA kernel.
// Math is fp32; activations may be fp32 or bf16 and outputs keep the input's dtype.
// The unfused ATen compositions they replace are in test/core/kernels/test_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace titan::ops {

// y = x / sqrt(mean(x^2, -1) + eps) * w.  x: (..., D) fp32/bf16, any strides; w: (D), any
// float dtype. Saves x, w and the inverse RMS (..., 1) fp32; gives dx and dw (in w's dtype).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// Rotates adjacent pairs (x[..., 2i], x[..., 2i+1]) of the last dim by angle t * f_i:
// out = (x0 cos - x1 sin, x0 sin + x1 cos), the same numbers as the complex form
// view_as_complex(x.float()) * e^(i angle) in models/layers.cpp. x: (B, T, H, D), any
// strides with unit stride in D (e.g. a view of a fused QKV output); cos, sin: (>= T, D/2)
// fp32, rows 0..T-1 used. Returns a contiguous (B, T, H, D) tensor in x's dtype. Backward is
// the inverse rotation and saves only the tables (no copy of x).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The (cos, sin) tables of a complex e^(i angle) table such as RopeTables::cis: two
// contiguous fp32 (max_seq, D/2) tensors on cis's device.
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& cis);

// silu(a) * b, elementwise. a, b: same shape and dtype (fp32/bf16), any strides (e.g. the two
// halves of a fused w1/w3 output). Saves a and b; backward gives da and db.
at::Tensor swiglu_act(const at::Tensor& a, const at::Tensor& b);

// The CPU kernel set in use: "avx2" or "default" (for logs and benchmarks).
const char* cpu_isa();

}  // namespace titan::ops
