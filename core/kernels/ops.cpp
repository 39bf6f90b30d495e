#include "core/kernels/ops.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>

#include "core/kernels/ops_kernels.h"

namespace titan::ops {
namespace {

using detail::Elem;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Elements per CPU task: ATen's grain size, so small tensors stay on one thread.
constexpr int64_t kGrainElems = 32768;

thread_local const detail::CpuKernels* t_kernels = nullptr;

const detail::CpuKernels& cpu() {
  if (t_kernels) return *t_kernels;
  // ATen picks its own kernels by the same capability (ATEN_CPU_CAPABILITY overrides it), so a
  // machine or a user that disables AVX2 for ATen disables it here too.
  static const detail::CpuKernels* k = [] {
    const std::string cap = at::get_cpu_capability();
    const detail::CpuKernels* avx2 = detail::cpu_kernels_avx2();
    return avx2 && (cap == "AVX2" || cap == "AVX512") ? avx2 : detail::cpu_kernels_default();
  }();
  return *k;
}

Elem elem_of(const at::Tensor& t, const char* op) {
  if (t.scalar_type() == at::kFloat) return Elem::kFloat;
  if (t.scalar_type() == at::kBFloat16) return Elem::kBFloat16;
  TORCH_CHECK(false, op, ": activations must be float32 or bfloat16, got ", t.scalar_type());
}

// Meta tensors (titan-train estimate's shape-only forward) get outputs of the right shapes
// and save what the real kernels save; no kernel runs.
void check_device(const at::Tensor& t, const char* op) {
  if (t.is_meta()) return;
#ifdef TITAN_HAVE_NVCC
  TORCH_CHECK(t.is_cpu() || t.is_cuda(), op, ": CPU or CUDA tensors only, got ", t.device());
#else
  TORCH_CHECK(t.is_cpu(), op, ": this build has no CUDA kernels (no nvcc), got ", t.device());
#endif
}

// (rows, D) with unit stride in D: a view when the leading dims collapse, otherwise a copy.
at::Tensor as_rows(const at::Tensor& x) {
  at::Tensor r = x.reshape({-1, x.size(-1)});
  if (r.size(1) > 1 && r.stride(1) != 1) r = r.contiguous();
  return r;
}
detail::Rows rows_of(const at::Tensor& r) {
  return {r.data_ptr(), r.stride(0)};
}

int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems));
}

// ---- RMSNorm ------------------------------------------------------------------------------

std::pair<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w,
                                               double eps) {
  const char* op = "rms_norm";
  check_device(x, op);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must be (..., D) with D > 0");
  const int64_t D = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D, op, ": w must be (", D, "), got ", w.sizes());
  TORCH_CHECK(w.device() == x.device(), op, ": x and w on different devices");
  detail::RmsNormFwdArgs a{};
  a.elem = elem_of(x, op);
  at::Tensor xr = as_rows(x);
  at::Tensor wf = w.to(at::kFloat).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  std::vector<int64_t> stat_shape(x.sizes().begin(), x.sizes().end());
  stat_shape.back() = 1;
  at::Tensor rstd = at::empty(stat_shape, x.options().dtype(at::kFloat));
  const int64_t rows = xr.size(0);
  if (x.is_meta()) return {y, rstd};
  a.x = rows_of(xr);
  a.w = wf.data_ptr<float>();
  a.y = y.data_ptr();
  a.rstd = rstd.data_ptr<float>();
  a.D = D;
  a.eps = static_cast<float>(eps);
  if (rows == 0) return {y, rstd};
  if (x.is_cuda()) {
#ifdef TITAN_HAVE_NVCC
    c10::DeviceGuard guard(x.device());
    detail::rms_norm_fwd_cuda(a, rows);
#endif
  } else {
    const auto& k = cpu();
    at::parallel_for(0, rows, grain_rows(D),
                     [&](int64_t r0, int64_t r1) { k.rms_norm_fwd(a, r0, r1); });
  }
  return {y, rstd};
}

// dw is summed per block of rows into (parts, D) fp32 and then over parts: deterministic for
// a given shape, whatever the thread count.
std::pair<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& g, const at::Tensor& x,
                                               const at::Tensor& w, const at::Tensor& rstd,
                                               bool need_dx, bool need_dw) {
  const char* op = "rms_norm backward";
  const int64_t D = x.size(-1);
  if (x.is_meta()) {
    auto o = x.options().memory_format(at::MemoryFormat::Contiguous);
    return {need_dx ? at::empty(x.sizes(), o) : at::Tensor(),
            need_dw ? at::empty(w.sizes(), w.options()) : at::Tensor()};
  }
  at::Tensor xr = as_rows(x);
  at::Tensor gr = as_rows(g.to(x.scalar_type()));
  at::Tensor wf = w.to(at::kFloat).contiguous();
  const int64_t rows = xr.size(0);
  detail::RmsNormBwdArgs a{};
  a.elem = elem_of(x, op);
  a.x = rows_of(xr);
  a.g = rows_of(gr);
  a.w = wf.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.D = D;
  at::Tensor dx;
  if (need_dx) {
    dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    a.dx = dx.data_ptr();
  }
  const bool cuda = x.is_cuda();
  // CUDA: 64 rows per part (grid.y <= 65535 parts); CPU: at most 64 parts.
  const int64_t rows_per_part = cuda ? std::max<int64_t>(64, (rows + 65534) / 65535)
                                     : std::max<int64_t>(1, (rows + 63) / 64);
  const int64_t parts = need_dw ? std::max<int64_t>(1, (rows + rows_per_part - 1) / rows_per_part) : 0;
  at::Tensor dw_parts = at::zeros({std::max<int64_t>(parts, 1), D}, x.options().dtype(at::kFloat));
  if (rows > 0) {
    if (cuda) {
#ifdef TITAN_HAVE_NVCC
      c10::DeviceGuard guard(x.device());
      detail::rms_norm_bwd_cuda(a, rows, need_dw ? dw_parts.data_ptr<float>() : nullptr, parts,
                                rows_per_part);
#endif
    } else if (need_dw) {
      const auto& k = cpu();
      float* dwp = dw_parts.data_ptr<float>();
      at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          k.rms_norm_bwd(a, p * rows_per_part, std::min(rows, (p + 1) * rows_per_part),
                         dwp + p * D);
      });
    } else {
      const auto& k = cpu();
      at::parallel_for(0, rows, grain_rows(D),
                       [&](int64_t r0, int64_t r1) { k.rms_norm_bwd(a, r0, r1, nullptr); });
    }
  }
  at::Tensor dw;
  if (need_dw) dw = dw_parts.sum(0).to(w.scalar_type());
  return {dx, dw};
}

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    auto [y, rstd] = rms_norm_fwd(x, w, eps);
    ctx->save_for_backward({x, w, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto s = ctx->get_saved_variables();
    auto [dx, dw] =
        rms_norm_bwd(go[0], s[0], s[1], s[2], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {dx, dw, at::Tensor()};
  }
};

// ---- RoPE ---------------------------------------------------------------------------------

at::Tensor rope_run(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                    bool inverse) {
  const char* op = "apply_rope";
  check_device(x_in, op);
  TORCH_CHECK(x_in.dim() == 4, op, ": x must be (B, T, H, D), got ", x_in.sizes());
  const int64_t B = x_in.size(0), T = x_in.size(1), H = x_in.size(2), D = x_in.size(3);
  TORCH_CHECK(D % 2 == 0, op, ": head dim must be even, got ", D);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) >= T &&
                    t->size(1) == D / 2 && t->is_contiguous(),
                op, ": cos/sin must be contiguous fp32 (>= ", T, ", ", D / 2, "), got ",
                t->scalar_type(), " ", t->sizes());
    TORCH_CHECK(t->device() == x_in.device(), op, ": tables and x on different devices");
  }
  detail::RopeArgs a{};
  a.elem = elem_of(x_in, op);
  at::Tensor x = (D > 1 && x_in.stride(3) != 1) ? x_in.contiguous() : x_in;
  at::Tensor y = at::empty({B, T, H, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.is_meta()) return y;
  a.x = x.data_ptr();
  a.B = B, a.T = T, a.H = H, a.D = D;
  a.sb = x.stride(0), a.st = x.stride(1), a.sh = x.stride(2);
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.y = y.data_ptr();
  a.inverse = inverse;
  const int64_t rows = B * T * H;
  if (rows == 0 || D == 0) return y;
  if (x.is_cuda()) {
#ifdef TITAN_HAVE_NVCC
    c10::DeviceGuard guard(x.device());
    detail::rope_cuda(a);
#endif
  } else {
    const auto& k = cpu();
    at::parallel_for(0, rows, grain_rows(D), [&](int64_t r0, int64_t r1) { k.rope(a, r0, r1); });
  }
  return y;
}

struct RopeFn : torch::autograd::Function<RopeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rope_run(x, cos, sin, /*inverse=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto s = ctx->get_saved_variables();
    return {rope_run(go[0], s[0], s[1], /*inverse=*/true), at::Tensor(), at::Tensor()};
  }
};

// ---- SwiGLU activation ----------------------------------------------------------------------

void swiglu_run(detail::SwigluArgs& s, const at::Tensor& like, int64_t rows, bool backward) {
  if (rows == 0) return;
  if (like.is_cuda()) {
#ifdef TITAN_HAVE_NVCC
    c10::DeviceGuard guard(like.device());
    if (backward)
      detail::swiglu_bwd_cuda(s, rows);
    else
      detail::swiglu_fwd_cuda(s, rows);
#endif
  } else {
    const auto& k = cpu();
    at::parallel_for(0, rows, grain_rows(s.F), [&](int64_t r0, int64_t r1) {
      backward ? k.swiglu_bwd(s, r0, r1) : k.swiglu_fwd(s, r0, r1);
    });
  }
}

void check_swiglu(const at::Tensor& a, const at::Tensor& b) {
  const char* op = "swiglu_act";
  check_device(a, op);
  TORCH_CHECK(a.sizes() == b.sizes(), op, ": a and b differ in shape: ", a.sizes(), " vs ",
              b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": a and b differ in dtype");
  TORCH_CHECK(a.device() == b.device(), op, ": a and b on different devices");
  TORCH_CHECK(a.dim() >= 1 && a.size(-1) > 0, op, ": inputs must be (..., F) with F > 0");
  (void)elem_of(a, op);
}

struct SwigluFn : torch::autograd::Function<SwigluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    check_swiglu(a, b);
    at::Tensor ar = as_rows(a), br = as_rows(b);
    at::Tensor y = at::empty(a.sizes(), a.options().memory_format(at::MemoryFormat::Contiguous));
    ctx->save_for_backward({a, b});
    if (a.is_meta()) return y;
    detail::SwigluArgs s{};
    s.a = rows_of(ar), s.b = rows_of(br);
    s.out0 = y.data_ptr();
    s.F = a.size(-1);
    s.elem = elem_of(a, "swiglu_act");
    swiglu_run(s, a, ar.size(0), /*backward=*/false);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto v = ctx->get_saved_variables();
    const at::Tensor &a = v[0], &b = v[1];
    at::Tensor ar = as_rows(a), br = as_rows(b), gr = as_rows(go[0].to(a.scalar_type()));
    auto opts = a.options().memory_format(at::MemoryFormat::Contiguous);
    at::Tensor da = at::empty(a.sizes(), opts), db = at::empty(a.sizes(), opts);
    if (a.is_meta()) return {da, db};
    detail::SwigluArgs s{};
    s.a = rows_of(ar), s.b = rows_of(br), s.g = rows_of(gr);
    s.out0 = da.data_ptr();
    s.out1 = db.data_ptr();
    s.F = a.size(-1);
    s.elem = elem_of(a, "swiglu_act");
    swiglu_run(s, a, ar.size(0), /*backward=*/true);
    return {da, db};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return RmsNormFn::apply(x, w, eps);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return RopeFn::apply(x, cos, sin);
}

std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& cis) {
  TORCH_CHECK(cis.is_complex() && cis.dim() == 2, "rope_cos_sin: cis must be a 2-D complex table");
  return {at::real(cis).to(at::kFloat).contiguous(), at::imag(cis).to(at::kFloat).contiguous()};
}

at::Tensor swiglu_act(const at::Tensor& a, const at::Tensor& b) {
  return SwigluFn::apply(a, b);
}

namespace detail {
void set_thread_cpu_kernels(const CpuKernels* k) {
  t_kernels = k;
}
}  // namespace detail

const char* cpu_isa() {
  return cpu().isa;
}

}  // namespace titan::ops
