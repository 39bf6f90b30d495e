// MoE building blocks: router math against hand-computed cases, dispatch (permute/unpermute
// round trip, the aligned layout), experts with empty groups and with every token on one
// expert, and the loop and grouped_mm backends against each other on CPU.
#include <catch2/catch.hpp>

#include "core/base/errors.h"
#include "core/telemetry/memory_stats.h"
#include "moe/dispatch.h"
#include "moe/experts.h"
#include "moe/moe_layer.h"
#include "moe/router.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

at::Tensor T2(std::vector<std::vector<double>> rows) {
  const int64_t r = static_cast<int64_t>(rows.size()), c = static_cast<int64_t>(rows[0].size());
  at::Tensor t = at::empty({r, c}, at::kDouble);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[i][j] = rows[static_cast<size_t>(i)][static_cast<size_t>(j)];
  return t.to(at::kFloat);
}

// Routing whose gate logits are exactly `logits` (T, E): x = I_T and gate_w = logits^T.
Routing route_logits(const at::Tensor& logits, const RouterArgs& a,
                     const at::Tensor& bias = at::Tensor()) {
  const int64_t T = logits.size(0);
  return route_tokens(at::eye(T, at::kFloat), logits.t().contiguous(), at::Tensor(), bias, a);
}

std::vector<int64_t> sorted_row(const at::Tensor& experts, int64_t t) {
  at::Tensor r = std::get<0>(experts[t].sort());
  return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
}

// The per-expert SwiGLU of each row of x computed row by row: (N, D).
at::Tensor dense_experts(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                         const at::Tensor& w3, const std::vector<int64_t>& expert_of_row) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < expert_of_row.size(); ++i) {
    const int64_t e = expert_of_row[i];
    at::Tensor xi = x[static_cast<int64_t>(i)].unsqueeze(0);
    out.push_back(
        at::matmul(at::silu(at::matmul(xi, w1[e].t())) * at::matmul(xi, w3[e].t()), w2[e].t()));
  }
  return at::cat(out);
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  double d = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (d > 0 ? d : 1);
}


// One training forward of `moe` on x and a backward of sum(y^2): the output, x's gradient and
// every parameter's gradient, in store order.
std::vector<at::Tensor> forward_backward(MoELayer& moe, ParamStore& store, const at::Tensor& x) {
  std::vector<at::Tensor> w;
  for (auto& p : store.all()) w.push_back(p.value);
  at::Tensor y = moe.forward(x, w, {true, false});
  y.pow(2).sum().backward();
  std::vector<at::Tensor> r{y.detach(), x.grad()};
  for (auto& p : store.all()) r.push_back(p.value.grad());
  return r;
}

}  // namespace

TEST_CASE("moe router: sigmoid top-1 picks the largest logit and gates with its sigmoid", "[moe]") {
  RouterArgs a;
  a.num_experts = 4;
  a.top_k = 1;
  a.score_func = ScoreFunc::Sigmoid;
  Routing r = route_logits(T2({{0, 1, -1, 2}, {3, 0, 0, 0}}), a);
  CHECK(r.experts[0][0].item<int64_t>() == 3);
  CHECK(r.experts[1][0].item<int64_t>() == 0);
  CHECK(r.top_scores[0][0].item<double>() == Approx(1 / (1 + std::exp(-2.0))).epsilon(1e-6));
  CHECK(r.top_scores[1][0].item<double>() == Approx(1 / (1 + std::exp(-3.0))).epsilon(1e-6));
  CHECK(r.scores.scalar_type() == at::kFloat);
}

TEST_CASE("moe router: softmax top-2 with route_norm and route_scale", "[moe]") {
  RouterArgs a;
  a.num_experts = 4;
  a.top_k = 2;
  a.score_func = ScoreFunc::Softmax;
  at::Tensor logits = T2({{1, 2, 0, 3}});
  // softmax([1, 2, 0, 3]) = e^x / (e + e^2 + 1 + e^3); top-2 = experts 3 and 1.
  const double z = std::exp(1.0) + std::exp(2.0) + 1 + std::exp(3.0);
  Routing r = route_logits(logits, a);
  CHECK(sorted_row(r.experts, 0) == std::vector<int64_t>{1, 3});
  CHECK(r.top_scores.sum().item<double>() == Approx((std::exp(2.0) + std::exp(3.0)) / z));
  a.route_norm = true;
  a.route_scale = 2.5;
  r = route_logits(logits, a);
  // Normalized to sum 1, then scaled: 2.5 * e^3 / (e^2 + e^3) for expert 3.
  at::Tensor w3 = r.top_scores.masked_select(r.experts == 3);
  CHECK(w3.item<double>() == Approx(2.5 * std::exp(3.0) / (std::exp(2.0) + std::exp(3.0))));
  CHECK(r.top_scores.sum().item<double>() == Approx(2.5));
}

TEST_CASE("moe router: expert bias changes the choice but not the gate weight", "[moe]") {
  RouterArgs a;
  a.num_experts = 3;
  a.top_k = 1;
  a.score_func = ScoreFunc::Sigmoid;
  at::Tensor logits = T2({{2, 1, 0}});
  at::Tensor bias = at::tensor({0.0f, 0.5f, 0.0f});  // sigmoid(1) + 0.5 > sigmoid(2)
  Routing r = route_logits(logits, a, bias);
  CHECK(r.experts[0][0].item<int64_t>() == 1);
  CHECK(r.top_scores[0][0].item<double>() == Approx(1 / (1 + std::exp(-1.0))).epsilon(1e-6));
  r = route_logits(logits, a, at::zeros({3}));
  CHECK(r.experts[0][0].item<int64_t>() == 0);
}

TEST_CASE("moe router: group-limited routing keeps the best groups by their top-2 sum", "[moe]") {
  RouterArgs a;
  a.num_experts = 8;
  a.top_k = 2;
  a.score_func = ScoreFunc::Sigmoid;
  a.num_expert_groups = 4;
  a.num_limited_groups = 2;
  // Groups {0,1} {2,3} {4,5} {6,7}. Expert 0 has the largest logit, but its group's top-2 sum
  // (s(5) + s(-5) = 1.0) is low; groups 1 (1.70) and 2 (1.68) win, so the choice is the best
  // two of experts 2..5.
  at::Tensor logits = T2({{5, -5, 2, 1.5, 3, 1, -5, -5}});
  Routing r = route_logits(logits, a);
  CHECK(sorted_row(r.experts, 0) == std::vector<int64_t>{2, 4});
  a.num_expert_groups = 0;
  a.num_limited_groups = 0;
  r = route_logits(logits, a);
  CHECK(sorted_row(r.experts, 0) == std::vector<int64_t>{0, 4});
}

TEST_CASE("moe router: bad arguments are user errors naming the field", "[moe]") {
  auto err = [](RouterArgs a) {
    try {
      validate_router_args(a, "test");
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  RouterArgs ok;
  ok.num_experts = 8;
  ok.top_k = 2;
  CHECK(err(ok).empty());
  RouterArgs a = ok;
  a.top_k = 9;
  CHECK_THAT(err(a), Contains("top_k = 9") && Contains("num_experts = 8"));
  a = ok;
  a.num_expert_groups = 3;
  a.num_limited_groups = 1;
  CHECK_THAT(err(a), Contains("num_expert_groups = 3") && Contains("divide"));
  a = ok;
  a.num_expert_groups = 4;
  a.num_limited_groups = 5;
  CHECK_THAT(err(a), Contains("num_limited_groups = 5"));
  a = ok;
  a.num_expert_groups = 8;
  a.num_limited_groups = 1;
  CHECK_THAT(err(a), Contains("num_expert_groups = 8") && Contains("at least 2"));
  a = ok;
  a.num_expert_groups = 4;
  a.num_limited_groups = 1;
  a.top_k = 3;
  CHECK_THAT(err(a), Contains("top_k = 3"));
}

TEST_CASE("moe dispatch: permute and unpermute round trip in stable expert order", "[moe]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t T = 10, K = 3, E = 5, D = 4;
  at::Tensor experts = at::empty({T, K}, at::kLong);
  for (int64_t t = 0; t < T; ++t) experts[t] = at::randperm(E, gen, at::kLong).slice(0, 0, K);
  at::Tensor x = at::randn({T, D}, gen);
  Dispatch d = plan_dispatch(experts, E, 0);
  at::Tensor flat = experts.reshape({-1});
  at::Tensor sorted = flat.index_select(0, d.order);
  CHECK(at::equal(d.counts, at::bincount(flat, {}, E)));
  CHECK((sorted.slice(0, 1) >= sorted.slice(0, 0, -1)).all().item<bool>());
  // Stable: within an expert, slots keep their order.
  at::Tensor same = sorted.slice(0, 1) == sorted.slice(0, 0, -1);
  CHECK((d.order.slice(0, 1) > d.order.slice(0, 0, -1)).masked_select(same).all().item<bool>());
  at::Tensor xs = permute_tokens(x, d);
  CHECK(at::equal(xs, x.index_select(0, d.order.div(K, "floor"))));
  at::Tensor back = unpermute_tokens(xs, d);  // (T, K, D)
  CHECK(at::equal(back, x.unsqueeze(1).expand({T, K, D})));
}

TEST_CASE("moe dispatch: aligned layout pads every group on the device to a static size", "[moe]") {
  // Counts [3, 0, 9, 1], align 8 -> groups of 8, 8 (empty expert padded too), 16, 8 rows.
  std::vector<int64_t> ids = {2, 0, 2, 2, 3, 2, 0, 2, 2, 2, 0, 2, 2};
  at::Tensor experts = at::tensor(ids, at::kLong).view({-1, 1});
  Dispatch d = plan_dispatch(experts, 4, 8);
  CHECK(d.padded_rows == 48);  // round_up(13 + 4 * 8, 8)
  CHECK(at::equal(d.counts, at::tensor({3, 0, 9, 1}, at::kLong)));
  CHECK(at::equal(d.offs, at::tensor({8, 16, 32, 48}, at::kInt)));
  at::Tensor expect_rows = at::tensor({0, 1, 2, 16, 17, 18, 19, 20, 21, 22, 23, 24, 32}, at::kLong);
  CHECK(at::equal(d.rows, expect_rows));
  // K = 1: token t is slot t. Padding rows read token 0 for the gather, the spare row 13 for
  // the scatter.
  std::vector<int64_t> order = {1, 6, 10, 0, 2, 3, 5, 7, 8, 9, 11, 12, 4};
  at::Tensor gather = at::zeros({48}, at::kLong), scatter = at::full({48}, 13, at::kLong);
  for (size_t i = 0; i < order.size(); ++i) {
    gather[expect_rows[static_cast<int64_t>(i)]] = order[i];
    scatter[expect_rows[static_cast<int64_t>(i)]] = order[i];
  }
  CHECK(at::equal(d.gather_tokens, gather));
  CHECK(at::equal(d.scatter_tokens, scatter));
  CHECK(at::equal(d.padded_order, gather));
  CHECK(d.pad_rows.size(0) == 48 - 13);
  CHECK(at::equal(at::isin(at::arange(48, at::kLong), d.pad_rows), scatter == 13));
  at::Tensor x = at::arange(1, 14, at::kFloat).view({13, 1}).expand({13, 2}).contiguous();
  at::Tensor padded = permute_tokens(x, d);  // straight into the aligned layout
  CHECK(padded.size(0) == 48);
  CHECK(padded.abs().sum().item<double>() == Approx(x.abs().sum().item<double>()));
  at::Tensor xs = x.index_select(0, d.order);  // rows in expert order
  CHECK(at::equal(padded.index_select(0, expect_rows), xs));
  CHECK(at::equal(unpad_groups(padded, d), xs));
}

TEST_CASE("moe experts: empty experts and one expert taking every token, both backends", "[moe]") {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const int64_t E = 4, D = 8, H = 16;
  at::Tensor w1 = (at::randn({E, H, D}, gen) * 0.3).requires_grad_();
  at::Tensor w2 = (at::randn({E, D, H}, gen) * 0.3).requires_grad_();
  at::Tensor w3 = (at::randn({E, H, D}, gen) * 0.3).requires_grad_();
  for (auto ids : {std::vector<int64_t>{1, 1, 3, 1, 3, 1, 1},           // experts 0 and 2 empty
                   std::vector<int64_t>{2, 2, 2, 2, 2, 2, 2, 2, 2}}) {  // all on expert 2
    const int64_t N = static_cast<int64_t>(ids.size());
    Dispatch d = plan_dispatch(at::tensor(ids, at::kLong).view({-1, 1}), E, 8);
    std::vector<int64_t> sorted_ids = ids;
    std::stable_sort(sorted_ids.begin(), sorted_ids.end());
    at::Tensor x = at::randn({N, D}, gen);
    at::Tensor xs = x.index_select(0, d.order).requires_grad_();
    // The grouped backend takes the aligned layout: its permute from xs's rows (K = 1, one
    // token per row, already in expert order, so tokens == rows of xs) and its unpad back.
    Dispatch dx = plan_dispatch(at::tensor(sorted_ids, at::kLong).view({-1, 1}), E, 8);
    at::Tensor g = at::randn({N, D}, gen);
    auto run = [&](int which) {
      for (auto* w : {&w1, &w2, &w3}) w->mutable_grad() = at::Tensor();
      xs.mutable_grad() = at::Tensor();
      at::Tensor y = which == 0   ? dense_experts(xs, w1, w2, w3, sorted_ids)
                     : which == 1 ? loop_experts(xs, w1, w2, w3, counts_to_host(d.counts))
                                  : unpad_groups(grouped_experts(permute_tokens(xs, dx), w1, w2,
                                                                 w3, dx),
                                                 dx);
      y.backward(g);
      return std::vector<at::Tensor>{y.detach(), xs.grad(), w1.grad(), w2.grad(), w3.grad()};
    };
    auto ref = run(0), loop = run(1), grouped = run(2);
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("tensor " << i << " of N = " << N);
      CHECK(rel(loop[i], ref[i]) < 1e-6);
      CHECK(rel(grouped[i], ref[i]) < 1e-6);
    }
    // Experts without tokens get exactly zero gradient.
    for (int64_t e = 0; e < E; ++e)
      if (std::find(ids.begin(), ids.end(), e) == ids.end()) {
        CHECK(loop[2][e].abs().sum().item<double>() == 0);
        CHECK(grouped[2][e].abs().sum().item<double>() == 0);
      }
  }
}

TEST_CASE("moe layer: loop and grouped_mm backends agree on CPU (outputs and gradients)", "[moe]") {
  // at::_grouped_mm runs on CPU in LibTorch 2.11 (a per-group fallback), so the two backends
  // can be compared here in fp32; the CUDA bf16 comparison is in test_moe_cuda.cpp.
  for (bool before : {true, false}) {
    MoEArgs a;
    a.num_experts = 8;
    a.top_k = 3;
    a.num_shared_experts = 1;
    a.score_func = before ? ScoreFunc::Sigmoid : ScoreFunc::Softmax;
    a.score_before_experts = before;
    std::vector<std::vector<at::Tensor>> results;
    for (auto backend : {ExpertsBackend::Loop, ExpertsBackend::GroupedMM}) {
      a.backend = backend;
      ParamStore store;
      MoELayer moe(a, 32, 48, "moe.", store, at::kCPU, 0.02);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
      store.initialize(1);
      at::Tensor x = at::randn({2, 40, 32}, gen).requires_grad_();
      results.push_back(forward_backward(moe, store, x));
    }
    for (size_t i = 0; i < results[0].size(); ++i) {
      INFO("score_before_experts " << before << " tensor " << i);
      CHECK(rel(results[1][i], results[0][i]) < 1e-5);
    }
  }
}

TEST_CASE("moe experts: backend selection on CPU", "[moe]") {
  CHECK(select_experts_backend("auto", at::kCPU) == ExpertsBackend::Loop);
  CHECK(select_experts_backend("loop", at::kCPU) == ExpertsBackend::Loop);
  try {
    select_experts_backend("grouped_mm", at::kCPU);
    FAIL("grouped_mm on the CPU must be refused");
  } catch (const UserError& e) {
    CHECK_THAT(std::string(e.what()), Contains("moe.experts_backend") && Contains("grouped_mm") &&
                                          Contains("9.0") && Contains("loop"));
  }
  try {
    select_experts_backend("cutlass", at::kCPU);
    FAIL("cutlass on the CPU must be refused");
  } catch (const UserError& e) {
    CHECK_THAT(std::string(e.what()), Contains("moe.experts_backend") && Contains("cutlass") &&
                                          Contains("allowed here: auto, loop"));
  }
  CHECK_THROWS_AS(select_experts_backend("fast", at::kCPU), UserError);
}

TEST_CASE("moe experts: the backend choice falls back at start when the shapes or dtype do not fit a kernel",
          "[moe]") {
  // issue 28 item 4: never a failed check inside the run. Devices by compute capability, a
  // build with and without the CUTLASS kernel.
  const ExpertsGemmShape ok{256, 512, at::kBFloat16};
  const ExpertsGemmShape odd_k{256, 100, at::kBFloat16};  // hidden 100: not a multiple of 8
  const ExpertsGemmShape odd_n{250, 512, at::kBFloat16};
  const ExpertsGemmShape fp32{256, 512, at::kFloat};
  // Where everything fits, the usual picks.
  CHECK(choose_experts_backend("auto", 90, false, ok, true).backend == ExpertsBackend::GroupedMM);
  CHECK(choose_experts_backend("auto", 80, false, ok, true).backend == ExpertsBackend::Cutlass);
  CHECK(choose_experts_backend("cutlass", 90, false, ok, true).backend == ExpertsBackend::Cutlass);
  CHECK_FALSE(choose_experts_backend("cutlass", 90, false, ok, true).fell_back);
  // SM80, hidden 100: auto and an explicit cutlass take the loop and say why.
  for (const char* req : {"auto", "cutlass"}) {
    INFO(req);
    ExpertsChoice c = choose_experts_backend(req, 80, false, odd_k, true);
    CHECK(c.backend == ExpertsBackend::Loop);
    CHECK(c.fell_back);
    CHECK_THAT(c.reason, Contains("hidden 100") && Contains("multiples of 8"));
  }
  CHECK(choose_experts_backend("cutlass", 86, false, odd_n, true).backend == ExpertsBackend::Loop);
  // fp32 compute: neither grouped kernel (both bf16-only) on SM90 either.
  ExpertsChoice f = choose_experts_backend("grouped_mm", 90, false, fp32, true);
  CHECK(f.backend == ExpertsBackend::Loop);
  CHECK_THAT(f.reason, Contains("bf16") && Contains("mixed_precision_param"));
  CHECK(choose_experts_backend("auto", 90, false, fp32, true).backend == ExpertsBackend::Loop);
  // A device that cannot run the kernel at all is still refused, naming the key.
  CHECK_THROWS_AS(choose_experts_backend("grouped_mm", 80, false, ok, true), UserError);
  CHECK_THROWS_AS(choose_experts_backend("cutlass", 90, false, ok, false), UserError);
  CHECK_THROWS_AS(choose_experts_backend("cutlass", 75, false, odd_k, true), UserError);
  // The loop under compile.enable is refused at start by check_compile_config (exit 2); on
  // the CPU the static step keeps the grouped layout whatever the shapes (the CPU kernel).
  CHECK(choose_experts_backend("auto", 0, true, odd_k, true).backend == ExpertsBackend::GroupedMM);
}

TEST_CASE("moe dispatch: the aligned permute and combine are one gather each way", "[moe]") {
  // Reference: the unaligned permute/combine (rows in expert order) with the aligned rows
  // picked out by Dispatch::rows; exact (the same adds in the same order). Memory: the
  // product's CPU allocator counts the bytes each call allocates (core/telemetry/memory_stats.h).
  install_cpu_memory_counter();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const int64_t T = 37, K = 2, E = 6, D = 64;
  at::Tensor experts = at::empty({T, K}, at::kLong);
  for (int64_t t = 0; t < T; ++t) experts[t] = at::randperm(E - 1, gen, at::kLong).slice(0, 0, K);
  Dispatch d = plan_dispatch(experts, E, 8), u = plan_dispatch(experts, E, 0);  // expert 5: none
  const int64_t N = T * K, M = d.padded_rows;
  CHECK(d.layout_rows() == M);
  CHECK(d.pad_rows.size(0) == M - N);
  at::Tensor x = at::randn({T, D}, gen).requires_grad_();
  at::Tensor w = at::rand({T, K}, gen);
  at::Tensor g = at::randn({T, D}, gen);

  MemoryStats m0 = cpu_memory_stats();
  at::Tensor xp = permute_tokens(x, d);  // (M, D)
  MemoryStats m1 = cpu_memory_stats();
  CHECK(m1.total - m0.total == M * D * 4);  // the output only: no zero-filled pad buffer
  CHECK(at::equal(xp.index_select(0, d.rows), permute_tokens(x, u)));
  CHECK(xp.index_select(0, d.pad_rows).abs().sum().item<double>() == 0);
  CHECK(at::equal(permute_slots(w, d).index_select(0, d.rows), permute_slots(w, u)));

  // Combine reads the aligned rows directly; padding rows hold garbage here on purpose.
  at::Tensor y = (xp.detach() * 3 + 1).requires_grad_();
  at::Tensor wp = permute_slots(w, d).requires_grad_();
  m0 = cpu_memory_stats();
  at::Tensor out = combine_tokens(y, wp, d);  // (T, D)
  m1 = cpu_memory_stats();
  // The (M, D) weighted rows and the (T + 1, D) fp32 accumulator; nothing else of that size.
  CHECK(m1.total - m0.total <= (M + T + 1) * D * 4 + 1024);
  at::Tensor yu = y.detach().index_select(0, d.rows).requires_grad_();
  at::Tensor wu = permute_slots(w, u).requires_grad_();
  at::Tensor out_u = combine_tokens(yu, wu, u);
  CHECK(at::equal(out, out_u));
  m0 = cpu_memory_stats();
  out.backward(g);
  m1 = cpu_memory_stats();
  out_u.backward(g);
  CHECK(at::equal(y.grad().index_select(0, d.rows), yu.grad()));
  CHECK(y.grad().index_select(0, d.pad_rows).abs().sum().item<double>() == 0);
  CHECK(at::equal(wp.grad().index_select(0, d.rows), wu.grad()));
  CHECK(wp.grad().index_select(0, d.pad_rows).abs().sum().item<double>() == 0);

  // The permute's backward: one index_add into (T + 1, D), equal to the unaligned one's.
  at::Tensor gp = at::randn({M, D}, gen);
  m0 = cpu_memory_stats();
  xp.backward(gp);
  m1 = cpu_memory_stats();
  CHECK(m1.total - m0.total <= (T + 1) * D * 4 + 1024);
  at::Tensor xu = x.detach().requires_grad_();
  permute_tokens(xu, u).backward(gp.index_select(0, d.rows));
  CHECK(at::equal(x.grad(), xu.grad()));
  // The output is an ordinary tensor: in-place ops on it work.
  at::Tensor o2 = combine_tokens(y, wp, d);
  CHECK_NOTHROW(o2.add_(1));
}

TEST_CASE("moe layer: grouped_mm path equals the loop path on CPU, uneven loads", "[moe]") {
  // The grouped path runs on the CPU by setting MoEArgs::backend directly (the product's
  // select_experts_backend refuses it there). Reference: the loop backend; tolerance 1e-5
  // relative (max abs difference over max abs value), fp32. Expert 0 gets no token (bias
  // -100), expert 3 most of them (bias +0.5 on sigmoid scores / softmax scores).
  for (int64_t K : {1, 2})
    for (int64_t shared : {0, 1})
      for (bool before : {true, false}) {
        MoEArgs a;
        a.num_experts = 8;
        a.top_k = K;
        a.num_shared_experts = shared;
        a.score_func = before ? ScoreFunc::Sigmoid : ScoreFunc::Softmax;
        a.score_before_experts = before;
        std::vector<std::vector<at::Tensor>> results;
        std::vector<at::Tensor> counts;
        for (auto backend : {ExpertsBackend::Loop, ExpertsBackend::GroupedMM}) {
          a.backend = backend;
          ParamStore store;
          MoELayer moe(a, 24, 40, "moe.", store, at::kCPU, 0.02);
          store.initialize(4);
          {
            at::NoGradGuard ng;
            moe.expert_bias[0] = -100.0;
            moe.expert_bias[3] = 0.5;
          }
          auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
          at::Tensor x = at::randn({3, 37, 24}, gen).requires_grad_();
          results.push_back(forward_backward(moe, store, x));
          counts.push_back(moe.tokens_per_expert.clone());
        }
        INFO("top-" << K << ", shared " << shared << ", score_before_experts " << before);
        CHECK(at::equal(counts[0], counts[1]));
        CHECK(counts[0][0].item<double>() == 0);
        CHECK(counts[0].max().item<double>() >= 2 * counts[0].mean().item<double>());
        for (size_t i = 0; i < results[0].size(); ++i) {
          INFO("tensor " << i);
          REQUIRE(results[1][i].defined());
          CHECK(rel(results[1][i], results[0][i]) < 1e-5);
        }
        // experts.w1/w2/w3 (params 1..3): expert 0 got no token, so exactly zero gradient.
        for (size_t i = 3; i < 6; ++i) CHECK(results[1][i][0].abs().sum().item<double>() == 0);
      }
}
