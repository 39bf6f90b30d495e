// Generation (models/generation.h, models/kv_cache.h): greedy decoding with the KV cache equals
// the argmax continuation computed by full forwards without a cache, token for token, for
// every family; sampling with the cache equals sampling without it on the same seed; on a
// tiny random Qwen3 the greedy continuation equals transformers' greedy generate() (the
// reference: transformers from the same venv, via test/reference/hf_interop_check.py); and the
// generate subcommand's bad input exits 2 with one line.
#include <catch2/catch.hpp>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/checkpoint/safetensors.h"
#include "models/deepseek_v3.h"
#include "models/generation.h"
#include "models/hf_interop.h"
#include "models/llama3.h"
#include "models/gpt_oss.h"
#include "models/llama4.h"
#include "models/qwen3.h"
#include "test_util.h"

using namespace titan;

namespace {

// Untied unless `tie`: a random tied model mostly repeats its last token (its output rows are
// its input rows), which would make the generation tests weak.
Qwen3Args tiny_qwen3(bool moe, bool tie = false) {
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
  if (moe) {
    const MoEArgs routing = qwen3_flavor("debugmodel_moe").moe;
    a.moe_enabled = true;
    a.moe = routing;
    a.moe.num_experts = 8;
    a.moe.top_k = 2;
    a.moe_inter_dim = 32;
  }
  return a;
}

// Every family, two layers of its debug flavor (Qwen3: tiny configs, dense and MoE).
std::vector<std::pair<std::string, std::function<std::unique_ptr<Model>()>>> families() {
  return {
      {"llama3",
       [] {
         Llama3Args a = llama3_flavor("debugmodel");
         a.n_layers = 2;
         return std::make_unique<Llama3>(a, at::kCPU);
       }},
      {"llama4",
       [] {
         Llama4Args a = llama4_flavor("debugmodel");
         a.n_layers = 2;
         a.max_seq_len = 64;
         return std::make_unique<Llama4>(a, at::kCPU);
       }},
      {"deepseek_v3",
       [] {
         DeepSeekV3Args a = deepseek_v3_flavor("debugmodel");
         a.n_layers = 2;
         a.max_seq_len = 64;
         return std::make_unique<DeepSeekV3>(a, at::kCPU);
       }},
      {"qwen3", [] { return std::make_unique<Qwen3>(tiny_qwen3(false), at::kCPU); }},
      {"qwen3-tied", [] { return std::make_unique<Qwen3>(tiny_qwen3(false, true), at::kCPU); }},
      {"qwen3-moe", [] { return std::make_unique<Qwen3>(tiny_qwen3(true), at::kCPU); }},
      // A window of 4 keys on the even layer: the 19 positions run past it, so the cached
      // form must slide it too; the sinks' column in every softmax.
      {"gpt_oss",
       [] {
         GptOssArgs a = gpt_oss_flavor("debugmodel");
         a.dim = 64;
         a.n_layers = 2;
         a.n_heads = 4;
         a.n_kv_heads = 2;
         a.head_dim = 16;
         a.vocab_size = 256;
         a.moe_inter_dim = 32;
         a.sliding_window_size = 4;
         a.max_seq_len = 64;
         return std::make_unique<GptOss>(a, at::kCPU);
       }},
  };
}

std::vector<int64_t> random_prompt(int64_t vocab, int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor t = at::randint(vocab, {n}, gen, at::kLong);
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
}

}  // namespace

TEST_CASE("generate: greedy with the KV cache equals full forwards, every family", "[generate]") {
  for (auto& [name, make] : families()) {
    INFO(name);
    std::unique_ptr<Model> m = make();
    m->init_weights(5);
    const std::vector<int64_t> prompt = random_prompt(m->info().vocab_size, 7, 6);
    GenerateOptions o;
    o.max_new_tokens = 12;
    o.use_cache = true;
    const std::vector<int64_t> cached = generate_tokens(*m, prompt, o);
    o.use_cache = false;
    const std::vector<int64_t> full = generate_tokens(*m, prompt, o);
    // The reference by hand: argmax of a full forward's last row, token by token.
    std::vector<int64_t> seq = prompt, by_hand;
    {
      at::NoGradGuard ng;
      for (int i = 0; i < 12; ++i) {
        at::Tensor logits = m->forward(at::tensor(seq, at::kLong).view({1, -1}));
        by_hand.push_back(logits[0][logits.size(1) - 1].argmax().item<int64_t>());
        seq.push_back(by_hand.back());
      }
    }
    CHECK(cached.size() == 12);
    CHECK(cached == full);
    CHECK(cached == by_hand);
  }
}

TEST_CASE("generate: sampling with the cache equals sampling without it on one seed",
          "[generate]") {
  Qwen3 m(tiny_qwen3(false), at::kCPU);
  m.init_weights(8);
  const std::vector<int64_t> prompt = random_prompt(256, 5, 9);
  GenerateOptions o;
  o.max_new_tokens = 16;
  o.sample = {1.5, 100, 0.98, 123};
  const std::vector<int64_t> a = generate_tokens(m, prompt, o);
  o.use_cache = false;
  CHECK(generate_tokens(m, prompt, o) == a);
  o.use_cache = true;
  o.sample.seed = 124;
  CHECK(generate_tokens(m, prompt, o) != a);  // the seed matters (16 draws from ~100 tokens)
}

TEST_CASE("generate: sample_token's filters", "[generate]") {
  at::Tensor l = at::tensor({1.0f, 3.0f, 2.0f, 0.5f});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  CHECK(sample_token(l, {0, 0, 1.0, 0}, gen) == 1);  // greedy
  for (int i = 0; i < 50; ++i) {
    CHECK(sample_token(l, {1.0, 1, 1.0, 0}, gen) == 1);   // top-1
    CHECK(sample_token(l, {1.0, 0, 1e-6, 0}, gen) == 1);  // a tiny nucleus keeps the best
    const int64_t t = sample_token(l, {1.0, 2, 1.0, 0}, gen);
    CHECK((t == 1 || t == 2));
  }
  // p = 0.7: softmax(1, 3, 2, 0.5) = (.086, .634, .233, .052); token 1 alone is below p, so
  // tokens 1 and 2 stay.
  bool saw2 = false;
  for (int i = 0; i < 200; ++i) {
    const int64_t t = sample_token(l, {1.0, 0, 0.7, 0}, gen);
    CHECK((t == 1 || t == 2));
    saw2 = saw2 || t == 2;
  }
  CHECK(saw2);
}

TEST_CASE("generate: greedy Qwen3 equals transformers' greedy generate", "[generate][qwen3][hf]") {
  test::TempDir tmp("gen-qwen3-tf");
  for (bool moe : {false, true}) {
    INFO((moe ? "moe" : "dense"));
    Qwen3 m(tiny_qwen3(moe), at::kCPU);
    m.init_weights(moe ? 21 : 22);
    const std::string dir = tmp.file(moe ? "hf-moe" : "hf");
    export_qwen3_hf(m, dir, {});
    const std::vector<int64_t> prompt = random_prompt(256, 6, 23);
    GenerateOptions o;
    o.max_new_tokens = 16;
    const std::vector<int64_t> ours = generate_tokens(m, prompt, o);
    save_safetensors(tmp.file("prompt.safetensors"),
                     {{"tokens", at::tensor(prompt, at::kLong).view({1, -1})}});
    auto r = test::run(test::python() + " " + test::source_dir() +
                       "/test/reference/hf_interop_check.py generate " + dir + " " +
                       tmp.file("prompt.safetensors") + " 16 " + tmp.file("gen.safetensors"));
    INFO(r.out);
    REQUIRE(r.rc == 0);
    at::Tensor theirs = SafetensorsFile::open(tmp.file("gen.safetensors")).get("tokens");
    REQUIRE(theirs.size(1) == 6 + 16);
    std::vector<int64_t> tf(theirs.data_ptr<int64_t>() + 6, theirs.data_ptr<int64_t>() + 22);
    CHECK(ours == tf);
  }
}

TEST_CASE("generate: the subcommand prints a continuation and exits 2 on bad input",
          "[generate][cli]") {
  test::TempDir tmp("gen-cli");
  Qwen3 m(qwen3_flavor("debugmodel"), at::kCPU);
  m.init_weights(3);
  export_qwen3_hf(m, tmp.file("hf"), {});
  const std::string bin = test::binary() + " generate --config " + test::source_dir() +
                          "/configs/qwen3_debug.toml --model.tokenizer_path " +
                          test::tokenizer_path() + " ";
  auto r = test::run(bin + "--from-hf " + tmp.file("hf") +
                     " --prompt 'In the beginning' --max-new-tokens 6 --temperature 0");
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK(r.out.rfind("In the beginning", 0) == 0);  // the prompt, then the continuation
  CHECK(r.out.find("tokens/s") != std::string::npos);

  std::filesystem::create_directories(tmp.file("llama"));
  test::write_file(tmp.file("llama/config.json"), R"({"model_type": "llama"})");
  struct Bad {
    std::string args, says;
  };
  for (const Bad& b : std::vector<Bad>{
           {"--from-hf " + tmp.file("hf") + " --prompt hi --model.flavor 3B",
            "is not a qwen3 flavor"},
           {"--from-hf " + tmp.file("llama") + " --prompt hi", "model_type = \"llama\""},
           {"--from-hf " + tmp.file("hf") +
                " --training.seq_len 8 --validation.enable false --prompt 'In the beginning "
                "God created the heaven and the earth'",
            "allowed: fewer than the model's window of 8 tokens"},
           {"--checkpoint " + tmp.file("none") + " --prompt hi", "no such folder"},
           {"--prompt hi", "--checkpoint DIR or --from-hf DIR"},
           {"--from-hf " + tmp.file("hf") + " --prompt hi --top-p 0", "--top-p"},
       }) {
    r = test::run(bin + b.args);
    INFO(b.args << "\n" << r.out);
    CHECK(r.rc == 2);
    CHECK(r.out.find(b.says) != std::string::npos);
  }
}

TEST_CASE("generate: --checkpoint takes a checkpoint folder (its latest step) or a step folder",
          "[generate][cli]") {
  test::TempDir tmp("gen-ckpt");
  auto r =
      test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() +
                " --config configs/llama3_debug.toml --model.n_layers 2 --training.steps 2 "
                "--training.seq_len 32 --training.local_batch_size 2 --validation.enable "
                "false --metrics.enable_tensorboard false --checkpoint.enable true "
                "--checkpoint.interval 1 --job.dump_folder " +
                tmp.file("run"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const std::string bin = test::binary() + " generate --config " + test::source_dir() +
                          "/configs/llama3_debug.toml --model.n_layers 2 --prompt 'In the' "
                          "--max-new-tokens 8 --temperature 0 --checkpoint ";
  // stdout alone: the text (stderr names the step folder it loaded).
  auto gen = [&](const std::string& dir) { return test::run("(" + bin + dir + " 2>/dev/null)"); };
  auto latest = gen(tmp.file("run/checkpoint"));
  auto step2 = gen(tmp.file("run/checkpoint/step-2"));
  auto step1 = gen(tmp.file("run/checkpoint/step-1"));
  INFO(latest.out << "\n" << step2.out << "\n" << step1.out);
  REQUIRE(latest.rc == 0);
  REQUIRE(step1.rc == 0);
  CHECK(latest.out == step2.out);  // the folder means its latest step
  CHECK(latest.out.rfind("In the", 0) == 0);
  CHECK(latest.out.size() > std::string("In the\n").size());
}
