// Load balancing: the aux-loss-free expert-bias update (math, counting rules, the
// data-parallel hook, its effect on a skewed router), the load metrics, the buffers'
// checkpoint round trip, and the sequence-wise auxiliary loss.
#include <catch2/catch.hpp>

#include "core/checkpoint/safetensors.h"
#include "core/train/recompute.h"
#include "models/llama4.h"
#include "moe/moe_layer.h"
#include "test_util.h"

using namespace titan;

namespace {

std::vector<at::Tensor> weights_of(const ParamStore& s) {
  std::vector<at::Tensor> w;
  for (auto& p : s.all()) w.push_back(p.value);
  return w;
}

// One MoE layer whose router is skewed towards expert 0: every gate row sees the same input
// direction, and expert 0's row has a larger weight on it.
struct SkewedLayer {
  ParamStore store;
  std::unique_ptr<MoELayer> moe;
  explicit SkewedLayer(double coeff) {
    MoEArgs a;
    a.num_experts = 8;
    a.top_k = 2;
    a.num_shared_experts = 0;
    a.score_func = ScoreFunc::Sigmoid;
    a.load_balance_coeff = coeff;
    moe = std::make_unique<MoELayer>(a, 16, 16, "layers.0.moe.", store, at::kCPU, 0.02);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    store.initialize(1);
    at::NoGradGuard ng;
    at::Tensor gate = store.all()[0].value;
    gate.normal_(0, 0.1, gen);
    gate.select(1, 0).add_(0.05);              // every expert likes feature 0 a little
    gate.select(0, 0).select(0, 0).add_(0.4);  // expert 0 likes it a lot
  }
  // A training step on a fresh batch: forward, a tiny loss, backward, the balance update.
  // Returns the step's max/mean load ratio.
  double step(at::Generator& gen) {
    at::Tensor x = at::randn({4, 64, 16}, gen);
    x.select(2, 0).add_(2.0);  // inputs share feature 0
    at::Tensor y = moe->forward(x, weights_of(store), {true, false});
    (y.pow(2).mean() * 1e-3).backward();
    moe_balance_step({moe.get()}, nullptr);
    return moe_load_metrics({{0, moe.get()}})["moe/layer0/max_mean_load_ratio"];
  }
};

}  // namespace

TEST_CASE("moe balance: the expert-bias update follows the published rule", "[moe]") {
  ParamStore store;
  MoEArgs a;
  a.num_experts = 4;
  a.load_balance_coeff = 0.1;
  MoELayer m(a, 8, 8, "layers.3.moe.", store, at::kCPU, 0.02);
  m.tokens_per_expert.copy_(at::tensor({10.0f, 0.0f, 2.0f, 4.0f}));
  int calls = 0;
  moe_balance_step({&m}, [&](at::Tensor& t) {
    ++calls;
    // One collective for every layer: its 4 counts and its dropped rows.
    CHECK(t.sizes() == at::IntArrayRef({1, 5}));
  });
  CHECK(calls == 1);
  // mean 4: sign(4 - c) = [-1, 1, 1, 0] -> 0.1 * that, minus its mean 0.025.
  at::Tensor expect = at::tensor({-0.125f, 0.075f, 0.075f, -0.025f});
  CHECK(at::allclose(m.expert_bias, expect, 0, 1e-7));
  CHECK(m.tokens_per_expert.abs().sum().item<double>() == 0);  // reset
  auto metrics = moe_load_metrics({{3, &m}});
  CHECK(metrics["moe/layer3/max_mean_load_ratio"] == Approx(2.5));
  CHECK(metrics["moe/layer3/dead_experts"] == 1);
  // The metrics read resets their window.
  CHECK(moe_load_metrics({{3, &m}})["moe/layer3/max_mean_load_ratio"] == 0);

  // Counts are summed over data-parallel ranks before the update: a second rank with the
  // mirrored counts balances the sum, so the bias does not move.
  m.tokens_per_expert.copy_(at::tensor({10.0f, 0.0f, 2.0f, 4.0f}));
  at::Tensor before = m.expert_bias.clone();
  moe_balance_step({&m},
                   [](at::Tensor& t) { t.add_(at::tensor({0.0f, 10.0f, 8.0f, 6.0f, 0.0f})); });
  CHECK(at::allclose(m.expert_bias, before, 0, 1e-7));
  CHECK(moe_load_metrics({{3, &m}})["moe/layer3/max_mean_load_ratio"] == Approx(1.0));

  // coeff 0 turns the update off but keeps the statistics.
  MoEArgs off = a;
  off.load_balance_coeff = 0;
  MoELayer z(off, 8, 8, "z.", store, at::kCPU, 0.02);
  z.tokens_per_expert.copy_(at::tensor({10.0f, 0.0f, 2.0f, 4.0f}));
  moe_balance_step({&z}, nullptr);
  CHECK(z.expert_bias.abs().sum().item<double>() == 0);
  CHECK(moe_load_metrics({{0, &z}})["moe/layer0/dead_experts"] == 1);
}

TEST_CASE("moe balance: a skewed router evens out with the bias and stays skewed without",
          "[moe]") {
  const int steps = 50;
  auto run = [&](double coeff, double& first, double& last) {
    SkewedLayer l(coeff);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
    first = l.step(gen);
    for (int s = 1; s < steps - 5; ++s) l.step(gen);
    last = 0;
    for (int s = 0; s < 5; ++s) last += l.step(gen) / 5;  // mean of the last five steps
    return l.moe->expert_bias.clone();
  };
  double on_first, on_last, off_first, off_last;
  at::Tensor bias_on = run(1e-2, on_first, on_last);
  at::Tensor bias_off = run(0.0, off_first, off_last);
  WARN("max/mean load over " << steps << " steps: coeff 1e-2 " << on_first << " -> " << on_last
                             << ", coeff 0 " << off_first << " -> " << off_last);
  CHECK(on_first > 2.0);  // skewed to begin with
  CHECK(on_last < 0.75 * on_first);
  CHECK(off_last > 0.9 * off_first);
  CHECK(bias_on[0].item<double>() < 0);  // the overloaded expert was pushed down
  CHECK(bias_off.abs().sum().item<double>() == 0);
}

TEST_CASE("moe balance: tokens are counted once per training forward", "[moe]") {
  Llama4Args a = llama4_flavor("debugmodel");
  a.n_layers = 4;  // MoE layers 1 and 3
  a.max_seq_len = 64;
  a.moe.top_k = 2;
  Llama4 m(a, at::kCPU);
  m.init_weights(3);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  at::Tensor tok = at::randint(a.vocab_size, {2, 16}, gen, at::kLong);
  const double per_layer = 2 * 16 * 2;  // B * T * top_k
  auto counted = [&]() {
    double n = 0;
    for (auto* l : m.moe_layers()) n += l->tokens_per_expert.sum().item<double>();
    return n;
  };
  {
    at::NoGradGuard ng;  // evaluation: not counted
    (void)m.forward(tok);
  }
  CHECK(counted() == 0);
  m.forward(tok).sum().backward();
  CHECK(counted() == 2 * per_layer);
  // Under full activation checkpointing the recompute does not count again.
  m.set_recompute_policy([](int64_t) { return true; });
  m.forward(tok).sum().backward();
  CHECK(counted() == 4 * per_layer);
  for (auto* l : m.moe_layers()) CHECK(l->pending_recomputes() == 0);  // host counts consumed
  m.after_optimizer_step();
  CHECK(counted() == 0);
  auto metrics = m.extra_metrics();
  CHECK(metrics.count("moe/layer1/max_mean_load_ratio") == 1);
  CHECK(metrics.count("moe/layer3/dead_experts") == 1);
  CHECK(metrics.count("moe/layer0/dead_experts") == 0);
}

TEST_CASE("moe balance: expert bias survives a buffers() save and load", "[moe]") {
  test::TempDir dir("moe-buffers");
  Llama4Args a = llama4_flavor("debugmodel");
  a.n_layers = 2;
  a.max_seq_len = 64;
  a.moe.load_balance_coeff = 0.05;
  Llama4 m(a, at::kCPU);
  m.init_weights(5);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  at::Tensor tok = at::randint(a.vocab_size, {2, 32}, gen, at::kLong);
  for (int s = 0; s < 3; ++s) {
    m.forward(tok).sum().backward();
    m.after_optimizer_step();
  }
  m.forward(tok).sum().backward();  // leave some counts pending, too
  auto bufs = m.buffers();
  REQUIRE(bufs.size() == 2);
  CHECK(bufs[0].first == "layers.1.moe.expert_bias");
  CHECK(bufs[1].first == "layers.1.moe.tokens_per_expert");
  CHECK(bufs[0].second.abs().sum().item<double>() > 0);
  std::vector<std::pair<std::string, at::Tensor>> saved;
  for (auto& [n, t] : bufs) saved.emplace_back(n, t.clone());
  save_safetensors(dir.file("buffers.safetensors"), saved);

  Llama4 fresh(a, at::kCPU);
  fresh.init_weights(5);
  auto f = SafetensorsFile::open(dir.file("buffers.safetensors"));
  for (auto& [n, t] : fresh.buffers()) t.copy_(f.get(n));  // loading copies into live tensors
  for (size_t i = 0; i < bufs.size(); ++i)
    CHECK(at::equal(fresh.buffers()[i].second, bufs[i].second));
  at::NoGradGuard ng;
  CHECK(at::equal(fresh.forward(tok), m.forward(tok)));  // the bias steers the same routing
}

TEST_CASE("moe balance: the sequence-wise auxiliary loss matches its formula", "[moe]") {
  MoEArgs a;
  a.num_experts = 4;
  a.top_k = 2;
  a.num_shared_experts = 0;
  a.score_func = ScoreFunc::Sigmoid;
  a.seq_aux_loss_coeff = 0.1;
  ParamStore store;
  MoELayer m(a, 8, 8, "moe.", store, at::kCPU, 0.5);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  store.initialize(1);
  at::Tensor x = at::randn({3, 5, 8}, gen);
  (void)m.forward(x, weights_of(store), {true, false});
  at::Tensor aux = m.take_aux_loss();
  REQUIRE(aux.defined());
  // By hand, per sequence: f_i = E / (K S) * count_i, P_i = mean_t s_{i,t} / sum_j s_{j,t}.
  at::NoGradGuard ng;
  Routing r = route_tokens(x.view({15, 8}), store.all()[0].value, at::Tensor(), m.expert_bias, a);
  double total = 0;
  for (int64_t b = 0; b < 3; ++b) {
    at::Tensor s = r.scores.slice(0, b * 5, b * 5 + 5);
    at::Tensor p = (s / s.sum(1, true)).mean(0);
    at::Tensor cnt = at::bincount(r.experts.slice(0, b * 5, b * 5 + 5).reshape({-1}), {}, 4);
    total += (cnt.to(at::kFloat) * 4.0 / (2 * 5) * p).sum().item<double>();
  }
  CHECK(aux.item<double>() == Approx(0.1 * total / 3).epsilon(1e-5));
  CHECK_FALSE(m.take_aux_loss().defined());  // taken
  {
    at::AutoGradMode on(true);
    (void)m.forward(x, weights_of(store), {false, false});  // not a training forward
  }
  CHECK_FALSE(m.take_aux_loss().defined());
}
