// titan-train estimate: the plan's per-rank parameter bytes follow the sharding (half on 2
// ranks, 1/1024 of llama3 405B's 4 x 405e9 bytes on 1024 ranks, within the padding rows),
// and a 405B config at world 1024 is estimated without allocating the model. Not yet
// checked: the activation estimate against the measured peak (issue 13, part 5).
#include <catch2/catch.hpp>

#include <regex>
#include <string>

#include "test_util.h"

using namespace titan;

namespace {

double gib_of(const std::string& out, const std::string& label) {
  std::smatch m;
  const std::regex re(label + R"(\s+([0-9.]+) GiB)");
  REQUIRE(std::regex_search(out, m, re));
  return std::stod(m[1]);
}

test::CmdResult estimate(const std::string& args) {
  return test::run("cd " + test::source_dir() + " && " + test::binary() + " estimate " + args);
}

}  // namespace

TEST_CASE("estimate: parameter bytes per rank follow the sharding", "[app][estimate]") {
  auto one = estimate("--config configs/llama3_debug.toml --world 1");
  INFO(one.out);
  REQUIRE(one.rc == 0);
  auto two = estimate("--config configs/llama3_debug.toml --world 2");
  INFO(two.out);
  REQUIRE(two.rc == 0);
  const double p1 = gib_of(one.out, R"(parameters \(fp32 shards\))");
  const double p2 = gib_of(two.out, R"(parameters \(fp32 shards\))");
  CHECK(p2 >= 0.5 * p1 * 0.99);
  CHECK(p2 <= 0.5 * p1 * 1.03);  // padding rows of odd dims, and 3-digit rounding
  CHECK(gib_of(two.out, R"(AdamW state \(fp32 exp_avg, exp_avg_sq\))") ==
        Approx(2 * p2).epsilon(0.01));
}

TEST_CASE("estimate: llama3 405B on 1024 ranks without allocating it", "[app][estimate]") {
  auto r = estimate("--config configs/llama3_8b.toml --world 1024 --gpu h100 "
                    "--set 'model.flavor=\"405B\"'");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const double p = gib_of(r.out, R"(parameters \(fp32 shards\))");
  const double expect = 4.0 * 405e9 / 1024 / (1024.0 * 1024 * 1024);
  CHECK(p == Approx(expect).epsilon(0.05));
  CHECK_THAT(r.out, Catch::Matchers::Contains("assumptions:"));
  CHECK_THAT(r.out, Catch::Matchers::Contains("MFU"));
}

TEST_CASE("estimate: an unknown GPU exits 2", "[app][estimate]") {
  auto r = estimate("--config configs/llama3_debug.toml --gpu v100");
  CHECK(r.rc == 2);
  CHECK_THAT(r.out, Catch::Matchers::Contains("allowed: a100, h100, h200, b200"));
}
