// CPU time of the fused ops (core/kernels/ops, core/kernels/fused_loss) against the unfused ATen code that
// models/layers.cpp and core/trainer.cpp run today, side by side in one run, at the Llama-3
// debugmodel shapes and a longer one. Hidden (tag [.opsbench]): not part of the test suite;
// scripts/bench_ops.sh runs it. Each timing is the median over iterations of forward +
// backward, the two variants alternating so that machine noise hits both alike.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "core/kernels/fused_loss.h"
#include "core/kernels/ops.h"
#include "test_util.h"
#include "counting_allocator.h"

using namespace titan;

namespace {

struct Shape {
  const char* name;
  int64_t B, T, D, H, F, V;
};

using Step = std::function<void()>;

using test::median;
using test::ms_of;

// Times fused and unfused alternately; prints medians and unfused / fused.
void compare(const char* op, const Step& fused, const Step& unfused, int iters) {
  fused();
  unfused();  // warm-up: first-touch allocations, oneDNN primitive creation
  std::vector<double> tf, tu;
  for (int i = 0; i < iters; ++i) {
    tf.push_back(ms_of(fused));
    tu.push_back(ms_of(unfused));
  }
  const double f = median(tf), u = median(tu);
  std::printf("  %-34s fused %9.3f ms   unfused %9.3f ms   ratio %5.2fx\n", op, f, u, u / f);
}

// Peak CPU bytes a step adds, by the test-local counting allocator.
int64_t peak_growth(const Step& f) {
  test::CountAllocations count;
  count.counter.reset_peak();
  const int64_t base = count.counter.live();
  f();
  return count.counter.peak() - base;
}

// Forward + backward of y = fn(inputs) with upstream gradient gy; inputs are fresh leaves.
Step fwd_bwd(const std::vector<at::Tensor>& inputs, const at::Tensor& gy,
             std::function<at::Tensor(const std::vector<at::Tensor>&)> fn) {
  return [inputs, gy, fn] {
    std::vector<at::Tensor> leaves;
    for (const auto& t : inputs) leaves.push_back(t.detach().requires_grad_());
    fn(leaves).backward(gy);
  };
}

void bench_shape(const Shape& s, at::ScalarType dt, int iters) {
  std::printf("%s: B=%lld T=%lld D=%lld H=%lld ffn=%lld vocab=%lld, %s, forward + backward\n",
              s.name, (long long)s.B, (long long)s.T, (long long)s.D, (long long)s.H,
              (long long)s.F, (long long)s.V, dt == at::kFloat ? "fp32" : "bf16");
  at::manual_seed(0);
  const int64_t hd = s.D / s.H;
  auto randn = [dt](at::IntArrayRef shape) { return at::randn(shape).to(dt); };

  at::Tensor x = randn({s.B, s.T, s.D}), w = at::ones({s.D}), gx = randn({s.B, s.T, s.D});
  compare("rms_norm vs at::rms_norm (today)",
          fwd_bwd({x, w}, gx, [](const auto& v) { return ops::rms_norm(v[0], v[1], 1e-5); }),
          fwd_bwd({x, w}, gx,
                  [](const auto& v) {
                    return at::rms_norm(v[0], {v[0].size(-1)}, v[1].to(v[0].scalar_type()), 1e-5);
                  }),
          iters);
  compare("rms_norm vs 5-op composition",
          fwd_bwd({x, w}, gx, [](const auto& v) { return ops::rms_norm(v[0], v[1], 1e-5); }),
          fwd_bwd({x, w}, gx,
                  [](const auto& v) {
                    at::Tensor xf = v[0].to(at::kFloat);
                    return (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-5) * v[1])
                        .to(v[0].scalar_type());
                  }),
          iters);

  // q of a fused (B, T, 3 * D) projection, as attention would pass it.
  at::Tensor qkv = randn({s.B, s.T, 3 * s.D}), gq = randn({s.B, s.T, s.H, hd});
  at::Tensor freqs = at::pow(10000.0, -at::arange(0, hd, 2, at::kFloat) / static_cast<double>(hd));
  at::Tensor angles = at::outer(at::arange(s.T, at::kFloat), freqs);
  at::Tensor cis = at::polar(at::ones_like(angles), angles);
  auto [cos, sin] = ops::rope_cos_sin(cis);
  auto q_of = [s, hd](const at::Tensor& t) {
    return t.narrow(2, 0, s.D).view({s.B, s.T, s.H, hd});
  };
  compare("apply_rope vs complex form (today)",
          fwd_bwd({qkv}, gq, [&, cos = cos, sin = sin](const auto& v) {
            return ops::apply_rope(q_of(v[0]), cos, sin);
          }),
          fwd_bwd({qkv}, gq,
                  [&](const auto& v) {
                    at::Tensor q = q_of(v[0]);
                    at::Tensor xc = at::view_as_complex(
                        q.to(at::kFloat).reshape({s.B, s.T, s.H, hd / 2, 2}));
                    at::Tensor f = cis.view({1, s.T, 1, hd / 2});
                    return at::view_as_real(xc * f).flatten(3).to(q.scalar_type());
                  }),
          iters);

  at::Tensor a = randn({s.B, s.T, s.F}), b = randn({s.B, s.T, s.F}), ga = randn({s.B, s.T, s.F});
  compare("swiglu_act vs silu(a) * b (today)",
          fwd_bwd({a, b}, ga, [](const auto& v) { return ops::swiglu_act(v[0], v[1]); }),
          fwd_bwd({a, b}, ga, [](const auto& v) { return at::silu(v[0]) * v[1]; }), iters);

  at::Tensor h = randn({s.B * s.T, s.D}), W = (0.02 * at::randn({s.V, s.D})).to(dt);
  at::Tensor labels = at::randint(s.V, {s.B * s.T}, at::kLong);
  at::Tensor one = at::ones({}, at::kFloat);
  Step unfused_loss = fwd_bwd({h, W}, one, [&](const auto& v) {
    return at::cross_entropy_loss(at::linear(v[0], v[1]).to(at::kFloat), labels, {},
                                  at::Reduction::Sum);
  });
  for (auto mode : {LossBackward::kInForward, LossBackward::kRecompute}) {
    const bool in_fwd = mode == LossBackward::kInForward;
    Step fused_loss = fwd_bwd({h, W}, one, [&, mode](const auto& v) {
      return fused_linear_cross_entropy(v[0], v[1], labels, 0, mode);
    });
    compare(in_fwd ? "linear + CE, grads in fwd (today)" : "linear + CE, recompute (today)",
            fused_loss, unfused_loss, iters);
    std::printf("  %-34s fused %9.1f MiB  unfused %9.1f MiB  (peak CPU bytes added, chunk %lld)\n",
                in_fwd ? "  memory, grads in fwd" : "  memory, recompute",
                peak_growth(fused_loss) / 1048576.0, peak_growth(unfused_loss) / 1048576.0,
                (long long)default_loss_chunk_tokens(s.V));
  }
}

}  // namespace

TEST_CASE("ops bench: fused ops against today's unfused ATen code on the CPU", "[.opsbench]") {
  const char* it = std::getenv("OPS_BENCH_ITERS");
  const int iters = it && *it ? std::atoi(it) : 10;
  std::printf("ops bench: CPU, %d threads, kernels %s, median of %d iterations\n",
              at::get_num_threads(), ops::cpu_isa(), iters);
  const Shape debug{"llama3 debugmodel", 8, 256, 256, 16, 768, 2048};
  const Shape longer{"longer", 1, 2048, 1024, 16, 2816, 32768};
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    bench_shape(debug, dt, iters);
    bench_shape(longer, dt, std::max(3, iters / 2));
  }
}
