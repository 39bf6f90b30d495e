// Streaming text readers: the .txt and JSONL document rules (those of the whole-file reader
// they replace), UTF-8 errors with byte offsets, gzip/zstd streams of several members/frames,
// batching, and input expansion (folders, globs, bad specs). Expected values are written out
// by hand from the format rules; Python's gzip/zstandard/pyarrow cross-checks are in
// test_tokenize.cpp.
#include <catch2/catch.hpp>

#include <zlib.h>
#include <zstd.h>

#include "core/base/errors.h"
#include "core/data/text_reader.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

namespace {

std::string gzip_member(const std::string& s) {
  z_stream z{};
  REQUIRE(deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::string out(deflateBound(&z, s.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(s.data()));
  z.avail_in = static_cast<uInt>(s.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string zstd_frame(const std::string& s) {
  std::string out(ZSTD_compressBound(s.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), s.data(), s.size(), 3);
  REQUIRE_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

bool accept_text(const std::string& p) {
  TextFormat f;
  return text_format_of(p, &f);
}

}  // namespace

TEST_CASE("textreader: .txt documents are runs of non-blank lines", "[textreader]") {
  test::TempDir dir("txtread");
  // Blank lines hold only spaces, tabs or CR; leading spaces and CRs inside lines are kept;
  // the last line needs no newline.
  test::write_file(dir.file("a.txt"),
                   "first doc\nline two\n\n\n second\n \t\r\nthird\r\nstill third\n\n\nlast");
  auto docs = read_documents(dir.file("a.txt"));
  REQUIRE(docs.size() == 4);
  CHECK(docs[0] == "first doc\nline two");
  CHECK(docs[1] == " second");
  CHECK(docs[2] == "third\r\nstill third");
  CHECK(docs[3] == "last");
  test::write_file(dir.file("empty.txt"), "");
  CHECK_THROWS_WITH(read_documents(dir.file("empty.txt")),
                    Contains("empty.txt") && Contains("is empty"));
  test::write_file(dir.file("blank.txt"), "\n \n\t\n");
  CHECK_THROWS_WITH(read_documents(dir.file("blank.txt")),
                    Contains("blank.txt") && Contains("holds no documents"));
}

TEST_CASE("textreader: JSONL takes one string field per line", "[textreader]") {
  test::TempDir dir("jsonlread");
  test::write_file(dir.file("b.jsonl"),
                   "{\"text\": \"alpha\"}\n\n  \r\n{\"id\": 3, \"text\": \"beta\\ngamma\\u00e9\", "
                   "\"meta\": {\"text\": \"nested\"}}\r\n{\"text\": \"\"}\n"
                   "{\"text\": \"old\", \"x\": [1, {\"text\": 2}], \"text\": \"last wins\"}");
  auto docs = read_documents(dir.file("b.jsonl"));
  REQUIRE(docs.size() == 4);
  CHECK(docs[0] == "alpha");
  CHECK(docs[1] == "beta\ngamma\xc3\xa9");
  CHECK(docs[2].empty());
  CHECK(docs[3] == "last wins");
  // --field picks another key; a line without it names the file and line.
  test::write_file(dir.file("c.jsonl"), "{\"body\": \"x\"}\n{\"text\": \"y\"}\n");
  TextReaderOptions o;
  o.field = "body";
  CHECK_THROWS_WITH(read_documents(dir.file("c.jsonl"), o),
                    Contains("c.jsonl' line 2") && Contains("string \"body\" field"));
  CHECK_THROWS_WITH(read_documents(dir.file("c.jsonl")), Contains("c.jsonl' line 1"));
  for (const char* bad : {"{\"text\": 5}", "[\"text\"]", "{\"text\": \"a\"} x", "{\"text\": \"a",
                          "{\"text\": {\"a\": 1}}", "{\"text\": \"\\ud800\"}"}) {
    INFO(bad);
    test::write_file(dir.file("d.jsonl"), std::string("{\"text\": \"ok\"}\n") + bad + "\n");
    CHECK_THROWS_WITH(read_documents(dir.file("d.jsonl")), Contains("d.jsonl' line 2"));
  }
}

TEST_CASE("textreader: invalid UTF-8 names the file and byte offset", "[textreader]") {
  test::TempDir dir("utf8read");
  // Offsets are of the first bad byte in the whole file, as the whole-file reader reported.
  test::write_file(dir.file("a.txt"), "ok line\n\nbad \xff here\n");
  CHECK_THROWS_WITH(read_documents(dir.file("a.txt")),
                    Contains("a.txt': not valid UTF-8 at byte offset 13"));
  test::write_file(dir.file("b.jsonl"), "{\"text\": \"a\"}\n{\"text\": \"\xc3\x28\"}\n");
  CHECK_THROWS_WITH(read_documents(dir.file("b.jsonl")),
                    Contains("b.jsonl': not valid UTF-8 at byte offset 24"));
  CHECK(invalid_utf8_at("plain ascii text, long enough for the 8-byte skip") == std::string::npos);
  CHECK(invalid_utf8_at("\xe2\x82\xac \xf0\x9f\x98\x80 \xc3\xa9") == std::string::npos);
  CHECK(invalid_utf8_at("abcdefgh\xc0\xaf") == 8);     // overlong '/'
  CHECK(invalid_utf8_at("abc\xed\xa0\x80") == 3);      // surrogate U+D800
  CHECK(invalid_utf8_at("\xf4\x90\x80\x80") == 0);     // above U+10FFFF
  CHECK(invalid_utf8_at("0123456789\xe2\x82") == 10);  // cut short at the end
  CHECK(invalid_utf8_at("\x80") == 0);                 // lone continuation byte
}

TEST_CASE("textreader: gzip members and zstd frames stream as one text", "[textreader]") {
  test::TempDir dir("zread");
  std::string part1, part2;
  for (int i = 0; i < 3000; ++i) part1 += "{\"text\": \"document " + std::to_string(i) + "\"}\n";
  for (int i = 3000; i < 5000; ++i) part2 += "{\"text\": \"document " + std::to_string(i) + "\"}\n";
  test::write_file(dir.file("a.jsonl.gz"), gzip_member(part1) + gzip_member(part2));
  test::write_file(dir.file("a.jsonl.zst"), zstd_frame(part1) + zstd_frame(part2));
  for (const char* name : {"a.jsonl.gz", "a.jsonl.zst"}) {
    INFO(name);
    auto docs = read_documents(dir.file(name));
    REQUIRE(docs.size() == 5000);
    CHECK(docs[0] == "document 0");
    CHECK(docs[4999] == "document 4999");
  }
  // Truncated and corrupt streams are errors naming the file, never a silent short read.
  const std::string gz = gzip_member(part1);
  test::write_file(dir.file("t.jsonl.gz"), gz.substr(0, gz.size() / 2));
  CHECK_THROWS_WITH(read_documents(dir.file("t.jsonl.gz")),
                    Contains("t.jsonl.gz") && Contains("truncated gzip"));
  const std::string zs = zstd_frame(part1);
  test::write_file(dir.file("t.jsonl.zst"), zs.substr(0, zs.size() / 2));
  CHECK_THROWS_WITH(read_documents(dir.file("t.jsonl.zst")),
                    Contains("t.jsonl.zst") && Contains("truncated zstd"));
  test::write_file(dir.file("c.jsonl.zst"), "this is not zstd at all");
  CHECK_THROWS_WITH(read_documents(dir.file("c.jsonl.zst")),
                    Contains("c.jsonl.zst") && Contains("corrupt zstd"));
}

TEST_CASE("textreader: batches cut anywhere give the same records and offsets", "[textreader]") {
  test::TempDir dir("batchread");
  std::string text, big(3 << 20, 'x');  // one 3 MiB line: longer than the read buffer
  for (int i = 0; i < 2000; ++i) text += "doc " + std::to_string(i) + "\nline b\n\n";
  text += big + "\n";
  test::write_file(dir.file("a.txt"), text);
  TextReaderOptions small;
  small.batch_bytes = 100;
  auto src = open_text_source(dir.file("a.txt"), small);
  TextBatch b;
  std::vector<std::string> docs;
  size_t batches = 0;
  while (src->next(b)) {
    ++batches;
    std::string scratch;
    for (size_t i = 0; i < b.size(); ++i) {
      docs.emplace_back(decode_record(b, i, "text", scratch));
      // The recorded offset points at the document's first byte in the file.
      CHECK(text.compare(b.offsets[i], docs.back().size(), docs.back()) == 0);
    }
  }
  CHECK(batches > 100);
  CHECK(src->bytes_done() == text.size());
  REQUIRE(docs.size() == 2001);
  CHECK(docs[1999] == "doc 1999\nline b");
  CHECK(docs[2000] == big);
  CHECK(docs == read_documents(dir.file("a.txt")));
}

TEST_CASE("textreader: folders and globs expand in sorted order; bad specs are errors",
          "[textreader]") {
  test::TempDir dir("expand");
  namespace fs = std::filesystem;
  fs::create_directories(dir.file("d"));
  fs::create_directories(dir.file("empty"));
  for (const char* n : {"d/b.jsonl", "d/a.txt", "d/c.jsonl.zst", "d/.hidden.txt", "d/README.md"})
    test::write_file(dir.file(n), "x\n");
  const std::string allowed = text_formats_allowed();
  auto files = expand_input_specs({dir.file("d")}, accept_text, allowed);
  REQUIRE(files.size() == 3);
  CHECK(files[0] == dir.file("d/a.txt"));
  CHECK(files[1] == dir.file("d/b.jsonl"));
  CHECK(files[2] == dir.file("d/c.jsonl.zst"));
  auto globbed =
      expand_input_specs({dir.file("d/*.jsonl*"), dir.file("d/a.txt")}, accept_text, allowed);
  REQUIRE(globbed.size() == 3);
  CHECK(globbed[0] == dir.file("d/b.jsonl"));
  CHECK(globbed[2] == dir.file("d/a.txt"));
  CHECK_THROWS_WITH(expand_input_specs({dir.file("empty")}, accept_text, allowed),
                    Contains("empty'") && Contains("holds no input files"));
  CHECK_THROWS_WITH(expand_input_specs({dir.file("d/*.parquet")}, accept_text, allowed),
                    Contains("*.parquet") && Contains("matches no file"));
  CHECK_THROWS_WITH(expand_input_specs({dir.file("d/README.md")}, accept_text, allowed),
                    Contains("README.md") && Contains("unknown extension") && Contains(".jsonl"));
  CHECK_THROWS_WITH(expand_input_specs({dir.file("d/*.md")}, accept_text, allowed),
                    Contains("README.md") && Contains("unknown extension"));
  CHECK_THROWS_WITH(expand_input_specs({dir.file("nope.txt")}, accept_text, allowed),
                    Contains("nope.txt") && Contains("does not exist"));
}
