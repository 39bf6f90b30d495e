// libFuzzer target for the Parquet source (core/data/parquet_source.h, Arrow C++ from the
// pyarrow wheel, itself not instrumented): the input is the .parquet file; its "text" column
// is read to the end and each value decoded, or UserError.
#include <cstdint>
#include <string>

#include "core/data/text_reader.h"
#include "test/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = titan::fuzz::scratch("in.parquet");
  titan::fuzz::write_file(path, data, size);
  return titan::fuzz::run_one([&] {
    auto src = titan::open_text_source(path, {});
    titan::TextBatch batch;
    std::string scratch;
    while (src->next(batch))
      for (size_t i = 0; i < batch.size(); ++i) titan::decode_record(batch, i, "text", scratch);
  });
}
