// FSDP's float8 all-gather and precomputed float8 scales (docs/float8.md, "FSDP float8
// all-gather"), through the binary on 2 gloo ranks on the CPU, llama3 debugmodel, float8
// tensorwise (the CPU _scaled_mm):
// - gathering the float8 linears' weights in e4m3 gives the same losses and gradient norms
//   as gathering them in high precision and casting the whole weight (tolerance 0: the scale
//   comes from the same global amax and the cast is elementwise), and precomputed scales the
//   same again (tolerance 0); against 1 rank, the layouts' usual 1e-5;
// - the all-gather bytes per step are those of the layout computed from the model's shapes:
//   1 byte per float8 weight element instead of 2 (bf16) or 4 (fp32);
// - the amax all-reduces: one per unit at each forward gather, or one per step precomputed;
// - the CPU capture check passes with both flags (the bf16 runs), and a run with both flags
//   resumes exactly.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/train/float8_linears.h"
#include "models/registry.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kRun =
    "--config configs/llama3_debug.toml --training.seq_len 64 --metrics.log_freq 1 "
    "--validation.enable false --metrics.enable_tensorboard false --training.device cpu "
    "--debug.seed 3 --model.converters float8 ";
const std::string kGather = "--quantize.linear.float8.enable_fsdp_float8_all_gather true ";
const std::string kPre = "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp true ";
constexpr int64_t kSteps = 8;

test::CmdResult torchrun_train(const std::string& args) {
  return test::run("cd " + test::source_dir() + " && " + test::torchrun() +
                   " --standalone --nproc_per_node 2 --no-python " + test::binary() + " " + kRun +
                   args);
}

test::CmdResult single_train(const std::string& args) {
  return test::run("cd " + test::source_dir() + " && env -u RANK -u WORLD_SIZE " + test::binary() +
                   " " + kRun + args);
}

std::string tail(const std::string& s) {
  return s.substr(s.size() > 4000 ? s.size() - 4000 : 0);
}

struct Step {
  double loss = 0, grad_norm = 0;
};

std::map<int64_t, Step> read_metrics(const std::string& dump) {
  std::map<int64_t, Step> out;
  for (auto& [step, j] : test::training_metrics(dump + "/metrics.jsonl"))
    out[step] = {j["loss"].get<double>(), j["grad_norm"].get<double>()};
  return out;
}

using test::worst_rel;

// From "=> collectives per step on this rank: all-gather 14.0 x 65.5 KiB; ...": calls per
// step and bytes per step of one kind.
struct Comm {
  double calls = 0, bytes = 0;
};
Comm comm_of(const std::string& out, const std::string& kind) {
  const auto at = out.find("=> collectives per step on this rank:");
  if (at == std::string::npos) return {};
  const std::string line = out.substr(at, out.find('\n', at) - at);
  std::smatch m;
  if (!std::regex_search(line, m, std::regex(kind + " ([0-9.]+) x ([0-9.]+) KiB"))) return {};
  const double calls = std::stod(m[1]);
  return {calls, calls * std::stod(m[2]) * 1024.0};
}

// The all-gather bytes per step on one rank of FSDP 2, from the model's shapes: each FSDP
// unit (a block; the embeddings; the final norm and output) gathers 2 x its per-rank row,
// the blocks twice a step (forward, and again in backward after resharding), the others once.
// A rank's row is each parameter's ceil(rows / 2) rows, in param_dtype (esize bytes) or, for
// a float8 weight with the float8 all-gather, 1 byte per element, padded then to 16 bytes.
// `linears`: the float8 linears' weights' share of it (their bytes as gathered).
double expected_all_gather_bytes(int64_t esize, bool float8, double* linears = nullptr) {
  JobConfig cfg = default_config();
  cfg.model.name = "llama3";
  cfg.model.flavor = "debugmodel";
  auto model = build_model(cfg, at::kCPU);
  const ParamStore& ps = model->params();
  const Float8Plan plan = plan_float8_linears(ps, {}, float8::Recipe::Tensorwise);
  std::map<std::string, std::pair<int64_t, bool>> units;  // unit -> (row bytes, has float8)
  double lin = 0;
  for (int64_t i = 0; i < ps.size(); ++i) {
    const std::vector<int64_t> shape = ps[i].model_shape();
    int64_t numel = (shape[0] + 1) / 2;
    for (size_t d = 1; d < shape.size(); ++d) numel *= shape[d];
    const std::string& name = ps[i].name;
    std::string unit = "embeddings";
    if (name.rfind("layers.", 0) == 0)
      unit = name.substr(0, name.find('.', 7));
    else if (name.rfind("tok_embeddings", 0) != 0)
      unit = "head";
    const bool converted =
        std::find(plan.converted.begin(), plan.converted.end(), i) != plan.converted.end();
    const bool f8 = float8 && converted;
    units[unit].first += numel * (f8 ? 1 : esize);
    if (converted) lin += 2.0 * 2.0 * static_cast<double>(numel * (f8 ? 1 : esize));  // blocks
    units[unit].second = units[unit].second || f8;
  }
  double total = 0;
  for (auto& [unit, u] : units) {
    const int64_t row = u.second ? (u.first + 15) / 16 * 16 : u.first;
    total += 2.0 * static_cast<double>(row) * (unit.rfind("layers.", 0) == 0 ? 2 : 1);
  }
  if (linears) *linears = lin;
  return total;
}

int64_t n_layers() {
  JobConfig cfg = default_config();
  cfg.model.name = "llama3";
  cfg.model.flavor = "debugmodel";
  return build_model(cfg, at::kCPU)->info().n_layers;
}

}  // namespace

TEST_CASE("FSDP float8 all-gather: FSDP 2 equals the high-precision gather bit for bit and 1 rank",
          "[float8][dist][app][compile]") {
  test::TempDir dir("f8_fsdp");
  struct Run {
    std::string name, args;
    bool two_ranks;
    test::CmdResult r;
    std::map<int64_t, Step> m;
  };
  const std::string steps = "--training.steps " + std::to_string(kSteps) + " ";
  // bf16 compute on the CPU comes with compile.enable (the CPU capture check, in the GPU
  // step's dtype): those runs are the capture check of FSDP 2 with both flags too.
  const std::string bf16 = "--training.mixed_precision_param bfloat16 --compile.enable true ";
  // 1 rank: the same 2-sequence micro-batches as each FSDP rank's (2 accumulated), so the
  // activations' tensorwise float8 scales (an amax over the micro-batch) are the same.
  std::vector<Run> runs = {
      {"one",
       "--training.local_batch_size 2 --training.global_batch_size 4 " + kGather + kPre,
       false,
       {},
       {}},
      {"hp", "--training.local_batch_size 2 ", true, {}, {}},
      {"f8", "--training.local_batch_size 2 " + kGather, true, {}, {}},
      {"f8pre", "--training.local_batch_size 2 " + kGather + kPre, true, {}, {}},
      {"hp_bf16", "--training.local_batch_size 2 " + bf16, true, {}, {}},
      {"f8_bf16", "--training.local_batch_size 2 " + bf16 + kGather + kPre, true, {}, {}},
  };
  std::map<std::string, Run*> by;
  for (Run& run : runs) {
    const std::string args = steps + run.args + "--job.dump_folder " + dir.file(run.name);
    run.r = run.two_ranks ? torchrun_train(args) : single_train(args);
    INFO(run.name << "\n" << tail(run.r.out));
    REQUIRE(run.r.rc == 0);
    run.m = read_metrics(dir.file(run.name));
    REQUIRE(run.m.size() == static_cast<size_t>(kSteps));
    by[run.name] = &run;
  }
  CHECK_THAT(by["one"]->r.out, Contains("enable_fsdp_float8_all_gather has nothing to gather"));
  CHECK_THAT(by["f8"]->r.out, Contains("float8 all-gather of") &&
                                  Contains("one amax all-reduce per unit at each forward gather"));
  CHECK_THAT(by["f8pre"]->r.out, Contains("precomputed after each optimizer step"));
  CHECK_THAT(by["hp"]->r.out, !Contains("float8 all-gather of"));

  // Tolerance 0: the same e4m3 weights (global amax, elementwise cast) and the same GEMMs.
  for (const char* name : {"f8", "f8pre"}) {
    INFO(name);
    for (auto& [step, s] : by["hp"]->m) {
      INFO("step " << step);
      CHECK(by[name]->m.at(step).loss == s.loss);
      CHECK(by[name]->m.at(step).grad_norm == s.grad_norm);
    }
  }
  // Against 1 rank: the reduce-scatter sums in another order (the layouts' 1e-5 bound).
  const auto [loss_rel, norm_rel] = worst_rel(by["one"]->m, by["f8pre"]->m);
  WARN(
      "FSDP 2 with float8 all-gather + precomputed scales vs 1 rank float8, max relative "
      "difference over "
      << kSteps << " steps: loss " << loss_rel << ", grad norm " << norm_rel);
  CHECK(loss_rel < 1e-5);
  CHECK(norm_rel < 1e-5);
  // bf16 compute: the float8 weight is cast from the fp32 master (torchao), not from its bf16
  // copy: close, not equal.
  const auto [bl, bn] = worst_rel(by["hp_bf16"]->m, by["f8_bf16"]->m);
  WARN("bf16 compute, float8 all-gather vs the bf16 gather: loss " << bl << ", grad norm " << bn);
  CHECK(bl < 1e-2);

  // All-gather bytes per step (the figures print with 0.1 KiB: tolerance 0.5%).
  struct Bytes {
    const char* run;
    int64_t esize;
    bool float8;
  };
  std::map<std::string, double> measured;
  for (const Bytes& b : {Bytes{"hp", 4, false}, Bytes{"f8", 4, true}, Bytes{"hp_bf16", 2, false},
                         Bytes{"f8_bf16", 2, true}}) {
    const Comm c = comm_of(by[b.run]->r.out, "all-gather");
    const double want = expected_all_gather_bytes(b.esize, b.float8);
    INFO(b.run << ": measured " << c.bytes << " bytes per step, expected " << want);
    CHECK(std::abs(c.bytes - want) <= 0.005 * want);
    measured[b.run] = c.bytes;
  }
  // The converted linears' share: 1 byte per element against 2 (bf16); the rest (embedding,
  // output, norms) is gathered as before.
  double lin_bf16 = 0, lin_f8 = 0;
  expected_all_gather_bytes(2, false, &lin_bf16);
  expected_all_gather_bytes(2, true, &lin_f8);
  WARN("all-gather KiB per step on a rank: fp32 "
       << measured["hp"] / 1024 << ", float8 gather " << measured["f8"] / 1024 << " ("
       << measured["f8"] / measured["hp"] << " of fp32); bf16 " << measured["hp_bf16"] / 1024
       << ", float8 gather " << measured["f8_bf16"] / 1024 << " ("
       << measured["f8_bf16"] / measured["hp_bf16"]
       << " of bf16); of which the float8 linears' "
          "weights: bf16 "
       << lin_bf16 / 1024 << ", float8 " << lin_f8 / 1024 << " KiB");
  CHECK(lin_f8 == 0.5 * lin_bf16);
  CHECK(measured["f8_bf16"] < measured["hp_bf16"]);
  CHECK(std::abs((measured["hp_bf16"] - measured["f8_bf16"]) - 0.5 * lin_bf16) <=
        0.005 * measured["hp_bf16"]);
  for (const char* name : {"hp_bf16", "f8_bf16"}) {
    INFO(name);
    CHECK_THAT(by[name]->r.out,
               Contains("capture check: " + std::to_string(kSteps - 2) + " steps compared"));
  }

  // The amax all-reduces: the run without the float8 gather has the step's own (the norm and
  // the logged losses); per unit and forward gather, one more per block; precomputed, one per
  // step plus the first step's (computed at its first gather).
  const double base = comm_of(by["hp"]->r.out, "all-reduce").calls;
  const double dynamic = comm_of(by["f8"]->r.out, "all-reduce").calls;
  const double pre = comm_of(by["f8pre"]->r.out, "all-reduce").calls;
  WARN("all-reduces per step: without the float8 gather " << base << ", with it " << dynamic
                                                          << ", with precomputed scales " << pre);
  CHECK(dynamic == Approx(base + static_cast<double>(n_layers())).margin(0.06));
  CHECK(pre == Approx(base + (kSteps + 1.0) / kSteps).margin(0.06));
}

TEST_CASE("FSDP float8 all-gather: a run with precomputed scales resumes exactly",
          "[float8][dist][app]") {
  test::TempDir dir("f8_fsdp_resume");
  const std::string args = "--training.steps 8 --training.local_batch_size 2 " + kGather + kPre +
                           "--checkpoint.enable --checkpoint.interval 4 --job.dump_folder " +
                           dir.file("run");
  auto first = torchrun_train(args);
  INFO(tail(first.out));
  REQUIRE(first.rc == 0);
  auto straight = test::losses(dir.file("run"));
  REQUIRE(straight.size() == 8);
  // Back to the step-4 checkpoint: the first gather after the load computes the scales from
  // the loaded shards, those the straight run precomputed after step 4.
  fs::remove_all(dir.file("run") + "/checkpoint/step-8");
  auto resumed = torchrun_train(args);
  INFO(tail(resumed.out));
  REQUIRE(resumed.rc == 0);
  CHECK_THAT(resumed.out, Contains("resumed from"));
  auto again = test::losses(dir.file("run"));
  for (int64_t s = 5; s <= 8; ++s) {
    INFO("step " << s);
    CHECK(again[s] == straight[s]);  // exact
  }
}

// Full activation checkpointing recomputes each block on detached copies of its saved weights;
// they keep the float8 mark and the gathered e4m3 weight (copy_float8_mark), so the recompute
// and its backward are the float8 ones. Tolerance 0: 1 rank with full checkpointing equals
// 1 rank without; FSDP 2 with the float8 gather equals the high-precision gather with it.
TEST_CASE("FSDP float8 all-gather: full activation checkpointing recomputes in float8",
          "[float8][dist][app]") {
  test::TempDir dir("f8_fsdp_ac");
  const std::string common = "--training.steps 3 --training.local_batch_size 2 ";
  std::map<std::string, std::map<int64_t, Step>> m;
  for (const std::string ac : {"none", "full"}) {
    auto r = single_train(common + "--activation_checkpoint.mode " + ac + " --job.dump_folder " +
                          dir.file("one_" + ac));
    INFO(tail(r.out));
    REQUIRE(r.rc == 0);
    m["one_" + ac] = read_metrics(dir.file("one_" + ac));
  }
  for (const std::string v : {"hp", "f8"}) {
    auto r = torchrun_train(common + "--activation_checkpoint.mode full " +
                            (v == "f8" ? kGather + kPre : std::string()) + "--job.dump_folder " +
                            dir.file(v));
    INFO(tail(r.out));
    REQUIRE(r.rc == 0);
    m[v] = read_metrics(dir.file(v));
  }
  for (int64_t s = 1; s <= 3; ++s) {
    INFO("step " << s);
    CHECK(m["one_full"].at(s).loss == m["one_none"].at(s).loss);
    CHECK(m["one_full"].at(s).grad_norm == m["one_none"].at(s).grad_norm);
    CHECK(m["f8"].at(s).loss == m["hp"].at(s).loss);
    CHECK(m["f8"].at(s).grad_norm == m["hp"].at(s).grad_norm);
  }
}
