// The checkpoint reader against damaged folders: metadata.json is a file users can edit or
// break, and each input the fuzz target (test/fuzz/fuzz_checkpoint_meta.cpp) found to escape
// as something other than a UserError is pinned here; a shard changed after the save is
// refused by its CRC32C, naming the shard.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/base/errors.h"
#include "core/checkpoint/checkpoint.h"
#include "test/core/checkpoint/small_checkpoint.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
using nlohmann::json;

namespace {

std::string save_small(const test::TempDir& dir) {
  return test_fixtures::save_small_checkpoint(dir.file("ckpt"));
}

// Opens the folder and reads every tensor; returns the UserError's message ("" when none).
std::string read_all(const std::string& step_dir) {
  try {
    CheckpointReader r(step_dir);
    for (const auto& [key, shape] : r.keys("")) r.get(key);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("checkpoint reader: each damaged metadata.json is one UserError naming file and tensor",
          "[checkpoint]") {
  test::TempDir dir("ckmeta");
  const std::string step = save_small(dir);
  const std::string meta_path = step + "/metadata.json";
  const json good = json::parse(test::read_file(meta_path));
  REQUIRE(read_all(step).empty());
  REQUIRE(good.contains("files"));  // the CRCs of the shards
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* says;
  };
  const std::vector<Case> cases = {
      // fuzz finding: "shape": null escaped as nlohmann::json::type_error
      {"shape null", [](json& m) { m["tensors"]["model.w"]["shape"] = nullptr; }, "model.w"},
      {"negative size", [](json& m) { m["tensors"]["model.w"]["shape"] = {-4, 3}; }, "model.w"},
      {"2^64 elements", [](json& m) { m["tensors"]["model.w"]["shape"] = {int64_t{1} << 32, int64_t{1} << 32}; }, "2^62"},
      {"shards not a list", [](json& m) { m["tensors"]["model.b"]["shards"] = "x"; }, "model.b"},
      {"file outside the folder", [](json& m) { m["tensors"]["model.b"]["shards"][0]["file"] = "../step-1/rank-00000.safetensors"; }, "model.b"},
      {"absolute file", [](json& m) { m["tensors"]["model.b"]["shards"][0]["file"] = "/etc/passwd"; }, "model.b"},
      {"negative offset", [](json& m) { m["tensors"]["model.w"]["shards"][0]["dim0_offset"] = -1; }, "model.w"},
      {"rows past the end", [](json& m) { m["tensors"]["model.w"]["shards"][0]["dim0_rows"] = 5; }, "outside its 4 rows"},
      {"offset as a string", [](json& m) { m["tensors"]["model.w"]["shards"][0]["dim0_offset"] = "0"; }, "model.w"},
      {"scalar with 2 rows", [](json& m) { m["tensors"]["model.s"]["shards"][0]["dim0_rows"] = 2; }, "model.s"},
      {"dtype missing", [](json& m) { m["tensors"]["model.s"].erase("dtype"); }, "model.s"},
      {"trailing dims differ from the file", [](json& m) { m["tensors"]["model.w"]["shape"] = {4, 4}; }, "has shape [4, 3]"},
      {"scalar says rows", [](json& m) { m["tensors"]["model.s"]["shape"] = {1}; }, "model.s"},
      {"crc not a number", [](json& m) { m["files"]["rank-00000.safetensors"]["crc32c"] = "x"; }, "rank-00000.safetensors"},
      {"files not a map", [](json& m) { m["files"] = json::array(); }, "\"files\""},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    json m = good;
    c.edit(m);
    test::write_file(meta_path, m.dump());
    const std::string msg = read_all(step);
    CHECK_THAT(msg, Contains("checkpoint") && Contains(c.says));
  }
  test::write_file(meta_path, good.dump());
  CHECK(read_all(step).empty());
}

TEST_CASE("checkpoint reader: a shard changed after the save is refused by its CRC32C",
          "[checkpoint]") {
  test::TempDir dir("ckcrc");
  const std::string step = save_small(dir);
  const std::string shard = step + "/rank-00000.safetensors";
  const auto size = std::filesystem::file_size(shard);
  {  // one bit of the last tensor's data: the safetensors header still parses
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 1));
    const char c = static_cast<char>(f.get() ^ 1);
    f.seekp(static_cast<std::streamoff>(size - 1));
    f.put(c);
  }
  const std::string msg = read_all(step);
  CHECK_THAT(msg, Contains("shard rank-00000.safetensors is corrupt") && Contains("CRC32C") &&
                      Contains(std::to_string(size) + " bytes"));
  // A checkpoint saved before the CRCs (no "files" map) still loads.
  json m = json::parse(test::read_file(step + "/metadata.json"));
  m.erase("files");
  test::write_file(step + "/metadata.json", m.dump());
  CHECK(read_all(step).empty());
}
