// Context parallelism (parallel/context_parallel.h, core/train/context_parallel.h): the
// head-tail balancer's slices and the equal causal work it promises, the option checks (exit
// 2 naming the keys), and training through the binary: CP 2, CP 2 x FSDP 2, TP 2 x CP 2 and
// (deepseek_v3) CP 2 x EP 2 and FSDP 2 x CP 2 x EP 4 against one process on the same global
// batch (losses and gradient norms to 1e-5), and CP 2 under the capture check.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "core/train/context_parallel.h"
#include "models/layers.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

test::CmdResult titan_run(const std::string& args) {
  return test::run("cd " + test::source_dir() +
                   " && env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                   test::binary() + " " + args);
}

test::CmdResult torchrun_train(int nproc, const std::string& args) {
  return test::run("cd " + test::source_dir() + " && " + test::torchrun() +
                   " --standalone --nproc_per_node " + std::to_string(nproc) + " --no-python " +
                   test::binary() + " " + args);
}

// step -> (loss, grad_norm)
std::map<int64_t, std::pair<double, double>> metrics(const std::string& file) {
  std::map<int64_t, std::pair<double, double>> out;
  for (auto& [step, j] : test::training_metrics(file))
    out[step] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  return out;
}

}  // namespace

TEST_CASE("context parallel: head-tail slices cover the sequence once and balance causal work",
          "[cp]") {
  // Reference: the rule itself. T = 16, cp 2: 4 chunks of 4; rank 0 holds chunks 0 and 3.
  CHECK(cp_positions(16, 2, 0, CpBalancer::HeadTail) ==
        std::vector<int64_t>{0, 1, 2, 3, 12, 13, 14, 15});
  CHECK(cp_positions(16, 2, 1, CpBalancer::HeadTail) ==
        std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11});
  CHECK(cp_positions(16, 2, 1, CpBalancer::None) ==
        std::vector<int64_t>{8, 9, 10, 11, 12, 13, 14, 15});
  for (int64_t cp : {2, 4, 8}) {
    const int64_t T = 256;
    std::set<int64_t> seen;
    std::vector<int64_t> balanced, plain;
    for (int64_t r = 0; r < cp; ++r) {
      for (int64_t p : cp_positions(T, cp, r, CpBalancer::HeadTail)) CHECK(seen.insert(p).second);
      balanced.push_back(cp_causal_pairs(T, cp, r, CpBalancer::HeadTail));
      plain.push_back(cp_causal_pairs(T, cp, r, CpBalancer::None));
    }
    INFO("cp " << cp);
    CHECK(static_cast<int64_t>(seen.size()) == T);
    // Every query-key pair of the causal triangle is some rank's work, once.
    CHECK(std::accumulate(balanced.begin(), balanced.end(), int64_t{0}) == T * (T + 1) / 2);
    CHECK(std::accumulate(plain.begin(), plain.end(), int64_t{0}) == T * (T + 1) / 2);
    // Head-tail: equal on every rank. Contiguous: the last rank does the most.
    CHECK(*std::min_element(balanced.begin(), balanced.end()) ==
          *std::max_element(balanced.begin(), balanced.end()));
    CHECK(plain.back() > plain.front());
  }
  // The mask a rank applies counts exactly its causal pairs (global positions compared).
  struct NoComm : TensorParallelComm {
    int64_t r;
    explicit NoComm(int64_t rank) : r(rank) {}
    int64_t size() const override { return 2; }
    int64_t rank() const override { return r; }
    at::Tensor gather_seq(const at::Tensor& x) override { return x; }
    at::Tensor reduce_scatter_seq(const at::Tensor& x) override { return x; }
    void allreduce(at::Tensor&, bool) override {}
    at::Tensor gather_last(const at::Tensor& x) override { return x; }
  };
  for (int64_t r = 0; r < 2; ++r) {
    ContextParallel cp(std::make_shared<NoComm>(r), CpBalancer::HeadTail);
    at::Tensor m = cp.causal_mask(32, at::kCPU);  // (T/cp, T) for T = 64
    CHECK(m.sizes().vec() == std::vector<int64_t>{32, 64});
    CHECK(m.sum().item<int64_t>() == cp_causal_pairs(64, 2, r, CpBalancer::HeadTail));
    at::Tensor toks = at::arange(64).view({1, 64});
    CHECK(at::equal(cp.shard(toks).view({-1}),
                    at::tensor(cp_positions(64, 2, r, CpBalancer::HeadTail))));
  }
}

// A cp group without peers: the "gathered" keys and values are the whole sequence's, in
// rank order, which the test hands over (cp_attention gathers the keys, then the values).
struct KeysThenValues : TensorParallelComm {
  int64_t r, n, calls = 0;
  at::Tensor k, v;  // (B, T, Hkv, D) in rank order
  KeysThenValues(int64_t rank, int64_t size) : r(rank), n(size) {}
  int64_t size() const override { return n; }
  int64_t rank() const override { return r; }
  at::Tensor gather_seq(const at::Tensor&) override { return calls++ % 2 ? v : k; }
  at::Tensor reduce_scatter_seq(const at::Tensor& x) override { return x; }
  void allreduce(at::Tensor&, bool) override {}
  at::Tensor gather_last(const at::Tensor& x) override { return x; }
};

TEST_CASE("context parallel: chunked attention computes only causal prefixes and equals SDPA",
          "[cp]") {
  // Work: a chunk of len c at global start g scores c x (g + c) pairs. Head-tail evens it
  // (c^2 (2C + 1) per rank), contiguous chunks do not, and both compute less than the
  // (T/C) x T scores of one masked attention over every gathered key.
  for (int64_t C : {2, 4}) {
    const int64_t T = 64 * C, c = T / (2 * C);
    std::vector<int64_t> ht, none;
    for (int64_t r = 0; r < C; ++r) {
      ht.push_back(cp_computed_pairs(T, C, r, CpBalancer::HeadTail));
      none.push_back(cp_computed_pairs(T, C, r, CpBalancer::None));
    }
    INFO("cp " << C);
    for (int64_t w : ht) CHECK(w == c * c * (2 * C + 1));
    CHECK(none.back() == 2 * c * T);  // the last contiguous chunk: (T/C) x T
    CHECK(none.front() == (2 * c) * (2 * c));
    CHECK(*std::max_element(ht.begin(), ht.end()) < (T / C) * T);
  }
  // Numerics (fp32, GQA): each rank's output rows equal one process's causal SDPA at the
  // rank's global positions, to 1e-5.
  at::manual_seed(3);
  const int64_t B = 2, T = 64, H = 4, Hkv = 2, D = 8, C = 2;
  at::Tensor q = at::randn({B, T, H, D}), k = at::randn({B, T, Hkv, D}),
             v = at::randn({B, T, Hkv, D});
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor ref = causal_attention(q, k, v, scale);  // (B, T, H * D)
  for (CpBalancer b : {CpBalancer::HeadTail, CpBalancer::None}) {
    std::vector<int64_t> order;
    for (int64_t r = 0; r < C; ++r)
      for (int64_t p : cp_positions(T, C, r, b)) order.push_back(p);
    const at::Tensor rank_order = at::tensor(order);
    for (int64_t r = 0; r < C; ++r) {
      auto comm = std::make_shared<KeysThenValues>(r, C);
      comm->k = k.index_select(1, rank_order);
      comm->v = v.index_select(1, rank_order);
      ContextParallel cp(comm, b);
      const at::Tensor pos = at::tensor(cp_positions(T, C, r, b));
      at::Tensor out = causal_attention(q.index_select(1, pos), k.index_select(1, pos),
                                        v.index_select(1, pos), scale, &cp);
      INFO("rank " << r << (b == CpBalancer::HeadTail ? " head-tail" : " none"));
      CHECK((out - ref.index_select(1, pos)).abs().max().item<double>() < 1e-5);
    }
  }
}

TEST_CASE("context parallel options: bad or unimplemented values exit 2 naming the key",
          "[cp][config]") {
  struct Case {
    std::string flags, text;
  };
  const std::vector<Case> cases = {
      {"--parallelism.context_parallel_load_balancer zigzag",
       "parallelism.context_parallel_load_balancer"},
      {"--parallelism.context_parallel_load_balancer ptrr",
       "parallelism.context_parallel_load_balancer = \"ptrr\" is not implemented yet"},
      {"--parallelism.context_parallel_rotate_method alltoall",
       "parallelism.context_parallel_rotate_method = \"alltoall\" is not implemented yet; "
       "allowed: allgather"},
      {"--parallelism.context_parallel_rotate_method ring",
       "parallelism.context_parallel_rotate_method"},
      {"--parallelism.context_parallel_degree 2 --training.seq_len 66",
       "training.seq_len = 66 does not split over parallelism.context_parallel_degree = 2"},
      // In a pipeline too: each micro-batch is cut as a whole batch is.
      {"--parallelism.context_parallel_degree 2 --parallelism.pipeline_parallel_degree 2 "
       "--training.seq_len 70",
       "training.seq_len = 70 does not split over parallelism.context_parallel_degree = 2 (2 x "
       "cp head-tail chunks); allowed: a multiple of 4"},
      {"--parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 "
       "--parallelism.expert_parallel_degree 4",
       "parallelism.expert_parallel_degree = 4 must divide the shard degree 2 (experts borrow "
       "ranks from data_parallel_shard_degree x context_parallel_degree)"},
  };
  for (const Case& c : cases) {
    auto r = titan_run("--config configs/llama3_debug.toml " + c.flags + " --dump-config");
    INFO(c.flags << "\n" << r.out);
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains(c.text));
    CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
  }
  auto ok = titan_run(
      "--config configs/llama3_debug.toml --parallelism.context_parallel_degree 2 "
      "--parallelism.context_parallel_load_balancer none --dump-config");
  INFO(ok.out);
  CHECK(ok.rc == 0);
  CHECK_THAT(ok.out, Contains("context_parallel_degree = 2"));
  auto pp = titan_run(
      "--config configs/llama3_debug.toml --parallelism.context_parallel_degree 2 "
      "--parallelism.pipeline_parallel_degree 2 --dump-config");
  INFO(pp.out);
  CHECK(pp.rc == 0);
}

TEST_CASE("CP 2, CP 2 x FSDP 2, TP 2 x CP 2 and CP 2 x EP match 1 rank for llama3 and deepseek_v3",
          "[cp][dist]") {
  // The same global batch of 4 sequences of 256 tokens, 4 steps. CP 2 is one dp rank (both
  // cp ranks read the same windows and run 128 tokens of each); CP 2 x FSDP 2 two dp ranks of
  // 2 sequences, the parameters sharded over all 4. Reference: one process; the logged losses
  // and gradient norms must agree to 1e-5 relative (fp32 sums in another order).
  struct Layout {
    const char* name;
    int nproc;
    std::string flags;
    const char* describes;
    bool moe_only = false;  // expert parallelism: deepseek_v3 only
  };
  const std::string cp2 = "--parallelism.context_parallel_degree 2 ";
  const std::vector<Layout> layouts = {
      {"cp2", 2, cp2 + "--training.local_batch_size 4", "dp_shard 1 x cp 2"},
      {"cp2_none", 2,
       cp2 + "--training.local_batch_size 4 --parallelism.context_parallel_load_balancer none",
       "contiguous chunks"},
      {"fsdp2xcp2", 4, cp2 + "--training.local_batch_size 2", "dp_shard 2 x cp 2"},
      // Checkpointing recomputes the K/V gather (full) or replays the block with the cp
      // attention off the op tape (op); the reference runs without checkpointing.
      {"cp2_full_ac", 2, cp2 + "--training.local_batch_size 4 --activation_checkpoint.mode full",
       "dp_shard 1 x cp 2"},
      {"cp2_op_ac", 2,
       cp2 + "--training.local_batch_size 4 --activation_checkpoint.mode selective "
             "--activation_checkpoint.selective_ac_option op",
       "dp_shard 1 x cp 2"},
      {"tp2xcp2", 4, cp2 + "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2",
       "dp_shard 1 x cp 2 x tp 2"},
      // Experts borrow from dp_shard x cp: ep 2 over the two cp ranks, ep 4 over all four.
      {"cp2xep2", 2, cp2 + "--training.local_batch_size 4 --parallelism.expert_parallel_degree 2",
       "dp_shard 1 x cp 2 (ep 2 x efsdp 1)", true},
      {"fsdp2xcp2xep4", 4,
       cp2 + "--training.local_batch_size 2 --parallelism.expert_parallel_degree 4",
       "dp_shard 2 x cp 2 (ep 4 x efsdp 1)", true},
  };
  // Plain loops, not sections: each reference run is made once.
  for (const char* model : {"llama3", "deepseek_v3"}) {
    const std::string common =
        "--config configs/llama3_debug.toml --training.seq_len 256 --metrics.log_freq 1 "
        "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
        "--training.steps 4 --debug.seed 3 --model.name " +
        std::string(model) + " ";
    test::TempDir one("cp_ref");
    auto r1 =
        titan_run(common + "--training.local_batch_size 4 --job.dump_folder " + one.path.string());
    INFO(r1.out);
    REQUIRE(r1.rc == 0);
    auto ref = metrics(one.file("metrics.jsonl"));
    REQUIRE(ref.size() == 4);
    for (const Layout& l : layouts) {
      if (l.moe_only && std::string(model) != "deepseek_v3") continue;
      test::TempDir dir(l.name);
      auto r =
          torchrun_train(l.nproc, common + l.flags + " --job.dump_folder " + dir.path.string());
      INFO(model << " " << l.name << "\n" << r.out);
      CHECK(r.rc == 0);
      CHECK_THAT(r.out, Contains(l.describes));
      CHECK_THAT(r.out, Contains("=> context parallel: cp 2"));
      auto m = metrics(dir.file("metrics.jsonl"));
      CHECK(m.size() == 4);
      if (m.size() != 4) continue;
      double loss = 0, norm = 0;
      for (auto& [step, s] : ref) {
        loss = std::max(loss, std::abs(m.at(step).first - s.first) / std::abs(s.first));
        norm = std::max(norm, std::abs(m.at(step).second - s.second) / std::abs(s.second));
      }
      WARN(model << " " << l.name << " vs 1 rank, max relative difference over 4 steps: loss "
                 << loss << ", grad norm " << norm);
      CHECK(loss < 1e-5);
      CHECK(norm < 1e-5);
    }
  }
}

TEST_CASE("CP 2 under the capture check is static, reads nothing on the host, and matches 1 rank",
          "[cp][dist][compile]") {
  // compile.enable on the CPU: the step runs eagerly in bf16 compute and its op trace is
  // compared across steps (docs/compile.md); the cp index tensors are built in the first step
  // and reused. Reference: one process under the same check; bf16 compute, so 1e-4 relative.
  const std::string common =
      "--config configs/llama3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
      "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
      "--training.steps 6 --debug.seed 3 --training.local_batch_size 4 --compile.enable true ";
  test::TempDir one("cp_cc1"), two("cp_cc2");
  auto r1 = titan_run(common + "--job.dump_folder " + one.path.string());
  INFO(r1.out);
  REQUIRE(r1.rc == 0);
  auto r2 = torchrun_train(
      2, common + "--parallelism.context_parallel_degree 2 --job.dump_folder " + two.path.string());
  INFO(r2.out);
  REQUIRE(r2.rc == 0);
  CHECK_THAT(r2.out, Contains("capture check: 4 steps compared"));
  CHECK_THAT(r2.out, Contains("ops per step, static"));
  auto a = metrics(one.file("metrics.jsonl")), b = metrics(two.file("metrics.jsonl"));
  REQUIRE(a.size() == 6);
  REQUIRE(b.size() == 6);
  double loss = 0, norm = 0;
  for (auto& [step, s] : a) {
    loss = std::max(loss, std::abs(b.at(step).first - s.first) / std::abs(s.first));
    norm = std::max(norm, std::abs(b.at(step).second - s.second) / std::abs(s.second));
  }
  WARN(
      "CP 2 vs 1 rank under the capture check (bf16 compute), max relative difference over 6 "
      "steps: loss "
      << loss << ", grad norm " << norm);
  CHECK(loss < 1e-4);
  CHECK(norm < 1e-3);
}

TEST_CASE("checkpoints cross context-parallel layouts: CP 2 x EP 2 to 1 rank and back",
          "[cp][dist][checkpoint]") {
  // deepseek_v3 (MoE: expert biases and load counts are buffers). CP folds into FSDP's shard
  // dimension, so a CP 2 x EP 2 checkpoint holds shards over the two cp ranks. Each run saves
  // at step 2; the CP run's step 2 resumes on 1 rank and 1 rank's on CP 2 x EP 2, and each
  // must reproduce steps 3-4 of the run that wrote it to 1e-5 relative.
  const std::string common =
      "--config configs/llama3_debug.toml --model.name deepseek_v3 --training.seq_len 64 "
      "--metrics.log_freq 1 --validation.enable false --metrics.enable_tensorboard false "
      "--training.device cpu --training.steps 4 --debug.seed 3 --training.local_batch_size 4 "
      "--checkpoint.enable true --checkpoint.interval 2 --checkpoint.keep_latest_k 0 ";
  const std::string cp =
      "--parallelism.context_parallel_degree 2 "
      "--parallelism.expert_parallel_degree 2 ";
  auto run = [&](bool on_cp, const test::TempDir& dir) {
    const std::string args = common + "--job.dump_folder " + dir.path.string();
    auto r = on_cp ? torchrun_train(2, args + " " + cp) : titan_run(args);
    INFO(r.out);
    REQUIRE(r.rc == 0);
    return r.out;
  };
  test::TempDir one("cp_ck1"), two("cp_ck2");
  run(false, one);
  run(true, two);
  const auto m1 = metrics(one.file("metrics.jsonl")), m2 = metrics(two.file("metrics.jsonl"));
  REQUIRE(m1.size() == 4);
  REQUIRE(m2.size() == 4);
  double worst = 0;
  for (bool to_cp : {false, true}) {
    const test::TempDir& from = to_cp ? one : two;
    const auto& expect = to_cp ? m1 : m2;
    test::TempDir to("cp_ck_resume");
    std::filesystem::create_directories(to.file("checkpoint"));
    std::filesystem::copy(from.file("checkpoint/step-2"), to.file("checkpoint/step-2"),
                          std::filesystem::copy_options::recursive);
    const std::string out = run(to_cp, to);
    CHECK_THAT(out, Contains("resumed from"));
    const auto m = metrics(to.file("metrics.jsonl"));
    CHECK_FALSE(m.count(2));
    for (int64_t step : {3, 4}) {
      REQUIRE(m.count(step));
      const auto& [l, n] = m.at(step);
      const auto& [el, en] = expect.at(step);
      worst = std::max({worst, std::abs(l - el) / std::abs(el), std::abs(n - en) / std::abs(en)});
    }
  }
  WARN("CP 2 x EP 2 <-> 1 rank resume: max relative loss / grad norm difference " << worst);
  CHECK(worst < 1e-5);
}
