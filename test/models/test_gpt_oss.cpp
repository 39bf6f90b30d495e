// GPT-OSS against torchtitan 0.2.2's own gpt_oss model code (test/reference/gpt_oss_ref.py runs
// GptOssModel on our weights, its blocks in fp32): logits and the mean next-token loss within a
// relative 1e-5, every parameter's gradient within 1e-4 of its largest entry (fp32 sums in
// another order), on a tiny model of the debug flavor's structure (4 layers: sliding windows
// on 0 and 2, 8 biased experts top 4, YaRN). The checks can fail: the same model without the
// sliding window, and without the SwiGLU clamp, gives clearly different logits. Also the
// pieces on their own: the sink softmax against an explicit formula, the YaRN tables against
// torchtitan's numbers, bad input.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "core/base/errors.h"
#include "core/checkpoint/safetensors.h"
#include "models/hf_interop.h"
#include "models/generation.h"
#include "models/gpt_oss.h"
#include "test_util.h"

using namespace titan;

namespace {

// The debug flavor's structure at toy widths: a window of 8 keys on a 24-token sequence, head
// dim 16 (YaRN's NTK range 2.0 .. 4.4 of 8 frequencies, inside (0, 7)).
GptOssArgs tiny() {
  GptOssArgs a = gpt_oss_flavor("debugmodel");
  a.dim = 64;
  a.n_layers = 4;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.head_dim = 16;
  a.vocab_size = 128;
  a.moe_inter_dim = 32;
  a.sliding_window_size = 8;
  a.max_seq_len = 24;
  return a;
}

nlohmann::json args_json(const GptOssArgs& a) {
  return {{"dim", a.dim},
          {"n_layers", a.n_layers},
          {"n_heads", a.n_heads},
          {"n_kv_heads", a.n_kv_heads},
          {"head_dim", a.head_dim},
          {"vocab_size", a.vocab_size},
          {"moe_inter_dim", a.moe_inter_dim},
          {"sliding_window_size", a.sliding_window_size},
          {"max_seq_len", a.max_seq_len},
          {"num_experts", a.moe.num_experts},
          {"top_k", a.moe.top_k}};
}

// Weights that exercise every part: norms away from 1, sinks and biases of order 1 (the init's
// are ~0.01 and would hide them), experts wide enough that the SwiGLU clamp (7) bites, random
// expert biases (the balancing state) on the routing.
void randomize(GptOss& m, uint64_t seed) {
  at::NoGradGuard ng;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto ends = [](const std::string& s, const std::string& e) {
    return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
  };
  for (auto& p : m.params().all()) {
    const std::string& n = p.name;
    if (n.find("norm") != std::string::npos)
      p.value.copy_(at::rand(p.value.sizes(), gen) + 0.5);
    else if (ends(n, "sinks") || ends(n, "bias"))
      p.value.copy_(at::randn(p.value.sizes(), gen) * 0.5);
    else if (ends(n, "experts.w1") || ends(n, "experts.w3"))
      p.value.copy_(at::randn(p.value.sizes(), gen) * 0.6);
    else if (n.find("attention.w") != std::string::npos)
      p.value.copy_(at::randn(p.value.sizes(), gen) * 0.15);
  }
  for (auto& [n, t] : m.buffers())
    if (ends(n, "expert_bias")) t.copy_(at::randn(t.sizes(), gen) * 0.05);
}

}  // namespace

TEST_CASE("gpt_oss: logits, loss and gradients equal torchtitan's gpt_oss model code",
          "[gpt_oss][torchtitan]") {
  const GptOssArgs a = tiny();
  GptOss model(a, at::kCPU);
  model.init_weights(5);
  randomize(model, 6);
  test::TempDir dir("gpt-oss-tt");
  std::vector<std::pair<std::string, at::Tensor>> w;
  for (auto& p : model.params().all()) w.emplace_back(p.name, p.value.detach().clone());
  for (auto& [n, t] : model.buffers())
    if (n.find("expert_bias") != std::string::npos) w.emplace_back(n, t.clone());
  save_safetensors(dir.file("w.safetensors"), w, {{"config", args_json(a).dump()}});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor tokens = at::randint(a.vocab_size, {2, 24}, gen, at::kLong);
  save_safetensors(dir.file("tokens.safetensors"), {{"tokens", tokens}});
  auto r = test::run(test::python() + " " + test::source_dir() + "/test/reference/gpt_oss_ref.py " +
                     dir.file("w.safetensors") + " " + dir.file("tokens.safetensors") + " " +
                     dir.file("ref.safetensors"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto ref = SafetensorsFile::open(dir.file("ref.safetensors"));

  const at::Tensor logits = model.forward(tokens);  // (B, T, V)
  const int64_t T = tokens.size(1);
  const at::Tensor loss =
      at::cross_entropy_loss(logits.narrow(1, 0, T - 1).reshape({-1, a.vocab_size}),
                             tokens.narrow(1, 1, T - 1).reshape({-1}));
  loss.backward();
  const double e_logits = test::rel_err(logits.detach(), ref.get("logits"));
  const double e_loss = std::abs(loss.item<double>() - ref.get("loss").item<double>()) /
                        ref.get("loss").item<double>();
  const double e_window = test::rel_err(logits.detach(), ref.get("logits_no_window"));
  const double e_clamp = test::rel_err(logits.detach(), ref.get("logits_no_clamp"));
  CHECK(e_logits <= 1e-5);
  CHECK(e_loss <= 1e-5);
  CHECK(e_window > 1e-3);  // the window is applied, on the layers torchtitan applies it to
  CHECK(e_clamp > 1e-3);   // and the clamp bites
  double worst = 0;
  std::string worst_name;
  int64_t compared = 0;
  for (auto& p : model.params().all()) {
    const double e = test::rel_err(p.value.grad(), ref.get("grad/" + p.name));
    INFO(p.name << " gradient relative error " << e);
    CHECK(e <= 1e-4);
    if (e > worst) worst = e, worst_name = p.name;
    ++compared;
  }
  CHECK(compared == model.params().size());
  WARN("gpt_oss vs torchtitan: logits rel err "
       << e_logits << ", loss rel err " << e_loss << ", worst of " << compared
       << " gradients rel err " << worst << " (" << worst_name << "); controls: no window "
       << e_window << ", no clamp " << e_clamp);
}

TEST_CASE("gpt_oss: the sink softmax equals its formula", "[gpt_oss]") {
  // out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink)), s over the allowed keys.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const int64_t B = 2, T = 6, H = 4, Hkv = 2, D = 8, window = 3;
  const at::Tensor q = at::randn({B, T, H, D}, gen), k = at::randn({B, T, Hkv, D}, gen);
  const at::Tensor v = at::randn({B, T, Hkv, D}, gen), sinks = at::randn({H}, gen);
  const double scale = 0.3;
  const at::Tensor got = sink_attention(q, k, v, sinks, scale, window, nullptr).view({B, T, H, D});
  double worst = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t g = h / (H / Hkv);
        at::Tensor num = at::zeros({D}, at::kDouble);
        double den = std::exp(sinks[h].item<double>());
        for (int64_t j = std::max<int64_t>(0, i - window + 1); j <= i; ++j) {
          const double e = std::exp(
              (q[b][i][h].to(at::kDouble) * k[b][j][g].to(at::kDouble)).sum().item<double>() *
              scale);
          num += e * v[b][j][g].to(at::kDouble);
          den += e;
        }
        worst = std::max(worst, test::rel_err(got[b][i][h], num / den));
      }
  WARN("sink attention vs the explicit formula: worst rel err " << worst);
  CHECK(worst <= 1e-5);
}

TEST_CASE("gpt_oss: YaRN tables are torchtitan's", "[gpt_oss]") {
  // torchtitan's precompute_rope_cache for head_dim 64, theta 150000, factor 32, alpha 1,
  // beta 32, original 4096: mscale 0.1 ln 32 + 1; frequency 0 is extrapolated (inv_freq 1),
  // the last is interpolated (theta^(-62/64) / 32).
  GptOssArgs a = gpt_oss_flavor("20b");
  a.max_seq_len = 8;
  const RopeTables r = gpt_oss_rope_tables(a, at::kCPU);
  REQUIRE(r.cos.sizes() == at::IntArrayRef({8, 32}));
  const double mscale = 0.1 * std::log(32.0) + 1.0;
  CHECK(r.cos[0][0].item<double>() == Approx(mscale).epsilon(1e-6));
  CHECK(r.sin[1][0].item<double>() == Approx(std::sin(1.0) * mscale).epsilon(1e-6));
  const double last = std::pow(150000.0, -62.0 / 64.0) / 32.0;
  CHECK(r.sin[7][31].item<double>() == Approx(std::sin(7 * last) * mscale).epsilon(1e-5));
  GptOssArgs bad = a;
  bad.head_dim = 4;  // NTK range beyond head_dim / 2 - 1
  CHECK_THROWS_AS(gpt_oss_rope_tables(bad, at::kCPU), UserError);
}

TEST_CASE("gpt_oss: parameters, flavors and bad input", "[gpt_oss]") {
  GptOss m(tiny(), at::kCPU);
  // Per layer: 2 norms, q/k/v/o with biases, the sinks, the router with its bias, and the
  // experts' three weights with their three biases.
  CHECK(m.params().size() == 2 + 1 + 4 * (2 + 8 + 1 + 2 + 6));
  CHECK(m.params()[m.params().index_of("layers.1.attention.sinks")].value.sizes() ==
        at::IntArrayRef({4}));
  CHECK(m.params()[m.params().index_of("layers.0.moe.experts.w2_bias")].value.sizes() ==
        at::IntArrayRef({8, 64}));
  CHECK(GptOss::sliding(0));
  CHECK_FALSE(GptOss::sliding(1));
  CHECK_THROWS_AS(gpt_oss_flavor("7b"), UserError);
  GptOssArgs bad = tiny();
  bad.n_kv_heads = 3;
  CHECK_THROWS_AS(GptOss(bad, at::kCPU), UserError);
}

TEST_CASE("gpt_oss: the grouped experts path equals the loop", "[gpt_oss][moe]") {
  // The grouped layout (the CPU kernel of at::_grouped_mm, what a captured step and CUDA run)
  // against the per-expert loop the torchtitan test checks: logits and every gradient within
  // 1e-5 of their largest entry (fp32, sums in another order).
  GptOssArgs a = tiny();
  GptOss loop(a, at::kCPU);
  a.moe.backend = ExpertsBackend::GroupedMM;
  GptOss grouped(a, at::kCPU);
  loop.init_weights(8);
  randomize(loop, 9);
  {
    at::NoGradGuard ng;
    for (int64_t i = 0; i < loop.params().size(); ++i)
      grouped.params()[i].value.copy_(loop.params()[i].value);
    auto lb = loop.buffers(), gb = grouped.buffers();
    for (size_t i = 0; i < lb.size(); ++i) gb[i].second.copy_(lb[i].second);
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(10);
  const at::Tensor tokens = at::randint(a.vocab_size, {2, 24}, gen, at::kLong);
  const at::Tensor l1 = loop.forward(tokens), l2 = grouped.forward(tokens);
  l1.pow(2).mean().backward();
  l2.pow(2).mean().backward();
  const double e = test::rel_err(l2.detach(), l1.detach());
  double worst = 0;
  for (int64_t i = 0; i < loop.params().size(); ++i) {
    const double g = test::rel_err(grouped.params()[i].value.grad(), loop.params()[i].value.grad());
    INFO(loop.params()[i].name << " gradient rel err " << g);
    CHECK(g <= 1e-5);
    worst = std::max(worst, g);
  }
  WARN("gpt_oss grouped experts vs loop: logits rel err " << e << ", worst gradient " << worst);
  CHECK(e <= 1e-5);
}

TEST_CASE("gpt_oss: transformers' GptOssForCausalLM gives our logits, loss and gradients",
          "[gpt_oss][hf]") {
  // Our export of the tiny model (random sinks, biases, clamp-biting experts) loaded by
  // transformers (test/reference/hf_interop_check.py, fp32, eager attention): logits and the
  // mean next-token loss within a relative 1e-5, every gradient transformers' names reach
  // within 1e-4 of its largest entry. The expert-bias buffers stay zero: transformers has no
  // place for them. Then the folder imports back to the same tensors, bit for bit.
  GptOssArgs a = tiny();
  a.max_seq_len = 24;
  GptOss model(a, at::kCPU);
  model.init_weights(11);
  randomize(model, 12);
  for (auto& [n, t] : model.buffers()) t.zero_();
  test::TempDir tmp("gpt-oss-hf");
  export_gpt_oss_hf(model, tmp.file("hf"), {});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const at::Tensor tokens = at::randint(a.vocab_size, {2, 24}, gen, at::kLong);
  save_safetensors(tmp.file("tokens.safetensors"), {{"tokens", tokens}});
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/hf_interop_check.py logits " + tmp.file("hf") + " " +
                     tmp.file("tokens.safetensors") + " " + tmp.file("out.safetensors"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto out = SafetensorsFile::open(tmp.file("out.safetensors"));
  const at::Tensor logits = model.forward(tokens);
  const int64_t T = tokens.size(1);
  const at::Tensor loss =
      at::cross_entropy_loss(logits.narrow(1, 0, T - 1).reshape({-1, a.vocab_size}),
                             tokens.narrow(1, 1, T - 1).reshape({-1}));
  loss.backward();
  const double e = test::rel_err(logits.detach(), out.get("logits"));
  const double el = std::abs(loss.item<double>() - out.get("loss").item<double>()) /
                    out.get("loss").item<double>();
  CHECK(e <= 1e-5);
  CHECK(el <= 1e-5);
  double worst = 0;
  int64_t compared = 0;
  for (const HfTensorMap& m : gpt_oss_hf_map(a)) {
    const std::string g = "grad/" + m.hf[0];
    if (!out.contains(g) || model.params().index_of(m.ours) < 0) continue;
    const double ge =
        test::rel_err(model.params()[model.params().index_of(m.ours)].value.grad(), out.get(g));
    INFO(m.ours << " gradient rel err " << ge);
    CHECK(ge <= 1e-4);
    worst = std::max(worst, ge);
    ++compared;
  }
  // The fused experts: transformers' gate_up_proj gradient (E, D, 2H), gate on the even
  // columns, against ours of w1 and w3; down_proj's against w2's, transposed.
  auto grad = [&](const std::string& n) {
    return model.params()[model.params().index_of(n)].value.grad();
  };
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".moe.experts.";
    const std::string h = "grad/model.layers." + std::to_string(l) + ".mlp.experts.";
    const at::Tensor gu = out.get(h + "gate_up_proj"), gb = out.get(h + "gate_up_proj_bias");
    for (const auto& [ours, theirs] :
         {std::pair<at::Tensor, at::Tensor>{grad(p + "w1"),
                                            gu.slice(2, 0, gu.size(2), 2).transpose(1, 2)},
          {grad(p + "w3"), gu.slice(2, 1, gu.size(2), 2).transpose(1, 2)},
          {grad(p + "w1_bias"), gb.slice(1, 0, gb.size(1), 2)},
          {grad(p + "w3_bias"), gb.slice(1, 1, gb.size(1), 2)},
          {grad(p + "w2"), out.get(h + "down_proj").transpose(1, 2)}}) {
      const double ge = test::rel_err(ours, theirs);
      INFO(p << " fused expert gradient rel err " << ge);
      CHECK(ge <= 1e-4);
      worst = std::max(worst, ge);
      ++compared;
    }
  }
  CHECK(compared == 3 + a.n_layers * (14 + 5));
  WARN("gpt_oss vs transformers GptOssForCausalLM: logits rel err "
       << e << ", loss rel err " << el << ", " << compared << " gradients, worst rel err "
       << worst);

  GptOss back(a, at::kCPU);
  back.init_weights(14);
  import_gpt_oss_hf(back, tmp.file("hf"));
  for (int64_t i = 0; i < model.params().size(); ++i) {
    INFO(model.params()[i].name);
    CHECK(back.params()[i].value.equal(model.params()[i].value));
  }
}

TEST_CASE("gpt_oss: an MXFP4 or foreign Hugging Face folder exits 2 with one line",
          "[gpt_oss][hf]") {
  // The release's experts are MXFP4 (config.json quantization_config): no dequantization yet.
  test::TempDir tmp("gpt-oss-mxfp4");
  GptOss model(tiny(), at::kCPU);
  model.init_weights(1);
  export_gpt_oss_hf(model, tmp.file("hf"), {});
  const std::string cfg_path = tmp.file("hf") + "/config.json";
  nlohmann::json cfg = nlohmann::json::parse(test::read_file(cfg_path));
  cfg["quantization_config"] = {{"quant_method", "mxfp4"}};
  test::write_file(cfg_path, cfg.dump());
  try {
    import_gpt_oss_hf(model, tmp.file("hf"));
    FAIL("no UserError");
  } catch (const UserError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("MXFP4") != std::string::npos);
  }
  auto r = test::run(test::binary() + " convert-hf --model gpt_oss --flavor debugmodel --from-hf " +
                     tmp.file("hf") + " --to-safetensors " + tmp.file("x.safetensors"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("quantization_config") != std::string::npos);
  cfg.erase("quantization_config");
  cfg["model_type"] = "qwen3";
  test::write_file(cfg_path, cfg.dump());
  CHECK_THROWS_AS(import_gpt_oss_hf(model, tmp.file("hf")), UserError);
}

TEST_CASE("gpt_oss: greedy generation with and without the KV cache equals full forwards",
          "[gpt_oss]") {
  GptOss m(tiny(), at::kCPU);
  m.init_weights(2);
  GenerateOptions o;
  o.max_new_tokens = 5;
  o.sample.temperature = 0;
  o.vocab_limit = 50;  // a tokenizer smaller than the table: ids past it are never chosen
  const std::vector<int64_t> cached = generate_tokens(m, {1, 2, 3}, o);
  o.use_cache = false;
  const std::vector<int64_t> out = generate_tokens(m, {1, 2, 3}, o);
  REQUIRE(out.size() == 5);
  CHECK(cached == out);
  // Greedy: each token is the argmax (below the limit) of a full forward of what came before.
  std::vector<int64_t> seq = {1, 2, 3};
  for (int64_t t : out) {
    at::NoGradGuard ng;
    const at::Tensor logits = m.forward(at::tensor(seq, at::kLong).view({1, -1}));
    CHECK(logits[0][logits.size(1) - 1].narrow(0, 0, 50).argmax().item<int64_t>() == t);
    seq.push_back(t);
  }
}
