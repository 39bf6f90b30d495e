// CPU kernel bodies of core/kernels/ops, included once per instruction set by core/kernels/ops_cpu_default.cpp
// and core/kernels/ops_cpu_avx2.cpp (which defines TITAN_OPS_TABLE / TITAN_OPS_ISA first). Everything
// but the table function has internal linkage, so the two copies never merge at link time.
// All arithmetic is fp32; bf16 rows are converted into a per-thread row buffer and back.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>

#include "core/kernels/ops_kernels.h"

namespace titan::ops::detail {
namespace {

using fV = at::vec::Vectorized<float>;
using bf16 = c10::BFloat16;
constexpr int64_t kW = fV::size();

int64_t elem_size(Elem e) {
  return e == Elem::kFloat ? 4 : 2;
}
const void* at_elem(const void* p, int64_t i, Elem e) {
  return static_cast<const char*>(p) + i * elem_size(e);
}
void* at_elem(void* p, int64_t i, Elem e) {
  return static_cast<char*>(p) + i * elem_size(e);
}
const void* row_ptr(const Rows& r, int64_t i, Elem e) {
  return at_elem(r.data, i * r.row_stride, e);
}

// An input row as fp32: fp32 rows are read in place, bf16 rows are widened into buf.
const float* load_row(const void* p, Elem e, float* buf, int64_t n) {
  if (e == Elem::kFloat) return static_cast<const float*>(p);
  const auto* s = static_cast<const bf16*>(p);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    fV v;
    at::vec::load_to_float(s + i, v);
    v.store(buf + i);
  }
  for (; i < n; ++i) buf[i] = static_cast<float>(s[i]);
  return buf;
}
// Where an output row is computed: in place for fp32, in buf for bf16 (then store_row).
float* out_row(void* p, Elem e, float* buf) {
  return e == Elem::kFloat ? static_cast<float*>(p) : buf;
}
void store_row(const float* v, void* p, Elem e, int64_t n) {
  if (e == Elem::kBFloat16) at::vec::convert(v, static_cast<bf16*>(p), n);  // round to nearest even
}
// Per-thread fp32 row scratch. Not std::vector: its out-of-line members would be weak symbols
// compiled for AVX2 that the linker could pick for every other translation unit.
class RowBuf {
 public:
  explicit RowBuf(int64_t n) : p_(n > 0 ? new float[n] : nullptr) {}
  ~RowBuf() { delete[] p_; }
  RowBuf(const RowBuf&) = delete;
  RowBuf& operator=(const RowBuf&) = delete;
  float* data() { return p_; }
  float& operator[](int64_t i) { return p_[i]; }

 private:
  float* p_;
};
// Row buffers for the bf16 conversions; fp32 rows need none.
int64_t buf_len(Elem e, int64_t n) {
  return e == Elem::kFloat ? 0 : n;
}

float hsum(const fV& v) {
  float lanes[kW];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += lanes[i];
  return s;
}

// sum a[i] * b[i] with four independent accumulators (32 lanes on AVX2), which also keeps the
// fp32 rounding error of a 4096-long sum near 1e-7 relative.
float dot(const float* a, const float* b, int64_t n) {
  fV s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    s0 = at::vec::fmadd(fV::loadu(a + i), fV::loadu(b + i), s0);
    s1 = at::vec::fmadd(fV::loadu(a + i + kW), fV::loadu(b + i + kW), s1);
    s2 = at::vec::fmadd(fV::loadu(a + i + 2 * kW), fV::loadu(b + i + 2 * kW), s2);
    s3 = at::vec::fmadd(fV::loadu(a + i + 3 * kW), fV::loadu(b + i + 3 * kW), s3);
  }
  for (; i + kW <= n; i += kW) s0 = at::vec::fmadd(fV::loadu(a + i), fV::loadu(b + i), s0);
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void rms_norm_fwd(const RmsNormFwdArgs& a, int64_t r0, int64_t r1) {
  const int64_t D = a.D;
  RowBuf bx(buf_len(a.elem, D)), by(buf_len(a.elem, D));
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = load_row(row_ptr(a.x, r, a.elem), a.elem, bx.data(), D);
    void* yp = at_elem(a.y, r * D, a.elem);
    float* y = out_row(yp, a.elem, by.data());
    const float rs = 1.f / std::sqrt(dot(x, x, D) / static_cast<float>(D) + a.eps);
    a.rstd[r] = rs;
    const fV vr(rs);
    int64_t i = 0;
    for (; i + kW <= D; i += kW) (fV::loadu(x + i) * vr * fV::loadu(a.w + i)).store(y + i);
    for (; i < D; ++i) y[i] = x[i] * rs * a.w[i];
    store_row(y, yp, a.elem, D);
  }
}

// dx = rstd * (g*w) - x * rstd^3 * <g*w, x> / D;  dw += g * x * rstd.
void rms_norm_bwd(const RmsNormBwdArgs& a, int64_t r0, int64_t r1, float* dw) {
  const int64_t D = a.D;
  RowBuf bx(buf_len(a.elem, D)), bg(buf_len(a.elem, D)), bdx(buf_len(a.elem, D));
  RowBuf gw(D);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = load_row(row_ptr(a.x, r, a.elem), a.elem, bx.data(), D);
    const float* g = load_row(row_ptr(a.g, r, a.elem), a.elem, bg.data(), D);
    const float rs = a.rstd[r];
    const fV vr(rs);
    if (a.dx) {
      int64_t i = 0;
      for (; i + kW <= D; i += kW) (fV::loadu(g + i) * fV::loadu(a.w + i)).store(gw.data() + i);
      for (; i < D; ++i) gw[i] = g[i] * a.w[i];
      const float c = rs * rs * rs * dot(gw.data(), x, D) / static_cast<float>(D);
      const fV vc(c);
      void* dp = at_elem(a.dx, r * D, a.elem);
      float* dx = out_row(dp, a.elem, bdx.data());
      for (i = 0; i + kW <= D; i += kW)
        (vr * fV::loadu(gw.data() + i) - vc * fV::loadu(x + i)).store(dx + i);
      for (; i < D; ++i) dx[i] = rs * gw[i] - c * x[i];
      store_row(dx, dp, a.elem, D);
    }
    if (dw) {
      int64_t i = 0;
      for (; i + kW <= D; i += kW)
        at::vec::fmadd(fV::loadu(g + i), fV::loadu(x + i) * vr, fV::loadu(dw + i)).store(dw + i);
      for (; i < D; ++i) dw[i] += g[i] * (x[i] * rs);
    }
  }
}

// Row position (b, t, h) of x (B, T, H, D), stepped row by row: no integer division per row,
// which would cost more than rotating a 16-wide head.
struct RopeCursor {
  const RopeArgs& a;
  int64_t b, t, h;
  RopeCursor(const RopeArgs& args, int64_t r)
      : a(args), b(r / (args.H * args.T)), t((r / args.H) % args.T), h(r % args.H) {}
  const void* src() const { return at_elem(a.x, b * a.sb + t * a.st + h * a.sh, a.elem); }
  void next() {
    if (++h < a.H) return;
    h = 0;
    if (++t < a.T) return;
    t = 0;
    ++b;
  }
};

// Rotates pairs (x[2i], x[2i+1]) by +angle, or by -angle for the backward pass.
void rope(const RopeArgs& a, int64_t r0, int64_t r1) {
  const int64_t D = a.D, half = D / 2;
  RopeCursor cur(a, r0);
  RowBuf bx(buf_len(a.elem, D)), by(buf_len(a.elem, D));
  for (int64_t r = r0; r < r1; ++r, cur.next()) {
    const int64_t t = cur.t;
    const float* x = load_row(cur.src(), a.elem, bx.data(), D);
    void* yp = at_elem(a.y, r * D, a.elem);
    float* y = out_row(yp, a.elem, by.data());
    const float* c = a.cos + t * half;
    const float* s = a.sin + t * half;
    int64_t i = 0;  // pair index
    for (; i + kW <= half; i += kW) {
      auto [ev, od] = at::vec::deinterleave2(fV::loadu(x + 2 * i), fV::loadu(x + 2 * i + kW));
      const fV cv = fV::loadu(c + i), sv = fV::loadu(s + i);
      fV re, im;
      if (a.inverse) {
        re = ev * cv + od * sv;
        im = od * cv - ev * sv;
      } else {  // (ev + i od) * (cv + i sv), in the complex form's operand order
        re = ev * cv - od * sv;
        im = ev * sv + od * cv;
      }
      auto [lo, hi] = at::vec::interleave2(re, im);
      lo.store(y + 2 * i);
      hi.store(y + 2 * i + kW);
    }
    for (; i < half; ++i) {
      const float e = x[2 * i], o = x[2 * i + 1];
      if (a.inverse) {
        y[2 * i] = e * c[i] + o * s[i];
        y[2 * i + 1] = o * c[i] - e * s[i];
      } else {
        y[2 * i] = e * c[i] - o * s[i];
        y[2 * i + 1] = e * s[i] + o * c[i];
      }
    }
    store_row(y, yp, a.elem, D);
  }
}

// SwiGLU works on registers: bf16 is widened 2 * kW elements at a time (no row buffers), as
// its rows are long and the kernel is bound by conversions and exp, not by memory.
using bV = at::vec::Vectorized<bf16>;
constexpr int64_t kB = bV::size();  // == 2 * kW

// silu(a) * b with silu(a) = a / (1 + exp(-a)), the form ATen's CPU silu uses.
fV silu_mul(const fV& a, const fV& b) {
  return a / (fV(1.f) + a.neg().exp()) * b;
}
float silu_mul(float a, float b) {
  return a / (1.f + std::exp(-a)) * b;
}

// da = g * b * sig * (1 + a * (1 - sig)),  db = g * a * sig,  sig = 1 / (1 + exp(-a)).
void silu_mul_grad(const fV& a, const fV& b, const fV& g, fV& da, fV& db) {
  const fV one(1.f);
  const fV sig = one / (one + a.neg().exp());
  da = g * b * sig * (one + a * (one - sig));
  db = g * (a * sig);
}
void silu_mul_grad(float a, float b, float g, float& da, float& db) {
  const float sig = 1.f / (1.f + std::exp(-a));
  da = g * b * sig * (1.f + a * (1.f - sig));
  db = g * (a * sig);
}

void swiglu_fwd(const SwigluArgs& s, int64_t r0, int64_t r1) {
  const int64_t F = s.F;
  for (int64_t r = r0; r < r1; ++r) {
    const void* ap = row_ptr(s.a, r, s.elem);
    const void* bp = row_ptr(s.b, r, s.elem);
    void* yp = at_elem(s.out0, r * F, s.elem);
    int64_t i = 0;
    if (s.elem == Elem::kFloat) {
      const auto *a = static_cast<const float*>(ap), *b = static_cast<const float*>(bp);
      auto* y = static_cast<float*>(yp);
      for (; i + kW <= F; i += kW) silu_mul(fV::loadu(a + i), fV::loadu(b + i)).store(y + i);
      for (; i < F; ++i) y[i] = silu_mul(a[i], b[i]);
    } else {
      const auto *a = static_cast<const bf16*>(ap), *b = static_cast<const bf16*>(bp);
      auto* y = static_cast<bf16*>(yp);
      for (; i + kB <= F; i += kB) {
        auto [a0, a1] = at::vec::convert_bfloat16_float(bV::loadu(a + i));
        auto [b0, b1] = at::vec::convert_bfloat16_float(bV::loadu(b + i));
        at::vec::convert_float_bfloat16(silu_mul(a0, b0), silu_mul(a1, b1)).store(y + i);
      }
      for (; i < F; ++i) y[i] = bf16(silu_mul(static_cast<float>(a[i]), static_cast<float>(b[i])));
    }
  }
}

void swiglu_bwd(const SwigluArgs& s, int64_t r0, int64_t r1) {
  const int64_t F = s.F;
  for (int64_t r = r0; r < r1; ++r) {
    const void* ap = row_ptr(s.a, r, s.elem);
    const void* bp = row_ptr(s.b, r, s.elem);
    const void* gp = row_ptr(s.g, r, s.elem);
    void* dap = at_elem(s.out0, r * F, s.elem);
    void* dbp = at_elem(s.out1, r * F, s.elem);
    int64_t i = 0;
    if (s.elem == Elem::kFloat) {
      const auto *a = static_cast<const float*>(ap), *b = static_cast<const float*>(bp),
                 *g = static_cast<const float*>(gp);
      auto *da = static_cast<float*>(dap), *db = static_cast<float*>(dbp);
      for (; i + kW <= F; i += kW) {
        fV va, vb;
        silu_mul_grad(fV::loadu(a + i), fV::loadu(b + i), fV::loadu(g + i), va, vb);
        va.store(da + i);
        vb.store(db + i);
      }
      for (; i < F; ++i) silu_mul_grad(a[i], b[i], g[i], da[i], db[i]);
    } else {
      const auto *a = static_cast<const bf16*>(ap), *b = static_cast<const bf16*>(bp),
                 *g = static_cast<const bf16*>(gp);
      auto *da = static_cast<bf16*>(dap), *db = static_cast<bf16*>(dbp);
      for (; i + kB <= F; i += kB) {
        auto [a0, a1] = at::vec::convert_bfloat16_float(bV::loadu(a + i));
        auto [b0, b1] = at::vec::convert_bfloat16_float(bV::loadu(b + i));
        auto [g0, g1] = at::vec::convert_bfloat16_float(bV::loadu(g + i));
        fV da0, db0, da1, db1;
        silu_mul_grad(a0, b0, g0, da0, db0);
        silu_mul_grad(a1, b1, g1, da1, db1);
        at::vec::convert_float_bfloat16(da0, da1).store(da + i);
        at::vec::convert_float_bfloat16(db0, db1).store(db + i);
      }
      for (; i < F; ++i) {
        float va, vb;
        silu_mul_grad(static_cast<float>(a[i]), static_cast<float>(b[i]), static_cast<float>(g[i]),
                      va, vb);
        da[i] = bf16(va);
        db[i] = bf16(vb);
      }
    }
  }
}

}  // namespace

const CpuKernels* TITAN_OPS_TABLE() {
  static const CpuKernels k{TITAN_OPS_ISA, &rms_norm_fwd, &rms_norm_bwd, &rope, &swiglu_fwd,
                            &swiglu_bwd};
  return &k;
}

}  // namespace titan::ops::detail
