// Float8 training through the binary (docs/float8.md): the debug models train with
// model.converters = ["float8"] close to, but not equal to, the run without it; a float8 run
// resumes exactly; the CPU capture check passes with float8; bad float8 input exits 2 naming
// the key. Which linears convert is checked on the model directly.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <map>

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
      CHECK_THAT(r.out, Contains(recipe == "tensorwise" ? "scaled_mm GEMMs on cpu"
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

TEST_CASE("float8: a float8 run resumes exactly", "[float8][app]") {
  test::TempDir dir("f8_resume");
  const std::string args =
      "--training.steps 20 --model.converters float8 --quantize.linear.float8.recipe_name "
      "rowwise --checkpoint.enable --checkpoint.interval 10 --job.dump_folder " +
      dir.file("run");
  auto first = train("llama3", args);
  INFO(tail(first.out));
  REQUIRE(first.rc == 0);
  auto straight = test::losses(dir.file("run"));
  REQUIRE(straight.size() == 20);
  // Back to the step-10 checkpoint: steps 11..20 again from what it holds.
  std::filesystem::remove_all(dir.file("run") + "/checkpoint/step-20");
  auto resumed = train("llama3", args);
  INFO(tail(resumed.out));
  REQUIRE(resumed.rc == 0);
  CHECK_THAT(resumed.out, Contains("resumed from"));
  auto again = test::losses(dir.file("run"));
  for (int64_t s = 11; s <= 20; ++s) {
    INFO("step " << s);
    CHECK(again[s] == straight[s]);  // exact
  }
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
      {"--model.converters float8 --quantize.linear.float8.enable_fsdp_float8_all_gather true",
       "quantize.linear.float8.enable_fsdp_float8_all_gather", "not implemented yet"},
      {"--model.converters quantize.linear.float8 "
       "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp true",
       "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "not implemented yet"},
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
