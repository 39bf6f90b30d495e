// Small non-cryptographic hashes shared by core: keys for the blend's Feistel permutation,
// the counter-based init streams and the token cache's file names.
#pragma once

#include <cstddef>
#include <cstdint>

namespace titan {

// splitmix64's finalizer: a fast, well-mixing 64-bit hash of one word.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a over bytes, continuing from h (start from kFnv1aOffset).
constexpr uint64_t kFnv1aOffset = 14695981039346656037ull;
inline uint64_t fnv1a(uint64_t h, const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace titan
