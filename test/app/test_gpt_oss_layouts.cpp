// The GPT-OSS debug model in the layouts, through the binary over gloo: FSDP 2, EP 2, TP 2
// (attention heads with their biases and sinks split, the MoE layer's experts whole), TP 2 with
// expert tensor parallelism (w1/w3 and their biases split by hidden rows, w2's bias added on
// one tp rank) and PP 2 (one block per stage) each give
// the losses and gradient norms of one process on the same global batch, within a relative
// 1e-5 (fp32 sums in another order, the other layouts' tolerance). Two of the four layers
// (model.n_layers 2: one sliding-window layer, one full), 32-token sequences (the 128-key
// window then covers them, so the window is proven by test/models/test_gpt_oss.cpp, not here),
// 3 steps. The CPU capture check passes (the grouped experts path, the sink attention);
// context parallelism exits 2 naming the key.
#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

const std::string kCommon =
    "--config configs/gpt_oss_debug.toml --model.n_layers 2 --training.seq_len 32 "
    "--metrics.log_freq 1 --validation.enable false --metrics.enable_tensorboard false "
    "--training.device cpu --training.steps 3 --debug.seed 3 --comm.train_timeout_seconds 180 "
    "--training.local_batch_size 2 --training.global_batch_size 4 ";

test::CmdResult train(int nproc, const std::string& args, const std::string& dir) {
  return test::train_ranks(nproc, kCommon + args, dir);
}

}  // namespace

TEST_CASE("gpt_oss: the debug model on FSDP 2, EP 2, TP 2, ETP 2 and PP 2 trains as 1 rank does",
          "[gpt_oss][moe][dist][app]") {
  test::TempDir ref_dir("go_ref");
  auto r = train(1, "", ref_dir.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const auto ref = test::step_figures(ref_dir.file("metrics.jsonl"));
  REQUIRE(ref.size() == 3);
  struct Layout {
    std::string flags, says;  // says: the start-up line that proves the layout ran
  };
  const std::string big = " --training.local_batch_size 4";
  for (const Layout& l :
       {Layout{"", "dp_replicate 1 x dp_shard 2"},
        Layout{"--parallelism.expert_parallel_degree 2", "(ep 2"},
        Layout{"--parallelism.tensor_parallel_degree 2" + big, "x tp 2"},
        Layout{"--parallelism.tensor_parallel_degree 2 "
               "--parallelism.expert_tensor_parallel_degree 2" +
                   big,
               "routed experts split over tp ("},
        Layout{"--parallelism.pipeline_parallel_degree 2" + big, ": pipeline parallel "}}) {
    test::TempDir dir("go_run");
    auto p = train(2, l.flags, dir.path.string());
    INFO(l.flags << "\n" << p.out);
    REQUIRE(p.rc == 0);
    CHECK_THAT(p.out, Contains(l.says));
    const double worst = test::worst_rel_either(ref, test::step_figures(dir.file("metrics.jsonl")));
    WARN("gpt_oss on 2 ranks, " << l.flags
                                << ": max relative loss / grad norm difference to 1 rank "
                                << worst);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("gpt_oss: the CPU capture check finds the debug model's step static",
          "[gpt_oss][compile][app]") {
  test::TempDir dir("go_cc");
  auto r = train(1, "--compile.enable true", dir.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  CHECK_THAT(r.out, Contains("ops per step, static"));
}

TEST_CASE("gpt_oss: context parallelism exits 2 naming the key", "[gpt_oss][app]") {
  test::TempDir dir("go_cp");
  auto r = train(2, "--parallelism.context_parallel_degree 2", dir.path.string());
  INFO(r.out);
  CHECK(r.rc != 0);
  CHECK_THAT(r.out, Contains("exitcode: 2") &&
                        Contains("parallelism.context_parallel_degree = 2 with model.name = "
                                 "\"gpt_oss\""));
}

TEST_CASE("gpt_oss: titan-train estimate runs the debug model on the meta device",
          "[gpt_oss][app]") {
  // Its meta-device forward and backward need meta kernels for every op of the sink attention
  // and the clamped SwiGLU's backward.
  auto r = test::run("cd " + test::source_dir() + " && " + test::binary() +
                     " estimate --config configs/gpt_oss_debug.toml");
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK_THAT(r.out, Contains("FLOPs/token"));
}
