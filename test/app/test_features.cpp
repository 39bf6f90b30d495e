// Options that each promise a behaviour, checked through the binary on the Llama-3
// debugmodel: gradient accumulation, the checkpoint loading and saving options, and a
// separate validation file.
#include <catch2/catch.hpp>

#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/checkpoint/safetensors.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kSmall =
    "--config configs/llama3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false --debug.seed 5 ";

test::CmdResult train(const std::string& args) {
  return test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " +
                   test::binary() + " " + kSmall + args);
}

// step -> (loss, grad_norm) of the run whose dump folder is `dump`.
std::map<int64_t, std::pair<double, double>> metrics(const std::string& dump) {
  std::map<int64_t, std::pair<double, double>> out;
  for (auto& [step, j] : test::training_metrics(dump + "/metrics.jsonl"))
    out[step] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  return out;
}

double rel(double a, double b) {
  return std::abs(a - b) / std::abs(b);
}

}  // namespace

TEST_CASE("features: 4 micro-batches of 2 equal one batch of 8", "[features][slow]") {
  // The same 8 windows per step either way; the loss is normalized by the step's token
  // count, so the accumulated gradients equal the big batch's up to summation order.
  // Reference: the batch-8 run; tolerance 1e-6 relative on loss and grad norm.
  test::TempDir dir("accum");
  auto a = train("--training.steps 5 --training.local_batch_size 8 --job.dump_folder " +
                 dir.file("a"));
  REQUIRE(a.rc == 0);
  auto b = train("--training.steps 5 --training.local_batch_size 2 "
                 "--training.global_batch_size 8 --job.dump_folder " + dir.file("b"));
  INFO(b.out);
  REQUIRE(b.rc == 0);
  CHECK_THAT(b.out, Contains("grad_accum_steps = 4"));
  auto ma = metrics(dir.file("a")), mb = metrics(dir.file("b"));
  REQUIRE(ma.size() == 5);
  REQUIRE(mb.size() == 5);
  for (auto& [step, v] : ma) {
    INFO("step " << step);
    CHECK(rel(mb[step].first, v.first) < 1e-6);
    CHECK(rel(mb[step].second, v.second) < 1e-6);
  }
}

TEST_CASE("features: checkpoint.exclude_from_loading skips exactly the named parts",
          "[features][checkpoint][slow]") {
  test::TempDir dir("exclude");
  const std::string save =
      "--checkpoint.enable --checkpoint.interval 4 --training.local_batch_size 2 ";
  // The uninterrupted reference, which checkpoints at steps 4 and 8.
  REQUIRE(train(save + "--training.steps 8 --job.dump_folder " + dir.file("ref")).rc == 0);
  auto ref = metrics(dir.file("ref"));
  // A fork starts from the reference's own step-4 checkpoint (a run stopped at --training.steps
  // 4 would have trained its first steps on a shorter LR schedule).
  auto fork = [&](const std::string& name, const std::string& extra) {
    fs::create_directories(dir.file(name) + "/checkpoint");
    fs::copy(dir.file("ref") + "/checkpoint/step-4", dir.file(name) + "/checkpoint/step-4",
             fs::copy_options::recursive);
    auto r = train(save + "--training.steps 8 --job.dump_folder " + dir.file(name) + " " + extra);
    INFO(r.out);
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("resumed from"));
    return metrics(dir.file(name));
  };
  // Nothing excluded: the resumed steps repeat the reference bit for bit.
  auto all = fork("all", "");
  CHECK(all.at(5).first == ref.at(5).first);
  // Without the optimizer, AdamW restarts from zero moments: step 5 sees the same batch and
  // weights (same loss) but takes another update (step 6 differs).
  auto no_opt = fork("no-opt", "--checkpoint.exclude_from_loading optimizer");
  CHECK(no_opt.at(5).first == ref.at(5).first);
  CHECK(no_opt.at(6).first != ref.at(6).first);
  // Without the loader position, step 5 reads the first windows again: another loss.
  auto no_data = fork("no-data", "--checkpoint.exclude_from_loading dataloader");
  CHECK(no_data.at(5).first != ref.at(5).first);
  // Without the train state, training counts from step 1 again on the loaded weights.
  auto r = train(save + "--training.steps 2 --job.dump_folder " + dir.file("all") +
                 " --checkpoint.load_step 4 --checkpoint.exclude_from_loading train_state");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  CHECK_THAT(r.out, Contains("step:     1"));
}

TEST_CASE("features: last_save_model_only writes the model alone, in export_dtype",
          "[features][checkpoint]") {
  test::TempDir dir("modelonly");
  auto r = train("--training.steps 2 --training.local_batch_size 2 --checkpoint.enable "
                 "--checkpoint.last_save_model_only --checkpoint.export_dtype bfloat16 "
                 "--job.dump_folder " + dir.file("r"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const std::string step = dir.file("r") + "/checkpoint/step-2";
  auto ts = nlohmann::json::parse(test::read_file(step + "/train_state.json"));
  CHECK(ts["model_only"].get<bool>());
  CHECK_FALSE(ts.contains("dataloader"));
  auto meta = nlohmann::json::parse(test::read_file(step + "/metadata.json"));
  int model = 0;
  for (auto& [k, v] : meta["tensors"].items()) {
    INFO(k);
    CHECK((k.rfind("model/", 0) == 0 || k.rfind("buffers/", 0) == 0));
    if (k.rfind("model/", 0) == 0) {
      ++model;
      CHECK(v["dtype"].get<std::string>() == "BFloat16");
    }
  }
  CHECK(model > 0);
  auto f = SafetensorsFile::open(step + "/rank-00000.safetensors");
  CHECK(f.entry("model/norm.weight").dtype == at::kBFloat16);
}

TEST_CASE("features: initial_load_path starts a new run from a titan-train checkpoint",
          "[features][checkpoint][slow]") {
  test::TempDir dir("initial");
  const std::string base = "--training.local_batch_size 2 ";
  REQUIRE(train(base + "--training.steps 6 --checkpoint.enable --checkpoint.interval 3 "
                       "--job.dump_folder " + dir.file("a")).rc == 0);
  auto a = metrics(dir.file("a"));
  const std::string step3 = dir.file("a") + "/checkpoint/step-3";
  // Model only (the default): step 1 of the new run reads run A's first batch with the
  // weights A had after 3 steps, so its loss is A's step-4 weights on A's step-1 data:
  // lower than A's own step 1.
  auto b = train(base + "--training.steps 2 --checkpoint.enable --checkpoint.initial_load_path " +
                 step3 + " --job.dump_folder " + dir.file("b"));
  INFO(b.out);
  REQUIRE(b.rc == 0);
  CHECK_THAT(b.out, Contains("initialized from " + step3 + " (model only)"));
  auto mb = metrics(dir.file("b"));
  CHECK(mb.at(1).first < a.at(1).first);
  // The whole state: the new run continues A exactly (steps 4..6 equal A's).
  auto c = train(base + "--training.steps 6 --checkpoint.enable --checkpoint.initial_load_path " +
                 step3 + " --checkpoint.initial_load_model_only false --job.dump_folder " +
                 dir.file("c"));
  INFO(c.out);
  REQUIRE(c.rc == 0);
  auto mc = metrics(dir.file("c"));
  REQUIRE(mc.count(4));
  for (int64_t s = 4; s <= 6; ++s) CHECK(mc.at(s).first == a.at(s).first);
  // Used only while the dump folder has no checkpoint of its own: c now resumes from its own.
  auto again = train(base + "--training.steps 6 --checkpoint.enable --checkpoint.initial_load_path " +
                     step3 + " --job.dump_folder " + dir.file("c"));
  CHECK_THAT(again.out, Contains("resumed from " + dir.file("c")));
}

TEST_CASE("features: validation.dataset_path evaluates on its own file", "[features]") {
  test::TempDir dir("valpath");
  // A small validation file: 3 documents of distinct text.
  std::string text;
  for (int d = 0; d < 3; ++d) {
    for (int i = 0; i < 60; ++i) text += "validation words number " + std::to_string(d * 100 + i) + " ";
    text += "\n\n";
  }
  test::write_file(dir.file("val.txt"), text);
  auto run = [&](const std::string& name, const std::string& extra) {
    auto r = train("--training.steps 2 --training.local_batch_size 2 --validation.enable "
                   "--validation.freq 2 --validation.seq_len 64 --validation.local_batch_size 1 "
                   "--job.dump_folder " + dir.file(name) + " " + extra);
    INFO(r.out);
    REQUIRE(r.rc == 0);
    std::stringstream ss(test::read_file(dir.file(name) + "/metrics.jsonl"));
    for (std::string line; std::getline(ss, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("validation_loss"))
        return std::make_pair(j["validation_loss"].get<double>(), j["validation_tokens"].get<int64_t>());
    }
    FAIL("no validation line");
    return std::make_pair(0.0, int64_t{0});
  };
  auto held = run("held", "");
  auto own = run("own", "--validation.dataset_path " + dir.file("val.txt"));
  CHECK(own.first != held.first);
  CHECK(own.second == held.second);  // validation.steps = 4 windows of 64 caps both
  // validation.steps = -1 reads the whole file once: more windows than 4, but fewer tokens
  // than the file has bytes (the held-out part of the corpus is far larger).
  auto all = run("own-all", "--validation.steps -1 --validation.dataset_path " + dir.file("val.txt"));
  CHECK(all.second > own.second);
  CHECK(all.second < static_cast<int64_t>(text.size()));
  CHECK(all.second % 64 == 0);  // whole windows of validation.seq_len
}

TEST_CASE("features: a tokenizer smaller than the model's vocabulary trains", "[features]") {
  // Real models pad their vocabulary; torchtitan's test tokenizer has 2,002 tokens for the
  // debugmodel's 2,048. The byte tokenizer (258) stands in for it here.
  test::TempDir dir("smallvocab");
  auto r = train("--training.steps 2 --training.local_batch_size 2 --model.tokenizer_path bytes "
                 "--job.dump_folder " + dir.file("r"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  CHECK_THAT(r.out, Contains("(vocab 258, model vocab 2048)"));
  CHECK(metrics(dir.file("r")).size() == 2);
}

TEST_CASE("features: raw text is tokenized once; a second start reuses the cache",
          "[features][data]") {
  // A fresh input file (its path, size and mtime key the cache), in a private cache folder.
  test::TempDir dir("tokcache");
  std::string text;
  for (int d = 0; d < 40; ++d) {
    for (int i = 0; i < 50; ++i) text += "document " + std::to_string(d) + " word " + std::to_string(i) + " ";
    text += "\n\n";
  }
  test::write_file(dir.file("raw.txt"), text);
  auto run = [&](const std::string& name) {
    auto r = test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE TITAN_CACHE=" +
                       dir.file("cache") + " " + test::binary() + " " + kSmall +
                       "--training.steps 3 --training.local_batch_size 2 --model.tokenizer_path " +
                       test::tokenizer_path() + " --training.dataset_path " + dir.file("raw.txt") +
                       " --job.dump_folder " + dir.file(name));
    INFO(r.out);
    REQUIRE(r.rc == 0);
    return r.out;
  };
  const std::string first = run("a"), second = run("b");
  CHECK_THAT(first, Contains("tokenized " + dir.file("raw.txt") + " into token cache"));
  CHECK_THAT(second, Contains("reusing token cache for " + dir.file("raw.txt")));
  CHECK_THAT(second, Contains("(nothing tokenized)"));
  auto a = metrics(dir.file("a")), b = metrics(dir.file("b"));
  REQUIRE(a.size() == 3);
  for (auto& [step, v] : a) CHECK(b.at(step).first == v.first);
}
