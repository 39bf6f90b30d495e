// optimizer.name = "Muon" through the binary on the Llama-3 debugmodel: bad Muon input exits 2
// naming the key; a resumed run repeats the straight run's losses bit for bit (the momentum
// buffer is checkpointed); switching optimizer on resume exits 2 unless the optimizer state
// is excluded from loading; the CPU capture check (compile.enable) passes with Muon, on one
// rank and with the owner plan's all-to-alls at FSDP 2; the layouts equal 1 rank (relative
// 1e-5 on the losses and gradient norms over 4 steps) and the owner plan gives each rank
// sharing the matrices its part of the Newton-Schulz work (the startup log's plan line).
#include <catch2/catch.hpp>

#include <filesystem>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

// Without --config: train() and torchrun_train() add the model's config first.
const std::string kSmall =
    "--training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
    "--debug.seed 5 --optimizer.name Muon --optimizer.muon_lr 0.02 ";

test::CmdResult train(const std::string& args,
                      const std::string& config = "configs/llama3_debug.toml") {
  return test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE OMP_NUM_THREADS=1 " +
                   test::binary() + " --config " + config + " " + kSmall + args);
}

test::CmdResult torchrun_train(int nproc, const std::string& args,
                               const std::string& config = "configs/llama3_debug.toml") {
  return test::run("cd " + test::source_dir() + " && OMP_NUM_THREADS=1 " + test::torchrun() +
                   " --standalone --nproc_per_node " + std::to_string(nproc) + " --no-python " +
                   test::binary() + " --config " + config + " " + kSmall + args);
}

// step -> (loss, grad_norm)
std::map<int64_t, std::pair<double, double>> metrics(const std::string& dump) {
  std::map<int64_t, std::pair<double, double>> out;
  for (auto& [step, j] : test::training_metrics(dump + "/metrics.jsonl"))
    out[step] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  return out;
}

}  // namespace

TEST_CASE("muon: bad Muon input exits 2 naming the key", "[muon][app]") {
  test::TempDir dir("muon-bad");
  const std::string common = "--training.steps 1 --job.dump_folder " + dir.file("r") + " ";
  struct Case {
    std::string args;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"--optimizer.muon_ns_coefficients 3.4,-4.7", {"optimizer.muon_ns_coefficients", "3"}},
      {"--optimizer.muon_ns_steps 0", {"optimizer.muon_ns_steps"}},
      {"--optimizer.muon_adjust_lr_fn sqrt", {"optimizer.muon_adjust_lr_fn", "match_rms_adamw"}},
      {"--optimizer.param_groups wq_b=AdamW", {"optimizer.param_groups", "wq_b", "matches no"}},
      {"--optimizer.param_groups norm=Muon", {"optimizer.param_groups", "matrices"}},
      {"--optimizer.param_groups wq=Adam", {"optimizer.param_groups", "REGEX=AdamW"}},
      {"--optimizer.param_groups wq=Muon:lr=fast", {"optimizer.param_groups", "sets lr"}},
      {"--optimizer.param_groups wq=Muon:lr=0.01 --optimizer.muon_lr 0",
       {"optimizer.param_groups", "optimizer.muon_lr = 0"}},
      // (kSmall sets muon_lr: the first Muon key found is named)
      {"--optimizer.name AdamW --optimizer.muon_ns_steps 3",
       {"optimizer.muon_lr is set but optimizer.name = \"AdamW\""}},
  };
  for (auto& c : cases) {
    INFO(c.args);
    auto r = train(common + c.args);
    INFO(r.out);
    CHECK(r.rc == 2);
    for (auto& e : c.expect) CHECK_THAT(r.out, Contains(e));
  }
}

TEST_CASE("muon: a resumed Muon run repeats the straight run bit for bit, switching exits 2",
          "[muon][app][checkpoint]") {
  test::TempDir dir("muon-resume");
  const std::string save =
      "--checkpoint.enable --checkpoint.interval 3 --training.local_batch_size 2 "
      "--training.steps 6 ";
  auto straight = train(save + "--job.dump_folder " + dir.file("ref"));
  INFO(straight.out);
  REQUIRE(straight.rc == 0);
  auto ref = metrics(dir.file("ref"));
  REQUIRE(ref.size() == 6);
  // The checkpoint holds Muon's state (momentum_buffer) for the matrices and AdamW's for the
  // rest, and no AdamW moments for the matrices.
  auto meta = nlohmann::json::parse(
      test::read_file(dir.file("ref") + "/checkpoint/step-3/metadata.json"))["tensors"];
  CHECK(meta.contains("optimizer/momentum_buffer/layers.0.attention.wq.weight"));
  CHECK_FALSE(meta.contains("optimizer/exp_avg/layers.0.attention.wq.weight"));
  CHECK(meta.contains("optimizer/exp_avg/tok_embeddings.weight"));
  CHECK_FALSE(meta.contains("optimizer/momentum_buffer/tok_embeddings.weight"));
  auto fork = [&](const std::string& name, const std::string& extra) {
    fs::create_directories(dir.file(name) + "/checkpoint");
    fs::copy(dir.file("ref") + "/checkpoint/step-3", dir.file(name) + "/checkpoint/step-3",
             fs::copy_options::recursive);
    return train(save + "--job.dump_folder " + dir.file(name) + " " + extra);
  };
  auto r = fork("resumed", "");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  CHECK_THAT(r.out, Contains("resumed from"));
  auto res = metrics(dir.file("resumed"));
  for (int64_t s = 4; s <= 6; ++s) {
    INFO("step " << s);
    CHECK(res.at(s).first == ref.at(s).first);  // bit-equal losses
    CHECK(res.at(s).second == ref.at(s).second);
  }
  // Switching to AdamW on resume: exit 2 naming the key; allowed without the optimizer state.
  auto sw = fork("switch", "--optimizer.name AdamW --optimizer.muon_lr 0.001");
  INFO(sw.out);
  CHECK(sw.rc == 2);
  CHECK_THAT(sw.out, Contains("optimizer.name"));
  CHECK_THAT(sw.out, Contains("checkpoint.exclude_from_loading"));
  auto ok = fork("switch-ok",
                 "--optimizer.name AdamW --optimizer.muon_lr 0.001 "
                 "--checkpoint.exclude_from_loading optimizer");
  INFO(ok.out);
  CHECK(ok.rc == 0);
}

TEST_CASE("muon: the CPU capture check passes with Muon", "[muon][app][compile]") {
  test::TempDir dir("muon-compile");
  auto r = train(
      "--training.steps 6 --training.local_batch_size 2 --compile.enable "
      "--training.mixed_precision_param float32 --job.dump_folder " +
      dir.file("r"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  // The same op sequence every step with no host read: Muon's lr is a device tensor and its
  // Newton-Schulz shapes are static.
  CHECK_THAT(r.out, Contains("ops per step, static"));
  CHECK_THAT(r.out, Contains("capture check: 4 steps compared"));
  // FSDP 2: the owner plan's two all-to-alls per step keep their sizes and read nothing.
  auto r2 = torchrun_train(2,
                           "--training.steps 6 --training.local_batch_size 1 --compile.enable "
                           "--training.mixed_precision_param float32 --job.dump_folder " +
                               dir.file("r2"));
  INFO(r2.out);
  REQUIRE(r2.rc == 0);
  CHECK_THAT(r2.out, Contains("ops per step, static"));
  CHECK_THAT(r2.out, Contains("capture check: 4 steps compared"));
  auto eager = train(
      "--training.steps 6 --training.local_batch_size 2 "
      "--training.mixed_precision_param float32 --job.dump_folder " +
      dir.file("e"));
  REQUIRE(eager.rc == 0);
  auto a = metrics(dir.file("r")), b = metrics(dir.file("e"));
  REQUIRE(a.size() == 6);
  for (int64_t s = 1; s <= 6; ++s) CHECK(a.at(s).first == Approx(b.at(s).first).epsilon(1e-6));
}

TEST_CASE(
    "muon: DDP 2, FSDP 2, TP 2, PP 2, CP 2 and FSDP 2 x TP 2 equal 1 rank over 4 steps, the owner "
    "plan halves the work",
    "[muon][app][dist]") {
  const std::string common = "--training.steps 4 ";
  test::TempDir one("muon-one");
  auto r1 = train(common + "--training.local_batch_size 4 --job.dump_folder " + one.file("r"));
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto ref = metrics(one.file("r"));
  REQUIRE(ref.size() == 4);
  struct Layout {
    const char* name;
    std::string flags;
  };
  const std::vector<Layout> layouts = {
      {"ddp2",
       "--training.local_batch_size 2 --parallelism.data_parallel_replicate_degree 2 "
       "--parallelism.data_parallel_shard_degree 1"},
      {"fsdp2", "--training.local_batch_size 2"},
      // One dp rank of 4 sequences: tensor-parallel slices sent to an owner tp rank; two
      // pipeline stages each orthogonalizing their own matrices.
      {"tp2", "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2"},
      {"pp2", "--training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2"},
      // The owner plan over two levels: each matrix's FSDP rows of its tp slice go to one
      // shard rank, whose tp group sends the slices to one tp rank (4 ranks).
      {"fsdp2_tp2", "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2"},
      // Context parallelism: the cp ranks shard the parameters with FSDP (as torchtitan's
      // dp_shard_cp mesh), so the owner plan splits the matrices over them too.
      {"cp2", "--training.local_batch_size 4 --parallelism.context_parallel_degree 2"},
  };
  // The owner plan (docs/training.md): the debugmodel's 42 block matrices (6 layers x wq, wk,
  // wv, wo, w1, w2, w3), all of one shape class, so an even cost split is an even count.
  const std::regex plan(
      R"(=> muon: Newton-Schulz on \d+ of (\d+) matrices[^\n]*per rank \[([0-9, ]+)\])");
  // held: the matrices rank 0 holds a piece of (a pipeline stage: its half of the layers).
  auto per_rank = [&](const std::string& out, const std::string& held) {
    std::smatch m;
    REQUIRE(std::regex_search(out, m, plan));
    CHECK(m[1] == held);
    std::vector<int64_t> v;
    std::stringstream ss(m[2]);
    for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoll(x));
    return v;
  };
  CHECK(per_rank(r1.out, "42") == std::vector<int64_t>{42});
  // One pass over the layouts (no sections: the 1-rank reference runs once).
  for (const Layout& l : layouts) {
    INFO(l.name);
    test::TempDir dir(l.name);
    const bool four = std::string(l.name) == "fsdp2_tp2";  // 4 ranks
    auto r = torchrun_train(four ? 4 : 2, common + l.flags + " --job.dump_folder " + dir.file("r"));
    INFO(r.out);
    REQUIRE(r.rc == 0);
    // Each rank sharing the matrices orthogonalizes its part of them, not all of them: half
    // at FSDP 2 and TP 2, about a quarter at FSDP 2 x TP 2; DDP replicas and pipeline stages
    // hold whole matrices (each stage its own layers' 21).
    const std::string name = l.name;
    const std::vector<int64_t> ranks = per_rank(r.out, name == "pp2" ? "21" : "42");
    if (four) {
      REQUIRE(ranks.size() == 4);
      int64_t sum = 0;
      for (int64_t n : ranks) {
        CHECK(n >= 9);
        CHECK(n <= 12);
        sum += n;
      }
      CHECK(sum == 42);
    } else if (name == "ddp2") {
      CHECK(ranks == std::vector<int64_t>{42, 42});
    } else {
      CHECK(ranks == std::vector<int64_t>{21, 21});
    }
    auto m = metrics(dir.file("r"));
    REQUIRE(m.size() == 4);
    double worst = 0;
    for (auto& [s, v] : ref) {
      worst = std::max(worst, std::abs(m.at(s).first - v.first) / std::abs(v.first));
      worst = std::max(worst, std::abs(m.at(s).second - v.second) / std::abs(v.second));
    }
    WARN(l.name << " with Muon vs 1 rank: worst relative difference (loss, grad norm) " << worst);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("muon: deepseek_v3 with FSDP 2 x EP 2 and with ETP 2 equals 1 rank over 4 steps",
          "[muon][app][dist][ep]") {
  // Routed experts (E, A, B) are E matrices, whole on their expert-parallel rank; MLA's and
  // the router's matrices are FSDP rows sent to their owner rank. Under expert tensor
  // parallelism (tp 2 = etp 2) the experts' hidden-size slices are sent to an owner tp rank
  // as the dense matrices' slices are. Tolerance 1e-5 relative, as for AdamW's
  // expert-parallel layouts (fp32 sums in another order, then bf16 Newton-Schulz).
  const std::string model = "--training.steps 4 ", ds = "configs/deepseek_v3_debug.toml";
  test::TempDir dir("muon-ep");
  auto r1 = train(model + "--training.local_batch_size 2 --job.dump_folder " + dir.file("one"), ds);
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto ref = metrics(dir.file("one"));
  REQUIRE(ref.size() == 4);
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"ep2", "--training.local_batch_size 1 --parallelism.expert_parallel_degree 2"},
      {"etp2",
       "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2 "
       "--parallelism.expert_tensor_parallel_degree 2"},
  };
  for (auto& [name, flags] : layouts) {
    INFO(name);
    auto r2 = torchrun_train(2, model + flags + " --job.dump_folder " + dir.file(name), ds);
    INFO(r2.out);
    REQUIRE(r2.rc == 0);
    auto m = metrics(dir.file(name));
    REQUIRE(m.size() == 4);
    double worst = 0;
    for (auto& [s, v] : ref) {
      worst = std::max(worst, std::abs(m.at(s).first - v.first) / std::abs(v.first));
      worst = std::max(worst, std::abs(m.at(s).second - v.second) / std::abs(v.second));
    }
    WARN("deepseek_v3 " << name << " with Muon vs 1 rank: worst relative difference " << worst);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("muon: estimate counts one state tensor for Muon's matrices", "[muon][app][estimate]") {
  auto state = [](const std::string& args) {
    auto r = test::run("cd " + test::source_dir() + " && " + test::binary() +
                       " estimate --config configs/llama3_debug.toml --world 1 " + args);
    INFO(r.out);
    REQUIRE(r.rc == 0);
    std::smatch m;
    const std::regex re(R"((AdamW state|optimizer state)[^\n]*?\s([0-9.]+) GiB)");
    REQUIRE(std::regex_search(r.out, m, re));
    return std::stod(m[2]);
  };
  const double adamw = state("");
  // Every parameter routed to AdamW by a group entry: the same 8 bytes per element.
  const double all_adamw = state("--optimizer.name Muon --optimizer.param_groups .=AdamW");
  const double muon = state("--optimizer.name Muon");
  CHECK(all_adamw == Approx(adamw).epsilon(1e-5));
  // The block matrices (most of the debugmodel besides the embedding and head) drop from 8
  // to 4 bytes per element.
  CHECK(muon < 0.75 * adamw);
  CHECK(muon > 0.5 * adamw);
}

TEST_CASE("muon: an FSDP 2 checkpoint's momentum reshards onto 1 rank",
          "[muon][app][dist][checkpoint]") {
  // The momentum buffers are saved as sharded rows like AdamW's moments; one process resuming
  // from the 2-rank step-2 checkpoint repeats steps 3 and 4 within 1e-5 relative (the layouts
  // agree to that, see above).
  test::TempDir dir("muon-reshard");
  const std::string save = "--training.steps 4 --checkpoint.enable --checkpoint.interval 2 ";
  auto f = torchrun_train(
      2, save + "--training.local_batch_size 2 --job.dump_folder " + dir.file("fsdp"));
  INFO(f.out);
  REQUIRE(f.rc == 0);
  fs::create_directories(dir.file("one") + "/checkpoint");
  fs::copy(dir.file("fsdp") + "/checkpoint/step-2", dir.file("one") + "/checkpoint/step-2",
           fs::copy_options::recursive);
  auto o = train(save + "--training.local_batch_size 4 --job.dump_folder " + dir.file("one"));
  INFO(o.out);
  REQUIRE(o.rc == 0);
  CHECK_THAT(o.out, Contains("resumed from"));
  auto a = metrics(dir.file("fsdp")), b = metrics(dir.file("one"));
  for (int64_t s = 3; s <= 4; ++s) {
    INFO("step " << s);
    CHECK(std::abs(b.at(s).first - a.at(s).first) / std::abs(a.at(s).first) < 1e-5);
    CHECK(std::abs(b.at(s).second - a.at(s).second) / std::abs(a.at(s).second) < 1e-5);
  }
}
