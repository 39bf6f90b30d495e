// The binary's contract for bad input: one clear message naming the key or file, exit
// status 2, and nothing written. Also --help and the configs/ files.
#include <catch2/catch.hpp>

#include <filesystem>

#include "core/config.h"
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
