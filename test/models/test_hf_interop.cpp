// Hugging Face import/export: bit-exact round trips, bf16 rounding, sharding and the index,
// the folder as the Python `safetensors` package and transformers see it (logits of
// LlamaForCausalLM equal ours within a relative 1e-5, which pins the q/k RoPE permutation),
// UserErrors for bad folders, the DeepSeek-V3 name map and the convert-hf subcommand.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "core/errors.h"
#include "core/safetensors.h"
#include "models/hf_interop.h"
#include "models/llama3.h"
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

double rel_err(const at::Tensor& ours, const at::Tensor& ref) {
  at::Tensor a = ours.to(at::kDouble), b = ref.to(at::kDouble);
  double denom = b.abs().max().item<double>();
  return (a - b).abs().max().item<double>() / (denom > 0 ? denom : 1.0);
}

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
    {
      // Sharper attention than the init gives, so that a wrong RoPE layout shows clearly.
      at::NoGradGuard ng;
      for (auto& p : model.params().all())
        if (p.name.find("attention.wq") != std::string::npos ||
            p.name.find("attention.wk") != std::string::npos)
          p.value.mul_(4.0);
    }
    export_llama3_hf(model, tmp.file("hf"), {});
    auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
    at::Tensor tokens = at::randint(a.vocab_size, {2, 48}, gen, at::kLong);
    save_safetensors(tmp.file("tokens.safetensors"), {{"tokens", tokens}});
    auto r = test::run(test::python() + " " + test::source_dir() +
                       "/test/reference/hf_interop_check.py logits " + tmp.file("hf") + " " +
                       tmp.file("tokens.safetensors") + " " + tmp.file("out.safetensors"));
    INFO(r.out);
    if (r.rc == 3) {
      WARN("transformers is not importable in " << test::python()
                                                << "; the logits check is SKIPPED: " << r.out);
      return;
    }
    REQUIRE(r.rc == 0);
    auto out = SafetensorsFile::open(tmp.file("out.safetensors"));
    at::Tensor ours;
    {
      at::NoGradGuard ng;
      ours = model.forward(tokens);
    }
    const double err = rel_err(ours, out.get("logits"));
    const double err_unpermuted = rel_err(ours, out.get("logits_unpermuted"));
    const size_t v = r.out.find("transformers ");
    const std::string version =
        v == std::string::npos ? "" : r.out.substr(v, r.out.find('\n', v) - v);
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
