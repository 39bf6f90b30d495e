// MetricsLogger's metrics.jsonl rows for the compile counts and an unknown comm_wait_ms
// (docs/compile.md, "Honest metrics under capture").
#include <catch2/catch.hpp>

#include "core/telemetry/metrics.h"
#include "test_util.h"

using namespace titan;

TEST_CASE("metrics: compile counts are written when set, and an unknown comm wait is null",
          "[metrics]") {
  test::TempDir dir("metrics");
  {
    MetricsLogger log(dir.path.string(), /*writer=*/true, /*tensorboard=*/false, "tb",
                      /*color=*/false, /*rank=*/0);
    StepMetrics eager;
    eager.step = 1;
    eager.loss = 8.0;
    eager.comm_wait_ms = 1.5;
    log.log_step(eager);
    StepMetrics replayed = eager;  // CUDA: a window with replayed collectives
    replayed.step = 2;
    replayed.comm_wait_ms = -1;
    replayed.compile_captures = 1;
    replayed.compile_replays = 27;
    log.log_step(replayed);
    StepMetrics checked = eager;  // CPU: the capture check
    checked.step = 3;
    checked.comm_wait_ms = 0;
    checked.compile_captures = 0;
    checked.compile_replays = 0;
    checked.compile_checked_steps = 1;
    log.log_step(checked);
  }
  auto m = test::training_metrics(dir.file("metrics.jsonl"));
  REQUIRE(m.size() == 3);
  CHECK(m[1]["comm_wait_ms"].get<double>() == 1.5);
  CHECK_FALSE(m[1].contains("compile_captures"));
  CHECK_FALSE(m[1].contains("compile_replays"));
  CHECK_FALSE(m[1].contains("compile_checked_steps"));
  CHECK(m[2]["comm_wait_ms"].is_null());
  CHECK(m[2]["compile_captures"].get<int64_t>() == 1);
  CHECK(m[2]["compile_replays"].get<int64_t>() == 27);
  CHECK_FALSE(m[2].contains("compile_checked_steps"));
  CHECK(m[3]["comm_wait_ms"].get<double>() == 0);
  CHECK(m[3]["compile_replays"].get<int64_t>() == 0);
  CHECK(m[3]["compile_checked_steps"].get<int64_t>() == 1);
}
