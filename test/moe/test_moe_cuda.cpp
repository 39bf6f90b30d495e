// CUDA-only MoE checks (tag [gpu]: ctest label gpu; skipped on a machine without CUDA):
// the grouped_mm path makes no host sync (ready for CUDA-graph capture), the loop path makes
// exactly one per layer and forward and none in backward, and the two backends agree in bf16.
#include <catch2/catch.hpp>

#include "core/train/recompute.h"
#include "moe/moe_layer.h"
#include "test_util.h"

#if __has_include(<c10/cuda/CUDAFunctions.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#define TITAN_TEST_CUDA_HEADERS 1
#endif

using namespace titan;

namespace {

#ifdef TITAN_TEST_CUDA_HEADERS
// Sets the CUDA sync-debug mode for a scope.
struct SyncDebug {
  c10::cuda::SyncDebugMode saved;
  explicit SyncDebug(c10::cuda::SyncDebugMode m)
      : saved(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::cuda::warning_state().set_sync_debug_mode(m);
  }
  ~SyncDebug() { c10::cuda::warning_state().set_sync_debug_mode(saved); }
};

// Counts warnings (the sync-debug mode's L_WARN reports each sync as one).
struct WarningCounter : c10::WarningHandler {
  int n = 0;
  void process(const c10::Warning&) override { ++n; }
};
#endif

struct CudaLayer {
  ParamStore store;
  std::unique_ptr<MoELayer> moe;
  std::vector<at::Tensor> w;  // bf16 compute forms
  at::Tensor x;
  CudaLayer(ExpertsBackend backend, int64_t seed) {
    MoEArgs a;
    a.num_experts = 8;
    a.top_k = 2;
    a.num_shared_experts = 1;
    a.score_func = ScoreFunc::Sigmoid;
    a.backend = backend;
    at::Device dev(at::kCUDA, 0);
    moe = std::make_unique<MoELayer>(a, 256, 512, "moe.", store, dev, 0.02);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
    store.initialize(static_cast<uint64_t>(seed));
    for (auto& p : store.all()) w.push_back(p.value.to(at::kBFloat16));
    x = at::randn({4, 128, 256}, gen).to(dev, at::kBFloat16).requires_grad_();
  }
};

// Why this machine cannot run a check that needs CUDA (and SM90+ when sm90), or nullptr.
const char* missing_cuda(bool sm90) {
  if (!at::hasCUDA()) return "no CUDA device (runs on the GPU check)";
  if (sm90 && cuda_compute_capability(at::Device(at::kCUDA, 0)) < 90)
    return "CUDA device below compute capability 9.0 (grouped_mm)";
  return nullptr;
}

}  // namespace

TEST_CASE("moe cuda: grouped_mm forward and backward make no host sync", "[moe][gpu]") {
#ifndef TITAN_TEST_CUDA_HEADERS
  TITAN_SKIP("built without CUDA headers");
#else
  if (const char* why = missing_cuda(true)) TITAN_SKIP(why);
  CudaLayer l(ExpertsBackend::GroupedMM, 1);
  at::Tensor g = at::randn_like(l.x);
  {
    SyncDebug mode(c10::cuda::SyncDebugMode::L_ERROR);
    REQUIRE_NOTHROW([&] {
      at::Tensor y = l.moe->forward(l.x, l.w, {true, false});
      y.backward(g);
    }());
  }
  CHECK(l.x.grad().defined());
  CHECK(l.moe->tokens_per_expert.sum().item<double>() == 4 * 128 * 2);
#endif
}

TEST_CASE("moe cuda: the loop backend syncs once per forward and never in backward",
          "[moe][gpu]") {
#ifndef TITAN_TEST_CUDA_HEADERS
  TITAN_SKIP("built without CUDA headers");
#else
  if (const char* why = missing_cuda(false)) TITAN_SKIP(why);
  CudaLayer l(ExpertsBackend::Loop, 2);
  at::Tensor g = at::randn_like(l.x);
  WarningCounter fwd, bwd;
  at::Tensor y;
  {
    SyncDebug mode(c10::cuda::SyncDebugMode::L_WARN);
    {
      c10::WarningUtils::WarningHandlerGuard guard(&fwd);
      y = l.moe->forward(l.x, l.w, {true, false});
    }
    {
      c10::WarningUtils::WarningHandlerGuard guard(&bwd);
      y.backward(g);
    }
  }
  CHECK(fwd.n == 1);
  CHECK(bwd.n == 0);
  // A checkpointed block: its recompute in backward reuses the forward's host counts.
  at::Tensor x = l.x.detach().requires_grad_();
  std::vector<at::Tensor> w;  // fresh compute forms for a fresh graph
  for (auto& p : l.store.all()) w.push_back(p.value.to(at::kBFloat16));
  BlockFn fn = [&](const at::Tensor& in, const std::vector<at::Tensor>& ws) {
    return l.moe->forward(in, ws, {true, true});
  };
  WarningCounter cfwd, cbwd;
  {
    SyncDebug mode(c10::cuda::SyncDebugMode::L_WARN);
    at::Tensor out;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&cfwd);
      out = checkpoint_block(fn, x, w);
    }
    {
      c10::WarningUtils::WarningHandlerGuard guard(&cbwd);
      out.backward(g);
    }
  }
  CHECK(cfwd.n == 1);
  CHECK(cbwd.n == 0);
  CHECK(l.moe->pending_recomputes() == 0);
#endif
}

TEST_CASE("moe cuda: loop and grouped_mm agree in bf16", "[moe][gpu]") {
  if (const char* why = missing_cuda(true)) TITAN_SKIP(why);
  std::vector<std::vector<at::Tensor>> r;
  for (auto b : {ExpertsBackend::Loop, ExpertsBackend::GroupedMM}) {
    CudaLayer l(b, 3);
    at::Tensor y = l.moe->forward(l.x, l.w, {true, false});
    y.to(at::kFloat).pow(2).sum().backward();
    std::vector<at::Tensor> v{y.detach().to(at::kFloat), l.x.grad().to(at::kFloat)};
    for (auto& p : l.store.all()) v.push_back(p.value.grad().to(at::kFloat));
    r.push_back(v);
  }
  for (size_t i = 0; i < r[0].size(); ++i) {
    INFO("tensor " << i);
    double scale = r[0][i].abs().max().item<double>();
    CHECK((r[1][i] - r[0][i]).abs().max().item<double>() <= 2e-2 * scale);
  }
}
