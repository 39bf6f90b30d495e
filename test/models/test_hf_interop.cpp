// Hugging Face import/export: bit-exact round trips, bf16 rounding, sharding and the index,
// the folder as the Python `safetensors` package and transformers see it (logits of
// LlamaForCausalLM equal ours within a relative 1e-5, which pins the q/k RoPE permutation;
// DeepseekV3ForCausalLM's within 1e-5 once three norm epsilons config.json cannot express are
// aligned, and within 2e-5 as transformers builds it), UserErrors for bad folders, the
// DeepSeek-V3 name map, model dispatch and the convert-hf subcommand.
#include <catch2/catch.hpp>

#include <initializer_list>
#include <optional>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "core/base/errors.h"
#include "core/checkpoint/safetensors.h"
#include "models/deepseek_v3.h"
#include "models/hf_interop.h"
#include "models/llama3.h"
#include "models/llama4.h"
#include "test_util.h"

using namespace titan;
namespace fs = std::filesystem;

namespace {

Llama3Args gqa_tied_args() {
  Llama3Args a = llama3_flavor("debugmodel");
  a.n_layers = 2;
  a.n_kv_heads = 4;
  a.tie_embeddings = true;
  a.rope_scaling.factor = 32;
  a.rope_scaling.original_max_seq_len = 16;  // small, so the scaled bands matter at T = 48
  return a;
}

// The two variants every Llama-3 test runs on.
std::vector<std::pair<std::string, Llama3Args>> variants() {
  return {{"debugmodel", llama3_flavor("debugmodel")}, {"gqa-tied", gqa_tied_args()}};
}

using test::rel_err;

nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(test::read_file(path));
}

// Every HF tensor of an exported folder, by name, from the shards the index lists.
std::map<std::string, at::Tensor> read_hf_folder(const std::string& dir) {
  std::map<std::string, at::Tensor> r;
  std::set<std::string> shards;
  const nlohmann::json index = read_json(dir + "/model.safetensors.index.json");
  for (auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  for (auto& s : shards) {
    auto f = SafetensorsFile::open(dir + "/" + s);
    for (auto& e : f.entries()) r[e.name] = f.get(e.name);
  }
  return r;
}

std::string user_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no UserError)";
}

// Rewrites one shard of `dir` with `edit` applied to its tensors, and the index to match.
void edit_shard(const std::string& dir, const std::string& tensor,
                const std::function<void(NamedTensors&)>& edit) {
  const std::string index_path = dir + "/model.safetensors.index.json";
  nlohmann::json index = read_json(index_path);
  const std::string shard = index["weight_map"][tensor].get<std::string>();
  NamedTensors t;
  {
    auto f = SafetensorsFile::open(dir + "/" + shard);
    for (auto& e : f.entries()) t.emplace_back(e.name, f.get(e.name));
  }
  edit(t);
  save_safetensors(dir + "/" + shard, t, {{"format", "pt"}});
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end();) {
    if (it.value() == shard)
      it = index["weight_map"].erase(it);
    else
      ++it;
  }
  for (auto& [name, v] : t) index["weight_map"][name] = shard;
  test::write_file(index_path, index.dump());
}

// Multiplies the weights whose names contain one of `parts` by 4: sharper attention than the
// init gives, so that a wrong RoPE layout shows clearly in the logits.
void sharpen(ParamStore& params, std::initializer_list<const char*> parts) {
  at::NoGradGuard ng;
  for (auto& p : params.all())
    for (const char* part : parts)
      if (p.name.find(part) != std::string::npos) {
        p.value.mul_(4.0);
        break;
      }
}

// What hf_interop_check.py computed with transformers for the export in `hf_dir`.
struct TransformersLogits {
  SafetensorsFile out;  // "logits" and the script's variants
  std::string version;  // "transformers X.Y.Z", as the script printed it
};

// Runs `hf_interop_check.py logits` on `hf_dir` for `tokens`; a failure of the script
// (transformers missing included) fails the test.
std::optional<TransformersLogits> transformers_logits(const test::TempDir& tmp,
                                                      const std::string& hf_dir,
                                                      const at::Tensor& tokens) {
  save_safetensors(tmp.file("tokens.safetensors"), {{"tokens", tokens}});
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/hf_interop_check.py logits " + hf_dir + " " +
                     tmp.file("tokens.safetensors") + " " + tmp.file("out.safetensors"));
  INFO(r.out);
  // transformers is pinned in scripts/versions.env and installed by scripts/setup.sh.
  REQUIRE(r.rc == 0);
  const size_t v = r.out.find("transformers ");
  return TransformersLogits{SafetensorsFile::open(tmp.file("out.safetensors")),
                            v == std::string::npos ? "" : r.out.substr(v, r.out.find('\n', v) - v)};
}

}  // namespace

TEST_CASE("hf: llama3 fp32 export and import round trip bit-exactly", "[hf]") {
  for (auto& [tag, a] : variants()) {
    INFO(tag);
    test::TempDir tmp("hf-rt-" + tag);
    Llama3 src(a, at::kCPU);
    src.init_weights(1);
    const std::string dir = tmp.file("hf");
    export_llama3_hf(src, dir, {});

    // The folder: shards, index and config, and no temp folder left behind.
    std::set<std::string> files;
    for (auto& e : fs::directory_iterator(dir)) files.insert(e.path().filename().string());
    CHECK(files.count("config.json") == 1);
    CHECK(files.count("model.safetensors.index.json") == 1);
    CHECK(files.count("model-00001-of-00001.safetensors") == 1);
    CHECK(files.size() == 3);
    CHECK_FALSE(fs::exists(dir + ".tmp-" + std::to_string(::getpid())));

    // HF names, and the q/k permutation: within head h, HF row i < hd/2 is our row 2i and
    // HF row hd/2 + i is our row 2i + 1 (real parts first, then imaginary parts).
    auto hf = read_hf_folder(dir);
    CHECK(hf.size() == src.params().all().size());
    CHECK(hf.count("lm_head.weight") == (a.tie_embeddings ? 0u : 1u));
    const int64_t hd = a.dim / a.n_heads;
    for (auto [ours, theirs, heads] :
         {std::tuple<const char*, const char*, int64_t>{
              "layers.1.attention.wq.weight", "model.layers.1.self_attn.q_proj.weight", a.n_heads},
          {"layers.1.attention.wk.weight", "model.layers.1.self_attn.k_proj.weight",
           a.n_kv_heads}}) {
      at::Tensor w = src.params()[src.params().index_of(ours)].value.detach();
      at::Tensor h = hf.at(theirs);
      REQUIRE(h.sizes() == w.sizes());
      for (int64_t head = 0; head < heads; ++head)
        for (int64_t i = 0; i < hd / 2; ++i) {
          CHECK(h[head * hd + i].equal(w[head * hd + 2 * i]));
          CHECK(h[head * hd + hd / 2 + i].equal(w[head * hd + 2 * i + 1]));
        }
    }
    CHECK(hf.at("model.layers.0.mlp.gate_proj.weight")
              .equal(src.params()[src.params().index_of("layers.0.feed_forward.w1.weight")]
                         .value.detach()));
    CHECK(hf.at("model.layers.0.mlp.up_proj.weight")
              .equal(src.params()[src.params().index_of("layers.0.feed_forward.w3.weight")]
                         .value.detach()));

    auto cfg = read_json(dir + "/config.json");
    CHECK(cfg["architectures"] == nlohmann::json::array({"LlamaForCausalLM"}));
    CHECK(cfg["model_type"] == "llama");
    CHECK(cfg["num_key_value_heads"] == a.n_kv_heads);
    CHECK(cfg["tie_word_embeddings"] == a.tie_embeddings);
    CHECK(cfg["torch_dtype"] == "float32");
    if (a.rope_scaling.factor != 1) {
      CHECK(cfg["rope_scaling"]["rope_type"] == "llama3");
      CHECK(cfg["rope_scaling"]["factor"] == a.rope_scaling.factor);
      CHECK(cfg["rope_scaling"]["original_max_position_embeddings"] ==
            a.rope_scaling.original_max_seq_len);
    } else {
      CHECK(cfg["rope_scaling"].is_null());
    }

    Llama3 dst(a, at::kCPU);
    dst.init_weights(2);
    import_llama3_hf(dst, dir);
    for (size_t i = 0; i < src.params().all().size(); ++i) {
      INFO(src.params().all()[i].name);
      CHECK(dst.params().all()[i].value.equal(src.params().all()[i].value));
    }
  }
}

TEST_CASE("hf: llama3 bf16 export imports the bf16-rounded values", "[hf]") {
  for (auto& [tag, a] : variants()) {
    INFO(tag);
    test::TempDir tmp("hf-bf16-" + tag);
    Llama3 src(a, at::kCPU);
    src.init_weights(3);
    HfExportOptions opts;
    opts.dtype = at::kBFloat16;
    export_llama3_hf(src, tmp.file("hf"), opts);
    CHECK(read_json(tmp.file("hf/config.json"))["torch_dtype"] == "bfloat16");
    for (auto& [name, t] : read_hf_folder(tmp.file("hf"))) {
      INFO(name);
      CHECK(t.scalar_type() == at::kBFloat16);
    }
    Llama3 dst(a, at::kCPU);
    dst.init_weights(4);
    import_llama3_hf(dst, tmp.file("hf"));
    for (size_t i = 0; i < src.params().all().size(); ++i) {
      INFO(src.params().all()[i].name);
      at::Tensor want = src.params().all()[i].value.detach().to(at::kBFloat16).to(at::kFloat);
      CHECK(dst.params().all()[i].value.equal(want));
    }
  }
}

TEST_CASE("hf: small max_shard_bytes gives several shards and a consistent index", "[hf]") {
  Llama3Args a = gqa_tied_args();
  test::TempDir tmp("hf-shard");
  Llama3 src(a, at::kCPU);
  src.init_weights(5);
  HfExportOptions opts;
  opts.max_shard_bytes = 300'000;  // the 2 MiB embedding gets a shard of its own
  const std::string dir = tmp.file("hf");
  export_llama3_hf(src, dir, opts);

  auto index = read_json(dir + "/model.safetensors.index.json");
  std::set<std::string> shard_files;
  for (auto& e : fs::directory_iterator(dir)) {
    std::string f = e.path().filename().string();
    if (f != "config.json" && f != "model.safetensors.index.json") shard_files.insert(f);
  }
  const size_t n = shard_files.size();
  CHECK(n > 3);
  int64_t total = 0, expected_total = 0;
  std::map<std::string, std::string> found;  // tensor -> shard holding it
  size_t k = 0;
  for (auto& f : shard_files) {
    char want[64];
    std::snprintf(want, sizeof(want), "model-%05zu-of-%05zu.safetensors", ++k, n);
    CHECK(f == want);
    auto sf = SafetensorsFile::open(dir + "/" + f);
    CHECK(sf.metadata().at("format") == "pt");
    int64_t shard_bytes = 0;
    for (auto& e : sf.entries()) {
      INFO(e.name);
      CHECK(found.emplace(e.name, f).second);  // in exactly one shard
      total += static_cast<int64_t>(e.end - e.begin);
      shard_bytes += static_cast<int64_t>(e.end - e.begin);
    }
    // Only a shard of a single tensor may exceed the limit.
    if (sf.entries().size() > 1) CHECK(shard_bytes <= opts.max_shard_bytes);
  }
  for (auto& p : src.params().all()) expected_total += p.value.numel() * 4;
  CHECK(total == expected_total);
  CHECK(index["metadata"]["total_size"] == expected_total);
  CHECK(index["weight_map"].size() == found.size());
  for (auto& [name, shard] : found) {
    INFO(name);
    CHECK(index["weight_map"][name] == shard);
  }

  Llama3 dst(a, at::kCPU);
  dst.init_weights(6);
  import_llama3_hf(dst, dir);
  for (size_t i = 0; i < src.params().all().size(); ++i)
    CHECK(dst.params().all()[i].value.equal(src.params().all()[i].value));
}

TEST_CASE("hf: a single model.safetensors imports and rotary inv_freq buffers are skipped",
          "[hf]") {
  Llama3Args a = gqa_tied_args();
  test::TempDir tmp("hf-single");
  Llama3 src(a, at::kCPU);
  src.init_weights(7);
  export_llama3_hf(src, tmp.file("hf"), {});
  const std::string dir = tmp.file("single");
  fs::create_directories(dir);
  NamedTensors t;
  for (auto& [name, v] : read_hf_folder(tmp.file("hf"))) t.emplace_back(name, v);
  t.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", at::ones({8}));
  save_safetensors(dir + "/model.safetensors", t);
  fs::copy_file(tmp.file("hf/config.json"), dir + "/config.json");
  Llama3 dst(a, at::kCPU);
  dst.init_weights(8);
  import_llama3_hf(dst, dir + "/");
  for (size_t i = 0; i < src.params().all().size(); ++i)
    CHECK(dst.params().all()[i].value.equal(src.params().all()[i].value));
}

TEST_CASE("hf: export refuses a non-empty folder and accepts an empty one", "[hf]") {
  Llama3Args a = gqa_tied_args();
  a.n_layers = 1;
  test::TempDir tmp("hf-overwrite");
  Llama3 m(a, at::kCPU);
  m.init_weights(9);
  const std::string dir = tmp.file("out");
  fs::create_directories(dir);
  export_llama3_hf(m, dir + "/", {});  // empty folder: fine
  CHECK(fs::exists(dir + "/config.json"));
  std::string msg = user_error_of([&] { export_llama3_hf(m, dir, {}); });
  INFO(msg);
  CHECK(msg.find("non-empty folder " + dir) != std::string::npos);
  std::set<std::string> left;
  for (auto& e : fs::directory_iterator(tmp.path)) left.insert(e.path().filename().string());
  CHECK(left == std::set<std::string>{"out"});  // no temp folder left behind
}

TEST_CASE("hf: the Python safetensors package reads every exported tensor", "[hf]") {
  Llama3Args a = gqa_tied_args();
  test::TempDir tmp("hf-py");
  Llama3 src(a, at::kCPU);
  src.init_weights(10);
  HfExportOptions opts;
  opts.dtype = at::kBFloat16;
  opts.max_shard_bytes = 1'000'000;
  export_llama3_hf(src, tmp.file("hf"), opts);
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/hf_interop_check.py list " + tmp.file("hf") + " " +
                     tmp.file("list.json"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto got = read_json(tmp.file("list.json"));
  auto map = llama3_hf_map(a);
  CHECK(got["tensors"].size() == map.size());
  int64_t bytes = 0;
  for (auto& m : map) {
    INFO(m.hf[0]);
    const auto& p = src.params()[src.params().index_of(m.ours)].value;
    REQUIRE(got["tensors"].contains(m.hf[0]));
    CHECK(got["tensors"][m.hf[0]]["shape"].get<std::vector<int64_t>>() == p.sizes().vec());
    CHECK(got["tensors"][m.hf[0]]["dtype"] == "torch.bfloat16");
    CHECK(got["weight_map"][m.hf[0]] == got["tensors"][m.hf[0]]["file"]);
    bytes += p.numel() * 2;
  }
  CHECK(got["total_size"] == bytes);
}

TEST_CASE("hf: transformers LlamaForCausalLM gives our logits", "[hf][transformers]") {
  for (auto& [tag, a] : variants()) {
    INFO(tag);
    test::TempDir tmp("hf-tf-" + tag);
    Llama3 model(a, at::kCPU);
    model.init_weights(11);
    sharpen(model.params(), {"attention.wq", "attention.wk"});
    export_llama3_hf(model, tmp.file("hf"), {});
    auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
    at::Tensor tokens = at::randint(a.vocab_size, {2, 48}, gen, at::kLong);
    auto tf = transformers_logits(tmp, tmp.file("hf"), tokens);
    const SafetensorsFile& out = tf->out;
    const std::string& version = tf->version;
    at::Tensor ours;
    {
      at::NoGradGuard ng;
      ours = model.forward(tokens);
    }
    const double err = rel_err(ours, out.get("logits"));
    const double err_unpermuted = rel_err(ours, out.get("logits_unpermuted"));
    WARN(tag << ": logits vs transformers rel err " << err << " (without the q/k permutation "
             << err_unpermuted << "; " << version << ")");
    CHECK(err <= 1e-5);
    CHECK(err_unpermuted > 1e-3);  // the check can tell the two RoPE layouts apart
  }
}

TEST_CASE("hf: bad folders are UserErrors naming the file tensor and shapes", "[hf]") {
  Llama3Args a = gqa_tied_args();
  a.n_layers = 1;
  test::TempDir tmp("hf-bad");
  Llama3 src(a, at::kCPU);
  src.init_weights(13);
  const std::string dir = tmp.file("hf");
  HfExportOptions opts;
  opts.max_shard_bytes = 300'000;
  export_llama3_hf(src, dir, opts);
  Llama3 dst(a, at::kCPU);
  dst.init_weights(14);
  const at::Tensor before = dst.params()[2].value.detach().clone();  // layers.0 wq
  const std::string k_name = "model.layers.0.self_attn.k_proj.weight";
  const std::string k_shard =
      read_json(dir + "/model.safetensors.index.json")["weight_map"][k_name].get<std::string>();

  SECTION("missing folder") {
    std::string msg = user_error_of([&] { import_llama3_hf(dst, tmp.file("nope")); });
    INFO(msg);
    CHECK(msg.find(tmp.file("nope")) != std::string::npos);
    CHECK(msg.find("does not exist") != std::string::npos);
  }
  SECTION("folder without weights") {
    fs::create_directories(tmp.file("empty"));
    std::string msg = user_error_of([&] { import_llama3_hf(dst, tmp.file("empty")); });
    INFO(msg);
    CHECK(msg.find("neither model.safetensors.index.json nor model.safetensors") !=
          std::string::npos);
  }
  SECTION("missing tensor") {
    edit_shard(dir, k_name, [&](NamedTensors& t) {
      t.erase(std::remove_if(t.begin(), t.end(), [&](auto& p) { return p.first == k_name; }),
              t.end());
    });
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("no tensor '" + k_name + "'") != std::string::npos);
    CHECK(msg.find("[64, 256]") != std::string::npos);
    CHECK(msg.find("layers.0.attention.wk.weight") != std::string::npos);
  }
  SECTION("index names a tensor its shard lacks") {
    nlohmann::json index = read_json(dir + "/model.safetensors.index.json");
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = k_shard;
    test::write_file(dir + "/model.safetensors.index.json", index.dump());
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("model.layers.0.mlp.ghost.weight") != std::string::npos);
    CHECK(msg.find(k_shard) != std::string::npos);
  }
  SECTION("wrong shape") {
    edit_shard(dir, k_name, [&](NamedTensors& t) {
      for (auto& p : t)
        if (p.first == k_name) p.second = at::zeros({32, 256});
    });
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("'" + k_name + "' in " + dir + "/" + k_shard) != std::string::npos);
    CHECK(msg.find("shape [32, 256]; expected [64, 256]") != std::string::npos);
  }
  SECTION("integer dtype") {
    edit_shard(dir, k_name, [&](NamedTensors& t) {
      for (auto& p : t)
        if (p.first == k_name) p.second = at::zeros({64, 256}, at::kInt);
    });
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find(k_name) != std::string::npos);
    CHECK(msg.find("I32") != std::string::npos);
  }
  SECTION("unexpected tensor") {
    edit_shard(dir, k_name, [&](NamedTensors& t) {
      t.emplace_back("model.layers.7.mlp.gate_proj.weight", at::zeros({2, 2}));
    });
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("model.layers.7.mlp.gate_proj.weight") != std::string::npos);
    CHECK(msg.find(k_shard) != std::string::npos);
  }
  SECTION("corrupt shard") {
    std::string bytes = test::read_file(dir + "/" + k_shard);
    bytes[8] = '#';  // the JSON header's opening brace
    test::write_file(dir + "/" + k_shard, bytes);
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find(dir + "/" + k_shard) != std::string::npos);
  }
  SECTION("truncated shard") {
    std::string bytes = test::read_file(dir + "/" + k_shard);
    test::write_file(dir + "/" + k_shard, bytes.substr(0, bytes.size() - 100));
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find(dir + "/" + k_shard) != std::string::npos);
  }
  SECTION("corrupt index") {
    test::write_file(dir + "/model.safetensors.index.json", "{\"weight_map\": [");
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("model.safetensors.index.json: not valid JSON") != std::string::npos);
  }
  SECTION("config.json with another head count") {
    // Same weight shapes (8 heads of 32 instead of 16 of 16), different q/k permutation.
    nlohmann::json cfg = read_json(dir + "/config.json");
    cfg["num_attention_heads"] = 8;
    test::write_file(dir + "/config.json", cfg.dump());
    std::string msg = user_error_of([&] { import_llama3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find(dir + "/config.json: num_attention_heads = 8; this model has 16") !=
          std::string::npos);
  }
  SECTION("tied model into an untied one") {
    Llama3Args untied = a;
    untied.tie_embeddings = false;
    Llama3 other(untied, at::kCPU);
    std::string msg = user_error_of([&] { import_llama3_hf(other, dir); });
    INFO(msg);
    CHECK(msg.find("no tensor 'lm_head.weight'") != std::string::npos);
  }
  // Checks run before any copy: a failed import leaves the model as it was.
  CHECK(dst.params()[2].value.equal(before));
}

TEST_CASE("hf: deepseek-v3 names map one to one in both directions", "[hf]") {
  const int64_t L = 4, dense = 1, E = 8;
  for (bool q_lora : {false, true}) {
    INFO("q_lora " << q_lora);
    auto map = deepseek_v3_hf_map(L, dense, E, q_lora);
    REQUIRE_NOTHROW(validate_hf_map(map));

    // torchtitan's names, written out here independently of the map.
    std::vector<std::string> ours = {"tok_embeddings.weight", "norm.weight", "output.weight"};
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      for (const char* n :
           {"attention_norm.weight", "ffn_norm.weight", "attention.wkv_a.weight",
            "attention.kv_norm.weight", "attention.wkv_b.weight", "attention.wo.weight"})
        ours.push_back(p + n);
      if (q_lora) {
        for (const char* n :
             {"attention.wq_a.weight", "attention.q_norm.weight", "attention.wq_b.weight"})
          ours.push_back(p + n);
      } else {
        ours.push_back(p + "attention.wq.weight");
      }
      if (l < dense) {
        for (const char* n :
             {"feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"})
          ours.push_back(p + n);
      } else {
        for (const char* n : {"moe.router.gate.weight", "moe.expert_bias", "moe.experts.w1",
                              "moe.experts.w2", "moe.experts.w3", "moe.shared_experts.w1.weight",
                              "moe.shared_experts.w2.weight", "moe.shared_experts.w3.weight"})
          ours.push_back(p + n);
      }
    }
    std::map<std::string, std::vector<std::string>> to_hf;
    std::map<std::string, std::pair<std::string, size_t>> from_hf;  // hf -> (ours, expert)
    for (auto& m : map) {
      CHECK(to_hf.emplace(m.ours, m.hf).second);
      for (size_t k = 0; k < m.hf.size(); ++k)
        CHECK(from_hf.emplace(m.hf[k], std::make_pair(m.ours, k)).second);
    }
    CHECK(to_hf.size() == ours.size());
    for (auto& n : ours) {
      INFO(n);
      REQUIRE(to_hf.count(n) == 1);
      const bool experts = n.find("moe.experts.") != std::string::npos;
      CHECK(to_hf[n].size() == (experts ? static_cast<size_t>(E) : 1u));
      for (size_t k = 0; k < to_hf[n].size(); ++k) {
        CHECK(from_hf.at(to_hf[n][k]).first == n);
        CHECK(from_hf.at(to_hf[n][k]).second == k);
      }
    }
    // Spot checks against the names in torchtitan's DeepSeekV3StateDictAdapter.
    CHECK(to_hf["layers.2.attention.wkv_a.weight"][0] ==
          "model.layers.2.self_attn.kv_a_proj_with_mqa.weight");
    CHECK(to_hf["layers.2.attention.kv_norm.weight"][0] ==
          "model.layers.2.self_attn.kv_a_layernorm.weight");
    CHECK(to_hf["layers.0.feed_forward.w3.weight"][0] == "model.layers.0.mlp.up_proj.weight");
    CHECK(to_hf["layers.3.moe.router.gate.weight"][0] == "model.layers.3.mlp.gate.weight");
    CHECK(to_hf["layers.3.moe.expert_bias"][0] ==
          "model.layers.3.mlp.gate.e_score_correction_bias");
    CHECK(to_hf["layers.1.moe.experts.w1"][5] == "model.layers.1.mlp.experts.5.gate_proj.weight");
    CHECK(to_hf["layers.1.moe.experts.w2"][0] == "model.layers.1.mlp.experts.0.down_proj.weight");
    CHECK(to_hf["layers.1.moe.experts.w3"][7] == "model.layers.1.mlp.experts.7.up_proj.weight");
    CHECK(to_hf["layers.1.moe.shared_experts.w2.weight"][0] ==
          "model.layers.1.mlp.shared_experts.down_proj.weight");
    if (q_lora) {
      CHECK(to_hf["layers.1.attention.q_norm.weight"][0] ==
            "model.layers.1.self_attn.q_a_layernorm.weight");
      CHECK(to_hf["layers.1.attention.wq_b.weight"][0] ==
            "model.layers.1.self_attn.q_b_proj.weight");
    } else {
      CHECK(to_hf["layers.1.attention.wq.weight"][0] == "model.layers.1.self_attn.q_proj.weight");
    }
    CHECK(to_hf["output.weight"][0] == "lm_head.weight");
  }
  DeepSeekV3HfLayout d;
  d.n_layers = 2;
  d.n_dense_layers = 1;
  d.n_experts = 4;
  d.shared_experts = false;
  d.expert_bias = false;
  d.tie_embeddings = true;
  for (auto& m : deepseek_v3_hf_map(d)) {
    CHECK(m.ours.find("shared_experts") == std::string::npos);
    CHECK(m.ours.find("expert_bias") == std::string::npos);
    CHECK(m.ours != "output.weight");
  }
}

TEST_CASE("hf: deepseek-v3 experts are split on export and stacked on import", "[hf]") {
  // Shapes as torchtitan's deepseek_v3 has them, tiny; the model class is not needed.
  const int64_t L = 2, E = 3, dim = 8, hidden = 6, vocab = 16;
  auto map = deepseek_v3_hf_map(L, 1, E, true);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(15);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (auto& m : map) {
    std::vector<int64_t> s = {dim, dim};
    if (m.ours == "tok_embeddings.weight" || m.ours == "output.weight") s = {vocab, dim};
    if (m.ours.find("norm") != std::string::npos) s = {dim};
    if (m.ours.find("expert_bias") != std::string::npos) s = {E};
    if (m.ours.find("router.gate") != std::string::npos) s = {E, dim};
    if (m.ours.find("experts.w1") != std::string::npos ||
        m.ours.find("experts.w3") != std::string::npos)
      s = {E, hidden, dim};
    if (m.ours.find("moe.experts.w2") != std::string::npos) s = {E, dim, hidden};
    shapes[m.ours] = s;
  }
  NamedTensors src, dst;
  for (auto& [name, s] : shapes) {
    src.emplace_back(name, at::randn(s, gen));
    dst.emplace_back(name, at::zeros(s));
  }
  test::TempDir tmp("hf-dsv3");
  export_hf(src, map, {{"model_type", "deepseek_v3"}}, tmp.file("hf"), {});
  auto hf = read_hf_folder(tmp.file("hf"));
  CHECK(hf.size() == map.size() - 3 + 3 * E);
  const at::Tensor& w2 = std::find_if(src.begin(), src.end(), [](auto& p) {
                           return p.first == "layers.1.moe.experts.w2";
                         })->second;
  CHECK(hf.at("model.layers.1.mlp.experts.2.down_proj.weight").equal(w2[2]));
  CHECK(hf.at("model.layers.1.mlp.experts.2.down_proj.weight").sizes() ==
        at::IntArrayRef({dim, hidden}));
  import_hf(dst, map, tmp.file("hf"));
  for (size_t i = 0; i < src.size(); ++i) {
    INFO(src[i].first);
    CHECK(dst[i].second.equal(src[i].second));
  }
}

TEST_CASE("hf: convert-hf subcommand converts both ways and exits 2 on user errors", "[hf][cli]") {
  test::TempDir tmp("hf-cli");
  Llama3 src(llama3_flavor("debugmodel"), at::kCPU);
  src.init_weights(16);
  NamedTensors w;
  for (auto& p : src.params().all()) w.emplace_back(p.name, p.value.detach());
  save_safetensors(tmp.file("w.safetensors"), w);
  const std::string bin = test::binary() + " convert-hf --model llama3 --flavor debugmodel ";

  auto r = test::run(bin + "--from-safetensors " + tmp.file("w.safetensors") + " --to-hf " +
                     tmp.file("hf") + " --dtype bfloat16");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  r = test::run(bin + "--from-hf " + tmp.file("hf") + " --to-safetensors " +
                tmp.file("back.safetensors"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto back = SafetensorsFile::open(tmp.file("back.safetensors"));
  CHECK(back.entries().size() == w.size());
  for (auto& [name, t] : w) {
    INFO(name);
    at::Tensor got = back.get(name);
    CHECK(got.scalar_type() == at::kFloat);
    CHECK(got.equal(t.to(at::kBFloat16).to(at::kFloat)));
  }

  struct Bad {
    std::string args, says;
  };
  for (const Bad& b : std::vector<Bad>{
           {"--from-safetensors " + tmp.file("w.safetensors") + " --to-hf " + tmp.file("hf"),
            "non-empty folder"},
           {"--from-hf " + tmp.file("nope") + " --to-safetensors " + tmp.file("x.safetensors"),
            "does not exist"},
           {"--from-safetensors " + tmp.file("w.safetensors") + " --to-hf " + tmp.file("h2") +
                " --dtype int8",
            "int8"},
           {"--from-safetensors " + tmp.file("w.safetensors"), "--to-hf"},
           {"", "--from-hf DIR --to-safetensors FILE"},
       }) {
    r = test::run(bin + b.args);
    INFO(b.args << "\n" << r.out);
    CHECK(r.rc == 2);
    CHECK(r.out.find(b.says) != std::string::npos);
  }
  r = test::run(test::binary() + " convert-hf --model llama3 --flavor 2B --from-hf " +
                tmp.file("hf") + " --to-safetensors " + tmp.file("x.safetensors"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("not a llama3 flavor") != std::string::npos);
  // A params file for another flavor: names the tensor and both shapes.
  Llama3Args small = gqa_tied_args();
  Llama3 other(small, at::kCPU);
  NamedTensors ow;
  for (auto& p : other.params().all()) ow.emplace_back(p.name, at::zeros(p.value.sizes()));
  save_safetensors(tmp.file("other.safetensors"), ow);
  r = test::run(bin + "--from-safetensors " + tmp.file("other.safetensors") + " --to-hf " +
                tmp.file("h3"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("other.safetensors") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp.file("h3")));
}

// ---- DeepSeek-V3 models -------------------------------------------------------------------------

namespace {

// Routing as DeepSeek-V3 (671B) does it, which transformers implements: sigmoid scores,
// normalized top-k weights scaled by 2.5, group-limited choice (4 groups of 2, best 2 kept).
DeepSeekV3Args ds_sigmoid_args() {
  DeepSeekV3Args a = deepseek_v3_flavor("debugmodel");
  a.n_layers = 3;  // 1 dense, 2 MoE
  a.moe.score_func = ScoreFunc::Sigmoid;
  a.moe.route_norm = true;
  a.moe.route_scale = 2.5;
  a.moe.num_expert_groups = 4;
  a.moe.num_limited_groups = 2;
  return a;
}

// q through the low-rank wq_a / q_norm / wq_b path, YaRN on (sequences longer than
// original_seq_len 4096, so the mscale 0.7 softmax factor applies too), no groups.
DeepSeekV3Args ds_qlora_yarn_args() {
  DeepSeekV3Args a = ds_sigmoid_args();
  a.moe.num_expert_groups = 0;
  a.moe.num_limited_groups = 0;
  a.q_lora_rank = 64;
  a.max_seq_len = 8192;
  return a;
}

std::vector<std::pair<std::string, DeepSeekV3Args>> ds_variants() {
  return {{"debugmodel", deepseek_v3_flavor("debugmodel")},
          {"sigmoid-groups", ds_sigmoid_args()},
          {"qlora-yarn", ds_qlora_yarn_args()}};
}

// Nonzero expert biases (as balancing leaves them), so that exporting them matters.
void set_expert_biases(DeepSeekV3& m, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard ng;
  for (MoELayer* l : m.moe_layers())
    l->expert_bias.copy_(at::randn(l->expert_bias.sizes(), gen) * 0.05);
}

const at::Tensor& param(const Model& m, const std::string& name) {
  const int64_t i = m.params().index_of(name);
  REQUIRE(i >= 0);
  return m.params()[i].value;
}

// Our tensors of a DeepSeek-V3 model and its biases, all equal (bit for bit) to another's.
void check_same_ds_tensors(const DeepSeekV3& got, const DeepSeekV3& want) {
  for (size_t i = 0; i < want.params().all().size(); ++i) {
    INFO(want.params().all()[i].name);
    CHECK(got.params().all()[i].value.equal(want.params().all()[i].value));
  }
  auto gl = got.moe_layers(), wl = want.moe_layers();
  REQUIRE(gl.size() == wl.size());
  for (size_t i = 0; i < wl.size(); ++i) {
    INFO(wl[i]->prefix() << "expert_bias");
    CHECK(gl[i]->expert_bias.equal(wl[i]->expert_bias));
  }
}

size_t hf_tensor_count(const std::vector<HfTensorMap>& map) {
  size_t n = 0;
  for (auto& m : map) n += m.hf.size();
  return n;
}

}  // namespace

TEST_CASE("hf: deepseek_v3 fp32 export and import round trip bit-exactly", "[hf]") {
  for (auto& [tag, a] : ds_variants()) {
    INFO(tag);
    test::TempDir tmp("hf-ds-rt-" + tag);
    DeepSeekV3 src(a, at::kCPU);
    src.init_weights(21);
    set_expert_biases(src, 22);
    const std::string dir = tmp.file("hf");
    export_model_hf(src, dir, {});  // the dispatching entry point

    auto hf = read_hf_folder(dir);
    const auto map = deepseek_v3_hf_map(deepseek_v3_hf_layout(a));
    CHECK(hf.size() == hf_tensor_count(map));
    const int64_t E = a.moe.num_experts;
    const size_t n_moe = src.moe_layers().size();
    CHECK(n_moe == static_cast<size_t>(a.n_layers - a.n_dense_layers));
    // Every parameter, one bias per MoE layer, and E - 1 more tensors per expert stack.
    CHECK(hf.size() == src.params().all().size() + n_moe + n_moe * 3 * static_cast<size_t>(E - 1));
    // Names and layouts: experts split along dim 0, the bias as e_score_correction_bias, and
    // the RoPE-carrying projections unpermuted.
    CHECK(hf.at("model.layers.2.mlp.gate.e_score_correction_bias")
              .equal(src.moe_layer(2)->expert_bias));
    CHECK(hf.at("model.layers.1.mlp.experts.5.gate_proj.weight")
              .equal(param(src, "layers.1.moe.experts.w1")[5]));
    CHECK(hf.at("model.layers.1.mlp.experts.7.up_proj.weight")
              .equal(param(src, "layers.1.moe.experts.w3")[7]));
    CHECK(hf.at("model.layers.2.mlp.experts.0.down_proj.weight")
              .equal(param(src, "layers.2.moe.experts.w2")[0]));
    CHECK(hf.at("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
              .equal(param(src, "layers.1.attention.wkv_a.weight")));
    const std::string q = a.q_lora_rank > 0 ? "q_b_proj" : "q_proj";
    const std::string wq = a.q_lora_rank > 0 ? "wq_b" : "wq";
    CHECK(hf.at("model.layers.0.self_attn." + q + ".weight")
              .equal(param(src, "layers.0.attention." + wq + ".weight")));
    CHECK(hf.at("model.layers.0.mlp.up_proj.weight")
              .equal(param(src, "layers.0.feed_forward.w3.weight")));

    auto cfg = read_json(dir + "/config.json");
    CHECK(cfg["architectures"] == nlohmann::json::array({"DeepseekV3ForCausalLM"}));
    CHECK(cfg["model_type"] == "deepseek_v3");
    CHECK(cfg["hidden_size"] == a.dim);
    CHECK(cfg["num_hidden_layers"] == a.n_layers);
    CHECK(cfg["first_k_dense_replace"] == a.n_dense_layers);
    CHECK(cfg["intermediate_size"] == a.inter_dim);
    CHECK(cfg["moe_intermediate_size"] == a.moe_inter_dim);
    CHECK(cfg["num_attention_heads"] == a.n_heads);
    CHECK(cfg["kv_lora_rank"] == a.kv_lora_rank);
    CHECK(cfg["qk_nope_head_dim"] == a.qk_nope_head_dim);
    CHECK(cfg["qk_rope_head_dim"] == a.qk_rope_head_dim);
    CHECK(cfg["v_head_dim"] == a.v_head_dim);
    CHECK(cfg["n_routed_experts"] == E);
    CHECK(cfg["n_shared_experts"] == a.moe.num_shared_experts);
    CHECK(cfg["num_experts_per_tok"] == a.moe.top_k);
    CHECK(cfg["norm_topk_prob"] == a.moe.route_norm);
    CHECK(cfg["routed_scaling_factor"] == a.moe.route_scale);
    CHECK(cfg["rope_interleave"] == true);
    CHECK(cfg["tie_word_embeddings"] == false);
    CHECK(cfg["torch_dtype"] == "float32");
    CHECK(cfg["scoring_func"] == (a.moe.score_func == ScoreFunc::Sigmoid ? "sigmoid" : "softmax"));
    if (a.q_lora_rank > 0)
      CHECK(cfg["q_lora_rank"] == a.q_lora_rank);
    else
      CHECK(cfg["q_lora_rank"].is_null());
    if (a.moe.num_expert_groups > 0) {
      CHECK(cfg["n_group"] == a.moe.num_expert_groups);
      CHECK(cfg["topk_group"] == a.moe.num_limited_groups);
    } else {
      CHECK(cfg["n_group"] == 1);
      CHECK(cfg["topk_group"] == 1);
    }
    if (a.max_seq_len > a.original_seq_len) {
      CHECK(cfg["rope_scaling"]["rope_type"] == "yarn");
      CHECK(cfg["rope_scaling"]["factor"] == a.rope_factor);
      CHECK(cfg["rope_scaling"]["original_max_position_embeddings"] == a.original_seq_len);
      CHECK(cfg["rope_scaling"]["mscale"] == a.mscale);
      CHECK(cfg["rope_scaling"]["mscale_all_dim"] == a.mscale);
    } else {
      CHECK(cfg["rope_scaling"].is_null());
      CHECK(cfg["max_position_embeddings"] == a.max_seq_len);
    }

    DeepSeekV3 dst(a, at::kCPU);
    dst.init_weights(23);  // biases zero
    import_model_hf(dst, dir);
    check_same_ds_tensors(dst, src);
  }
}

TEST_CASE("hf: deepseek_v3 bf16 export keeps the expert bias in fp32", "[hf]") {
  DeepSeekV3Args a = ds_sigmoid_args();
  test::TempDir tmp("hf-ds-bf16");
  DeepSeekV3 src(a, at::kCPU);
  src.init_weights(24);
  set_expert_biases(src, 25);
  HfExportOptions opts;
  opts.dtype = at::kBFloat16;
  export_deepseek_v3_hf(src, tmp.file("hf"), opts);
  CHECK(read_json(tmp.file("hf/config.json"))["torch_dtype"] == "bfloat16");
  for (auto& [name, t] : read_hf_folder(tmp.file("hf"))) {
    INFO(name);
    const bool bias = name.find("e_score_correction_bias") != std::string::npos;
    CHECK(t.scalar_type() == (bias ? at::kFloat : at::kBFloat16));
  }
  DeepSeekV3 dst(a, at::kCPU);
  dst.init_weights(26);
  import_deepseek_v3_hf(dst, tmp.file("hf"));
  for (size_t i = 0; i < src.params().all().size(); ++i) {
    INFO(src.params().all()[i].name);
    at::Tensor want = src.params().all()[i].value.detach().to(at::kBFloat16).to(at::kFloat);
    CHECK(dst.params().all()[i].value.equal(want));
  }
  for (int64_t l : {1, 2})
    CHECK(dst.moe_layer(l)->expert_bias.equal(src.moe_layer(l)->expert_bias));
}

TEST_CASE("hf: the Python safetensors package reads a deepseek_v3 export", "[hf]") {
  DeepSeekV3Args a = deepseek_v3_flavor("debugmodel");
  test::TempDir tmp("hf-ds-py");
  DeepSeekV3 src(a, at::kCPU);
  src.init_weights(27);
  set_expert_biases(src, 28);
  HfExportOptions opts;
  opts.dtype = at::kBFloat16;
  opts.max_shard_bytes = 1'000'000;
  export_deepseek_v3_hf(src, tmp.file("hf"), opts);
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/hf_interop_check.py list " + tmp.file("hf") + " " +
                     tmp.file("list.json"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto got = read_json(tmp.file("list.json"));
  const auto map = deepseek_v3_hf_map(deepseek_v3_hf_layout(a));
  CHECK(got["tensors"].size() == hf_tensor_count(map));
  std::set<std::string> files;
  int64_t bytes = 0;
  std::map<std::string, at::Tensor> ours;
  for (auto& [name, t] : deepseek_v3_hf_tensors(src)) ours[name] = t;
  for (auto& m : map) {
    const at::Tensor& t = ours.at(m.ours);
    for (size_t k = 0; k < m.hf.size(); ++k) {
      INFO(m.hf[k]);
      REQUIRE(got["tensors"].contains(m.hf[k]));
      const auto& g = got["tensors"][m.hf[k]];
      std::vector<int64_t> shape = t.sizes().vec();
      if (m.transform == HfTransform::kSplitExperts) shape.erase(shape.begin());
      CHECK(g["shape"].get<std::vector<int64_t>>() == shape);
      CHECK(g["dtype"] == (m.keep_fp32 ? "torch.float32" : "torch.bfloat16"));
      CHECK(got["weight_map"][m.hf[k]] == g["file"]);
      files.insert(g["file"].get<std::string>());
      bytes += t.numel() / static_cast<int64_t>(m.hf.size()) * (m.keep_fp32 ? 4 : 2);
    }
  }
  CHECK(files.size() > 1);
  CHECK(got["total_size"] == bytes);
}

TEST_CASE("hf: transformers DeepseekV3ForCausalLM gives our logits", "[hf][transformers]") {
  for (auto& [tag, a] : std::vector<std::pair<std::string, DeepSeekV3Args>>{
           {"sigmoid-groups", ds_sigmoid_args()}, {"qlora-yarn", ds_qlora_yarn_args()}}) {
    INFO(tag);
    test::TempDir tmp("hf-ds-tf-" + tag);
    DeepSeekV3 model(a, at::kCPU);
    model.init_weights(29);
    set_expert_biases(model, 30);
    sharpen(model.params(), {"attention.wq", "attention.wkv_a"});
    export_deepseek_v3_hf(model, tmp.file("hf"), {});
    auto gen = at::make_generator<at::CPUGeneratorImpl>(31);
    at::Tensor tokens = at::randint(a.vocab_size, {2, 48}, gen, at::kLong);
    auto tf = transformers_logits(tmp, tmp.file("hf"), tokens);
    const SafetensorsFile& out = tf->out;
    const std::string& version = tf->version;
    at::Tensor ours;
    {
      at::NoGradGuard ng;
      ours = model.forward(tokens);
    }
    const double err = rel_err(ours, out.get("logits_eps_aligned"));
    const double err_stock = rel_err(ours, out.get("logits"));
    const double err_rope_half = rel_err(ours, out.get("logits_rope_half"));
    const double err_no_bias = rel_err(ours, out.get("logits_no_bias"));
    WARN(tag << ": logits vs transformers rel err " << err << " with our norm epsilons, "
             << err_stock << " as transformers builds the model (rope_interleave off: "
             << err_rope_half << ", expert bias zeroed: " << err_no_bias << "; " << version << ")");
    // The same function of the same weights once the three RMSNorm epsilons agree (see
    // hf_interop_check.py): measured 3.5e-7 and 3.9e-7 (transformers 5.24, CPU). As
    // transformers builds it, with kv_a_layernorm / q_a_layernorm at eps 1e-6 instead of our
    // 1e-5 and the final norm at 1e-5 instead of fp32's 1.2e-7: 5.2e-6 and 6.0e-6.
    CHECK(err <= 1e-5);
    CHECK(err_stock <= 2e-5);
    CHECK(err_rope_half > 1e-3);  // the check can tell the two RoPE layouts apart
    CHECK(err_no_bias > 1e-3);    // and sees the expert bias

    // A folder transformers itself wrote (its config.json has rope_parameters, no
    // scoring_func) imports back to the same tensors.
    auto r = test::run(test::python() + " " + test::source_dir() +
                       "/test/reference/hf_interop_check.py resave " + tmp.file("hf") + " " +
                       tmp.file("resaved"));
    INFO(r.out);
    REQUIRE(r.rc == 0);
    DeepSeekV3 back(a, at::kCPU);
    back.init_weights(37);
    import_deepseek_v3_hf(back, tmp.file("resaved"));
    check_same_ds_tensors(back, model);
  }
}

TEST_CASE("hf: bad deepseek_v3 folders are UserErrors naming the file and tensor", "[hf]") {
  DeepSeekV3Args a = ds_sigmoid_args();
  test::TempDir tmp("hf-ds-bad");
  DeepSeekV3 src(a, at::kCPU);
  src.init_weights(32);
  const std::string dir = tmp.file("hf");
  export_deepseek_v3_hf(src, dir, {});
  DeepSeekV3 dst(a, at::kCPU);
  dst.init_weights(33);
  const at::Tensor before = dst.params()[0].value.detach().clone();
  const std::string bias = "model.layers.1.mlp.gate.e_score_correction_bias";

  SECTION("config.json with another head count") {
    nlohmann::json cfg = read_json(dir + "/config.json");
    cfg["num_attention_heads"] = 8;
    test::write_file(dir + "/config.json", cfg.dump());
    std::string msg = user_error_of([&] { import_deepseek_v3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find(dir + "/config.json: num_attention_heads = 8; this model has 16") !=
          std::string::npos);
  }
  SECTION("config.json with another rope head dim") {
    nlohmann::json cfg = read_json(dir + "/config.json");
    cfg["qk_rope_head_dim"] = 32;
    cfg["qk_nope_head_dim"] = 160;  // same q_proj rows
    test::write_file(dir + "/config.json", cfg.dump());
    std::string msg = user_error_of([&] { import_model_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("qk_nope_head_dim = 160; this model has 128") != std::string::npos);
  }
  SECTION("rope_interleave false") {
    nlohmann::json cfg = read_json(dir + "/config.json");
    cfg["rope_interleave"] = false;
    test::write_file(dir + "/config.json", cfg.dump());
    std::string msg = user_error_of([&] { import_deepseek_v3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("rope_interleave = false") != std::string::npos);
    CHECK(msg.find("allowed: true") != std::string::npos);
  }
  SECTION("missing expert bias") {
    edit_shard(dir, bias, [&](NamedTensors& t) {
      t.erase(std::remove_if(t.begin(), t.end(), [&](auto& p) { return p.first == bias; }),
              t.end());
    });
    std::string msg = user_error_of([&] { import_deepseek_v3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("no tensor '" + bias + "' (shape [8], our layers.1.moe.expert_bias)") !=
          std::string::npos);
  }
  SECTION("an expert of the wrong shape") {
    const std::string e = "model.layers.2.mlp.experts.3.down_proj.weight";
    edit_shard(dir, e, [&](NamedTensors& t) {
      for (auto& p : t)
        if (p.first == e) p.second = at::zeros({256, 128});
    });
    std::string msg = user_error_of([&] { import_deepseek_v3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("'" + e + "'") != std::string::npos);
    CHECK(msg.find("shape [256, 128]; expected [256, 256] (our layers.2.moe.experts.w2 [8, "
                   "256, 256])") != std::string::npos);
  }
  SECTION("a stray layer tensor") {
    edit_shard(dir, bias, [&](NamedTensors& t) {
      t.emplace_back("model.layers.2.mlp.experts.8.up_proj.weight", at::zeros({256, 256}));
    });
    std::string msg = user_error_of([&] { import_deepseek_v3_hf(dst, dir); });
    INFO(msg);
    CHECK(msg.find("'model.layers.2.mlp.experts.8.up_proj.weight'") != std::string::npos);
    CHECK(msg.find("is not part of this model") != std::string::npos);
  }
  SECTION("multi-token-prediction layers are skipped") {
    // DeepSeek-V3's release: one extra layer after the last, here model.layers.3.
    edit_shard(dir, bias, [&](NamedTensors& t) {
      t.emplace_back("model.layers.3.eh_proj.weight", at::zeros({4, 4}));
      t.emplace_back("model.layers.3.mlp.experts.0.up_proj.weight", at::zeros({4, 4}));
    });
    import_deepseek_v3_hf(dst, dir);
    check_same_ds_tensors(dst, src);
    return;  // imported, so the model changed: the check below is for failed imports
  }
  SECTION("a llama3 folder") {
    test::TempDir other("hf-ds-bad-llama");
    Llama3 llama(llama3_flavor("debugmodel"), at::kCPU);
    llama.init_weights(34);
    export_llama3_hf(llama, other.file("hf"), {});
    std::string msg = user_error_of([&] { import_deepseek_v3_hf(dst, other.file("hf")); });
    INFO(msg);
    CHECK(msg.find(other.file("hf") + "/config.json: intermediate_size") != std::string::npos);
  }
  CHECK(dst.params()[0].value.equal(before));
}

TEST_CASE("hf: model dispatch names the unsupported family and the allowed ones", "[hf]") {
  Llama4Args a = llama4_flavor("debugmodel");
  a.n_layers = 1;
  Llama4 l4(a, at::kCPU);
  CHECK_FALSE(hf_supported(l4));
  DeepSeekV3 ds(ds_sigmoid_args(), at::kCPU);
  Llama3 l3(gqa_tied_args(), at::kCPU);
  CHECK(hf_supported(ds));
  CHECK(hf_supported(l3));
  CHECK(hf_supported_models() ==
        std::vector<std::string>{"llama3", "deepseek_v3", "qwen3", "gpt_oss"});
  test::TempDir tmp("hf-dispatch");
  for (const std::string& msg : {user_error_of([&] { export_model_hf(l4, tmp.file("out"), {}); }),
                                 user_error_of([&] { import_model_hf(l4, tmp.file("out")); })}) {
    INFO(msg);
    CHECK(msg.find("supported for model.name = llama3, deepseek_v3, qwen3, gpt_oss; found "
                   "\"llama4\"") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(tmp.file("out")));
  // hf_tensors: llama3's parameters; deepseek_v3's plus one expert bias per MoE layer.
  CHECK(hf_tensors(l3).size() == l3.params().all().size());
  CHECK(hf_tensors(ds).size() == ds.params().all().size() + 2);
}

TEST_CASE("hf: convert-hf converts deepseek_v3 both ways", "[hf][cli]") {
  test::TempDir tmp("hf-ds-cli");
  DeepSeekV3 src(deepseek_v3_flavor("debugmodel"), at::kCPU);
  src.init_weights(35);
  set_expert_biases(src, 36);
  NamedTensors w;
  for (auto& [name, t] : hf_tensors(src)) w.emplace_back(name, t.detach());
  save_safetensors(tmp.file("w.safetensors"), w);
  const std::string bin = test::binary() + " convert-hf --model deepseek_v3 --flavor debugmodel ";

  auto r = test::run(bin + "--from-safetensors " + tmp.file("w.safetensors") + " --to-hf " +
                     tmp.file("hf") + " --seq-len 8192");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto cfg = read_json(tmp.file("hf/config.json"));
  CHECK(cfg["model_type"] == "deepseek_v3");
  CHECK(cfg["rope_scaling"]["rope_type"] == "yarn");  // --seq-len 8192 > 4096
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

  // A file without the expert biases, and a family without a Hugging Face mapping.
  NamedTensors params_only;
  for (auto& p : src.params().all()) params_only.emplace_back(p.name, p.value.detach());
  save_safetensors(tmp.file("params.safetensors"), params_only);
  r = test::run(bin + "--from-safetensors " + tmp.file("params.safetensors") + " --to-hf " +
                tmp.file("h2"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("has no tensor 'layers.1.moe.expert_bias' (shape [8])") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp.file("h2")));
  r = test::run(test::binary() + " convert-hf --model llama4 --flavor debugmodel --from-hf " +
                tmp.file("hf") + " --to-safetensors " + tmp.file("x.safetensors"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("llama4") != std::string::npos);
  CHECK(r.out.find("deepseek_v3") != std::string::npos);
  r = test::run(test::binary() + " convert-hf --model llama3 --flavor debugmodel --seq-len 8192 " +
                "--from-hf " + tmp.file("hf") + " --to-safetensors " + tmp.file("x.safetensors"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("--seq-len is for --model deepseek_v3 only; found --model llama3") !=
        std::string::npos);
  r = test::run(bin + "--from-hf " + tmp.file("nope") + " --to-safetensors " +
                tmp.file("x.safetensors"));
  CHECK(r.rc == 2);
  CHECK(r.out.find("does not exist") != std::string::npos);
}

// ---- Row-range (sharded) import -----------------------------------------------------------------

namespace {

// Cuts every parameter along dim 0 as FSDP does for rank r of k (parallel/fsdp.cpp
// shard_param): rows [r*c, (r+1)*c) with c = ceil(rows / k), zero padding to c rows.
void shard_like_fsdp(ParamStore& ps, int64_t k, int64_t r) {
  at::NoGradGuard ng;
  for (Param& p : ps.all()) {
    const std::vector<int64_t> global = p.value.sizes().vec();
    const int64_t rows = global[0], chunk = (rows + k - 1) / k;
    const int64_t begin = std::min(rows, r * chunk);
    std::vector<int64_t> shape = global;
    shape[0] = chunk;
    p.value = at::full(shape, 7.0).requires_grad_(true);  // not zero: the import must write
    p.global_shape = global;
    p.dim0_offset = begin;
    p.dim0_rows = std::min(rows, begin + chunk) - begin;
  }
}

// The bytes of `p`'s valid rows in a folder holding it as `hf_dtype`.
int64_t row_bytes(const Param& p, at::ScalarType hf_dtype) {
  const std::vector<int64_t> full = p.full_shape();
  int64_t numel = 1;
  for (size_t d = 1; d < full.size(); ++d) numel *= full[d];
  return p.dim0_rows * numel * static_cast<int64_t>(c10::elementSize(hf_dtype));
}

// For a model whose parameters `import` fills after shard_like_fsdp(k, r): every rank's valid
// rows equal the full import's bit for bit, padding stays as it was, and each rank reads
// exactly its rows' bytes (plus `extra_per_rank`, tensors every rank reads whole).
template <class M>
void check_sharded_import(const M& full, const std::function<std::unique_ptr<M>()>& make,
                          const std::function<HfImportStats(M&)>& import, int64_t k,
                          at::ScalarType hf_dtype, int64_t extra_per_rank) {
  int64_t sum_read = 0, total = -1;
  for (int64_t r = 0; r < k; ++r) {
    std::unique_ptr<M> m = make();
    shard_like_fsdp(m->params(), k, r);
    const HfImportStats st = import(*m);
    int64_t want_read = extra_per_rank;
    for (size_t i = 0; i < full.params().all().size(); ++i) {
      const Param& p = m->params().all()[i];
      INFO("rank " << r << " of " << k << ": " << p.name << " rows [" << p.dim0_offset << ", "
                   << p.dim0_offset + p.dim0_rows << ")");
      const at::Tensor want =
          full.params().all()[i].value.detach().narrow(0, p.dim0_offset, p.dim0_rows);
      CHECK(p.valid(p.value).equal(want));
      const int64_t pad = p.value.size(0) - p.dim0_rows;
      if (pad > 0) CHECK(p.value.narrow(0, p.dim0_rows, pad).eq(7.0).all().item<bool>());
      want_read += row_bytes(p, hf_dtype);
    }
    CHECK(st.bytes_read == want_read);
    CHECK((total < 0 || st.bytes_total == total));
    total = st.bytes_total;
    sum_read += st.bytes_read - extra_per_rank;
  }
  CHECK(sum_read + extra_per_rank == total);  // every row read once over the ranks
}

}  // namespace

TEST_CASE("hf: a sharded import reads only its rows of each transform", "[hf]") {
  // Three transforms, shapes chosen so that shard boundaries fall inside RoPE heads (head
  // dim 6) and experts split unevenly (5 over 2, 3 or 4 ranks: the last of 4 holds none).
  // Reference: the whole-tensor import of the same bf16 folder, bit for bit. The bytes read
  // are exactly the rows' bf16 bytes.
  std::vector<HfTensorMap> map = {
      {"plain", {"hf.plain"}, HfTransform::kNone, 0},
      {"norm", {"hf.norm"}, HfTransform::kNone, 0},
      {"q", {"hf.q"}, HfTransform::kRopePermute, 3},
      {"experts", {"hf.e0", "hf.e1", "hf.e2", "hf.e3", "hf.e4"}, HfTransform::kSplitExperts, 0},
  };
  const std::map<std::string, std::vector<int64_t>> shapes = {
      {"plain", {10, 6}}, {"norm", {7}}, {"q", {18, 5}}, {"experts", {5, 3, 2}}};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(41);
  NamedTensors src, whole;
  for (auto& m : map) {
    src.emplace_back(m.ours, at::randn(shapes.at(m.ours), gen));
    whole.emplace_back(m.ours, at::zeros(shapes.at(m.ours)));
  }
  test::TempDir tmp("hf-rows");
  HfExportOptions opts;
  opts.dtype = at::kBFloat16;
  opts.max_shard_bytes = 200;  // several files
  export_hf(src, map, {{"model_type", "test"}}, tmp.file("hf"), opts);
  const HfImportStats all = import_hf(whole, map, tmp.file("hf"));
  CHECK(all.bytes_read == all.bytes_total);
  CHECK(all.bytes_total == (60 + 7 + 90 + 30) * 2);
  CHECK(whole[2].second.equal(src[2].second.to(at::kBFloat16).to(at::kFloat)));

  for (int64_t k : {2, 3, 4}) {
    int64_t sum = 0;
    for (int64_t r = 0; r < k; ++r) {
      HfImportTargets targets;
      int64_t want_read = 0;
      for (auto& [name, t] : whole) {
        const int64_t rows = t.size(0), chunk = (rows + k - 1) / k;
        const int64_t o = std::min(rows, r * chunk), n = std::min(rows, o + chunk) - o;
        targets.push_back({name, at::full(t.narrow(0, o, n).sizes(), 7.0), t.sizes().vec(), o});
        want_read += t.narrow(0, o, n).numel() * 2;
      }
      const HfImportStats st = import_hf(targets, map, tmp.file("hf"));
      for (size_t i = 0; i < targets.size(); ++i) {
        const HfImportTarget& t = targets[i];
        INFO("rank " << r << " of " << k << ": " << t.name << " rows from " << t.row_offset);
        CHECK(t.dst.equal(whole[i].second.narrow(0, t.row_offset, t.dst.size(0))));
      }
      CHECK(st.bytes_read == want_read);
      CHECK(st.bytes_total == all.bytes_total);
      sum += st.bytes_read;
    }
    CHECK(sum == all.bytes_total);
  }
}

TEST_CASE("hf: FSDP-sharded llama3 and deepseek_v3 parameters import the full import's rows",
          "[hf]") {
  // Parameters cut as FSDP cuts them over 2, 3 and 4 ranks (3 puts boundaries inside RoPE
  // heads of 16 rows and splits 8 experts 3/3/2), filled by the model's import. Reference:
  // the same folder imported whole into an unsharded model, bit for bit.
  SECTION("llama3") {
    const Llama3Args a = gqa_tied_args();
    test::TempDir tmp("hf-rows-l3");
    Llama3 src(a, at::kCPU);
    src.init_weights(42);
    HfExportOptions opts;
    opts.dtype = at::kBFloat16;
    export_llama3_hf(src, tmp.file("hf"), opts);
    Llama3 full(a, at::kCPU);
    full.init_weights(43);
    const HfImportStats st = import_llama3_hf(full, tmp.file("hf"));
    CHECK(st.bytes_read == st.bytes_total);
    for (size_t i = 0; i < src.params().all().size(); ++i) {  // the whole import is right
      INFO(src.params().all()[i].name);
      const at::Tensor& want = src.params().all()[i].value;
      CHECK(full.params().all()[i].value.equal(want.detach().to(at::kBFloat16).to(at::kFloat)));
    }
    CHECK(st.describe().find(" MiB of Hugging Face tensor data") != std::string::npos);
    for (int64_t k : {2, 3, 4})
      check_sharded_import<Llama3>(
          full, [&] { return std::make_unique<Llama3>(a, at::kCPU); },
          [&](Llama3& m) { return import_llama3_hf(m, tmp.file("hf")); }, k, at::kBFloat16, 0);
  }
  SECTION("deepseek_v3") {
    const DeepSeekV3Args a = ds_qlora_yarn_args();
    test::TempDir tmp("hf-rows-ds");
    DeepSeekV3 src(a, at::kCPU);
    src.init_weights(44);
    set_expert_biases(src, 45);
    export_deepseek_v3_hf(src, tmp.file("hf"), {});
    DeepSeekV3 full(a, at::kCPU);
    full.init_weights(46);
    import_deepseek_v3_hf(full, tmp.file("hf"));
    check_same_ds_tensors(full, src);
    // The expert biases are buffers, read whole on every rank (fp32, E per MoE layer).
    const int64_t biases = static_cast<int64_t>(full.moe_layers().size()) * a.moe.num_experts * 4;
    for (int64_t k : {2, 3, 4})
      check_sharded_import<DeepSeekV3>(
          full, [&] { return std::make_unique<DeepSeekV3>(a, at::kCPU); },
          [&](DeepSeekV3& m) {
            HfImportStats s = import_deepseek_v3_hf(m, tmp.file("hf"));
            auto got = m.moe_layers(), want = full.moe_layers();
            for (size_t i = 0; i < want.size(); ++i)
              CHECK(got.at(i)->expert_bias.equal(want[i]->expert_bias));
            return s;
          },
          k, at::kFloat, biases);
  }
}

// A Llama-architecture folder of dimensions no built-in flavor has (as many small public
// models are): its config.json gives the flavor ("hf:DIR" for training, --flavor hf for
// convert-hf), the weights import bit-exactly, and a run trains from them.
TEST_CASE("hf: a custom-dimension Llama folder imports from its config.json", "[hf]") {
  test::TempDir tmp("hf-custom");
  Llama3Args a = llama3_flavor("debugmodel");
  a.dim = 96;
  a.n_layers = 2;
  a.n_heads = 6;
  a.n_kv_heads = 2;
  a.vocab_size = 320;
  a.multiple_of = 200;  // intermediate_size 200: no multiple_of/multiplier pair of ours makes it
  a.ffn_dim_multiplier = 0.78;
  a.rope_scaling.factor = 1.0;
  a.rope_theta = 10000;
  a.tie_embeddings = true;
  REQUIRE(llama_ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier) == 200);
  Llama3 src(a, at::kCPU);
  src.init_weights(3);
  const std::string dir = tmp.file("hf");
  export_llama3_hf(src, dir, {});
  // Written by transformers' conventions, not ours: a common ffn width, no multiple_of.
  auto cfg = nlohmann::json::parse(test::read_file(dir + "/config.json"));
  CHECK(cfg["intermediate_size"] == 200);

  const Llama3Args b = llama3_flavor("hf:" + dir);
  CHECK(b.dim == 96);
  CHECK(b.n_layers == 2);
  CHECK(b.n_heads == 6);
  CHECK(b.n_kv_heads == 2);
  CHECK(b.vocab_size == 320);
  CHECK(llama_ffn_hidden(b.dim, b.multiple_of, b.ffn_dim_multiplier) == 200);
  CHECK(b.rope_theta == 10000);
  CHECK(b.rope_scaling.factor == 1.0);
  CHECK(b.tie_embeddings);
  CHECK(llama3_matching_flavor(b).empty());
  CHECK(llama3_matching_flavor(llama3_flavor("1B")) == "1B");
  Llama3 dst(b, at::kCPU);
  import_llama3_hf(dst, dir);
  for (size_t i = 0; i < src.params().all().size(); ++i)
    CHECK(src.params().all()[i].value.equal(dst.params().all()[i].value));
  // Every intermediate_size comes out exactly.
  for (int64_t dim : {64, 96, 2048})
    for (int64_t ffn : {2, 100, 173, 200, 5461, 8192, 14336}) {
      cfg["hidden_size"] = dim;
      cfg["num_attention_heads"] = 8;
      cfg["num_key_value_heads"] = 8;
      cfg["head_dim"] = dim / 8;
      cfg["intermediate_size"] = ffn;
      fs::create_directories(tmp.file("cfg"));
      test::write_file(tmp.file("cfg/config.json"), cfg.dump());
      const Llama3Args c = llama3_args_from_hf_config(tmp.file("cfg"));
      INFO(dim << " " << ffn);
      CHECK(llama_ffn_hidden(c.dim, c.multiple_of, c.ffn_dim_multiplier) == ffn);
    }

  // convert-hf --flavor hf names the custom flavor and converts.
  auto conv = test::run(test::binary() + " convert-hf --model llama3 --flavor hf --from-hf " + dir +
                        " --to-safetensors " + tmp.file("w.safetensors"));
  INFO(conv.out);
  CHECK(conv.rc == 0);
  CHECK_THAT(conv.out, Catch::Matchers::Contains("dim 96, 2 layers, 6 heads (2 KV), ffn 200") &&
                           Catch::Matchers::Contains("a custom flavor"));
  // Training from the folder with model.flavor = "hf:DIR".
  auto run =
      test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() +
                " --config configs/llama3_debug.toml --model.flavor hf:" + dir +
                " --model.tokenizer_path bytes --training.steps 1 "
                "--training.local_batch_size 2 --training.seq_len 32 --validation.enable false "
                "--checkpoint.initial_load_in_hf --checkpoint.initial_load_path " +
                dir + " --job.dump_folder " + tmp.file("run"));
  INFO(run.out);
  CHECK(run.rc == 0);
  CHECK_THAT(run.out, Catch::Matchers::Contains("a custom flavor") &&
                          Catch::Matchers::Contains("initialized from Hugging Face weights"));
}

// ---- DeepSeek-V3's float8 checkpoints -----------------------------------------------------------

namespace {

// A deepseek_v3 debugmodel exported as float32, then rewritten by hf_fp8_ref.py in DeepSeek-V3's
// published layout: linear weights float8 e4m3fn with float32 <name>_scale_inv per
// `br` x `bc` block, the rest bfloat16; `ref` holds the float32 the importer must produce.
struct Fp8Folder {
  std::string dir, ref;
};
Fp8Folder write_fp8_folder(const test::TempDir& tmp, const DeepSeekV3Args& a, int64_t br,
                           int64_t bc) {
  DeepSeekV3 src(a, at::kCPU);
  src.init_weights(51);
  set_expert_biases(src, 52);
  const std::string tag = std::to_string(br) + "x" + std::to_string(bc);
  export_model_hf(src, tmp.file("fp32-" + tag), {});
  Fp8Folder f{tmp.file("fp8-" + tag), tmp.file("ref-" + tag + ".safetensors")};
  auto r = test::run(test::python() + " " + test::source_dir() +
                     "/test/reference/hf_fp8_ref.py quantize " + tmp.file("fp32-" + tag) + " " +
                     f.dir + " " + std::to_string(br) + " " + std::to_string(bc) + " " + f.ref);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  return f;
}

// Every tensor of `m` (hf_tensors) equals the reference's dequantized HF tensors, bit for bit.
void check_fp8_import(const DeepSeekV3& m, const std::string& ref_path) {
  auto ref = SafetensorsFile::open(ref_path);
  const auto map = deepseek_v3_hf_map(deepseek_v3_hf_layout(m.args()));
  const NamedTensors got = hf_tensors(m);
  std::map<std::string, at::Tensor> by_name(got.begin(), got.end());
  for (auto& e : map) {
    INFO(e.ours);
    std::vector<at::Tensor> hf;
    for (auto& n : e.hf) hf.push_back(ref.get(n));
    CHECK(by_name.at(e.ours).equal(from_hf_layout(e, hf)));
  }
}

}  // namespace

TEST_CASE("hf: DeepSeek-V3's float8 layout (e4m3 + block _scale_inv) imports dequantized",
          "[hf][float8]") {
  // Reference: hf_fp8_ref.py dequantizes each weight independently (padded to whole blocks and
  // scaled per block view) in float32; the import equals it bit for bit, as both round
  // fp8 x scale once. [128, 128] is DeepSeek-V3's block; [5, 3] makes every weight end in
  // partial blocks at the bottom and right (no dimension is a multiple of 5 or 3).
  const DeepSeekV3Args a = deepseek_v3_flavor("debugmodel");
  test::TempDir tmp("hf-fp8");
  for (auto [br, bc] : {std::pair<int64_t, int64_t>{128, 128}, {5, 3}}) {
    INFO("block " << br << "x" << bc);
    const Fp8Folder f = write_fp8_folder(tmp, a, br, bc);
    auto cfg = read_json(f.dir + "/config.json");
    CHECK(cfg["quantization_config"]["weight_block_size"] == nlohmann::json({br, bc}));
    auto hf = read_hf_folder(f.dir);
    const at::Tensor& w = hf.at("model.layers.1.mlp.experts.3.down_proj.weight");
    CHECK(w.scalar_type() == at::ScalarType::Float8_e4m3fn);
    const at::Tensor& s = hf.at("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv");
    CHECK(s.sizes().vec() ==
          std::vector<int64_t>{(w.size(0) + br - 1) / br, (w.size(1) + bc - 1) / bc});
    if (br == 5) CHECK((w.size(0) % 5 != 0 && w.size(1) % 3 != 0));

    DeepSeekV3 m(a, at::kCPU);
    const HfImportStats st = import_model_hf(m, f.dir);
    CHECK(st.bytes_read == st.bytes_total);
    check_fp8_import(m, f.ref);
    // Float8 really was read: the weight differs from the float32 source, by e4m3's rounding.
    DeepSeekV3 src(a, at::kCPU);
    src.init_weights(51);
    const at::Tensor& got = param(m, "layers.1.moe.experts.w2");
    const at::Tensor& orig = param(src, "layers.1.moe.experts.w2");
    CHECK_FALSE(got.equal(orig));
    CHECK(rel_err(got, orig) < 0.07);

    // FSDP-cut rows (3 ranks: boundaries fall inside blocks) equal the whole import's.
    for (int64_t r = 0; r < 3; ++r) {
      DeepSeekV3 part(a, at::kCPU);
      shard_like_fsdp(part.params(), 3, r);
      import_model_hf(part, f.dir);
      for (size_t i = 0; i < m.params().all().size(); ++i) {
        const Param& p = part.params().all()[i];
        INFO("rank " << r << ": " << p.name);
        CHECK(p.valid(p.value).equal(
            m.params().all()[i].value.detach().narrow(0, p.dim0_offset, p.dim0_rows)));
      }
    }
  }
}

TEST_CASE("hf: bad float8 folders are UserErrors naming the file and tensor; convert-hf exits 2",
          "[hf][float8][cli]") {
  const DeepSeekV3Args a = deepseek_v3_flavor("debugmodel");
  test::TempDir tmp("hf-fp8-bad");
  const Fp8Folder f = write_fp8_folder(tmp, a, 5, 3);
  const std::string w = "model.layers.0.mlp.down_proj.weight";
  const std::string scale = w + "_scale_inv";
  const std::string shard = read_json(f.dir + "/model.safetensors.index.json")["weight_map"][w];
  auto copy = [&](const std::string& name) {
    fs::copy(f.dir, tmp.file(name), fs::copy_options::recursive);
    return tmp.file(name);
  };
  auto import_error = [&](const std::string& dir) {
    return user_error_of([&] {
      DeepSeekV3 m(a, at::kCPU);
      import_model_hf(m, dir);
    });
  };

  const std::string missing = copy("missing");
  edit_shard(missing, scale, [&](NamedTensors& t) {
    t.erase(std::remove_if(t.begin(), t.end(), [&](auto& e) { return e.first == scale; }), t.end());
  });
  CHECK(import_error(missing) == "Hugging Face tensor '" + w + "' in " + missing + "/" + shard +
                                     " is F8_E4M3 but the folder has no '" + scale +
                                     "' to dequantize it; expected shape [52, 342], one scale "
                                     "per [5, 3] block (config.json quantization_config."
                                     "weight_block_size) of [256, 1024]");

  const std::string wrong = copy("wrong-shape");
  edit_shard(wrong, scale, [&](NamedTensors& t) {
    for (auto& [n, v] : t)
      if (n == scale) v = at::ones({52, 341});
  });
  const std::string e = import_error(wrong);
  CHECK(e.find("'" + scale + "' in " + wrong + "/" + shard + " has shape [52, 341]; expected " +
               "[52, 342]") != std::string::npos);

  // config.json's block size disagrees with the scales the folder holds.
  const std::string block = copy("block");
  auto cfg = read_json(block + "/config.json");
  cfg["quantization_config"]["weight_block_size"] = {4, 4};
  test::write_file(block + "/config.json", cfg.dump());
  CHECK(import_error(block).find("one scale per [4, 4] block (config.json quantization_config."
                                 "weight_block_size)") != std::string::npos);
  cfg["quantization_config"] = {{"quant_method", "bitsandbytes"}};
  test::write_file(block + "/config.json", cfg.dump());
  CHECK(import_error(block) ==
        block +
            "/config.json: quantization_config.quant_method = \"bitsandbytes\"; allowed: "
            "\"fp8\" (block-wise float8, as DeepSeek-V3 publishes)");

  // convert-hf: the good folder converts (to the dequantized float32), the bad one exits 2
  // with the message on one line.
  const std::string bin = test::binary() + " convert-hf --model deepseek_v3 --flavor debugmodel ";
  auto r = test::run(bin + "--from-hf " + f.dir + " --to-safetensors " + tmp.file("out.st"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find("dequantizing") != std::string::npos);
  DeepSeekV3 m(a, at::kCPU);
  auto out = SafetensorsFile::open(tmp.file("out.st"));
  NamedTensors back;
  for (auto& [name, t] : hf_tensors(m)) t.detach().copy_(out.get(name));
  check_fp8_import(m, f.ref);
  r = test::run(bin + "--from-hf " + missing + " --to-safetensors " + tmp.file("x.st"));
  INFO(r.out);
  CHECK(r.rc == 2);
  CHECK(r.out.find("'" + w + "' in " + missing + "/" + shard +
                   " is F8_E4M3 but the folder has "
                   "no '" +
                   scale + "'") != std::string::npos);
}
