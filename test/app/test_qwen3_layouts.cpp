// The Qwen3 debug models in the layouts, through the binary over gloo: FSDP 2, TP 2 (dense and
// MoE), EP 2 (MoE) and PP 2 (MoE: the dense debug model ties its embeddings, which cannot be
// cut into stages, and exits 2) each give the losses and gradient norms of one process on the
// same global batch, within a relative 1e-5 (fp32 sums in another order, the other layouts'
// tolerance); the CPU capture check finds the step static for both. Two of the eight layers
// (model.n_layers 2) at the flavors' widths, 32-token sequences, 3 steps.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

const std::string kCommon =
    "--config configs/qwen3_debug.toml --model.n_layers 2 --training.seq_len 32 "
    "--metrics.log_freq 1 --validation.enable false --metrics.enable_tensorboard false "
    "--training.device cpu --training.steps 3 --debug.seed 3 --comm.train_timeout_seconds 120 ";

test::CmdResult train(int nproc, const std::string& args, const std::string& dir) {
  return test::train_ranks(nproc, kCommon + args, dir);
}

using Step = test::StepFigures;

std::map<int64_t, Step> metrics(const test::TempDir& dir) {
  return test::step_figures(dir.file("metrics.jsonl"));
}

double worst_rel(const std::map<int64_t, Step>& ref, const std::map<int64_t, Step>& got) {
  return test::worst_rel_either(ref, got);
}

struct Layout {
  int nproc;
  std::string flags, says;  // says: the start-up line that proves the layout ran
};

// One process with `flags`, then each layout on the same flags and global batch.
void check_layouts(const std::string& flags, const std::vector<Layout>& layouts) {
  test::TempDir ref_dir("q3_ref");
  auto r = train(1, flags, ref_dir.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const auto ref = metrics(ref_dir);
  REQUIRE(ref.size() == 3);
  for (const Layout& l : layouts) {
    test::TempDir dir("q3_run");
    auto p = train(l.nproc, flags + " " + l.flags, dir.path.string());
    INFO(l.flags << "\n" << p.out);
    REQUIRE(p.rc == 0);
    CHECK_THAT(p.out, Contains(l.says));
    const double worst = worst_rel(ref, metrics(dir));
    WARN(flags << " on " << l.nproc << " ranks, " << l.flags
               << ": max relative loss / grad norm difference to 1 rank " << worst);
    CHECK(worst < 1e-5);
  }
}

// 4 sequences per step: one rank accumulates 2 micro-batches of 2, two data-parallel ranks
// take 2 each.
const std::string kBatch = "--training.local_batch_size 2 --training.global_batch_size 4 ";

}  // namespace

TEST_CASE("qwen3: the dense debug model on FSDP 2 and TP 2 trains as 1 rank does",
          "[qwen3][dist][app]") {
  check_layouts(kBatch, {{2, "", "dp_replicate 1 x dp_shard 2"},
                         {2, "--parallelism.tensor_parallel_degree 2 --training.local_batch_size 4",
                          "x tp 2"}});
}

TEST_CASE("qwen3: the MoE debug model on EP 2, TP 2 and PP 2 trains as 1 rank does",
          "[qwen3][moe][dist][app]") {
  check_layouts(
      kBatch + "--model.flavor debugmodel_moe",
      {{2, "--parallelism.expert_parallel_degree 2", "(ep 2"},
       {2, "--parallelism.tensor_parallel_degree 2 --training.local_batch_size 4", "x tp 2"},
       {2, "--parallelism.pipeline_parallel_degree 2 --training.local_batch_size 4",
        ": pipeline parallel "}});
}

TEST_CASE("qwen3: the CPU capture check passes for the dense and MoE debug models",
          "[qwen3][compile][app]") {
  for (const std::string flavor : {"debugmodel", "debugmodel_moe"}) {
    test::TempDir dir("q3_cc");
    auto r =
        train(1, "--training.local_batch_size 2 --compile.enable true --model.flavor " + flavor,
              dir.path.string());
    INFO(flavor << "\n" << r.out);
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("ops per step, static"));
  }
}

TEST_CASE("qwen3: the tied dense model cannot be pipelined and exits 2 naming the key",
          "[qwen3][dist][app]") {
  test::TempDir dir("q3_pp_tied");
  auto r = train(2, "--parallelism.pipeline_parallel_degree 2", dir.path.string());
  INFO(r.out);
  CHECK(r.rc != 0);
  CHECK_THAT(r.out, Contains("exitcode: 2") && Contains("titan-train: error: ") &&
                        Contains("tied to the embeddings"));  // each rank's one line
}
