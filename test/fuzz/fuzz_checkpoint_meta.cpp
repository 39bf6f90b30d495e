// libFuzzer target for a checkpoint's metadata.json (core/checkpoint/checkpoint.h): a real
// one-rank checkpoint is saved once at start-up, then each input replaces its metadata.json
// and the reader lists the tensors and reads each whole and by its second half of rows.
// With TITAN_FUZZ_WRITE_SEEDS=<dir> the start-up also copies the valid metadata.json there.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/checkpoint/checkpoint.h"
#include "test/core/checkpoint/small_checkpoint.h"
#include "test/fuzz/fuzz_util.h"

namespace {

std::string step_dir() { return titan::fuzz::scratch("ckpt/step-1"); }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  titan::test_fixtures::save_small_checkpoint(titan::fuzz::scratch("ckpt"));
  if (const char* seeds = std::getenv("TITAN_FUZZ_WRITE_SEEDS"))
    std::filesystem::copy_file(step_dir() + "/metadata.json",
                               std::string(seeds) + "/metadata.json",
                               std::filesystem::copy_options::overwrite_existing);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  titan::fuzz::write_file(step_dir() + "/metadata.json", data, size);
  return titan::fuzz::run_one([&] {
    titan::CheckpointReader r(step_dir());
    for (const auto& [key, shape] : r.keys("")) {
      if (!r.contains(key)) __builtin_trap();
      auto t = r.get(key);
      if (!t || t->sizes().vec() != shape) __builtin_trap();
      if (shape.empty() || shape[0] < 2) continue;
      auto half = shape;
      half[0] = shape[0] - shape[0] / 2;
      at::Tensor dst = at::empty(half, t->options());
      r.restore_rows(key, shape, shape[0] / 2, half[0], dst, true);
      if (!dst.equal(t->narrow(0, shape[0] / 2, half[0]))) __builtin_trap();
    }
  });
}
