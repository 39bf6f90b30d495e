// Fused RMSNorm, RoPE and SwiGLU activation (core/kernels/ops) against their unfused ATen compositions
// from the same LibTorch, forward and autograd gradients, with every CPU kernel set this
// build has (portable and AVX2). Error measure: max |a - ref| / max |ref| over the tensor.
// Tolerances: fp32 forward 1e-6, fp32 gradients 1e-5; bf16 (8 significant bits, one rounding
// of each output is 2^-9 relative) 1e-2 forward and 2e-2 gradients.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/kernels/ops.h"
#include "core/kernels/ops_kernels.h"
#include "test_util.h"

using namespace titan;

namespace {

constexpr double kFwdTol32 = 1e-6, kGradTol32 = 1e-5, kFwdTol16 = 1e-2, kGradTol16 = 2e-2;

double rel_err(const at::Tensor& a, const at::Tensor& ref) {
  at::Tensor r = ref.detach().to(at::kCPU, at::kDouble);
  const double diff = (a.detach().to(at::kCPU, at::kDouble) - r).abs().max().item<double>();
  const double scale = r.abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

// The kernel sets to test: the portable one, and AVX2 where built and this CPU has it.
std::vector<const ops::detail::CpuKernels*> kernel_sets() {
  std::vector<const ops::detail::CpuKernels*> v{ops::detail::cpu_kernels_default()};
  if (ops::detail::cpu_kernels_avx2() && std::string(ops::cpu_isa()) == "avx2")
    v.push_back(ops::detail::cpu_kernels_avx2());
  return v;
}
struct UseKernels {
  explicit UseKernels(const ops::detail::CpuKernels* k) { ops::detail::set_thread_cpu_kernels(k); }
  ~UseKernels() { ops::detail::set_thread_cpu_kernels(nullptr); }
};

// ---- the unfused references ----------------------------------------------------------------

at::Tensor rms_norm_ref(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps) * w.to(at::kFloat);
  return y.to(x.scalar_type());
}

// models/layers.cpp's complex form: adjacent pairs as complex numbers times e^(i angle).
at::Tensor rope_ref(const at::Tensor& x, const at::Tensor& cis) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  at::Tensor xc = at::view_as_complex(x.to(at::kFloat).contiguous().view({B, T, H, D / 2, 2}));
  at::Tensor f = cis.slice(0, 0, T).view({1, T, 1, D / 2});
  return at::view_as_real(xc * f).flatten(3).to(x.scalar_type());
}

at::Tensor swiglu_ref(const at::Tensor& a, const at::Tensor& b) {
  return at::silu(a) * b;
}

// e^(i t f_j), f_j = 10000^(-2j/D), built as models/layers.cpp builds its table.
at::Tensor rope_cis(int64_t max_seq, int64_t D) {
  at::Tensor freqs = at::pow(10000.0, -at::arange(0, D, 2, at::kDouble).slice(0, 0, D / 2) /
                                          static_cast<double>(D)).to(at::kFloat);
  at::Tensor angles = at::outer(at::arange(max_seq, at::kFloat), freqs);
  return at::polar(at::ones_like(angles), angles);
}

// Runs fused and reference on leaf copies of `inputs` (made by `make`), compares the output
// and every input gradient under a shared random upstream gradient.
void compare(const std::vector<at::Tensor>& inputs,
             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& fused,
             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& ref, double fwd_tol,
             double grad_tol, const std::vector<bool>& differentiable) {
  auto leaves = [&] {
    std::vector<at::Tensor> v;
    for (size_t i = 0; i < inputs.size(); ++i)
      v.push_back(differentiable[i] ? inputs[i].detach().clone().requires_grad_() : inputs[i]);
    return v;
  };
  // The fused op sees the same strides as the inputs: a view of a leaf clone keeps them.
  std::vector<at::Tensor> lf = leaves(), lr = leaves();
  at::Tensor yf = fused(lf), yr = ref(lr);
  REQUIRE(yf.sizes() == yr.sizes());
  REQUIRE(yf.scalar_type() == yr.scalar_type());
  CHECK(rel_err(yf, yr) <= fwd_tol);
  at::Tensor gy = at::randn(yr.sizes(), at::TensorOptions().dtype(at::kFloat)).to(yr.dtype());
  (yf * gy).sum().backward();
  (yr * gy).sum().backward();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!differentiable[i]) continue;
    INFO("gradient of input " << i);
    REQUIRE(lf[i].grad().defined());
    CHECK(rel_err(lf[i].grad(), lr[i].grad()) <= grad_tol);
  }
}

}  // namespace

TEST_CASE("ops: rms_norm equals the ATen composition, fp32 and bf16, odd shapes", "[ops]") {
  for (const auto* k : kernel_sets()) {
    UseKernels use(k);
    for (int64_t D : {6, 250, 4097}) {
      for (int64_t T : {1, 7}) {
        for (auto dt : {at::kFloat, at::kBFloat16}) {
          INFO(k->isa << " D=" << D << " T=" << T << " " << dt);
          at::manual_seed(D * 10 + T);
          at::Tensor x = at::randn({2, T, D}).to(dt);
          at::Tensor w = 1 + 0.1 * at::randn({D});
          const bool f32 = dt == at::kFloat;
          compare(
              {x, w}, [](const auto& v) { return ops::rms_norm(v[0], v[1], 1e-5); },
              [](const auto& v) { return rms_norm_ref(v[0], v[1], 1e-5); }, f32 ? kFwdTol32 : kFwdTol16,
              f32 ? kGradTol32 : kGradTol16, {true, true});
        }
      }
    }
  }
}

TEST_CASE("ops: rms_norm on non-contiguous inputs and a bf16 weight", "[ops]") {
  for (const auto* k : kernel_sets()) {
    UseKernels use(k);
    INFO(k->isa);
    const int64_t B = 3, T = 5, D = 250;
    at::manual_seed(1);
    at::Tensor w = 1 + 0.1 * at::randn({D});
    auto fused = [](const auto& v) { return ops::rms_norm(v[0], v[1], 1e-6); };
    auto ref = [](const auto& v) { return rms_norm_ref(v[0], v[1], 1e-6); };
    // Each view is taken inside the op call so autograd sees the strided tensor.
    auto on_view = [&](std::function<at::Tensor(const at::Tensor&)> view, at::Tensor base) {
      compare(
          {base, w}, [&](const auto& v) { return fused(std::vector<at::Tensor>{view(v[0]), v[1]}); },
          [&](const auto& v) { return ref(std::vector<at::Tensor>{view(v[0]), v[1]}); }, kFwdTol32,
          kGradTol32, {true, true});
    };
    // Transposed leading dims: rows are not evenly spaced, so the op copies.
    on_view([](const at::Tensor& b) { return b.transpose(0, 1); }, at::randn({T, B, D}));
    // The middle third of a fused projection: evenly spaced rows read in place.
    on_view([&](const at::Tensor& b) { return b.narrow(2, D, D); }, at::randn({B, T, 3 * D}));
    // Stride 2 in the last dim.
    on_view([&](const at::Tensor& b) { return b.slice(2, 0, 2 * D, 2); }, at::randn({B, T, 2 * D}));
    // bf16 weight (as a mixed-precision model holds it): dw comes back in bf16.
    at::Tensor x = at::randn({B, T, D});
    compare(
        {x, w.to(at::kBFloat16)}, fused, ref, kFwdTol32, kGradTol16, {true, true});
  }
}

TEST_CASE("ops: apply_rope equals the complex form, fp32 and bf16, odd shapes", "[ops]") {
  for (const auto* k : kernel_sets()) {
    UseKernels use(k);
    for (int64_t D : {6, 250, 4098}) {  // D must be even: 4098 stands in for 4097
      for (int64_t T : {1, 7}) {
        for (auto dt : {at::kFloat, at::kBFloat16}) {
          INFO(k->isa << " D=" << D << " T=" << T << " " << dt);
          at::manual_seed(D + T);
          at::Tensor cis = rope_cis(16, D);  // longer than T: rows 0..T-1 are used
          auto [cos, sin] = ops::rope_cos_sin(cis);
          at::Tensor x = at::randn({2, T, 3, D}).to(dt);
          const bool f32 = dt == at::kFloat;
          compare(
              {x}, [&](const auto& v) { return ops::apply_rope(v[0], cos, sin); },
              [&](const auto& v) { return rope_ref(v[0], cis); }, f32 ? kFwdTol32 : kFwdTol16,
              f32 ? kGradTol32 : kGradTol16, {true});
        }
      }
    }
  }
}

TEST_CASE("ops: apply_rope on views of a fused QKV output and transposed heads", "[ops]") {
  for (const auto* k : kernel_sets()) {
    UseKernels use(k);
    INFO(k->isa);
    const int64_t B = 2, T = 7, H = 4, D = 64;
    at::manual_seed(2);
    at::Tensor cis = rope_cis(T, D);
    auto [cos, sin] = ops::rope_cos_sin(cis);
    auto on_view = [&](std::function<at::Tensor(const at::Tensor&)> view, at::Tensor base) {
      compare(
          {base}, [&](const auto& v) { return ops::apply_rope(view(v[0]), cos, sin); },
          [&](const auto& v) { return rope_ref(view(v[0]), cis); }, kFwdTol32, kGradTol32, {true});
    };
    // k of a fused (B, T, 3 * H * D) projection, read in place.
    on_view([&](const at::Tensor& b) { return b.narrow(2, H * D, H * D).view({B, T, H, D}); },
            at::randn({B, T, 3 * H * D}));
    // (B, H, T, D) storage seen as (B, T, H, D).
    on_view([](const at::Tensor& b) { return b.transpose(1, 2); }, at::randn({B, H, T, D}));
    // Stride 2 in D: the op copies.
    on_view([](const at::Tensor& b) { return b.slice(3, 0, 2 * D, 2); },
            at::randn({B, T, H, 2 * D}));
  }
}

TEST_CASE("ops: rms_norm gradients are bitwise equal at 1 and 2 threads", "[ops]") {
  // dw is summed per fixed block of rows, then over blocks: the thread count never changes it.
  at::manual_seed(8);
  at::Tensor x = at::randn({4, 300, 96}), w = at::randn({96}), gy = at::randn({4, 300, 96});
  const int threads = at::get_num_threads();
  auto grads = [&](int n) {
    at::set_num_threads(n);
    at::Tensor xl = x.clone().requires_grad_(), wl = w.clone().requires_grad_();
    ops::rms_norm(xl, wl, 1e-5).backward(gy);
    return std::make_pair(xl.grad(), wl.grad());
  };
  auto [dx1, dw1] = grads(1);
  auto [dx2, dw2] = grads(2);
  at::set_num_threads(threads);
  CHECK(at::equal(dx1, dx2));
  CHECK(at::equal(dw1, dw2));
}

TEST_CASE("ops: rope_cos_sin splits a complex table", "[ops]") {
  at::Tensor cis = rope_cis(9, 8);
  auto [cos, sin] = ops::rope_cos_sin(cis);
  CHECK(cos.is_contiguous());
  CHECK(cos.scalar_type() == at::kFloat);
  CHECK(at::equal(cos, at::real(cis)));
  CHECK(at::equal(sin, at::imag(cis)));
}

TEST_CASE("ops: swiglu_act equals silu(a) * b, fp32 and bf16, odd shapes and views", "[ops]") {
  for (const auto* k : kernel_sets()) {
    UseKernels use(k);
    for (int64_t F : {6, 250, 4097}) {
      for (int64_t T : {1, 7}) {
        for (auto dt : {at::kFloat, at::kBFloat16}) {
          INFO(k->isa << " F=" << F << " T=" << T << " " << dt);
          at::manual_seed(F + 3 * T);
          at::Tensor a = 2 * at::randn({2, T, F}), b = at::randn({2, T, F});
          const bool f32 = dt == at::kFloat;
          compare(
              {a.to(dt), b.to(dt)}, [](const auto& v) { return ops::swiglu_act(v[0], v[1]); },
              [](const auto& v) { return swiglu_ref(v[0], v[1]); }, f32 ? kFwdTol32 : kFwdTol16,
              f32 ? kGradTol32 : kGradTol16, {true, true});
        }
      }
      // The two halves of a fused (B, T, 2F) w1/w3 output, and transposed leading dims.
      INFO(k->isa << " views, F=" << F);
      at::Tensor h = at::randn({2, 7, 2 * F});
      auto halves = [F](const auto& v) {
        return std::vector<at::Tensor>{v[0].narrow(2, 0, F), v[0].narrow(2, F, F)};
      };
      compare(
          {h}, [&](const auto& v) { auto p = halves(v); return ops::swiglu_act(p[0], p[1]); },
          [&](const auto& v) { auto p = halves(v); return swiglu_ref(p[0], p[1]); }, kFwdTol32,
          kGradTol32, {true});
      at::Tensor a = at::randn({7, 2, F}), b = at::randn({7, 2, F});
      compare(
          {a, b}, [](const auto& v) { return ops::swiglu_act(v[0].transpose(0, 1), v[1].transpose(0, 1)); },
          [](const auto& v) { return swiglu_ref(v[0].transpose(0, 1), v[1].transpose(0, 1)); },
          kFwdTol32, kGradTol32, {true, true});
    }
  }
}

TEST_CASE("ops: bad inputs are rejected with the op named", "[ops]") {
  at::Tensor x = at::randn({2, 3, 8});
  CHECK_THROWS_WITH(ops::rms_norm(x, at::ones({7}), 1e-5), Catch::Contains("rms_norm"));
  CHECK_THROWS_WITH(ops::rms_norm(x.to(at::kDouble), at::ones({8}), 1e-5),
                    Catch::Contains("float32 or bfloat16"));
  at::Tensor cis = rope_cis(3, 8);
  auto [cos, sin] = ops::rope_cos_sin(cis);
  CHECK_THROWS_WITH(ops::apply_rope(at::randn({1, 4, 2, 8}), cos, sin),
                    Catch::Contains("apply_rope"));  // table shorter than T
  CHECK_THROWS_WITH(ops::swiglu_act(x, x.to(at::kBFloat16)), Catch::Contains("swiglu_act"));
}

// CUDA kernels against the CPU unfused compositions: fp32 1e-5 (thread-block reduction order,
// expf), bf16 as on the CPU.
TEST_CASE("ops: CUDA kernels equal the CPU compositions", "[ops][gpu]") {
  if (!at::hasCUDA()) TITAN_SKIP("no CUDA device");
  const at::Device dev(at::kCUDA, 0);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const bool f32 = dt == at::kFloat;
    const double ft = f32 ? 1e-5 : kFwdTol16, gt = f32 ? 1e-5 : kGradTol16;
    for (int64_t D : {6, 250, 4098}) {
      INFO(dt << " D=" << D);
      at::manual_seed(D);
      at::Tensor x = at::randn({2, 7, 3, D}).to(dt), w = 1 + 0.1 * at::randn({D});
      compare(
          {x, w}, [&](const auto& v) { return ops::rms_norm(v[0].to(dev), v[1].to(dev), 1e-5).cpu(); },
          [](const auto& v) { return rms_norm_ref(v[0], v[1], 1e-5); }, ft, gt, {true, true});
      at::Tensor cis = rope_cis(7, D);
      auto [cos, sin] = ops::rope_cos_sin(cis);
      at::Tensor cc = cos.to(dev), sc = sin.to(dev);
      compare(
          {x}, [&](const auto& v) { return ops::apply_rope(v[0].to(dev), cc, sc).cpu(); },
          [&](const auto& v) { return rope_ref(v[0], cis); }, ft, gt, {true});
      at::Tensor b = at::randn({2, 7, 3, D}).to(dt);
      compare(
          {x, b}, [&](const auto& v) { return ops::swiglu_act(v[0].to(dev), v[1].to(dev)).cpu(); },
          [](const auto& v) { return swiglu_ref(v[0], v[1]); }, ft, gt, {true, true});
    }
  }
}
