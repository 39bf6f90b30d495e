// The expert-parallel capacity control's metrics (app/ep_capacity.h): the peak pair load is
// measured under every exchange, also where no overflow is checked (issue 45).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "app/ep_capacity.h"
#include "core/config/config.h"
#include "moe/moe_layer.h"
#include "parallel/expert_parallel.h"
#include "parallel/launch_env.h"
#include "parallel/process_group.h"
#include "test_port.h"

using namespace titan;

TEST_CASE("the peak pair load is reported at capacity factor inf and with the probs drop policy",
          "[moe][dist][ep_metrics]") {
  // One rank: every routed row of the layer goes to the one destination, so the peak pair
  // holds all N = 24 tokens x top-2 = 48 rows, and the balanced share N / P is 48 too: the
  // load is exactly 1 (it was 0 where no overflow flag is read). Neither set-up re-runs, so
  // EpCapacityControl never reads a flag in settle(); the figure comes from the metrics read.
  LaunchEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = test::free_tcp_port();
  ProcessGroup pg(env, default_config().comm, /*cuda=*/false);
  struct Setup {
    const char* name;
    double factor;
    EpDropPolicy policy;
    bool rerun;
  };
  for (const Setup& s : {Setup{"factor inf", INFINITY, EpDropPolicy::None, false},
                         Setup{"probs at factor 0.5", 0.5, EpDropPolicy::Probs, false}}) {
    INFO(s.name);
    EpExchangeOptions o;
    o.fixed = true;
    o.capacity_factor = s.factor;
    o.drop_policy = s.policy;
    auto ex = make_expert_exchange(pg, o);
    EpCapacityPolicy p;
    p.rerun = s.rerun;
    EpCapacityControl control(ex, p);
    MoEArgs a;
    a.num_experts = 4;
    a.top_k = 2;
    a.backend = ExpertsBackend::GroupedMM;
    ParamStore store;
    MoELayer moe(a, 16, 24, "moe.", store, at::kCPU, 0.1);
    moe.set_expert_exchange(ex);
    store.initialize(2);
    std::vector<at::Tensor> w;
    for (auto& q : store.all()) w.push_back(q.value.detach().clone().requires_grad_());
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    at::Tensor x = at::randn({2, 12, 16}, gen).requires_grad_();
    moe.forward(x, w, {true, false}).sum().backward();
    control.reduce_overflow();  // the end of the step's forward+backward, as the trainer calls it
    auto m = control.take_metrics();
    REQUIRE(m.count("moe_ep_peak_pair_load"));
    CHECK(m.at("moe_ep_peak_pair_load") == 1.0);
    // The accumulators restart: a log step without training dispatches reports 0.
    CHECK(control.take_metrics().at("moe_ep_peak_pair_load") == 0.0);
  }
}
