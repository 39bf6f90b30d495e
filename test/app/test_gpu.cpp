// Whole-program checks that need a CUDA device (tag [gpu], ctest label gpu): they run on the
// GPU check (scripts/gpu_check.sh), where none may skip, and report skipped elsewhere.
// - a non-logging train step makes no host synchronization (CUDA's sync-debug mode set to
//   error) for llama3 and deepseek_v3 on grouped_mm;
// - the three model families train on one GPU with finite, falling losses;
// - NCCL process groups of one rank run DDP, FSDP and the expert-parallel exchange;
// - a CUDA out-of-memory error exits 3 with its message, a GPU-less LOCAL_RANK exits 2.
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "app/train_step.h"
#include "core/config/config.h"
#include "core/telemetry/cuda_info.h"
#include "models/registry.h"
#include "test_util.h"

#if __has_include(<c10/cuda/CUDAFunctions.h>)
#include <c10/cuda/CUDAFunctions.h>
#define TITAN_TEST_CUDA_HEADERS 1
#endif

using namespace titan;
using Catch::Matchers::Contains;

namespace {

const char* missing_gpu(bool sm90 = false) {
#ifndef TITAN_TEST_CUDA_HEADERS
  return "built without CUDA headers";
#else
  if (!at::hasCUDA()) return "no CUDA device (runs on the GPU check)";
  if (sm90 && cuda_device_info(0).major < 9) return "CUDA device below compute capability 9.0";
  return nullptr;
#endif
}

// The binary on this machine's first GPU (never a launcher's rank variables).
test::CmdResult run_gpu(const std::string& args) {
  return test::run("cd " + test::source_dir() +
                   " && env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u SLURM_PROCID "
                   "-u OMPI_COMM_WORLD_RANK " +
                   test::binary() + " --training.device cuda --metrics.enable_tensorboard false " +
                   args);
}

test::CmdResult torchrun_one(const std::string& env, const std::string& args) {
  return test::run("cd " + test::source_dir() + " && env " + env + " " + test::torchrun() +
                   " --standalone --nproc_per_node 1 --no-python " + test::binary() +
                   " --training.device cuda --metrics.enable_tensorboard false " + args);
}

// Losses of the run in `dump`: at least `n` logged, all finite, the last below `ratio` x
// the first.
void check_learning(const std::string& dump, size_t n, double ratio) {
  auto l = test::losses(dump);
  REQUIRE(l.size() >= n);
  for (auto& [step, v] : l) {
    INFO("step " << step);
    CHECK(std::isfinite(v));
  }
  const double first = l.begin()->second, last = l.rbegin()->second;
  WARN(dump << ": loss " << first << " -> " << last);
  CHECK(last < ratio * first);
}

#ifdef TITAN_TEST_CUDA_HEADERS
// CUDA's sync-debug mode for a scope: at L_ERROR every synchronizing call (a device-to-host
// copy, .item(), a stream or device synchronize, nonzero) throws.
struct SyncDebug {
  c10::cuda::SyncDebugMode saved;
  explicit SyncDebug(c10::cuda::SyncDebugMode m)
      : saved(c10::cuda::warning_state().get_sync_debug_mode()) {
    c10::cuda::warning_state().set_sync_debug_mode(m);
  }
  ~SyncDebug() { c10::cuda::warning_state().set_sync_debug_mode(saved); }
};
#endif

}  // namespace

TEST_CASE("gpu: a non-logging bf16 train step of llama3 and deepseek_v3 on grouped_mm makes no host sync",
          "[gpu][step]") {
  if (const char* why = missing_gpu(/*sm90=*/true)) TITAN_SKIP(why);
#ifdef TITAN_TEST_CUDA_HEADERS
  const at::Device dev(at::kCUDA, 0);
  for (std::string name : {"llama3", "deepseek_v3"}) {
    INFO(name);
    JobConfig cfg = default_config();
    cfg.model.name = name;
    cfg.model.flavor = "debugmodel";
    cfg.moe.experts_backend = "grouped_mm";
    auto model = build_model(cfg, dev);
    model->set_compute_dtype(at::kBFloat16);
    std::vector<bool> decay;
    for (auto& p : model->params().all()) decay.push_back(p.weight_decay);
    AdamW opt(model->params().tensors(), decay, cfg.optimizer);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const int64_t V = model->info().vocab_size;
    std::vector<MicroBatch> micro;
    for (int i = 0; i < 2; ++i)
      micro.push_back({at::randint(V, {2, 128}, gen, at::kLong).to(dev),
                       at::randint(V, {2, 128}, gen, at::kLong).to(dev)});
    StepOptions o;
    o.global_tokens = 2 * 2 * 128;
    o.lr = 1e-3;
    o.max_norm = 1.0;
    PhaseTimer timer(/*cuda=*/true);
    o.timer = &timer;
    for (int i = 0; i < 2; ++i) (void)train_step(*model, opt, micro, o);  // state, workspaces
    (void)timer.take();
    StepResult r;
    {
      SyncDebug guard(c10::cuda::SyncDebugMode::L_ERROR);
      o.lr = 5e-4;  // a new lr reaches the step without a host read of the device
      CHECK_NOTHROW(r = train_step(*model, opt, micro, o));
      // The detector can fail: the log step's read is a sync.
      CHECK_THROWS(r.loss.item<double>());
    }
    CHECK(std::isfinite(r.loss.item<double>()));
    CHECK(std::isfinite(r.grad_norm.item<double>()));
    const PhaseTimer::Totals t = timer.take();  // the events of the three steps
    CHECK(t.steps == 1);
    CHECK(t.fwdbwd_ms > 0);
    CHECK(t.opt_ms > 0);
  }
#endif
}

TEST_CASE("gpu: llama3 and llama4 and deepseek_v3 train on one GPU with finite falling losses",
          "[gpu][train]") {
  if (const char* why = missing_gpu()) TITAN_SKIP(why);
  test::TempDir dir("gpu-train");
  for (std::string cfg : {"llama3_debug", "llama4_debug", "deepseek_v3_debug"}) {
    INFO(cfg);
    const std::string dump = dir.file(cfg);
    auto r = run_gpu("--config configs/" + cfg +
                     ".toml --training.steps 30 --metrics.log_freq 5 --validation.enable false "
                     "--training.local_batch_size 8 --training.seq_len 512 --job.dump_folder " +
                     dump);
    INFO(r.out.substr(r.out.size() > 4000 ? r.out.size() - 4000 : 0));
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("device = CUDA:0") && Contains("bf16 compute"));
    check_learning(dump, 6, 0.9);
    auto m = test::training_metrics(dump + "/metrics.jsonl");
    const auto& last = m.rbegin()->second;
    CHECK(last["memory_kind"] == "cuda");
    CHECK(last["memory_peak_gib"].get<double>() > 0);
    CHECK(last["time_fwdbwd_ms"].get<double>() > 0);  // CUDA events, every step
    if (cuda_device_info(0).name.find("H1") != std::string::npos ||
        cuda_device_info(0).name.find("H2") != std::string::npos)
      CHECK(last["mfu"].get<double>() > 0);
  }
}

TEST_CASE("gpu: NCCL process groups of one rank run DDP and FSDP and the expert exchange",
          "[gpu][dist]") {
  if (const char* why = missing_gpu()) TITAN_SKIP(why);
  test::TempDir dir("gpu-nccl");
  const std::string common =
      "--training.steps 20 --metrics.log_freq 5 --validation.enable false "
      "--training.seq_len 256 --job.dump_folder ";
  struct Case {
    const char* name;
    const char* env;
    const char* config;
    const char* extra;
    const char* log_must_have;
  };
  const Case cases[] = {
      {"ddp", "OMP_NUM_THREADS=4", "llama3_debug", "--training.local_batch_size 8",
       "DDP (replicated)"},
      {"fsdp", "TITAN_FORCE_FSDP=1", "llama3_debug",
       "--training.local_batch_size 4 --training.global_batch_size 8 "
       "--activation_checkpoint.mode full",
       "FSDP, dp_replicate 1 x dp_shard 1"},
      {"ep", "TITAN_FORCE_EP=1", "deepseek_v3_debug", "--training.local_batch_size 4",
       "the exchange runs over the world"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const std::string dump = dir.file(c.name);
    auto r = torchrun_one(c.env, std::string("--config configs/") + c.config + ".toml " +
                                     c.extra + " " + common + dump);
    INFO(r.out.substr(r.out.size() > 4000 ? r.out.size() - 4000 : 0));
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("nccl") || Contains("NCCL"));
    CHECK_THAT(r.out, Contains(c.log_must_have));
    CHECK_THAT(r.out, Contains("comm_wait_ms"));
    check_learning(dump, 4, 0.95);
  }
}

TEST_CASE("gpu: CUDA out of memory exits 3 naming the memory and a GPU-less LOCAL_RANK exits 2",
          "[gpu][cli]") {
  if (const char* why = missing_gpu()) TITAN_SKIP(why);
  test::TempDir dir("gpu-oom");
  // Hundreds of GB of activations for one micro-batch of 4096 x 2048 tokens: an allocation
  // of the forward fails.
  auto r = run_gpu(
      "--config configs/llama3_debug.toml --training.steps 1 --validation.enable false "
      "--training.local_batch_size 4096 --training.seq_len 2048 --job.dump_folder " +
      dir.file("oom"));
  INFO(r.out.substr(r.out.size() > 3000 ? r.out.size() - 3000 : 0));
  CHECK(r.rc == 3);
  CHECK_THAT(r.out, Contains("out of memory") && Contains("GiB free of") &&
                        Contains("training.local_batch_size (now 4096)"));
  // One GPU per rank: a LOCAL_RANK past the visible GPUs is a launch error, not GPU 0.
  const int64_t gpus = cuda_device_count();
  auto bad = test::run("cd " + test::source_dir() + " && env RANK=0 WORLD_SIZE=1 LOCAL_RANK=" +
                       std::to_string(gpus) + " " + test::binary() +
                       " --config configs/llama3_debug.toml --training.steps 1 "
                       "--job.dump_folder " + dir.file("rank"));
  INFO(bad.out);
  CHECK(bad.rc == 2);
  CHECK_THAT(bad.out, Contains("LOCAL_RANK " + std::to_string(gpus)) &&
                          Contains("--training.device cpu"));
}
