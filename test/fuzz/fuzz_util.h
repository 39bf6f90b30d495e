// Shared by the libFuzzer targets (test/fuzz/fuzz_*.cpp, built by test/fuzz/CMakeLists.txt
// through scripts/fuzz.sh): a scratch folder for the readers that take paths, and the one
// rule every target checks: any input either reads or raises titan::UserError. Any other
// exception, a sanitizer report, a crash, a hang or a leak is a bug.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/base/errors.h"

namespace titan::fuzz {

// A folder of this process's own under $TMPDIR, removed at exit. The name is never freed:
// the exit handler runs after static destructors registered later.
inline const std::string& scratch_dir() {
  static const std::string* dir = [] {
    const char* t = std::getenv("TMPDIR");
    auto* tmpl = new std::string(std::string(t && *t ? t : "/tmp") + "/titan-fuzz-XXXXXX");
    if (!mkdtemp(tmpl->data())) std::abort();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return tmpl;
  }();
  return *dir;
}

inline std::string scratch(const std::string& name) { return scratch_dir() + "/" + name; }

inline void write_file(const std::string& path, const void* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!f) std::abort();
}

// Runs body(); a UserError is an accepted outcome (its message printed with
// TITAN_FUZZ_PRINT=1, handy to read what a corpus hits). Anything else escapes to libFuzzer.
template <class Body>
int run_one(Body&& body) {
  static const bool print = std::getenv("TITAN_FUZZ_PRINT") != nullptr;
  try {
    body();
    if (print) std::printf("ok\n");
  } catch (const UserError& e) {
    if (print) std::printf("UserError: %s\n", e.what());
  }
  return 0;
}

}  // namespace titan::fuzz
