// Multi-process training through the binary: DDP, FSDP and HSDP against 1 rank on the same
// global batch (losses, gradient norms, memory per rank), expert parallelism, a dead or hung
// peer, a config that differs between ranks, bad degrees, and FSDP checkpoints resharded
// onto other world sizes.
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <fstream>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/checkpointer.h"
#include "core/checkpoint/safetensors.h"
#include "models/deepseek_v3.h"
#include "models/hf_interop.h"
#include "models/llama3.h"
#include "test_port.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kSmall =
    "--config configs/llama3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false --training.device cpu ";

using test::torchrun;

// A port no process holds (test_port.h): ports computed from the process id collided when
// ctest ran two such tests at once. `offset` is kept for the callers' readability.
int free_port(int /*offset*/) {
  return test::free_tcp_port();
}

struct Step {
  double loss = 0, loss_max = 0, grad_norm = 0;
};

std::map<int64_t, Step> read_metrics(const std::string& file) {
  std::map<int64_t, Step> out;
  for (auto& [step, j] : test::training_metrics(file))
    out[step] = {j["loss"].get<double>(), j["loss_max"].get<double>(),
                 j["grad_norm"].get<double>()};
  return out;
}

using test::worst_rel;

using test::wait_for;

// One rank started by hand with the environment torchrun would give it.
struct Rank {
  int pid = -1;
  std::string log, rc_file;
  bool done() const { return fs::exists(rc_file) && fs::file_size(rc_file) > 0; }
  int rc() const { return std::stoi(test::read_file(rc_file)); }
};

Rank spawn_rank(int rank, int world, int port, const std::string& args, const std::string& dir) {
  Rank r;
  r.log = dir + "/rank" + std::to_string(rank) + ".log";
  r.rc_file = r.log + ".rc";
  const std::string env =
      "RANK=" + std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank) +
      " WORLD_SIZE=" + std::to_string(world) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
      " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " OMP_NUM_THREADS=1";
  auto out = test::run("cd " + test::source_dir() + " && ( env " + env + " " + test::binary() +
                       " " + kSmall + args + " > " + r.log + " 2>&1; echo $? > " + r.rc_file +
                       " ) > /dev/null 2>&1 & echo $!");
  const std::string shell = std::to_string(std::stoi(out.out));
  wait_for([&] { return !test::run("pgrep -P " + shell).out.empty(); }, 30);
  r.pid = std::stoi(test::run("pgrep -P " + shell).out);
  return r;
}

// The ratio printed by "=> memory: parameters + AdamW state on this rank ... (ratio R)".
double memory_ratio(const std::string& log) {
  const std::string key = "for the whole model (ratio ";
  const auto at = log.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(log.substr(at + key.size()));
}

test::CmdResult torchrun_train(int nproc, const std::string& args) {
  return test::run("cd " + test::source_dir() + " && " + torchrun() +
                   " --standalone --nproc_per_node " + std::to_string(nproc) + " --no-python " +
                   test::binary() + " " + args);
}

test::CmdResult single_train(const std::string& args) {
  return test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() +
                   " " + args);
}

}  // namespace

TEST_CASE("layouts 1 rank and DDP 2 and FSDP 2 and HSDP 2x2 agree over 20 steps",
          "[dist][app][slow]") {
  // The same global batch of 4 sequences on every layout: rank r of dp takes windows r,
  // r + dp, ... of each group of four in the epoch's order (the order does not depend on dp),
  // and the loss is normalized by the global token count, so the summed gradients and the
  // logged mean loss are the same quantities. FSDP gathers the same full weights and
  // reduce-scatters the same sums; HSDP adds an all-reduce over the 2 replicas.
  struct Layout {
    const char* name;
    int nproc;
    std::string flags;
    double memory;  // expected parameter + optimizer memory per rank, as a fraction
    const char* describes;
  };
  const std::vector<Layout> layouts = {
      {"ddp2", 2,
       "--training.local_batch_size 2 --parallelism.data_parallel_replicate_degree 2 "
       "--parallelism.data_parallel_shard_degree 1",
       1.0, "DDP (replicated)"},
      {"fsdp2", 2, "--training.local_batch_size 2", 0.5, "FSDP, dp_replicate 1 x dp_shard 2"},
      {"hsdp22", 4, "--training.local_batch_size 1 --parallelism.data_parallel_replicate_degree 2",
       0.5, "HSDP, dp_replicate 2 x dp_shard 2"},
  };
  const std::string common = kSmall + "--training.steps 20 --debug.seed 3 ";
  test::TempDir one("layout1");
  auto r1 =
      single_train(common + "--training.local_batch_size 4 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  CHECK(memory_ratio(r1.out) == Approx(1.0));
  auto ref = read_metrics(one.file("metrics.jsonl"));
  REQUIRE(ref.size() == 20);
  for (const Layout& l : layouts) {
    DYNAMIC_SECTION(l.name) {
      test::TempDir dir(l.name);
      auto r =
          torchrun_train(l.nproc, common + l.flags + " --job.dump_folder " + dir.path.string());
      INFO(r.out);
      REQUIRE(r.rc == 0);
      CHECK_THAT(r.out, Contains(l.describes));
      CHECK_THAT(r.out, Contains("process group: gloo, " + std::to_string(l.nproc) +
                                 " ranks, launched by torchrun"));
      CHECK_FALSE(fs::exists(dir.file("metrics_rank1.jsonl")));  // only rank 0 writes metrics
      // Measured from the tensors' storage on rank 0: parameters, exp_avg and exp_avg_sq.
      const double mem = memory_ratio(r.out);
      CHECK(mem >= l.memory * 0.999);
      CHECK(mem <= l.memory * 1.02);  // padding rows of dims that do not divide evenly
      auto m = read_metrics(dir.file("metrics.jsonl"));
      REQUIRE(m.size() == 20);
      const auto [worst_loss, worst_norm] = worst_rel(ref, m);
      for (auto& [step, t] : m)
        CHECK(t.loss_max >= t.loss - 1e-6);  // the worst rank's mean bounds the global mean
      WARN(l.name << " vs 1 rank, max relative difference over 20 steps: loss " << worst_loss
                  << ", grad norm " << worst_norm << "; memory per rank " << mem);
      CHECK(worst_loss < 1e-5);
      CHECK(worst_norm < 1e-5);
    }
  }
}

TEST_CASE("overlapped FSDP, HSDP and DDP with checkpointing and accumulation match 1 rank",
          "[dist][app][slow]") {
  // The overlap paths: FSDP prefetches the next unit in forward and the previous one in
  // backward, reduce-scatters are waited for only before the norm (at most 2 in flight), HSDP
  // all-reduces each unit over the replicas as its reduce-scatter ends, and DDP all-reduces
  // each bucket from the post-accumulate-grad hooks. Global batch 8 in 2 micro-batches (4 on
  // 4 ranks) with every block recomputed; the reference is 1 rank with the same flags.
  // Tolerance: 1e-5 relative, as for the plain layouts (the sums are the same, only the
  // order of fp32 additions differs).
  struct Layout {
    const char* name;
    int nproc;
    std::string flags;
    const char* describes;
  };
  const std::vector<Layout> layouts = {
      {"fsdp2", 2, "--training.local_batch_size 2", "reduce-scatters waited for before the norm"},
      {"fsdp4", 4, "--training.local_batch_size 1", "prefetch"},
      {"hsdp22", 4, "--training.local_batch_size 1 --parallelism.data_parallel_replicate_degree 2",
       "async all-reduce per unit over 2 replicas"},
      {"ddp2", 2,
       "--training.local_batch_size 2 --parallelism.data_parallel_replicate_degree 2 "
       "--parallelism.data_parallel_shard_degree 1",
       "all-reduced during backward"},
  };
  const std::string common = kSmall +
                             "--training.steps 8 --debug.seed 5 --training.global_batch_size 8 "
                             "--activation_checkpoint.mode full ";
  test::TempDir one("overlap1");
  auto r1 =
      single_train(common + "--training.local_batch_size 4 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto ref = read_metrics(one.file("metrics.jsonl"));
  REQUIRE(ref.size() == 8);
  for (const Layout& l : layouts) {
    DYNAMIC_SECTION(l.name) {
      test::TempDir dir(l.name);
      auto r =
          torchrun_train(l.nproc, common + l.flags + " --job.dump_folder " + dir.path.string());
      INFO(r.out);
      REQUIRE(r.rc == 0);
      CHECK_THAT(r.out, Contains(l.describes));
      CHECK_THAT(r.out, Contains("comm_wait_ms: "));
      auto m = read_metrics(dir.file("metrics.jsonl"));
      REQUIRE(m.size() == 8);
      const auto [worst_loss, worst_norm] = worst_rel(ref, m);
      double wait = 0;
      for (auto& [step, j] : test::training_metrics(dir.file("metrics.jsonl"))) {
        REQUIRE(j.contains("comm_wait_ms"));
        CHECK(j["comm_wait_ms"].get<double>() >= 0);
        wait += j["comm_wait_ms"].get<double>();
      }
      WARN(l.name << " (AC full, 2 micro-batches) vs 1 rank over 8 steps: loss " << worst_loss
                  << ", grad norm " << worst_norm << "; mean comm_wait_ms " << wait / 8);
      CHECK(worst_loss < 1e-5);
      CHECK(worst_norm < 1e-5);
    }
  }
}

TEST_CASE("expert parallelism ep 1 and 2 and 4 at dp_shard 4 give the same losses",
          "[dist][app][slow][moe]") {
  // deepseek_v3 debugmodel (8 experts) on 4 ranks. ep = 2: each rank holds 4 experts,
  // FSDP-sharded over 2 ranks; ep = 4: 2 experts each, unsharded. Tokens travel to their
  // experts' ranks by all-to-all and come back in order, so every token meets the same
  // weights; only the per-expert GEMMs see different row counts.
  const std::string common =
      "--config configs/deepseek_v3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --training.steps 4 "
      "--debug.seed 3 --training.local_batch_size 1 ";
  std::map<int, std::map<int64_t, Step>> runs;
  for (int ep : {1, 2, 4}) {
    test::TempDir dir("ep" + std::to_string(ep));
    auto r = torchrun_train(4, common + "--parallelism.expert_parallel_degree " +
                                   std::to_string(ep) + " --job.dump_folder " + dir.path.string());
    INFO(r.out);
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out,
               Contains("(ep " + std::to_string(ep) + " x efsdp " + std::to_string(4 / ep) + ")"));
    runs[ep] = read_metrics(dir.file("metrics.jsonl"));
    REQUIRE(runs[ep].size() == 4);
  }
  double worst = 0, worst_norm = 0;
  for (int ep : {2, 4})
    for (auto& [step, s] : runs[1]) {
      const Step& t = runs[ep].at(step);
      worst = std::max(worst, std::abs(s.loss - t.loss) / s.loss);
      worst_norm = std::max(worst_norm, std::abs(s.grad_norm - t.grad_norm) / s.grad_norm);
    }
  WARN("ep 2 and 4 vs ep 1 over 4 steps: max relative loss difference " << worst << ", grad norm "
                                                                        << worst_norm);
  CHECK(worst < 1e-6);
  CHECK(worst_norm < 1e-6);
}

TEST_CASE("with the sequence-wise aux loss, 1 rank, DDP 2, FSDP 2 and EP 2 agree",
          "[dist][app][slow][moe]") {
  // The aux loss is a mean over the global batch's sequences whatever the layout: each rank
  // divides its share by (micro-batches x dp) and the gradient sums add the shares. Before
  // the fix the dp ranks' sum made the coefficient dp times larger, and the grad norms
  // differed from 1 rank's at the first step. Reference: the 1-rank run; tolerance 1e-5.
  const std::string common =
      "--config configs/deepseek_v3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --training.steps 6 "
      "--debug.seed 3 --activation_checkpoint.mode none --moe.seq_aux_loss_coeff 0.05 ";
  test::TempDir one("aux1");
  auto r1 =
      single_train(common + "--training.local_batch_size 4 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto ref = read_metrics(one.file("metrics.jsonl"));
  REQUIRE(ref.size() == 6);
  // The loss is active: without it the gradient norm of step 1 differs.
  test::TempDir off("aux0");
  auto r0 = single_train(common +
                         "--training.local_batch_size 4 --moe.seq_aux_loss_coeff 0 "
                         "--job.dump_folder " +
                         off.path.string());
  REQUIRE(r0.rc == 0);
  auto no_aux = read_metrics(off.file("metrics.jsonl"));
  CHECK(std::abs(no_aux.at(1).grad_norm - ref.at(1).grad_norm) > 1e-4 * ref.at(1).grad_norm);
  const std::vector<std::pair<const char*, std::string>> layouts = {
      {"ddp2",
       "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1"},
      {"fsdp2", ""},
      {"ep2", "--parallelism.expert_parallel_degree 2"},
  };
  for (auto& [name, flags] : layouts) {
    DYNAMIC_SECTION(name) {
      test::TempDir dir(name);
      auto r = torchrun_train(2, common + "--training.local_batch_size 2 " + flags +
                                     " --job.dump_folder " + dir.path.string());
      INFO(r.out);
      REQUIRE(r.rc == 0);
      auto m = read_metrics(dir.file("metrics.jsonl"));
      REQUIRE(m.size() == 6);
      auto [loss, norm] = worst_rel(ref, m);
      WARN(name << " with seq_aux_loss_coeff 0.05 vs 1 rank over 6 steps: loss " << loss
                << ", grad norm " << norm);
      CHECK(loss < 1e-5);
      CHECK(norm < 1e-5);
    }
  }
}

TEST_CASE("FSDP without reshard after forward and reductions in bf16 keep their promises",
          "[dist][app][slow]") {
  const std::string common = kSmall + "--training.steps 6 --debug.seed 3 ";
  auto run = [&](const std::string& name, const std::string& flags) {
    test::TempDir dir(name);
    auto r = torchrun_train(2, common + flags + " --job.dump_folder " + dir.path.string());
    INFO(r.out);
    REQUIRE(r.rc == 0);
    auto m = read_metrics(dir.file("metrics.jsonl"));
    REQUIRE(m.size() == 6);
    return std::make_pair(m, r.out);
  };
  const std::string fsdp = "--training.local_batch_size 2 ";
  const std::string ddp =
      "--training.local_batch_size 2 --parallelism.data_parallel_replicate_degree 2 "
      "--parallelism.data_parallel_shard_degree 1 ";
  auto [base, base_log] = run("fsdp-default", fsdp);
  // Keeping the gathered weights changes when memory is freed, not what is computed:
  // the same collectives on the same values, so equal to 1e-6.
  auto [never, never_log] =
      run("fsdp-never", fsdp + "--parallelism.fsdp_reshard_after_forward never");
  CHECK_THAT(never_log, Contains("no reshard after forward"));
  auto [l_never, n_never] = worst_rel(base, never);
  CHECK(l_never < 1e-6);
  CHECK(n_never < 1e-6);
  // bf16 reductions round the summed gradients to 8 bits of mantissa: the runs stay within
  // 1e-2 of the fp32 ones but are not the same numbers (the option is honoured).
  for (auto& [name, flags, says] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"fsdp-bf16", fsdp, "reduce-scatter in BFloat16"},
           {"ddp-bf16", ddp, "all-reduce in BFloat16"}}) {
    auto [ref, ref_log] =
        name == "fsdp-bf16" ? std::make_pair(base, base_log) : run("ddp-fp32", ddp);
    auto [bf, bf_log] = run(name, flags + "--training.mixed_precision_reduce bfloat16");
    CHECK_THAT(bf_log, Contains(says));
    auto [loss, norm] = worst_rel(ref, bf);
    WARN(name << " vs float32 reductions over 6 steps: loss " << loss << ", grad norm " << norm);
    CHECK(norm > 0);
    CHECK(loss < 1e-2);
    CHECK(norm < 1e-2);
  }
}

TEST_CASE("an expert-parallel degree that does not divide the experts exits 2",
          "[dist][app][moe]") {
  test::TempDir dir("epbad");
  // 3 ranks, dp_shard 3, ep 3: the degrees fit the world but 8 experts do not split in 3.
  auto r = torchrun_train(3,
                          "--config configs/deepseek_v3_debug.toml --training.seq_len 64 "
                          "--validation.enable false --training.steps 1 "
                          "--training.local_batch_size 1 "
                          "--parallelism.expert_parallel_degree 3 --job.dump_folder " +
                              dir.path.string());
  INFO(r.out);
  CHECK(test::exit_status(r) == 2);
  CHECK_THAT(r.out, Contains("expert_parallel_degree = 3 does not divide the 8 experts"));
  CHECK_THAT(r.out, Contains("exitcode  : 2"));
}

TEST_CASE("a dead or hung rank makes the others exit non-zero within the timeout",
          "[dist][app][slow]") {
  const int timeout_s = 10;
  // Rank 1 killed, rank 1 stopped (a hang: its sockets stay open), and rank 0 killed (the
  // rank that hosts the store).
  // FSDP 2 (the default layout) keeps prefetches and reduce-scatters in flight; the DDP
  // cases have bucket all-reduces in flight from the backward hooks.
  const std::string ddp =
      "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 ";
  const std::vector<std::tuple<int, int, std::string>> cases = {
      {1, SIGKILL, ""}, {1, SIGSTOP, ""}, {0, SIGKILL, ""}, {1, SIGKILL, ddp}, {1, SIGSTOP, ddp}};
  for (const auto& [victim, sig, layout] : cases) {
    DYNAMIC_SECTION("rank " << victim << " signal " << sig << (layout.empty() ? "" : " ddp")) {
      test::TempDir dir("ddpfail");
      const int port = free_port(sig + 50 * victim + (layout.empty() ? 0 : 7));
      const std::string args = layout +
                               "--training.steps 100000 --training.local_batch_size 2 "
                               "--comm.train_timeout_seconds " +
                               std::to_string(timeout_s) + " --job.dump_folder " +
                               dir.path.string();
      Rank ranks[2] = {spawn_rank(0, 2, port, args, dir.path.string()),
                       spawn_rank(1, 2, port, args, dir.path.string())};
      const Rank& dead = ranks[victim];
      const Rank& live = ranks[1 - victim];
      // Both ranks are training once rank 0 has logged a few steps.
      REQUIRE(wait_for([&] { return read_metrics(dir.file("metrics.jsonl")).size() >= 3; }, 300));
      ::kill(dead.pid, sig);
      const auto t0 = std::chrono::steady_clock::now();
      const bool exited = wait_for([&] { return live.done(); }, timeout_s + 30);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (sig == SIGSTOP) {
        ::kill(dead.pid, SIGKILL);
        ::kill(dead.pid, SIGCONT);
      }
      if (!exited) ::kill(live.pid, SIGKILL);
      INFO(test::read_file(live.log));
      REQUIRE(exited);
      CHECK(live.rc() != 0);
      CHECK(secs < timeout_s + 15);  // the timeout plus the step in flight
      CHECK_THAT(test::read_file(live.log), Contains("failed"));
      WARN("signal " << sig << " to rank " << victim << ": rank " << 1 - victim << " exited "
                     << live.rc() << " after " << secs << " s");
      wait_for([&] { return dead.done(); }, 30);
    }
  }
}

TEST_CASE("ranks with different configs all exit 2 naming the rank", "[dist][app]") {
  test::TempDir dir("ddpcfg");
  const int port = free_port(100);
  const std::string base =
      "--training.local_batch_size 2 --training.steps 2 --job.dump_folder " + dir.path.string();
  Rank r0 = spawn_rank(0, 2, port, base, dir.path.string());
  Rank r1 = spawn_rank(1, 2, port, base + " --optimizer.lr 0.1", dir.path.string());
  REQUIRE(wait_for([&] { return r0.done() && r1.done(); }, 120));
  for (const Rank* r : {&r0, &r1}) {
    INFO(test::read_file(r->log));
    CHECK(r->rc() == 2);
    CHECK_THAT(test::read_file(r->log), Contains("configuration differs between ranks: rank(s) 1"));
  }
}

TEST_CASE("parallel degrees whose product is not the world size exit 2 under torchrun",
          "[dist][app]") {
  test::TempDir dir("ddpdeg");
  auto r =
      test::run("cd " + test::source_dir() + " && " + torchrun() +
                " --standalone --nproc_per_node 2 --no-python " + test::binary() + " " + kSmall +
                "--training.local_batch_size 2 --training.steps 2 "
                "--parallelism.data_parallel_shard_degree 3 --job.dump_folder " +
                dir.path.string());
  INFO(r.out);
  CHECK(test::exit_status(r) == 2);  // the worker's own status (torchrun itself exits 1)
  CHECK_THAT(r.out, Contains("but the world size is 2"));
  CHECK_THAT(r.out, Contains("exitcode  : 2"));
}

TEST_CASE("an FSDP checkpoint of 2 ranks resumes on 2 and reshards onto 1 and 4 ranks",
          "[dist][app][slow][checkpoint]") {
  // Run A (FSDP on 2 ranks) saves step 5 and trains on to 10. Each rank writes its own rows;
  // metadata.json maps the rows. Resuming A's step-5 checkpoint must reproduce steps 6..10:
  // exactly on 2 ranks, and with the same global batch on 1 rank (whole tensors assembled
  // from both files) and on 4 ranks (each rank reads half of one rank's rows).
  test::TempDir a("fsdpckA"), b("fsdpckB"), c("fsdpckC"), d("fsdpckD");
  const std::string common = kSmall +
                             "--training.steps 10 --checkpoint.enable true "
                             "--checkpoint.interval 5 --checkpoint.keep_latest_k 0 ";
  auto fsdp = [&](int n, const std::string& dump) {
    return torchrun_train(n, common + "--training.local_batch_size " + std::to_string(4 / n) +
                                 " --job.dump_folder " + dump);
  };
  auto ra = fsdp(2, a.path.string());
  INFO(ra.out);
  REQUIRE(ra.rc == 0);
  REQUIRE(fs::exists(a.file("checkpoint/step-5/rank-00000.safetensors")));
  REQUIRE(fs::exists(a.file("checkpoint/step-5/rank-00001.safetensors")));
  CHECK_FALSE(fs::exists(a.file("checkpoint/step-5/rank-00000.safetensors.json")));  // merged
  auto meta = nlohmann::json::parse(test::read_file(a.file("checkpoint/step-5/metadata.json")));
  const auto& wq = meta["tensors"]["model/layers.0.attention.wq.weight"];
  CHECK(wq["shape"] == nlohmann::json::array({256, 256}));
  REQUIRE(wq["shards"].size() == 2);
  CHECK(wq["shards"][1]["dim0_offset"] == 128);
  CHECK(wq["shards"][1]["file"] == "rank-00001.safetensors");
  for (auto* t : {&b, &c, &d}) {
    fs::create_directories(t->file("checkpoint"));
    fs::copy(a.file("checkpoint/step-5"), t->file("checkpoint/step-5"),
             fs::copy_options::recursive);
  }
  auto rb = fsdp(2, b.path.string());
  INFO(rb.out);
  REQUIRE(rb.rc == 0);
  auto rc =
      single_train(common + "--training.local_batch_size 4 --job.dump_folder " + c.path.string());
  INFO(rc.out);
  REQUIRE(rc.rc == 0);
  auto rd = fsdp(4, d.path.string());
  INFO(rd.out);
  REQUIRE(rd.rc == 0);
  const double mem4 = memory_ratio(rd.out);  // 1/4 on 4 ranks (plus padding)
  CHECK(mem4 >= 0.25 * 0.999);
  CHECK(mem4 <= 0.25 * 1.02);
  auto ma = read_metrics(a.file("metrics.jsonl"));
  auto mb = read_metrics(b.file("metrics.jsonl"));
  auto mc = read_metrics(c.file("metrics.jsonl"));
  auto md = read_metrics(d.file("metrics.jsonl"));
  CHECK_FALSE(mb.count(5));  // resumed after step 5
  double worst = 0;
  for (int64_t step = 6; step <= 10; ++step) {
    INFO("step " << step);
    REQUIRE(mb.count(step));
    REQUIRE(mc.count(step));
    REQUIRE(md.count(step));
    CHECK(mb[step].loss == ma[step].loss);
    worst = std::max({worst, std::abs(mc[step].loss - ma[step].loss) / ma[step].loss,
                      std::abs(md[step].loss - ma[step].loss) / ma[step].loss});
  }
  WARN("resharded 2 -> 1 and 2 -> 4 ranks: max relative loss difference " << worst
                                                                          << " over steps 6..10");
  CHECK(worst < 1e-5);
  CHECK(std::abs(mc[6].loss - ma[6].loss) / ma[6].loss < 1e-6);  // the next step
  CHECK(std::abs(md[6].loss - ma[6].loss) / ma[6].loss < 1e-6);
}

TEST_CASE("SIGTERM to one rank stops every rank after the same step with one checkpoint",
          "[dist][app][slow][checkpoint]") {
  // Slurm may signal one task before the others. The signalled rank's flag is all-reduced
  // every step and read two steps later on every rank, so all ranks save the same step and
  // exit 0 together.
  test::TempDir dir("preempt2");
  const int port = free_port(300);
  const std::string args =
      "--training.steps 100000 --training.local_batch_size 2 --checkpoint.enable true "
      "--checkpoint.interval 100000 --job.dump_folder " +
      dir.path.string();
  Rank r0 = spawn_rank(0, 2, port, args, dir.path.string());
  Rank r1 = spawn_rank(1, 2, port, args, dir.path.string());
  REQUIRE(wait_for([&] { return read_metrics(dir.file("metrics.jsonl")).size() >= 3; }, 300));
  ::kill(r1.pid, SIGTERM);
  const bool done = wait_for([&] { return r0.done() && r1.done(); }, 120);
  if (!done) {
    ::kill(r0.pid, SIGKILL);
    ::kill(r1.pid, SIGKILL);
  }
  const std::string log0 = test::read_file(r0.log);
  INFO(log0);
  INFO(test::read_file(r1.log));
  REQUIRE(done);
  CHECK(r0.rc() == 0);
  CHECK(r1.rc() == 0);
  CHECK_THAT(log0, Contains("received signal 15"));
  auto steps = titan::Checkpointer::complete_steps(dir.file("checkpoint"));
  REQUIRE(steps.size() == 1);
  CHECK_THAT(log0, Contains("after step " + std::to_string(steps[0]) + ": saving and exiting"));
  // Both ranks' shards of the one checkpoint are there.
  const std::string ck = dir.file("checkpoint") + "/step-" + std::to_string(steps[0]);
  CHECK(fs::exists(ck + "/rank-00000.safetensors"));
  CHECK(fs::exists(ck + "/rank-00001.safetensors"));
}

TEST_CASE("a corrupt shard of a 2-rank checkpoint stops both ranks at load, naming it",
          "[dist][app][checkpoint]") {
  // Rank 1's shard is damaged after the save. Ranks started by hand (no launcher that would
  // kill the survivors): both must exit 2 with the shard's name, neither waiting for the
  // other in a collective.
  test::TempDir dir("corrupt2");
  const std::string args =
      "--training.local_batch_size 2 --checkpoint.enable true "
      "--checkpoint.interval 3 --job.dump_folder " +
      dir.path.string();
  auto r = torchrun_train(2, kSmall + args + " --training.steps 3");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const std::string shard = dir.file("checkpoint/step-3/rank-00001.safetensors");
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(fs::file_size(shard) - 1);
    f.seekg(at);
    const char c = static_cast<char>(f.get() ^ 0x55);
    f.seekp(at);
    f.put(c);
  }
  const int port = free_port(340);
  Rank r0 = spawn_rank(0, 2, port, args + " --training.steps 6", dir.path.string());
  Rank r1 = spawn_rank(1, 2, port, args + " --training.steps 6", dir.path.string());
  const bool done = wait_for([&] { return r0.done() && r1.done(); }, 120);
  if (!done) {
    ::kill(r0.pid, SIGKILL);
    ::kill(r1.pid, SIGKILL);
  }
  const std::string log0 = test::read_file(r0.log), log1 = test::read_file(r1.log);
  INFO(log0);
  INFO(log1);
  REQUIRE(done);
  CHECK(r0.rc() == 2);
  CHECK(r1.rc() == 2);
  CHECK_THAT(log1, Contains("shard rank-00001.safetensors is corrupt") && Contains("CRC32C"));
  CHECK_THAT(log0, Contains("rank-00001.safetensors is corrupt"));
}

TEST_CASE("an async HSDP checkpoint is written by the first replica and resumes on 2 ranks",
          "[dist][app][slow][checkpoint]") {
  // HSDP 2x2: ranks 0 and 1 (replica 0) write their shards from their async writer threads,
  // ranks 2 and 3 write nothing; rank 0 renames once both files are on disk. The save
  // resumes as FSDP on 2 ranks.
  test::TempDir a("hsdpckA"), b("hsdpckB");
  const std::string common = kSmall +
                             "--training.steps 6 --checkpoint.enable true "
                             "--checkpoint.interval 3 --checkpoint.keep_latest_k 0 ";
  auto ra = torchrun_train(4, common +
                                  "--training.local_batch_size 1 "
                                  "--parallelism.data_parallel_replicate_degree 2 "
                                  "--checkpoint.async_mode async --job.dump_folder " +
                                  a.path.string());
  INFO(ra.out);
  REQUIRE(ra.rc == 0);
  const std::string ck = a.file("checkpoint/step-3");
  CHECK(fs::exists(ck + "/rank-00000.safetensors"));
  CHECK(fs::exists(ck + "/rank-00001.safetensors"));
  CHECK_FALSE(fs::exists(ck + "/rank-00002.safetensors"));
  CHECK_FALSE(fs::exists(ck + "/rank-00003.safetensors"));
  fs::create_directories(b.file("checkpoint"));
  fs::copy(ck, b.file("checkpoint/step-3"), fs::copy_options::recursive);
  auto rb = torchrun_train(
      2, common + "--training.local_batch_size 2 --job.dump_folder " + b.path.string());
  INFO(rb.out);
  REQUIRE(rb.rc == 0);
  auto ma = read_metrics(a.file("metrics.jsonl"));
  auto mb = read_metrics(b.file("metrics.jsonl"));
  for (int64_t step = 4; step <= 6; ++step) {
    INFO("step " << step);
    REQUIRE(mb.count(step));
    CHECK(std::abs(mb[step].loss - ma[step].loss) / ma[step].loss < 1e-5);
  }
}

TEST_CASE("FSDP with ep 2 exports the same Hugging Face weights as one process",
          "[dist][app][checkpoint][hf]") {
  // With lr 0 and no bias updates the weights stay at their seeded init. The sharded run
  // allocates and initializes only its own rows (deferred parameters), and its export
  // gathers the shards and the other ep rank's experts; both must reproduce the
  // single-process tensors bit for bit.
  const std::string common =
      "--config configs/deepseek_v3_debug.toml --training.seq_len 64 "
      "--validation.enable false --metrics.enable_tensorboard false --training.steps 1 "
      "--debug.seed 3 --checkpoint.enable true --checkpoint.last_save_in_hf true "
      "--optimizer.lr 0 --moe.load_balance_coeff 0 ";
  test::TempDir one("hfx1"), two("hfx2");
  auto r1 =
      single_train(common + "--training.local_batch_size 2 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto r2 = torchrun_train(2, common +
                                  "--training.local_batch_size 1 "
                                  "--parallelism.expert_parallel_degree 2 --job.dump_folder " +
                                  two.path.string());
  INFO(r2.out);
  REQUIRE(r2.rc == 0);
  auto load = [](const std::string& dir) {
    std::map<std::string, at::Tensor> out;
    for (auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") {
        auto f = titan::SafetensorsFile::open(e.path().string());
        for (auto& t : f.entries()) out[t.name] = f.get(t.name);
      }
    return out;
  };
  auto a = load(one.file("checkpoint/step-1-hf"));
  auto b = load(two.file("checkpoint/step-1-hf"));
  REQUIRE(a.size() > 100);
  REQUIRE(a.size() == b.size());
  int64_t differ = 0;
  for (auto& [name, t] : a) {
    INFO(name);
    REQUIRE(b.count(name));
    if (!at::equal(t, b[name])) ++differ;
  }
  CHECK(differ == 0);
}

namespace {

// From "=> checkpoint: initialized from Hugging Face weights in <dir>: read A of B MiB of
// Hugging Face tensor data on rank 0 (at most C MiB on any rank)": {A, B, C}; C is -1 without
// the parenthesis (one process), everything -1 without the line.
std::tuple<double, double, double> hf_read_mib(const std::string& log) {
  static const std::regex line(
      "read ([0-9.]+) of ([0-9.]+) MiB of Hugging Face tensor data on rank 0"
      "( \\(at most ([0-9.]+) MiB on any rank\\))?");
  std::smatch m;
  if (!std::regex_search(log, m, line)) return {-1, -1, -1};
  return {std::stod(m[1]), std::stod(m[2]), m[4].matched ? std::stod(m[4]) : -1.0};
}

// Runs 1 rank and each layout from the Hugging Face folder `hf`, 3 steps: the losses and
// grad norms agree within 1e-5 relative (the layouts' tolerance above), the single process
// reads the whole folder and no rank of a layout reads more than its 1/`shards` share of it
// plus 0.2% (the log rounds to 0.001 MiB; the debug models' dims divide evenly, and the
// DeepSeek expert biases, read whole, are 32 bytes a layer).
void check_hf_init_layouts(const std::string& model_args, const std::string& hf,
                           const std::vector<std::tuple<std::string, int, std::string, int>>& runs,
                           const std::string& tag) {
  const std::string common = model_args +
                             " --training.seq_len 64 --metrics.log_freq 1 --validation.enable "
                             "false --metrics.enable_tensorboard false --training.steps 3 "
                             "--debug.seed 3 --checkpoint.enable --checkpoint.interval 1000 "
                             "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path " +
                             hf + " ";
  test::TempDir one(tag + "1");
  auto r1 =
      single_train(common + "--training.local_batch_size 4 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  const auto [read1, total1, most1] = hf_read_mib(r1.out);
  REQUIRE(total1 > 0);
  CHECK(read1 == total1);
  CHECK(most1 < 0);
  auto ref = read_metrics(one.file("metrics.jsonl"));
  REQUIRE(ref.size() == 3);
  for (auto& [name, nproc, flags, shards] : runs) {
    DYNAMIC_SECTION(name) {
      test::TempDir dir(tag + name);
      auto r = torchrun_train(nproc, common + flags + " --job.dump_folder " + dir.path.string());
      INFO(r.out);
      REQUIRE(r.rc == 0);
      CHECK_THAT(r.out, Contains("FSDP"));
      const auto [read, total, most] = hf_read_mib(r.out);
      CHECK(total == total1);
      CHECK(read <= most);
      CHECK(most <= total / shards * 1.002 + 0.002);
      CHECK(most >= total / shards * 0.99);
      auto m = read_metrics(dir.file("metrics.jsonl"));
      REQUIRE(m.size() == 3);
      const auto [loss, norm] = worst_rel(ref, m);
      WARN(tag << " " << name << " from Hugging Face weights vs 1 rank over 3 steps: loss " << loss
               << ", grad norm " << norm << "; read at most " << most << " of " << total
               << " MiB on a rank");
      CHECK(loss < 1e-5);
      CHECK(norm < 1e-5);
    }
  }
}

}  // namespace

TEST_CASE("FSDP 2 and 4 start from Hugging Face weights reading only their rows",
          "[dist][app][checkpoint][hf]") {
  // The folder: the llama3 debugmodel at seed 9 (not the runs' seed 3, so a run that kept
  // its own init would differ), exported in bf16 so each rank converts only its rows.
  test::TempDir tmp("hfrows-l3");
  {
    Llama3 src(llama3_flavor("debugmodel"), at::kCPU);
    src.init_weights(9);
    HfExportOptions opts;
    opts.dtype = at::kBFloat16;
    opts.max_shard_bytes = 1 << 20;  // several files
    export_llama3_hf(src, tmp.file("hf"), opts);
  }
  check_hf_init_layouts("--config configs/llama3_debug.toml", tmp.file("hf"),
                        {{"fsdp2", 2, "--training.local_batch_size 2", 2},
                         {"fsdp4", 4, "--training.local_batch_size 1", 4}},
                        "hfrows-l3-");
}

TEST_CASE("FSDP 2 with ep 2 starts deepseek_v3 from Hugging Face weights reading half",
          "[dist][app][checkpoint][hf][moe]") {
  // Dense weights are cut over the 2 ranks, each holds 4 of the 8 experts of a layer (and
  // reads only those experts' tensors); the expert biases (nonzero here) are read whole.
  test::TempDir tmp("hfrows-ds");
  {
    DeepSeekV3 src(deepseek_v3_flavor("debugmodel"), at::kCPU);
    src.init_weights(9);
    at::NoGradGuard ng;
    for (MoELayer* l : src.moe_layers())
      l->expert_bias.copy_(at::arange(l->expert_bias.size(0), at::kFloat) * 0.01);
    export_deepseek_v3_hf(src, tmp.file("hf"), {});
  }
  check_hf_init_layouts(
      "--config configs/deepseek_v3_debug.toml", tmp.file("hf"),
      {{"fsdp2-ep2", 2, "--training.local_batch_size 2 --parallelism.expert_parallel_degree 2", 2}},
      "hfrows-ds-");
}

TEST_CASE("FSDP 2 from a Hugging Face folder of another model exits 2 naming the tensor",
          "[dist][app][checkpoint][hf]") {
  // The sharded import checks the whole folder before reading any row, the same way on every
  // rank: one extra layer (config.json removed, so the tensor check is what fires) is the
  // one-line UserError of the unsharded import, and the rank exits 2.
  test::TempDir tmp("hfrows-bad");
  {
    Llama3Args a = llama3_flavor("debugmodel");
    a.n_layers += 1;
    Llama3 src(a, at::kCPU);
    src.init_weights(9);
    export_llama3_hf(src, tmp.file("hf"), {});
    fs::remove(tmp.file("hf/config.json"));
  }
  // Ranks started by hand (not torchrun, which may stop one rank when the other fails first).
  const std::string args =
      "--training.local_batch_size 2 --training.steps 2 --checkpoint.enable "
      "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path " +
      tmp.file("hf") + " --job.dump_folder " + tmp.file("run");
  const int port = free_port(400);
  std::vector<Rank> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(spawn_rank(r, 2, port, args, tmp.path.string()));
  const std::string msg = "titan-train: error: Hugging Face tensor 'model.layers." +
                          std::to_string(llama3_flavor("debugmodel").n_layers) + ".";
  // Rank 0 hosts the rendezvous store: when it exits first, rank 1 may instead fail its next
  // store call (the data setup's barrier) before it reaches the import. Either way it ends.
  for (const Rank& r : ranks) {
    REQUIRE(wait_for([&] { return r.done(); }, 300));
    const std::string log = test::read_file(r.log);
    INFO(log);
    CHECK(r.rc() != 0);
    if (&r == &ranks[0] || log.find("store") == std::string::npos) {
      CHECK(r.rc() == 2);
      CHECK_THAT(log, Contains(msg) && Contains("is not part of this model"));
    }
  }
}

TEST_CASE("tensor parallel 2 and FSDP 2 x TP 2 match 1 rank for llama3, llama4, deepseek_v3",
          "[dist][app][tp]") {
  // The same global batch of 4 sequences: TP 2 is one dp rank (both tp ranks read the same
  // windows), FSDP 2 x TP 2 two dp ranks of 2 sequences. Sequence parallel on the norms,
  // heads split, the vocabulary-parallel loss: the logged losses and gradient norms must be
  // those of one process to 1e-5 (fp32 sums in another order).
  struct Layout {
    const char* name;
    int nproc;
    std::string flags;
    double memory;  // parameters + AdamW state per rank, as a fraction of the whole
    const char* describes;
  };
  const std::vector<Layout> layouts = {
      {"tp2", 2, "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2", 0.5,
       "dp_replicate 1 x dp_shard 1 x tp 2"},
      {"fsdp2xtp2", 4, "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2", 0.25,
       "FSDP, dp_replicate 1 x dp_shard 2 x tp 2"},
  };
  // llama4 and deepseek_v3: attention (GQA, MLA) and the dense layers split, the MoE layers
  // whole on sequence shards.
  for (const char* model : {"llama3", "llama4", "deepseek_v3"}) {
    DYNAMIC_SECTION(model) {
      const std::string common =
          kSmall + "--training.steps 4 --debug.seed 3 --model.name " + model + " ";
      test::TempDir one("tp_ref");
      auto r1 = single_train(common + "--training.local_batch_size 4 --job.dump_folder " +
                             one.path.string());
      INFO(r1.out);
      REQUIRE(r1.rc == 0);
      auto ref = read_metrics(one.file("metrics.jsonl"));
      REQUIRE(ref.size() == 4);
      for (const Layout& l : layouts) {
        DYNAMIC_SECTION(l.name) {
          test::TempDir dir(l.name);
          auto r =
              torchrun_train(l.nproc, common + l.flags + " --job.dump_folder " + dir.path.string());
          INFO(r.out);
          REQUIRE(r.rc == 0);
          CHECK_THAT(r.out, Contains(l.describes));
          CHECK_THAT(r.out, Contains("tp 2 (sequence parallel)"));
          const double mem = memory_ratio(r.out);
          if (std::string(model) == "llama3") {  // MoE layers are whole on each tp rank
            CHECK(mem >= l.memory * 0.999);
            CHECK(mem <= l.memory * 1.05);  // the norms are whole on every tp rank
          }
          auto m = read_metrics(dir.file("metrics.jsonl"));
          REQUIRE(m.size() == 4);
          const auto [worst_loss, worst_norm] = worst_rel(ref, m);
          WARN(model << " " << l.name << " vs 1 rank, max relative difference over 4 steps: loss "
                     << worst_loss << ", grad norm " << worst_norm << "; memory per rank " << mem);
          CHECK(worst_loss < 1e-5);
          CHECK(worst_norm < 1e-5);
        }
      }
    }
  }
}

TEST_CASE("a tensor-parallel degree the plan cannot split exits 2 at start naming the parameter",
          "[dist][app][tp]") {
  // 3 ranks: tp 3 does not divide the debug model's 256 query rows.
  auto r = torchrun_train(3, kSmall +
                                 "--training.steps 1 --training.seq_len 63 "
                                 "--parallelism.tensor_parallel_degree 3");
  INFO(r.out);
  CHECK(test::exit_status(r) == 2);  // the worker's own status (torchrun itself exits 1)
  CHECK_THAT(r.out, Contains("parallelism.tensor_parallel_degree = 3: "
                             "layers.0.attention.wq.weight [256, 256] is column-parallel"));
  auto b = torchrun_train(2, kSmall +
                                 "--training.steps 1 --parallelism.tensor_parallel_degree 2 "
                                 "--training.seq_len 63");
  INFO(b.out);
  CHECK(test::exit_status(b) == 2);
  CHECK_THAT(b.out, Contains("training.seq_len = 63 does not split over"));
}

namespace {

// The "=> collectives per step on this rank: ..." line of a run's log.
std::string comm_line(const std::string& out) {
  const auto at = out.find("=> collectives per step on this rank:");
  return at == std::string::npos ? "" : out.substr(at, out.find('\n', at) - at);
}

// Global tokens/s: rank 0's logged tps (its dp rank's tokens) x the dp degree, median of
// steps 2.. (step 1 includes warm-up).
double global_tps(const std::string& metrics, int dp) {
  std::vector<double> v;
  for (auto& [step, j] : test::training_metrics(metrics))
    if (step >= 2) v.push_back(j["tps"].get<double>());
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2] * dp;
}

}  // namespace

TEST_CASE("bench: bytes per collective and tokens/s of TP 2 against FSDP 2 on the debugmodel",
          "[.tpbench]") {
  // Same global batch (4 x 256 tokens), same steps, one after the other on this machine.
  const std::string common =
      "--config configs/llama3_debug.toml --training.seq_len 256 "
      "--metrics.log_freq 1 --validation.enable false "
      "--metrics.enable_tensorboard false --training.steps 12 ";
  struct Run {
    const char* name;
    int nproc, dp;
    std::string flags;
    double tps = 0;
    std::string comm;
  };
  std::vector<Run> runs = {
      {"FSDP 2", 2, 2, "--training.local_batch_size 2"},
      {"TP 2", 2, 1, "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2"},
  };
  for (Run& r : runs) {
    test::TempDir dir("tpbench");
    auto out =
        torchrun_train(r.nproc, common + r.flags + " --job.dump_folder " + dir.path.string());
    INFO(out.out);
    REQUIRE(out.rc == 0);
    r.tps = global_tps(dir.file("metrics.jsonl"), r.dp);
    r.comm = comm_line(out.out);
  }
  for (const Run& r : runs) WARN(r.name << ": " << r.tps << " tokens/s (all ranks), " << r.comm);
  WARN("TP 2 / FSDP 2 tokens/s: " << runs[1].tps / runs[0].tps);
}

TEST_CASE("a TP 2 x FSDP 2 checkpoint reshards onto 1 rank and FSDP 4, and FSDP 4's back",
          "[dist][app][tp][checkpoint]") {
  // A: TP 2 x FSDP 2 saves steps 2, 4, 6. The files hold whole tensors' rows (dim-0 slices at
  // their global rows, dim-1 slices gathered over tp), so C (1 rank) and D (FSDP 4) resume
  // A's step 2 and reproduce steps 3..6; E (TP 2 x FSDP 2) resumes D's step-4 save and
  // reproduces A's steps 5..6. Same global batch of 4 and the same training.steps (the lr
  // schedule's length) everywhere; tolerance 1e-5.
  test::TempDir a("tpckA"), c("tpckC"), d("tpckD"), e("tpckE");
  const std::string common = kSmall +
                             "--checkpoint.enable true --checkpoint.interval 2 "
                             "--checkpoint.keep_latest_k 0 --debug.seed 3 ";
  const std::string tp22 = "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2 ";
  auto ra =
      torchrun_train(4, common + tp22 + "--training.steps 6 --job.dump_folder " + a.path.string());
  INFO(ra.out);
  REQUIRE(ra.rc == 0);
  auto meta = nlohmann::json::parse(test::read_file(a.file("checkpoint/step-2/metadata.json")));
  CHECK(meta["tensors"]["model/layers.0.attention.wo.weight"]["shape"] ==
        nlohmann::json::array({256, 256}));
  CHECK(meta["tensors"]["model/tok_embeddings.weight"]["shards"].size() == 4);  // 2 tp x 2 dp
  for (auto* t : {&c, &d}) {
    fs::create_directories(t->file("checkpoint"));
    fs::copy(a.file("checkpoint/step-2"), t->file("checkpoint/step-2"),
             fs::copy_options::recursive);
  }
  auto rc = single_train(common +
                         "--training.local_batch_size 4 --training.steps 6 "
                         "--job.dump_folder " +
                         c.path.string());
  INFO(rc.out);
  REQUIRE(rc.rc == 0);
  auto rd = torchrun_train(4, common +
                                  "--training.local_batch_size 1 --training.steps 6 "
                                  "--job.dump_folder " +
                                  d.path.string());
  INFO(rd.out);
  REQUIRE(rd.rc == 0);
  fs::create_directories(e.file("checkpoint"));
  fs::copy(d.file("checkpoint/step-4"), e.file("checkpoint/step-4"), fs::copy_options::recursive);
  auto re =
      torchrun_train(4, common + tp22 + "--training.steps 6 --job.dump_folder " + e.path.string());
  INFO(re.out);
  REQUIRE(re.rc == 0);
  auto ma = read_metrics(a.file("metrics.jsonl"));
  auto mc = read_metrics(c.file("metrics.jsonl"));
  auto md = read_metrics(d.file("metrics.jsonl"));
  auto me = read_metrics(e.file("metrics.jsonl"));
  double worst = 0;
  auto cmp = [&](std::map<int64_t, Step>& m, int64_t step) {
    INFO("step " << step);
    REQUIRE(m.count(step));
    worst = std::max(worst, std::abs(m[step].loss - ma[step].loss) / ma[step].loss);
    worst = std::max(worst, std::abs(m[step].grad_norm - ma[step].grad_norm) / ma[step].grad_norm);
  };
  for (int64_t s : {3, 4, 5, 6}) {
    cmp(mc, s);
    cmp(md, s);
  }
  for (int64_t s : {5, 6}) cmp(me, s);
  CHECK_FALSE(mc.count(2));
  CHECK_FALSE(me.count(4));
  WARN(
      "TP 2 x FSDP 2 -> 1 rank, -> FSDP 4 -> TP 2 x FSDP 2: max relative loss / grad norm "
      "difference "
      << worst);
  CHECK(worst < 1e-5);
}

TEST_CASE("llama4 with TP 2 and expert TP 2 matches 1 rank, and its checkpoints cross layouts",
          "[dist][app][tp][checkpoint]") {
  // The same global batch of 4 sequences, 4 steps, saves at steps 2 and 4. TP 2 x ETP 2 (one
  // dp rank): the routed experts' hidden size split over the tp ranks, every tp rank routing
  // the whole sequence. Its losses and gradient norms must be those of one process to 1e-5
  // (the TP tests' tolerance: fp32 sums in another order). Then each run's step-2 save is
  // resumed by the other layout (files hold whole experts) and must reproduce the steps 3-4
  // of the run that wrote it, to 1e-5.
  test::TempDir one("etp_ref"), two("etp_tp2"), one_from_two("etp_1of2"), two_from_one("etp_2of1");
  const std::string common = kSmall +
                             "--model.name llama4 --training.steps 4 --debug.seed 3 "
                             "--training.local_batch_size 4 --checkpoint.enable true "
                             "--checkpoint.interval 2 --checkpoint.keep_latest_k 0 ";
  const std::string etp =
      "--parallelism.tensor_parallel_degree 2 "
      "--parallelism.expert_tensor_parallel_degree 2 ";
  auto r1 = single_train(common + "--job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto r2 = torchrun_train(2, common + etp + "--job.dump_folder " + two.path.string());
  INFO(r2.out);
  REQUIRE(r2.rc == 0);
  CHECK_THAT(r2.out, Contains("tp 2 (sequence parallel)") &&
                         Contains("routed experts split over tp (6 w1/w3 by hidden rows, 3 w2"));
  // 3 MoE layers x 3 weights x 8 experts x 512 x 256: half on each tp rank.
  const int64_t whole = 3 * 3 * 8 * 512 * 256;
  CHECK_THAT(r2.out, Contains("routed-expert parameters on this tp rank " +
                              std::to_string(whole / 2) + " of " + std::to_string(whole)));
  // Parameters + AdamW state per rank: about 0.54 of the whole (only the norms, routers and
  // shared experts stay whole; 0.85 when the experts are whole too, etp 1).
  const double mem = memory_ratio(r2.out);
  CHECK(mem > 0.5);
  CHECK(mem < 0.56);
  auto meta = nlohmann::json::parse(test::read_file(two.file("checkpoint/step-2/metadata.json")));
  CHECK(meta["tensors"]["model/layers.1.moe.experts.w1"]["shape"] ==
        nlohmann::json::array({8, 512, 256}));
  CHECK(meta["tensors"]["model/layers.1.moe.experts.w2"]["shape"] ==
        nlohmann::json::array({8, 256, 512}));
  auto ref = read_metrics(one.file("metrics.jsonl"));
  auto m = read_metrics(two.file("metrics.jsonl"));
  REQUIRE(ref.size() == 4);
  REQUIRE(m.size() == 4);
  const auto [worst_loss, worst_norm] = worst_rel(ref, m);
  // Resume each layout's step 2 in the other.
  for (auto [from, to] : {std::pair{&two, &one_from_two}, std::pair{&one, &two_from_one}}) {
    fs::create_directories(to->file("checkpoint"));
    fs::copy(from->file("checkpoint/step-2"), to->file("checkpoint/step-2"),
             fs::copy_options::recursive);
  }
  auto r3 = single_train(common + "--job.dump_folder " + one_from_two.path.string());
  INFO(r3.out);
  REQUIRE(r3.rc == 0);
  auto r4 = torchrun_train(2, common + etp + "--job.dump_folder " + two_from_one.path.string());
  INFO(r4.out);
  REQUIRE(r4.rc == 0);
  auto m3 = read_metrics(one_from_two.file("metrics.jsonl"));
  auto m4 = read_metrics(two_from_one.file("metrics.jsonl"));
  CHECK_FALSE(m3.count(2));
  CHECK_FALSE(m4.count(2));
  double worst_resume = 0;
  for (auto [mine, theirs] : {std::pair{&m3, &m}, std::pair{&m4, &ref}})
    for (int64_t s : {3, 4}) {
      INFO("step " << s);
      REQUIRE(mine->count(s));
      const Step &a = mine->at(s), &b = theirs->at(s);
      worst_resume = std::max(worst_resume, std::abs(a.loss - b.loss) / b.loss);
      worst_resume = std::max(worst_resume, std::abs(a.grad_norm - b.grad_norm) / b.grad_norm);
    }
  WARN("llama4 TP 2 x ETP 2 vs 1 rank, max relative difference over 4 steps: loss "
       << worst_loss << ", grad norm " << worst_norm << "; resumed across layouts: " << worst_resume
       << "; memory per rank " << mem);
  CHECK(worst_loss < 1e-5);
  CHECK(worst_norm < 1e-5);
  CHECK(worst_resume < 1e-5);
}

TEST_CASE("llama4 with TP 2 x EP 2 x ETP 2 matches 1 rank, and its checkpoint resumes on 1 rank",
          "[dist][app][tp][ep][etp][checkpoint]") {
  // 4 ranks: tp 2 x dp_shard 2, ep 2 borrowed from dp_shard (torchtitan 0.2.2's ep x etp with
  // etp = tp). Each tp rank gathers its dp rank's sequences, routes them all and exchanges the
  // rows over its tp index's ep group, whose ranks hold the same hidden slice of their 4
  // experts; the partial outputs come home and are reduce-scattered over tp. The same global
  // batch of 4 sequences as one process, 4 steps: losses and gradient norms to 1e-5 relative
  // (the TP tests' tolerance: fp32 sums in another order), with the exact exchange and with
  // the static one at the worst-case capacity (never overflows, so its own path is compared).
  // Then the EP 2 x ETP 2 run's step-2 save (whole experts in the files) resumes on one
  // process and must reproduce its steps 3-4 to 1e-5.
  test::TempDir one("epetp_ref"), exact("epetp_exact"), fixed("epetp_static"),
      one_from_four("epetp_1of4");
  const std::string common = kSmall +
                             "--model.name llama4 --training.steps 4 --debug.seed 3 "
                             "--checkpoint.enable true --checkpoint.interval 2 "
                             "--checkpoint.keep_latest_k 0 --training.global_batch_size 4 ";
  const std::string epetp =
      "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2 "
      "--parallelism.expert_parallel_degree 2 --parallelism.expert_tensor_parallel_degree 2 ";
  auto r1 =
      single_train(common + "--training.local_batch_size 4 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto r2 = torchrun_train(4, common + epetp + "--job.dump_folder " + exact.path.string());
  INFO(r2.out);
  REQUIRE(r2.rc == 0);
  CHECK_THAT(r2.out, Contains("routed experts split over tp") &&
                         Contains("exchanges its rows over its tp index's ep group (ep 2)"));
  auto r3 = torchrun_train(4, common + epetp +
                                  "--moe.ep_exchange static "
                                  "--moe.ep_capacity_factor inf --job.dump_folder " +
                                  fixed.path.string());
  INFO(r3.out);
  REQUIRE(r3.rc == 0);
  CHECK_THAT(r3.out, Contains("MoE expert-parallel exchange = static"));
  auto meta = nlohmann::json::parse(test::read_file(exact.file("checkpoint/step-2/metadata.json")));
  CHECK(meta["tensors"]["model/layers.1.moe.experts.w1"]["shape"] ==
        nlohmann::json::array({8, 512, 256}));
  CHECK(meta["tensors"]["model/layers.1.moe.experts.w2"]["shape"] ==
        nlohmann::json::array({8, 256, 512}));
  fs::create_directories(one_from_four.file("checkpoint"));
  fs::copy(exact.file("checkpoint/step-2"), one_from_four.file("checkpoint/step-2"),
           fs::copy_options::recursive);
  auto r4 = single_train(common + "--training.local_batch_size 4 --job.dump_folder " +
                         one_from_four.path.string());
  INFO(r4.out);
  REQUIRE(r4.rc == 0);
  auto ref = read_metrics(one.file("metrics.jsonl"));
  auto m2 = read_metrics(exact.file("metrics.jsonl"));
  auto m3 = read_metrics(fixed.file("metrics.jsonl"));
  auto m4 = read_metrics(one_from_four.file("metrics.jsonl"));
  REQUIRE(ref.size() == 4);
  REQUIRE(m2.size() == 4);
  REQUIRE(m3.size() == 4);
  CHECK_FALSE(m4.count(2));
  const auto [loss_exact, norm_exact] = worst_rel(ref, m2);
  const auto [loss_static, norm_static] = worst_rel(ref, m3);
  double worst_resume = 0;
  for (int64_t s : {3, 4}) {
    INFO("step " << s);
    REQUIRE(m4.count(s));
    const Step &a = m4.at(s), &b = m2.at(s);
    worst_resume = std::max(worst_resume, std::abs(a.loss - b.loss) / b.loss);
    worst_resume = std::max(worst_resume, std::abs(a.grad_norm - b.grad_norm) / b.grad_norm);
  }
  WARN(
      "llama4 TP 2 x EP 2 x ETP 2 vs 1 rank, max relative difference over 4 steps: exact "
      "exchange loss "
      << loss_exact << ", grad norm " << norm_exact << "; static exchange loss " << loss_static
      << ", grad norm " << norm_static << "; its step-2 save resumed on 1 rank: " << worst_resume);
  CHECK(loss_exact < 1e-5);
  CHECK(norm_exact < 1e-5);
  CHECK(loss_static < 1e-5);
  CHECK(norm_static < 1e-5);
  CHECK(worst_resume < 1e-5);
}

TEST_CASE("deepseek_v3 with TP 2 x EP 2 x ETP 2 matches 1 rank", "[dist][app][tp][ep][etp]") {
  // As the llama4 case above, for DeepSeek-V3's MoE (softmax top-3 of 8 experts, 2 shared,
  // scores applied after the experts) behind MLA split by heads: 4 steps of the same global
  // batch, losses and gradient norms to 1e-5 relative against one process (exact exchange).
  test::TempDir one("dsepetp_ref"), four("dsepetp_4");
  const std::string common = kSmall +
                             "--model.name deepseek_v3 --training.steps 4 --debug.seed 3 "
                             "--training.global_batch_size 4 ";
  auto r1 =
      single_train(common + "--training.local_batch_size 4 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto r2 =
      torchrun_train(4, common +
                            "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2 "
                            "--parallelism.expert_parallel_degree 2 "
                            "--parallelism.expert_tensor_parallel_degree 2 --job.dump_folder " +
                            four.path.string());
  INFO(r2.out);
  REQUIRE(r2.rc == 0);
  CHECK_THAT(r2.out, Contains("exchanges its rows over its tp index's ep group (ep 2)"));
  auto ref = read_metrics(one.file("metrics.jsonl"));
  auto m = read_metrics(four.file("metrics.jsonl"));
  REQUIRE(ref.size() == 4);
  REQUIRE(m.size() == 4);
  const auto [loss, norm] = worst_rel(ref, m);
  WARN("deepseek_v3 TP 2 x EP 2 x ETP 2 vs 1 rank, max relative difference over 4 steps: loss "
       << loss << ", grad norm " << norm);
  CHECK(loss < 1e-5);
  CHECK(norm < 1e-5);
}

TEST_CASE("static and exact expert-parallel exchanges give the same losses at ep 2 and 4",
          "[dist][app][slow][moe]") {
  // The static exchange at the worst-case capacity (inf: it never overflows, so no step is
  // re-run and the static path itself is what is compared) moves the same rows
  // to the same experts as the exact one, only through fixed-size all-to-alls and a layout
  // built on the device; the per-expert GEMMs see the same rows. Reference: the exact run;
  // tolerance 1e-5 on every step's loss and grad norm. DeepSeek-V3 also recomputes every
  // block (the recompute reuses the exchanged counts), Llama-4 runs without checkpointing.
  const std::string common =
      "--training.seq_len 64 --metrics.log_freq 1 --validation.enable false "
      "--metrics.enable_tensorboard false --training.steps 3 --debug.seed 3 "
      "--training.local_batch_size 1 --training.device cpu ";
  for (std::string model : {"deepseek_v3", "llama4"}) {
    const std::string cfg = "--config configs/" + model + "_debug.toml " +
                            (model == "deepseek_v3" ? "--activation_checkpoint.mode full " : "");
    for (int ep : {2, 4}) {
      std::map<std::string, std::map<int64_t, Step>> runs;
      for (std::string x : {"exact", "static"}) {
        test::TempDir dir("ex" + x + std::to_string(ep));
        auto r = torchrun_train(ep, cfg + common + "--parallelism.expert_parallel_degree " +
                                        std::to_string(ep) + " --moe.ep_exchange " + x +
                                        " --moe.ep_capacity_factor inf" + " --job.dump_folder " +
                                        dir.path.string());
        INFO(model << " ep " << ep << " " << x << "\n" << r.out);
        REQUIRE(r.rc == 0);
        CHECK_THAT(r.out, Contains("MoE expert-parallel exchange = " + x));
        runs[x] = read_metrics(dir.file("metrics.jsonl"));
        REQUIRE(runs[x].size() == 3);
      }
      auto [loss, norm] = worst_rel(runs["exact"], runs["static"]);
      INFO(model << " ep " << ep << ": max relative loss difference " << loss << ", grad norm "
                 << norm);
      CHECK(loss < 1e-5);
      CHECK(norm < 1e-5);
    }
  }
}

namespace {

// Metric `key` of every step of a run's metrics.jsonl (0 where absent).
std::map<int64_t, double> metric(const std::string& file, const std::string& key) {
  std::map<int64_t, double> out;
  for (auto& [step, j] : test::training_metrics(file))
    out[step] = j.contains(key) ? j[key].get<double>() : 0.0;
  return out;
}

double total(const std::map<int64_t, double>& m) {
  double t = 0;
  for (auto& [step, v] : m) t += v;
  return t;
}

}  // namespace

TEST_CASE("an overflowing static exchange re-runs the step: losses equal the exact exchange",
          "[dist][app][moe]") {
  // Dropless capture (docs/moe.md): at capacity factor 0.25 (a quarter of the balanced share
  // per pair) every step overflows, is detected on the device, agreed over the ep group, and
  // run again with the exact exchange, so the run equals the exact one. Reference: the exact
  // exchange; 1e-6 relative on every step's loss and grad norm (the re-run is the exact
  // step, so in practice bit-equal). EP 2 over 5 steps, the growth capped at the starting
  // factor, so the fourth overflow switches the run to the exact exchange for good (said once);
  // EP 4 over 3 steps at the default cap; EP 2 on 4 ranks (FSDP 4: two ep groups share the
  // shard group) over 3 steps, where the flag is agreed over the world, since a re-run's FSDP
  // gathers span both ep groups.
  const std::string common =
      "--config configs/deepseek_v3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --debug.seed 3 "
      "--training.local_batch_size 1 --training.device cpu ";
  for (auto [ep, nproc] : {std::pair{2, 2}, std::pair{4, 4}, std::pair{2, 4}}) {
    const std::string steps = nproc == 4 ? "3" : "5";
    const std::string base = common + "--training.steps " + steps +
                             " --parallelism.expert_parallel_degree " + std::to_string(ep) + " ";
    const std::string tag = std::to_string(ep) + "_" + std::to_string(nproc);
    test::TempDir exact_dir("ovx" + tag), static_dir("ovs" + tag);
    auto exact = torchrun_train(
        nproc, base + "--moe.ep_exchange exact --job.dump_folder " + exact_dir.path.string());
    INFO(exact.out);
    REQUIRE(exact.rc == 0);
    auto st =
        torchrun_train(nproc, base + "--moe.ep_exchange static --moe.ep_capacity_factor 0.25 " +
                                  (nproc == 2 ? "--moe.ep_capacity_factor_max 0.25 " : "") +
                                  "--job.dump_folder " + static_dir.path.string());
    INFO(st.out);
    REQUIRE(st.rc == 0);
    CHECK_THAT(st.out, Contains("is run again with the exact exchange (no drops)"));
    auto a = read_metrics(exact_dir.file("metrics.jsonl")),
         b = read_metrics(static_dir.file("metrics.jsonl"));
    REQUIRE(a.size() == std::stoul(steps));
    REQUIRE(b.size() == a.size());
    auto [loss, norm] = worst_rel(a, b);
    WARN("ep " << ep << " on " << nproc
               << " ranks, static 0.25 against exact: max relative loss difference " << loss
               << ", grad norm " << norm);
    CHECK(loss < 1e-6);
    CHECK(norm < 1e-6);
    auto over = metric(static_dir.file("metrics.jsonl"), "moe_ep_overflows");
    auto reruns = metric(static_dir.file("metrics.jsonl"), "moe_ep_reruns");
    CHECK(over[1] == 1);  // the first step overflows
    CHECK(total(over) >= 3);
    CHECK(total(reruns) == total(over));
    CHECK(total(metric(static_dir.file("metrics.jsonl"), "moe_dropped_tokens")) == 0);
    // The exact run measures the pair load the static exchange would have to hold.
    CHECK(metric(exact_dir.file("metrics.jsonl"), "moe_ep_peak_pair_load")[1] > 0.25);
    if (nproc == 2) {
      CHECK_THAT(st.out, Contains("continues eagerly with the exact exchange"));
      CHECK(metric(static_dir.file("metrics.jsonl"), "moe_ep_exact_only")[5] == 1);
    }
  }
}

TEST_CASE("the probs drop policy drops and counts rows over capacity, and trains on",
          "[dist][app][moe]") {
  // At a quarter of the balanced load per (source, destination) pair most routed rows are
  // dropped (lowest router probability first): the metric counts them (never silent), no
  // step is re-run, and the losses stay finite. The policy with the exact exchange exits 2.
  test::TempDir dir("probs025");
  const std::string base =
      "--config configs/deepseek_v3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --training.steps 3 "
      "--training.local_batch_size 1 --parallelism.expert_parallel_degree 2 "
      "--moe.ep_drop_policy probs --training.device cpu ";
  auto r = torchrun_train(2, base +
                                 "--moe.ep_exchange static --moe.ep_capacity_factor 0.25 "
                                 "--job.dump_folder " +
                                 dir.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  CHECK_THAT(r.out, Contains("factor 0.25") && Contains("lowest router probability first"));
  auto steps = test::training_metrics(dir.file("metrics.jsonl"));
  REQUIRE(steps.size() == 3);
  for (auto& [step, j] : steps) {
    INFO("step " << step << ": " << j.dump());
    REQUIRE(j.contains("moe_dropped_tokens"));
    CHECK(j["moe_dropped_tokens"].get<double>() > 0);
    CHECK(j["moe_ep_reruns"].get<double>() == 0);
    CHECK(std::isfinite(j["loss"].get<double>()));
  }
  auto bad = torchrun_train(2, base + "--moe.ep_exchange exact --job.dump_folder " + dir.file("x"));
  INFO(bad.out);
  CHECK(test::exit_status(bad) == 2);
  CHECK_THAT(bad.out, Contains("moe.ep_drop_policy = \"probs\"") && Contains("exitcode  : 2"));
}

TEST_CASE("collapsed routing under EP 2 trains on and equals one process, every exchange",
          "[dist][app][moe][ep_zero]") {
  // Issue 45: when routing collapses, a rank's experts can receive no rows at all; the exact
  // exchange's receiver then gathered from an empty tensor and the run died (and the static
  // exchange's overflow re-run with it). The collapse is planted: deepseek_v3 debugmodel (8
  // experts, top-3) starts from Hugging Face weights whose expert bias (used for selection
  // only) is +1 on experts 0-3, which sigmoid scores in (0, 1) cannot outweigh, and load
  // balancing is off: every token of every layer goes to rank 0's experts, rank 1's receive
  // nothing, from step 1 on. Reference: one process with the same global batch (2
  // sequences; each of the 2 ranks takes 1); every step's loss and grad norm within 1e-5
  // relative. Exchanges: exact (the default without compile); under compile.enable the
  // static exchange at capacity factor 1 (capped there), whose overflowing steps are re-run
  // with the exact exchange (then exact for good past the cap), with the grouped layout and
  // its CPU kernel (what auto takes under compile on the CPU);
  // the static exchange at the worst case (inf) with the loop kernel; the probs drop policy
  // at factor 2 (the worst case at EP 2 for top-3 of 4 local experts: nothing dropped).
  test::TempDir tmp("collapse-hf");
  {
    DeepSeekV3 src(deepseek_v3_flavor("debugmodel"), at::kCPU);
    src.init_weights(9);
    at::NoGradGuard ng;
    for (MoELayer* l : src.moe_layers())
      l->expert_bias.copy_(at::cat({at::ones({4}), at::zeros({l->expert_bias.size(0) - 4})}));
    export_deepseek_v3_hf(src, tmp.file("hf"), {});
  }
  const std::string common =
      "--config configs/deepseek_v3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
      "--training.steps 4 --debug.seed 3 --moe.load_balance_coeff 0 "
      "--checkpoint.enable --checkpoint.interval 1000 --checkpoint.initial_load_in_hf "
      "--checkpoint.initial_load_path " +
      tmp.file("hf") + " ";
  // One process, eager and under compile.enable (whose CPU step computes in bf16, about
  // 5e-4 from the eager fp32 losses on this model: the reference of the captured EP run is
  // the captured one-process run).
  std::map<bool, std::map<int64_t, Step>> refs;
  for (bool compiled : {false, true}) {
    test::TempDir one(compiled ? "collapse1c" : "collapse1");
    auto r1 = single_train(common + "--training.local_batch_size 2 --job.dump_folder " +
                           one.path.string() + (compiled ? " --compile.enable true" : ""));
    INFO(r1.out);
    REQUIRE(r1.rc == 0);
    refs[compiled] = read_metrics(one.file("metrics.jsonl"));
    REQUIRE(refs[compiled].size() == 4);
    // The routing is collapsed: 4 of the 8 experts of every MoE layer receive nothing.
    for (auto& [step, j] : test::training_metrics(one.file("metrics.jsonl")))
      for (auto& [k, v] : j.items())
        if (k.find("dead_experts") != std::string::npos) CHECK(v.get<double>() >= 4);
  }
  struct Run {
    const char* name;
    std::string flags;
  };
  const std::vector<Run> runs = {
      {"exact", "--moe.ep_exchange exact"},
      {"static factor 1 re-run, compile (grouped layout, CPU kernel)",
       "--compile.enable true --moe.ep_capacity_factor 1 --moe.ep_capacity_factor_max 1"},
      {"static worst case, loop",
       "--moe.ep_exchange static --moe.ep_capacity_factor inf --moe.experts_backend loop"},
      {"static drop policy probs", "--moe.ep_exchange static --moe.ep_drop_policy probs"},
  };
  for (const Run& run : runs) {
    DYNAMIC_SECTION(run.name) {
      test::TempDir dir("collapse_ep");
      auto r = torchrun_train(2, common +
                                     "--training.local_batch_size 1 "
                                     "--parallelism.expert_parallel_degree 2 " +
                                     run.flags + " --job.dump_folder " + dir.path.string());
      INFO(r.out);
      REQUIRE(r.rc == 0);
      auto m = read_metrics(dir.file("metrics.jsonl"));
      REQUIRE(m.size() == 4);
      const bool compiled = run.flags.find("--compile.enable true") != std::string::npos;
      if (compiled) CHECK(total(metric(dir.file("metrics.jsonl"), "moe_ep_reruns")) >= 1);
      const auto [loss, norm] = worst_rel(refs[compiled], m);
      WARN("collapsed routing, EP 2 " << run.name << " vs 1 process over 4 steps: loss " << loss
                                      << ", grad norm " << norm);
      // The captured run computes in bf16 on the CPU (the capture check's compute dtype),
      // where the experts' GEMMs over other row groupings round differently: measured 1.2e-5
      // (loss) and 2.5e-4 (norm) from the captured one-process run, so held to 1e-3; the
      // fp32 eager exchanges to 1e-5.
      const double tol = compiled ? 1e-3 : 1e-5;
      CHECK(loss < tol);
      CHECK(norm < tol);
    }
  }
}

TEST_CASE("routing collapsed by a high lr under EP 2 trains on", "[dist][app][moe][ep_zero]") {
  // The issue's own recipe: llama4 debugmodel, load balancing off, lr 0.05: one process has 6
  // of 8 experts dead in every MoE layer by step 3 and 7 from step 4; EP 2 used to die at
  // step 3. Now it trains on. Reference: one process, same global batch. Steps 1-2 (before
  // the collapse) within 1e-5 relative; after it the run is chaotic (lr 0.05 amplifies the
  // GEMMs' fp32 rounding: 1.6e-4 apart by step 6 as measured), so steps 3-6 are held to 1e-3.
  const std::string common =
      "--config configs/llama4_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
      "--training.steps 6 --debug.seed 3 --moe.load_balance_coeff 0 --optimizer.lr 0.05 "
      "--lr_scheduler.warmup_steps 0 ";
  test::TempDir one("collapse-lr1"), ep("collapse-lr2");
  auto r1 =
      single_train(common + "--training.local_batch_size 2 --job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto steps = test::training_metrics(one.file("metrics.jsonl"));
  REQUIRE(steps.size() == 6);
  CHECK(steps.at(6).value("moe/layer1/dead_experts", 0.0) >= 6);
  auto r = torchrun_train(2, common +
                                 "--training.local_batch_size 1 "
                                 "--parallelism.expert_parallel_degree 2 --job.dump_folder " +
                                 ep.path.string());
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto a = read_metrics(one.file("metrics.jsonl")), b = read_metrics(ep.file("metrics.jsonl"));
  REQUIRE(b.size() == 6);
  for (auto& [step, s] : a) {
    INFO("step " << step);
    const double tol = step <= 2 ? 1e-5 : 1e-3;
    CHECK(std::abs(s.loss - b.at(step).loss) / s.loss < tol);
    CHECK(std::abs(s.grad_norm - b.at(step).grad_norm) / s.grad_norm < tol);
  }
}
