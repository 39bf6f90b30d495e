// `titan-train tokenize`, the token writers and the raw-text cache.
//
// References (test/reference/tokenize_big_ref.py, run with the venv's Python): Hugging Face
// `tokenizers` encode_batch(texts, add_special_tokens=False) with BOS/EOS added around each
// document, on documents parsed by Python's json module; .tok v2 files read back with numpy
// (every layout rule checked); Megatron files compared byte for byte with what megatron-core's
// IndexedDatasetBuilder writes, and read back with its IndexedDataset; .jsonl.gz, .jsonl.zst
// and Parquet inputs written by gzip, zstandard and pyarrow. Tolerance: exact (token ids and
// bytes).
#include <catch2/catch.hpp>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <regex>

#include "core/base/errors.h"
#include "core/data/text_reader.h"
#include "core/data/token_cache.h"
#include "core/data/token_writer.h"
#include "core/data/tokenize_pipeline.h"
#include "core/tokenizer/tokenizer.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

test::CmdResult py_ref(const std::string& args) {
  return test::run(test::python() + " " + test::source_dir() +
                   "/test/reference/tokenize_big_ref.py " + args);
}

test::CmdResult tokenize(const std::string& args) {
  return test::run(test::binary() + " tokenize " + args);
}

// The bundled corpus as JSONL, one chapter per line, up to max_bytes of text, then documents
// that stress byte-level BPE: accents, CJK, emoji, CR LF, tabs, JSON escapes.
std::string corpus_jsonl(size_t max_bytes) {
  const std::string corpus = test::read_file(test::corpus_path());
  std::string out;
  size_t pos = 0;
  while (pos < corpus.size() && pos < max_bytes) {
    size_t end = corpus.find("\n\n", pos);
    if (end == std::string::npos) end = corpus.size();
    out += nlohmann::json({{"text", corpus.substr(pos, end - pos)}, {"n", pos}}).dump() + "\n";
    pos = end + 2;
  }
  for (const char* t : {"caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
                        "emoji \xf0\x9f\x98\x80\xf0\x9f\x91\x8d end", "line\r\nbreak\ttab  ",
                        "   leading spaces", "quote \" backslash \\ slash /", "1234567 89"})
    out += nlohmann::json({{"text", t}}).dump() + "\n";
  return out;
}

// The text of the first `bytes` of the corpus, cut at a document boundary.
std::string corpus_txt(size_t bytes) {
  const std::string corpus = test::read_file(test::corpus_path());
  return corpus.substr(0, corpus.find("\n\n", bytes));
}

struct TokHeader {
  uint32_t version = 0, width = 0;
  uint64_t docs = 0, tokens = 0, vocab = 0, max_id = 0;
};

TokHeader tok_header(const std::string& path) {
  const std::string b = test::read_file(path);
  REQUIRE(b.size() >= 64);
  TokHeader h;
  std::memcpy(&h.version, b.data() + 8, 4);
  std::memcpy(&h.width, b.data() + 12, 4);
  std::memcpy(&h.docs, b.data() + 16, 8);
  std::memcpy(&h.tokens, b.data() + 24, 8);
  std::memcpy(&h.vocab, b.data() + 32, 8);
  std::memcpy(&h.max_id, b.data() + 40, 8);
  return h;
}

// Documents of a .tok v2 (layout trusted here; the Python reference checks it).
std::vector<std::vector<int64_t>> tok_docs(const std::string& path) {
  const std::string b = test::read_file(path);
  const TokHeader h = tok_header(path);
  uint64_t start;
  std::memcpy(&start, b.data() + 56, 8);
  std::vector<std::vector<int64_t>> docs;
  for (uint64_t d = 0; d < h.docs; ++d) {
    uint64_t lo, hi;
    std::memcpy(&lo, b.data() + 64 + 8 * d, 8);
    std::memcpy(&hi, b.data() + 64 + 8 * (d + 1), 8);
    std::vector<int64_t> doc;
    for (uint64_t i = lo; i < hi; ++i) {
      uint32_t t = 0;
      std::memcpy(&t, b.data() + start + i * h.width, h.width);
      doc.push_back(t);
    }
    docs.push_back(doc);
  }
  return docs;
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string ids(const Tokenizer& t) {
  return std::to_string(t.bos_id()) + " " + std::to_string(t.eos_id());
}

}  // namespace

TEST_CASE("tokenize: output is the same for 1, 2 and 4 threads and equals HF tokenizers",
          "[tokenize]") {
  test::TempDir dir("tokthreads");
  const std::string tok = test::tokenizer_path();
  auto t = load_tokenizer(tok);
  test::write_file(dir.file("c.jsonl"), corpus_jsonl(1500000));
  // Small work items (64 KiB) so that 4 threads really interleave on this input.
  for (int th : {1, 2, 4}) {
    auto r = tokenize("--tokenizer " + tok + " --threads " + std::to_string(th) +
                      " --batch-bytes 65536 --output " + dir.file("t" + std::to_string(th)) + " " +
                      dir.file("c.jsonl"));
    INFO(r.out);
    REQUIRE(r.rc == 0);
    CHECK_THAT(r.out, Contains("1 shard(s)"));
  }
  const std::string one = test::read_file(dir.file("t1.tok"));
  CHECK(one == test::read_file(dir.file("t2.tok")));
  CHECK(one == test::read_file(dir.file("t4.tok")));
  auto r = py_ref("check-tok " + tok + " " + dir.file("c.jsonl") + " " + ids(*t) + " " +
                  dir.file("t1.tok"));
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK_THAT(r.out, Contains("ok "));
  // Plain text, and the framing flags.
  test::write_file(dir.file("c.txt"), corpus_txt(300000));
  auto x = tokenize("--tokenizer " + tok + " --threads 2 --batch-bytes 50000 --output " +
                    dir.file("x.tok") + " " + dir.file("c.txt"));
  REQUIRE(x.rc == 0);
  auto y = tokenize("--tokenizer " + tok + " --no-bos --output " + dir.file("y.tok") + " " +
                    dir.file("c.txt"));
  REQUIRE(y.rc == 0);
  auto rx = py_ref("check-tok " + tok + " " + dir.file("c.txt") + " " + ids(*t) + " " +
                   dir.file("x.tok"));
  INFO(rx.out);
  CHECK(rx.rc == 0);
  auto ry = py_ref("check-tok " + tok + " " + dir.file("c.txt") + " -1 " +
                   std::to_string(t->eos_id()) + " " + dir.file("y.tok"));
  INFO(ry.out);
  CHECK(ry.rc == 0);
}

TEST_CASE("tokenize: shards hold at most --shard-tokens tokens of whole documents, in order",
          "[tokenize]") {
  test::TempDir dir("tokshards");
  const std::string tok = test::tokenizer_path();
  auto t = load_tokenizer(tok);
  test::write_file(dir.file("c.jsonl"), corpus_jsonl(400000));
  fs::create_directories(dir.file("s"));
  auto r = tokenize("--tokenizer " + tok + " --threads 2 --shard-tokens 20000 --output " +
                    dir.file("s/out.tok") + " " + dir.file("c.jsonl"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto names = files_in(dir.file("s"));
  REQUIRE(names.size() >= 3);
  std::string shards;
  for (size_t i = 0; i < names.size(); ++i) {
    char want[32];
    std::snprintf(want, sizeof want, "out_%06zu.tok", i);
    CHECK(names[i] == want);  // no temporaries, no unsharded name
    const TokHeader h = tok_header(dir.file("s/" + names[i]));
    CHECK(h.tokens <= 20000);
    CHECK(h.tokens > 0);
    shards += " " + dir.file("s/" + names[i]);
  }
  auto c = py_ref("check-tok " + tok + " " + dir.file("c.jsonl") + " " + ids(*t) + shards);
  INFO(c.out);
  CHECK(c.rc == 0);
  // Megatron pairs split at the same documents.
  fs::create_directories(dir.file("m"));
  auto m = tokenize("--tokenizer " + tok + " --format megatron --shard-tokens 20000 --output " +
                    dir.file("m/out") + " " + dir.file("c.jsonl"));
  REQUIRE(m.rc == 0);
  auto mnames = files_in(dir.file("m"));
  REQUIRE(mnames.size() == 2 * names.size());
  CHECK(mnames[0] == "out_000000.bin");
  CHECK(mnames[1] == "out_000000.idx");
}

TEST_CASE("tokenize: .jsonl.gz, .jsonl.zst and Parquet inputs give the plain JSONL's tokens",
          "[tokenize]") {
  test::TempDir dir("tokformats");
  const std::string tok = test::tokenizer_path();
  test::write_file(dir.file("in.jsonl"), corpus_jsonl(600000));
  auto g = py_ref("inputs " + dir.file("in.jsonl") + " " + dir.path.string());
  INFO(g.out);
  REQUIRE(g.rc == 0);
  auto run = [&](const std::string& in, const std::string& out) {
    auto r = tokenize("--tokenizer " + tok + " --threads 2 --batch-bytes 100000 --output " +
                      dir.file(out) + " " + dir.file(in));
    INFO(r.out);
    REQUIRE(r.rc == 0);
    return test::read_file(dir.file(out));
  };
  const std::string plain = run("in.jsonl", "plain.tok");
  CHECK(run("in.jsonl.gz", "gz.tok") == plain);
  CHECK(run("in.jsonl.zst", "zst.tok") == plain);
  if (!parquet_supported()) {
    auto r = tokenize("--tokenizer " + tok + " --output " + dir.file("pq.tok") + " " +
                      dir.file("in.parquet"));
    CHECK(r.rc == 2);
    CHECK_THAT(r.out, Contains("Apache Arrow"));
    TITAN_SKIP("this build has no Parquet support (configure found no pyarrow)");
  }
  CHECK(run("in.parquet", "pq.tok") == plain);
  CHECK(run("dict.parquet", "dict.tok") == plain);
  // The other field through --field: Parquet column "body".
  auto b = tokenize("--tokenizer " + tok + " --field body --output " + dir.file("body.tok") + " " +
                    dir.file("nofield.parquet"));
  INFO(b.out);
  REQUIRE(b.rc == 0);
  CHECK(test::read_file(dir.file("body.tok")) == plain);
}

TEST_CASE("tokenize: Megatron output equals megatron-core's IndexedDatasetBuilder byte for byte",
          "[tokenize]") {
  test::TempDir dir("tokmegatron");
  const std::string tok = test::tokenizer_path();
  auto t = load_tokenizer(tok);
  test::write_file(dir.file("c.jsonl"), corpus_jsonl(200000));
  auto a = tokenize("--tokenizer " + tok + " --format megatron --output " + dir.file("m.bin") +
                    " " + dir.file("c.jsonl"));
  auto b =
      tokenize("--tokenizer " + tok + " --output " + dir.file("t") + " " + dir.file("c.jsonl"));
  INFO(a.out + b.out);
  REQUIRE(a.rc == 0);
  REQUIRE(b.rc == 0);
  CHECK(fs::exists(dir.file("m.idx")));
  // The writer itself at both widths: uint16 below 65500 ids, int32 from there (.tok: u16 up
  // to 65536, u32 above), with an empty document and the largest id.
  const std::vector<std::vector<int32_t>> docs = {{5, 7, 9}, {}, {65535}, {0, 1}, {42}};
  const std::vector<std::vector<int32_t>> wide = {{69999, 3}, {}, {65500, 65535, 1}};
  auto write = [&](const std::string& out, TokenFileFormat f, int64_t vocab,
                   const std::vector<std::vector<int32_t>>& d) {
    TokenWriterOptions o;
    o.format = f;
    o.vocab_size = vocab;
    TokenShardWriter w(out, o);
    for (auto& doc : d) w.add_document(doc.data(), doc.size());
    return w.commit();
  };
  write(dir.file("n16.tok"), TokenFileFormat::kTok, 65536, docs);
  write(dir.file("n16"), TokenFileFormat::kMegatron, 65536, docs);  // Megatron: int32 here
  write(dir.file("w.tok"), TokenFileFormat::kTok, 70000, wide);
  write(dir.file("w"), TokenFileFormat::kMegatron, 70000, wide);
  write(dir.file("s.tok"), TokenFileFormat::kTok, 300, {{1, 2}, {299}});
  write(dir.file("s"), TokenFileFormat::kMegatron, 300, {{1, 2}, {299}});
  CHECK(tok_header(dir.file("n16.tok")).width == 2);
  CHECK(tok_header(dir.file("w.tok")).width == 4);
  CHECK(tok_header(dir.file("w.tok")).max_id == 69999);
  auto r = py_ref("megatron-compare " + dir.file("t.tok") + " " + dir.file("m") + " " +
                  std::to_string(t->vocab_size()) + " " + dir.file("n16.tok") + " " +
                  dir.file("n16") + " 65536 " + dir.file("w.tok") + " " + dir.file("w") +
                  " 70000 " + dir.file("s.tok") + " " + dir.file("s") + " 300");
  INFO(r.out);
  CHECK(r.rc == 0);
  CHECK(std::regex_search(r.out, std::regex("ok [0-9]+\nok 5\nok 3\nok 2")));
}

TEST_CASE("tokenize: bad input is one error line naming the file, exit 2, nothing written",
          "[tokenize]") {
  test::TempDir dir("tokbad");
  const std::string tok = test::tokenizer_path();
  test::write_file(dir.file("in.jsonl"), "{\"text\": \"a\"}\n{\"text\": \"b\"}\n");
  auto g = py_ref("inputs " + dir.file("in.jsonl") + " " + dir.path.string());
  REQUIRE(g.rc == 0);
  test::write_file(dir.file("nofield.jsonl"), "{\"text\": \"a\"}\n{\"content\": \"b\"}\n");
  test::write_file(dir.file("latin1.txt"), "ok\n\ncaf\xe9\n");
  test::write_file(dir.file("data.csv"), "text\nhello\n");
  fs::create_directories(dir.file("empty"));
  fs::create_directories(dir.file("out"));
  struct Case {
    std::string input;
    std::vector<std::string> expect;
  };
  std::vector<Case> cases = {
      {dir.file("nofield.jsonl"), {"nofield.jsonl' line 2", "string \"text\" field"}},
      {dir.file("latin1.txt"), {"latin1.txt", "not valid UTF-8 at byte offset 7"}},
      {dir.file("data.csv"), {"data.csv", "unknown extension", ".jsonl.zst"}},
      {dir.file("empty"), {"empty", "holds no input files"}},
      {dir.file("nothing_*.jsonl"), {"nothing_*.jsonl", "matches no file"}},
      // A good file first: the error still removes everything written for it.
      {dir.file("in.jsonl") + " " + dir.file("nofield.jsonl"), {"nofield.jsonl' line 2"}},
  };
  if (parquet_supported())
    cases.push_back(
        {dir.file("nofield.parquet"), {"nofield.parquet", "no column \"text\"", "body"}});
  for (const char* fmt : {"tok", "megatron"})
    for (auto& c : cases) {
      INFO(fmt << " " << c.input);
      auto r = tokenize("--tokenizer " + tok + " --format " + fmt + " --output " +
                        dir.file("out/x") + " " + c.input);
      INFO(r.out);
      CHECK(r.rc == 2);
      CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
      CHECK_THAT(r.out, Contains("titan-train: error: "));
      for (auto& e : c.expect) CHECK_THAT(r.out, Contains(e));
      CHECK(files_in(dir.file("out")).empty());
    }
  auto nodir = tokenize("--tokenizer " + tok + " --output " + dir.file("no/such/x") + " " +
                        dir.file("in.jsonl"));
  CHECK(nodir.rc == 2);
  CHECK_THAT(nodir.out, Contains("no/such") && Contains("does not exist"));
}

TEST_CASE("tokenize: a version-1 .tok is rewritten as version 2 with BOS/EOS", "[tokenize]") {
  test::TempDir dir("tokv1");
  // Version 1: magic, u32 1, u32 width 2, u64 docs, u64 tokens, u64 vocab, u64 offsets[docs+1],
  // u16 tokens; documents without BOS/EOS.
  std::string v1 = "TITANTOK";
  auto put = [&](auto v) { v1.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(uint32_t{1});
  put(uint32_t{2});
  put(uint64_t{2});
  put(uint64_t{4});
  put(uint64_t{258});
  for (uint64_t o : {0, 3, 4}) put(o);
  for (uint16_t tkn : {104, 105, 33, 255}) put(tkn);
  test::write_file(dir.file("old.tok"), v1);
  auto r = tokenize("--tokenizer bytes --input " + dir.file("old.tok") + " --output " +
                    dir.file("new.tok"));
  INFO(r.out);
  REQUIRE(r.rc == 0);
  const TokHeader h = tok_header(dir.file("new.tok"));
  CHECK(h.version == 2);
  CHECK(h.docs == 2);
  CHECK(h.vocab == 258);
  CHECK(h.max_id == 257);
  auto docs = tok_docs(dir.file("new.tok"));
  CHECK(docs == std::vector<std::vector<int64_t>>{{256, 104, 105, 33, 257}, {256, 255, 257}});
  auto again = tokenize("--tokenizer bytes --input " + dir.file("new.tok") + " --output " +
                        dir.file("z.tok"));
  CHECK(again.rc == 2);
  CHECK_THAT(again.out, Contains("new.tok") && Contains("already version 2"));
  test::write_file(dir.file("cut.tok"), v1.substr(0, v1.size() - 1));
  auto cut = tokenize("--tokenizer bytes --input " + dir.file("cut.tok") + " --output " +
                      dir.file("z.tok"));
  CHECK(cut.rc == 2);
  CHECK_THAT(cut.out, Contains("cut.tok"));
  CHECK_FALSE(fs::exists(dir.file("z.tok")));
}

TEST_CASE("tokenize: the raw-text cache is reused until the input or the tokenizer changes",
          "[tokenize]") {
  test::TempDir dir("tokcache");
  const std::string raw = dir.file("corpus.txt");
  test::write_file(raw, corpus_txt(200000));
  const std::string tok_file = test::tokenizer_path();
  auto tok = load_tokenizer(tok_file);
  TokenCacheOptions o;
  o.cache_dir = dir.file("cache");
  o.threads = 2;
  int barriers = 0;
  o.barrier = [&] { ++barriers; };
  TokenCacheResult a = ensure_token_cache(raw, *tok, tok_file, o);
  CHECK_FALSE(a.reused);
  CHECK(barriers == 1);
  CHECK_THAT(a.log_line, Contains("tokenized") && Contains("corpus.txt"));
  REQUIRE(fs::exists(a.path));
  const auto built_at = fs::last_write_time(a.path);
  // The same bytes as the command line's output.
  auto cli = tokenize("--tokenizer " + tok_file + " --output " + dir.file("cli.tok") + " " + raw);
  REQUIRE(cli.rc == 0);
  CHECK(test::read_file(a.path) == test::read_file(dir.file("cli.tok")));

  TokenCacheResult b = ensure_token_cache(raw, *tok, tok_file, o);
  CHECK(b.reused);
  CHECK(b.path == a.path);
  CHECK_THAT(b.log_line, Contains("reusing"));
  CHECK(fs::last_write_time(a.path) == built_at);  // not rewritten
  // Another rank of the node: waits at the barrier, then uses the file.
  TokenCacheOptions w = o;
  w.builder = false;
  TokenCacheResult c = ensure_token_cache(raw, *tok, tok_file, w);
  CHECK(c.reused);
  CHECK(c.path == a.path);
  CHECK(barriers == 3);

  // Touching the input rebuilds into a new file.
  fs::last_write_time(raw, fs::last_write_time(raw) + std::chrono::seconds(5));
  TokenCacheResult d = ensure_token_cache(raw, *tok, tok_file, o);
  CHECK_FALSE(d.reused);
  CHECK(d.path != a.path);
  // So does another tokenizer file, even one that encodes the same (a trailing newline).
  test::write_file(dir.file("tok2.json"), test::read_file(tok_file) + "\n");
  auto tok2 = load_tokenizer(dir.file("tok2.json"));
  TokenCacheResult e = ensure_token_cache(raw, *tok2, dir.file("tok2.json"), o);
  CHECK_FALSE(e.reused);
  CHECK(e.path != d.path);
  CHECK(test::read_file(e.path) == test::read_file(d.path));
  CHECK(ensure_token_cache(raw, *tok2, dir.file("tok2.json"), o).reused);

  // A failing build still reaches the barrier, so the waiting ranks fail at once, by name.
  test::write_file(dir.file("bad.txt"), "fine\n\nnot \xff fine\n");
  barriers = 0;
  CHECK_THROWS_WITH(ensure_token_cache(dir.file("bad.txt"), *tok, tok_file, o),
                    Contains("bad.txt") && Contains("UTF-8"));
  CHECK(barriers == 1);
  CHECK_THROWS_WITH(ensure_token_cache(dir.file("bad.txt"), *tok, tok_file, w),
                    Contains("bad.txt") && Contains("local rank 0"));
  for (auto& f : files_in(dir.file("cache"))) CHECK(f.find(".tmp-") == std::string::npos);

  // The default folder is $TITAN_CACHE/tokcache.
  const char* old = std::getenv("TITAN_CACHE");
  const std::string saved = old ? old : "";
  ::setenv("TITAN_CACHE", dir.file("tc").c_str(), 1);
  const std::string p = token_cache_path(raw, tok_file, TokenCacheOptions{});
  if (old)
    ::setenv("TITAN_CACHE", saved.c_str(), 1);
  else
    ::unsetenv("TITAN_CACHE");
  CHECK(p.rfind(dir.file("tc") + "/tokcache/corpus.txt-", 0) == 0);
}

TEST_CASE("tokenize: peak memory does not grow with the input (30 MB vs 300 MB of JSONL)",
          "[tokenize][slow]") {
  if (!fs::exists("/usr/bin/time")) TITAN_SKIP("needs /usr/bin/time to measure peak RSS");
  test::TempDir dir("tokrss");
  // Chapters of the bundled corpus, each copy made distinct by its number. The byte
  // tokenizer keeps 300 MB within the test's time on one core; the pipeline, readers and
  // writers (what this bounds) are the same as with BPE.
  const std::string corpus = test::read_file(test::corpus_path());
  auto make = [&](const std::string& path, size_t bytes) {
    std::ofstream f(path, std::ios::binary);
    size_t written = 0, copy = 0, pos = 0;
    while (written < bytes) {
      size_t end = corpus.find("\n\n", pos);
      if (end == std::string::npos) end = corpus.size(), ++copy;
      const std::string line = nlohmann::json({{"text", "copy " + std::to_string(copy) + ": " +
                                                            corpus.substr(pos, end - pos)}})
                                   .dump() +
                               "\n";
      f << line;
      written += line.size();
      pos = end >= corpus.size() ? 0 : end + 2;
    }
  };
  auto peak_kb = [&](const std::string& in) {
    auto r =
        test::run("/usr/bin/time -f 'maxrss_kb %M' " + test::binary() +
                  " tokenize --tokenizer bytes --threads 2 --output " + dir.file("out") + " " + in);
    INFO(r.out);
    REQUIRE(r.rc == 0);
    std::smatch m;
    REQUIRE(std::regex_search(r.out, m, std::regex("maxrss_kb ([0-9]+)")));
    fs::remove(dir.file("out.tok"));
    return std::stoll(m[1]);
  };
  // The binary maps LibTorch and its CUDA libraries before reading any data (~370 MB here),
  // so the bounds are on the growth above a one-document run.
  test::write_file(dir.file("one.jsonl"), "{\"text\": \"one\"}\n");
  const int64_t base = peak_kb(dir.file("one.jsonl"));
  make(dir.file("small.jsonl"), 30u << 20);
  const int64_t small = peak_kb(dir.file("small.jsonl"));
  make(dir.file("big.jsonl"), 300u << 20);
  const int64_t big = peak_kb(dir.file("big.jsonl"));
  fs::remove(dir.file("big.jsonl"));
  WARN("peak RSS: " << base / 1024 << " MiB for 1 document, " << small / 1024 << " MiB for 30 MB, "
                    << big / 1024 << " MiB for 300 MB");
  CHECK(big < small + 50 * 1024);
  CHECK(big < base + 300 * 1024);

  // SIGINT mid-run: exit 2, and the temporaries are gone.
  fs::create_directories(dir.file("int"));
  auto r =
      test::run("sh -c '" + test::binary() + " tokenize --tokenizer " + test::tokenizer_path() +
                " --threads 1 --output " + dir.file("int/x") + " " + dir.file("small.jsonl") +
                " & p=$!; for i in $(seq 600); do ls " + dir.file("int") +
                " | grep -q tmp && break; sleep 0.05; done; kill -INT $p; wait $p; "
                "echo rc=$?'");
  INFO(r.out);
  CHECK_THAT(r.out, Contains("rc=2") && Contains("interrupted"));
  CHECK(files_in(dir.file("int")).empty());
}
