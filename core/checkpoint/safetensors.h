// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
//
//   [8 bytes]  N, little-endian uint64: the header length in bytes
//   [N bytes]  UTF-8 JSON object, possibly padded with trailing spaces:
//              {"__metadata__": {str: str},
//               "<name>": {"dtype": "F32", "shape": [d0, d1, ..], "data_offsets": [begin, end]},
//               ..}
//   [rest]     the data buffer; offsets are bytes relative to its start, little-endian values.
//
// The reader is strict: every inconsistency in a file is a UserError naming the file, what was
// found and what is allowed, raised before any tensor is returned. It never maps the file: the
// header is read once and get() reads one tensor's bytes (get_rows() a range of its dim-0 rows)
// straight into a new tensor, so a file truncated or rewritten under us is an error, not a
// SIGBUS.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace titan {

// One tensor of a file. begin/end are byte offsets into the data buffer (end - begin ==
// numel * element size).
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

// Where a file's bytes come from (a file descriptor or a buffer in memory). Internal.
class SafetensorsSource;

class SafetensorsFile {
 public:
  // Reads and validates the header of the file at `path`. Throws UserError.
  static SafetensorsFile open(const std::string& path);
  // The same over bytes already in memory; `name` stands for the path in messages and path().
  static SafetensorsFile open_from_memory(std::string bytes, const std::string& name);

  // Every tensor, sorted by begin offset (ties by end, then name).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const;
  // The entry called `name`; throws UserError naming the file when there is none.
  const SafetensorsEntry& entry(const std::string& name) const;
  // A new contiguous CPU tensor (a copy) with the stored dtype and shape. Throws UserError when
  // the name is absent or the bytes cannot be read (file shrank since open()).
  at::Tensor get(const std::string& name) const;
  // Rows [row_begin, row_begin + rows) of dim 0 of tensor `name` (shape [rows, rest...]), read
  // with one pread of exactly those bytes (dim-0 rows are contiguous in the file), so a rank
  // that needs a slice of a tensor never reads or converts the rest. c10::Error when the range
  // is outside the tensor or the tensor is a scalar; read failures as get().
  at::Tensor get_rows(const std::string& name, int64_t row_begin, int64_t rows) const;
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  static SafetensorsFile from_source(std::shared_ptr<const SafetensorsSource> source);
  // `nbytes` bytes of entry `e` from `skip` bytes into its data, as a new tensor of `shape`.
  at::Tensor read_span(const SafetensorsEntry& e, const std::vector<int64_t>& shape, uint64_t skip,
                       uint64_t nbytes) const;

  std::string path_;
  std::shared_ptr<const SafetensorsSource> source_;
  uint64_t data_start_ = 0;  // byte offset of the data buffer in the file: 8 + N
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// ---- The parsing core, free of tensors (shared by the reader and the fuzz target) -----------

// Header length cap: the Python package's MAX_HEADER_SIZE.
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// The 12 dtypes this program reads and writes (the 10 of PyTorch's usual tensors, and the
// float8 e4m3fn / e5m2 of float8 checkpoints such as DeepSeek-V3's).
bool safetensors_dtype_from_name(const std::string& name, at::ScalarType& out);
// "F32", "BF16", ...; throws c10::Error for a dtype outside the 12.
const char* safetensors_dtype_name(at::ScalarType dtype);
// "F64, F32, ..., F8_E5M2" for messages.
const char* safetensors_allowed_dtypes();

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // sorted like SafetensorsFile::entries()
  std::map<std::string, std::string> metadata;
};

// Header length N from the first 8 bytes of a file of `file_size` bytes, checked against the
// cap and the file size. `path` names the file in messages. Throws UserError.
uint64_t parse_safetensors_header_length(const unsigned char (&prefix)[8], uint64_t file_size,
                                         const std::string& path);
// Parses and checks the N header bytes of a file whose data buffer is `data_size` bytes long.
// Throws UserError.
SafetensorsHeader parse_safetensors_header(const char* json, size_t json_size, uint64_t data_size,
                                           const std::string& path);

// ---- Writer -----------------------------------------------------------------------------------

// Writes `tensors` (any device; the 12 dtypes above; made contiguous and copied to CPU one at a
// time) and `metadata` to `path` atomically: the bytes go
// to <path>.tmp.<pid>, which is fsynced and renamed over `path`.
//
// Layout, like the Python package: the data buffer holds the tensors by element size
// (largest first), then by name, so that every tensor starts at a multiple of its element size
// (readers that view the buffer in place need that); the JSON header lists them sorted by name
// and is padded with spaces so the data buffer starts at an 8-byte-aligned file offset.
// __metadata__ is written only when `metadata` is not empty.
//
// Duplicate names, the name "__metadata__" or another dtype are programming errors
// (c10::Error); failing to write (missing folder, full disk) is a UserError naming `path`.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace titan
