// torchtitan's train configs load unchanged. The first test writes its own configs with every
// key and section that torchtitan v0.2.2's llama3 / llama4 / deepseek_v3 configs use (and
// v0.1's spellings of them); the optional last one loads the real shipped configs from a git
// clone of pytorch/torchtitan named by TITAN_TORCHTITAN_SRC (README "Tests"), and is skipped
// when that is unset: the torchtitan wheel the venv holds ships no train_configs TOMLs.
#include <catch2/catch.hpp>

#include <filesystem>
#include <regex>

#include <toml++/toml.h>

#include "core/config/config.h"
#include "core/base/errors.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

CliResult parse(std::vector<std::string> args) {
  std::vector<const char*> argv{"titan-train"};
  for (auto& a : args) argv.push_back(a.c_str());
  return parse_command_line(static_cast<int>(argv.size()), argv.data());
}

test::CmdResult titan_run(const std::string& args) {
  return test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                   test::binary() + " " + args);
}

// How many warnings mention `text`.
int warned(const std::vector<std::string>& warnings, const std::string& text) {
  return static_cast<int>(std::count_if(warnings.begin(), warnings.end(), [&](auto& w) {
    return w.find(text) != std::string::npos;
  }));
}

// Every key and section of torchtitan v0.2.2's llama3/llama4/deepseek_v3 train configs.
const char* kV022 = R"(
[job]
dump_folder = "./outputs-v022"
description = "every v0.2.2 key"
print_config = true

[profiling]
enable_profiling = true
save_traces_folder = "traces"
profile_freq = 50
enable_memory_snapshot = false
save_memory_snapshot_folder = "snapshots"

[metrics]
log_freq = 5
disable_color_printing = true
enable_tensorboard = true
save_tb_folder = "board"
enable_wandb = false

[model]
name = "deepseek_v3"
flavor = "16B"
hf_assets_path = "./assets/hf/some-model"
converters = []

[optimizer]
name = "AdamW"
lr = 2.2e-4
eps = 1e-15

[lr_scheduler]
warmup_steps = 2_000
decay_ratio = 0.8
decay_type = "cosine"
min_lr_factor = 0.1

[training]
local_batch_size = 4
seq_len = 4096
max_norm = 1  # an integer where a float is expected
steps = 10_000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "1F1B"
context_parallel_degree = 1
expert_parallel_degree = 8
expert_tensor_parallel_degree = 1

[checkpoint]
enable = true
folder = "ckpt"
interval = 500
last_save_model_only = true
export_dtype = "bfloat16"
async_mode = "disabled"

[activation_checkpoint]
mode = "selective"
selective_ac_option = 'op'

[compile]
enable = true
components = ["loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
filter_fqns = ["output", "router.gate"]

[quantize.grouped_mm.float8]
fqns = ["experts"]

[quantize.linear.mx]
filter_fqns = ["output"]

[quantize.grouped_mm.mx]
fqns = ["experts"]

[validation]
enable = false
dataset = "c4_validation"
freq = 500
steps = 1200
)";

// torchtitan v0.1's spellings of the same settings, plus its other keys.
const char* kV01 = R"(
[job]
dump_folder = "./outputs-v01"
print_args = true
use_for_integration_test = true

[model]
name = "llama3"
flavor = "8B"
tokenizer_path = "./assets/tokenizer/original/tokenizer.model"

[optimizer]
implementation = "foreach"

[lr_scheduler]
lr_min = 0.1

[training]
batch_size = 2
compile = true
seed = 7
deterministic = true

[checkpoint]
enable_checkpoint = true
last_save_model_weights_only = true
initial_load_model_weights_only = false

[float8]
enable_fsdp_float8_all_gather = false
filter_fqns = ["output"]

[experimental]
custom_args_module = ""
)";

}  // namespace

TEST_CASE("torchtitan-configs: every key of torchtitan's configs loads, warns once and dumps",
          "[torchtitan-configs]") {
  test::TempDir dir("ttcfg");
  test::write_file(dir.file("v022.toml"), kV022);
  test::write_file(dir.file("v01.toml"), kV01);

  // v0.2.2: every key is read; the five ignored keys or sections warn once each.
  auto a = parse({"--config", dir.file("v022.toml")});
  INFO([&] {
    std::string s;
    for (auto& w : a.warnings) s += w + "\n";
    return s;
  }());
  // The switches of features titan-train lacks (enable_memory_snapshot, enable_wandb) are
  // accepted silently at their default; any other value exits 2 (below).
  CHECK(a.warnings.size() == 3);
  for (const char* k : {"profiling.save_memory_snapshot_folder", "quantize.linear.mx.*",
                        "quantize.grouped_mm.mx.*"})
    CHECK(warned(a.warnings, k) == 1);
  CHECK(warned(a.warnings, "v022.toml:") == 3);  // each names the file and line
  const JobConfig& c = a.cfg;
  CHECK(c.profiling.enable_profiling);
  CHECK(c.profiling.save_traces_folder == "traces");
  CHECK(c.profiling.profile_freq == 50);
  CHECK(c.job.print_config);
  CHECK(c.model.flavor == "16B");
  CHECK(c.optimizer.eps == 1e-15);
  CHECK(c.lr_scheduler.warmup_steps == 2000);
  CHECK(c.lr_scheduler.min_lr_factor == 0.1);
  CHECK(c.training.max_norm == 1.0);
  CHECK(c.training.dataset == "c4");
  CHECK(c.parallelism.expert_parallel_degree == 8);
  CHECK(c.checkpoint.last_save_model_only);
  CHECK(c.activation_checkpoint.selective_ac_option == "op");
  CHECK(c.compile.components == std::vector<std::string>{"loss"});
  CHECK(c.validation.dataset == "c4_validation");
  // The float8 section is read (and inert while model.converters is empty, as in torchtitan).
  CHECK(c.float8.enable_fsdp_float8_all_gather);
  CHECK(c.float8.filter_fqns == std::vector<std::string>{"output", "router.gate"});
  CHECK(c.float8.grouped_mm_fqns == std::vector<std::string>{"experts"});
  CHECK_NOTHROW(validate_config(c));  // ep 8 and validation.dataset wait for launch
  CHECK_THROWS_WITH(validate_for_world(c, 1), Contains("expert_parallel_degree = 8"));
  CHECK_NOTHROW(validate_for_world(c, 8));

  // v0.1: old names set the same fields and each warns once, naming the current name, also
  // when the command line repeats them.
  auto b = parse({"--config", dir.file("v01.toml"), "--job.print_args", "--training.compile=true",
                  "--float8.filter_fqns", "output"});
  INFO([&] {
    std::string s;
    for (auto& w : b.warnings) s += w + "\n";
    return s;
  }());
  const std::vector<std::pair<std::string, std::string>> renamed = {
      {"job.print_args", "job.print_config"},
      {"lr_scheduler.lr_min", "lr_scheduler.min_lr_factor"},
      {"training.batch_size", "training.local_batch_size"},
      {"training.compile", "compile.enable"},
      {"training.seed", "debug.seed"},
      {"training.deterministic", "debug.deterministic"},
      {"checkpoint.enable_checkpoint", "checkpoint.enable"},
      {"checkpoint.last_save_model_weights_only", "checkpoint.last_save_model_only"},
      {"checkpoint.initial_load_model_weights_only", "checkpoint.initial_load_model_only"},
      {"float8.enable_fsdp_float8_all_gather",
       "quantize.linear.float8.enable_fsdp_float8_all_gather"},
      {"float8.filter_fqns", "quantize.linear.float8.filter_fqns"}};
  for (auto& [old_name, name] : renamed) {
    INFO(old_name);
    CHECK(warned(b.warnings,
                 old_name + " is an older torchtitan name; the current name is " + name) == 1);
  }
  CHECK(b.warnings.size() == renamed.size());
  const JobConfig& o = b.cfg;
  CHECK(o.job.print_config);
  CHECK(o.job.use_for_integration_test);
  CHECK(o.lr_scheduler.min_lr_factor == 0.1);
  CHECK(o.training.local_batch_size == 2);
  CHECK(o.compile.enable);
  CHECK(o.debug.seed == 7);
  CHECK(o.debug.deterministic);
  CHECK(o.checkpoint.enable);
  CHECK(o.checkpoint.last_save_model_only);
  CHECK_FALSE(o.checkpoint.initial_load_model_only);
  CHECK(o.optimizer.implementation == "foreach");

  // The dumps use the current names only, load back without warnings to the same dump.
  for (const CliResult* r : {&a, &b}) {
    std::string d1 = dump_config_toml(r->cfg);
    test::write_file(dir.file("dump.toml"), d1);
    auto back = parse({"--config", dir.file("dump.toml")});
    CHECK(back.warnings.empty());
    CHECK(dump_config_toml(back.cfg) == d1);
  }

  // The binary: --dump-config exits 0 for both, with the same warnings on stderr.
  for (const char* f : {"v022.toml", "v01.toml"}) {
    auto r = titan_run("--config " + dir.file(f) + " --dump-config");
    INFO(r.out);
    CHECK(r.rc == 0);
    CHECK_THAT(r.out, Contains("selective_ac_option = "));
  }
  auto r = titan_run("--config " + dir.file("v022.toml") + " --dump-config");
  CHECK(std::regex_search(r.out, std::regex("warning: .*quantize\\.linear\\.mx\\.\\*")));
}

TEST_CASE("torchtitan-configs: every key of torchtitan 0.2.2's JobConfig is known",
          "[torchtitan-configs]") {
  // The installed torchtitan's JobConfig dataclass, walked by test/reference/torchtitan_keys.py.
  auto r =
      test::run(test::python() + " " + test::source_dir() + "/test/reference/torchtitan_keys.py");
  INFO(r.out.substr(0, 2000));
  REQUIRE(r.rc == 0);
  std::stringstream ss(r.out);
  int n = 0;
  for (std::string key; std::getline(ss, key);) {
    INFO(key);
    ++n;
    // An option (possibly one accepted only at its default), or one of the ignored keys.
    CHECK((find_option(key) != nullptr || is_ignored_torchtitan_key(key)));
  }
  CHECK(n > 100);
}

TEST_CASE("torchtitan-configs: unsupported parallelism or quantization exits 2 naming the key",
          "[torchtitan-configs]") {
  test::TempDir dir("ttlater");
  struct Case {
    std::string toml, key, feature;
  };
  std::vector<Case> cases = {
      {"[model]\nconverters = [\"float8\"]\n[quantize.linear.float8]\n"
       "enable_fsdp_float8_all_gather = true\nrecipe_name = \"rowwise\"\n",
       "quantize.linear.float8.enable_fsdp_float8_all_gather", "tensorwise scales only"},
      {"[model]\nname = \"deepseek_v3\"\nconverters = [\"quantize.grouped_mm.float8\"]\n"
       "[quantize.grouped_mm.float8]\nfqns = [\"experts\"]\n[parallelism]\n"
       "tensor_parallel_degree = 2\nexpert_tensor_parallel_degree = 2\n",
       "parallelism.expert_tensor_parallel_degree", "quantize.grouped_mm.float8"},
      {"[parallelism]\nenable_async_tensor_parallel = true\n",
       "parallelism.enable_async_tensor_parallel", "tensor_parallel_degree = 1"},
      {"[parallelism]\ncontext_parallel_rotate_method = \"alltoall\"\n",
       "parallelism.context_parallel_rotate_method", "alltoall"},
      // The first one in the file is named.
      {"[model]\nconverters = [\"mx\"]\n[parallelism]\ntensor_parallel_degree = 8\n",
       "model.converters", "mx"},
  };
  for (auto& c : cases) {
    INFO(c.toml);
    test::write_file(dir.file("x.toml"), c.toml);
    auto r = titan_run("--config " + dir.file("x.toml") + " --dump-config");
    INFO(r.out);
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains(c.key) && Contains(c.feature) &&
                          (Contains("titan-train does not support yet") ||
                           Contains("is not implemented yet") || Contains("is not allowed")));
    CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
  }
  // Context parallelism is accepted (test/parallel/test_context_parallel.cpp trains it).
  auto r = titan_run("--parallelism.context_parallel_degree 2 --dump-config");
  CHECK(r.rc == 0);
  CHECK_THAT(r.out, Contains("context_parallel_degree = 2"));
  // Tensor parallelism is accepted; the experts' degree must be 1 or tp (torchtitan 0.2.2).
  auto tp = titan_run("--parallelism.tensor_parallel_degree 8 "
                      "--parallelism.expert_tensor_parallel_degree 8 --dump-config");
  CHECK(tp.rc == 0);
  CHECK_THAT(tp.out, Contains("tensor_parallel_degree = 8"));
  auto etp = titan_run("--parallelism.tensor_parallel_degree 8 "
                       "--parallelism.expert_tensor_parallel_degree 4 --dump-config");
  CHECK(etp.rc == 2);
  CHECK_THAT(etp.out, Contains("parallelism.expert_tensor_parallel_degree = 4 is not allowed; "
                               "allowed: 1 or tensor_parallel_degree (8)"));
  // Expert tensor parallelism with expert parallelism (ep x etp) is accepted
  // (test/parallel/test_dist.cpp trains it).
  auto epx = titan_run(
      "--parallelism.tensor_parallel_degree 2 "
      "--parallelism.expert_tensor_parallel_degree 2 "
      "--parallelism.expert_parallel_degree 2 --dump-config");
  CHECK(epx.rc == 0);
  CHECK_THAT(epx.out, Contains("expert_tensor_parallel_degree = 2"));
}

namespace {

// A git clone of pytorch/torchtitan with the v0.2.2 and v0.1.0 tags, or "" when none is named.
std::string torchtitan_src() {
  const char* e = std::getenv("TITAN_TORCHTITAN_SRC");
  return e ? e : "";
}

// The keys that make a config need what titan-train does not have yet, and their values.
std::vector<std::string> unsupported_keys(const std::string& text) {
  std::vector<std::string> out;
  toml::table t = toml::parse(text);
  // Float8 linears run, with the FSDP float8 all-gather and under tensor parallelism.
  if (t["parallelism"]["context_parallel_rotate_method"].value_or<std::string>("allgather") ==
      "alltoall")
    out.push_back("parallelism.context_parallel_rotate_method");
  const int64_t tp = t["parallelism"]["tensor_parallel_degree"].value_or<int64_t>(1);
  const int64_t etp = t["parallelism"]["expert_tensor_parallel_degree"].value_or<int64_t>(1);
  if (etp != 1 && etp != tp) out.push_back("parallelism.expert_tensor_parallel_degree");
  return out;
}

}  // namespace

TEST_CASE("torchtitan-configs: torchtitan's shipped configs load with --dump-config",
          "[torchtitan-configs]") {
  const std::string repo = torchtitan_src();
  if (repo.empty())
    TITAN_SKIP("optional: set TITAN_TORCHTITAN_SRC to a git clone of pytorch/torchtitan");
  // A named clone that is not there is a mistake, not a skip.
  REQUIRE(fs::is_directory(repo));
  test::TempDir dir("ttship");
  const std::string git = "git -C " + test::shell_quote(repo) + " ";
  struct Release {
    std::string tag, pattern;
  };
  // v0.1's deepseek_v2.toml names model "deepseek_v2", which is no titan-train model.
  const std::vector<Release> releases = {
      {"v0.2.2", "^torchtitan/models/(llama3|llama4|deepseek_v3)/train_configs/.*\\.toml$"},
      {"v0.1.0", "^torchtitan/(models/llama3|experiments/llama4)/train_configs/.*\\.toml$"}};
  int loaded = 0, later = 0;
  for (auto& rel : releases) {
    auto ls = test::run(git + "ls-tree -r --name-only " + rel.tag);
    REQUIRE(ls.rc == 0);
    std::stringstream ss(ls.out);
    for (std::string path; std::getline(ss, path);) {
      if (!std::regex_search(path, std::regex(rel.pattern))) continue;
      INFO(rel.tag << ":" << path);
      const std::string file = dir.file("cfg.toml");
      REQUIRE(test::run(git + "show " + rel.tag + ":" + path + " > " + file).rc == 0);
      const auto unsupported = unsupported_keys(test::read_file(file));
      auto r = titan_run("--config " + file + " --dump-config");
      INFO(r.out.substr(0, 3000));
      if (unsupported.empty()) {
        CHECK(r.rc == 0);
        CHECK_THAT(r.out, Contains("[training]"));
        ++loaded;
      } else {
        CHECK(r.rc == 2);
        bool named = false;
        for (auto& k : unsupported) named |= r.out.find(k + " = ") != std::string::npos;
        CHECK(named);
        CHECK_THAT(r.out, Contains("does not support yet") || Contains("is not implemented yet"));
        ++later;
      }
    }
  }
  WARN(loaded << " shipped configs load, " << later << " need PP/CP, async TP or float8 (exit 2)");
  CHECK(loaded >= 7);
}

TEST_CASE(
    "torchtitan 0.2.2's tensor-parallel configs: 70B, 17Bx16E and 405B (float8 linears with TP 8, "
    "async TP, the float8 all-gather) load, 405B's estimate runs at world 512; 17Bx128E's "
    "pipeline plans",
    "[torchtitan-configs][tp]") {
  // Fixtures with the keys and values of the shipped files (test/core/config/torchtitan_v022).
  const std::string dir = test::source_dir() + "/test/core/config/torchtitan_v022/";
  for (const char* f : {"llama3_70b.toml", "llama4_17bx16e.toml", "llama3_405b.toml"}) {
    auto r = titan_run("--config " + dir + f + " --dump-config");
    INFO(f << "\n" << r.out.substr(0, 3000));
    CHECK(r.rc == 0);
    CHECK_THAT(r.out, Contains("tensor_parallel_degree = 8"));
  }
  auto a = parse({"--config", dir + "llama4_17bx16e.toml"});
  CHECK(a.cfg.parallelism.tensor_parallel_degree == 8);
  CHECK(a.cfg.parallelism.expert_tensor_parallel_degree == 8);
  // 405B as shipped (float8 linears, TP 8 with async TP, FSDP's float8 all-gather with
  // precomputed scales): its layout passes the checks of a 512-rank world (dp_shard -1 -> 64)
  // and estimate plans it there.
  const std::string big = "--config " + dir + "llama3_405b.toml";
  auto b = parse({"--config", dir + "llama3_405b.toml"});
  CHECK(b.cfg.parallelism.enable_async_tensor_parallel);
  CHECK(b.cfg.float8.enable_fsdp_float8_all_gather);
  CHECK_NOTHROW(validate_for_world(b.cfg, 512));
  auto est405 = titan_run("estimate " + big + " --world 512");
  INFO(est405.out);
  CHECK(est405.rc == 0);
  CHECK_THAT(est405.out, Contains("dp_shard 64 x tp 8") && Contains("step time: "));
  WARN("llama3 405B (torchtitan v0.2.2's config) estimate at world 512:\n" << est405.out);
  // 17Bx128E gets past the pipeline keys: --dump-config loads it, its layout (PP 4 x FSDP 8
  // x TP 8 with expert TP 8) passes the checks of a 256-rank world, estimate plans it there,
  // and --dump-schedule plans it (its local_batch_size 1 is 1 micro-batch, too few for 1F1B
  // over 4 stages, as in PyTorch; 4 sequences are enough).
  const std::string maverick = "--config " + dir + "llama4_17bx128e.toml";
  auto dump = titan_run(maverick + " --dump-config");
  CHECK(dump.rc == 0);
  CHECK_THAT(dump.out, Contains("pipeline_parallel_degree = 4"));
  auto mav = parse({"--config", dir + "llama4_17bx128e.toml", "--training.local_batch_size", "4"});
  CHECK_NOTHROW(validate_for_world(mav.cfg, 256));
  auto est = titan_run("estimate " + maverick + " --world 256 --training.local_batch_size 4");
  INFO(est.out);
  CHECK(est.rc == 0);
  CHECK_THAT(est.out, Contains("plan: pp 4 x dp_replicate 1 x dp_shard 8 x tp 8; 1F1B") &&
                          Contains("stage 3, gathered weights") && Contains("step time: "));
  auto few = titan_run(maverick + " --dump-schedule");
  INFO(few.out);
  CHECK(few.rc == 2);
  CHECK_THAT(few.out, Contains("parallelism.pipeline_parallel_microbatch_size"));
  auto plan = titan_run(maverick + " --dump-schedule --training.local_batch_size 4");
  INFO(plan.out);
  CHECK(plan.rc == 0);
  CHECK_THAT(plan.out, Contains("0      0     tok_embeddings, layers.0-11") &&
                           Contains("3      3     layers.37-47, norm, output"));
}
