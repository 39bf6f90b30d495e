// The routed experts under the zero-bubble split backward (core/kernels/weight_grad_store.h):
// during an I both CPU backends (the grouped GEMM and the per-expert loop) give the input
// gradient and record their three weight-gradient GEMMs; the W's flush gives the weight
// gradients of a fused backward. Reference: the same op's fused backward; tolerance 1e-6
// relative (the same GEMMs, so in practice the same bits).
#include <catch2/catch.hpp>

#include <torch/csrc/autograd/autograd.h>

#include <optional>
#include <vector>

#include "core/kernels/weight_grad_store.h"
#include "moe/experts.h"

using namespace titan;

namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

}  // namespace

TEST_CASE("weight-grad store: grouped experts defer their three weight GEMMs", "[pp][wgrad][moe]") {
  // Both CPU backends of the routed experts: the grouped GEMM (at::_grouped_mm's CPU kernel)
  // and the per-expert loop. 3 experts of 4 -> 8 -> 4, 7 rows in groups of 3, 0 and 4.
  at::manual_seed(11);
  const at::Tensor x0 = at::randn({7, 4});
  const at::Tensor gy = at::randn({7, 4});
  const at::Tensor w10 = at::randn({3, 8, 4}), w20 = at::randn({3, 4, 8}),
                   w30 = at::randn({3, 8, 4});
  const at::Tensor offs = at::tensor(std::vector<int32_t>{3, 3, 7});
  for (const bool loop : {false, true}) {
    INFO((loop ? "loop" : "grouped"));
    auto run = [&](WeightGradStore* store) {
      std::vector<at::Tensor> w{w10.clone().requires_grad_(), w20.clone().requires_grad_(),
                                w30.clone().requires_grad_()};
      at::Tensor x = x0.clone().requires_grad_();
      at::Tensor y = loop ? loop_experts(x, w[0], w[1], w[2], {3, 0, 4})
                          : grouped_swiglu(x, w[0], w[1], w[2], offs, GroupedKernel::Cpu);
      std::optional<DeferWeightGrads> defer;
      if (store) defer.emplace(store);
      torch::autograd::backward({y}, {gy});
      w.push_back(x);
      return w;
    };
    const auto ref = run(nullptr);
    WeightGradStore store;
    const auto got = run(&store);
    CHECK(store.size() == 3);
    for (int i = 0; i < 3; ++i) CHECK(!got[i].grad().defined());
    CHECK(rel(got[3].grad(), ref[3].grad()) < 1e-6);  // the input gradient came in I
    store.flush();
    for (int i = 0; i < 3; ++i) {
      REQUIRE(got[i].grad().defined());
      CHECK(rel(got[i].grad(), ref[i].grad()) < 1e-6);
    }
  }
}
