// libFuzzer target for the pre-tokenized shard readers (core/data/token_source.h). The first
// byte picks the format and the vocabulary; the rest is the file:
//   0: a .tok v2 file          1: an llm.c .bin shard
//   2: a Megatron pair: two little-endian bytes give the .idx length, the .idx, then the .bin
// A source that opens must then read tokens at its start, middle and end, locate positions
// and give its document starts, all in range, or raise UserError.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/data/token_source.h"
#include "test/fuzz/fuzz_util.h"

namespace {

void exercise(const titan::TokenSource& src) {
  const int64_t n = src.num_tokens();
  if (n < 0) __builtin_trap();
  std::vector<int64_t> buf(64);
  for (int64_t pos : {int64_t{0}, n / 2, std::max<int64_t>(0, n - 64)}) {
    const int64_t k = std::min<int64_t>(64, n - pos);
    if (k <= 0) continue;
    src.will_need(pos, k);
    src.read(pos, k, buf.data());
    for (int64_t i = 0; i < k; ++i)
      if (buf[i] < 0 || (src.vocab() > 0 && buf[i] >= src.vocab())) __builtin_trap();
    auto at = src.locate(pos);
    if (at.shard >= src.num_shards() || at.offset < 0) __builtin_trap();
  }
  const int64_t d = src.num_docs();
  if (d < 0) return;
  int64_t prev = 0;
  for (int64_t i : {int64_t{0}, int64_t{1}, d / 2, d - 1, d}) {
    if (i < 0 || i > d) continue;
    const int64_t s = src.doc_start(i);
    if (s < 0 || s > n) __builtin_trap();
    prev = s;
  }
  (void)prev;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  using titan::fuzz::scratch;
  using titan::fuzz::write_file;
  static const int64_t vocabs[] = {0, 256, 300, 50257, 65536, 128256, 1 << 30};
  const int64_t vocab = vocabs[(data[0] >> 2) % 7];
  const int kind = data[0] & 3;
  std::string spec;
  if (kind == 0 || kind == 3) {
    spec = scratch("d.tok");
    write_file(spec, data + 1, size - 1);
  } else if (kind == 1) {
    spec = scratch("llmc.bin");
    write_file(spec, data + 1, size - 1);
  } else {
    if (size < 3) return 0;
    const size_t idx_len = std::min<size_t>(data[1] | (data[2] << 8), size - 3);
    write_file(scratch("mega.idx"), data + 3, idx_len);
    write_file(scratch("mega.bin"), data + 3 + idx_len, size - 3 - idx_len);
    spec = scratch("mega");
  }
  return titan::fuzz::run_one([&] { exercise(*titan::TokenSource::open(spec, vocab)); });
}
