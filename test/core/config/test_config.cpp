// Config registry: precedence, parsing, validation and the --dump-config round trip.
#include <catch2/catch.hpp>

#include <set>

#include "core/config/config.h"
#include "core/base/errors.h"
#include "test_util.h"

using namespace titan;

namespace {
CliResult parse(std::vector<std::string> args) {
  std::vector<const char*> argv{"titan-train"};
  for (auto& a : args) argv.push_back(a.c_str());
  return parse_command_line(static_cast<int>(argv.size()), argv.data());
}
}  // namespace

TEST_CASE("config: precedence is defaults < TOML < command line", "[config]") {
  test::TempDir dir("cfg");
  test::write_file(dir.file("a.toml"),
                   "[training]\nsteps = 77\nseq_len = 128\n[optimizer]\nlr = 0.5\n");
  auto r = parse({"--config", dir.file("a.toml"), "--training.seq_len=64"});
  CHECK(r.cfg.training.steps == 77);     // TOML over default
  CHECK(r.cfg.training.seq_len == 64);   // command line over TOML
  CHECK(r.cfg.optimizer.lr == 0.5);      // TOML
  CHECK(r.cfg.optimizer.beta2 == 0.95);  // default
  CHECK(r.cfg.job.config_file == dir.file("a.toml"));
  // --job.config_file is the same option as --config; space-separated values work.
  auto r2 = parse({"--job.config_file", dir.file("a.toml"), "--training.seq_len", "32"});
  CHECK(r2.cfg.training.steps == 77);
  CHECK(r2.cfg.training.seq_len == 32);
}

TEST_CASE("config: booleans and lists from the command line", "[config]") {
  CHECK(parse({"--debug.deterministic"}).cfg.debug.deterministic);
  CHECK(parse({"--debug.deterministic=true"}).cfg.debug.deterministic);
  CHECK_FALSE(parse({"--debug.deterministic", "false"}).cfg.debug.deterministic);
  CHECK_FALSE(parse({"--debug.deterministic=false"}).cfg.debug.deterministic);
  auto l1 = parse({"--checkpoint.exclude_from_loading", "optimizer", "dataloader"});
  CHECK(l1.cfg.checkpoint.exclude_from_loading ==
        std::vector<std::string>{"optimizer", "dataloader"});
  auto l2 = parse({"--checkpoint.exclude_from_loading=optimizer,lr_scheduler"});
  CHECK(l2.cfg.checkpoint.exclude_from_loading ==
        std::vector<std::string>{"optimizer", "lr_scheduler"});
  // torchtitan's old spellings are aliases.
  CHECK(parse({"--checkpoint.enable_checkpoint"}).cfg.checkpoint.enable);
  CHECK(parse({"--training.seed", "9"}).cfg.debug.seed == 9);
}

TEST_CASE("config: every registry default round-trips through the typed struct", "[config]") {
  JobConfig c = default_config();
  for (auto& o : registry()) CHECK(o.get(c) == o.default_value);
  CHECK(c.training.seq_len == 2048);
  CHECK(c.model.name == "llama3");
  // Names are unique, including aliases.
  std::set<std::string> names;
  for (auto& o : registry()) {
    CHECK(names.insert(o.name()).second);
    for (auto& a : o.aliases) CHECK(names.insert(a).second);
  }
}

TEST_CASE("config: --dump-config output loads back to the same dump", "[config]") {
  test::TempDir dir("dump");
  auto r =
      parse({"--training.steps=12", "--optimizer.lr=3.14159e-4", "--model.flavor", "x y \"q\"",
             "--checkpoint.exclude_from_loading=optimizer", "--lr_scheduler.decay_ratio", "0.1"});
  std::string d1 = dump_config_toml(r.cfg);
  test::write_file(dir.file("d.toml"), d1);
  auto r2 = parse({"--config", dir.file("d.toml")});
  std::string d2 = dump_config_toml(r2.cfg);
  CHECK(d1 == d2);
  CHECK(r2.cfg.optimizer.lr == 3.14159e-4);
  CHECK(r2.cfg.model.flavor == "x y \"q\"");
  CHECK(config_hash(r.cfg) == config_hash(r2.cfg));
  CHECK(config_hash(r.cfg) != config_hash(default_config()));
}

TEST_CASE("config: bad TOML input names the key and the line and what is allowed", "[config]") {
  std::vector<std::string> w;
  auto err = [&](const std::string& toml) -> std::string {
    JobConfig c = default_config();
    try {
      apply_toml_string(c, toml, "x.toml", w);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  using Catch::Matchers::Contains;
  CHECK_THAT(err("[training]\nsteps = 3\nstepz = 4\n"),
             Contains("x.toml:3") && Contains("training.stepz") && Contains("training.steps"));
  CHECK_THAT(err("[trainin]\nsteps = 3\n"), Contains("[trainin]") && Contains("[training]"));
  CHECK_THAT(err("[training]\nsteps = \"ten\"\n"),
             Contains("training.steps") && Contains("expected int") && Contains("string"));
  CHECK_THAT(err("[training]\nsteps = -5\n"),
             Contains("training.steps = -5") && Contains("value >= 1"));
  CHECK_THAT(err("[lr_scheduler]\ndecay_type = \"exp\"\n"),
             Contains("decay_type") && Contains("linear, sqrt, cosine"));
  CHECK_THAT(err("[training\nsteps = 3\n"), Contains("x.toml:1:") && Contains("TOML syntax error"));
  CHECK_THAT(err("[training]\nsteps = \n"), Contains("x.toml:2:"));
  // Pipeline keys are read (--dump-schedule uses them); training refuses PP in validate_for_world.
  CHECK(err("[parallelism]\npipeline_parallel_degree = 2\n").empty());
  CHECK_THAT(err("[parallelism]\npipeline_parallel_degree = 0\n"),
             Contains("parallelism.pipeline_parallel_degree = 0"));
  CHECK(err("[training]\nsteps = 3\n").empty());
  // Non-ASCII outside strings (fuzz_config found toml++ 3.3's undefined behaviour on it) is
  // refused with its place; inside strings and comments it is fine.
  CHECK_THAT(err("[t\xC6\xA0iaset]\n"), Contains("x.toml:1:3:") && Contains("0xC6") &&
                                           Contains("outside a string or comment"));
  CHECK_THAT(err("[job]\ndescription = \"\"\"a\\\n  \xC6\xA0\"\"\"\n"),
             Contains("x.toml:3:3:") && Contains("right after a backslash"));
  CHECK(err("# d\xC3\xA9j\xC3\xA0\n[job]\ndescription = \"caf\xC3\xA9 \xD0\x96\"\n").empty());
  CHECK(err("[job]\ndescription = '''\xC6\xA0\\'''\n").empty());
  // torchtitan keys we ignore warn instead of failing.
  w.clear();
  CHECK(err("[mx]\nrecipe_name = \"mxfp8\"\n[training]\ngc_freq = 5\n").empty());
  REQUIRE(w.size() == 2);
  CHECK_THAT(w[0], Contains("x.toml:2: ignoring torchtitan keys mx.*"));
  CHECK_THAT(w[1], Contains("x.toml:4: ignoring torchtitan key training.gc_freq"));
  // Once per key or ignored section, however often it appears.
  CHECK(err("[mx]\nfilter_fqns = []\n[training]\ngc_freq = 6\n").empty());
  CHECK(w.size() == 2);
  // Nested torchtitan tables: options below a section are read ([quantize.linear.float8]),
  // an ignored table warns once for all its keys.
  w.clear();
  CHECK(err("[quantize.linear.float8]\nfilter_fqns = [\"output\"]\n[quantize.grouped_mm.mx]\n"
            "fqns = [\"experts\"]\nrecipe_name = \"mxfp8\"\n[training.dataloader]\n"
            "num_workers = 2\n")
            .empty());
  REQUIRE(w.size() == 2);
  CHECK_THAT(w[0], Contains("quantize.grouped_mm.mx.*"));
  CHECK_THAT(w[1], Contains("training.dataloader.*"));
  // v0.1's [float8] is an older name of [quantize.linear.float8].
  w.clear();
  CHECK(err("[float8]\nemulate = true\n").empty());
  REQUIRE(w.size() == 1);
  CHECK_THAT(w[0], Contains("float8.emulate is an older torchtitan name; the current name is "
                            "quantize.linear.float8.emulate"));
  // Tables elsewhere are errors.
  CHECK_THAT(err("[training.steps]\nx = 1\n"),
             Contains("training.steps: expected int, found a table"));
  CHECK_THAT(err("[training.loader]\nx = 1\n"), Contains("unknown key training.loader"));
}

TEST_CASE("config: inconsistent values are rejected with the numbers involved", "[config]") {
  using Catch::Matchers::Contains;
  JobConfig c = default_config();
  c.training.local_batch_size = 4;
  c.training.global_batch_size = 10;
  // Not a multiple of the local batch: wrong for any world, so validate_config sees it.
  CHECK_THROWS_WITH(validate_config(c), Contains("global_batch_size = 10") && Contains("(4)"));
  CHECK_THROWS_WITH(validate_for_world(c, 1),
                    Contains("global_batch_size = 10") && Contains("multiple of 4"));
  c.training.global_batch_size = 16;
  CHECK_NOTHROW(validate_for_world(c, 1));
  CHECK(derive_config(c, 1).grad_accum_steps == 4);
  CHECK_NOTHROW(validate_config(c));
  CHECK_THROWS_WITH(validate_for_world(c, 8), Contains("multiple of 32"));
  c.training.global_batch_size = -1;
  c.parallelism.data_parallel_shard_degree = 3;
  CHECK_NOTHROW(validate_config(c));
  CHECK_THROWS_WITH(validate_for_world(c, 4), Contains("world size is 4"));
  c.parallelism.data_parallel_shard_degree = -1;
  c.parallelism.data_parallel_replicate_degree = 2;
  CHECK_NOTHROW(validate_for_world(c, 4));
  CHECK(derive_config(c, 4).dp_shard == 2);
  // Expert parallelism against the world happens at launch only (--dump-config has none).
  c.parallelism.data_parallel_replicate_degree = 1;
  c.parallelism.expert_parallel_degree = 8;
  CHECK_NOTHROW(validate_config(c));
  CHECK_THROWS_WITH(validate_for_world(c, 4),
                    Contains("expert_parallel_degree = 8") && Contains("world size 4"));
  CHECK_NOTHROW(validate_for_world(c, 8));
  c.parallelism.data_parallel_shard_degree = 4;  // explicit: wrong for every world
  CHECK_THROWS_WITH(validate_config(c), Contains("expert_parallel_degree = 8"));
  c.parallelism.data_parallel_shard_degree = -1;
  c.parallelism.expert_parallel_degree = 1;
  c.activation_checkpoint.mode = "selective";
  for (const char* ok : {"op", "1", "3"}) {
    c.activation_checkpoint.selective_ac_option = ok;
    CHECK_NOTHROW(validate_config(c));
  }
  for (const char* bad : {"0", "-1", "ops", "", "2x", "99999999999999999999"}) {
    INFO(bad);
    c.activation_checkpoint.selective_ac_option = bad;
    CHECK_THROWS_WITH(validate_config(c),
                      Contains("selective_ac_option") && Contains("op, or a positive integer"));
  }
  c.activation_checkpoint.mode = "full";  // the option only matters for selective
  CHECK_NOTHROW(validate_config(c));
  // Blend weights: one per path, non-negative (the registry), not all zero.
  c.training.dataset_path = {"a.tok", "b.tok"};
  c.training.dataset_weights = {1.0};
  CHECK_THROWS_WITH(validate_config(c), Contains("dataset_weights has 1") && Contains("has 2"));
  c.training.dataset_weights = {0.0, 0.0};
  CHECK_THROWS_WITH(validate_config(c), Contains("all 0"));
  c.training.dataset_weights = {0.0, 2.5};
  CHECK_NOTHROW(validate_config(c));
  c.training.dataset_weights = {};
  CHECK_NOTHROW(validate_config(c));
}

TEST_CASE("config: nearest valid name", "[config]") {
  CHECK(nearest_option_name("training.stepz") == "training.steps");
  CHECK(nearest_option_name("optimizer.learning_rate").rfind("optimizer.", 0) == 0);
  CHECK(is_ignored_torchtitan_key("mx.anything"));
  CHECK_FALSE(is_ignored_torchtitan_key("float8.emulate"));
  CHECK_FALSE(is_ignored_torchtitan_key("training.steps"));
}

TEST_CASE("config: a control byte where a TOML key starts is a syntax error naming the line",
          "[config]") {
  // Found by test/fuzz/fuzz_config.cpp: toml++ asserts here in debug builds; the release
  // build (ours) must give its parse error as a UserError.
  using Catch::Matchers::Contains;
  JobConfig c = default_config();
  std::vector<std::string> w;
  try {
    apply_toml_string(c, "[training]\nsteps = 5\n\x02steps = 6\n", "bad.toml", w);
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Contains("bad.toml:3") && Contains("TOML syntax error"));
  }
}
