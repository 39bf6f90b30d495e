// `titan-train data-preview`: its JSON lines for 2 steps of a two-source blend equal the
// loader's own batches (first 8 ids, exact) and the planner's windows (source, shard, offset);
// --rank R --world W lists rank R's part of the same step; --tokens all gives whole windows.
#include <catch2/catch.hpp>

#include <sstream>

#include "core/data/blend.h"
#include "core/config/config.h"
#include "core/data/loader.h"
#include "core/data/token_source.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

std::vector<nlohmann::json> preview(const std::string& args, int* rc = nullptr) {
  auto r = test::run("(env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                     test::binary() + " data-preview " + args + " 2>/dev/null)");
  if (rc) *rc = r.rc;
  std::vector<nlohmann::json> out;
  std::stringstream ss(r.out);
  for (std::string line; std::getline(ss, line);)
    if (line.rfind("{\"step\"", 0) == 0) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::vector<std::string> split_args(const std::string& s) {
  std::vector<std::string> out = {"titan-train"};
  std::stringstream ss(s);
  for (std::string a; ss >> a;) out.push_back(a);
  return out;
}

}  // namespace

TEST_CASE("data-preview: JSON lines match the loader's batches and ranks list their half", "[data]") {
  test::TempDir dir("preview");
  for (int s = 0; s < 2; ++s) {  // ids below the debugmodel's vocabulary of 2048
    std::vector<int32_t> tokens;
    std::vector<int64_t> offsets = {0};
    const int64_t n = s == 0 ? 3000 : 9000;
    for (int64_t i = 0; i < n; ++i) {
      tokens.push_back(static_cast<int32_t>((i * 7919 + s * 1013) % 2048));
      if ((i + 1) % 250 == 0) offsets.push_back(i + 1);
    }
    write_tok_v2(dir.file(s == 0 ? "a.tok" : "b.tok"), tokens, offsets, 2048);
  }
  const std::string args = "--config " + test::source_dir() +
                           "/configs/llama3_debug.toml --training.dataset_path " +
                           dir.file("a.tok") + "," + dir.file("b.tok") +
                           " --training.seq_len 31 --training.local_batch_size 4"
                           " --training.global_batch_size 8 --training.steps 2 --debug.seed 3";
  int rc = -1;
  auto lines = preview(args + " --steps 2", &rc);
  REQUIRE(rc == 0);
  REQUIRE(lines.size() == 16);  // 2 steps x 2 micro-batches x 4 rows
  // --tokens all: whole windows, inputs then the last label (the torchtitan comparison's feed).
  auto whole = preview(args + " --steps 2 --tokens all", &rc);
  REQUIRE(rc == 0);
  REQUIRE(whole.size() == 16);

  // The same config in-process: the loader's batches and the planner's windows.
  auto argv = split_args(args);
  std::vector<const char*> cargv;
  for (auto& a : argv) cargv.push_back(a.c_str());
  JobConfig cfg = parse_command_line(static_cast<int>(cargv.size()), cargv.data()).cfg;
  DerivedConfig d = derive_config(cfg, 1);
  REQUIRE(d.grad_accum_steps == 2);
  BlendOptions opts;
  opts.vocab = 2048;
  opts.holdout_fraction = cfg.training.holdout_fraction;
  Blend blend(parse_dataset_spec({cfg.training.dataset_path}, {}), opts);
  Loader loader(blend, 31, 4, 0, 1, 2, 3, at::kCPU, 2);
  WindowPlanner planner(blend, loader.layout(), 3);
  LoaderState st = planner.initial_state();
  std::set<int64_t> sources;
  for (int64_t step = 1; step <= 2; ++step) {
    auto plan = planner.next_step(st);
    for (int64_t m = 0; m < 2; ++m) {
      MicroBatch mb = loader.next();
      for (int64_t b = 0; b < 4; ++b) {
        const size_t i = static_cast<size_t>(((step - 1) * 2 + m) * 4 + b);
        const nlohmann::json& j = lines[i];
        INFO(j.dump());
        CHECK(j["step"] == step);
        CHECK(j["rank"] == 0);
        auto first8 = mb.tokens[b].slice(0, 0, 8);
        CHECK(j["tokens"].get<std::vector<int64_t>>() ==
              std::vector<int64_t>(first8.data_ptr<int64_t>(), first8.data_ptr<int64_t>() + 8));
        CHECK(j["micro"] == m);
        CHECK(j["row"] == b);
        auto all = whole[i]["tokens"].get<std::vector<int64_t>>();
        REQUIRE(all.size() == 32);
        at::Tensor in = mb.tokens[b].contiguous(), lab = mb.labels[b].contiguous();
        CHECK(std::vector<int64_t>(all.begin(), all.end() - 1) ==
              std::vector<int64_t>(in.data_ptr<int64_t>(), in.data_ptr<int64_t>() + 31));
        CHECK(std::vector<int64_t>(all.begin() + 1, all.end()) ==
              std::vector<int64_t>(lab.data_ptr<int64_t>(), lab.data_ptr<int64_t>() + 31));
        const WindowRef& w = plan[static_cast<size_t>(m * 4 + b)];
        CHECK(j["source"] == w.draw.source);
        CHECK(j["path"] == dir.file(w.draw.source == 0 ? "a.tok" : "b.tok"));
        CHECK(j["offset"] == w.token);
        sources.insert(w.draw.source);
      }
    }
  }
  CHECK(sources.size() == 2);

  // Two data-parallel ranks with the same global batch: rank r lists rows r*4 .. r*4 + 3 of
  // each step of the one-rank listing (g = (m * dp + r) * B + b), nothing else.
  auto r0 = preview(args + " --steps 2 --rank 0 --world 2");
  auto r1 = preview(args + " --steps=2 --rank=1 --world=2");
  REQUIRE(r0.size() == 8);
  REQUIRE(r1.size() == 8);
  for (size_t i = 0; i < 16; ++i) {
    const size_t step = i / 8, j = i % 8;
    nlohmann::json w = (j < 4 ? r0 : r1)[step * 4 + j % 4];
    CHECK(w["rank"] == (j < 4 ? 0 : 1));
    CHECK(w["micro"] == 0);  // one micro-batch per rank; the one-rank listing has two
    w["rank"] = 0;
    w["micro"] = j / 4;
    CHECK(w == lines[i]);
  }
  auto bad = test::run(test::binary() + " data-preview " + args + " --rank 2 --world 2");
  CHECK(bad.rc == 2);
  CHECK_THAT(bad.out, Contains("--rank 2") && Contains("0..1"));
}
