// Is one GEMM on a concatenated weight faster than separate GEMMs on this CPU? The attention
// projections (wq, wk, wv -> one (q+k+v, D) weight) and the SwiGLU pair (w1, w3 -> one (2F, D)
// weight), forward + backward, separate against fused, alternated, median of repeats.
// Hidden (tag [.projbench]): not part of the test suite; `scripts/bench_ops.sh "[.projbench]"`
// runs it. The decision it informs is recorded in docs/performance.md.
//
// The fused step is what a model would run per micro-batch with the concatenated weight built
// once per optimizer step: one linear, split of the output into views, backward through the
// split (its gradient is one concatenation) and through the weight concatenation into the
// three leaves (the split of the weight gradient). The weight concatenation itself is timed
// apart: it is paid once per optimizer step, not per micro-batch.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "core/kernels/ops.h"
#include "test_util.h"

using namespace titan;

namespace {

using Step = std::function<void()>;

using test::median;
using test::ms_of;

struct Timing {
  double separate, fused;
};

// Alternates the two variants `iters` times after one warm-up each; medians in ms.
Timing alternate(const Step& separate, const Step& fused, int iters) {
  separate();
  fused();
  std::vector<double> ts, tf;
  for (int i = 0; i < iters; ++i) {
    ts.push_back(ms_of(separate));
    tf.push_back(ms_of(fused));
  }
  return {median(ts), median(tf)};
}

std::vector<at::Tensor> leaves(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().requires_grad_());
  return out;
}

void report(const char* what, const Timing& t, double concat_ms) {
  std::printf("  %-22s separate %8.3f ms   fused %8.3f ms   separate/fused %5.3fx"
              "   weight concat %6.3f ms (once per optimizer step)\n",
              what, t.separate, t.fused, t.separate / t.fused, concat_ms);
}

struct Shape {
  const char* name;
  int64_t tokens, dim, heads, kv_heads, ffn;
};

// q, k, v = h wq^T, h wk^T, h wv^T against one h [wq; wk; wv]^T split into views.
void bench_qkv(const Shape& s, at::ScalarType dt, int iters) {
  const int64_t hd = s.dim / s.heads, nq = s.heads * hd, nkv = s.kv_heads * hd;
  auto r = [dt](at::IntArrayRef shape, double scale) { return (at::randn(shape) * scale).to(dt); };
  at::Tensor h = r({s.tokens, s.dim}, 1), wq = r({nq, s.dim}, 0.02), wk = r({nkv, s.dim}, 0.02),
             wv = r({nkv, s.dim}, 0.02);
  std::vector<at::Tensor> g = {r({s.tokens, nq}, 1), r({s.tokens, nkv}, 1), r({s.tokens, nkv}, 1)};
  Step separate = [&] {
    auto v = leaves({h, wq, wk, wv});
    torch::autograd::backward(
        {at::linear(v[0], v[1]), at::linear(v[0], v[2]), at::linear(v[0], v[3])}, g);
  };
  Step fused = [&] {
    auto v = leaves({h, wq, wk, wv});
    at::Tensor w = at::cat({v[1], v[2], v[3]});  // built once per step in a model
    auto parts = at::linear(v[0], w).split_with_sizes({nq, nkv, nkv}, -1);
    torch::autograd::backward({parts[0], parts[1], parts[2]}, g);
  };
  Step concat = [&] { (void)at::cat({wq, wk, wv}); };
  double concat_ms = median({ms_of(concat), ms_of(concat), ms_of(concat), ms_of(concat),
                             ms_of(concat)});
  report("qkv", alternate(separate, fused, iters), concat_ms);
}

// swiglu_act(x w1^T, x w3^T) against swiglu_act on the halves of x [w1; w3]^T.
void bench_w13(const Shape& s, at::ScalarType dt, int iters) {
  auto r = [dt](at::IntArrayRef shape, double scale) { return (at::randn(shape) * scale).to(dt); };
  at::Tensor x = r({s.tokens, s.dim}, 1), w1 = r({s.ffn, s.dim}, 0.02),
             w3 = r({s.ffn, s.dim}, 0.02), gy = r({s.tokens, s.ffn}, 1);
  Step separate = [&] {
    auto v = leaves({x, w1, w3});
    ops::swiglu_act(at::linear(v[0], v[1]), at::linear(v[0], v[2])).backward(gy);
  };
  Step fused = [&] {
    auto v = leaves({x, w1, w3});
    at::Tensor w = at::cat({v[1], v[2]});  // built once per step in a model
    auto ab = at::linear(v[0], w).split(s.ffn, -1);
    ops::swiglu_act(ab[0], ab[1]).backward(gy);
  };
  Step concat = [&] { (void)at::cat({w1, w3}); };
  double concat_ms = median({ms_of(concat), ms_of(concat), ms_of(concat), ms_of(concat),
                             ms_of(concat)});
  report("w1/w3 (+ swiglu_act)", alternate(separate, fused, iters), concat_ms);
}

}  // namespace

TEST_CASE("proj bench: separate against fused QKV and w1/w3 GEMMs on the CPU", "[.projbench]") {
  const char* it = std::getenv("OPS_BENCH_ITERS");
  const int iters = it && *it ? std::atoi(it) : 15;
  std::printf("proj bench: CPU, %d threads, forward + backward, median of %d alternated runs\n",
              at::get_num_threads(), iters);
  const Shape shapes[] = {{"llama3 debugmodel (dim 256, 16/16 heads, ffn 768)", 2048, 256, 16, 16, 768},
                          {"bench_cpu long (dim 384, 6/2 heads, hd 64, ffn 1024)", 1024, 384, 6, 2, 1024}};
  // PROJ_BENCH_BF16=0 skips bf16 (on CPUs without bf16 GEMM units it is slow and not the
  // CPU training dtype).
  const char* bf = std::getenv("PROJ_BENCH_BF16");
  std::vector<at::ScalarType> dtypes = {at::kFloat};
  if (!(bf && std::string(bf) == "0")) dtypes.push_back(at::kBFloat16);
  for (auto dt : dtypes) {
    for (const auto& s : shapes) {
      std::printf("%s, %lld tokens, %s\n", s.name, (long long)s.tokens,
                  dt == at::kFloat ? "fp32" : "bf16");
      at::manual_seed(0);
      bench_qkv(s, dt, iters);
      bench_w13(s, dt, iters);
    }
  }
}
