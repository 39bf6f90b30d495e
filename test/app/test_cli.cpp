// The binary's contract for bad input: one clear message naming the key or file, exit
// status 2, and nothing written. Also --help and the configs/ files.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include <signal.h>

#include "app/checkpointer.h"
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

// A bare `titan-train` used to start a 10,000-step run into ./outputs: it prints the usage.
TEST_CASE("cli: no arguments print a short usage; --help lists the subcommands", "[cli]") {
  test::TempDir dir("cli-bare");
  auto r = test::run("cd " + dir.path.string() + " && env -u RANK -u WORLD_SIZE " +
                     test::binary());
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK_THAT(r.out, Contains("Usage:") &&
                        Contains("Subcommands: estimate, data-preview, tokenize, convert-hf") &&
                        Contains("titan-train --config configs/llama3_debug.toml"));
  CHECK(std::count(r.out.begin(), r.out.end(), '\n') < 25);  // short: no option list
  CHECK(fs::is_empty(dir.path));                                // nothing trained or written
  auto h = titan_run("--help");
  for (const char* sub : {"titan-train estimate", "titan-train data-preview",
                          "titan-train tokenize", "titan-train convert-hf"})
    CHECK_THAT(h.out, Contains(sub));
}

TEST_CASE("cli: a UTF-8 byte-order mark at the start of a TOML file is skipped", "[cli]") {
  test::TempDir dir("cli-bom");
  test::write_file(dir.file("bom.toml"), "\xEF\xBB\xBF[training]\nsteps = 3\n");
  auto r = titan_run("--config " + dir.file("bom.toml") + " --dump-config");
  INFO(r.out);
  CHECK(r.rc == 0);  // was: "a non-ASCII byte (0xEF)", exit 2
  CHECK_THAT(r.out, Contains("\nsteps = 3\n"));
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
  test::write_file(dir.file("huge.toml"), "[training]\nlocal_batch_size = 9223372036854775807\n");
  test::write_file(dir.file("inf.toml"), "[optimizer]\nweight_decay = inf\n");
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
      // Absurd batch sizes are refused before any allocation (not "vector::reserve", exit 1).
      {"--config " + dir.file("huge.toml"),
       {"training.local_batch_size = 9223372036854775807", "local_batch_size x seq_len <="}},
      {"--training.global_batch_size 4611686018427387904",
       {"training.global_batch_size = 4611686018427387904", "global_batch_size x seq_len <="}},
      // Infinity means nothing for these (the loss only turns nan); nan was refused already.
      {"--optimizer.lr inf", {"optimizer.lr = inf", "value >= 0.0, finite"}},
      {"--config " + dir.file("inf.toml"), {"optimizer.weight_decay = inf", "finite"}},
      // Keys that cannot act name the key that turns them off (checkpoint.enable is false).
      {"--checkpoint.load_step 3", {"checkpoint.load_step = 3", "checkpoint.enable = false"}},
      {"--checkpoint.last_save_in_hf", {"last_save_in_hf = true", "checkpoint.enable = false"}},
      {"--checkpoint.initial_load_in_hf", {"initial_load_in_hf", "initial_load_path is empty"}},
      // The capacity factor sizes the static expert-parallel exchange only.
      {"--moe.ep_capacity_factor 1.25",
       {"moe.ep_capacity_factor = 1.25 has no effect", "expert_parallel_degree = 1"}},
      {"--moe.ep_capacity_factor 1.25 --parallelism.expert_parallel_degree 2",
       {"moe.ep_capacity_factor = 1.25 has no effect", "ep_exchange = \"auto\" without"}},
      // Keys that cannot act without their feature (issue 45): the drop policy without
      // expert parallelism, the pipeline keys at degree 1, the float8 recipe without its
      // converter.
      {"--moe.ep_drop_policy probs",
       {"moe.ep_drop_policy = 'probs' has no effect", "expert_parallel_degree = 1"}},
      {"--parallelism.pipeline_parallel_schedule GPipe",
       {"parallelism.pipeline_parallel_schedule = 'GPipe' has no effect",
        "pipeline_parallel_degree = 1"}},
      {"--parallelism.pipeline_parallel_layers_per_stage 2",
       {"parallelism.pipeline_parallel_layers_per_stage = 2 has no effect", "(no pipeline)"}},
      {"--parallelism.pipeline_parallel_microbatch_size 2",
       {"parallelism.pipeline_parallel_microbatch_size = 2 has no effect", "(no pipeline)"}},
      {"--parallelism.pipeline_parallel_schedule_csv x.csv",
       {"parallelism.pipeline_parallel_schedule_csv = 'x.csv' has no effect"}},
      {"--parallelism.pipeline_parallel_first_stage_less_layers 0",
       {"pipeline_parallel_first_stage_less_layers = 0 has no effect"}},
      {"--parallelism.pipeline_parallel_last_stage_less_layers 2",
       {"pipeline_parallel_last_stage_less_layers = 2 has no effect"}},
      {"--parallelism.pipeline_parallel_expert_parallel_overlap false",
       {"pipeline_parallel_expert_parallel_overlap = false has no effect"}},
      {"--parallelism.module_fqns_per_model_part 'tok_embeddings layers.0,layers.1 norm output'",
       {"parallelism.module_fqns_per_model_part = ", "has no effect"}},
      {"--quantize.linear.float8.recipe_name rowwise",
       {"quantize.linear.float8.recipe_name = 'rowwise' has no effect without the float8"}},
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
      // An ignored torchtitan key swallows its value; an old name sets the current key; a
      // torchtitan switch titan-train lacks is accepted at its default.
      {"--training.gc_freq 10 --training.steps 3", "training", "steps", "3"},
      {"--profiling.enable_memory_snapshot false --training.steps 4", "training", "steps", "4"},
      {"--profiling.profile_freq 5", "profiling", "profile_freq", "5"},
      {"--job.print_args", "job", "print_config", "true"},
      // inf keeps its meaning where the default is inf (the no-drop worst case).
      {"--moe.ep_capacity_factor inf", "moe", "ep_capacity_factor", "inf"},
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
  auto r = titan_run("--training.gc_freq 10 --job.print_args --dump-config");
  CHECK_THAT(r.out,
             Contains("warning: command line: ignoring torchtitan key "
                      "training.gc_freq") &&
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
      // torchtitan switches of features titan-train lacks: only their default (issue 41).
      {"--training.enable_cpu_offload true",
       {"training.enable_cpu_offload = true needs CPU offload", "allowed: only false"}},
      {"--fault_tolerance.enable true", {"fault_tolerance.enable = true", "TorchFT"}},
      {"--parallelism.expert_parallel_comm_backend deepep",
       {"expert_parallel_comm_backend = 'deepep'", "allowed: only 'standard'"}},
      {"--profiling.enable_memory_snapshot true", {"profiling.enable_memory_snapshot = true"}},
      {"--metrics.enable_wandb true", {"metrics.enable_wandb = true"}},
      {"--experimental.custom_import my.module", {"experimental.custom_import"}},
      {"--debug.plant_error sometimes", {"debug.plant_error", "host_read"}},
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
// the stack c10 attaches). The planted errors come from debug.plant_error at the start of a
// run, so no test has to exhaust real memory; the CUDA out-of-memory path itself is a [gpu]
// test (test/app/test_gpu.cpp).
TEST_CASE("cli: every error ends in one message and its exit status", "[cli]") {
  test::TempDir dir("cli-fatal");
  const std::string run = "--config " + test::source_dir() +
                          "/configs/llama3_debug.toml --training.steps 1 --job.dump_folder " +
                          dir.file("out") + " --training.local_batch_size 3";
  auto planted = [&](const std::string& kind) {
    return test::run("env -u RANK -u WORLD_SIZE -u SLURM_PROCID -u OMPI_COMM_WORLD_RANK " +
                     test::binary() + " " + run + " --debug.plant_error " + kind);
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
  CHECK_THAT(unknown.out, Contains("debug.plant_error") && Contains("internal, oom, std"));
  for (const auto& r : {oom, internal, other}) CHECK_THAT(r.out, !Contains("terminate called"));
  // A device that is not there is bad input (the CPU suite runs with every GPU hidden).
  auto cuda = titan_run(run + " --training.device cuda");
  INFO(cuda.out);
  CHECK(cuda.rc == 2);
  CHECK_THAT(cuda.out, Contains("training.device = \"cuda\"") && Contains("allowed here: cpu, auto"));
}

// scripts/run_train.sh runs where it is called from (relative paths and ./outputs are the
// caller's) and returns the workers' exit status without torchrun's Python traceback: bad
// input stays 2, a SIGTERM that saves cleanly is 0.
TEST_CASE("cli: run_train.sh keeps the caller's directory and returns the workers' status",
          "[cli][dist]") {
  test::TempDir dir("cli-run-train");
  {  // a relative data file, found from the caller's directory
    std::ifstream in(test::corpus_path(), std::ios::binary);
    std::string text(200000, '\0');
    in.read(&text[0], static_cast<std::streamsize>(text.size()));
    test::write_file(dir.file("data.txt"), text);
  }
  const std::string script = "env -u RANK -u WORLD_SIZE TORCHRUN=" + test::torchrun() +
                             " TITAN_BINARY=" + test::binary() + " bash " + test::source_dir() +
                             "/scripts/run_train.sh ";
  const std::string launch = "cd " + dir.path.string() + " && " + script;
  const std::string small =
      "--training.dataset_path data.txt --training.seq_len 64 --training.local_batch_size 2 "
      "--metrics.log_freq 1 --metrics.enable_tensorboard false --validation.enable false ";
  auto ok = test::run(launch + small + "--training.steps 2");
  INFO(ok.out);
  CHECK(ok.rc == 0);
  // configs/llama3_debug.toml's dump folder, ./outputs/llama3_debug, under the caller's cwd.
  CHECK(test::losses(dir.file("outputs/llama3_debug")).size() == 2);

  auto bad = test::run(launch + "--training.stepz 3");
  INFO(bad.out);
  CHECK(bad.rc == 2);
  CHECK_THAT(bad.out, Contains("titan-train: error: command line: unknown option --training.stepz"));
  CHECK_THAT(bad.out, !Contains("Traceback") && !Contains("ChildFailedError"));

  // SIGTERM to the script: every worker finishes its step, saves, exits 0; so does the script.
  // `;` not `&&`: the & must put the script itself (env execs bash) in the background, so
  // $p is its pid.
  auto term = test::run(
      "cd " + dir.path.string() + "; " + script + small +
      "--training.steps 100000 --checkpoint.enable --checkpoint.interval 100000 "
      "--job.dump_folder t > t.log 2>&1 & p=$!; for i in $(seq 1500); do "
      "[ \"$(cat t/metrics.jsonl 2>/dev/null | wc -l)\" -ge 3 ] && break; sleep 0.2; done; "
      "kill -TERM $p; wait $p; echo \"rc=$?\"; cat t.log");
  INFO(term.out);
  CHECK_THAT(term.out, Contains("rc=0"));
  CHECK_THAT(term.out, Contains("received signal 15") && !Contains("Traceback") &&
                           !Contains("SignalException"));
  CHECK(fs::exists(dir.file("t/checkpoint")));
  CHECK(Checkpointer::complete_steps(dir.file("t/checkpoint")).size() == 1);
}

// A loss that turns nan or inf ends the run with its own status (README: 4), on stderr,
// naming the step and the newest checkpoint trained on finite losses. A huge but finite lr
// (inf itself is refused) makes step 1's update blow the weights up.
TEST_CASE("cli: a diverged loss exits 4 naming the step and the last good checkpoint", "[cli]") {
  test::TempDir dir("cli-nan");
  const std::string run = "--config " + test::source_dir() +
                          "/configs/llama3_debug.toml --training.steps 5 --metrics.log_freq 1 "
                          "--training.local_batch_size 2 --training.seq_len 32 "
                          "--validation.enable false --lr_scheduler.warmup_steps 0 "
                          "--optimizer.lr 1e30 --checkpoint.enable --checkpoint.interval 1 "
                          "--job.dump_folder " + dir.file("out");
  // stderr alone into a file (the inner redirection wins over test::run's 2>&1).
  auto r = test::run("{ env -u RANK -u WORLD_SIZE " + test::binary() + " " + run + " 2>" +
                     dir.file("err") + "; }");
  const std::string err = test::read_file(dir.file("err"));
  INFO(r.out << err);
  CHECK(r.rc == 4);
  CHECK_THAT(err, Contains("titan-train: error: the loss is") && Contains(" at step 2 ") &&
                      Contains("the last good checkpoint is " + dir.file("out") +
                               "/checkpoint/step-1") &&
                      Contains("checkpoint.load_step = 1"));
}

// c10's CPU allocator reports a failed host allocation as a plain c10::Error: it is out of
// memory (3, with the hint), not an internal error (1). A virtual-memory limit makes the
// first activation allocation fail without touching the machine's memory.
TEST_CASE("cli: host out of memory exits 3 with the hint", "[cli]") {
  test::TempDir dir("cli-hostoom");
  auto r = test::run("ulimit -v 6000000 && env -u RANK -u WORLD_SIZE " + test::binary() +
                     " --config " + test::source_dir() +
                     "/configs/llama3_debug.toml --training.steps 1 --training.seq_len 64 "
                     "--training.local_batch_size 100000 --validation.enable false "
                     "--job.dump_folder " + dir.file("out"));
  INFO(r.out);
  CHECK(r.rc == 3);
  CHECK_THAT(r.out, Contains("titan-train: out of memory:") &&
                        Contains("training.local_batch_size (now 100000)"));
  CHECK_THAT(r.out, !Contains("internal error"));
}
