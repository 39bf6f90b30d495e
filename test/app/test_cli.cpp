// The binary's contract for bad input: one clear message naming the key or file, exit
// status 2, and nothing written. Also --help and the configs/ files.
#include <catch2/catch.hpp>

#include <filesystem>

#include "core/config/config.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {
test::CmdResult titan_run(const std::string& args) {
  return test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                   test::binary() + " " + args);
}
}  // namespace

TEST_CASE("cli: --help lists every key with type and default", "[cli]") {
  auto r = titan_run("--help");
  REQUIRE(r.rc == 0);
  for (auto& o : registry()) {
    INFO(o.name());
    CHECK_THAT(r.out, Contains("--" + o.name() + " <" + opt_type_name(o.type) + ">"));
  }
}

TEST_CASE("cli: every bad-input class exits 2 naming the key or file and writes nothing", "[cli]") {
  test::TempDir dir("cli");
  std::string dump = dir.file("out");
  std::string common = "--job.dump_folder " + dump + " ";
  test::write_file(dir.file("syntax.toml"), "[training]\nsteps = 3\nseq_len = = 4\n");
  test::write_file(dir.file("unknown.toml"), "[training]\nsteps = 3\nsequence_len = 4\n");
  test::write_file(dir.file("section.toml"), "[trainer]\nsteps = 3\n");
  test::write_file(dir.file("type.toml"), "[optimizer]\nlr = \"fast\"\n");
  test::write_file(dir.file("range.toml"), "[optimizer]\nbeta1 = 1.5\n");
  test::write_file(dir.file("batch.toml"),
                   "[training]\nlocal_batch_size = 4\nglobal_batch_size = 6\n");
  struct Case {
    std::string args;
    std::vector<std::string> expect;
  };
  std::vector<Case> cases = {
      {"--config " + dir.file("missing.toml"), {"missing.toml", "cannot be read"}},
      {"--config " + dir.path.string(), {"cannot be read"}},  // a folder is unreadable as TOML
      {"--config " + dir.file("syntax.toml"), {"syntax.toml:3:", "TOML syntax error"}},
      {"--config " + dir.file("unknown.toml"), {"training.sequence_len", "training.seq_len"}},
      {"--config " + dir.file("section.toml"), {"[trainer]", "[training]"}},
      {"--config " + dir.file("type.toml"), {"optimizer.lr", "expected float", "string"}},
      {"--config " + dir.file("range.toml"), {"optimizer.beta1 = 1.5", "0.0 <= value <= 1.0"}},
      {"--config " + dir.file("batch.toml"), {"global_batch_size = 6", "multiple of 4"}},
      {"--training.stepz 3", {"--training.stepz", "--training.steps"}},
      {"--training.steps ten", {"training.steps", "expected int"}},
      {"--training.steps 0", {"training.steps = 0", "value >= 1"}},
      {"--lr_scheduler.decay_type exp", {"decay_type", "linear, sqrt, cosine"}},
      {"--model.name gpt2", {"model.name", "llama3"}},
  };
  for (auto& c : cases) {
    INFO(c.args);
    auto r = titan_run(common + c.args);
    INFO(r.out);
    CHECK(r.rc == 2);
    for (auto& e : c.expect) CHECK_THAT(r.out, Contains(e));
    CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);  // one message, one line
    CHECK_FALSE(fs::exists(dump));
  }
}

TEST_CASE("cli: every config under configs/ loads and dumps", "[cli]") {
  int n = 0;
  for (auto& e : fs::directory_iterator(test::source_dir() + "/configs")) {
    if (e.path().extension() != ".toml") continue;
    ++n;
    INFO(e.path());
    auto r = titan_run("--config " + e.path().string() + " --dump-config");
    INFO(r.out);
    CHECK(r.rc == 0);
    CHECK_THAT(r.out, Contains("[training]"));
  }
  CHECK(n >= 2);
}

TEST_CASE("cli: the README configuration reference matches the registry", "[cli]") {
  std::string readme = test::read_file(test::source_dir() + "/README.md");
  const std::string begin = "<!-- config-reference:begin -->\n";
  const std::string end = "<!-- config-reference:end -->";
  auto b = readme.find(begin);
  auto e = readme.find(end);
  REQUIRE(b != std::string::npos);
  REQUIRE(e != std::string::npos);
  std::string section = readme.substr(b + begin.size(), e - b - begin.size());
  INFO("regenerate with scripts/update_readme_reference.sh");
  CHECK(section == config_reference_markdown());
}

TEST_CASE("cli: values are taken only by keys that expect one; --key= is an empty value", "[cli]") {
  // What the dump says about one key: the text after "key = " in its [section].
  auto dumped = [](const std::string& out, const std::string& section, const std::string& key) {
    auto s = out.find("[" + section + "]\n");
    if (s == std::string::npos) return std::string("(no section)");
    auto k = out.find("\n" + key + " = ", s);
    if (k == std::string::npos) return std::string("(no key)");
    k += key.size() + 4;
    return out.substr(k, out.find('\n', k) - k);
  };
  struct Case {
    std::string args, section, key, value;
  };
  std::vector<Case> ok = {
      {"--validation.dataset= --dump-config", "validation", "dataset", "''"},
      {"--model.flavor=8B --validation.dataset=", "validation", "dataset", "''"},
      {"--checkpoint.enable --dump-config", "checkpoint", "enable", "true"},
      {"--checkpoint.enable false", "checkpoint", "enable", "false"},
      {"--checkpoint.enable=off", "checkpoint", "enable", "false"},
      {"--lr_scheduler.decay_ratio -1", "lr_scheduler", "decay_ratio", "-1.0"},
      {"--training.dataset_path a.txt b.tok", "training", "dataset_path", "['a.txt', 'b.tok']"},
      {"--training.dataset_path=a.txt,b.tok", "training", "dataset_path", "['a.txt', 'b.tok']"},
      {"--training.dataset_path a.txt --training.dataset_path=", "training", "dataset_path",
       "['a.txt']"},
      {"--training.dataset_path=", "training", "dataset_path", "[]"},
      {"--training.dataset_weights 1,2.5 --training.dataset_path a b", "training",
       "dataset_weights", "[1.0, 2.5]"},
      {"--validation.dataset_path v.txt", "validation", "dataset_path", "['v.txt']"},
      // An ignored torchtitan key swallows its value; an old name sets the current key.
      {"--profiling.enable_memory_snapshot true --training.steps 3", "training", "steps", "3"},
      {"--profiling.profile_freq 5", "profiling", "profile_freq", "5"},
      {"--job.print_args", "job", "print_config", "true"},
      // Degrees against the world are a launch check: --dump-config has no world.
      {"--parallelism.expert_parallel_degree 8", "parallelism", "expert_parallel_degree", "8"},
  };
  for (auto& c : ok) {
    INFO(c.args);
    auto r = titan_run(c.args + " --dump-config");
    INFO(r.out);
    CHECK(r.rc == 0);
    CHECK(dumped(r.out, c.section, c.key) == c.value);
  }
  auto r = titan_run("--profiling.enable_memory_snapshot true --job.print_args --dump-config");
  CHECK_THAT(r.out,
             Contains("warning: command line: ignoring torchtitan key "
                      "profiling.enable_memory_snapshot") &&
                        Contains("job.print_args is an older torchtitan name; the current name "
                                 "is job.print_config"));

  struct Bad {
    std::string args;
    std::vector<std::string> expect;
  };
  std::vector<Bad> bad = {
      {"--training.steps --dump-config",
       {"--training.steps expects a int value but found the option --dump-config",
        "--training.steps="}},
      {"--model.flavor", {"--model.flavor expects a string value but found the end"}},
      {"--training.dataset_path --dump-config", {"--training.dataset_path expects a list"}},
      {"--checkpoint.enable maybe", {"unexpected argument 'maybe'"}},
      {"--training.steps=", {"training.steps", "expected int, found ''"}},
      {"--training.dataset_weights -1", {"training.dataset_weights = [-1.0]", "value >= 0.0"}},
      {"--training.dataset_weights 1,x", {"training.dataset_weights", "list of floats"}},
      {"--training.dataset_weights 1 --training.dataset_path a b",
       {"dataset_weights has 1", "has 2"}},
      {"--activation_checkpoint.selective_ac_option ops", {"selective_ac_option", "op, or"}},
  };
  for (auto& c : bad) {
    INFO(c.args);
    auto b = titan_run(c.args);
    INFO(b.out);
    CHECK(b.rc == 2);
    for (auto& e : c.expect) CHECK_THAT(b.out, Contains(e));
    CHECK(std::count(b.out.begin(), b.out.end(), '\n') == 1);
  }
  // At launch the degrees meet the world (here 1 rank), before anything is written.
  test::TempDir dir("cli-world");
  auto w = titan_run("--parallelism.expert_parallel_degree 8 --job.dump_folder " + dir.file("o"));
  CHECK(w.rc == 2);
  CHECK_THAT(w.out, Contains("expert_parallel_degree = 8") && Contains("world size 1"));
  CHECK_FALSE(fs::exists(dir.file("o")));
}

// main() maps every exception to one message and a documented status (app/fatal.h): 2 bad
// input, 3 out of memory (naming the memory and the keys that lower it), 1 internal (with
// the stack c10 attaches). The planted errors come from TITAN_PLANT_ERROR at the start of a
// run, so no test has to exhaust real memory; the CUDA out-of-memory path itself is a [gpu]
// test (test/app/test_gpu.cpp).
TEST_CASE("cli: every error ends in one message and its exit status", "[cli]") {
  test::TempDir dir("cli-fatal");
  const std::string run = "--config " + test::source_dir() +
                          "/configs/llama3_debug.toml --training.steps 1 --job.dump_folder " +
                          dir.file("out") + " --training.local_batch_size 3";
  auto planted = [&](const std::string& kind) {
    return test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK "
                     "TITAN_PLANT_ERROR=" + kind + " " + test::binary() + " " + run);
  };
  auto oom = planted("oom");
  INFO(oom.out);
  CHECK(oom.rc == 3);
  CHECK_THAT(oom.out, Contains("titan-train: out of memory: planted: tried to allocate 1.00 TiB") &&
                          Contains("the host has") && Contains("available") &&
                          Contains("training.local_batch_size (now 3)") &&
                          Contains("activation_checkpoint.mode"));
  auto internal = planted("internal");
  INFO(internal.out);
  CHECK(internal.rc == 1);
  CHECK_THAT(internal.out, Contains("titan-train: internal error: planted invariant failure"));
  CHECK_THAT(internal.out, Contains("fatal.cpp"));  // where it was raised, from c10's context
  auto other = planted("std");
  CHECK(other.rc == 1);
  CHECK_THAT(other.out, Contains("titan-train: internal error: planted std::runtime_error"));
  auto unknown = planted("nonsense");
  CHECK(unknown.rc == 2);
  CHECK_THAT(unknown.out, Contains("TITAN_PLANT_ERROR") && Contains("allowed: internal, oom, std"));
  for (const auto& r : {oom, internal, other}) CHECK_THAT(r.out, !Contains("terminate called"));
  // A device that is not there is bad input (the CPU suite runs with every GPU hidden).
  auto cuda = titan_run(run + " --training.device cuda");
  INFO(cuda.out);
  CHECK(cuda.rc == 2);
  CHECK_THAT(cuda.out, Contains("training.device = \"cuda\"") && Contains("allowed here: cpu, auto"));
}
