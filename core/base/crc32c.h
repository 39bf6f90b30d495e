// CRC32C (Castagnoli), the checksum TFRecord files use for their length and data fields.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace titan {

// Continues a CRC32C over `n` more bytes; crc32c_extend(crc32c(a), b) == crc32c(a + b).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) {
  return crc32c_extend(0, data, n);
}
inline uint32_t crc32c(std::string_view s) {
  return crc32c_extend(0, s.data(), s.size());
}

// TFRecord stores CRCs masked, because a CRC computed over data that itself holds CRCs is
// weak; readers (TensorFlow, TensorBoard) expect exactly this rotation and offset.
inline uint32_t crc32c_mask(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace titan
