// Op-level selective activation checkpointing (activation_checkpoint.selective_ac_option =
// "op", core/train/recompute.h) against no checkpointing, for the three families: the losses and
// every gradient after two accumulated micro-batches must be bitwise equal, and the tape must
// really hand back saved GEMM and attention outputs (counted by op_tape_replays()). The
// binary's llama4 and deepseek_v3 debug configs train with "op" to the same losses as "none".
#include <catch2/catch.hpp>

#include <functional>
#include <memory>

#include "core/train/functional.h"
#include "core/train/recompute.h"
#include "models/deepseek_v3.h"
#include "models/llama3.h"
#include "models/llama4.h"
#include "test_util.h"

using namespace titan;

namespace {

struct AccumRun {
  std::vector<double> losses;
  std::vector<at::Tensor> grads;
  int64_t replays = 0;
};

// Two micro-batches of (2, 32) tokens, each loss backpropagated into the same gradients.
AccumRun accumulate(Model& m, int64_t vocab, bool op) {
  if (op) m.set_op_checkpointing({});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  AccumRun r;
  const int64_t replays0 = op_tape_replays();
  for (int micro = 0; micro < 2; ++micro) {
    at::Tensor tok = at::randint(vocab, {2, 32}, gen, at::kLong);
    at::Tensor loss = token_loss_sum(m.forward(tok), tok);
    r.losses.push_back(loss.item<double>());
    loss.backward();
  }
  r.replays = op_tape_replays() - replays0;
  for (auto& p : m.params().all()) r.grads.push_back(p.value.grad().clone());
  return r;
}

void check_equal(const AccumRun& base, const AccumRun& op,
                 const std::function<std::string(size_t)>& name) {
  CHECK(base.replays == 0);
  CHECK(op.losses == base.losses);  // bitwise
  REQUIRE(op.grads.size() == base.grads.size());
  for (size_t i = 0; i < base.grads.size(); ++i) {
    INFO(name(i) << ": max |op - none| = "
                 << (op.grads[i] - base.grads[i]).abs().max().item<double>());
    CHECK(at::equal(op.grads[i], base.grads[i]));
  }
}

template <class M, class Args>
void compare(const Args& a, at::ScalarType dtype, int64_t expect_replays) {
  auto run = [&](bool op) {
    M m(a, at::kCPU);
    m.init_weights(5);
    m.set_compute_dtype(dtype);
    AccumRun r = accumulate(m, a.vocab_size, op);
    return std::make_pair(r, m.params().size());
  };
  auto [base, n] = run(false);
  auto [op, n2] = run(true);
  CHECK(op.replays == expect_replays);
  M names(a, at::kCPU);
  check_equal(base, op, [&](size_t i) { return names.params()[static_cast<int64_t>(i)].name; });
}

}  // namespace

TEST_CASE("op checkpointing: llama3 equals no checkpointing, fp32 and bf16", "[sac][llama3]") {
  Llama3Args a = llama3_flavor("debugmodel");
  a.n_layers = 3;
  // Per block 7 GEMMs, of which the 1st, 3rd, 5th and 7th are saved, plus attention:
  // 3 blocks x 2 micro-batches x 5.
  SECTION("fp32") { compare<Llama3>(a, at::kFloat, 3 * 2 * 5); }
  SECTION("bf16") { compare<Llama3>(a, at::kBFloat16, 3 * 2 * 5); }
}

TEST_CASE("op checkpointing: llama4 equals no checkpointing", "[sac][moe][llama4]") {
  Llama4Args a = llama4_flavor("debugmodel");
  a.n_layers = 3;
  a.max_seq_len = 64;
  // Dense blocks save 4 GEMMs + attention. The MoE block (layer 1) saves wq, wv and the
  // shared expert's w1 and w2 (the router is recomputed), and attention: 5 per block in both
  // cases; the MoE block also saves its routed experts' outputs (one replay, docs/moe.md).
  compare<Llama4>(a, at::kFloat, 2 * 3 * 5 + 2 * 1);
}

TEST_CASE("op checkpointing: deepseek_v3 equals no checkpointing", "[sac][moe][deepseek_v3]") {
  DeepSeekV3Args a = deepseek_v3_flavor("debugmodel");
  a.n_layers = 3;
  a.max_seq_len = 64;
  // Per block 4 attention GEMMs (wq, wkv_a, wkv_b, wo, without q_lora), then the dense
  // FFN's or the shared experts' 3: of these 7, the 1st, 3rd, 5th and 7th are saved. q and v
  // head dims differ, so PyTorch runs its math kernel and attention is recomputed. The two
  // MoE blocks (layers 1 and 2) also save their routed experts' outputs: one replay each.
  compare<DeepSeekV3>(a, at::kFloat, 2 * 3 * 4 + 2 * 2);
}

namespace {

std::map<int64_t, double> train_losses(const std::string& config, const std::string& ac) {
  test::TempDir dir("op-ac");
  auto r = test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                     test::binary() + " --config " + test::source_dir() + "/configs/" + config +
                     " --job.dump_folder " + dir.path.string() +
                     " --training.steps 6 --training.local_batch_size 2"
                     " --training.global_batch_size 4 --training.seq_len 32"
                     " --validation.enable false --metrics.log_freq 1"
                     " --metrics.enable_tensorboard false --moe.experts_backend loop " +
                     ac);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  return test::losses(dir.path.string());
}

void check_binary(const std::string& config) {
  auto none = train_losses(config, "--activation_checkpoint.mode none");
  auto op = train_losses(config,
                         "--activation_checkpoint.mode selective "
                         "--activation_checkpoint.selective_ac_option op");
  REQUIRE(none.size() == 6);
  CHECK(op == none);  // bitwise, with 2 accumulated micro-batches per step
}

}  // namespace

TEST_CASE("op checkpointing: the llama4 debug config trains with op as with none",
          "[sac][moe][llama4][cli]") {
  check_binary("llama4_debug.toml");
}

TEST_CASE("op checkpointing: the deepseek_v3 debug config trains with op as with none",
          "[sac][moe][deepseek_v3][cli]") {
  check_binary("deepseek_v3_debug.toml");
}
