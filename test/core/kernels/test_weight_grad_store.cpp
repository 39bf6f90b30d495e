// The zero-bubble split backward's store (core/kernels/weight_grad_store.h): under a deferring
// store a backward (the pipeline's I) leaves the linear layers' weight gradients unset and
// records one GEMM per layer; flush() (the W) gives the gradients of a fused backward. The
// reference is the same graph's fused backward; tolerance 1e-6 relative (fp32, the same
// GEMMs in the same order, so in practice the same bits), 1e-5 under float8 emulation.
// Recomputed blocks (activation checkpointing) defer too.
#include <catch2/catch.hpp>

#include <torch/csrc/autograd/autograd.h>

#include <optional>

#include "core/kernels/float8_linear.h"
#include "core/kernels/weight_grad_store.h"
#include "core/train/functional.h"
#include "core/train/recompute.h"

using namespace titan;

namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

struct Params {
  at::Tensor norm, w1, w2;  // (8), (16, 8), (8, 16)
};

Params make_params() {
  at::manual_seed(7);
  return {at::rand({8}).add_(0.5).requires_grad_(), at::randn({16, 8}).requires_grad_(),
          at::randn({8, 16}).requires_grad_()};
}

// norm -> project(w1) -> gelu -> project(w2) through a double-precision compute form of the
// weights, so the weight gradients reach the parameters through a cast node that the I has
// already run once (with no gradient) before W runs it again.
at::Tensor forward(const Params& p, const at::Tensor& x) {
  at::Tensor h = rms_norm(x, p.norm, 1e-5);
  h = at::gelu(project(h.to(at::kDouble), p.w1.to(at::kDouble)));
  return project(h, p.w2.to(at::kDouble)).to(at::kFloat);
}

}  // namespace

TEST_CASE("weight-grad store: an I leaves the linear weights' grads to W, which matches fused",
          "[pp][wgrad]") {
  const at::Tensor x0 = at::randn({2, 5, 8});
  const at::Tensor gy = at::randn({2, 5, 8});
  Params ref = make_params();
  at::Tensor xr = x0.clone().requires_grad_();
  {
    SplitBackwardForward split(true);
    torch::autograd::backward({forward(ref, xr)}, {gy});
  }
  Params p = make_params();
  at::Tensor x = x0.clone().requires_grad_();
  at::Tensor y;
  {
    SplitBackwardForward split(true);
    y = forward(p, x);
  }
  WeightGradStore store;
  {
    DeferWeightGrads defer(&store);
    torch::autograd::backward({y}, {gy});
  }
  // After I: the input and the norm weight have their gradients, the linear weights none.
  CHECK(store.size() == 2);
  CHECK(!p.w1.grad().defined());
  CHECK(!p.w2.grad().defined());
  REQUIRE(x.grad().defined());
  CHECK(rel(x.grad(), xr.grad()) < 1e-6);
  CHECK(rel(p.norm.grad(), ref.norm.grad()) < 1e-6);
  store.flush();  // W
  CHECK(store.size() == 0);
  REQUIRE(p.w1.grad().defined());
  REQUIRE(p.w2.grad().defined());
  CHECK(rel(p.w1.grad(), ref.w1.grad()) < 1e-6);
  CHECK(rel(p.w2.grad(), ref.w2.grad()) < 1e-6);
  CHECK(rel(p.norm.grad(), ref.norm.grad()) < 1e-6);  // W did not add to it again
}

TEST_CASE("weight-grad store: float8 linears defer too", "[pp][wgrad]") {
  const float8::Options f8{float8::Recipe::Tensorwise, /*emulate=*/true};
  const at::Tensor x0 = at::randn({6, 16});
  const at::Tensor gy = at::randn({6, 32});
  at::manual_seed(3);
  const at::Tensor w0 = at::randn({32, 16});
  auto run = [&](WeightGradStore* store) {
    at::Tensor w = w0.clone().requires_grad_();
    at::Tensor y = float8::float8_linear(x0, w, at::Tensor(), f8);
    std::optional<DeferWeightGrads> defer;
    if (store) defer.emplace(store);
    torch::autograd::backward({y}, {gy});
    return w;
  };
  const at::Tensor ref = run(nullptr);
  WeightGradStore store;
  const at::Tensor w = run(&store);
  CHECK(store.size() == 1);
  CHECK(!w.grad().defined());
  store.flush();
  REQUIRE(w.grad().defined());
  CHECK(rel(w.grad(), ref.grad()) < 1e-5);
}

TEST_CASE("weight-grad store: recomputed blocks (full and op-level AC) defer onto their weights",
          "[pp][wgrad]") {
  // The rerun differentiates detached copies of the block's weights; its records are moved
  // onto the weights the block received (here the parameters), so W fills their grads.
  BlockFn block = [](const at::Tensor& h, const std::vector<at::Tensor>& ws) {
    return project(at::gelu(project(project(h, ws[0]), ws[1])), ws[2]);
  };
  const OpCheckpointPolicy policy;
  const at::Tensor x0 = at::randn({2, 5, 8});
  auto run = [&](bool ops, WeightGradStore* store) {
    at::manual_seed(5);
    std::vector<at::Tensor> ws{at::randn({16, 8}).requires_grad_(),
                               at::randn({16, 16}).requires_grad_(),
                               at::randn({8, 16}).requires_grad_()};
    at::Tensor x = x0.clone().requires_grad_();
    at::Tensor y;
    {
      SplitBackwardForward split(store != nullptr);
      y = ops ? checkpoint_block_ops(block, x, ws, policy) : checkpoint_block(block, x, ws);
    }
    std::optional<DeferWeightGrads> defer;
    if (store) defer.emplace(store);
    torch::autograd::backward({y}, {at::ones_like(y)});
    ws.push_back(x);
    return ws;
  };
  for (bool ops : {false, true}) {
    INFO((ops ? "op-level" : "full") << " checkpointing");
    const auto ref = run(ops, nullptr);
    WeightGradStore store;
    const auto got = run(ops, &store);
    CHECK(store.size() == 3);
    for (size_t i = 0; i < 3; ++i) CHECK(!got[i].grad().defined());
    CHECK(rel(got[3].grad(), ref[3].grad()) < 1e-6);  // the input's, in I
    store.flush();
    for (size_t i = 0; i < 3; ++i) {
      REQUIRE(got[i].grad().defined());
      CHECK(rel(got[i].grad(), ref[i].grad()) < 1e-6);
    }
  }
}
