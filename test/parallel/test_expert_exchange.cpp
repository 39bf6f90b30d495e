// The expert-parallel exchange in process, over a one-rank gloo group: the static and exact
// exchanges give the layer the same rows, and op-level activation checkpointing repeats
// neither the all-to-alls nor the expert GEMMs in its recompute. The multi-rank equality
// (2 and 4 ranks) is in test_dist.cpp.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <stdexcept>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>

#include "core/config/config.h"
#include "core/train/functional.h"
#include "core/train/recompute.h"
#include "moe/moe_layer.h"
#include "parallel/expert_parallel.h"
#include "parallel/launch_env.h"
#include "parallel/process_group.h"
#include "test_port.h"
#include "test_util.h"

using namespace titan;

namespace {

std::unique_ptr<ProcessGroup> one_rank_group(int offset) {
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  (void)offset;  // each group its own free port
  env.master_port = test::free_tcp_port();
  return std::make_unique<ProcessGroup>(env, default_config().comm, /*cuda=*/false);
}

struct Result {
  std::vector<at::Tensor> grads;  // y, dx, then every weight's gradient
  int64_t all_to_alls = 0, replays = 0;
};

// One forward and backward of an MoE layer whose experts go through `ex`, plain or under
// op-level checkpointing.
Result run_layer(ExpertsBackend backend, const std::shared_ptr<ExpertExchange>& ex, bool op_ac) {
  MoEArgs a;
  a.num_experts = 4;
  a.top_k = 2;
  a.score_func = ScoreFunc::Sigmoid;
  a.backend = backend;
  ParamStore store;
  MoELayer moe(a, 16, 24, "moe.", store, at::kCPU, 0.1);
  moe.set_expert_exchange(ex);
  store.initialize(2);
  std::vector<at::Tensor> w;
  for (auto& p : store.all()) w.push_back(p.value.detach().clone().requires_grad_());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  at::Tensor x = at::randn({2, 12, 16}, gen).requires_grad_();
  at::Tensor g = at::randn({2, 12, 16}, gen);
  BlockFn fn = [&](const at::Tensor& in, const std::vector<at::Tensor>& ws) {
    return moe.forward(in, ws, {true, op_ac});
  };
  OpCheckpointPolicy policy;
  Result r;
  const int64_t calls = ProcessGroup::all_to_all_calls(), replays = op_tape_replays();
  at::Tensor y = op_ac ? checkpoint_block_ops(fn, x, w, policy) : fn(x, w);
  y.backward(g);
  r.all_to_alls = ProcessGroup::all_to_all_calls() - calls;
  r.replays = op_tape_replays() - replays;
  r.grads = {y.detach(), x.grad()};
  for (auto& t : w) r.grads.push_back(t.grad().defined() ? t.grad() : at::zeros_like(t));
  return r;
}

}  // namespace

TEST_CASE("expert exchange: op-level checkpointing saves the all-to-alls and expert GEMMs",
          "[moe][dist]") {
  // Reference: the same layer without checkpointing; gradients within 1e-6 of the largest
  // value. Communication: the checkpointed forward and backward make exactly the plain run's
  // all-to-alls (counts, rows out, rows home; and the two reverse ones in backward): the
  // recompute takes the saved results. Its replays: both row all-to-alls and the experts.
  auto pg = one_rank_group(1);
  for (bool fixed : {false, true})
    for (auto backend : {ExpertsBackend::Loop, ExpertsBackend::GroupedMM}) {
      EpExchangeOptions o;
      o.fixed = fixed;
      o.capacity_factor = INFINITY;
      auto ex = make_expert_exchange(*pg, o);
      Result plain = run_layer(backend, ex, false), op = run_layer(backend, ex, true);
      INFO((fixed ? "static" : "exact") << " " << experts_backend_name(backend));
      CHECK(plain.all_to_alls == 5);
      CHECK(op.all_to_alls == plain.all_to_alls);
      CHECK(op.replays >= 3);
      for (size_t i = 0; i < plain.grads.size(); ++i) {
        INFO("tensor " << i);
        CHECK(test::rel_err(op.grads[i], plain.grads[i]) < 1e-6);
      }
    }
}

TEST_CASE("expert exchange: static and exact agree, and a small capacity drops and counts",
          "[moe][dist]") {
  // One rank: the exchange is a local copy, so the exact and the no-drop static exchange
  // must give the same outputs and gradients (1e-6). At capacity factor 0.25 the layer
  // counts its dropped rows on the device and still trains (finite gradients).
  auto pg = one_rank_group(2);
  EpExchangeOptions exact, fixed;
  fixed.fixed = true;
  fixed.capacity_factor = INFINITY;
  Result a = run_layer(ExpertsBackend::GroupedMM, make_expert_exchange(*pg, exact), false);
  Result b = run_layer(ExpertsBackend::GroupedMM, make_expert_exchange(*pg, fixed), false);
  for (size_t i = 0; i < a.grads.size(); ++i) {
    INFO("tensor " << i);
    CHECK(test::rel_err(b.grads[i], a.grads[i]) < 1e-6);
  }
  // 24 tokens x top-2 = 48 rows on one rank; capacity ceil(0.25 * 48) = 12.
  CHECK(ep_static_capacity(48, 2, 1, 4, 0.25) == 12);
  CHECK(ep_static_capacity(48, 2, 1, 4, INFINITY) == 48);
  CHECK(ep_static_capacity(48, 2, 4, 1, INFINITY) == 24);  // one expert per rank: T rows
  EpExchangeOptions small = fixed;
  small.capacity_factor = 0.25;
  MoEArgs args;
  args.num_experts = 4;
  args.top_k = 2;
  args.backend = ExpertsBackend::GroupedMM;
  ParamStore store;
  MoELayer moe(args, 16, 24, "moe.", store, at::kCPU, 0.1);
  moe.set_expert_exchange(make_expert_exchange(*pg, small));
  store.initialize(2);
  std::vector<at::Tensor> w;
  for (auto& p : store.all()) w.push_back(p.value.detach().clone().requires_grad_());
  at::Tensor x = at::randn({2, 12, 16}).requires_grad_();
  auto ex = make_expert_exchange(*pg, small);
  moe.set_expert_exchange(ex);
  moe.forward(x, w, {true, false}).sum().backward();
  CHECK(moe.dropped_tokens.item<double>() == 48 - 12);
  CHECK(at::isfinite(x.grad()).all().item<bool>());
  // The step's overflow, agreed over the (one-rank) group: 36 rows over capacity, and the
  // pair's 48 rows as the peak load; the accumulators restart after the reduction.
  at::Tensor flag = ex->reduce_overflow();
  REQUIRE(flag.defined());
  CHECK(flag[0].item<int64_t>() == 36);
  CHECK(flag[1].item<int64_t>() == 48);
  CHECK(ex->reduce_overflow()[0].item<int64_t>() == 0);
  CHECK(ex->capacity_rows() == 12);
  CHECK(ex->buffer_bytes() == 12 * 16 * 4);  // P * C rows of 16 fp32
  moe_balance_step({&moe}, nullptr);
  auto m = moe_load_metrics({{0, &moe}});
  CHECK(m.at("moe_dropped_tokens") == 36);
}

TEST_CASE(
    "expert exchange: the probs drop policy keeps the most probable rows and its "
    "gradients equal a masked dense reference",
    "[moe][dist]") {
  // One rank, E = 4, top-2, 24 tokens: N = 48 routed rows in one (source, destination) pair
  // of capacity ceil(0.5 * 48) = 24, so half the (token, choice) pairs are dropped: the 24
  // of lowest gate weight. Reference (C++, independent of the dispatch and the exchange):
  // every expert's SwiGLU on every token, gathered by the routing, weighted by the gate
  // weights (DeepSeek: after the experts) and masked where the pair is dropped, plus the
  // shared expert. Output and every gradient within 1e-5 of the largest value; the dropped
  // count is 24.
  auto pg = one_rank_group(3);
  for (const char* backend : {"loop", "grouped"}) {
    INFO(backend);
    MoEArgs a;
    a.num_experts = 4;
    a.top_k = 2;
    a.score_func = ScoreFunc::Sigmoid;
    a.score_before_experts = false;
    a.backend = std::string(backend) == "loop" ? ExpertsBackend::Loop : ExpertsBackend::GroupedMM;
    ParamStore store;
    MoELayer moe(a, 16, 24, "moe.", store, at::kCPU, 0.1);
    EpExchangeOptions o;
    o.fixed = true;
    o.capacity_factor = 0.5;
    o.drop_policy = EpDropPolicy::Probs;
    moe.set_expert_exchange(make_expert_exchange(*pg, o));
    store.initialize(5);
    std::vector<at::Tensor> w, wr;
    for (auto& p : store.all()) {
      w.push_back(p.value.detach().clone().requires_grad_());
      wr.push_back(p.value.detach().clone().requires_grad_());
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
    at::Tensor x0 = at::randn({2, 12, 16}, gen), g = at::randn({2, 12, 16}, gen);
    at::Tensor x = x0.clone().requires_grad_(), xr = x0.clone().requires_grad_();
    at::Tensor y = moe.forward(x, w, {true, false});
    y.backward(g);
    CHECK(moe.dropped_tokens.item<double>() == 24);

    // The reference. Weights in store order: gate, w1, w2, w3, shared w1, w2, w3.
    at::Tensor xt = xr.reshape({24, 16});
    Routing r = route_tokens(xt, wr[0], at::Tensor(), moe.expert_bias, a);
    std::vector<at::Tensor> per_expert;
    for (int64_t e = 0; e < 4; ++e) per_expert.push_back(swiglu(xt, wr[1][e], wr[2][e], wr[3][e]));
    at::Tensor all = at::stack(per_expert, 1);                                       // (T, E, D)
    at::Tensor chosen = all.gather(1, r.experts.unsqueeze(-1).expand({24, 2, 16}));  // (T, K, D)
    at::Tensor flat = r.top_scores.detach().reshape({-1});
    at::Tensor mask = at::zeros({48});
    mask.index_fill_(0, std::get<1>(flat.topk(24)), 1.0);  // the 24 most probable pairs
    at::Tensor wgt = (r.top_scores * mask.view({24, 2})).unsqueeze(-1);
    at::Tensor yr = ((chosen * wgt).sum(1) + swiglu(xt, wr[4], wr[5], wr[6])).view({2, 12, 16});
    yr.backward(g);
    CHECK(test::rel_err(y.detach(), yr.detach()) < 1e-5);
    CHECK(test::rel_err(x.grad(), xr.grad()) < 1e-5);
    for (size_t i = 0; i < w.size(); ++i) {
      INFO("weight " << i);
      CHECK(test::rel_err(w[i].grad(), wr[i].grad()) < 1e-5);
    }
  }
}

TEST_CASE(
    "expert exchange: DeepSeek-V3 671B's receive buffer at the default factor and the "
    "worst case",
    "[moe]") {
  // The figures of docs/moe.md (what `titan-train estimate` should add for the exchange):
  // DeepSeek-V3 671B (dim 7168, top-8 of 256 experts) at EP 64 of 256 ranks, seq_len 4096
  // and one sequence per rank, bf16 rows. N = 4096 * 8 routed rows per rank, balanced share
  // N / 64 = 512 rows per pair; worst case T * min(K, El) = 4096 * 4 rows per pair.
  const int64_t T = 4096, K = 8, P = 64, El = 256 / 64, D = 7168, bf16 = 2;
  const int64_t balanced = T * K * D * bf16;  // what the exact exchange receives, balanced
  const int64_t at2 = ep_static_buffer_bytes(T * K, K, P, El, D, bf16, 2.0);
  const int64_t at4 = ep_static_buffer_bytes(T * K, K, P, El, D, bf16, 4.0);
  const int64_t worst = ep_static_buffer_bytes(T * K, K, P, El, D, bf16, INFINITY);
  WARN(
      "DeepSeek-V3 671B, EP 64, 4096 tokens per rank, bf16: receive buffer per MoE layer and "
      "forward "
      << at2 / 1048576 << " MiB at factor 2, " << at4 / 1048576 << " MiB at the cap 4, "
      << worst / 1048576 << " MiB worst case (balanced " << balanced / 1048576
      << " MiB); x58 MoE layers: " << 58 * at2 / 1048576 << " MiB vs " << 58 * worst / 1048576
      << " MiB");
  CHECK(at2 == 2 * balanced);
  CHECK(at4 == 4 * balanced);
  CHECK(worst == 32 * balanced);
  CHECK(ep_static_capacity(T * K, K, P, El, 2.0) == 1024);
}

namespace {

// Routing planted through the expert bias (added to the scores for selection only, so the
// gate weights stay the router's): -10 on an expert keeps every token off it (sigmoid
// scores are in (0, 1)). E = 4 over 2 ranks: rank 0 holds experts 0, 1, rank 1 experts 2, 3.
struct ZeroCase {
  const char* name;
  std::vector<int64_t> off[2];  // the experts each rank's tokens avoid
};

const ZeroCase kZeroCases[] = {
    {"an expert (3) receives no rows", {{3}, {3}}},
    {"all experts of rank 1 receive no rows (rank 1 receives nothing)", {{2, 3}, {2, 3}}},
    {"the pairs (0 -> 1) and (1 -> 0) carry no rows", {{2, 3}, {0, 1}}},
};

struct Variant {
  const char* name;
  EpExchangeOptions opt;
  bool forced_exact = false;  // the overflow re-run: the static exchange switched to exact
};

std::vector<Variant> zero_variants() {
  std::vector<Variant> v;
  v.push_back({"exact", {}, false});
  EpExchangeOptions st;
  st.fixed = true;
  st.capacity_factor = INFINITY;
  v.push_back({"static (worst case)", st, false});
  st.capacity_factor = 2;  // E = 4, K = 2 over 2 ranks: factor 2 is the worst case, no drops
  v.push_back({"static factor 2, re-run exactly", st, true});
  st.drop_policy = EpDropPolicy::Probs;
  v.push_back({"static factor 2, drop policy probs", st, false});
  return v;
}

constexpr int64_t kZeroE = 4, kZeroD = 16, kZeroH = 24;

MoEArgs zero_args(ExpertsBackend backend) {
  MoEArgs a;
  a.num_experts = kZeroE;
  a.top_k = 2;
  a.score_func = ScoreFunc::Sigmoid;
  a.backend = backend;
  return a;
}

at::Tensor zero_bias(const std::vector<int64_t>& off) {
  at::Tensor b = at::zeros({kZeroE});
  for (int64_t e : off) b[e] = -10.0;
  return b;
}

// The input and output gradient of rank r.
std::pair<at::Tensor, at::Tensor> zero_input(int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + rank);
  at::Tensor x = at::randn({2, 12, kZeroD}, gen), g = at::randn({2, 12, kZeroD}, gen);
  return {x, g};
}

// Reference: one process, the whole layer (all E experts, no exchange) on rank r's tokens
// with rank r's routing: y, dx, then every weight's gradient (whole).
std::vector<at::Tensor> zero_reference(ExpertsBackend backend, const std::vector<at::Tensor>& w0,
                                       const ZeroCase& c, int rank) {
  ParamStore store;
  MoELayer moe(zero_args(backend), kZeroD, kZeroH, "moe.", store, at::kCPU, 0.1);
  moe.expert_bias.copy_(zero_bias(c.off[rank]));
  std::vector<at::Tensor> w;
  for (auto& t : w0) w.push_back(t.clone().requires_grad_());
  auto [x0, g] = zero_input(rank);
  at::Tensor x = x0.clone().requires_grad_();
  at::Tensor y = moe.forward(x, w, {true, false});
  y.backward(g);
  std::vector<at::Tensor> out{y.detach(), x.grad()};
  for (auto& t : w) out.push_back(t.grad().defined() ? t.grad() : at::zeros_like(t));
  return out;
}

// Rank r of 2 in this thread: the layer with rank r's experts, through `v`'s exchange, on
// rank r's tokens, against the references. worst: the largest relative error of y, dx and
// every gradient; counts: this rank's routed rows per expert; error: what threw, if anything.
void zero_rank(int rank, ProcessGroup& pg, ExpertsBackend backend, const ZeroCase& c,
               const Variant& v, double& worst, at::Tensor& counts, std::string& error) {
  try {
    ParamStore store;
    MoELayer moe(zero_args(backend), kZeroD, kZeroH, "moe.", store, at::kCPU, 0.1);
    store.initialize(2);  // the same whole weights on both ranks (and in the reference)
    std::vector<at::Tensor> w0;
    for (auto& p : store.all()) w0.push_back(p.value.detach().clone());
    auto ex = make_expert_exchange(pg, v.opt);
    if (v.forced_exact) ex->force_exact(true);
    moe.set_expert_exchange(ex);
    moe.expert_bias.copy_(zero_bias(c.off[rank]));
    // This rank's experts: rows [r * El, (r + 1) * El) of w1, w2, w3 (store indices 1-3).
    const int64_t El = kZeroE / 2;
    std::vector<at::Tensor> w;
    for (size_t i = 0; i < w0.size(); ++i)
      w.push_back((i >= 1 && i <= 3 ? w0[i].narrow(0, rank * El, El).clone() : w0[i].clone())
                      .requires_grad_());
    auto [x0, g] = zero_input(rank);
    at::Tensor x = x0.clone().requires_grad_();
    at::Tensor y = moe.forward(x, w, {true, false});
    y.backward(g);
    const auto mine = zero_reference(backend, w0, c, rank);
    const auto other = zero_reference(backend, w0, c, 1 - rank);
    auto check = [&](const at::Tensor& ours, const at::Tensor& ref) {
      if (!ours.defined() || ours.sizes() != ref.sizes())
        throw std::runtime_error("a result of the wrong shape");
      worst = std::max(worst, test::rel_err(ours, ref));
    };
    check(y.detach(), mine[0]);
    check(x.grad(), mine[1]);
    for (size_t i = 0; i < w.size(); ++i) {
      at::Tensor got = w[i].grad().defined() ? w[i].grad() : at::zeros_like(w[i]);
      // An expert's gradient sums the rows of both ranks' tokens; the rest is this rank's own.
      const bool expert = i >= 1 && i <= 3;
      check(got, expert ? (mine[2 + i] + other[2 + i]).narrow(0, rank * El, El) : mine[2 + i]);
    }
    counts = moe.tokens_per_expert.clone();  // this rank's routed rows per expert
  } catch (const std::exception& e) {
    error = e.what();
    if (auto nl = error.find('\n'); nl != std::string::npos) error.resize(nl);
  }
}

// One outcome per (case, exchange, kernel) of one rank.
struct ZeroOutcome {
  std::string what;
  double worst = 0;
  at::Tensor counts;
  std::string error;
};

// Rank r of 2 in this thread: one gloo group (one port) for every (case, exchange, kernel)
// in turn.
std::vector<ZeroOutcome> zero_all(int rank, int port) {
  std::vector<ZeroOutcome> out;
  try {
    LaunchEnv env;
    env.source = "test";
    env.rank = env.local_rank = rank;
    env.world_size = env.local_world_size = 2;
    env.master_addr = "127.0.0.1";
    env.master_port = port;
    CommSection cs;
    cs.init_timeout_seconds = cs.train_timeout_seconds = 30;
    ProcessGroup pg(env, cs, /*cuda=*/false);
    for (const ZeroCase& c : kZeroCases)
      for (const Variant& v : zero_variants())
        for (auto backend : {ExpertsBackend::Loop, ExpertsBackend::GroupedMM}) {
          ZeroOutcome o;
          o.what = std::string(c.name) + "; " + v.name + "; " + experts_backend_name(backend);
          zero_rank(rank, pg, backend, c, v, o.worst, o.counts, o.error);
          out.push_back(o);
        }
  } catch (const std::exception& e) {
    out.push_back({"the process group", 0, at::Tensor(), e.what()});
  }
  return out;
}

}  // namespace

TEST_CASE(
    "expert exchange: zero rows for an expert, for all experts of a rank and for a pair, "
    "forward and backward, every exchange and both kernels",
    "[moe][dist][ep_zero]") {
  // Collapsed routing (issue 45): a rank that receives no rows made the exact exchange's
  // receiver gather from an empty tensor. Two ranks in threads over a real gloo group, the
  // routing planted by the expert bias; every exchange (exact, static at the worst case,
  // the overflow re-run (static forced exact), the probs drop policy at a factor that drops
  // nothing) and both kernels (loop, grouped_mm's CPU kernel). Reference: one process, the
  // whole layer without expert parallelism on the same tokens and routing; an expert's
  // gradient is the sum of both ranks' references. Output, input gradient and every weight
  // gradient within 1e-5 of the largest reference value (fp32; the GEMMs' rows in another
  // order).
  const int port = test::free_tcp_port();
  std::vector<ZeroOutcome> r0, r1;
  std::thread t1([&] { r1 = zero_all(1, port); });
  r0 = zero_all(0, port);
  t1.join();
  REQUIRE(r0.size() == r1.size());
  REQUIRE(r0.size() == 24);  // 3 cases x 4 exchanges x 2 kernels
  size_t i = 0;
  for (const ZeroCase& c : kZeroCases)
    for (size_t n = 0; n < 8; ++n, ++i) {
      INFO(r0[i].what);
      CHECK(r0[i].error == "");
      CHECK(r1[i].error == "");
      if (!r0[i].error.empty() || !r1[i].error.empty()) continue;
      // The planted routing: no row of either rank goes to its avoided experts.
      for (int r : {0, 1})
        for (int64_t e : c.off[r])
          CHECK((r == 0 ? r0[i].counts : r1[i].counts)[e].item<double>() == 0);
      CHECK(r0[i].worst < 1e-5);
      CHECK(r1[i].worst < 1e-5);
    }
}
