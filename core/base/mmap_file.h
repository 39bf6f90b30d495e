// A read-only memory mapping of a whole file (RAII). Token files are read through it, so
// opening a file costs O(1) and only the pages a rank actually reads are ever loaded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace titan {

class MmapFile {
 public:
  MmapFile() = default;
  // Maps `path` read-only. Throws UserError naming the file when it is missing, a folder,
  // or cannot be opened or mapped. An empty file maps to size() == 0, data() == nullptr.
  explicit MmapFile(const std::string& path);
  ~MmapFile();
  MmapFile(MmapFile&& o) noexcept;
  MmapFile& operator=(MmapFile&& o) noexcept;
  MmapFile(const MmapFile&) = delete;
  MmapFile& operator=(const MmapFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // "" while the file at path() is the one mapped, unchanged since the mapping: same size
  // and modification time, or replaced by another file (a rename: the mapping still holds
  // the old one, whose pages stay valid). Otherwise what changed ("is 100 bytes now, was
  // 4096 when opened"): a truncated file would raise SIGBUS on its lost pages, an
  // overwritten one gives other tokens. One stat() of the path.
  std::string changed_since_open() const;

  // Little-endian scalar at a byte offset (any alignment). The caller bounds-checks.
  template <class T>
  T load(size_t offset) const {
    T v;
    std::memcpy(&v, data_ + offset, sizeof v);
    return v;
  }

  // Access-pattern hints (madvise, best effort). Window reads are random across the file,
  // so kernel read-ahead is turned off for the whole mapping (advise_random) and each window
  // is asked for explicitly just before it is read (will_need), which starts its I/O
  // asynchronously for exactly its pages.
  void advise_random() const;
  void will_need(size_t offset, size_t bytes) const;

 private:
  void release();
  std::string path_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  uint64_t dev_ = 0, ino_ = 0;
  int64_t mtime_ns_ = 0;
};

}  // namespace titan
