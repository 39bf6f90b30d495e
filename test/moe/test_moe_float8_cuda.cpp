// Float8 grouped GEMMs on CUDA (tag [gpu]: ctest label gpu; skipped without CUDA or off
// compute capability 9.0). Reference: the same op emulated on the same GPU (the arithmetic
// test_moe_float8.cpp checks bit for bit against torchao's recipe on the CPU). The real
// at::_scaled_grouped_mm sees the same float8 operands and scales and differs only in its
// accumulation (fast accumulation, as torchao asks for) and its bf16 output: each of the
// three forms, and the experts op's output and four gradients, within 1e-2 of the emulated
// ones relative to their largest element. Also: forward and backward make no host sync (CUDA
// sync-debug mode set to error). Written without a GPU; not yet run (docs/float8.md).
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <vector>

#include "moe/experts.h"
#include "moe/float8_grouped_gemm.h"
#include "test_util.h"

#if __has_include(<c10/cuda/CUDAFunctions.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDAFunctions.h>
#define TITAN_TEST_CUDA_HEADERS 1
#endif

using namespace titan;

TEST_CASE("moe float8 cuda: _scaled_grouped_mm against the emulated GEMMs, and no host sync",
          "[float8][moe][gpu]") {
#ifndef TITAN_TEST_CUDA_HEADERS
  TITAN_SKIP("built without CUDA headers");
#else
  if (!at::hasCUDA()) TITAN_SKIP("no CUDA device (runs on the GPU check)");
  const at::Device dev(at::kCUDA, 0);
  const int64_t E = 8, M = 1024, D = 512, H = 256;
  std::string why;
  if (choose_float8_grouped_kernel(cuda_compute_capability(dev), D, H, at::kBFloat16, &why) !=
      Float8GroupedKernel::ScaledGroupedMm)
    TITAN_SKIP("no float8 grouped kernel here: " + why);
  auto g = at::make_generator<at::CPUGeneratorImpl>(31);
  auto bf = [&](at::Tensor t) { return t.to(dev, at::kBFloat16); };
  // Group sizes multiples of 16, one empty-like (16 rows) and one large.
  const std::vector<int32_t> ends = {16, 160, 176, 400, 416, 704, 880, 1024};
  const at::Tensor offs = at::tensor(ends, at::kInt).to(dev);
  const at::Tensor x = bf(at::randn({M, D}, g) * at::exp(at::randn({M, 1}, g)));
  const at::Tensor w1 = bf(at::randn({E, H, D}, g) * 0.02), w3 = bf(at::randn({E, H, D}, g) * 0.02);
  const at::Tensor w2 = bf(at::randn({E, D, H}, g) * 0.02);
  const at::Tensor dy = bf(at::randn({M, D}, g) * 1e-3), dh = bf(at::randn({M, H}, g) * 1e-3);
  const auto k = GroupedKernel::GroupedMM;
  const auto real = Float8GroupedKernel::ScaledGroupedMm, emu = Float8GroupedKernel::Emulated;
  auto both = [&](GemmForm f, const at::Tensor& a, const at::Tensor& b) {
    INFO("form " << static_cast<int>(f));
    CHECK(test::rel_err(float8_grouped_gemm(f, a, b, offs, k, real),
                        float8_grouped_gemm(f, a, b, offs, k, emu)) <= 1e-2);
  };
  both(GemmForm::NT, x, w1);
  both(GemmForm::NN, dh, w1);
  both(GemmForm::TN, dh, x);

  std::vector<at::Tensor> got[2];
  for (int i = 0; i < 2; ++i) {
    std::vector<at::Tensor> leaves = {
        x.clone().requires_grad_(true), w1.clone().requires_grad_(true),
        w2.clone().requires_grad_(true), w3.clone().requires_grad_(true)};
    const auto saved = c10::cuda::warning_state().get_sync_debug_mode();
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    at::Tensor y;
    try {
      y = grouped_swiglu(leaves[0], leaves[1], leaves[2], leaves[3], offs, k, i == 0 ? real : emu);
      y.backward(dy);
    } catch (...) {
      c10::cuda::warning_state().set_sync_debug_mode(saved);
      throw;
    }
    c10::cuda::warning_state().set_sync_debug_mode(saved);
    got[i] = {y.detach()};
    for (auto& l : leaves) got[i].push_back(l.grad());
  }
  for (size_t j = 0; j < got[0].size(); ++j) {
    INFO("output/gradient " << j);
    CHECK(test::rel_err(got[0][j], got[1][j]) <= 1e-2);
  }
#endif
}
