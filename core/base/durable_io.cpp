#include "core/base/durable_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/base/errors.h"

namespace titan {

std::string read_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw UserError(what + " '" + path + "': does not exist");
  if (std::filesystem::is_directory(path, ec))
    throw UserError(what + " '" + path + "': is a folder; allowed: a file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError(what + " '" + path + "': cannot be read (" + std::strerror(errno) + ")");
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw UserError(what + " '" + path + "': read failed");
  return ss.str();
}

void write_file_durable(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw UserError("cannot create '" + tmp + "': " + std::strerror(errno));
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      throw UserError("cannot write '" + tmp + "': " + std::strerror(e));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0)
    throw UserError("cannot write '" + tmp + "': " + std::strerror(errno));
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw UserError("cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(errno));
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace titan
