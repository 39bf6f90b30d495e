// Llama-4 and DeepSeek-V3 against the independent PyTorch reference
// (test/reference/moe_ref.py), CPU fp32: logits within a relative 1e-5 and every gradient
// within a relative 1e-4 (max|ours - ref| / max|ref|). When TITAN_TORCHTITAN_PATH points at a
// torchtitan 0.2.2 install, the same comparison also runs against torchtitan's own model code
// (test/reference/torchtitan_ref.py). Also: flavor sizes, config errors, activation
// checkpointing, and end-to-end training runs of the binary.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/base/errors.h"
#include "core/checkpoint/safetensors.h"
#include "app/train_step.h"
#include "core/train/functional.h"
#include "models/deepseek_v3.h"
#include "models/registry.h"
#include "models/llama4.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

using test::rel_err;

nlohmann::json moe_json(const MoEArgs& m) {
  return {{"num_experts", m.num_experts},
          {"num_shared_experts", m.num_shared_experts},
          {"top_k", m.top_k},
          {"score_func", m.score_func == ScoreFunc::Sigmoid ? "sigmoid" : "softmax"},
          {"route_norm", m.route_norm},
          {"route_scale", m.route_scale},
          {"score_before_experts", m.score_before_experts},
          {"num_expert_groups", m.num_expert_groups},
          {"num_limited_groups", m.num_limited_groups},
          {"seq_aux_loss_coeff", m.seq_aux_loss_coeff}};
}

nlohmann::json args_json(const Llama4Args& a) {
  return {{"model", "llama4"},
          {"dim", a.dim},
          {"n_layers", a.n_layers},
          {"n_heads", a.n_heads},
          {"n_kv_heads", a.n_kv_heads},
          {"norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_factor", a.rope_scaling.factor},
          {"rope_low_freq_factor", a.rope_scaling.low_freq_factor},
          {"rope_high_freq_factor", a.rope_scaling.high_freq_factor},
          {"rope_original_max_seq_len", a.rope_scaling.original_max_seq_len},
          {"max_seq_len", a.max_seq_len},
          {"interleave_moe_layer_step", a.interleave_moe_layer_step},
          {"moe", moe_json(a.moe)}};
}

nlohmann::json args_json(const DeepSeekV3Args& a) {
  return {{"model", "deepseek_v3"},
          {"dim", a.dim},
          {"n_layers", a.n_layers},
          {"n_dense_layers", a.n_dense_layers},
          {"n_heads", a.n_heads},
          {"norm_eps", a.norm_eps},
          {"q_lora_rank", a.q_lora_rank},
          {"kv_lora_rank", a.kv_lora_rank},
          {"qk_nope_head_dim", a.qk_nope_head_dim},
          {"qk_rope_head_dim", a.qk_rope_head_dim},
          {"v_head_dim", a.v_head_dim},
          {"max_seq_len", a.max_seq_len},
          {"original_seq_len", a.original_seq_len},
          {"rope_theta", a.rope_theta},
          {"rope_factor", a.rope_factor},
          {"beta_fast", a.beta_fast},
          {"beta_slow", a.beta_slow},
          {"mscale", a.mscale},
          {"moe", moe_json(a.moe)}};
}

// Runs `model` and the reference script on the same weights and batch; checks logits,
// gradients (and the auxiliary loss when on). `bias_seed` >= 0 sets random expert biases.
template <typename M>
void run_parity(M& model, const nlohmann::json& meta, const std::string& script,
                const std::string& tag, int bias_seed = -1) {
  test::TempDir dir("moe-parity-" + tag);
  const int64_t B = 2, T = 48;
  const int64_t V = model.info().vocab_size;
  std::vector<std::pair<std::string, at::Tensor>> w;
  for (auto& p : model.params().all()) w.emplace_back(p.name, p.value.detach().clone());
  if (bias_seed >= 0) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(bias_seed));
    for (auto& [n, t] : model.buffers())
      if (n.size() > 11 && n.substr(n.size() - 11) == "expert_bias") {
        at::NoGradGuard ng;
        t.copy_(at::randn(t.sizes(), g) * 0.05);
        w.emplace_back(n, t.clone());
      }
  }
  save_safetensors(dir.file("w.safetensors"), w);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  at::Tensor tok = at::randint(V, {B, T}, gen, at::kLong);
  at::Tensor lab = at::randint(V, {B, T}, gen, at::kLong);
  save_safetensors(dir.file("batch.safetensors"), {{"tokens", tok}, {"labels", lab}},
                   {{"config", meta.dump()}});
  auto r = test::run(test::python() + " " + test::source_dir() + "/test/reference/" + script +
                     " --weights " + dir.file("w.safetensors") + " --batch " +
                     dir.file("batch.safetensors") + " --out " + dir.file("ref.safetensors"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto ref = SafetensorsFile::open(dir.file("ref.safetensors"));

  at::Tensor logits = model.forward(tok);
  at::Tensor loss = token_loss_sum(logits, lab) / static_cast<double>(B * T);
  at::Tensor aux = model.aux_loss();
  (aux.defined() ? loss + aux : loss).backward();
  const double e_logits = rel_err(logits.detach(), ref.get("logits"));
  CHECK(e_logits <= 1e-5);
  double e_aux = 0;
  if (aux.defined()) {
    e_aux = rel_err(aux.detach().reshape({1}), ref.get("aux_loss"));
    CHECK(e_aux <= 1e-5);
  }
  double worst = 0;
  std::string worst_name;
  for (auto& p : model.params().all()) {
    double e = rel_err(p.value.grad(), ref.get("grad." + p.name));
    INFO(p.name << " gradient relative error " << e);
    CHECK(e <= 1e-4);
    if (e > worst) worst = e, worst_name = p.name;
    p.value.mutable_grad() = at::Tensor();
  }
  std::ostringstream aux_note;
  if (aux.defined()) aux_note << ", aux loss rel err " << e_aux;
  WARN(tag << " vs " << script << ": logits rel err " << e_logits << ", worst gradient rel err "
           << worst << " (" << worst_name << ")" << aux_note.str());
}

// Parity against the independent reference, then against torchtitan's own model code (in
// the test venv, installed by scripts/setup.sh).
template <typename M>
void parity_both(M& model, const nlohmann::json& meta, const std::string& tag,
                 bool torchtitan_too = true, int bias_seed = -1) {
  run_parity(model, meta, "moe_ref.py", tag, bias_seed);
  if (torchtitan_too) run_parity(model, meta, "torchtitan_ref.py", tag + "-torchtitan", bias_seed);
}

Llama4Args small_llama4() {
  Llama4Args a = llama4_flavor("debugmodel");
  a.max_seq_len = 64;
  return a;
}

DeepSeekV3Args small_deepseek() {
  DeepSeekV3Args a = deepseek_v3_flavor("debugmodel");
  a.max_seq_len = 64;
  return a;
}

}  // namespace

TEST_CASE("llama4: debugmodel matches the PyTorch reference", "[moe][llama4][parity]") {
  Llama4Args a = small_llama4();
  Llama4 m(a, at::kCPU);
  m.init_weights(1234);
  parity_both(m, args_json(a), "llama4-debug");
}

TEST_CASE("deepseek_v3: debugmodel matches the PyTorch reference", "[moe][deepseek_v3][parity]") {
  DeepSeekV3Args a = small_deepseek();
  DeepSeekV3 m(a, at::kCPU);
  m.init_weights(1234);
  parity_both(m, args_json(a), "deepseek-debug");
}

TEST_CASE("deepseek_v3: q_lora YaRN group-limited sigmoid routing and aux loss match the reference",
          "[moe][deepseek_v3][parity]") {
  DeepSeekV3Args a = small_deepseek();
  a.n_layers = 3;
  a.q_lora_rank = 64;
  a.original_seq_len = 16;  // < max_seq_len: YaRN and the mscale softmax factor are on
  a.mscale = 1.0;
  a.moe.num_shared_experts = 1;
  a.moe.num_expert_groups = 4;
  a.moe.num_limited_groups = 2;
  a.moe.top_k = 3;
  a.moe.score_func = ScoreFunc::Sigmoid;
  a.moe.route_norm = true;
  a.moe.route_scale = 2.5;
  a.moe.seq_aux_loss_coeff = 0.01;
  DeepSeekV3 m(a, at::kCPU);
  m.init_weights(77);
  // torchtitan has no sequence-wise loss and zero biases: only the independent reference.
  parity_both(m, args_json(a), "deepseek-variant", /*torchtitan_too=*/false, /*bias_seed=*/5);
  a.moe.seq_aux_loss_coeff = 0;
  DeepSeekV3 m2(a, at::kCPU);
  m2.init_weights(77);
  parity_both(m2, args_json(a), "deepseek-variant-nobias");
}

TEST_CASE("llama4: GQA top-2 routing on every layer with grouped_mm matches the reference",
          "[moe][llama4][parity]") {
  Llama4Args a = small_llama4();
  a.n_layers = 2;
  a.n_kv_heads = 4;
  a.interleave_moe_layer_step = 1;
  a.moe.top_k = 2;
  a.moe.num_experts = 4;
  a.moe.backend = ExpertsBackend::GroupedMM;  // runs on CPU through at::_grouped_mm's fallback
  Llama4 m(a, at::kCPU);
  m.init_weights(9);
  parity_both(m, args_json(a), "llama4-gqa-grouped", true, /*bias_seed=*/3);
}

TEST_CASE("moe models: flavors have their published sizes", "[moe][llama4][deepseek_v3]") {
  // Built on the meta device: shapes without memory.
  auto info_of = [](auto args) {
    args.max_seq_len = 16;
    using A = decltype(args);
    if constexpr (std::is_same_v<A, Llama4Args>)
      return Llama4(args, at::kMeta).info();
    else
      return DeepSeekV3(args, at::kMeta).info();
  };
  auto billions = [](int64_t n) { return static_cast<double>(n) / 1e9; };
  struct Case {
    std::string name;
    ModelInfo info;
    double total, active;          // published, billions
    bool active_counts_embedding;  // Meta's "17B active" counts it; DeepSeek's numbers do not
  };
  // Published: Llama-4 Scout 109B total (with its vision encoder; the text model is 107.8B),
  // Maverick 400B, both 17B active; DeepSeek-V2-Lite 15.7B / 2.4B active, V2 236B / 21B,
  // V3 671B / 37B.
  std::vector<Case> cases = {
      {"llama4 17bx16e (Scout)", info_of(llama4_flavor("17bx16e")), 107.8, 17, true},
      {"llama4 17bx128e (Maverick)", info_of(llama4_flavor("17bx128e")), 400, 17, true},
      {"deepseek_v3 16B (V2-Lite)", info_of(deepseek_v3_flavor("16B")), 15.7, 2.4, false},
      {"deepseek_v3 236B (V2)", info_of(deepseek_v3_flavor("236B")), 236, 21, false},
      {"deepseek_v3 671B (V3)", info_of(deepseek_v3_flavor("671B")), 671, 37, false},
  };
  for (auto& c : cases) {
    const double total = billions(c.info.n_params);
    const double active = billions(c.info.n_active_non_embedding +
                                   (c.active_counts_embedding ? c.info.n_params_embedding : 0));
    INFO(c.name << ": " << total << "B parameters, " << active << "B active");
    CHECK(total == Approx(c.total).epsilon(0.01));
    CHECK(active == Approx(c.active).epsilon(0.03));  // published actives are rounded
  }
  Llama4Args l4 = llama4_flavor("debugmodel");
  CHECK(llama4_expert_hidden(l4) == 512);
  CHECK(llama4_expert_hidden(llama4_flavor("17bx16e")) == 8192);
  // FLOPs count only the active experts: debugmodel layers 1, 3, 5 are MoE with top-1 of 8.
  Llama4 dm(small_llama4(), at::kCPU);
  const int64_t experts_per_layer = 3 * 8 * 512 * 256;
  CHECK(dm.info().n_active_non_embedding ==
        dm.info().n_params - 2048 * 256 - 3 * (experts_per_layer - experts_per_layer / 8));
  CHECK(dm.info().attn_flops_dims == 6 * 16 * 32);
  DeepSeekV3 ds(small_deepseek(), at::kCPU);
  CHECK(ds.info().attn_flops_dims == 6 * 16 * (192 + 128));
  const int64_t ds_experts = 3 * 8 * 256 * 256;
  CHECK(ds.info().n_active_non_embedding ==
        ds.info().n_params - 2048 * 256 - 5 * (ds_experts - ds_experts * 3 / 8));
}

TEST_CASE("moe models: impossible MoE arguments and unknown flavors are user errors",
          "[moe][llama4][deepseek_v3]") {
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  DeepSeekV3Args d = small_deepseek();
  d.moe.top_k = 9;
  CHECK_THAT(message([&] { DeepSeekV3(d, at::kMeta); }),
             Contains("top_k = 9") && Contains("num_experts = 8"));
  d = small_deepseek();
  d.moe.num_expert_groups = 3;
  d.moe.num_limited_groups = 1;
  CHECK_THAT(message([&] { DeepSeekV3(d, at::kMeta); }), Contains("num_expert_groups = 3"));
  d = small_deepseek();
  d.moe.num_expert_groups = 4;
  d.moe.num_limited_groups = 6;
  CHECK_THAT(message([&] { DeepSeekV3(d, at::kMeta); }), Contains("num_limited_groups = 6"));
  Llama4Args l = small_llama4();
  l.moe.top_k = 10;
  CHECK_THAT(message([&] { Llama4(l, at::kMeta); }), Contains("top_k = 10"));
  CHECK_THAT(message([] { llama4_flavor("17bx64e"); }),
             Contains("model.flavor = \"17bx64e\"") && Contains("17bx16e"));
  CHECK_THAT(message([] { deepseek_v3_flavor("7B"); }),
             Contains("model.flavor = \"7B\"") && Contains("671B"));
  // Through the factory, with a job config.
  JobConfig cfg = default_config();
  cfg.model.name = "deepseek_v3";
  cfg.model.flavor = "debugmodel";
  cfg.training.seq_len = 32;
  cfg.moe.seq_aux_loss_coeff = 0.01;
  cfg.activation_checkpoint.mode = "full";
  CHECK_THAT(message([&] { build_model(cfg, at::kCPU); }),
             Contains("moe.seq_aux_loss_coeff") && Contains("activation_checkpoint.mode"));
  cfg.activation_checkpoint.mode = "none";
  cfg.moe.experts_backend = "grouped_mm";
  CHECK_THAT(message([&] { build_model(cfg, at::kCPU); }), Contains("moe.experts_backend"));
  cfg.moe.experts_backend = "auto";
  auto m = build_model(cfg, at::kCPU);
  CHECK(m->info().name == "deepseek_v3");
  CHECK(m->info().max_seq_len == run_max_seq_len(cfg));
}

TEST_CASE("moe models: activation checkpointing gives the same gradients", "[moe][deepseek_v3]") {
  DeepSeekV3Args a = small_deepseek();
  a.n_layers = 3;
  auto grads = [&](std::function<bool(int64_t)> policy) {
    DeepSeekV3 m(a, at::kCPU);
    m.init_weights(5);
    if (policy) m.set_recompute_policy(policy);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    at::Tensor tok = at::randint(a.vocab_size, {2, 32}, gen, at::kLong);
    token_loss_sum(m.forward(tok), tok).backward();
    std::vector<at::Tensor> g;
    for (auto& p : m.params().all()) g.push_back(p.value.grad().clone());
    for (auto* l : m.moe_layers()) {
      CHECK(l->tokens_per_expert.sum().item<double>() == 2 * 32 * 3);
      CHECK(l->pending_recomputes() == 0);
    }
    return g;
  };
  auto base = grads(nullptr);
  auto full = grads([](int64_t) { return true; });
  auto every2 = grads([](int64_t l) { return (l + 1) % 2 == 0; });
  for (size_t i = 0; i < base.size(); ++i) {
    CHECK(at::allclose(base[i], full[i], 0, 1e-6));
    CHECK(at::allclose(base[i], every2[i], 0, 1e-6));
  }
}

namespace {

struct TrainRun {
  int rc = -1;
  std::string out;
  std::map<int64_t, nlohmann::json> steps;
};

TrainRun train(const std::string& config, const std::string& extra) {
  test::TempDir dir("moe-e2e");
  TrainRun t;
  auto r = test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                     test::binary() + " --config " + test::source_dir() + "/configs/" + config +
                     " --job.dump_folder " + dir.path.string() +
                     " --training.steps 100 --training.local_batch_size 2"
                     " --training.seq_len 32 --validation.enable false --metrics.log_freq 10"
                     " --metrics.enable_tensorboard false --lr_scheduler.warmup_steps 10 " +
                     extra);
  t.rc = r.rc;
  t.out = r.out;
  t.steps = test::training_metrics(dir.file("metrics.jsonl"));
  return t;
}

void check_training(const std::string& config, const std::string& model) {
  TrainRun t = train(config, "--moe.experts_backend loop");
  INFO(t.out);
  REQUIRE(t.rc == 0);
  CHECK_THAT(t.out, Contains("MoE experts backend = loop"));
  REQUIRE(t.steps.count(1));
  REQUIRE(t.steps.count(100));
  const double first = t.steps[1]["loss"].get<double>(), last = t.steps[100]["loss"].get<double>();
  WARN(model << ": loss " << first << " at step 1, " << last << " at step 100; step-100 "
             << "max/mean load of the first MoE layer "
             << t.steps[100].value("moe/layer1/max_mean_load_ratio", -1.0));
  CHECK(last < 0.75 * first);
  CHECK(t.steps[100].contains("moe/layer1/max_mean_load_ratio"));
  CHECK(t.steps[100].contains("moe/layer1/dead_experts"));
}

}  // namespace

TEST_CASE("moe models: deepseek_v3 debugmodel trains end to end on the corpus",
          "[moe][deepseek_v3][slow]") {
  check_training("deepseek_v3_debug.toml", "deepseek_v3");
}

TEST_CASE("moe models: llama4 debugmodel trains end to end on the corpus", "[moe][llama4][slow]") {
  check_training("llama4_debug.toml", "llama4");
}

TEST_CASE("moe models: grouped_mm on the CPU is a clean user error", "[moe][cli]") {
  test::TempDir dir("moe-cli");
  for (std::string cfg : {"deepseek_v3_debug.toml", "llama4_debug.toml"}) {
    auto r = test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                       test::binary() + " --config " + test::source_dir() + "/configs/" + cfg +
                       " --job.dump_folder " + dir.file("out") +
                       " --training.steps 2 --moe.experts_backend grouped_mm --training.device cpu");
    INFO(r.out);
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains("moe.experts_backend") && Contains("grouped_mm"));
  }
}

TEST_CASE("moe models: bad experts and exchange settings are clean user errors", "[moe][cli]") {
  // Each exits 2 with one line naming the key and what is allowed.
  test::TempDir dir("moe-bad");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--moe.ep_capacity_factor 0", "moe.ep_capacity_factor"},
      {"--moe.ep_capacity_factor -1", "moe.ep_capacity_factor"},
      {"--moe.ep_exchange fast", "moe.ep_exchange"},
      {"--moe.experts_backend cutlass", "moe.experts_backend"},  // no CUDA: cannot run here
  };
  for (const auto& [flag, key] : cases) {
    if (flag.find("cutlass") != std::string::npos && at::hasCUDA()) continue;
    auto r = test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                       test::binary() + " --config " + test::source_dir() +
                       "/configs/deepseek_v3_debug.toml --job.dump_folder " + dir.file("out") +
                       " --training.steps 1 " + flag);
    INFO(flag << "\n" << r.out);
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains(key) && Contains("allowed"));
  }
}
