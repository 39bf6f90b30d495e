// Checkpointing through the binary: bit-exact resume after kill -9, a kill during a save,
// pre-emption by SIGTERM, pruning, async saves, and bad checkpoints (exit 2).
#include <catch2/catch.hpp>

#include <signal.h>

#include <fstream>

#include <chrono>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "app/checkpointer.h"
#include "core/checkpoint/safetensors.h"
#include "models/deepseek_v3.h"
#include "models/hf_interop.h"
#include "models/llama3.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kSmall =
    "--config configs/llama3_debug.toml --training.local_batch_size 2 --training.seq_len 64 "
    "--metrics.log_freq 1 --validation.enable false --metrics.enable_tensorboard false ";

std::string cmd(const std::string& args) {
  return "cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() + " " +
         kSmall + args;
}

using test::losses;
using test::wait_for;

// The binary running in the background under a shell that records its exit status.
struct Proc {
  int pid = -1;
  std::string rc_file;
  int wait() const {  // exit status, or -1 on timeout
    if (!wait_for([&] { return fs::exists(rc_file) && fs::file_size(rc_file) > 0; }, 600))
      return -1;
    return std::stoi(test::read_file(rc_file));
  }
};

Proc spawn(const std::string& args, const std::string& log, const std::string& env = "") {
  Proc p;
  p.rc_file = log + ".rc";
  auto r = test::run("cd " + test::source_dir() + " && ( env -u RANK -u WORLD_SIZE " + env + " " +
                     test::binary() + " " + kSmall + args + " > " + log + " 2>&1; echo $? > " +
                     p.rc_file + " ) > /dev/null 2>&1 & echo $!");
  const std::string shell = std::to_string(std::stoi(r.out));
  wait_for([&] { return !test::run("pgrep -P " + shell).out.empty(); }, 30);
  p.pid = std::stoi(test::run("pgrep -P " + shell).out);
  return p;
}

}  // namespace

TEST_CASE("checkpoint: resume after kill -9 gives bit-identical losses", "[checkpoint][slow]") {
  test::TempDir dir("resume");
  auto a = test::run(cmd("--training.steps 40 --job.dump_folder " + dir.file("a")));
  REQUIRE(a.rc == 0);
  auto straight = losses(dir.file("a"));
  REQUIRE(straight.size() == 40);

  const std::string b_args =
      "--training.steps 40 --checkpoint.enable --checkpoint.interval 10 "
      "--job.dump_folder " +
      dir.file("b");
  Proc b_proc = spawn(b_args, dir.file("b.log"));
  const std::string step20 = dir.file("b") + "/checkpoint/step-20";
  REQUIRE(wait_for([&] { return fs::exists(step20); }, 300));
  std::mt19937 rng(std::random_device{}());
  std::this_thread::sleep_for(
      std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 800)(rng)));
  ::kill(b_proc.pid, SIGKILL);
  CHECK(b_proc.wait() == 128 + SIGKILL);
  auto killed_at = losses(dir.file("b"));
  INFO("killed after step " << (killed_at.empty() ? 0 : killed_at.rbegin()->first));

  auto resumed = test::run(cmd(b_args));
  INFO(resumed.out.substr(resumed.out.size() > 2000 ? resumed.out.size() - 2000 : 0));
  REQUIRE(resumed.rc == 0);
  CHECK_THAT(resumed.out, Contains("resumed from"));
  auto b = losses(dir.file("b"));
  for (int64_t s = 21; s <= 40; ++s) {
    INFO("step " << s);
    CHECK(b[s] == straight[s]);  // exact, not approximate
  }
}

TEST_CASE("checkpoint: a save killed midway is never picked as the latest", "[checkpoint]") {
  test::TempDir dir("killsave");
  const std::string args =
      "--training.steps 30 --checkpoint.enable --checkpoint.interval 5 "
      "--job.dump_folder " +
      dir.file("r");
  // Every save sleeps 3 s between writing its files and the rename: a slow disk.
  Proc proc = spawn(args + " --debug.checkpoint_delay_ms 3000", dir.file("r.log"));
  const std::string root = dir.file("r") + "/checkpoint";
  auto tmp_of_10 = [&] {
    if (!fs::exists(root)) return false;
    for (auto& e : fs::directory_iterator(root))
      if (e.path().filename().string().rfind("step-10.tmp-", 0) == 0 &&
          fs::exists(e.path() / "train_state.json"))
        return true;
    return false;
  };
  REQUIRE(wait_for(tmp_of_10, 300));
  ::kill(proc.pid, SIGKILL);
  CHECK(proc.wait() == 128 + SIGKILL);
  CHECK(Checkpointer::complete_steps(root) == std::vector<int64_t>{5});
  auto r = test::run(cmd(args + " --training.steps 6"));
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK_THAT(r.out, Contains("checkpoint/step-5 at step 5"));
  // The killed writer's folder is removed at the start of the next run, and the log says so.
  CHECK_FALSE(tmp_of_10());
  CHECK_THAT(r.out, Contains("=> checkpoint: removed " + root + "/step-10.tmp-") &&
                        Contains("which is gone"));
}

TEST_CASE("checkpoint: SIGTERM finishes the step and saves and exits 0", "[checkpoint]") {
  test::TempDir dir("preempt");
  const std::string args =
      "--training.steps 100000 --checkpoint.enable --checkpoint.interval 100000 "
      "--job.dump_folder " +
      dir.file("r");
  Proc proc = spawn(args, dir.file("r.log"));
  REQUIRE(wait_for(
      [&] {
        return fs::exists(dir.file("r") + "/metrics.jsonl") && losses(dir.file("r")).size() >= 3;
      },
      300));
  ::kill(proc.pid, SIGTERM);
  CHECK(proc.wait() == 0);
  std::string log = test::read_file(dir.file("r.log"));
  INFO(log.substr(log.size() > 2000 ? log.size() - 2000 : 0));
  CHECK_THAT(log, Contains("received signal 15"));
  CHECK(log.find("training done") == std::string::npos);
  auto steps = Checkpointer::complete_steps(dir.file("r") + "/checkpoint");
  REQUIRE(steps.size() == 1);
  const int64_t n = steps[0];
  CHECK(losses(dir.file("r")).rbegin()->first == n);  // saved the last finished step
  auto r = test::run(cmd(args + " --training.steps " + std::to_string(n + 2)));
  CHECK(r.rc == 0);
  CHECK_THAT(r.out, Contains("at step " + std::to_string(n)));
  CHECK(losses(dir.file("r")).count(n + 2) == 1);
}

// Ctrl-C is a pre-emption like SIGTERM (README "Errors and exit status"): the step finishes,
// a checkpoint is saved, exit 0. A second Ctrl-C during that save ends the process at once.
TEST_CASE("checkpoint: SIGINT saves and exits 0; a second SIGINT aborts the save", "[checkpoint]") {
  test::TempDir dir("sigint");
  const std::string args =
      "--training.steps 100000 --checkpoint.enable --checkpoint.interval 100000 "
      "--job.dump_folder ";
  auto started = [&](const std::string& dump) {
    return wait_for([&] { return losses(dump).size() >= 2; }, 300);
  };
  Proc once = spawn(args + dir.file("a"), dir.file("a.log"));
  REQUIRE(started(dir.file("a")));
  ::kill(once.pid, SIGINT);
  CHECK(once.wait() == 0);
  std::string log = test::read_file(dir.file("a.log"));
  INFO(log.substr(log.size() > 2000 ? log.size() - 2000 : 0));
  CHECK_THAT(log, Contains("received signal 2") && Contains("saving and exiting"));
  CHECK(Checkpointer::complete_steps(dir.file("a") + "/checkpoint").size() == 1);

  // Each save sleeps 3 s before its rename, so the second SIGINT lands inside it.
  Proc twice = spawn(args + dir.file("b") + " --debug.checkpoint_delay_ms 3000", dir.file("b.log"));
  REQUIRE(started(dir.file("b")));
  ::kill(twice.pid, SIGINT);
  REQUIRE(wait_for(
      [&] {
        return test::read_file(dir.file("b.log")).find("received signal 2") != std::string::npos;
      },
      60));
  ::kill(twice.pid, SIGINT);
  CHECK(twice.wait() == 128 + SIGINT);
  CHECK(Checkpointer::complete_steps(dir.file("b") + "/checkpoint").empty());
}

TEST_CASE("checkpoint: pruning keeps the newest k and async saves resume like sync ones",
          "[checkpoint]") {
  test::TempDir dir("prune");
  // The same two-leg run (7 steps, then resumed to 12) with synchronous and async saves.
  for (const char* mode : {"disabled", "async"}) {
    const std::string args = std::string("--checkpoint.enable --checkpoint.interval 2 ") +
                             "--checkpoint.keep_latest_k 2 --checkpoint.async_mode " + mode +
                             " --job.dump_folder " + dir.file(mode);
    auto r1 = test::run(cmd(args + " --training.steps 7"));
    INFO(r1.out);
    REQUIRE(r1.rc == 0);
    CHECK(Checkpointer::complete_steps(dir.file(mode) + "/checkpoint") ==
          std::vector<int64_t>{6, 7});
    REQUIRE(test::run(cmd(args + " --training.steps 12")).rc == 0);
    for (auto& e : fs::directory_iterator(dir.file(mode) + "/checkpoint"))
      CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
  }
  auto sync = losses(dir.file("disabled")), async = losses(dir.file("async"));
  REQUIRE(sync.size() == 12);
  for (int64_t s = 1; s <= 12; ++s) CHECK(async[s] == sync[s]);
}

TEST_CASE("checkpoint: bad checkpoints and failed saves exit 2 with a clear message",
          "[checkpoint]") {
  test::TempDir dir("badckpt");
  const std::string base =
      "--checkpoint.enable --checkpoint.interval 5 --job.dump_folder " + dir.file("r");
  // No checkpoint folder at all.
  auto r = test::run(cmd(base + " --training.steps 5 --checkpoint.load_step 5"));
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("checkpoint.load_step = 5") && Contains("does not exist"));
  REQUIRE(test::run(cmd(base + " --training.steps 5")).rc == 0);
  // A load_step that has no checkpoint.
  r = test::run(cmd(base + " --training.steps 10 --checkpoint.load_step 7"));
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("no complete checkpoint step-7") && Contains("available: 5"));
  // A full disk (a file-size limit far below the 70 MB shard): exit 2, step-5 kept, no debris.
  r = test::run("ulimit -f 20000 && " + cmd(base + " --training.steps 10"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("checkpoint save of step 10") &&
                        Contains("previous checkpoint step-5 is kept"));
  CHECK(Checkpointer::complete_steps(dir.file("r") + "/checkpoint") == std::vector<int64_t>{5});
  for (auto& e : fs::directory_iterator(dir.file("r") + "/checkpoint"))
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
  // One byte of a shard changed after the save: refused by its CRC32C, naming the shard.
  const std::string shard5 = dir.file("r") + "/checkpoint/step-5/rank-00000.safetensors";
  {
    std::fstream f(shard5, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(fs::file_size(shard5) / 2);
    f.seekg(at);
    const char c = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(at);
    f.put(c);
  }
  r = test::run(cmd(base + " --training.steps 10"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("shard rank-00000.safetensors is corrupt") && Contains("CRC32C"));
  // A truncated shard names the file.
  const std::string shard = dir.file("r") + "/checkpoint/step-5/rank-00000.safetensors";
  fs::resize_file(shard, fs::file_size(shard) / 2);
  r = test::run(cmd(base + " --training.steps 10"));
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("rank-00000.safetensors"));
  // A corrupt metadata file names the file.
  test::write_file(dir.file("r") + "/checkpoint/step-5/metadata.json", "{not json");
  r = test::run(cmd(base + " --training.steps 10"));
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("metadata.json"));
}

TEST_CASE("checkpoint: an incompatible model config names the tensor and both shapes",
          "[checkpoint]") {
  test::TempDir dir("incompat");
  JobConfig cfg = default_config();
  cfg.job.dump_folder = dir.file("r");
  cfg.checkpoint.enable = true;
  Llama3Args small = llama3_flavor("debugmodel");
  small.dim = 128;
  Llama3 a(small, at::kCPU);
  a.init_weights(1);
  std::vector<bool> decay(a.params().all().size(), true);
  Optimizer opt_a(a.params().tensors(), decay, cfg.optimizer);
  Checkpointer ck(cfg, 0, 1);
  TrainingState sa{&a, &opt_a, {}, {}, 3, 0};
  ck.save(sa, false);
  Llama3 b(llama3_flavor("debugmodel"), at::kCPU);
  Optimizer opt_b(b.params().tensors(), decay, cfg.optimizer);
  TrainingState sb{&b, &opt_b, {}, {}, 0, 0};
  CHECK_THROWS_WITH(ck.load(sb), Contains("model/tok_embeddings.weight") &&
                                     Contains("[2048, 128]") && Contains("[2048, 256]"));
  // The same model loads, and restores step and parameters exactly.
  Llama3 c(small, at::kCPU);
  c.init_weights(77);
  Optimizer opt_c(c.params().tensors(), decay, cfg.optimizer);
  TrainingState sc{&c, &opt_c, {}, {}, 0, 0};
  CHECK_THAT(ck.load(sc), Contains("step-3"));
  CHECK(sc.step == 3);
  for (size_t i = 0; i < a.params().all().size(); ++i)
    CHECK(at::equal(a.params().all()[i].value, c.params().all()[i].value));
}

// A resumed run keeps one metrics row per step (the earlier run's rows past the checkpoint
// are dropped, not duplicated), and a checkpoint past training.steps is said to be so.
TEST_CASE("checkpoint: resume trims metrics.jsonl; a checkpoint past the last step is named",
          "[checkpoint]") {
  test::TempDir dir("trim");
  const std::string args = "--checkpoint.enable --checkpoint.interval 3 --job.dump_folder " +
                           dir.file("r") + " --training.steps ";
  REQUIRE(test::run(cmd(args + "6")).rc == 0);
  fs::remove_all(dir.file("r") + "/checkpoint/step-6");
  auto again = test::run(cmd(args + "6"));
  INFO(again.out);
  REQUIRE(again.rc == 0);
  CHECK_THAT(again.out, Contains("at step 3") && Contains("dropped 3 rows after step 3"));
  size_t rows = 0;
  std::stringstream ss(test::read_file(dir.file("r") + "/metrics.jsonl"));
  for (std::string line; std::getline(ss, line);)
    rows += line.find("\"loss\"") != std::string::npos;
  CHECK(rows == 6);
  CHECK(losses(dir.file("r")).size() == 6);
  auto past = test::run(cmd(args + "4"));
  INFO(past.out);
  CHECK(past.rc == 0);
  CHECK_THAT(past.out, Contains("the checkpoint is at step 6, already at or past the last step "
                                "(training.steps = 4): nothing to train"));
}

// A resume never silently falls back to an older step: a newer folder that is no complete
// checkpoint is named with the reason, and a damaged newest checkpoint's error names the step
// before it as the way back.
TEST_CASE("checkpoint: skipped and damaged newest checkpoints are named", "[checkpoint]") {
  test::TempDir dir("skipped");
  JobConfig cfg = default_config();
  cfg.job.dump_folder = dir.file("r");
  cfg.checkpoint.enable = true;
  Llama3Args small = llama3_flavor("debugmodel");
  small.dim = 64;
  Llama3 a(small, at::kCPU);
  a.init_weights(1);
  std::vector<bool> decay(a.params().all().size(), true);
  Optimizer opt(a.params().tensors(), decay, cfg.optimizer);
  Checkpointer ck(cfg, 0, 1);
  for (int64_t step : {3, 5, 7}) {
    TrainingState s{&a, &opt, {}, {}, step, 0};
    ck.save(s, false);
  }
  const std::string root = dir.file("r") + "/checkpoint";
  fs::remove(root + "/step-7/metadata.json");
  TrainingState st{&a, &opt, {}, {}, 0, 0};
  const std::string what = ck.load(st);
  CHECK(st.step == 5);
  CHECK_THAT(what, Contains("resumed from " + root + "/step-5") &&
                       Contains("skipped " + root + "/step-7: it has no metadata.json"));
  // Damage step-5's shard: its CRC fails, and the message offers step 3.
  {
    std::fstream f(root + "/step-5/rank-00000.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(
        static_cast<std::streamoff>(fs::file_size(root + "/step-5/rank-00000.safetensors") / 2));
    f.write("garbage!", 8);
  }
  CHECK_THROWS_WITH(ck.load(st),
                    Contains("rank-00000.safetensors") && Contains("checkpoint.load_step = 3"));
}

TEST_CASE("checkpoint: last_save_in_hf exports weights that initial_load_in_hf loads back",
          "[checkpoint][hf]") {
  test::TempDir dir("hfckpt");
  auto a =
      test::run(cmd("--training.steps 30 --checkpoint.enable --checkpoint.last_save_in_hf "
                    "--checkpoint.export_dtype float32 --job.dump_folder " +
                    dir.file("a")));
  INFO(a.out);
  REQUIRE(a.rc == 0);
  const std::string hf = dir.file("a") + "/checkpoint/step-30-hf";
  CHECK(fs::exists(hf + "/config.json"));
  CHECK(fs::exists(hf + "/model.safetensors.index.json"));
  // One evaluation step from the exported weights versus from a fresh initialization: the
  // trained weights must give a clearly lower first loss.
  const std::string one = "--training.steps 1 --optimizer.lr 0 --lr_scheduler.warmup_steps 0 ";
  auto fresh = test::run(cmd(one + "--job.dump_folder " + dir.file("fresh")));
  // Loading initial weights does not need checkpoint.enable (saving): without it, as here,
  // the weights were once silently not loaded.
  auto loaded = test::run(cmd(one +
                              "--checkpoint.initial_load_in_hf "
                              "--checkpoint.initial_load_path " +
                              hf + " --job.dump_folder " + dir.file("b")));
  INFO(loaded.out);
  REQUIRE(fresh.rc == 0);
  REQUIRE(loaded.rc == 0);
  CHECK_THAT(loaded.out, Contains("initialized from Hugging Face weights"));
  CHECK(losses(dir.file("b"))[1] < losses(dir.file("fresh"))[1] - 0.5);
  CHECK_FALSE(fs::exists(dir.file("b") + "/checkpoint"));  // nothing saved
  // The same for a native checkpoint folder.
  auto native = test::run(cmd(one + "--checkpoint.initial_load_path " + dir.file("a") +
                              "/checkpoint/step-30 --job.dump_folder " + dir.file("c")));
  INFO(native.out);
  REQUIRE(native.rc == 0);
  CHECK_THAT(native.out, Contains("initialized from " + dir.file("a") + "/checkpoint/step-30"));
  CHECK(losses(dir.file("c"))[1] == Approx(losses(dir.file("b"))[1]).epsilon(1e-4));
}

TEST_CASE("checkpoint: deepseek_v3 last_save_in_hf exports the checkpoint's weights and biases",
          "[checkpoint][hf]") {
  test::TempDir dir("hfckpt-ds");
  auto ds = [&](const std::string& args) {
    return "cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() +
           " --config configs/deepseek_v3_debug.toml --training.local_batch_size 2 "
           "--training.seq_len 64 --metrics.log_freq 1 --validation.enable false "
           "--metrics.enable_tensorboard false " +
           args;
  };
  auto a =
      test::run(ds("--training.steps 4 --checkpoint.enable --checkpoint.last_save_in_hf "
                   "--job.dump_folder " +
                   dir.file("a")));
  INFO(a.out);
  REQUIRE(a.rc == 0);
  const std::string step = dir.file("a") + "/checkpoint/step-4";
  const std::string hf = step + "-hf";
  REQUIRE(fs::exists(hf + "/config.json"));
  CHECK(nlohmann::json::parse(test::read_file(hf + "/config.json"))["model_type"] == "deepseek_v3");

  // Every HF tensor equals the checkpoint's (model/<name>, buffers/<name> for the biases,
  // which four balancing steps have made nonzero).
  auto ck = SafetensorsFile::open(step + "/rank-00000.safetensors");
  std::map<std::string, at::Tensor> hf_tensors;
  for (auto& e : fs::directory_iterator(hf)) {
    if (e.path().extension() != ".safetensors") continue;
    auto f = SafetensorsFile::open(e.path().string());
    for (auto& t : f.entries()) hf_tensors[t.name] = f.get(t.name);
  }
  const auto map = deepseek_v3_hf_map(deepseek_v3_hf_layout(deepseek_v3_flavor("debugmodel")));
  size_t n = 0;
  for (auto& m : map) {
    const bool buffer = m.ours.find("expert_bias") != std::string::npos;
    at::Tensor ours = ck.get((buffer ? "buffers/" : "model/") + m.ours);
    if (buffer) CHECK(ours.abs().sum().item<double>() > 0);
    for (size_t k = 0; k < m.hf.size(); ++k, ++n) {
      INFO(m.hf[k]);
      REQUIRE(hf_tensors.count(m.hf[k]) == 1);
      CHECK(hf_tensors[m.hf[k]].equal(m.hf.size() > 1 ? ours[static_cast<int64_t>(k)] : ours));
    }
  }
  CHECK(hf_tensors.size() == n);

  // Starting from the HF folder and from the checkpoint gives the same first loss.
  const std::string one =
      "--training.steps 1 --optimizer.lr 0 --lr_scheduler.warmup_steps 0 "
      "--checkpoint.enable --checkpoint.initial_load_path ";
  auto from_hf = test::run(
      ds(one + hf + " --checkpoint.initial_load_in_hf --job.dump_folder " + dir.file("b")));
  auto from_ck = test::run(ds(one + step + " --job.dump_folder " + dir.file("c")));
  INFO(from_hf.out);
  INFO(from_ck.out);
  REQUIRE(from_hf.rc == 0);
  REQUIRE(from_ck.rc == 0);
  CHECK_THAT(from_hf.out, Contains("initialized from Hugging Face weights"));
  REQUIRE(losses(dir.file("b")).count(1) == 1);
  CHECK(losses(dir.file("b"))[1] == losses(dir.file("c"))[1]);
}

TEST_CASE("checkpoint: Hugging Face weights for llama4 exit 2 naming the supported models",
          "[checkpoint][hf]") {
  test::TempDir dir("hfckpt-l4");
  const std::string l4 = "cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                         test::binary() +
                         " --config configs/llama4_debug.toml --training.steps 1 "
                         "--checkpoint.enable --job.dump_folder " +
                         dir.file("a");
  // last_save_in_hf is refused by the config check, initial_load_in_hf by the trainer.
  auto r = test::run(l4 + " --checkpoint.last_save_in_hf");
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("model.name = \"llama4\"; allowed: llama3, deepseek_v3"));
  fs::create_directories(dir.file("hf"));
  r = test::run(l4 + " --checkpoint.initial_load_in_hf --checkpoint.initial_load_path " +
                dir.file("hf"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Contains("checkpoint.initial_load_in_hf / last_save_in_hf: Hugging Face "
                             "weights are supported for model.name = llama3, deepseek_v3, "
                             "qwen3, gpt_oss; found \"llama4\""));
}
