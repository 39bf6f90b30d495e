// The float8 linear on CUDA (tag [gpu]: ctest label gpu; skipped without CUDA or below SM89).
// Reference: the same op emulated on the same GPU (torchao's emulate = True arithmetic, which
// test_float8_linear.cpp checks bit for bit against torchao on the CPU). The real scaled GEMMs
// see the same float8 operands and scales, and differ only in accumulation (fast accumulation
// in the output GEMM) and in rounding the rowwise gradients to bf16 before scaling: every
// output and gradient within 1e-2 of the emulated one, relative to its largest element.
// Also: forward and backward make no host sync (CUDA sync-debug mode set to error).
// Not yet run on a GPU when written (docs/float8.md).
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "core/kernels/float8_linear.h"
#include "test_util.h"

#if __has_include(<c10/cuda/CUDAFunctions.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDAFunctions.h>
#define TITAN_TEST_CUDA_HEADERS 1
#endif

using namespace titan;
namespace f8 = titan::float8;

TEST_CASE("float8 linear cuda: scaled_mm against the emulated GEMMs, and no host sync",
          "[float8][gpu]") {
#ifndef TITAN_TEST_CUDA_HEADERS
  TITAN_SKIP("built without CUDA headers");
#else
  if (!at::hasCUDA()) TITAN_SKIP("no CUDA device (runs on the GPU check)");
  const at::Device dev(at::kCUDA, 0);
  if (f8::kernel_for({f8::Recipe::Tensorwise, false}, dev) != f8::Kernel::ScaledMm)
    TITAN_SKIP("CUDA device below compute capability 8.9 (no float8 GEMM)");
  auto g = at::make_generator<at::CPUGeneratorImpl>(30);
  const int64_t B = 4, T = 128, K = 512, N = 768;
  at::Tensor x0 = (at::randn({B, T, K}, g) * at::exp(at::randn({B, T, 1}, g))).to(dev);
  at::Tensor w0 = (at::randn({N, K}, g) * 0.02).to(dev);
  at::Tensor go = (at::randn({B, T, N}, g) * 1e-3).to(dev, at::kBFloat16);
  int ran = 0;
  for (f8::Recipe r : {f8::Recipe::Tensorwise, f8::Recipe::Rowwise, f8::Recipe::RowwiseWithGwHp}) {
    INFO(f8::describe({r, false}, dev));
    if (f8::kernel_for({r, false}, dev) != f8::Kernel::ScaledMm) continue;  // rowwise below SM90
    at::Tensor out[2], dx[2], dw[2];
    for (int emulate = 0; emulate < 2; ++emulate) {
      at::Tensor x = x0.to(at::kBFloat16).requires_grad_(true);
      at::Tensor w = w0.to(at::kBFloat16).requires_grad_(true);
      const auto saved = c10::cuda::warning_state().get_sync_debug_mode();
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
      try {
        out[emulate] = f8::float8_linear(x, w, at::Tensor(), {r, emulate == 1});
        out[emulate].backward(go);
      } catch (...) {
        c10::cuda::warning_state().set_sync_debug_mode(saved);
        throw;
      }
      c10::cuda::warning_state().set_sync_debug_mode(saved);
      dx[emulate] = x.grad();
      dw[emulate] = w.grad();
    }
    CHECK(test::rel_err(out[0], out[1]) <= 1e-2);
    CHECK(test::rel_err(dx[0], dx[1]) <= 1e-2);
    CHECK(test::rel_err(dw[0], dw[1]) <= 1e-2);
    ++ran;
  }
  CHECK(ran >= 1);
#endif
}
