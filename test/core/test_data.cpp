// Data pipeline: document reading, token files, packing with BOS/EOS, disjoint per-rank
// windows, resumable position, and bad data files.
#include <catch2/catch.hpp>

#include <set>

#include "core/data.h"
#include "core/errors.h"
#include "core/tokenizer.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;

TEST_CASE("data: text and JSONL documents with the byte tokenizer", "[data]") {
  test::TempDir dir("data");
  test::write_file(dir.file("a.txt"), "first doc\nline two\n\n\n second\n\nthird\n");
  test::write_file(dir.file("b.jsonl"),
                   "{\"text\": \"alpha\"}\n\n{\"text\": \"beta\\ngamma\", \"id\": 3}\n");
  auto tok = load_tokenizer("bytes");
  auto docs = read_text_documents(dir.file("a.txt"));
  REQUIRE(docs.size() == 3);
  CHECK(docs[0] == "first doc\nline two");
  CHECK(docs[1] == " second");
  auto j = read_text_documents(dir.file("b.jsonl"));
  REQUIRE(j.size() == 2);
  CHECK(j[1] == "beta\ngamma");
  TokenizedDocs td = load_documents(dir.file("b.jsonl"), *tok);
  CHECK(td.num_docs() == 2);
  CHECK(td.tokens.size() == 5 + 10);
  // Packing adds BOS/EOS around every document.
  Splits s = split_and_pack(td, 0.0, tok->bos_id(), tok->eos_id());
  REQUIRE(s.train.size() == 15 + 4);
  CHECK(s.train[0] == 256);
  CHECK(s.train[6] == 257);
  CHECK(s.train[7] == 256);
  CHECK(s.heldout.empty());
  Splits h = split_and_pack(td, 0.01, tok->bos_id(), tok->eos_id());
  CHECK(h.heldout.size() == 10 + 2);  // at least one document is held out
}

TEST_CASE("data: token files round trip and reject corruption", "[data]") {
  test::TempDir dir("tokfile");
  TokenizedDocs d;
  d.vocab_size = 70000;  // forces 4-byte tokens
  d.tokens = {1, 69999, 5, 6, 7};
  d.offsets = {0, 2, 5};
  write_token_file(dir.file("x.tok"), d);
  TokenizedDocs r = read_token_file(dir.file("x.tok"));
  CHECK(r.tokens == d.tokens);
  CHECK(r.offsets == d.offsets);
  CHECK(r.vocab_size == 70000);
  std::string bytes = test::read_file(dir.file("x.tok"));
  test::write_file(dir.file("short.tok"), bytes.substr(0, bytes.size() - 3));
  CHECK_THROWS_WITH(read_token_file(dir.file("short.tok")), Contains("short.tok"));
  test::write_file(dir.file("magic.tok"), "NOTATOKFILE" + bytes);
  CHECK_THROWS_WITH(read_token_file(dir.file("magic.tok")), Contains("TITANTOK"));
  // A .tok made with a larger vocabulary than the tokenizer is refused.
  auto tok = load_tokenizer("bytes");
  CHECK_THROWS_WITH(load_documents(dir.file("x.tok"), *tok), Contains("70000"));
}

TEST_CASE("data: bad data files are UserErrors naming the file", "[data]") {
  test::TempDir dir("baddata");
  test::write_file(dir.file("empty.txt"), "");
  test::write_file(dir.file("latin1.txt"), "caf\xe9 au lait\n");
  test::write_file(dir.file("bad.jsonl"), "{\"text\": \"ok\"}\n{\"txt\": 1}\n");
  CHECK_THROWS_WITH(read_text_documents(dir.file("missing.txt")),
                    Contains("missing.txt") && Contains("does not exist"));
  CHECK_THROWS_WITH(read_text_documents(dir.file("empty.txt")),
                    Contains("empty.txt") && Contains("is empty"));
  CHECK_THROWS_WITH(read_text_documents(dir.file("latin1.txt")),
                    Contains("latin1.txt") && Contains("UTF-8") && Contains("offset 3"));
  CHECK_THROWS_WITH(read_text_documents(dir.file("bad.jsonl")),
                    Contains("bad.jsonl") && Contains("line 2"));
}

TEST_CASE("data: ranks read disjoint windows and the position resumes exactly", "[data]") {
  std::vector<int32_t> stream(10 * 17 + 5);
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<int32_t>(i);
  const int64_t T = 16;  // windows of 17 tokens: 10 windows
  std::set<int32_t> seen_first;
  for (int64_t r = 0; r < 2; ++r) {
    PackedLoader l(&stream, T, 1, r, 2, 7, true);
    CHECK(l.windows_per_rank() == 5);
    for (int i = 0; i < 5; ++i) {
      Batch b = l.next();
      int32_t first = static_cast<int32_t>(b.tokens[0][0].item<int64_t>());
      CHECK(first % 17 == 0);                              // window aligned
      CHECK(seen_first.insert(first).second);              // never seen by any rank this epoch
      CHECK(b.labels[0][0].item<int64_t>() == first + 1);  // labels are shifted tokens
      CHECK(b.tokens.size(1) == T);
    }
  }
  CHECK(seen_first.size() == 10);
  // Resume: a loader restored to another's state yields the same batches from then on,
  // across an epoch boundary.
  PackedLoader a(&stream, T, 2, 0, 1, 3, true);
  for (int i = 0; i < 3; ++i) a.next();
  PackedLoader b(&stream, T, 2, 0, 1, 3, true);
  b.load_state(a.state());
  for (int i = 0; i < 6; ++i) CHECK(at::equal(a.next().tokens, b.next().tokens));
  CHECK(a.state().epoch >= 1);
  // Epochs are reshuffled, but deterministically from the seed.
  PackedLoader c(&stream, T, 10, 0, 1, 3, true);
  at::Tensor e0 = c.next().tokens, e1 = c.next().tokens;
  CHECK_FALSE(at::equal(e0, e1));
  PackedLoader c2(&stream, T, 10, 0, 1, 3, true);
  CHECK(at::equal(c2.next().tokens, e0));
}
