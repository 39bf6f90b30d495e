#include "core/data/token_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <c10/util/Exception.h>

#include "core/base/durable_io.h"
#include "core/base/strings.h"
#include "core/base/errors.h"
#include "core/base/log.h"

namespace titan {
namespace {

namespace fs = std::filesystem;

constexpr size_t kBufBytes = 1 << 20;

[[noreturn]] void write_failed(const std::string& path, const char* what) {
  throw UserError("output file '" + path + "': " + what + " (" + std::strerror(errno) +
                  "); allowed: a writable folder with free space");
}

// A file written sequentially through a 1 MiB buffer; every failure is a UserError naming
// it (a full disk is the usual one).
class OutFile {
 public:
  explicit OutFile(std::string path) : path_(std::move(path)), buf_(kBufBytes) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) write_failed(path_, "cannot be created");
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      if (used_ == buf_.size()) flush();
      const size_t k = std::min(n, buf_.size() - used_);
      std::memcpy(buf_.data() + used_, c, k);
      used_ += k;
      c += k;
      n -= k;
    }
  }
  template <class T>
  void put(T v) {
    write(&v, sizeof v);
  }
  void zeros(uint64_t n) {
    static const char z[4096] = {};
    for (; n > 0; n -= std::min<uint64_t>(n, sizeof z)) write(z, std::min<uint64_t>(n, sizeof z));
  }
  void flush() {
    size_t off = 0;
    while (off < used_) {
      const ssize_t k = ::write(fd_, buf_.data() + off, used_ - off);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) write_failed(path_, "write failed");
      off += static_cast<size_t>(k);
    }
    size_ += used_;
    used_ = 0;
  }
  // Appends the whole file at `src` (flushed and closed): in-kernel copy where possible.
  void append_file(const std::string& src) {
    flush();
    const int in = ::open(src.c_str(), O_RDONLY | O_CLOEXEC);
    if (in < 0) write_failed(src, "cannot be reopened");
    struct stat st {};
    ::fstat(in, &st);
    uint64_t left = static_cast<uint64_t>(st.st_size);
    bool kernel = true;
    while (left > 0) {
      ssize_t k = -1;
      if (kernel) {
        k = ::copy_file_range(in, nullptr, fd_, nullptr, std::min<uint64_t>(left, 1 << 30), 0);
        if (k < 0 &&
            (errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
          kernel = false;
          continue;
        }
      } else {
        k = ::read(in, buf_.data(), std::min<uint64_t>(left, buf_.size()));
        if (k > 0) {
          used_ = static_cast<size_t>(k);
          flush();  // counts the bytes in size_
        }
      }
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        ::close(in);
        write_failed(path_, "copy failed");
      }
      left -= static_cast<uint64_t>(k);
      size_ += kernel ? static_cast<uint64_t>(k) : 0;
    }
    ::close(in);
  }
  void close(bool sync) {
    flush();
    if (sync && ::fsync(fd_) != 0) write_failed(path_, "fsync failed");
    if (::close(fd_) != 0) write_failed(path_, "close failed");
    fd_ = -1;
  }
  uint64_t size() const { return size_ + used_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::vector<char> buf_;
  size_t used_ = 0;
  uint64_t size_ = 0;
};

// Writes ids as T (u16, u32 or i32), converting through a small stack buffer.
template <class T>
void put_tokens(OutFile& f, const int32_t* ids, size_t n) {
  T tmp[4096];
  while (n > 0) {
    const size_t k = std::min(n, sizeof tmp / sizeof tmp[0]);
    for (size_t i = 0; i < k; ++i) tmp[i] = static_cast<T>(ids[i]);
    f.write(tmp, k * sizeof(T));
    ids += k;
    n -= k;
  }
}

void remove_quietly(const std::string& p) {
  std::error_code ec;
  fs::remove(p, ec);
}

std::string parent_of(const std::string& p) {
  std::string d = fs::path(p).parent_path().string();
  return d.empty() ? "." : d;
}

}  // namespace

std::string token_output_base(const std::string& output, TokenFileFormat f) {
  auto strip = [&](const char* ext) {
    return ends_with(output, ext) ? output.substr(0, output.size() - std::strlen(ext)) : output;
  };
  if (f == TokenFileFormat::kTok) return strip(".tok");
  return ends_with(output, ".idx") ? strip(".idx") : strip(".bin");
}

std::string token_shard_path(const std::string& base, TokenFileFormat f, int64_t i, int64_t n) {
  const char* ext = f == TokenFileFormat::kTok ? ".tok" : ".bin";
  if (n == 1) return base + ext;
  char num[32];
  std::snprintf(num, sizeof num, "_%06lld", static_cast<long long>(i));
  return base + num + ext;
}

// One shard being written under temporary names.
class TokenShardWriter::Shard {
 public:
  Shard(const std::string& base, int64_t index) {
    char num[32];
    std::snprintf(num, sizeof num, ".shard%06lld", static_cast<long long>(index));
    prefix_ = base + num;
    // Host and pid: builders on several nodes may share a file system (token cache).
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    suffix_ = ".tmp-" + std::string(host) + "-" + std::to_string(::getpid());
  }
  virtual ~Shard() {
    for (auto& p : temps_) remove_quietly(p);
  }
  virtual void add(const int32_t* ids, size_t n) = 0;
  // Assembles the complete file(s) under temporary names and fsyncs them.
  virtual void finish() = 0;
  // Renames the assembled file(s); `final_path` is the .tok or the .bin.
  virtual void rename_to(const std::string& final_path) = 0;
  int64_t tokens = 0, docs = 0;

 protected:
  // A temporary name for this shard's file with extension `ext`; removed with the shard.
  std::string temp(const std::string& ext) {
    temps_.push_back(prefix_ + ext + suffix_);
    return temps_.back();
  }
  void rename_temp(const std::string& from, const std::string& to) {
    if (std::rename(from.c_str(), to.c_str()) != 0) write_failed(to, "rename failed");
    temps_.erase(std::remove(temps_.begin(), temps_.end(), from), temps_.end());
  }

 private:
  std::string prefix_, suffix_;
  std::vector<std::string> temps_;
};

namespace {

// .tok v2: tokens and offsets spill to their own files, then header + offsets + zero
// padding to a 4096-byte boundary + tokens are assembled into the shard.
class TokShard : public TokenShardWriter::Shard {
 public:
  TokShard(const std::string& base, int64_t index, int64_t vocab)
      : Shard(base, index),
        vocab_(vocab),
        width_(tok_token_bytes(vocab)),
        tok_path_(temp(".tok")),
        tokens_(temp(".tokens")),
        offsets_(temp(".offsets")) {
    offsets_.put<uint64_t>(0);
  }
  void add(const int32_t* ids, size_t n) override {
    if (width_ == 2)
      put_tokens<uint16_t>(tokens_, ids, n);
    else
      put_tokens<uint32_t>(tokens_, ids, n);
    for (size_t i = 0; i < n; ++i) max_id_ = std::max(max_id_, ids[i]);
    tokens += static_cast<int64_t>(n);
    ++docs;
    offsets_.put<uint64_t>(static_cast<uint64_t>(tokens));
  }
  void finish() override {
    tokens_.close(false);
    offsets_.close(false);
    const uint64_t d = static_cast<uint64_t>(docs), n = static_cast<uint64_t>(tokens);
    const uint64_t start =
        (kTokV2HeaderBytes + 8 * (d + 1) + kTokV2Align - 1) / kTokV2Align * kTokV2Align;
    OutFile out(tok_path_);
    out.write(kTokV2Magic, 8);
    out.put<uint32_t>(kTokV2Version);
    out.put<uint32_t>(width_);
    out.put<uint64_t>(d);
    out.put<uint64_t>(n);
    out.put<uint64_t>(static_cast<uint64_t>(vocab_));
    out.put<uint64_t>(n ? static_cast<uint64_t>(max_id_) : 0);
    out.put<uint64_t>(kTokV2HeaderBytes);
    out.put<uint64_t>(start);
    out.append_file(offsets_.path());
    out.zeros(start - out.size());
    out.append_file(tokens_.path());
    TORCH_CHECK(out.size() == start + n * width_, "tok shard size mismatch");
    out.close(true);
    remove_quietly(tokens_.path());
    remove_quietly(offsets_.path());
  }
  void rename_to(const std::string& final_path) override { rename_temp(tok_path_, final_path); }

 private:
  int64_t vocab_;
  uint32_t width_;
  std::string tok_path_;
  OutFile tokens_, offsets_;
  int32_t max_id_ = 0;
};

// Megatron: tokens go straight to the .bin; sequence lengths spill to a file and become the
// .idx's sizes, pointers (their running byte sum) and document indices (0..S).
class MegatronShard : public TokenShardWriter::Shard {
 public:
  MegatronShard(const std::string& base, int64_t index, int64_t vocab)
      : Shard(base, index),
        u16_(megatron_uses_u16(vocab)),
        idx_path_(temp(".idx")),
        bin_(temp(".bin")),
        sizes_(temp(".sizes")) {}
  void add(const int32_t* ids, size_t n) override {
    TORCH_CHECK(n <= static_cast<size_t>(INT32_MAX), "document longer than 2^31 tokens");
    if (u16_)
      put_tokens<uint16_t>(bin_, ids, n);
    else
      put_tokens<int32_t>(bin_, ids, n);
    sizes_.put<int32_t>(static_cast<int32_t>(n));
    tokens += static_cast<int64_t>(n);
    ++docs;
  }
  void finish() override {
    bin_.close(true);
    sizes_.close(false);
    const uint64_t s = static_cast<uint64_t>(docs);
    OutFile idx(idx_path_);
    idx.write("MMIDIDX\0\0", 9);
    idx.put<uint64_t>(1);
    idx.put<uint8_t>(u16_ ? 8 : 4);
    idx.put<uint64_t>(s);
    idx.put<uint64_t>(s + 1);
    idx.append_file(sizes_.path());
    write_pointers(idx);
    for (uint64_t i = 0; i <= s; ++i) idx.put<int64_t>(static_cast<int64_t>(i));
    idx.close(true);
    remove_quietly(sizes_.path());
  }
  void rename_to(const std::string& final_bin) override {
    rename_temp(bin_.path(), final_bin);
    rename_temp(idx_path_, final_bin.substr(0, final_bin.size() - 4) + ".idx");
  }

 private:
  // Byte offset of each sequence in the .bin, streamed from the spilled sizes.
  void write_pointers(OutFile& idx) {
    std::FILE* f = std::fopen(sizes_.path().c_str(), "rb");
    if (!f) write_failed(sizes_.path(), "cannot be reopened");
    const int64_t item = u16_ ? 2 : 4;
    int64_t ptr = 0;
    int32_t buf[4096];
    for (size_t k; (k = std::fread(buf, sizeof buf[0], 4096, f)) > 0;)
      for (size_t i = 0; i < k; ++i) {
        idx.put<int64_t>(ptr);
        ptr += int64_t{buf[i]} * item;
      }
    std::fclose(f);
  }
  bool u16_;
  std::string idx_path_;
  OutFile bin_, sizes_;
};

}  // namespace

TokenShardWriter::TokenShardWriter(const std::string& output, const TokenWriterOptions& opts)
    : base_(token_output_base(output, opts.format)), opts_(opts) {
  TORCH_CHECK(opts.vocab_size > 0, "TokenShardWriter needs the vocabulary size");
  if (opts.shard_tokens < 0)
    throw UserError("--shard-tokens " + std::to_string(opts.shard_tokens) +
                    ": allowed: 0 (one shard) or a positive token count");
  std::error_code ec;
  if (!fs::is_directory(parent_of(base_), ec))
    throw UserError("output '" + output + "': folder '" + parent_of(base_) +
                    "' does not exist; allowed: a path in an existing folder");
  start_shard();  // fails now, not after hours of tokenizing, when the folder is not writable
}

TokenShardWriter::~TokenShardWriter() = default;

void TokenShardWriter::start_shard() {
  const int64_t i = static_cast<int64_t>(shards_.size());
  if (opts_.format == TokenFileFormat::kTok)
    shards_.push_back(std::make_unique<TokShard>(base_, i, opts_.vocab_size));
  else
    shards_.push_back(std::make_unique<MegatronShard>(base_, i, opts_.vocab_size));
}

void TokenShardWriter::add_document(const int32_t* ids, size_t n) {
  TORCH_CHECK(!committed_, "add_document after commit");
  Shard* cur = shards_.back().get();
  if (opts_.shard_tokens > 0 && cur->tokens > 0 &&
      cur->tokens + static_cast<int64_t>(n) > opts_.shard_tokens) {
    cur->finish();
    start_shard();
    cur = shards_.back().get();
  }
  cur->add(ids, n);
  ++docs_;
  tokens_ += static_cast<int64_t>(n);
}

std::vector<std::string> TokenShardWriter::commit() {
  TORCH_CHECK(!committed_, "commit twice");
  shards_.back()->finish();
  const int64_t n = shards();
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(token_shard_path(base_, opts_.format, i, n));
    shards_[static_cast<size_t>(i)]->rename_to(out.back());
  }
  committed_ = true;
  fsync_dir(parent_of(base_));
  // Shards of an earlier, larger run would join a glob or folder of this output.
  std::error_code ec;
  std::vector<std::string> stale;
  if (n > 1 && fs::exists(token_shard_path(base_, opts_.format, 0, 1), ec))
    stale.push_back(token_shard_path(base_, opts_.format, 0, 1));
  for (int64_t i = n == 1 ? 0 : n;; ++i) {
    const std::string p = token_shard_path(base_, opts_.format, i, 2);
    if (!fs::exists(p, ec)) break;
    stale.push_back(p);
  }
  for (auto& p : stale)
    log_warn("'" + p +
             "' is from an earlier run, not part of this output; remove it before "
             "training on a folder or glob of these shards");
  return out;
}

}  // namespace titan
