// Throughput of one MoE layer's forward + backward, loop vs grouped_mm vs cutlass, in one
// run, and the bytes it allocates. Hidden
// (tag [.bench]): not part of the test suite; scripts/bench_moe.sh runs it.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <iomanip>
#include <iostream>

#include "core/telemetry/memory_stats.h"
#include "moe/moe_layer.h"

using namespace titan;

namespace {

double env_or(const char* name, double dflt) {
  const char* e = std::getenv(name);
  return e && *e ? std::atof(e) : dflt;
}

}  // namespace

TEST_CASE("moe bench: one MoE layer forward and backward with each experts backend", "[.bench]") {
  const bool cuda = at::hasCUDA();
  at::Device dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::ScalarType dt = cuda ? at::kBFloat16 : at::kFloat;
  const int64_t dim = static_cast<int64_t>(env_or("MOE_BENCH_DIM", cuda ? 2048 : 256));
  const int64_t hidden = static_cast<int64_t>(env_or("MOE_BENCH_HIDDEN", cuda ? 1408 : 256));
  const int64_t E = static_cast<int64_t>(env_or("MOE_BENCH_EXPERTS", cuda ? 64 : 8));
  const int64_t K = static_cast<int64_t>(env_or("MOE_BENCH_TOPK", cuda ? 6 : 2));
  // CUDA defaults: one DeepSeek-V3 16B (V2-Lite) MoE layer at 8k tokens.
  const int64_t tokens = static_cast<int64_t>(env_or("MOE_BENCH_TOKENS", cuda ? 8192 : 2048));
  const int iters = static_cast<int>(env_or("MOE_BENCH_ITERS", cuda ? 20 : 5));
  // grouped_mm runs on the CPU through LibTorch's per-group fallback (it copies the offsets to
  // the host), so the CPU ratio compares two loops; its CUTLASS kernel needs 9.x/10.x. The
  // cutlass backend (CUDA from 8.0) is timed on a GPU only.
  const int cc = cuda_compute_capability(dev);
  const bool grouped_ok = !cuda || (cc >= 90 && cc < 110);
  const bool cutlass_ok = cuda && cc >= 80 && cutlass_grouped_gemm_built();
  std::cout << "MoE layer: dim " << dim << ", expert hidden " << hidden << ", " << E
            << " experts, top-" << K << ", " << tokens << " tokens, "
            << (cuda ? "CUDA bf16" : "CPU fp32") << ", " << iters << " timed iterations\n";
  std::map<std::string, double> tps;
  for (auto b : {ExpertsBackend::Loop, ExpertsBackend::GroupedMM, ExpertsBackend::Cutlass}) {
    if (b == ExpertsBackend::GroupedMM && !grouped_ok) {
      std::cout << "grouped_mm: skipped (needs CUDA compute capability 9.x/10.x)\n";
      continue;
    }
    if (b == ExpertsBackend::Cutlass && !cutlass_ok) {
      std::cout << "cutlass: skipped (needs a CUDA device from 8.0 and a build with CUTLASS)\n";
      continue;
    }
    MoEArgs a;
    a.num_experts = E;
    a.top_k = K;
    a.num_shared_experts = 0;
    a.score_func = ScoreFunc::Softmax;
    a.score_before_experts = false;
    a.backend = b;
    ParamStore store;
    MoELayer moe(a, dim, hidden, "moe.", store, dev, 0.02);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    store.initialize(1);
    at::Tensor x = at::randn({1, tokens, dim}, gen).to(dev, dt).requires_grad_();
    at::Tensor g = at::randn({1, tokens, dim}, gen).to(dev, dt);
    auto step = [&] {
      std::vector<at::Tensor> w;
      for (auto& p : store.all()) w.push_back(p.value.to(dt));
      moe.forward(x, w, {true, false}).backward(g);
    };
    step();  // warm-up
    if (cuda) (void)x.grad().sum().item<double>();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) step();
    if (cuda) (void)x.grad().sum().item<double>();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tps[experts_backend_name(b)] = static_cast<double>(tokens) * iters / s;
    std::cout << std::setw(11) << experts_backend_name(b) << ": " << std::fixed
              << std::setprecision(1) << 1e3 * s / iters << " ms per forward+backward, "
              << std::setprecision(0) << tps[experts_backend_name(b)] << " tokens/s\n";
  }
  for (const char* b : {"grouped_mm", "cutlass"})
    if (tps.count(b))
      std::cout << b << " / loop throughput ratio: " << std::setprecision(2)
                << tps[b] / tps["loop"] << "\n";
  if (tps.count("grouped_mm") && tps.count("cutlass"))
    std::cout << "cutlass / grouped_mm throughput ratio: " << std::setprecision(2)
              << tps["cutlass"] / tps["grouped_mm"] << "\n";
  SUCCEED();
}

TEST_CASE("moe bench: bytes one MoE layer allocates in forward and backward on the CPU",
          "[.bench]") {
  // The copies of dispatch and combine, counted by the product's CPU allocator
  // (core/telemetry/memory_stats.h): every byte allocated during one forward + backward of the layer,
  // temporaries included, in units of one (N, D) fp32 activation (N = tokens * top-k), next
  // to the peak. Deterministic on the CPU; docs/moe.md records the figures.
  install_cpu_memory_counter();
  const int64_t dim = 256, hidden = 256, E = 8, K = 2, tokens = 2048;
  const double nd = static_cast<double>(tokens * K * dim * 4);
  std::cout << "MoE layer allocations: dim " << dim << ", expert hidden " << hidden << ", " << E
            << " experts, top-" << K << ", " << tokens << " tokens, CPU fp32, no shared expert;"
            << " unit (N, D) fp32 = " << nd / 1048576.0 << " MiB\n";
  for (bool before : {true, false}) {
    for (auto b : {ExpertsBackend::Loop, ExpertsBackend::GroupedMM}) {
      MoEArgs a;
      a.num_experts = E;
      a.top_k = K;
      a.num_shared_experts = 0;
      a.score_func = before ? ScoreFunc::Sigmoid : ScoreFunc::Softmax;
      a.score_before_experts = before;
      a.backend = b;
      ParamStore store;
      MoELayer moe(a, dim, hidden, "moe.", store, at::kCPU, 0.02);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
      store.initialize(1);
      at::Tensor x = at::randn({1, tokens, dim}, gen).requires_grad_();
      at::Tensor g = at::randn({1, tokens, dim}, gen);
      std::vector<at::Tensor> w;
      for (auto& p : store.all()) w.push_back(p.value);
      moe.forward(x, w, {true, false}).backward(g);  // warm-up; grads now allocated
      const MemoryStats s0 = cpu_memory_stats();
      reset_cpu_memory_peak();
      at::Tensor y = moe.forward(x, w, {true, false});
      const MemoryStats s1 = cpu_memory_stats();
      y.backward(g);
      y = at::Tensor();
      const MemoryStats s2 = cpu_memory_stats();
      std::cout << std::setw(11) << experts_backend_name(b)
                << (before ? " (scores before experts)" : " (scores after experts) ")
                << std::fixed << std::setprecision(2)
                << ": allocated forward " << (s1.total - s0.total) / nd << ", backward "
                << (s2.total - s1.total) / nd << ", peak above start " << (s2.peak - s0.allocated) / nd
                << " x (N, D)\n";
    }
  }
  SUCCEED();
}
