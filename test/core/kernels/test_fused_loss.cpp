// Chunked linear + cross-entropy (core/kernels/fused_loss) against the unfused
// at::cross_entropy_loss(at::linear(h, W).float(), labels, sum) of the same LibTorch, loss and
// gradients (dh, dW), and its memory bound, measured with a test-local counting wrapper of
// c10's CPU allocator. Error measure: max |a - ref| / max |ref|. Tolerances: fp32 1e-6 for
// the loss and both gradients; bf16 (logits rounded to 8 bits before the fp32 softmax, as in
// the reference) 1e-3 for the loss and 2e-2 for the gradients.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "counting_allocator.h"
#include "test_util.h"
#include "core/kernels/fused_loss.h"

using namespace titan;
using titan::test::CountAllocations;

namespace {

double rel_err(const at::Tensor& a, const at::Tensor& ref) {
  at::Tensor r = ref.detach().to(at::kCPU, at::kDouble);
  const double diff = (a.detach().to(at::kCPU, at::kDouble) - r).abs().max().item<double>();
  const double scale = r.abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

at::Tensor ref_loss(const at::Tensor& h, const at::Tensor& W, const at::Tensor& labels) {
  at::Tensor logits = at::linear(h, W);
  return at::cross_entropy_loss(logits.reshape({-1, W.size(0)}).to(at::kFloat),
                                labels.reshape({-1}), {}, at::Reduction::Sum, kIgnoreIndex);
}

// Labels in [0, V) with about one in five set to the ignore index.
at::Tensor make_labels(at::IntArrayRef shape, int64_t V) {
  at::Tensor l = at::randint(V, shape, at::kLong);
  return at::where(at::rand(shape) < 0.2, at::full_like(l, kIgnoreIndex), l);
}

struct Result {
  at::Tensor loss, dh, dW;
};

constexpr LossBackward kModes[] = {LossBackward::kInForward, LossBackward::kRecompute};
const char* name(LossBackward m) {
  return m == LossBackward::kInForward ? "in forward" : "recompute";
}

Result run(bool fused, const at::Tensor& h0, const at::Tensor& W0, const at::Tensor& labels,
           int64_t chunk, LossBackward mode = LossBackward::kInForward) {
  at::Tensor h = h0.detach().clone().requires_grad_();
  at::Tensor W = W0.detach().clone().requires_grad_();
  at::Tensor loss =
      fused ? fused_linear_cross_entropy(h, W, labels, chunk, mode) : ref_loss(h, W, labels);
  (loss * 0.75).backward();  // an upstream gradient other than 1
  return {loss.detach(), h.grad(), W.grad()};
}

}  // namespace

TEST_CASE("loss: fused equals the unfused loss and gradients in fp32, any chunk size", "[loss]") {
  at::manual_seed(3);
  const int64_t B = 3, T = 13, D = 24, V = 50;  // N = 39 tokens
  at::Tensor h = at::randn({B, T, D}), W = 0.3 * at::randn({V, D});
  at::Tensor labels = make_labels({B, T}, V);
  REQUIRE(labels.eq(kIgnoreIndex).any().item<bool>());
  Result ref = run(false, h, W, labels, 0);
  for (auto mode : kModes)
  for (int64_t chunk : {0, 1, 8, 13, 39, 64}) {  // 8 does not divide 39; 13 does
    INFO(name(mode) << ", chunk " << chunk);
    Result f = run(true, h, W, labels, chunk, mode);
    CHECK(f.loss.dim() == 0);
    CHECK(f.loss.scalar_type() == at::kFloat);
    CHECK(rel_err(f.loss, ref.loss) <= 1e-6);
    CHECK(f.dh.sizes() == h.sizes());
    CHECK(rel_err(f.dh, ref.dh) <= 1e-6);
    CHECK(rel_err(f.dW, ref.dW) <= 1e-6);
  }
  // (N, D) input, every label ignored: zero loss and zero gradients.
  for (auto mode : kModes) {
    Result none =
        run(true, h.reshape({-1, D}), W, at::full({B * T}, kIgnoreIndex, at::kLong), 8, mode);
    CHECK(none.loss.item<float>() == 0.f);
    CHECK(none.dh.abs().max().item<float>() == 0.f);
    CHECK(none.dW.abs().max().item<float>() == 0.f);
  }
}

TEST_CASE("loss: only the inputs that require grad get one; no-grad forwards save nothing",
          "[loss]") {
  at::manual_seed(9);
  at::Tensor h = at::randn({10, 8}), W = at::randn({12, 8});
  at::Tensor labels = make_labels({10}, 12);
  const float ref = ref_loss(h, W, labels).item<float>();
  for (auto mode : kModes) {
    INFO(name(mode));
    at::Tensor hl = h.clone().requires_grad_();
    fused_linear_cross_entropy(hl, W, labels, 3, mode).backward();
    CHECK(hl.grad().defined());
    at::Tensor Wl = W.clone().requires_grad_();
    fused_linear_cross_entropy(h, Wl, labels, 3, mode).backward();
    CHECK(Wl.grad().defined());
    at::NoGradGuard ng;
    at::Tensor l = fused_linear_cross_entropy(h.clone().requires_grad_(), W, labels, 3, mode);
    CHECK_FALSE(l.requires_grad());
    CHECK(l.item<float>() == Approx(ref).epsilon(1e-6));
  }
}

TEST_CASE("loss: a second backward is refused in forward mode and allowed in recompute mode",
          "[loss]") {
  at::Tensor h = at::randn({6, 4}), W = at::randn({5, 4});
  at::Tensor labels = make_labels({6}, 5);
  at::Tensor hl = h.clone().requires_grad_();
  at::Tensor l = fused_linear_cross_entropy(hl, W, labels, 4, LossBackward::kRecompute);
  l.backward({}, /*retain_graph=*/true);
  at::Tensor first = hl.grad().clone();
  l.backward();
  CHECK(rel_err(hl.grad(), 2 * first) <= 1e-6);
  at::Tensor l2 = fused_linear_cross_entropy(hl, W, labels, 4, LossBackward::kInForward);
  l2.backward({}, /*retain_graph=*/true);
  CHECK_THROWS_WITH(l2.backward(), Catch::Contains("backward ran twice"));
}

TEST_CASE("loss: tied output and embedding weights get both gradients", "[loss]") {
  at::manual_seed(4);
  const int64_t B = 2, T = 9, D = 16, V = 40;
  at::Tensor W0 = 0.5 * at::randn({V, D});
  at::Tensor tokens = at::randint(V, {B, T}, at::kLong);
  at::Tensor labels = make_labels({B, T}, V);
  auto grad_of = [&](bool fused, LossBackward mode) {
    at::Tensor W = W0.clone().requires_grad_();
    at::Tensor h = at::tanh(at::embedding(W, tokens)) * 1.5;  // (B, T, D)
    at::Tensor loss =
        fused ? fused_linear_cross_entropy(h, W, labels, 5, mode) : ref_loss(h, W, labels);
    loss.backward();
    return std::make_pair(loss.detach(), W.grad());
  };
  auto [lr, gr] = grad_of(false, LossBackward::kInForward);
  for (auto mode : kModes) {
    INFO(name(mode));
    auto [lf, gf] = grad_of(true, mode);
    CHECK(rel_err(lf, lr) <= 1e-6);
    CHECK(rel_err(gf, gr) <= 1e-6);
    // Both paths contribute: the lookup's rows alone would leave untouched rows at zero.
    CHECK(gf.abs().sum(1).gt(0).all().item<bool>());
  }
}

TEST_CASE("loss: fused equals the unfused loss in bf16", "[loss]") {
  at::manual_seed(5);
  const int64_t N = 50, D = 32, V = 300;
  at::Tensor h = at::randn({N, D}).to(at::kBFloat16);
  at::Tensor W = (0.3 * at::randn({V, D})).to(at::kBFloat16);
  at::Tensor labels = make_labels({N}, V);
  Result ref = run(false, h, W, labels, 0);
  for (auto mode : kModes) {
    INFO(name(mode));
    Result f = run(true, h, W, labels, 16, mode);
    CHECK(f.dh.scalar_type() == at::kBFloat16);
    CHECK(f.dW.scalar_type() == at::kBFloat16);
    CHECK(rel_err(f.loss, ref.loss) <= 1e-3);
    CHECK(rel_err(f.dh, ref.dh) <= 2e-2);
    CHECK(rel_err(f.dW, ref.dW) <= 2e-2);
  }
}

TEST_CASE("loss: default chunk keeps a chunk's fp32 logits within 32 MiB", "[loss]") {
  CHECK(default_loss_chunk_tokens(2048) == 4096);
  CHECK(default_loss_chunk_tokens(32768) == 256);
  CHECK(default_loss_chunk_tokens(128256) == 64);
  CHECK(default_loss_chunk_tokens(int64_t{1} << 22) == 2);  // below 16: not rounded
  CHECK(default_loss_chunk_tokens(int64_t{1} << 30) == 1);
  for (int64_t V : {2048, 32000, 102400, 129280})
    CHECK(default_loss_chunk_tokens(V) * V * 4 <= kLossChunkBytes);
}

TEST_CASE("loss: bad shapes and dtypes are rejected", "[loss]") {
  at::Tensor h = at::randn({4, 8}), W = at::randn({10, 8});
  at::Tensor l = at::zeros({4}, at::kLong);
  CHECK_THROWS_WITH(fused_linear_cross_entropy(h, at::randn({10, 7}), l),
                    Catch::Contains("fused_linear_cross_entropy"));
  CHECK_THROWS_WITH(fused_linear_cross_entropy(h, W.to(at::kBFloat16), l), Catch::Contains("dtype"));
  CHECK_THROWS_WITH(fused_linear_cross_entropy(h, W, l.to(at::kInt)), Catch::Contains("int64"));
  CHECK_THROWS_WITH(fused_linear_cross_entropy(h, W, at::zeros({5}, at::kLong)),
                    Catch::Contains("5 labels for 4 tokens"));
}

// N = 4096 tokens, V = 32768: the full logits would be N * V * 4 = 512 MiB. The fused loss's
// forward + backward may add at most 4 chunks of logits (4 * 32 MiB) to the inputs, the
// fp32 dW and dh. The same counter must see >= 512 MiB for the unfused logits alone.
TEST_CASE("loss: peak CPU memory stays near one chunk of logits", "[loss]") {
  const int64_t N = 4096, V = 32768, D = 16;
  at::manual_seed(6);
  at::Tensor h = at::randn({N, D}), W = 0.1 * at::randn({V, D});
  at::Tensor labels = make_labels({N}, V);
  const int64_t full_logits = N * V * 4;
  const int64_t grads = (N * D + V * D) * 4;
  CountAllocations count;
  for (auto mode : kModes) {
    at::Tensor hh = h.clone().requires_grad_(), WW = W.clone().requires_grad_();
    count.counter.reset_peak();
    const int64_t base = count.counter.live();
    fused_linear_cross_entropy(hh, WW, labels, 0, mode).backward();
    const int64_t growth = count.counter.peak() - base;
    INFO(name(mode) << ": fused peak growth " << growth / (1 << 20) << " MiB");
    CHECK(growth <= 4 * kLossChunkBytes + 2 * grads);
    CHECK(growth < full_logits / 2);
  }
  {
    at::NoGradGuard ng;
    count.counter.reset_peak();
    const int64_t base = count.counter.live();
    at::Tensor logits = at::linear(h, W);
    const int64_t growth = count.counter.peak() - base;
    INFO("unfused logits " << growth / (1 << 20) << " MiB");
    CHECK(growth >= full_logits);
  }
}

// CUDA against the CPU reference: fp32 1e-5 (cuBLAS reduction order, TF32 off by default),
// bf16 as on the CPU. The bf16 dW accumulates through addmm's fp32-output form (CUDA only).
TEST_CASE("loss: CUDA fused loss equals the CPU reference", "[loss][gpu]") {
  if (!at::hasCUDA()) TITAN_SKIP("no CUDA device");
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(7);
  const int64_t N = 300, D = 64, V = 1000;
  at::Tensor labels = make_labels({N}, V);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    INFO(dt);
    const bool f32 = dt == at::kFloat;
    at::Tensor h = at::randn({N, D}).to(dt), W = (0.3 * at::randn({V, D})).to(dt);
    Result ref = run(false, h, W, labels, 0);
    for (auto mode : kModes) {
      INFO(name(mode));
      Result f = run(true, h.to(dev), W.to(dev), labels.to(dev), 64, mode);
      CHECK(rel_err(f.loss, ref.loss) <= (f32 ? 1e-5 : 1e-3));
      CHECK(rel_err(f.dh, ref.dh) <= (f32 ? 1e-5 : 2e-2));
      CHECK(rel_err(f.dW, ref.dW) <= (f32 ? 1e-5 : 2e-2));
    }
  }
}
