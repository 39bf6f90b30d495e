#include "core/base/mmap_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "core/base/errors.h"

namespace titan {

MmapFile::MmapFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw UserError("data file '" + path + "': cannot be opened (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw UserError("data file '" + path + "': is not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    if (p == MAP_FAILED)
      throw UserError("data file '" + path + "': cannot be memory-mapped (" + std::strerror(err) +
                      ")");
    data_ = static_cast<uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

MmapFile::~MmapFile() { release(); }

MmapFile::MmapFile(MmapFile&& o) noexcept
    : path_(std::move(o.path_)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

MmapFile& MmapFile::operator=(MmapFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void MmapFile::release() {
  if (data_) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

void MmapFile::advise_random() const {
  if (data_) ::madvise(data_, size_, MADV_RANDOM);
}

void MmapFile::will_need(size_t offset, size_t bytes) const {
  if (!data_ || offset >= size_) return;
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t begin = offset / page * page;
  const size_t end = std::min(size_, offset + bytes);
  ::madvise(data_ + begin, end - begin, MADV_WILLNEED);
}

}  // namespace titan
