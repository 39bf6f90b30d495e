// libFuzzer target for the raw-text readers (core/data/text_reader.h): .txt, .jsonl,
// .jsonl.gz and .jsonl.zst. The first byte picks the format (low 2 bits) and the batch size;
// the rest is the file. Every record of every batch is decoded; each step either works or
// raises UserError.
#include <cstdint>
#include <string>

#include "core/data/text_reader.h"
#include "test/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const char* names[] = {"in.txt", "in.jsonl", "in.jsonl.gz", "in.jsonl.zst"};
  const std::string path = titan::fuzz::scratch(names[data[0] & 3]);
  titan::fuzz::write_file(path, data + 1, size - 1);
  titan::TextReaderOptions opts;
  opts.batch_bytes = size_t{1} << (data[0] >> 4);  // 1 B .. 32 KiB: many batch boundaries
  return titan::fuzz::run_one([&] {
    auto src = titan::open_text_source(path, opts);
    titan::TextBatch batch;
    std::string scratch;
    while (src->next(batch)) {
      if (batch.size() == 0) __builtin_trap();
      for (size_t i = 0; i < batch.size(); ++i)
        titan::decode_record(batch, i, opts.field, scratch);
    }
    if (src->bytes_done() > src->bytes_total()) __builtin_trap();
  });
}
