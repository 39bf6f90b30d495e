// Multi-process data parallelism through the binary: 2-rank DDP against 1 rank on the same
// global batch, a dead or hung peer, a config that differs between ranks, and degrees that
// do not match the world size.
#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kSmall =
    "--config configs/llama3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false ";

std::string torchrun() {
  return test::cache_dir() + "/venv/bin/torchrun";
}

// A port per test process, so parallel ctest runs do not collide.
int free_port(int offset) {
  return 20000 + static_cast<int>(::getpid() % 20000) + offset;
}

struct Step {
  double loss = 0, loss_max = 0, grad_norm = 0;
};

std::map<int64_t, Step> read_metrics(const std::string& file) {
  std::map<int64_t, Step> out;
  std::stringstream ss(test::read_file(file));
  for (std::string line; std::getline(ss, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("loss"))
      out[j["step"].get<int64_t>()] = {j["loss"].get<double>(), j["loss_max"].get<double>(),
                                       j["grad_norm"].get<double>()};
  }
  return out;
}

template <class F>
bool wait_for(F cond, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

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

}  // namespace

TEST_CASE("DDP on 2 ranks matches 1 rank on the same global batch", "[dist][app][slow]") {
  // With dp = 2 and local batch 2, rank r takes windows r, r + 2 of each group of four in the
  // epoch's order (the order does not depend on dp); one rank with local batch 4 takes the
  // same four windows. The loss is normalized by the global token count in both, so the
  // summed gradients and the logged mean loss are the same quantities.
  test::TempDir one("ddp1"), two("ddp2");
  const std::string common = kSmall + "--training.steps 20 --debug.seed 3 ";
  auto r1 = test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                      test::binary() + " " + common + "--training.local_batch_size 4 " +
                      "--job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto r2 =
      test::run("cd " + test::source_dir() + " && " + torchrun() +
                " --standalone --nproc_per_node 2 --no-python " + test::binary() + " " + common +
                "--training.local_batch_size 2 --job.dump_folder " + two.path.string());
  INFO(r2.out);
  REQUIRE(r2.rc == 0);
  CHECK_THAT(r2.out, Contains("process group: gloo, 2 ranks, launched by torchrun"));
  CHECK_FALSE(fs::exists(two.file("metrics_rank1.jsonl")));  // only rank 0 writes metrics
  auto a = read_metrics(one.file("metrics.jsonl"));
  auto b = read_metrics(two.file("metrics.jsonl"));
  REQUIRE(a.size() == 20);
  REQUIRE(b.size() == 20);
  double worst_loss = 0, worst_norm = 0;
  for (auto& [step, s] : a) {
    const Step& t = b.at(step);
    worst_loss = std::max(worst_loss, std::abs(s.loss - t.loss) / std::abs(s.loss));
    worst_norm = std::max(worst_norm, std::abs(s.grad_norm - t.grad_norm) / std::abs(s.grad_norm));
    CHECK(t.loss_max >= t.loss - 1e-6);  // the worst rank's mean bounds the global mean
  }
  WARN("max relative difference over 20 steps: loss " << worst_loss << ", grad norm "
                                                      << worst_norm);
  CHECK(worst_loss < 1e-5);
  CHECK(worst_norm < 1e-5);
}

TEST_CASE("a dead or hung rank makes the others exit non-zero within the timeout",
          "[dist][app][slow]") {
  const int timeout_s = 10;
  // Rank 1 killed, rank 1 stopped (a hang: its sockets stay open), and rank 0 killed (the
  // rank that hosts the store).
  const std::vector<std::pair<int, int>> cases = {{1, SIGKILL}, {1, SIGSTOP}, {0, SIGKILL}};
  for (const auto& [victim, sig] : cases) {
    DYNAMIC_SECTION("rank " << victim << " signal " << sig) {
      test::TempDir dir("ddpfail");
      const int port = free_port(sig + 50 * victim);
      const std::string args =
          "--training.steps 100000 --training.local_batch_size 2 "
          "--comm.train_timeout_seconds " +
          std::to_string(timeout_s) + " --job.dump_folder " + dir.path.string();
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
  CHECK(r.rc != 0);  // torchrun reports a failed worker as 1; the worker's own status is 2
  CHECK_THAT(r.out, Contains("but the world size is 2"));
  CHECK_THAT(r.out, Contains("exitcode  : 2"));
}

TEST_CASE("a 2-rank checkpoint resumes on 2 ranks and on 1 rank", "[dist][app][slow]") {
  // Run A saves step 5 and trains on to 10. Resuming A's step-5 checkpoint must reproduce
  // steps 6..10: exactly on 2 ranks, and on 1 rank with the same global batch (the saved
  // loader position, recorded at dp = 2, is rescaled to dp = 1).
  test::TempDir a("ddpckA"), b("ddpckB"), c("ddpckC");
  const std::string common = kSmall +
                             "--training.steps 10 --checkpoint.enable true "
                             "--checkpoint.interval 5 --checkpoint.keep_latest_k 0 ";
  auto ddp = [&](const std::string& dump) {
    return test::run("cd " + test::source_dir() + " && " + torchrun() +
                     " --standalone --nproc_per_node 2 --no-python " + test::binary() + " " +
                     common + "--training.local_batch_size 2 --job.dump_folder " + dump);
  };
  auto ra = ddp(a.path.string());
  INFO(ra.out);
  REQUIRE(ra.rc == 0);
  REQUIRE(fs::exists(a.file("checkpoint/step-5/rank-00000.safetensors")));
  CHECK_FALSE(fs::exists(a.file("checkpoint/step-5/rank-00001.safetensors")));
  for (auto* d : {&b, &c}) {
    fs::create_directories(d->file("checkpoint"));
    fs::copy(a.file("checkpoint/step-5"), d->file("checkpoint/step-5"),
             fs::copy_options::recursive);
  }
  auto rb = ddp(b.path.string());
  INFO(rb.out);
  REQUIRE(rb.rc == 0);
  auto rc = test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                      test::binary() + " " + common +
                      "--training.local_batch_size 4 --job.dump_folder " + c.path.string());
  INFO(rc.out);
  REQUIRE(rc.rc == 0);
  auto ma = read_metrics(a.file("metrics.jsonl"));
  auto mb = read_metrics(b.file("metrics.jsonl"));
  auto mc = read_metrics(c.file("metrics.jsonl"));
  for (int64_t step = 6; step <= 10; ++step) {
    INFO("step " << step);
    REQUIRE(mb.count(step));
    REQUIRE(mc.count(step));
    CHECK(mb[step].loss == ma[step].loss);
    CHECK(std::abs(mc[step].loss - ma[step].loss) / ma[step].loss < 1e-5);
  }
  CHECK_FALSE(mb.count(5));  // resumed after step 5
}
