// Pre-tokenized readers: .tok v2, Megatron (uint16, int32; .bin, .idx or prefix; folders),
// llm.c shards and globs, checked against test/reference/data_ref.py: numpy's memmap over the
// published layouts, and megatron-core's own IndexedDatasetBuilder / IndexedDataset. Token ids
// are integers: every comparison is exact. Bad files: one UserError line naming the file.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>

#include "core/base/errors.h"
#include "core/data/token_source.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

// Fixtures of every format and what numpy / megatron-core read from them, made once per run.
const nlohmann::json& reference(std::string* root_out = nullptr) {
  static test::TempDir dir("dataref");
  static nlohmann::json manifest = [] {
    auto r = test::run(test::python() + " " + test::source_dir() +
                       "/test/reference/data_ref.py make " + dir.path.string());
    if (r.rc != 0) FAIL("data_ref.py failed: " << r.out);
    return nlohmann::json::parse(test::read_file(dir.file("manifest.json")));
  }();
  if (root_out) *root_out = dir.path.string();
  return manifest;
}

std::string error_of(const std::string& spec, int64_t vocab = 0) {
  try {
    TokenSource::open(spec, vocab);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

void patch(const std::string& path, size_t offset, const std::string& bytes) {
  std::string s = test::read_file(path);
  s.replace(offset, bytes.size(), bytes);
  test::write_file(path, s);
}

template <class T>
std::string le(T v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof v);
}

void copy_pair(const std::string& from_prefix, const std::string& to_prefix) {
  fs::copy_file(from_prefix + ".bin", to_prefix + ".bin");
  fs::copy_file(from_prefix + ".idx", to_prefix + ".idx");
}

}  // namespace

TEST_CASE("data: every format, folder and glob reads what numpy's memmap reads", "[data]") {
  const nlohmann::json& ref = reference();
  const int64_t w = ref["seq_len"].get<int64_t>() + 1;
  for (auto& e : ref["sources"]) {
    const std::string spec = e["spec"];
    INFO(spec);
    auto src = TokenSource::open(spec, 70000);
    CHECK(token_format_name(src->format()) == e["format"].get<std::string>());
    CHECK(src->num_tokens() == e["tokens"].get<int64_t>());
    CHECK(src->num_docs() == e["docs"].get<int64_t>());
    auto starts = e["doc_starts"].get<std::vector<int64_t>>();
    for (size_t d = 0; d < starts.size(); ++d)
      CHECK(src->doc_start(static_cast<int64_t>(d)) == starts[d]);
    // Every window, several of which cross a shard boundary in the folders and globs.
    auto windows = e["windows"].get<std::vector<std::vector<int64_t>>>();
    REQUIRE(!windows.empty());
    std::vector<int64_t> got(static_cast<size_t>(w));
    for (size_t i = 0; i < windows.size(); ++i) {
      src->read(static_cast<int64_t>(i) * w, w, got.data());
      REQUIRE(got == windows[i]);
    }
  }
  // The glob took the training shards only; the folder ignored its README.txt.
  std::string root;
  reference(&root);
  auto g = TokenSource::open(root + "/llmc/fineweb_train_*.bin", 0);
  REQUIRE(g->num_shards() == 2);
  CHECK(g->shard(1).path == root + "/llmc/fineweb_train_000002.bin");
  CHECK(TokenSource::open(root + "/tokdir", 0)->num_shards() == 3);
  // locate() names the shard holding a position and the offset inside it.
  auto dirsrc = TokenSource::open(root + "/tokdir", 0);
  const int64_t first = dirsrc->shard(0).num_tokens;
  CHECK(dirsrc->locate(first - 1).shard == 0);
  CHECK(dirsrc->locate(first).shard == 1);
  CHECK(dirsrc->locate(first + 5).offset == 5);
}

TEST_CASE(
    "data: Megatron files from megatron-core's IndexedDatasetBuilder read back token for token",
    "[data]") {
  const nlohmann::json& ref = reference();
  int checked = 0;
  for (auto& e : ref["sources"]) {
    if (!e.contains("megatron_docs")) continue;
    const std::string spec = e["spec"];
    INFO(spec);
    auto src = TokenSource::open(spec, 0);
    auto docs = e["megatron_docs"].get<std::vector<std::vector<int64_t>>>();
    REQUIRE(src->num_docs() == static_cast<int64_t>(docs.size()));
    for (size_t d = 0; d < docs.size(); ++d) {
      const int64_t a = src->doc_start(static_cast<int64_t>(d));
      const int64_t b = src->doc_start(static_cast<int64_t>(d) + 1);
      std::vector<int64_t> got(static_cast<size_t>(b - a));
      src->read(a, b - a, got.data());
      REQUIRE(got == docs[d]);
    }
    ++checked;
  }
  CHECK(checked == 5);  // m16 as .bin, .idx and prefix; m32 (int32 tokens); the folder of two
}

TEST_CASE("data: write_tok_v2 writes the layout numpy reads", "[data]") {
  test::TempDir dir("tokv2");
  for (int64_t vocab : {2048, 70000}) {
    INFO("vocab " << vocab);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 5000; ++i) tokens.push_back(static_cast<int32_t>((i * 7919) % vocab));
    const std::vector<int64_t> offsets = {0, 3, 3, 1000, 4999, 5000};
    const std::string path = dir.file("w" + std::to_string(vocab) + ".tok");
    write_tok_v2(path, tokens, offsets, vocab);
    auto r = test::run(test::python() + " " + test::source_dir() +
                       "/test/reference/data_ref.py read-tok " + path);
    REQUIRE(r.rc == 0);
    auto j = nlohmann::json::parse(r.out.substr(r.out.rfind("{\"header\"")));
    CHECK(j["header"]["width"] == (vocab <= 65536 ? 2 : 4));
    CHECK(j["header"]["tokens_at"].get<int64_t>() % 4096 == 0);
    CHECK(j["header"]["size"] ==
          j["header"]["tokens_at"].get<int64_t>() + 5000 * j["header"]["width"].get<int64_t>());
    CHECK(j["header"]["max_id"] == *std::max_element(tokens.begin(), tokens.end()));
    CHECK(j["header"]["vocab"] == vocab);
    CHECK(j["offsets"].get<std::vector<int64_t>>() == offsets);
    CHECK(j["tokens"].get<std::vector<int64_t>>() ==
          std::vector<int64_t>(tokens.begin(), tokens.end()));
    auto src = TokenSource::open(path, vocab);
    CHECK(src->num_docs() == 5);
    CHECK(src->doc_start(3) == 1000);
  }
}

TEST_CASE("data: bad token files are one-line UserErrors naming the file", "[data]") {
  std::string root;
  reference(&root);
  test::TempDir dir("badtok");
  auto f = [&](const std::string& n) { return dir.file(n); };

  SECTION("Megatron: truncated .bin, .idx disagreeing with the .bin, magic, version, dtype") {
    copy_pair(root + "/m16", f("trunc"));
    fs::resize_file(f("trunc.bin"), fs::file_size(f("trunc.bin")) - 2);
    CHECK_THAT(error_of(f("trunc")), Contains(f("trunc.bin")) && Contains("truncated"));
    copy_pair(root + "/m16", f("size"));  // last sequence size off by one
    std::string idx = test::read_file(f("size.idx"));
    uint64_t S;  // m16: 9 documents, some of two sequences
    std::memcpy(&S, idx.data() + 18, 8);
    REQUIRE(fs::file_size(f("size.idx")) == 34 + 12 * S + 8 * 10);
    int32_t last;
    std::memcpy(&last, idx.data() + 34 + 4 * (S - 1), 4);
    patch(f("size.idx"), 34 + 4 * (S - 1), le<int32_t>(last + 1));
    CHECK_THAT(error_of(f("size.bin")), Contains(f("size.bin")) && Contains("last sequence ends"));
    copy_pair(root + "/m16", f("ptr"));  // a pointer in the middle moved
    int64_t p3;
    std::memcpy(&p3, idx.data() + 34 + 4 * S + 8 * 3, 8);
    patch(f("ptr.idx"), 34 + 4 * S + 8 * 3, le<int64_t>(p3 + 2));
    CHECK_THAT(error_of(f("ptr")), Contains(f("ptr.idx")) && Contains("not contiguous"));
    copy_pair(root + "/m16", f("long"));
    test::write_file(f("long.idx"), idx + "extra");
    CHECK_THAT(error_of(f("long")), Contains(f("long.idx")) && Contains("need"));
    copy_pair(root + "/m16", f("magic"));
    patch(f("magic.idx"), 0, "XX");
    CHECK_THAT(error_of(f("magic")), Contains(f("magic.idx")) && Contains("MMIDIDX"));
    copy_pair(root + "/m16", f("ver"));
    patch(f("ver.idx"), 9, le<uint64_t>(2));
    CHECK_THAT(error_of(f("ver")), Contains(f("ver.idx")) && Contains("version 2"));
    copy_pair(root + "/m16", f("f32"));
    patch(f("f32.idx"), 17, std::string(1, '\x07'));
    CHECK_THAT(error_of(f("f32")), Contains(f("f32.idx")) && Contains("float32"));
    test::write_file(f("orphan.idx"), idx);
    CHECK_THAT(error_of(f("orphan.idx")), Contains(f("orphan.bin")));
  }
  SECTION(".tok: version 1 names the converter; magic, unknown version, truncation") {
    // Version 1: magic, u32 version, u32 width, u64 docs, tokens, vocab, offsets, tokens.
    std::string v1 = "TITANTOK" + le<uint32_t>(1) + le<uint32_t>(2) + le<uint64_t>(1) +
                     le<uint64_t>(3) + le<uint64_t>(300) + le<uint64_t>(0) + le<uint64_t>(3) +
                     le<uint16_t>(1) + le<uint16_t>(2) + le<uint16_t>(3);
    test::write_file(f("old.tok"), v1);
    CHECK_THAT(error_of(f("old.tok")),
               Contains(f("old.tok")) && Contains("titan-train tokenize --input " + f("old.tok")));
    fs::copy_file(root + "/a.tok", f("v3.tok"));
    patch(f("v3.tok"), 8, le<uint32_t>(3));
    CHECK_THAT(error_of(f("v3.tok")), Contains(f("v3.tok")) && Contains("version 3"));
    fs::copy_file(root + "/a.tok", f("short.tok"));
    fs::resize_file(f("short.tok"), fs::file_size(f("short.tok")) - 1);
    CHECK_THAT(error_of(f("short.tok")), Contains(f("short.tok")) && Contains("truncated"));
    test::write_file(f("junk.tok"), "NOTATOKENFILE....");
    CHECK_THAT(error_of(f("junk.tok")), Contains(f("junk.tok")) && Contains("TITANTOK"));
  }
  SECTION("llm.c: version, truncation; an unknown .bin names its first bytes") {
    const std::string good = root + "/llmc/fineweb_train_000001.bin";
    fs::copy_file(good, f("v2.bin"));
    patch(f("v2.bin"), 4, le<int32_t>(2));
    CHECK_THAT(error_of(f("v2.bin")), Contains(f("v2.bin")) && Contains("version 2"));
    fs::copy_file(good, f("cut.bin"));
    fs::resize_file(f("cut.bin"), fs::file_size(f("cut.bin")) - 2);
    CHECK_THAT(error_of(f("cut.bin")), Contains(f("cut.bin")) && Contains("truncated"));
    test::write_file(f("raw.bin"), "\x01\x02hello world");
    CHECK_THAT(error_of(f("raw.bin")), Contains(f("raw.bin")) && Contains("first bytes 01 02 68"));
  }
  SECTION("paths: missing, empty folder, empty glob, mixed formats, raw text") {
    CHECK_THAT(error_of(f("nothing.tok")),
               Contains(f("nothing.tok")) && Contains("does not exist"));
    fs::create_directories(f("empty"));
    CHECK_THAT(error_of(f("empty")), Contains(f("empty")) && Contains("is empty"));
    CHECK_THAT(error_of(f("none_*.bin")), Contains(f("none_*.bin")) && Contains("matches no file"));
    fs::create_directories(f("mixed"));
    fs::copy_file(root + "/a.tok", f("mixed/a.tok"));
    fs::copy_file(root + "/llmc/fineweb_train_000001.bin", f("mixed/b.bin"));
    CHECK_THAT(error_of(f("mixed")), Contains(f("mixed")) && Contains("mixes formats") &&
                                         Contains("llm.c") && Contains("tok v2"));
    test::write_file(f("text.jsonl"), "{\"text\": \"hi\"}\n");
    CHECK_THAT(error_of(f("text.jsonl")), Contains(f("text.jsonl")) && Contains("raw text"));
  }
}

TEST_CASE("data: token ids at or above the vocabulary", "[data]") {
  const nlohmann::json& ref = reference();
  const int64_t w = ref["seq_len"].get<int64_t>() + 1;
  for (auto& e : ref["sources"]) {
    const std::string spec = e["spec"];
    INFO(spec);
    const int64_t max_id = e["max_id"].get<int64_t>();
    if (e["format"] == "tok v2") {  // checked at open, from the header
      CHECK_THAT(error_of(spec, max_id), Contains("ids up to " + std::to_string(max_id)) &&
                                             Contains("has " + std::to_string(max_id) + " tokens"));
      // The header also records the writing tokenizer's vocabulary (issue 32 item 6): a run
      // with a smaller one used another tokenizer, even where the ids present fit.
      const std::string err = error_of(spec, max_id + 1);
      if (err != "(no error)") CHECK_THAT(err, Contains("written for a vocabulary of"));
      CHECK_NOTHROW(TokenSource::open(spec, int64_t{1} << 20));
      continue;
    }
    // Megatron, llm.c: opening is fine; the first window holding a bad id names the shard and
    // the token's offset within it.
    const int64_t vocab = 1000;
    auto src = TokenSource::open(spec, vocab);
    auto windows = e["windows"].get<std::vector<std::vector<int64_t>>>();
    std::vector<int64_t> got(static_cast<size_t>(w));
    for (size_t i = 0; i < windows.size(); ++i) {
      auto bad =
          std::find_if(windows[i].begin(), windows[i].end(), [&](int64_t t) { return t >= vocab; });
      if (bad == windows[i].end()) continue;
      const int64_t pos = static_cast<int64_t>(i) * w + (bad - windows[i].begin());
      const auto loc = src->locate(pos);
      CHECK_THROWS_WITH(src->read(static_cast<int64_t>(i) * w, w, got.data()),
                        Contains("'" + src->shard(loc.shard).path + "'") &&
                            Contains("token id " + std::to_string(*bad) + " at token offset " +
                                     std::to_string(loc.offset)));
      break;
    }
  }
}

TEST_CASE("data: a shard truncated or overwritten after opening is an error naming it", "[data]") {
  // docs/data.md "Files that change": every read checks its shard's size and modification
  // time; a file replaced by a rename is fine (the mapping keeps the old one).
  test::TempDir dir("changed");
  const std::string path = dir.file("a.tok");
  std::vector<int32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i % 250);
  write_tok_v2(path, tokens, {0, 10000, 20000}, 256);
  std::vector<int64_t> out(100);
  {  // truncated
    auto src = TokenSource::open(path, 256);
    src->read(0, 100, out.data());
    std::filesystem::resize_file(path, 4096 + 2 * 5000);
    try {
      src->read(15000, 100, out.data());
      FAIL("no error");
    } catch (const UserError& e) {
      CHECK_THAT(e.what(), Contains(path) && Contains("bytes now") && Contains("must not change"));
    }
  }
  write_tok_v2(path, tokens, {0, 10000, 20000}, 256);
  {  // overwritten in place: same size, a later modification time
    auto src = TokenSource::open(path, 256);
    src->read(0, 100, out.data());
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(4096);
      f.put('\x07');
    }
    struct timespec times[2] = {{0, UTIME_OMIT}, {time(nullptr) + 5, 0}};
    REQUIRE(::utimensat(AT_FDCWD, path.c_str(), times, 0) == 0);
    try {
      src->read(0, 100, out.data());
      FAIL("no error");
    } catch (const UserError& e) {
      CHECK_THAT(e.what(), Contains(path) && Contains("modified after it was opened"));
    }
  }
  {  // replaced by a rename: the old file stays mapped and reads on
    auto src = TokenSource::open(path, 256);
    write_tok_v2(path, std::vector<int32_t>(10, 1), {0, 10}, 256);  // temp file + rename
    src->read(19900, 100, out.data());
    CHECK(out[0] == 19900 % 250);
  }
}

TEST_CASE("data: a .tok token above its header's max id is an error naming the file", "[data]") {
  // Found by test/fuzz/fuzz_token_source.cpp: the reader trusted the header's max id, so a
  // damaged token (here 16391 in a file whose header says 299, vocabulary 300) reached the
  // model's embedding.
  test::TempDir dir("maxid");
  const std::string path = dir.file("a.tok");
  write_tok_v2(path, {1, 2, 3, 299, 0, 7, 9, 299}, {0, 3, 8}, 300);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096 + 2 * 5);
    const uint16_t bad = 16391;
    f.write(reinterpret_cast<const char*>(&bad), 2);
  }
  auto src = TokenSource::open(path, 300);
  std::vector<int64_t> out(8);
  try {
    src->read(0, 8, out.data());
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Contains(path) && Contains("token id 16391 at token offset 5") &&
                             Contains("outside this run's vocabulary"));
  }
  auto wide = TokenSource::open(path, 65536);  // inside the vocabulary, above the header's max
  try {
    wide->read(0, 8, out.data());
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Contains("above the max id 299 its header records"));
  }
}
