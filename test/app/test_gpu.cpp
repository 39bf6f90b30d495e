// Whole-program checks that need a CUDA device (tag [gpu], ctest label gpu): they run on the
// GPU check (scripts/gpu_check.sh), where none may skip, and report skipped elsewhere.
// - a non-logging train step makes no host synchronization (CUDA's sync-debug mode set to
//   error) for llama3 and deepseek_v3 on grouped_mm;
// - the three model families train on one GPU with finite, falling losses;
// - NCCL process groups of one rank run DDP, FSDP and the expert-parallel exchange, and
//   captured (compile.enable) FSDP and static exchange equal eager, with honest counts;
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
    Optimizer opt(model->params().tensors(), decay, cfg.optimizer);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const int64_t V = model->info().vocab_size;
    std::vector<MicroBatch> micro;
    for (int i = 0; i < 2; ++i)
      micro.push_back({at::randint(V, {2, 128}, gen, at::kLong).to(dev),
                       at::randint(V, {2, 128}, gen, at::kLong).to(dev)});
    StepObjective obj;
    obj.global_tokens = 2 * 2 * 128;
    obj.max_norm = 1.0;
    StepDrivers o;
    o.lr = 1e-3;
    PhaseTimer timer(/*cuda=*/true);
    o.timer = &timer;
    for (int i = 0; i < 2; ++i) (void)train_step(*model, opt, micro, obj, o);  // state, workspaces
    (void)timer.take();
    StepResult r;
    {
      SyncDebug guard(c10::cuda::SyncDebugMode::L_ERROR);
      o.lr = 5e-4;  // a new lr reaches the step without a host read of the device
      CHECK_NOTHROW(r = train_step(*model, opt, micro, obj, o));
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
      {"fsdp", "", "llama3_debug",
       "--debug.force_fsdp true --training.local_batch_size 4 --training.global_batch_size 8 "
       "--activation_checkpoint.mode full",
       "FSDP, dp_replicate 1 x dp_shard 1"},
      {"ep", "", "deepseek_v3_debug", "--debug.force_ep true --training.local_batch_size 4",
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

// "=> collectives per step on this rank: ..." of a run's log (empty if absent).
std::string collectives_line(const std::string& out) {
  const auto at = out.find("=> collectives per step on this rank:");
  if (at == std::string::npos) return "";
  return out.substr(at, out.find('\n', at) - at);
}

TEST_CASE("gpu: captured FSDP and static expert exchange over one-rank NCCL equal eager",
          "[gpu][compile][dist]") {
  // compile.enable captures the step with its NCCL collectives inside the graphs (a one-rank
  // NCCL group still launches real NCCL kernels): FSDP's gathers and reduce-scatters
  // (debug.force_fsdp), and DDP's bucket all-reduce with the static expert exchange's
  // all-to-alls (debug.force_ep). Against the same run eager, bf16 compute, 20 steps:
  // - losses per step within 2e-2 relative (as test_compile_cuda.cpp: the same kernels, but
  //   atomics in some backward kernels add in another order, and the difference compounds);
  // - 1 capture and 17 replays (3 eager warm-up steps; the capture step replays at once);
  // - the same "collectives per step" line: each replay counts what its capture recorded
  //   (parallel/comm_record.h), and the capture is not counted twice;
  // - comm_wait_ms unknown (null) on the rows with replays, measured on the eager ones.
  if (const char* why = missing_gpu()) TITAN_SKIP(why);
  test::TempDir dir("gpu-capture-comm");
  const int64_t steps = 20, warmup = 3;
  struct Case {
    const char* name;
    const char* env;
    const char* args;
    const char* log_must_have;
  };
  const Case cases[] = {
      {"fsdp", "",
       "--debug.force_fsdp true --config configs/llama3_debug.toml --training.local_batch_size 4 "
       "--training.global_batch_size 8",
       "FSDP, dp_replicate 1 x dp_shard 1"},
      {"ep", "",
       "--debug.force_ep true --config configs/deepseek_v3_debug.toml --training.local_batch_size 4 "
       "--moe.ep_exchange static",
       "the exchange runs over the world"},
      // FSDP's float8 all-gather (docs/float8.md): the e4m3 byte gathers in the forward graph,
      // the precomputed scales' fused amax and all-reduce in the optimizer graph, into the
      // buffer the next replay's gathers read.
      {"fsdp_float8", "",
       "--debug.force_fsdp true --config configs/llama3_debug.toml --training.local_batch_size 4 "
       "--training.global_batch_size 8 --model.converters float8 "
       "--quantize.linear.float8.enable_fsdp_float8_all_gather true "
       "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp true",
       "precomputed after each optimizer step"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      const std::string common = std::string(c.args) + " --training.steps " +
                                 std::to_string(steps) +
                                 " --metrics.log_freq 1 --validation.enable false "
                                 "--training.seq_len 256 --job.dump_folder ";
      const std::string de = dir.file(std::string(c.name) + "_eager"),
                        dc = dir.file(std::string(c.name) + "_captured");
      auto eager = torchrun_one(c.env, common + de);
      INFO(eager.out.substr(eager.out.size() > 3000 ? eager.out.size() - 3000 : 0));
      REQUIRE(eager.rc == 0);
      auto cap = torchrun_one(c.env, common + dc + " --compile.enable true");
      INFO(cap.out.substr(cap.out.size() > 4000 ? cap.out.size() - 4000 : 0));
      REQUIRE(cap.rc == 0);
      for (const auto* out : {&eager.out, &cap.out}) {
        CHECK_THAT(*out, Contains("nccl"));
        CHECK_THAT(*out, Contains("bf16 compute"));
        CHECK_THAT(*out, Contains(c.log_must_have));
      }
      CHECK_THAT(cap.out, Contains("captured the train step as 2 CUDA graphs"));
      CHECK_THAT(cap.out, Contains("each replay runs the collectives the capture recorded"));

      auto le = test::losses(de), lc = test::losses(dc);
      REQUIRE(le.size() == static_cast<size_t>(steps));
      REQUIRE(lc.size() == le.size());
      double worst = 0;
      for (auto& [step, loss] : le) {
        INFO("step " << step << ": eager " << loss << " captured " << lc[step]);
        CHECK(std::isfinite(lc[step]));
        CHECK(std::abs(lc[step] - loss) <= 2e-2 * std::abs(loss));
        worst = std::max(worst, std::abs(lc[step] - loss) / std::abs(loss));
      }
      WARN(c.name << ": largest relative loss difference captured vs eager: " << worst);

      auto mc = test::training_metrics(dc + "/metrics.jsonl");
      const auto& last = mc.rbegin()->second;
      CHECK(last["compile_captures"].get<int64_t>() == 1);
      CHECK(last["compile_replays"].get<int64_t>() == steps - warmup);
      for (auto& [step, j] : mc) {
        INFO("captured step " << step << ": " << j.dump());
        // Rows of steps 1-3 are eager warm-up; from step 4 (capture + replay) each row's
        // step was a replay with collectives, whose wait cannot be timed.
        CHECK(j["comm_wait_ms"].is_null() == (step > warmup));
      }
      for (auto& [step, j] : test::training_metrics(de + "/metrics.jsonl"))
        CHECK(j["comm_wait_ms"].is_number());

      const std::string ce = collectives_line(eager.out), cc = collectives_line(cap.out);
      INFO("eager:    " << ce << "\ncaptured: " << cc);
      CHECK_FALSE(ce.empty());
      CHECK_THAT(ce, Contains(std::string(c.name).rfind("fsdp", 0) == 0 ? "reduce-scatter"
                                                                        : "all-to-all"));
      CHECK(cc == ce);
    }
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
