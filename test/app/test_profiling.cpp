// profiling.* (torchtitan's keys and schedule): the windows fall where torch.profiler's
// schedule(wait, warmup, active) puts them in torchtitan's loop, and a profiled run writes a
// Chrome trace that parses as JSON with traceEvents, holding the step's ATen ops.
#include <catch2/catch.hpp>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/telemetry/profiler.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

TEST_CASE("profiling: the schedule is torchtitan's", "[profiling]") {
  // torchtitan: schedule(wait = freq - warmup - active, warmup, active) stepped once per
  // training step from step_num = 0, so training step k is in position (k - 1) % freq and
  // the window saved after step 10 is iteration_10.
  ProfilingSection p = default_config().profiling;
  REQUIRE(p.profile_freq == 10);
  REQUIRE(p.profiler_warmup == 3);
  REQUIRE(p.profiler_active == 1);
  using Ph = StepProfiler::Phase;
  for (int64_t k = 1; k <= 6; ++k) CHECK(StepProfiler::phase(p, k) == Ph::Wait);
  for (int64_t k = 7; k <= 9; ++k) CHECK(StepProfiler::phase(p, k) == Ph::Warmup);
  CHECK(StepProfiler::phase(p, 10) == Ph::Active);
  CHECK(StepProfiler::phase(p, 11) == Ph::Wait);
  CHECK(StepProfiler::phase(p, 20) == Ph::Active);
  p.profile_freq = 2;
  p.profiler_warmup = 0;
  p.profiler_active = 2;
  CHECK(StepProfiler::phase(p, 1) == Ph::Active);
  CHECK(StepProfiler::phase(p, 2) == Ph::Active);
  p.save_traces_folder = "tr";
  StepProfiler sp(p, "/d", 3, false);
  CHECK(sp.trace_path(20) == "/d/tr/iteration_20/rank3_trace.json");
}

TEST_CASE("profiling: a profiled run writes a Chrome trace of its window", "[profiling]") {
  test::TempDir dir("prof");
  const std::string run = "cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                          test::binary() +
                          " --config configs/llama3_debug.toml --training.steps 2 "
                          "--training.local_batch_size 2 --training.seq_len 64 "
                          "--validation.enable false --metrics.enable_tensorboard false "
                          "--profiling.enable_profiling --profiling.profile_freq 2 "
                          "--profiling.profiler_warmup 1 --profiling.profiler_active 1 "
                          "--job.dump_folder ";
  auto r = test::run(run + dir.file("a") + " --profiling.save_traces_folder traces");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const std::string trace = dir.file("a") + "/traces/iteration_2/rank0_trace.json";
  REQUIRE(fs::exists(trace));
  CHECK_FALSE(fs::exists(dir.file("a") + "/traces/iteration_1"));
  CHECK_FALSE(fs::exists(trace + ".tmp"));
  CHECK_THAT(r.out, Contains("trace of step 2 written to " + trace));
  auto j = nlohmann::json::parse(test::read_file(trace));  // throws if not JSON
  REQUIRE(j.contains("traceEvents"));
  REQUIRE(j["traceEvents"].is_array());
  int64_t aten = 0, mm = 0;
  bool step_span = false, fwdbwd = false, optim = false;
  for (auto& e : j["traceEvents"]) {
    if (!e.contains("name") || !e["name"].is_string()) continue;
    const std::string n = e["name"];
    aten += n.rfind("aten::", 0) == 0;
    mm += n == "aten::mm" || n == "aten::addmm" || n == "aten::matmul";
    step_span |= n == "ProfilerStep#2";
    fwdbwd |= n == "titan::forward_backward";
    optim |= n == "titan::optimizer";
  }
  INFO(aten << " aten events");
  CHECK(aten > 100);
  CHECK(mm > 0);
  CHECK(step_span);
  CHECK(fwdbwd);
  CHECK(optim);

  // profile_freq below warmup + active is a config error naming the keys, exit 2.
  auto bad = test::run(run + dir.file("b") + " --profiling.profiler_warmup 3");
  CHECK(bad.rc == 2);
  CHECK_THAT(bad.out, Contains("profiling.profile_freq = 2") &&
                          Contains("profile_freq >= profiler_warmup + profiler_active"));
  CHECK_FALSE(fs::exists(dir.file("b") + "/profile_traces"));
}
