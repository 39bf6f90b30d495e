// 20 training steps against torchtitan 0.2.2's own trainer code (our version of its
// `loss_compare.py --assert-equal`): test/reference/torchtitan_compare.py runs torchtitan's
// model, AdamW builder, LR-schedule builder, loss and clipping on CPU in fp32, from the same
// initial weights (titan-train's seed checkpoint) and the same batches (`data-preview
// --tokens all`), and the per-step losses, gradient norms and learning rates are compared with
// titan-train's metrics.jsonl. Tolerances (issue 14): loss within 1e-5 relative, gradient
// norm within 1e-4 relative of the norm of torchtitan's gradients (accumulated in fp64), and
// within 3e-4 of the value torchtitan's clip_grad_norm_ reports, which uses torch's fp32 CPU
// vector_norm: that is itself up to ~1.3e-4 off on the output-layer gradient here. The
// learning rate within 1e-12 relative (same formula).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_util.h"

using namespace titan;
namespace fs = std::filesystem;

namespace {

struct CompareRun {
  std::string model, config;
  std::string lr;
  int64_t batch = 2, seq_len = 128, steps = 20;
  std::string flavor;      // empty: the config's (debugmodel)
  bool documents = false;  // packed short documents (block-causal flavors): EOS inside windows
};

// Both sides' settings. torchtitan decays every parameter, so titan-train is told to as well
// (optimizer.weight_decay_scope = "all"); everything else is the two programs' defaults or
// set identically on both command lines.
std::string titan_flags(const CompareRun& c, const std::string& dump) {
  std::ostringstream s;
  s << "--config configs/" << c.config << " --job.dump_folder " << dump << " --training.steps "
    << c.steps << " --training.local_batch_size " << c.batch << " --training.seq_len " << c.seq_len
    << " --training.max_norm 1.0"
    << " --optimizer.lr " << c.lr << " --optimizer.eps 1e-8 --optimizer.weight_decay 0.1"
    << " --optimizer.weight_decay_scope all"
    << " --lr_scheduler.warmup_steps 2 --lr_scheduler.decay_ratio 0.8"
    << " --lr_scheduler.decay_type linear --lr_scheduler.min_lr_factor 0.0"
    << " --metrics.log_freq 1 --metrics.enable_tensorboard false --validation.enable false"
    << " --activation_checkpoint.mode none --debug.seed 0"
    << " --checkpoint.enable true --checkpoint.folder ckpt --checkpoint.interval 1000"
    << " --checkpoint.last_save_model_only true --checkpoint.export_dtype float32";
  if (!c.flavor.empty()) s << " --model.flavor " << c.flavor;
  if (c.documents) s << " --training.dataset_path " << test::short_documents_file();
  return s.str();
}

std::string reference_flags(const CompareRun& c) {
  std::ostringstream s;
  s << " --model " << c.model << " --steps " << c.steps << " --local_batch_size " << c.batch
    << " --seq_len " << c.seq_len << " --max_norm 1.0 --lr " << c.lr
    << " --eps 1e-8 --weight_decay 0.1"
    << " --warmup_steps 2 --decay_ratio 0.8 --decay_type linear --min_lr_factor 0.0"
    << " --load_balance_coeff 1e-3";
  if (!c.flavor.empty()) s << " --flavor " << c.flavor;
  return s.str();
}

test::CmdResult run_titan(const std::string& args) {
  return test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() +
                   " " + args);
}

std::string tail(const std::string& s) {
  return s.substr(s.size() > 4000 ? s.size() - 4000 : 0);
}

double rel(double ours, double ref) {
  return std::abs(ours - ref) / std::max(std::abs(ref), 1e-30);
}

void compare_with_torchtitan(const CompareRun& c) {
  test::TempDir dir("ttcompare-" + c.model);
  const std::string dump = dir.file("run");
  const std::string flags = titan_flags(c, dump);

  // 1. The initial weights: torchtitan's seed-checkpoint flow, step-0 in the run's folder.
  auto seed = run_titan(flags + " --checkpoint.create_seed_checkpoint true");
  INFO(tail(seed.out));
  REQUIRE(seed.rc == 0);
  const std::string weights = dump + "/ckpt/step-0/rank-00000.safetensors";
  REQUIRE(fs::exists(weights));

  // 2. The batches the run will read, whole windows (seq_len + 1 ids each).
  // In a subshell, so that the blend table on stderr stays out of the JSON lines.
  auto prev = test::run("(cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                        test::binary() + " data-preview " + flags + " --steps " +
                        std::to_string(c.steps) + " --tokens all > " + dir.file("batches.jsonl") +
                        " 2> " + dir.file("preview.log") + ")");
  INFO(tail(prev.out));
  REQUIRE(prev.rc == 0);

  // 3. titan-train resumes from the seed (model only) and trains.
  auto train = run_titan(flags);
  INFO(tail(train.out));
  REQUIRE(train.rc == 0);
  CHECK(train.out.find("step-0") != std::string::npos);  // it started from the seed
  auto ours = test::training_metrics(dump + "/metrics.jsonl");
  REQUIRE(static_cast<int64_t>(ours.size()) == c.steps);

  // Block-causal flavors: torchtitan builds its masks from the EOS id our log names, and the
  // batches must hold EOS inside their windows, or the masks would equal causal ones.
  std::string eos_flag;
  if (c.documents) {
    const std::string tag = "documents end at EOS ";
    const size_t at = train.out.find(tag);
    REQUIRE(at != std::string::npos);
    const int64_t eos = std::atoll(train.out.c_str() + at + tag.size());
    eos_flag = " --eos_id " + std::to_string(eos);
    int64_t inside = 0;
    std::istringstream rows(test::read_file(dir.file("batches.jsonl")));
    for (std::string line; std::getline(rows, line);) {
      if (line.empty()) continue;
      auto toks = nlohmann::json::parse(line)["tokens"];
      for (size_t i = 0; i + 2 < toks.size(); ++i) inside += toks[i].get<int64_t>() == eos;
    }
    INFO("EOS " << eos << " inside the windows: " << inside);
    CHECK(inside >= c.steps * c.batch);  // ~2 per 128-token window of ~60-token documents
  }

  // 4. torchtitan on the same weights and batches.
  auto ref = test::run(test::python() + " " + test::source_dir() +
                       "/test/reference/torchtitan_compare.py --weights " + weights +
                       " --batches " + dir.file("batches.jsonl") + " --out " +
                       dir.file("ref.jsonl") + reference_flags(c) + eos_flag);
  INFO(tail(ref.out));
  REQUIRE(ref.rc == 0);
  auto theirs = test::training_metrics(dir.file("ref.jsonl"));
  REQUIRE(static_cast<int64_t>(theirs.size()) == c.steps);

  double worst_loss = 0, worst_norm = 0, worst_own = 0, worst_lr = 0;
  for (int64_t s = 1; s <= c.steps; ++s) {
    const auto &a = ours[s], &b = theirs[s];
    const double el = rel(a["loss"].get<double>(), b["loss"].get<double>());
    const double en = rel(a["grad_norm"].get<double>(), b["grad_norm_fp64"].get<double>());
    const double eo = rel(a["grad_norm"].get<double>(), b["grad_norm"].get<double>());
    const double er = rel(a["lr"].get<double>(), b["lr"].get<double>());
    INFO("step " << s << ": loss " << a["loss"] << " vs " << b["loss"] << ", grad_norm "
                 << a["grad_norm"] << " vs " << b["grad_norm_fp64"] << " (torchtitan's fp32 "
                 << b["grad_norm"] << "), lr " << a["lr"] << " vs " << b["lr"]);
    CHECK(el <= 1e-5);
    CHECK(en <= 1e-4);
    CHECK(eo <= 3e-4);
    CHECK(er <= 1e-12);
    worst_loss = std::max(worst_loss, el);
    worst_norm = std::max(worst_norm, en);
    worst_own = std::max(worst_own, eo);
    worst_lr = std::max(worst_lr, er);
  }
  // The loss must move, or equal curves would prove little.
  CHECK(ours[c.steps]["loss"].get<double>() < ours[1]["loss"].get<double>() - 0.1);
  WARN(c.model << (c.flavor.empty() ? "" : " " + c.flavor) << " vs torchtitan 0.2.2, " << c.steps
               << " steps of " << c.batch << "x" << c.seq_len << " tokens: worst loss rel err "
               << worst_loss << ", worst grad_norm rel err " << worst_norm << " (" << worst_own
               << " against torchtitan's fp32 norm), worst lr rel err " << worst_lr
               << "; step 1 loss " << ours[1]["loss"] << ", step " << c.steps << " loss "
               << ours[c.steps]["loss"]);
}

}  // namespace

TEST_CASE("torchtitan compare: llama3 debugmodel, 20 steps equal torchtitan 0.2.2's",
          "[train][torchtitan][slow]") {
  compare_with_torchtitan({"llama3", "llama3_debug.toml", "8e-4"});  // torchtitan's debug lr
}

TEST_CASE("torchtitan compare: deepseek_v3 debugmodel, 20 steps equal torchtitan 0.2.2's",
          "[train][torchtitan][moe][slow]") {
  // At 8e-4 these 256-token batches give gradient spikes (norms 4 to 316) where torchtitan
  // disagrees with itself: fused against foreach AdamW, its losses are 6e-5 apart at step 17
  // and the routing then drifts. At 3e-4, with shard-local init, spikes at steps 15 and 19 still
  // put the grad norms 2.3e-4 apart (losses 2e-7); at 1e-4 the run is smooth (docs/training.md).
  compare_with_torchtitan({"deepseek_v3", "deepseek_v3_debug.toml", "1e-4"});
}

TEST_CASE("torchtitan compare: qwen3 debugmodel, 20 steps equal torchtitan 0.2.2's",
          "[train][torchtitan][qwen3][slow]") {
  // At the debug config's 8e-4 the losses agree to 7.4e-7 over the 20 steps, but at the steps
  // after gradient spikes (10 and 19) the grad norms are up to 1.4e-3 apart, while every
  // gradient of the model equals transformers' to 9e-7 (test_qwen3.cpp): the deepseek_v3
  // case below. At 1e-4: losses 1.4e-7, grad norms 6.9e-7 (measured on this CPU).
  compare_with_torchtitan({"qwen3", "qwen3_debug.toml", "1e-4"});
}

TEST_CASE(
    "torchtitan compare: llama3 debugmodel_flex_attn (block_causal), 20 steps equal "
    "torchtitan 0.2.2's",
    "[train][torchtitan][attention][slow]") {
  // torchtitan's masks (its document and causal mask_mods over its get_attention_masks) on
  // packed ~60-token documents; flex_attention's kernel is SDPA with their dense mask on the
  // CPU (torchtitan_compare.py says why). Same tolerances as the causal comparison.
  CompareRun c{"llama3", "llama3_debug.toml", "8e-4"};
  c.flavor = "debugmodel_flex_attn";
  c.documents = true;
  compare_with_torchtitan(c);
}

TEST_CASE("torchtitan compare: gpt_oss debugmodel, 20 steps equal torchtitan 0.2.2's",
          "[train][torchtitan][gpt_oss][slow]") {
  // torchtitan's GptOssModel in fp32 (its blocks are built in bf16 there), its flex attention
  // as a dense softmax over the same mask functions (torchtitan_compare.py): the model, the
  // MoE load-balancing optimizer, the schedule and the clipping are torchtitan's.
  compare_with_torchtitan({"gpt_oss", "gpt_oss_debug.toml", "1e-4"});
}

TEST_CASE("seed checkpoint: needs checkpoint.enable and one process", "[checkpoint]") {
  test::TempDir dir("seed-errors");
  const std::string base = "--config configs/llama3_debug.toml --job.dump_folder " +
                           dir.file("run") + " --checkpoint.create_seed_checkpoint true";
  auto off = run_titan(base + " --checkpoint.enable false");
  INFO(off.out);
  CHECK(off.rc == 2);
  CHECK(off.out.find("checkpoint.create_seed_checkpoint") != std::string::npos);
  CHECK(off.out.find("checkpoint.enable = true") != std::string::npos);
  CHECK(std::count(off.out.begin(), off.out.end(), '\n') == 1);
  // Checked at launch, before any rendezvous: rank 0 of 2 exits at once.
  auto two = test::run("cd " + test::source_dir() +
                       " && env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 "
                       "MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 " +
                       test::binary() + " " + base + " --checkpoint.enable true");
  INFO(two.out);
  CHECK(two.rc == 2);
  CHECK(two.out.find("world size of 2") != std::string::npos);
  CHECK(!fs::exists(dir.file("run") + "/checkpoint"));
}
