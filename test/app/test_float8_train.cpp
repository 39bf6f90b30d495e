// Float8 training through the binary (docs/float8.md): the debug models train with
// model.converters = ["float8"] close to, but not equal to, the run without it; a float8 run
// resumes exactly; the CPU capture check passes with float8; bad float8 input exits 2 naming
// the key. Which linears convert is checked on the model directly. The float8 grouped GEMMs
// of the MoE experts (docs/float8.md, "MoE experts") likewise: the deepseek_v3 and llama4
// debugmodels train with model.converters = ["quantize.grouped_mm.float8"] close to, but not
// equal to, the run without it; the CPU capture check passes with it; expert parallelism
// equals 1 rank; bad input exits 2 naming the key.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/train/float8_linears.h"
#include "core/train/functional.h"
#include "models/registry.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

// seq_len 64 and 2 sequences: a 50-step debug run takes 10-60 s on the CPU.
const std::string kRun =
    "--training.local_batch_size 2 --training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false ";
const std::string kGrouped =
    "--model.converters quantize.grouped_mm.float8 --quantize.grouped_mm.float8.fqns experts ";

test::CmdResult train(const std::string& model, const std::string& args) {
  return test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() +
                   " --config configs/" + model + "_debug.toml " + kRun + args);
}

std::string tail(const std::string& s) {
  return s.substr(s.size() > 3000 ? s.size() - 3000 : 0);
}

// The loss "at step 50" is the mean of steps 41..50. On 128-token batches one step's loss
// swings by up to 20% (the deepseek_v3 debugmodel without float8: 7.82 at step 44, 6.05 at
// step 45), so a 3% bound on a single step would measure that noise, not float8 (measured:
// deepseek_v3 rowwise 7.19 at step 50 against 6.34 without float8, while the means of steps
// 41..50 differ by 1.2%). Tolerance 3% (issue 30). The figures are printed (WARN).
double late_loss(const std::map<int64_t, double>& l) {
  double sum = 0;
  for (int64_t s = 41; s <= 50; ++s) sum += l.at(s);
  return sum / 10;
}

}  // namespace

TEST_CASE("float8: llama3 and deepseek_v3 debugmodels train 50 steps close to the run without it",
          "[float8][app]") {
  for (const std::string model : {"llama3", "deepseek_v3"}) {
    test::TempDir dir("f8_train_" + model);
    auto base = train(model, "--training.steps 50 --job.dump_folder " + dir.file("base"));
    INFO(tail(base.out));
    REQUIRE(base.rc == 0);
    auto lb = test::losses(dir.file("base"));
    REQUIRE(lb.size() == 50);
    for (const std::string recipe : {"tensorwise", "rowwise"}) {
      auto r = train(model,
                     "--training.steps 50 --model.converters float8 "
                     "--quantize.linear.float8.recipe_name " +
                         recipe + " --job.dump_folder " + dir.file(recipe));
      INFO(model << " " << recipe << "\n" << tail(r.out));
      REQUIRE(r.rc == 0);
      CHECK_THAT(r.out, Contains("float8: recipe " + recipe));
      // Tensorwise takes ATen's CPU _scaled_mm unless the start-up probe found it slow here.
      const bool probed_slow = r.out.find("too slow, the CPU GEMMs are emulated") != std::string::npos;
      CHECK_THAT(r.out, Contains(recipe == "tensorwise" && !probed_slow ? "scaled_mm GEMMs on cpu"
                                                                        : "emulated GEMMs on cpu"));
      CHECK_THAT(r.out, Contains("linears converted"));
      auto lf = test::losses(dir.file(recipe));
      REQUIRE(lf.size() == 50);
      const double rel = std::abs(late_loss(lf) - late_loss(lb)) / late_loss(lb);
      WARN(model << " " << recipe << ": loss at step 1 " << lf[1] << " (without float8 " << lb[1]
                 << "), at step 50 " << lf[50] << " (without " << lb[50]
                 << "), mean of steps 41-50 " << late_loss(lf) << " (without " << late_loss(lb)
                 << "), relative difference " << rel);
      CHECK(late_loss(lf) < lf[1] - 1.0);  // it learns
      CHECK(rel < 0.03);
      CHECK(lf[50] != lb[50]);  // float8 is really on
    }
  }
}

TEST_CASE("float8: a run resumes exactly, its precomputed FSDP float8 scales rebuilt on load",
          "[float8][app][dist]") {
  // Float8 keeps one thing between steps: with enable_fsdp_float8_all_gather and
  // precompute_float8_dynamic_scale_for_fsdp, each weight's tensorwise scale is computed
  // after the optimizer step for the next step's all-gather. A resume must rebuild those
  // scales from the loaded weights (a stale or missing scale changes step 4's numbers).
  // FSDP 2, tensorwise, 6 steps; back to the step-3 checkpoint, steps 4..6 bit for bit.
  test::TempDir dir("f8_resume");
  const std::string args =
      "--training.steps 6 --training.local_batch_size 1 --model.converters float8 "
      "--quantize.linear.float8.enable_fsdp_float8_all_gather true "
      "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp true "
      "--checkpoint.enable --checkpoint.interval 3 --job.dump_folder " +
      dir.file("run");
  auto fsdp2 = [&] {
    return test::run("cd " + test::source_dir() + " && " + test::torchrun() +
                     " --standalone --nproc_per_node 2 --no-python " + test::binary() +
                     " --config configs/llama3_debug.toml " + kRun + args);
  };
  auto first = fsdp2();
  INFO(tail(first.out));
  REQUIRE(first.rc == 0);
  CHECK_THAT(first.out, Contains("float8 all-gather of"));
  auto straight = test::losses(dir.file("run"));
  REQUIRE(straight.size() == 6);
  std::filesystem::remove_all(dir.file("run") + "/checkpoint/step-6");
  auto resumed = fsdp2();
  INFO(tail(resumed.out));
  REQUIRE(resumed.rc == 0);
  CHECK_THAT(resumed.out, Contains("resumed from"));
  auto again = test::losses(dir.file("run"));
  for (int64_t s = 4; s <= 6; ++s) {
    INFO("step " << s);
    CHECK(again[s] == straight[s]);  // exact
  }
}

TEST_CASE("float8: a slow CPU _scaled_mm is found at start and the GEMMs are emulated",
          "[float8][app]") {
  // debug.float8_plant_slow_scaled_mm_ms stands in for a processor whose CPU _scaled_mm is
  // hundreds of times slower than the emulation (issue 45): the probe must see it, say so,
  // and train exactly as quantize.linear.float8.emulate = true does (the same kernel).
  test::TempDir dir("f8_probe");
  const std::string args = "--training.steps 3 --model.converters float8 --job.dump_folder ";
  auto slow = train("llama3", args + dir.file("slow") + " --debug.float8_plant_slow_scaled_mm_ms 20");
  INFO(tail(slow.out));
  REQUIRE(slow.rc == 0);
  CHECK_THAT(slow.out, Contains("too slow, the CPU GEMMs are emulated"));
  CHECK_THAT(slow.out, Contains("emulated GEMMs on cpu (ATen's CPU _scaled_mm measured slow"));
  auto emulated =
      train("llama3", args + dir.file("emu") + " --quantize.linear.float8.emulate true");
  INFO(tail(emulated.out));
  REQUIRE(emulated.rc == 0);
  CHECK_THAT(emulated.out, !Contains("float8: CPU _scaled_mm"));  // emulate = true: no probe
  const auto ls = test::losses(dir.file("slow")), le = test::losses(dir.file("emu"));
  REQUIRE(ls.size() == 3);
  REQUIRE(le.size() == 3);
  for (int64_t s = 1; s <= 3; ++s) CHECK(ls.at(s) == le.at(s));  // bit for bit
  // A rowwise recipe is emulated on the CPU anyway: no probe is run.
  auto rw = train("llama3", args + dir.file("rw") +
                                " --quantize.linear.float8.recipe_name rowwise --training.steps 1");
  REQUIRE(rw.rc == 0);
  CHECK_THAT(rw.out, !Contains("float8: CPU _scaled_mm"));
}

TEST_CASE("float8: the CPU capture check passes with float8 on", "[float8][app][compile]") {
  test::TempDir dir("f8_compile");
  for (const std::string model : {"llama3", "deepseek_v3"})
    for (const std::string recipe : {"tensorwise", "rowwise"}) {
      // v0.2.2's converter name here, the older "float8" elsewhere.
      auto r = train(model,
                     "--training.steps 5 --compile.enable true "
                     "--model.converters quantize.linear.float8 "
                     "--quantize.linear.float8.recipe_name " +
                         recipe + " --job.dump_folder " + dir.file(model + recipe));
      INFO(model << " " << recipe << "\n" << tail(r.out));
      REQUIRE(r.rc == 0);
      CHECK_THAT(r.out, Contains("float8: recipe " + recipe));
      CHECK_THAT(r.out, Contains("capture check: 3 steps compared"));
    }
}

TEST_CASE("float8: bad float8 input exits 2 naming the key", "[float8][app]") {
  test::TempDir dir("f8_bad");
  struct Case {
    std::string args, key, says;
  };
  const std::vector<Case> cases = {
      {"--model.converters mx", "model.converters",
       "one of float8, quantize.linear.float8, quantize.grouped_mm.float8"},
      {"--model.converters float8 --quantize.linear.float8.recipe_name blockwise",
       "quantize.linear.float8.recipe_name", "tensorwise, rowwise, rowwise_with_gw_hp"},
      {"--model.converters float8 --quantize.linear.float8.enable_fsdp_float8_all_gather true "
       "--quantize.linear.float8.recipe_name rowwise",
       "quantize.linear.float8.enable_fsdp_float8_all_gather", "tensorwise scales only"},
      {"--model.converters quantize.linear.float8 "
       "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp true",
       "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
       "enable_fsdp_float8_all_gather = true"},
      {"--model.converters quantize.grouped_mm.float8", "model.converters", "no routed experts"},
      {"--model.converters float8 --quantize.linear.float8.recipe_name rowwise_with_gw_hp "
       "--quantize.linear.float8.filter_fqns auto_filter_small_kn",
       "quantize.linear.float8.filter_fqns", "rowwise_with_gw_hp"},
      {"--model.converters float8 --activation_checkpoint.mode selective "
       "--activation_checkpoint.selective_ac_option op",
       "activation_checkpoint.selective_ac_option", "not implemented yet"},
  };
  for (const Case& c : cases) {
    auto r =
        train("llama3", "--training.steps 1 --job.dump_folder " + dir.file("x") + " " + c.args);
    INFO(c.args << "\n" << tail(r.out));
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains(c.key));
    CHECK_THAT(r.out, Contains(c.says));
  }
  // The TOML tables: torchtitan v0.2.2's nested [quantize.linear.float8] and v0.1's [float8]
  // (an alias that warns) both set the key.
  for (const std::string section : {"quantize.linear.float8", "float8"}) {
    test::write_file(dir.file("f8.toml"), "[model]\nconverters = [\"float8\"]\n[" + section +
                                              "]\nrecipe_name = \"rowwise\"\nemulate = true\n");
    auto r = test::run("cd " + test::source_dir() + " && " + test::binary() + " --config " +
                       dir.file("f8.toml") + " --dump-config");
    INFO(section << "\n" << r.out);
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("[quantize.linear.float8]"));
    CHECK_THAT(r.out, Contains("recipe_name = 'rowwise'"));
    CHECK_THAT(r.out, Contains("emulate = true"));
  }
}

// Tolerance 0: a converted linear's project() is float8_linear itself.
TEST_CASE("float8: which linears convert, and project() runs them in float8", "[float8]") {
  for (const std::string name : {"llama3", "deepseek_v3"}) {
    JobConfig cfg = default_config();
    cfg.model.name = name;
    cfg.model.flavor = "debugmodel";
    auto model = build_model(cfg, at::kCPU);
    const ParamStore& ps = model->params();
    Float8Plan all = plan_float8_linears(ps, {}, float8::Recipe::Tensorwise);
    INFO(name);
    REQUIRE(!all.converted.empty());
    for (int64_t i : all.converted) {
      const std::string& n = ps[i].name;
      INFO(n);
      CHECK(n.find("output") == std::string::npos);
      CHECK(n.find("tok_embeddings") == std::string::npos);
      CHECK(n.find("router") == std::string::npos);
      CHECK((n.find("experts.w") == std::string::npos ||
             n.find("shared_experts") != std::string::npos));
    }
    // filter_fqns: substrings of the fqn.
    Float8Plan no_wq = plan_float8_linears(ps, {"attention.wq"}, float8::Recipe::Rowwise);
    CHECK(no_wq.converted.size() + no_wq.filtered.size() ==
          all.converted.size() + all.filtered.size());
    CHECK(no_wq.filtered.size() > all.filtered.size());
    // The debug models are far below torchao's thresholds: auto_filter_small_kn keeps all.
    Float8Plan small = plan_float8_linears(ps, {"auto_filter_small_kn"}, float8::Recipe::Rowwise);
    CHECK(small.converted.empty());
  }
  // project() with a marked weight is float8_linear; unmarked, at::linear.
  at::Tensor x = at::randn({4, 32}), w = at::randn({16, 32});
  at::Tensor plain = project(x, w);
  CHECK(at::equal(plain, at::linear(x, w)));
  float8::Options o{float8::Recipe::Rowwise, false};
  mark_float8_weight(w, o);
  at::Tensor f8 = project(x, w);
  CHECK(at::equal(f8, float8::float8_linear(x, w, at::Tensor(), o)));
  CHECK_FALSE(at::equal(f8, plain));
  CHECK_FALSE(float8_options_of(at::randn({16, 32})).has_value());
}

TEST_CASE(
    "float8 grouped: deepseek_v3 and llama4 debugmodels train 50 steps close to the run "
    "without it",
    "[float8][moe][app]") {
  for (const std::string model : {"deepseek_v3", "llama4"}) {
    test::TempDir dir("f8g_train_" + model);
    auto base = train(model, "--training.steps 50 --job.dump_folder " + dir.file("base"));
    INFO(tail(base.out));
    REQUIRE(base.rc == 0);
    auto lb = test::losses(dir.file("base"));
    REQUIRE(lb.size() == 50);
    auto r =
        train(model, "--training.steps 50 " + kGrouped + "--job.dump_folder " + dir.file("f8"));
    INFO(model << "\n" << tail(r.out));
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("=> float8 grouped GEMMs (quantize.grouped_mm.float8): torchao's "
                               "rowwise recipe, e4m3, power-of-2 scales; emulated on the CPU"));
    CHECK_THAT(r.out, Contains("=> float8 grouped GEMMs: routed experts of"));
    auto lf = test::losses(dir.file("f8"));
    REQUIRE(lf.size() == 50);
    const double rel = std::abs(late_loss(lf) - late_loss(lb)) / late_loss(lb);
    WARN(model << ": loss at step 1 " << lf[1] << " (without float8 " << lb[1] << "), at step 50 "
               << lf[50] << " (without " << lb[50] << "), mean of steps 41-50 " << late_loss(lf)
               << " (without " << late_loss(lb) << "), relative difference " << rel);
    CHECK(late_loss(lf) < lf[1] - 1.0);  // it learns
    CHECK(rel < 0.03);
    CHECK(lf[50] != lb[50]);  // float8 is really on
  }
}

TEST_CASE("float8 grouped: the CPU capture check passes with float8 grouped GEMMs on",
          "[float8][moe][app][compile]") {
  test::TempDir dir("f8g_compile");
  for (const std::string model : {"deepseek_v3", "llama4"}) {
    auto r = train(model, "--training.steps 5 --compile.enable true " + kGrouped +
                              "--job.dump_folder " + dir.file(model));
    INFO(model << "\n" << tail(r.out));
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("=> float8 grouped GEMMs: routed experts of"));
    CHECK_THAT(r.out, Contains("capture check: 3 steps compared"));
  }
}

TEST_CASE("float8 grouped: bad input exits 2 naming the key", "[float8][moe][app]") {
  test::TempDir dir("f8g_bad");
  struct Case {
    std::string model, args, key, says;
  };
  const std::string conv = "--model.converters quantize.grouped_mm.float8 ";
  const std::vector<Case> cases = {
      {"deepseek_v3", conv + "--quantize.grouped_mm.float8.fqns nomatch",
       "quantize.grouped_mm.float8.fqns", "\"nomatch\" matches no routed experts module"},
      {"deepseek_v3", conv, "quantize.grouped_mm.float8.fqns", "converts nothing"},
      {"llama4", kGrouped + "--moe.experts_backend loop", "moe.experts_backend", "cannot run"},
      {"llama3", kGrouped, "model.converters", "no routed experts"},
      {"deepseek_v3",
       kGrouped + "--parallelism.tensor_parallel_degree 2 "
                  "--parallelism.expert_tensor_parallel_degree 2",
       "parallelism.expert_tensor_parallel_degree", "not implemented yet"},
      {"deepseek_v3", kGrouped + "--parallelism.context_parallel_degree 2",
       "parallelism.context_parallel_degree", "quantize.grouped_mm.float8"},
  };
  for (const Case& c : cases) {
    auto r = train(c.model, "--training.steps 1 --job.dump_folder " + dir.file("x") + " " + c.args);
    INFO(c.model << " " << c.args << "\n" << tail(r.out));
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains(c.key));
    CHECK_THAT(r.out, Contains(c.says));
  }
}

// Expert parallelism with float8 grouped GEMMs: each expert is whole on its rank and receives
// the same tokens as on one rank, so every scale (per row, per expert and column, per group
// and column) is the one-rank scale; only the GEMMs' sums run in another order. EP 2 (2
// ranks, 1 sequence each) against 1 rank with both sequences, deepseek_v3, 4 steps.
TEST_CASE("float8 grouped: expert parallelism 2 matches one rank", "[float8][moe][app][dist]") {
  test::TempDir dir("f8g_ep");
  const std::string common =
      "--config configs/deepseek_v3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --training.steps 4 "
      "--debug.seed 3 " +
      kGrouped;
  auto one = test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                       test::binary() + " " + common +
                       "--training.local_batch_size 2 --job.dump_folder " + dir.file("one"));
  INFO(tail(one.out));
  REQUIRE(one.rc == 0);
  auto ep =
      test::run("cd " + test::source_dir() + " && " + test::torchrun() +
                " --standalone --nproc_per_node 2 --no-python " + test::binary() + " " + common +
                "--training.local_batch_size 1 --parallelism.expert_parallel_degree 2 "
                "--job.dump_folder " +
                dir.file("ep"));
  INFO(tail(ep.out));
  REQUIRE(ep.rc == 0);
  CHECK_THAT(ep.out, Contains("(ep 2"));
  CHECK_THAT(ep.out, Contains("=> float8 grouped GEMMs: routed experts of"));
  auto l1 = test::losses(dir.file("one")), l2 = test::losses(dir.file("ep"));
  REQUIRE(l1.size() == 4);
  REQUIRE(l2.size() == 4);
  double worst = 0;
  for (auto& [s, l] : l1) worst = std::max(worst, std::abs(l - l2.at(s)) / l);
  WARN("float8 grouped, ep 2 vs 1 rank over 4 steps: max relative loss difference " << worst);
  CHECK(worst < 1e-5);
}

// Full checkpointing recomputes the float8 forward; op-level checkpointing saves the float8
// GEMM outputs and replays them under the float8 backward. Both repeat the run without
// checkpointing exactly (measured: losses and grad norms bit-equal over 5 steps).
TEST_CASE("float8 grouped: full and op-level activation checkpointing change nothing",
          "[float8][moe][app]") {
  test::TempDir dir("f8g_ac");
  const std::string base = "--training.steps 5 " + kGrouped + "--activation_checkpoint.mode ";
  std::map<std::string, std::map<int64_t, double>> runs;
  for (const std::string ac : {"none", "full",
                               "selective --activation_checkpoint."
                               "selective_ac_option op"}) {
    const std::string name = ac.substr(0, 4);
    auto r = train("deepseek_v3", base + ac + " --job.dump_folder " + dir.file(name));
    INFO(ac << "\n" << tail(r.out));
    REQUIRE(r.rc == 0);
    runs[name] = test::losses(dir.file(name));
    REQUIRE(runs[name].size() == 5);
  }
  for (int64_t s = 1; s <= 5; ++s) {
    INFO("step " << s);
    CHECK(runs["full"][s] == runs["none"][s]);
    CHECK(runs["sele"][s] == runs["none"][s]);
  }
}

// titan-train estimate's meta-device step runs the experts in high precision (no meta
// kernels for the casts); it must not fail with the converter on.
TEST_CASE("float8 grouped: estimate runs with the converter on", "[float8][moe][app]") {
  auto r = test::run("cd " + test::source_dir() + " && " + test::binary() +
                     " estimate --config configs/deepseek_v3_debug.toml " + kGrouped);
  INFO(tail(r.out));
  CHECK(r.rc == 0);
  CHECK_THAT(r.out, Contains("=> float8 grouped GEMMs: routed experts of 5 of 5 MoE layers"));
}
