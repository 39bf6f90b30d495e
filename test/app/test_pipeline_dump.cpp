// `titan-train --dump-schedule` through the binary: one process plans the pipeline a
// config asks for (stage table, actions, grid, bubble) and exits 0 without training; bad
// pipeline input exits 2 with one line naming the key; training under PP on one process is
// refused.
// References: the stage split of torchtitan 0.2.2 (test/reference/pp_stage_split_table.py)
// and the bubble (p-1)/(m+p-1) of 1F1B (docs/distributed.md).
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>

#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

test::CmdResult dump(const std::string& args) {
  return test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                   test::binary() + " --config " + test::source_dir() +
                   "/configs/llama3_debug.toml --parallelism.pipeline_parallel_degree 2 " + args);
}

int lines(const std::string& s) {
  return static_cast<int>(std::count(s.begin(), s.end(), '\n'));
}

}  // namespace

TEST_CASE("dump-schedule: llama3 debugmodel over PP 2 with 1F1B", "[pp][cli]") {
  test::TempDir dir("pp-dump");
  auto r = dump("--dump-schedule --job.dump_folder " + dir.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  // 6 layers + embeddings + head = 8 weighted over 2 stages (torchtitan's rule).
  CHECK_THAT(r.out, Contains("=> 2 stages, 1 per rank") && Contains("=> 8 micro-batches") &&
                        Contains("0      0     tok_embeddings, layers.0-2\n") &&
                        Contains("1      1     layers.3-5, norm, output\n"));
  CHECK_THAT(r.out, Contains("rank 0: 0F0 0SEND_F0 0F1 0SEND_F1") && Contains("1RECV_F0 1F0"));
  CHECK_THAT(r.out, Contains("rank 0 |0F0 0F1 ") && Contains("rank 1 |.   1F0 "));
  // (p-1)/(m+p-1) = 1/9.
  CHECK_THAT(r.out, Contains("no deadlock); bubble fraction 0.1111\n"));
  CHECK(fs::is_empty(dir.path));  // nothing trained or written
}

TEST_CASE("dump-schedule: Interleaved1F1B and ZBVZeroBubble place 2 stages per rank", "[pp][cli]") {
  auto il = dump("--dump-schedule --parallelism.pipeline_parallel_schedule Interleaved1F1B");
  INFO(il.out);
  REQUIRE(il.rc == 0);
  // 8 weighted layers over 4 stages, loop placement: stage s on rank s % 2.
  CHECK_THAT(il.out, Contains("=> 4 stages, 2 per rank (stage s on rank s % p)") &&
                         Contains("0      0     tok_embeddings, layers.0\n") &&
                         Contains("1      1     layers.1-2\n") &&
                         Contains("2      0     layers.3-4\n") &&
                         Contains("3      1     layers.5, norm, output\n"));
  CHECK_THAT(il.out, Contains("Interleaved1F1B: 2 ranks, 4 stages, 8 micro-batches"));

  auto zbv = dump("--dump-schedule --parallelism.pipeline_parallel_schedule zbvzerobubble");
  INFO(zbv.out);
  REQUIRE(zbv.rc == 0);
  // The V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
  CHECK_THAT(zbv.out, Contains("V: rank r holds stages r and 2p-1-r") &&
                          Contains("0      0     tok_embeddings, layers.0\n") &&
                          Contains("2      1     layers.3-4\n") &&
                          Contains("3      0     layers.5, norm, output\n"));
  CHECK_THAT(zbv.out, Contains("0I0") && Contains("0W0") && Contains("no deadlock"));
  // Stages 1 and 2 share rank 1: the turn of the V passes locally, with no transfer.
  CHECK_THAT(zbv.out, !Contains("1SEND_F") && !Contains("2SEND_B"));
}

TEST_CASE("dump-schedule: explicit module_fqns_per_model_part and a schedule CSV", "[pp][cli]") {
  test::TempDir dir("pp-csv");
  // TOML's array of arrays, as torchtitan writes it.
  test::write_file(dir.file("split.toml"),
                   "[parallelism]\nmodule_fqns_per_model_part = [[\"tok_embeddings\", "
                   "\"layers.0\"], [\"layers.1\", \"layers.2\", \"layers.3\", \"layers.4\", "
                   "\"layers.5\", \"norm\", \"output\"]]\n");
  auto toml = test::run("env -u RANK -u WORLD_SIZE " + test::binary() + " --config " +
                        dir.file("split.toml") +
                        " --parallelism.pipeline_parallel_degree 2 --dump-schedule");
  INFO(toml.out);
  CHECK(toml.rc == 0);
  CHECK_THAT(toml.out, Contains("0      0     tok_embeddings, layers.0\n") &&
                           Contains("1      1     layers.1-5, norm, output\n"));
  // --dump-config writes it back in torchtitan's form (at degree 2: at 1 the key has no
  // effect and exits 2).
  auto back =
      test::run("env -u RANK -u WORLD_SIZE " + test::binary() + " --config " +
                dir.file("split.toml") + " --parallelism.pipeline_parallel_degree 2 --dump-config");
  CHECK_THAT(back.out, Contains("module_fqns_per_model_part = [['tok_embeddings', "
                                "'layers.0'], ['layers.1', 'layers.2'"));
  // The command line's form: stages separated by commas, modules by spaces.
  auto cli = dump(
      "--dump-schedule --parallelism.module_fqns_per_model_part "
      "'tok_embeddings layers.0 layers.1,layers.2 layers.3 layers.4 layers.5 norm "
      "output'");
  INFO(cli.out);
  CHECK(cli.rc == 0);
  CHECK_THAT(cli.out, Contains("1      1     layers.2-5, norm, output\n"));

  // A GPipe order for 2 micro-batches, read back from CSV; and one that deadlocks.
  test::write_file(dir.file("gpipe.csv"), "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n");
  auto csv = dump(
      "--dump-schedule --training.local_batch_size 2 "
      "--parallelism.pipeline_parallel_schedule_csv " +
      dir.file("gpipe.csv"));
  INFO(csv.out);
  CHECK(csv.rc == 0);
  CHECK_THAT(csv.out, Contains("no deadlock); bubble fraction 0.3333\n"));
  test::write_file(dir.file("dead.csv"), "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n");
  auto dead = dump(
      "--dump-schedule --training.local_batch_size 2 "
      "--parallelism.pipeline_parallel_schedule_csv " +
      dir.file("dead.csv"));
  INFO(dead.out);
  CHECK(dead.rc == 2);
  CHECK_THAT(dead.out, Contains("deadlocks"));
}

TEST_CASE("dump-schedule: bad pipeline input exits 2 naming the key", "[pp][cli]") {
  struct Case {
    std::string args, key;
  };
  const std::vector<Case> cases = {
      // 6 layers + 2 over 3 ranks at 1 layer per stage: 8 stages, which 3 does not divide.
      {"--parallelism.pipeline_parallel_degree 3 --parallelism.pipeline_parallel_schedule "
       "Interleaved1F1B --parallelism.pipeline_parallel_layers_per_stage 1",
       "parallelism.pipeline_parallel_degree = 3"},
      {"--parallelism.pipeline_parallel_degree 9", "parallelism.pipeline_parallel_degree"},
      {"--training.local_batch_size 1", "parallelism.pipeline_parallel_microbatch_size"},
      {"--parallelism.pipeline_parallel_microbatch_size 3",
       "parallelism.pipeline_parallel_microbatch_size = 3"},
      {"--parallelism.pipeline_parallel_schedule ZBVZeroBubble "
       "--parallelism.pipeline_parallel_layers_per_stage 1",
       "ZBVZeroBubble needs exactly 2 stages per rank"},
      {"--parallelism.pipeline_parallel_schedule 2F2B",
       "allowed (any case): GPipe, 1F1B, LoopedBFS, Interleaved1F1B"},
      {"--model.flavor 1B", "tied to the embeddings"},
      {"--parallelism.module_fqns_per_model_part 'layers.0,tok_embeddings'",
       "parallelism.module_fqns_per_model_part"},
      {"--parallelism.pipeline_parallel_schedule_csv /nonexistent.csv",
       "parallelism.pipeline_parallel_schedule_csv = /nonexistent.csv"},
  };
  for (const Case& c : cases) {
    auto r = dump(c.args + " --dump-schedule");
    INFO(c.args << "\n" << r.out);
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains(c.key));
    CHECK(lines(r.out) == 1);
  }
}

TEST_CASE("dump-schedule: PP training on too few ranks is refused, naming --dump-schedule",
          "[pp][cli]") {
  test::TempDir dir("pp-train");
  auto r = dump("--training.steps 1 --job.dump_folder " + dir.path.string());
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("parallelism.pipeline_parallel_degree = 2 needs 2 ranks but the "
                             "world has 1") &&
                        Contains("torchrun --nproc_per_node 2") && Contains("--dump-schedule"));
  CHECK(lines(r.out) == 1);
}

TEST_CASE("dump-schedule: PP 1 exits 2 saying there is no pipeline", "[pp][cli]") {
  // Exit 2, not a one-stage drawing of a schedule training never runs (issue 45): the
  // config has no pipeline, which is what a script asking for its schedule must learn.
  auto one = test::run("env -u RANK -u WORLD_SIZE " + test::binary() + " --config " +
                       test::source_dir() + "/configs/llama3_debug.toml --dump-schedule");
  INFO(one.out);
  CHECK(one.rc == 2);
  CHECK_THAT(one.out, Contains("--dump-schedule with parallelism.pipeline_parallel_degree = 1: "
                               "there is no pipeline"));
  CHECK(lines(one.out) == 1);
}

TEST_CASE("dump-schedule: MoE configs print the report only, no start-up log line",
          "[pp][cli][moe]") {
  // The meta-device model build used to log "=> MoE experts backend = ..." into the report.
  for (const char* model : {"llama4", "deepseek_v3"}) {
    INFO(model);
    auto r = test::run("env -u RANK -u WORLD_SIZE " + test::binary() + " --config " +
                       test::source_dir() + "/configs/" + model +
                       "_debug.toml --parallelism.pipeline_parallel_degree 2 --dump-schedule");
    INFO(r.out);
    CHECK(r.rc == 0);
    CHECK_THAT(r.out, Contains("schedule check: passed"));
    CHECK_THAT(r.out, !Contains("experts backend") && !Contains("[titan "));
    CHECK(r.out.rfind("pipeline: ", 0) == 0);  // the report's first line comes first
  }
}
