// Qwen3 (dense and MoE) against transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM: logits
// and loss within a relative 1e-5 on tiny random configs exported to a Hugging Face folder
// (the reference: transformers from the same venv, run by test/reference/hf_interop_check.py);
// the same folder re-saved by transformers imports back to the same tensors; convert-hf both
// ways on the debug flavor; and the checks can fail: a RoPE layout with adjacent pairs or no
// QK-norm gives clearly different logits.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "core/base/errors.h"
#include "core/checkpoint/safetensors.h"
#include "models/hf_interop.h"
#include "models/qwen3.h"
#include "test_util.h"

using namespace titan;

namespace {

// head_dim 32 while dim / n_heads is 16: the head size is independent of the width.
Qwen3Args tiny_dense(bool tie) {
  Qwen3Args a;
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.head_dim = 32;
  a.hidden_dim = 96;
  a.vocab_size = 256;
  a.max_seq_len = 64;
  a.tie_embeddings = tie;
  return a;
}

Qwen3Args tiny_moe() {
  Qwen3Args a = qwen3_flavor("debugmodel_moe");  // its routing: softmax, top-k renormalized
  const MoEArgs routing = a.moe;
  a = tiny_dense(false);
  a.moe_enabled = true;
  a.moe = routing;
  a.moe.num_experts = 8;
  a.moe.top_k = 2;
  a.moe_inter_dim = 32;
  return a;
}

// Random norm weights (all ones after init, which would hide a wrong norm) and sharper q/k
// (so a wrong RoPE layout shows in the logits).
void randomize(ParamStore& params, uint64_t seed) {
  at::NoGradGuard ng;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& p : params.all()) {
    if (p.name.find("norm") != std::string::npos)
      p.value.copy_(at::rand(p.value.sizes(), gen) + 0.5);
    if (p.name.find("attention.wq") != std::string::npos ||
        p.name.find("attention.wk") != std::string::npos)
      p.value.mul_(4.0);
  }
}

// Transformers' outputs for `hf_dir` on `tokens` (hf_interop_check.py logits).
SafetensorsFile transformers_outputs(const test::TempDir& tmp, const std::string& hf_dir,
                                     const at::Tensor& tokens, std::string* version) {
  save_safetensors(tmp.file("tokens.safetensors"), {{"tokens", tokens}});
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/hf_interop_check.py logits " + hf_dir + " " +
                     tmp.file("tokens.safetensors") + " " + tmp.file("out.safetensors"));
  INFO(r.out);
  REQUIRE(r.rc == 0);  // transformers is pinned in scripts/versions.env
  const size_t v = r.out.find("transformers ");
  *version = v == std::string::npos ? "" : r.out.substr(v, r.out.find('\n', v) - v);
  return SafetensorsFile::open(tmp.file("out.safetensors"));
}

// Our mean next-token loss over tokens (B, T): labels shifted by one, the last one ignored,
// as transformers' causal-LM loss.
double mean_loss(Qwen3& m, const at::Tensor& tokens) {
  at::Tensor labels = at::full_like(tokens, -100);
  const int64_t T = tokens.size(1);
  labels.narrow(1, 0, T - 1).copy_(tokens.narrow(1, 1, T - 1));
  at::NoGradGuard ng;
  return m.token_loss_sum(tokens, labels).item<double>() /
         static_cast<double>(tokens.size(0) * (T - 1));
}

void check_against_transformers(const std::string& tag, const Qwen3Args& a) {
  INFO(tag);
  test::TempDir tmp("qwen3-tf-" + tag);
  Qwen3 model(a, at::kCPU);
  model.init_weights(41);
  randomize(model.params(), 42);
  export_qwen3_hf(model, tmp.file("hf"), {});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(43);
  at::Tensor tokens = at::randint(a.vocab_size, {2, 40}, gen, at::kLong);
  std::string version;
  SafetensorsFile out = transformers_outputs(tmp, tmp.file("hf"), tokens, &version);
  at::Tensor ours;
  {
    at::NoGradGuard ng;
    ours = model.forward(tokens);
  }
  const double err = test::rel_err(ours, out.get("logits"));
  const double err_interleaved = test::rel_err(ours, out.get("logits_interleaved"));
  const double err_no_norm = test::rel_err(ours, out.get("logits_no_qk_norm"));
  const double loss = mean_loss(model, tokens), tf_loss = out.get("loss").item<double>();
  WARN(tag << ": logits vs transformers rel err " << err << ", loss " << loss << " vs " << tf_loss
           << " (adjacent-pairs RoPE: " << err_interleaved << ", no QK-norm: " << err_no_norm
           << "; " << version << ")");
  CHECK(err <= 1e-5);
  CHECK(std::abs(loss - tf_loss) <= 1e-5 * std::abs(tf_loss));
  CHECK(err_interleaved > 1e-3);  // the check tells the RoPE layouts apart
  CHECK(err_no_norm > 1e-3);      // and sees the QK-norm

  // The gradients of that mean loss, parameter by parameter, under transformers' names (its
  // fused experts have none: the router's and every other weight's are compared). Tolerance
  // 1e-4 relative to each gradient's largest entry (fp32 sums in another order).
  {
    at::Tensor labels = at::full_like(tokens, -100);
    const int64_t T = tokens.size(1);
    labels.narrow(1, 0, T - 1).copy_(tokens.narrow(1, 1, T - 1));
    for (auto& p : model.params().all()) p.value.mutable_grad() = at::Tensor();
    (model.token_loss_sum(tokens, labels) / static_cast<double>(tokens.size(0) * (T - 1)))
        .backward();
  }
  int64_t compared = 0;
  double worst = 0;
  for (const HfTensorMap& e : qwen3_hf_map(a)) {
    if (e.hf.size() != 1 || !out.contains("grad/" + e.hf[0])) continue;
    const Param& p = model.params()[model.params().index_of(e.ours)];
    const double g = test::rel_err(p.value.grad(), out.get("grad/" + e.hf[0]));
    INFO(e.ours << " gradient rel err " << g);
    CHECK(g <= 1e-4);
    worst = std::max(worst, g);
    ++compared;
  }
  WARN(tag << ": " << compared << " gradients vs transformers, worst rel err " << worst);
  CHECK(compared >= 2 + a.n_layers * (a.moe_enabled ? 8 : 10));

  // A folder transformers itself wrote imports back to the same tensors, bit for bit (fp32).
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/hf_interop_check.py resave " + tmp.file("hf") + " " +
                     tmp.file("resaved"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  Qwen3 back(a, at::kCPU);
  back.init_weights(44);
  import_qwen3_hf(back, tmp.file("resaved"));
  for (int64_t i = 0; i < model.params().size(); ++i) {
    INFO(model.params()[i].name);
    CHECK(back.params()[i].value.equal(model.params()[i].value));
  }
}

}  // namespace

TEST_CASE("qwen3: transformers Qwen3ForCausalLM gives our logits and loss", "[qwen3][hf]") {
  check_against_transformers("tied", tiny_dense(true));
  check_against_transformers("untied", tiny_dense(false));
}

TEST_CASE("qwen3: transformers Qwen3MoeForCausalLM gives our logits and loss", "[qwen3][hf]") {
  check_against_transformers("moe", tiny_moe());
}

TEST_CASE("qwen3: HF names and config.json", "[qwen3][hf]") {
  const Qwen3Args d = qwen3_flavor("debugmodel");
  const std::vector<HfTensorMap> m = qwen3_hf_map(d);
  validate_hf_map(m);
  Qwen3 model(d, at::kCPU);
  CHECK(m.size() == static_cast<size_t>(model.params().size()));  // every parameter, once
  bool q_norm = false, lm_head = false;
  for (auto& e : m) {
    q_norm = q_norm || e.hf[0] == "model.layers.3.self_attn.q_norm.weight";
    lm_head = lm_head || e.hf[0] == "lm_head.weight";
    CHECK(e.transform == HfTransform::kNone);
  }
  CHECK(q_norm);
  CHECK_FALSE(lm_head);  // tied
  const auto cfg = qwen3_hf_config(d, at::kBFloat16);
  CHECK(cfg["model_type"] == "qwen3");
  CHECK(cfg["head_dim"] == 128);
  CHECK(cfg["hidden_size"] == 256);
  CHECK(cfg["tie_word_embeddings"] == true);
  const Qwen3Args moe = qwen3_flavor("debugmodel_moe");
  const auto mc = qwen3_hf_config(moe, at::kFloat);
  CHECK(mc["architectures"][0] == "Qwen3MoeForCausalLM");
  CHECK(mc["num_experts"] == 64);
  CHECK(mc["num_experts_per_tok"] == 8);
  CHECK(mc["norm_topk_prob"] == true);
  int64_t split = 0;
  for (auto& e : qwen3_hf_map(moe))
    if (e.transform == HfTransform::kSplitExperts) {
      CHECK(e.hf.size() == 64);
      ++split;
    }
  CHECK(split == 3 * 8);
}

TEST_CASE("qwen3: an import checks the folder's architecture", "[qwen3][hf]") {
  test::TempDir tmp("qwen3-arch");
  Qwen3 dense(tiny_dense(true), at::kCPU);
  dense.init_weights(1);
  export_qwen3_hf(dense, tmp.file("dense"), {});
  Qwen3 moe(tiny_moe(), at::kCPU);
  try {
    import_qwen3_hf(moe, tmp.file("dense"));
    FAIL("no UserError");
  } catch (const UserError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("model_type = \"qwen3\"; allowed: \"qwen3_moe\"") !=
          std::string::npos);
  }
  Qwen3Args wide = tiny_dense(true);
  wide.head_dim = 16;
  Qwen3 other(wide, at::kCPU);
  try {
    import_qwen3_hf(other, tmp.file("dense"));
    FAIL("no UserError");
  } catch (const UserError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("head_dim") != std::string::npos);
  }
}

TEST_CASE("qwen3: convert-hf converts the debug flavor both ways", "[qwen3][hf][cli]") {
  test::TempDir tmp("qwen3-cli");
  Qwen3 src(qwen3_flavor("debugmodel"), at::kCPU);
  src.init_weights(16);
  NamedTensors w;
  for (auto& p : src.params().all()) w.emplace_back(p.name, p.value.detach());
  save_safetensors(tmp.file("w.safetensors"), w);
  const std::string bin = test::binary() + " convert-hf --model qwen3 --flavor debugmodel ";
  auto r = test::run(bin + "--from-safetensors " + tmp.file("w.safetensors") + " --to-hf " +
                     tmp.file("hf"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  // The export loads into transformers with our logits.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  at::Tensor tokens = at::randint(2048, {1, 24}, gen, at::kLong);
  std::string version;
  SafetensorsFile out = transformers_outputs(tmp, tmp.file("hf"), tokens, &version);
  at::Tensor ours;
  {
    at::NoGradGuard ng;
    ours = src.forward(tokens);
  }
  const double err = test::rel_err(ours, out.get("logits"));
  WARN("qwen3/debugmodel via convert-hf: logits vs transformers rel err " << err);
  CHECK(err <= 1e-5);
  r = test::run(bin + "--from-hf " + tmp.file("hf") + " --to-safetensors " +
                tmp.file("back.safetensors"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto back = SafetensorsFile::open(tmp.file("back.safetensors"));
  CHECK(back.entries().size() == w.size());
  for (auto& [name, t] : w) {
    INFO(name);
    CHECK(back.get(name).equal(t));
  }
  // A folder of another family: exit 2 naming model_type.
  r = test::run(test::binary() + " convert-hf --model qwen3 --flavor debugmodel_moe --from-hf " +
                tmp.file("hf") + " --to-safetensors " + tmp.file("x.safetensors"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("model_type") != std::string::npos);
}
