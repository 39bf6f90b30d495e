// The tensor-parallel plan as the models declare it, and its checks (parallel/
// tensor_parallel.h): llama3's plan puts every parameter in one group and splits along
// dims tp divides; planted faults (a parameter in no group, in two, an index past the store,
// a degree that does not divide the heads, a model with no plan) are UserErrors (exit 2)
// naming the fault. The multi-rank equality runs are in test_dist.cpp.
#include <catch2/catch.hpp>

#include "core/base/errors.h"
#include "models/deepseek_v3.h"
#include "models/llama3.h"
#include "models/llama4.h"
#include "parallel/tensor_parallel.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

std::unique_ptr<Llama3> debug_llama3() {
  DeferParams defer(true);  // shapes only
  return std::make_unique<Llama3>(llama3_flavor("debugmodel"), at::kCPU);
}

}  // namespace

TEST_CASE("llama3 declares a tensor-parallel plan that covers every parameter once", "[tp]") {
  auto m = debug_llama3();
  const TpPlan& p = m->tp_plan();
  const int64_t L = m->info().n_layers;
  CHECK(p.column.size() == static_cast<size_t>(5 * L));  // wq wk wv w1 w3
  CHECK(p.row.size() == static_cast<size_t>(2 * L));     // wo w2
  CHECK(p.vocab.size() == 2);                            // tok_embeddings, output
  CHECK(p.replicate.size() == static_cast<size_t>(2 * L + 1));
  CHECK(p.column.size() + p.row.size() + p.vocab.size() + p.replicate.size() ==
        static_cast<size_t>(m->params().size()));
  for (int64_t tp : {1, 2, 4, 8, 16}) CHECK_NOTHROW(check_tp_plan(*m, tp));
  // 3 does not divide wq's 256 rows: the first parameter it cannot split is named.
  CHECK_THROWS_WITH(check_tp_plan(*m, 3),
                    Contains("layers.0.attention.wq.weight [256, 256] is column-parallel"));
  // 32 divides every split dim, but not the 16 heads.
  CHECK_THROWS_WITH(check_tp_plan(*m, 32), Contains("does not divide n_heads = 16"));
  for (int64_t i : p.row) CHECK_THAT(m->params()[i].name, Contains("wo") || Contains("w2"));
}

TEST_CASE("a planted wrong tensor-parallel plan is refused naming the fault", "[tp]") {
  auto m = debug_llama3();
  const TpPlan good = m->tp_plan();
  SECTION("a parameter in no group") {
    TpPlan p = good;
    const int64_t dropped = p.replicate.back();  // norm.weight
    p.replicate.pop_back();
    m->set_tp_plan(p);
    CHECK_THROWS_AS(check_tp_plan(*m, 2), UserError);
    CHECK_THROWS_WITH(check_tp_plan(*m, 2),
                      Contains("parameter " + m->params()[dropped].name + " is in no group"));
  }
  SECTION("a parameter in two groups") {
    TpPlan p = good;
    p.row.push_back(p.column.front());
    m->set_tp_plan(p);
    CHECK_THROWS_WITH(check_tp_plan(*m, 2), Contains("in two groups (column and row)"));
  }
  SECTION("an index that is no parameter") {
    TpPlan p = good;
    p.column.push_back(m->params().size() + 3);
    m->set_tp_plan(p);
    CHECK_THROWS_WITH(check_tp_plan(*m, 2), Contains("names parameter index"));
  }
  SECTION("a norm declared row-parallel (a 1-d tensor has no dim 1)") {
    TpPlan p = good;
    p.row.push_back(p.replicate.back());
    p.replicate.pop_back();
    m->set_tp_plan(p);
    CHECK_THROWS_WITH(check_tp_plan(*m, 2), Contains("norm.weight [256] is row-parallel"));
  }
  SECTION("no plan at all") {
    m->set_tp_plan(TpPlan{});
    CHECK_THROWS_WITH(check_tp_plan(*m, 2), Contains("declares no tensor-parallel plan"));
  }
}

TEST_CASE("llama4 and deepseek_v3 split attention and dense layers and keep MoE layers whole",
          "[tp]") {
  DeferParams defer(true);
  Llama4 m(llama4_flavor("debugmodel"), at::kCPU);
  DeepSeekV3 d(deepseek_v3_flavor("debugmodel"), at::kCPU);
  for (const Model* model : {static_cast<const Model*>(&m), static_cast<const Model*>(&d)}) {
    INFO(model->info().name);
    CHECK_NOTHROW(check_tp_plan(*model, 2));
    for (int64_t i : model->tp_plan().replicate) {
      const std::string& n = model->params()[i].name;
      INFO(n);
      // Norms, MoE layers, and MLA's shared down-projections (wq_a, wkv_a).
      CHECK((n.find("norm") != std::string::npos || n.find(".moe.") != std::string::npos ||
             n.find("_a.weight") != std::string::npos));
    }
    for (int64_t i : model->tp_plan().row) CHECK_THAT(model->params()[i].name,
                                                      Contains("wo") || Contains("w2"));
  }
}

TEST_CASE(
    "expert tensor parallelism cuts the routed experts along their hidden size, each "
    "slice drawing the whole tensor's values",
    "[tp]") {
  // Reference: one process's initialization (the counter streams of ParamStore::initialize);
  // tp rank 1 of 2 must hold exactly its hidden rows of w1/w3 and hidden columns of w2.
  Llama4 whole(llama4_flavor("debugmodel"), at::kCPU);
  Llama4 part(llama4_flavor("debugmodel"), at::kCPU);
  const TpPlan& plan = part.tp_plan();
  CHECK(plan.expert_column.size() == 6);  // 3 MoE layers x (w1, w3)
  CHECK(plan.expert_row.size() == 3);     // 3 MoE layers x w2
  CHECK_FALSE(plan.split_experts);
  split_for_tensor_parallel(part, 2, 1, /*split_experts=*/true);
  CHECK(part.tp_plan().split_experts);
  // The replicated set (gradients summed over tp) no longer holds the routed experts.
  for (int64_t i : part.tp_plan().replicated())
    CHECK_THAT(part.params()[i].name, !Contains(".moe.experts.w"));
  whole.params().initialize(3);
  part.params().initialize(3);
  for (int64_t i : plan.expert_column) {
    const Param& p = part.params()[i];
    INFO(p.name);
    CHECK(p.value.sizes().vec() == std::vector<int64_t>{8, 256, 256});
    CHECK(at::equal(p.value, whole.params()[i].value.narrow(1, 256, 256)));
  }
  for (int64_t i : plan.expert_row) {
    const Param& p = part.params()[i];
    INFO(p.name);
    CHECK(p.value.sizes().vec() == std::vector<int64_t>{8, 256, 256});
    CHECK(at::equal(p.value, whole.params()[i].value.narrow(2, 256, 256)));
  }
  // Without expert tensor parallelism the experts stay whole (etp 1, as before).
  Llama4 kept(llama4_flavor("debugmodel"), at::kCPU);
  split_for_tensor_parallel(kept, 2, 0);
  for (int64_t i : plan.expert_column)
    CHECK(kept.params()[i].value.sizes().vec() == std::vector<int64_t>{8, 512, 256});
}
