// The expert-parallel exchange in process, over a one-rank gloo group: the static and exact
// exchanges give the layer the same rows, and op-level activation checkpointing repeats
// neither the all-to-alls nor the expert GEMMs in its recompute. The multi-rank equality
// (2 and 4 ranks) is in test_dist.cpp.
#include <catch2/catch.hpp>

#include <unistd.h>

#include "core/config/config.h"
#include "core/train/recompute.h"
#include "moe/moe_layer.h"
#include "parallel/expert_parallel.h"
#include "parallel/launch_env.h"
#include "parallel/process_group.h"
#include "test_util.h"

using namespace titan;

namespace {

std::unique_ptr<ProcessGroup> one_rank_group(int offset) {
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = 30000 + static_cast<int>(::getpid() % 20000) + offset;
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
  moe.forward(x, w, {true, false}).sum().backward();
  CHECK(moe.dropped_tokens.item<double>() == 48 - 12);
  CHECK(at::isfinite(x.grad()).all().item<bool>());
  moe_balance_step({&moe}, nullptr);
  auto m = moe_load_metrics({{0, &moe}});
  CHECK(m.at("moe_dropped_tokens") == 36);
}
