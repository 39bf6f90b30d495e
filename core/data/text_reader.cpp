#include "core/data/text_reader.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/base/errors.h"
#include "core/base/strings.h"
#include "core/base/log.h"
#include "core/data/parquet_source.h"

namespace titan {
namespace {

namespace fs = std::filesystem;

constexpr size_t kReadChunk = 1 << 20;  // bytes per read() of the input file

bool blank_line(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

// A file opened for sequential reading; closes itself.
class Fd {
 public:
  explicit Fd(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0)
      throw UserError("data file '" + path + "': cannot be read (" + std::strerror(errno) + ")");
    struct stat st {};
    if (::fstat(fd_, &st) == 0) size_ = static_cast<uint64_t>(st.st_size);
#ifdef POSIX_FADV_SEQUENTIAL
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  }
  ~Fd() {
    ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  size_t read(char* dst, size_t cap) {
    for (;;) {
      ssize_t n = ::read(fd_, dst, cap);
      if (n >= 0) {
        done_ += static_cast<uint64_t>(n);
        return static_cast<size_t>(n);
      }
      if (errno != EINTR)
        throw UserError("data file '" + path_ + "': read failed at byte " + std::to_string(done_) +
                        " (" + std::strerror(errno) + ")");
    }
  }
  uint64_t done() const {
    return done_;
  }
  uint64_t size() const {
    return size_;
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0, done_ = 0;
};

// Decompressed bytes of a file: plain, gzip (one or more members) or zstd (one or more
// frames). done()/size() count the file's own (compressed) bytes.
class ByteReader {
 public:
  virtual ~ByteReader() = default;
  virtual size_t read(char* dst, size_t cap) = 0;  // 0 at the end
  virtual uint64_t done() const = 0;
  virtual uint64_t size() const = 0;
};

class PlainReader : public ByteReader {
 public:
  explicit PlainReader(const std::string& path) : f_(path) {}
  size_t read(char* dst, size_t cap) override { return f_.read(dst, cap); }
  uint64_t done() const override { return f_.done(); }
  uint64_t size() const override { return f_.size(); }

 private:
  Fd f_;
};

class GzipReader : public ByteReader {
 public:
  explicit GzipReader(const std::string& path) : path_(path), f_(path), in_(kReadChunk) {
    if (inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK)
      throw std::runtime_error("zlib inflateInit2 failed");
  }
  ~GzipReader() override { inflateEnd(&z_); }
  uint64_t done() const override { return f_.done(); }
  uint64_t size() const override { return f_.size(); }

  size_t read(char* dst, size_t cap) override {
    z_.next_out = reinterpret_cast<Bytef*>(dst);
    z_.avail_out = static_cast<uInt>(std::min<size_t>(cap, 1u << 30));
    while (z_.avail_out > 0) {
      if (z_.avail_in == 0 && !eof_) {
        const size_t n = f_.read(in_.data(), in_.size());
        if (n == 0) eof_ = true;
        z_.next_in = reinterpret_cast<Bytef*>(in_.data());
        z_.avail_in = static_cast<uInt>(n);
      }
      if (z_.avail_in == 0 && eof_) {
        if (mid_member_)
          throw UserError("data file '" + path_ +
                          "': truncated gzip stream (it ends inside a member); allowed: a "
                          "complete .gz file");
        break;
      }
      const int rc = inflate(&z_, Z_NO_FLUSH);
      mid_member_ = true;
      if (rc == Z_STREAM_END) {
        mid_member_ = false;
        inflateReset(&z_);  // a following member continues the stream (gzip -c a b > c)
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        throw UserError("data file '" + path_ + "': corrupt gzip data near compressed byte " +
                        std::to_string(f_.done() - z_.avail_in) +
                        " (zlib: " + (z_.msg ? z_.msg : "error " + std::to_string(rc)) + ")");
      }
    }
    return static_cast<size_t>(reinterpret_cast<char*>(z_.next_out) - dst);
  }

 private:
  std::string path_;
  Fd f_;
  std::vector<char> in_;
  z_stream z_{};
  bool eof_ = false, mid_member_ = false;
};

class ZstdReader : public ByteReader {
 public:
  explicit ZstdReader(const std::string& path)
      : path_(path), f_(path), in_(ZSTD_DStreamInSize()), ds_(ZSTD_createDStream()) {
    if (!ds_) throw std::runtime_error("ZSTD_createDStream failed");
    ZSTD_initDStream(ds_);
  }
  ~ZstdReader() override { ZSTD_freeDStream(ds_); }
  uint64_t done() const override { return f_.done(); }
  uint64_t size() const override { return f_.size(); }

  size_t read(char* dst, size_t cap) override {
    ZSTD_outBuffer out{dst, cap, 0};
    while (out.pos < out.size) {
      if (ib_.pos == ib_.size && !eof_) {
        const size_t n = f_.read(in_.data(), in_.size());
        if (n == 0) eof_ = true;
        ib_ = ZSTD_inBuffer{in_.data(), n, 0};
      }
      if (ib_.pos == ib_.size && eof_) {
        if (pending_ != 0)
          throw UserError("data file '" + path_ +
                          "': truncated zstd stream (it ends inside a frame); allowed: a "
                          "complete .zst file");
        break;
      }
      const size_t rc = ZSTD_decompressStream(ds_, &out, &ib_);
      if (ZSTD_isError(rc))
        throw UserError("data file '" + path_ + "': corrupt zstd data near compressed byte " +
                        std::to_string(f_.done() - (ib_.size - ib_.pos)) +
                        " (zstd: " + ZSTD_getErrorName(rc) + ")");
      pending_ = rc;  // 0: a frame just ended
    }
    return out.pos;
  }

 private:
  std::string path_;
  Fd f_;
  std::vector<char> in_;
  ZSTD_DStream* ds_;
  ZSTD_inBuffer ib_{nullptr, 0, 0};
  bool eof_ = false;
  size_t pending_ = 0;
};

// Lines of a byte stream, split at '\n' as std::getline does: "a\n" is one line, "a\nb"
// two; the '\n' is not part of the line. Memory: one buffer that grows to the longest line.
class LineReader {
 public:
  explicit LineReader(std::unique_ptr<ByteReader> in) : in_(std::move(in)), buf_(2 * kReadChunk) {}

  // The view lives until the next call. `offset` is the line's byte offset in the stream.
  bool next(std::string_view& line, uint64_t& offset) {
    for (;;) {
      const char* base = buf_.data();
      if (const void* nl = std::memchr(base + scan_, '\n', end_ - scan_)) {
        const size_t at = static_cast<size_t>(static_cast<const char*>(nl) - base);
        line = std::string_view(base + begin_, at - begin_);
        offset = base_ + begin_;
        begin_ = scan_ = at + 1;
        return true;
      }
      if (eof_) {
        if (begin_ == end_) return false;
        line = std::string_view(base + begin_, end_ - begin_);
        offset = base_ + begin_;
        begin_ = scan_ = end_;
        return true;
      }
      refill();
    }
  }
  uint64_t stream_bytes() const { return base_ + end_; }
  const ByteReader& input() const { return *in_; }

 private:
  void refill() {
    if (begin_ > 0) {  // keep only the unfinished line
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      base_ += begin_;
      end_ -= begin_;
      begin_ = 0;
    }
    scan_ = end_;
    if (buf_.size() - end_ < kReadChunk) buf_.resize(std::max(2 * buf_.size(), end_ + kReadChunk));
    const size_t n = in_->read(buf_.data() + end_, buf_.size() - end_);
    if (n == 0) eof_ = true;
    end_ += n;
  }

  std::unique_ptr<ByteReader> in_;
  std::vector<char> buf_;
  size_t begin_ = 0, scan_ = 0, end_ = 0;  // unread bytes are buf_[begin_, end_)
  uint64_t base_ = 0;                      // stream offset of buf_[0]
  bool eof_ = false;
};

std::unique_ptr<ByteReader> open_bytes(const std::string& path, TextFormat f) {
  if (f == TextFormat::kJsonlGz) return std::make_unique<GzipReader>(path);
  if (f == TextFormat::kJsonlZst) return std::make_unique<ZstdReader>(path);
  return std::make_unique<PlainReader>(path);
}

class LineSourceBase : public TextSource {
 public:
  LineSourceBase(const std::string& path, TextFormat f, const TextReaderOptions& opts)
      : path_(path), format_(f), opts_(opts), lines_(open_bytes(path, f)) {}
  uint64_t bytes_done() const override { return lines_.input().done(); }
  uint64_t bytes_total() const override { return lines_.input().size(); }

 protected:
  void start(TextBatch& b) const {
    b.clear();
    b.path = path_;
    b.format = format_;
  }
  // At the end of the file: an error if it held no document (as the whole-file reader did).
  bool finish(const TextBatch& b) const {
    if (!b.ends.empty()) return true;
    if (docs_ == 0) {
      if (lines_.stream_bytes() == 0)
        throw UserError("data file '" + path_ + "': is empty; allowed: a file with text");
      throw UserError("data file '" + path_ + "': holds no documents");
    }
    return false;
  }
  std::string path_;
  TextFormat format_;
  TextReaderOptions opts_;
  LineReader lines_;
  int64_t docs_ = 0;
};

// Documents are runs of non-blank lines; a blank line holds only spaces, tabs or '\r'. Inside
// a run lines are one '\n' apart, so a document is exactly its bytes in the file.
class TxtSource : public LineSourceBase {
 public:
  using LineSourceBase::LineSourceBase;
  bool next(TextBatch& b) override {
    start(b);
    std::string_view line;
    uint64_t off = 0;
    bool open = false;
    while (lines_.next(line, off)) {
      if (blank_line(line)) {
        if (open) {
          close(b);
          open = false;
          if (b.data.size() >= opts_.batch_bytes) return true;
        }
        continue;
      }
      if (!open) {
        b.offsets.push_back(off);
        open = true;
      } else {
        b.data.push_back('\n');
      }
      b.data.append(line);
    }
    if (open) close(b);
    return finish(b);
  }

 private:
  void close(TextBatch& b) {
    b.ends.push_back(b.data.size());
    ++docs_;
  }
};

// One record per non-blank line; the JSON is parsed later by decode_record.
class JsonlSource : public LineSourceBase {
 public:
  using LineSourceBase::LineSourceBase;
  bool next(TextBatch& b) override {
    start(b);
    std::string_view line;
    uint64_t off = 0;
    while (lines_.next(line, off)) {
      ++line_no_;
      if (blank_line(line)) continue;
      b.data.append(line);
      b.ends.push_back(b.data.size());
      b.offsets.push_back(off);
      b.lines.push_back(line_no_);
      ++docs_;
      if (b.data.size() >= opts_.batch_bytes) return true;
    }
    return finish(b);
  }

 private:
  int64_t line_no_ = 0;
};

// Pulls one string field of a top-level JSON object out of a SAX stream without building
// the document tree. A repeated key keeps its last value, as json.loads does.
class FieldExtractor {
 public:
  using json = nlohmann::json;
  FieldExtractor(const std::string& field, std::string& out) : field_(field), out_(out) {}
  enum class Found { kNo, kString, kOther };
  Found found = Found::kNo;
  bool top_is_object = false;

  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(json::number_integer_t) { return value(); }
  bool number_unsigned(json::number_unsigned_t) { return value(); }
  bool number_float(json::number_float_t, const std::string&) { return value(); }
  bool binary(json::binary_t&) { return value(); }
  bool string(std::string& s) {
    if (depth_ == 1 && at_field_) out_.swap(s);
    if (depth_ == 1 && at_field_) found = Found::kString;
    at_field_ = false;
    return true;
  }
  bool start_object(std::size_t) {
    if (depth_ == 0) top_is_object = true;
    open();
    return true;
  }
  bool start_array(std::size_t) {
    open();
    return true;
  }
  bool end_object() { return --depth_, true; }
  bool end_array() { return --depth_, true; }
  bool key(std::string& k) {
    at_field_ = depth_ == 1 && k == field_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }

 private:
  bool value() {
    if (depth_ == 1 && at_field_) found = Found::kOther;
    at_field_ = false;
    return true;
  }
  void open() {
    if (depth_ == 1 && at_field_) found = Found::kOther;
    at_field_ = false;
    ++depth_;
  }
  const std::string& field_;
  std::string& out_;
  int depth_ = 0;
  bool at_field_ = false;
};

void require_utf8(const TextBatch& b, size_t i, std::string_view text) {
  const size_t bad = invalid_utf8_at(text);
  if (bad == std::string_view::npos) return;
  if (b.format == TextFormat::kParquet)
    throw UserError("data file '" + b.path + "' row " + std::to_string(b.offsets[i]) +
                    ": not valid UTF-8 at byte offset " + std::to_string(bad) +
                    " of the text; allowed: UTF-8 text");
  const bool compressed = b.format == TextFormat::kJsonlGz || b.format == TextFormat::kJsonlZst;
  throw UserError("data file '" + b.path + "': not valid UTF-8 at " +
                  (compressed ? "decompressed " : "") + "byte offset " +
                  std::to_string(b.offsets[i] + bad) + "; allowed: UTF-8 text");
}

}  // namespace

bool text_format_of(const std::string& path, TextFormat* out) {
  if (ends_with(path, ".txt"))
    *out = TextFormat::kTxt;
  else if (ends_with(path, ".jsonl"))
    *out = TextFormat::kJsonl;
  else if (ends_with(path, ".jsonl.gz"))
    *out = TextFormat::kJsonlGz;
  else if (ends_with(path, ".jsonl.zst"))
    *out = TextFormat::kJsonlZst;
  else if (ends_with(path, ".parquet"))
    *out = TextFormat::kParquet;
  else
    return false;
  return true;
}

const char* text_format_name(TextFormat f) {
  switch (f) {
    case TextFormat::kTxt:
      return "txt";
    case TextFormat::kJsonl:
      return "jsonl";
    case TextFormat::kJsonlGz:
      return "jsonl.gz";
    case TextFormat::kJsonlZst:
      return "jsonl.zst";
    case TextFormat::kParquet:
      return "parquet";
  }
  return "?";
}

std::string text_formats_allowed() {
  return std::string("a .txt, .jsonl, .jsonl.gz, .jsonl.zst") +
         (parquet_supported() ? " or .parquet" : "") + " file";
}

std::vector<std::string> expand_input_specs(const std::vector<std::string>& specs,
                                            bool (*accept)(const std::string&),
                                            const std::string& allowed) {
  std::vector<std::string> files;
  for (const std::string& spec : specs) {
    std::error_code ec;
    if (spec.find_first_of("*?[") != std::string::npos && !fs::exists(spec, ec)) {
      glob_t g{};
      const int rc = ::glob(spec.c_str(), 0, nullptr, &g);
      std::vector<std::string> hits(g.gl_pathv, g.gl_pathv + (rc == 0 ? g.gl_pathc : 0));
      globfree(&g);
      if (hits.empty())
        throw UserError("input glob '" + spec + "': matches no file; allowed: " + allowed);
      std::sort(hits.begin(), hits.end());
      for (auto& h : hits) {
        if (fs::is_directory(h, ec)) continue;
        if (!accept(h))
          throw UserError("input '" + h + "' (from glob '" + spec +
                          "'): unknown extension; allowed: " + allowed);
        files.push_back(h);
      }
      continue;
    }
    if (!fs::exists(spec, ec))
      throw UserError("input '" + spec + "': does not exist; allowed: " + allowed +
                      ", a folder or a glob of them");
    if (!fs::is_directory(spec, ec)) {
      if (!accept(spec))
        throw UserError("input '" + spec + "': unknown extension; allowed: " + allowed);
      files.push_back(spec);
      continue;
    }
    std::vector<std::string> hits;
    int64_t skipped = 0;
    for (const auto& e : fs::directory_iterator(spec, ec)) {
      const std::string name = e.path().filename().string();
      if (name.empty() || name[0] == '.' || e.is_directory(ec)) continue;
      if (accept(e.path().string()))
        hits.push_back(e.path().string());
      else
        ++skipped;
    }
    if (ec) throw UserError("input folder '" + spec + "': cannot be listed (" + ec.message() + ")");
    if (hits.empty())
      throw UserError("input folder '" + spec + "': holds no input files; allowed: " + allowed);
    if (skipped > 0)
      log_warn("input folder '" + spec + "': skipped " + std::to_string(skipped) +
               " file(s) with other extensions");
    std::sort(hits.begin(), hits.end());
    files.insert(files.end(), hits.begin(), hits.end());
  }
  return files;
}

std::unique_ptr<TextSource> open_text_source(const std::string& path,
                                             const TextReaderOptions& opts) {
  TextFormat f;
  if (!text_format_of(path, &f))
    throw UserError("data file '" + path +
                    "': unknown extension; allowed: " + text_formats_allowed());
  std::error_code ec;
  if (fs::is_directory(path, ec))
    throw UserError("data file '" + path + "': is a folder; allowed: " + text_formats_allowed());
  if (!fs::exists(path, ec))
    throw UserError("data file '" + path + "': does not exist; allowed: " + text_formats_allowed());
  switch (f) {
    case TextFormat::kTxt:
      return std::make_unique<TxtSource>(path, f, opts);
    case TextFormat::kParquet:
      return open_parquet_source(path, opts);
    default:
      return std::make_unique<JsonlSource>(path, f, opts);
  }
}

std::string_view decode_record(const TextBatch& b, size_t i, const std::string& field,
                               std::string& scratch) {
  std::string_view rec = b.record(i);
  require_utf8(b, i, rec);
  if (b.format == TextFormat::kTxt || b.format == TextFormat::kParquet) return rec;
  scratch.clear();
  FieldExtractor fx(field, scratch);
  const bool ok = nlohmann::json::sax_parse(rec, &fx);
  if (!ok || !fx.top_is_object || fx.found != FieldExtractor::Found::kString)
    throw UserError("data file '" + b.path + "' line " + std::to_string(b.lines[i]) +
                    ": expected a JSON object with a string \"" + field + "\" field");
  return scratch;
}

std::vector<std::string> read_documents(const std::string& path, const TextReaderOptions& opts) {
  auto src = open_text_source(path, opts);
  std::vector<std::string> docs;
  TextBatch b;
  std::string scratch;
  while (src->next(b))
    for (size_t i = 0; i < b.size(); ++i)
      docs.emplace_back(decode_record(b, i, opts.field, scratch));
  return docs;
}

size_t invalid_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs dominate real text: skip 8 bytes at a time while none has its top bit set.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    const size_t len = (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > n) return i;
    for (size_t k = 1; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return i;
    if (len == 2 && c < 0xC2) return i;                       // overlong
    if (len == 3 && c == 0xE0 && p[i + 1] < 0xA0) return i;   // overlong
    if (len == 3 && c == 0xED && p[i + 1] >= 0xA0) return i;  // surrogate
    if (len == 4 && (c > 0xF4 || (c == 0xF0 && p[i + 1] < 0x90) || (c == 0xF4 && p[i + 1] >= 0x90)))
      return i;
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace titan
