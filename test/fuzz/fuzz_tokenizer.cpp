// libFuzzer target for the tokenizer.json loader: the input is the file. A file that loads
// must then encode a few fixed texts and decode its own ids without error.
#include <cstdint>
#include <string>

#include "core/tokenizer/tokenizer.h"
#include "test/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = titan::fuzz::scratch("tokenizer.json");
  titan::fuzz::write_file(path, data, size);
  return titan::fuzz::run_one([&] {
    auto tok = titan::load_tokenizer(path);
    for (const char* text : {"Hello, world! 123", "  tabs\tand\nnewlines  ", "caf\xc3\xa9 \xe2\x82\xac",
                             "\xff\xfe invalid \xc3", ""}) {
      auto ids = tok->encode(text);
      for (int32_t id : ids)
        if (id < 0 || id >= tok->vocab_size()) __builtin_trap();
      tok->decode(ids);  // ids of its own encode must decode (std::out_of_range would escape)
    }
  });
}
