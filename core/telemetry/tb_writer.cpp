#include "core/telemetry/tb_writer.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/base/crc32c.h"
#include "core/base/errors.h"

namespace titan {
namespace {

// Field numbers from tensorboard/compat/proto/event.proto and summary.proto.
constexpr uint32_t kEventWallTime = 1;     // double
constexpr uint32_t kEventStep = 2;         // int64
constexpr uint32_t kEventFileVersion = 3;  // string, in oneof `what`
constexpr uint32_t kEventSummary = 5;      // Summary, in oneof `what`
constexpr uint32_t kSummaryValue = 1;      // repeated Summary.Value
constexpr uint32_t kValueTag = 1;          // string
constexpr uint32_t kValueSimpleValue = 2;  // float, in oneof `value`

enum class WireType : uint32_t { Varint = 0, Fixed64 = 1, LengthDelimited = 2, Fixed32 = 5 };

// The protobuf wire format, just the parts Event needs. Integers are little-endian whatever
// the host, so bytes are appended one at a time.
class ProtoWriter {
 public:
  void varint(uint64_t v) {
    while (v >= 0x80) {
      out_ += char((v & 0x7f) | 0x80);
      v >>= 7;
    }
    out_ += char(v);
  }
  void key(uint32_t field, WireType type) { varint(uint64_t(field) << 3 | uint32_t(type)); }
  // int64 is a plain varint of the two's complement, so negatives take ten bytes (not zigzag).
  void int64_field(uint32_t field, int64_t v) {
    key(field, WireType::Varint);
    varint(uint64_t(v));
  }
  void double_field(uint32_t field, double v) {
    key(field, WireType::Fixed64);
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    fixed(bits, 8);
  }
  void float_field(uint32_t field, float v) {
    key(field, WireType::Fixed32);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    fixed(bits, 4);
  }
  // Strings, bytes and embedded messages share this encoding.
  void bytes_field(uint32_t field, const std::string& bytes) {
    key(field, WireType::LengthDelimited);
    varint(bytes.size());
    out_ += bytes;
  }
  const std::string& bytes() const { return out_; }

 private:
  void fixed(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_ += char((v >> (8 * i)) & 0xff);
  }
  std::string out_;
};

// proto3 leaves out plain scalar fields that hold their default, and Python's protobuf (the
// golden test's reference) does too; oneof members such as simple_value are always written.
void event_header(ProtoWriter& w, double wall_time, int64_t step) {
  if (wall_time != 0) w.double_field(kEventWallTime, wall_time);
  if (step != 0) w.int64_field(kEventStep, step);
}

std::string file_version_event(double wall_time) {
  ProtoWriter w;
  event_header(w, wall_time, 0);
  w.bytes_field(kEventFileVersion, "brain.Event:2");
  return w.bytes();
}

std::string scalar_event(const std::string& tag, double value, int64_t step, double wall_time) {
  ProtoWriter v;
  if (!tag.empty()) v.bytes_field(kValueTag, tag);
  v.float_field(kValueSimpleValue, static_cast<float>(value));
  ProtoWriter s;
  s.bytes_field(kSummaryValue, v.bytes());
  ProtoWriter e;
  event_header(e, wall_time, step);
  e.bytes_field(kEventSummary, s.bytes());
  return e.bytes();
}

void append_le(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out += char((v >> (8 * i)) & 0xff);
}

// TFRecord: uint64 length, masked CRC of those 8 bytes, data, masked CRC of the data.
std::string tfrecord(const std::string& data) {
  std::string r;
  r.reserve(data.size() + 16);
  append_le(r, data.size(), 8);
  append_le(r, crc32c_mask(crc32c(r)), 4);
  r += data;
  append_le(r, crc32c_mask(crc32c(data)), 4);
  return r;
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& folder) {
  double t = now_seconds();
  // TensorBoard orders and names runs' files by this stamp; the pid keeps ranks that share a
  // host (and a folder) from writing into one file.
  open(folder,
       "events.out.tfevents." + std::to_string(int64_t(t)) + "." + host_name() + "." +
           std::to_string(::getpid()) + ".titan",
       t);
}

TensorBoardWriter::TensorBoardWriter(const std::string& folder, const std::string& file_name,
                                     double wall_time) {
  open(folder, file_name, wall_time);
}

TensorBoardWriter::~TensorBoardWriter() {
  // No throwing from a destructor: a failed final flush is lost, as with any buffered log.
  out_.flush();
}

void TensorBoardWriter::open(const std::string& folder, const std::string& file_name,
                             double wall_time) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec || !fs::is_directory(folder)) {
    throw UserError("cannot create TensorBoard folder " + folder + ": " +
                    (ec ? ec.message() : "not a directory"));
  }
  path_ = (fs::path(folder) / file_name).string();
  errno = 0;
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_.is_open()) {
    throw UserError("cannot open TensorBoard event file " + path_ + ": " +
                    (errno ? std::strerror(errno) : "open failed"));
  }
  write_record(file_version_event(wall_time));
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  add_scalar(tag, value, step, now_seconds());
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step,
                                   double wall_time) {
  write_record(scalar_event(tag, value, step, wall_time));
}

void TensorBoardWriter::flush() {
  out_.flush();
  if (!out_) throw UserError("cannot write TensorBoard event file " + path_);
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string r = tfrecord(data);
  out_.write(r.data(), std::streamsize(r.size()));
  if (!out_) throw UserError("cannot write TensorBoard event file " + path_);
}

}  // namespace titan
