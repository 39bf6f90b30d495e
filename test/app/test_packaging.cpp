// Packaging facts that would otherwise drift: the Dockerfile and scripts/setup.sh read their
// pinned versions from the one file scripts/versions.env, and the README documents the
// commands and every torchtitan key we ignore.
#include <catch2/catch.hpp>

#include <map>
#include <regex>
#include <set>
#include <sstream>

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

namespace {
// KEY=VALUE lines of scripts/versions.env.
std::map<std::string, std::string> versions_env() {
  std::map<std::string, std::string> out;
  std::stringstream ss(test::read_file(test::source_dir() + "/scripts/versions.env"));
  for (std::string line; std::getline(ss, line);) {
    const auto eq = line.find('=');
    if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
    out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

// "name==version" for every NAME==$VAR the file pins, read here independently of the script.
std::set<std::string> dockerfile_pins(const std::string& text) {
  const auto env = versions_env();
  std::set<std::string> out;
  const std::regex re(R"(([A-Za-z0-9_.-]+)==\$\{?([A-Z_][A-Z0-9_]*)\}?)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator();
       ++it)
    out.insert((*it)[1].str() + "==" + (env.count((*it)[2]) ? env.at((*it)[2]) : "(unset)"));
  return out;
}

std::set<std::string> wheelhouse(const std::string& dockerfile) {
  auto r = test::run("TITAN_DOCKERFILE=" + dockerfile + " bash " + test::source_dir() +
                     "/scripts/docker_wheels.sh");
  INFO(r.out);
  REQUIRE(r.rc == 0);
  std::set<std::string> out;
  std::stringstream ss(r.out);
  for (std::string kind, req; ss >> kind >> req;) out.insert(req);
  return out;
}
}  // namespace

// scripts/docker_check.sh serves its base images a local wheelhouse. It once lacked the
// nvidia-cutlass wheel the Dockerfile had started to install, and nothing noticed until the
// image build failed; now the wheelhouse is derived from the Dockerfile's pip lines, and this
// checks that derivation against every pin in the Dockerfile without building anything.
TEST_CASE("packaging: the docker check's wheelhouse holds every wheel the Dockerfile pins",
          "[packaging]") {
  const std::string path = test::source_dir() + "/Dockerfile";
  const auto pins = dockerfile_pins(test::read_file(path));
  CHECK(pins.count("nvidia-cutlass==" + versions_env().at("CUTLASS_VERSION")) == 1);
  CHECK(wheelhouse(path) == pins);
  const std::string check = test::read_file(test::source_dir() + "/scripts/docker_check.sh");
  CHECK_THAT(check, Contains("scripts/docker_wheels.sh"));
  CHECK_FALSE(std::regex_search(check, std::regex(R"(pip download[^\n]*==)")));  // no own list
  // A pin added to the Dockerfile reaches the wheelhouse by itself.
  test::TempDir dir("wheels");
  test::write_file(dir.file("Dockerfile"),
                   test::read_file(path) +
                       "RUN /opt/venv/bin/pip install --no-deps numpy==$NUMPY_VERSION\n");
  CHECK(wheelhouse(dir.file("Dockerfile")).count("numpy==" + versions_env().at("NUMPY_VERSION")));
}

// scripts/train.sh sets up and builds only what training needs; scripts/test.sh the rest.
TEST_CASE("packaging: train.sh installs only what training needs", "[packaging]") {
  const std::string setup = "bash " + test::source_dir() + "/scripts/setup.sh";
  auto train = test::run("TITAN_SETUP_DRY_RUN=1 TITAN_SETUP_MODE=train " + setup);
  auto all = test::run("TITAN_SETUP_DRY_RUN=1 " + setup);
  INFO(train.out << all.out);
  REQUIRE(train.rc == 0);
  REQUIRE(all.rc == 0);
  for (const char* test_only : {"slurm-wlm", "munge", "docker.io", "debootstrap",
                                "transformers==", "torchtitan==", "megatron-core==", "torchao=="}) {
    CHECK_THAT(train.out, !Contains(test_only));
    CHECK_THAT(all.out, Contains(test_only));
  }
  for (const char* needed : {"build-essential", "torch==", "tokenizers==", "pyarrow==",
                             "nvidia-cutlass=="})
    CHECK_THAT(train.out, Contains(needed));
  const std::string train_sh = test::read_file(test::source_dir() + "/scripts/train.sh");
  CHECK_THAT(train_sh, Contains("TITAN_SETUP_MODE=\"${TITAN_SETUP_MODE:-train}\"") &&
                           Contains("TITAN_NINJA_ARGS=\"${TITAN_NINJA_ARGS:-titan-train}\""));
  CHECK_THAT(test::read_file(test::source_dir() + "/scripts/test.sh"), !Contains("TITAN_SETUP_MODE"));
}
