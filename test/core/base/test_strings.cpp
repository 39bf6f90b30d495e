// core/base/strings.h: the one ends_with of the project.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>

#include "core/base/strings.h"
#include "test_util.h"

using namespace titan;
namespace fs = std::filesystem;

TEST_CASE("strings: ends_with", "[base]") {
  CHECK(ends_with("data.jsonl.gz", ".gz"));
  CHECK(ends_with("data.jsonl.gz", ".jsonl.gz"));
  CHECK_FALSE(ends_with("data.jsonl.gz", ".jsonl"));
  CHECK(ends_with("x", ""));
  CHECK(ends_with(".tok", ".tok"));
  CHECK_FALSE(ends_with("tok", ".tok"));  // a suffix longer than the string
  CHECK(ends_with(std::string("model.layers.0.self_attn.rotary_emb.inv_freq"),
                  std::string("rotary_emb.inv_freq")));
}

// Issue 32 item 19: it was defined four times (text_reader, token_source, token_writer,
// hf_interop). Every layer includes core/base/strings.h instead.
TEST_CASE("strings: ends_with is defined once, in core/base", "[base]") {
  std::vector<std::string> defs;
  for (const char* top : {"core", "models", "moe", "parallel", "app"})
    for (auto& e : fs::recursive_directory_iterator(test::source_dir() + "/" + top)) {
      const auto ext = e.path().extension();
      if (ext != ".cpp" && ext != ".h" && ext != ".cu") continue;
      if (test::read_file(e.path().string()).find("bool ends_with(") != std::string::npos)
        defs.push_back(fs::relative(e.path(), test::source_dir()).string());
    }
  CHECK(defs == std::vector<std::string>{"core/base/strings.h"});
}
