// Packaging facts that would otherwise drift: the Dockerfile and scripts/setup.sh read their
// pinned versions from the one file scripts/versions.env, and the README documents the
// commands and every torchtitan key we ignore.
#include <catch2/catch.hpp>

#include <regex>

#include "core/config/config.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

TEST_CASE("packaging: Dockerfile and setup.sh take versions only from versions.env",
          "[packaging]") {
  const std::string env = test::read_file(test::source_dir() + "/scripts/versions.env");
  const std::string docker = test::read_file(test::source_dir() + "/Dockerfile");
  const std::string setup = test::read_file(test::source_dir() + "/scripts/setup.sh");
  CHECK_THAT(env, Contains("TORCH_VERSION=2.11.0"));
  for (const std::string& f : {docker, setup}) {
    CHECK_THAT(f, Contains("versions.env"));
    CHECK_THAT(f, Contains("torch==$TORCH_VERSION"));
    // No literal pins such as torch==2.x or tokenizers==0.x outside versions.env.
    CHECK_FALSE(std::regex_search(f, std::regex("==[0-9]")));
  }
  CHECK_THAT(docker, Contains("$DEBIAN_BUILD_PACKAGES"));
  CHECK_THAT(setup, Contains("$DEBIAN_BUILD_PACKAGES"));
  CHECK_THAT(docker, Contains("ENTRYPOINT [\"titan-train\"]"));
}

TEST_CASE("packaging: README shows the commands and lists every ignored torchtitan key",
          "[packaging]") {
  const std::string readme = test::read_file(test::source_dir() + "/README.md");
  CHECK_THAT(readme, Contains("scripts/train.sh"));
  CHECK_THAT(readme, Contains("scripts/test.sh"));
  for (auto& k : ignored_torchtitan_keys()) {
    INFO(k);
    CHECK_THAT(readme, Contains("`" + k + "`"));
  }
}
