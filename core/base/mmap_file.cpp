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
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  mtime_ns_ = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
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
      size_(std::exchange(o.size_, 0)),
      dev_(o.dev_),
      ino_(o.ino_),
      mtime_ns_(o.mtime_ns_) {}

MmapFile& MmapFile::operator=(MmapFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    dev_ = o.dev_, ino_ = o.ino_, mtime_ns_ = o.mtime_ns_;
  }
  return *this;
}

void MmapFile::release() {
  if (data_) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

std::string MmapFile::changed_since_open() const {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0)
    return std::string("cannot be checked any more (") + std::strerror(errno) + ")";
  if (st.st_dev != dev_ || st.st_ino != ino_) return "";  // replaced: we still map the old file
  if (static_cast<size_t>(st.st_size) != size_)
    return "is " + std::to_string(st.st_size) + " bytes now, was " + std::to_string(size_) +
           " when opened (truncated or appended to)";
  if (int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec != mtime_ns_)
    return "was modified after it was opened (overwritten in place?)";
  return "";
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
