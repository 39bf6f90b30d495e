// libFuzzer target for the safetensors reader: any bytes must either open (and then every
// tensor reads back with its declared size) or raise titan::UserError. Anything else, an
// uncaught exception, an ASan report, a crash, is a bug.
//
// Built only by scripts/fuzz_safetensors.sh (clang++ -fsanitize=fuzzer,address
// -DTITAN_FUZZ_TARGET). test/CMakeLists.txt leaves test/fuzz out of the test binary; the
// define keeps it empty should another build pick it up.
#ifdef TITAN_FUZZ_TARGET

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/base/errors.h"
#include "core/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // TITAN_FUZZ_PRINT=1 prints each input's message: handy to read the errors of a corpus.
  static const bool print = std::getenv("TITAN_FUZZ_PRINT") != nullptr;
  try {
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
    if (print) std::printf("ok: %zu tensors\n", f.entries().size());
  } catch (const titan::UserError& e) {
    if (print) std::printf("%s\n", e.what());
  }
  return 0;
}

#endif  // TITAN_FUZZ_TARGET
