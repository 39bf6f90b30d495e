// libFuzzer target for the safetensors reader: any bytes must either open (and then every
// tensor reads back with its declared size) or raise titan::UserError.
#include <cstdint>
#include <string>

#include "core/checkpoint/safetensors.h"
#include "test/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return titan::fuzz::run_one([&] {
    auto f = titan::SafetensorsFile::open_from_memory(
        std::string(reinterpret_cast<const char*>(data), size), "fuzz-input");
    uint64_t covered = 0;
    for (const auto& e : f.entries()) {
      // open() promised a tiling of the data buffer; get() must honour each entry's span.
      if (e.begin != covered || e.end < e.begin) __builtin_trap();
      covered = e.end;
      at::Tensor t = f.get(e.name);
      if (static_cast<uint64_t>(t.nbytes()) != e.end - e.begin) __builtin_trap();
    }
  });
}
