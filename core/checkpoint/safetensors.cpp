#include "core/checkpoint/safetensors.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include "core/base/durable_io.h"
#include "core/base/errors.h"

// Values in the data buffer are little-endian and are copied as they are.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors I/O assumes a little-endian host");

namespace titan {

using Json = nlohmann::json;

// ---- Byte sources -------------------------------------------------------------------------

class SafetensorsSource {
 public:
  explicit SafetensorsSource(std::string name) : name_(std::move(name)) {}
  virtual ~SafetensorsSource() = default;
  const std::string& name() const { return name_; }
  virtual uint64_t size() const = 0;
  // Copies n bytes at `offset` into dst. Returns an empty string on success, else why not.
  virtual std::string read(uint64_t offset, void* dst, size_t n) const = 0;

 private:
  std::string name_;
};

namespace {

class FileSource final : public SafetensorsSource {
 public:
  FileSource(std::string path, int fd, uint64_t size)
      : SafetensorsSource(std::move(path)), fd_(fd), size_(size) {}
  ~FileSource() override { ::close(fd_); }
  uint64_t size() const override { return size_; }
  std::string read(uint64_t offset, void* dst, size_t n) const override {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      // pread moves at most ~2 GiB per call on Linux; loop for big tensors and short reads.
      ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (got < 0) {
        if (errno == EINTR) continue;
        return std::strerror(errno);
      }
      if (got == 0) return "the file ended early (was it truncated after it was opened?)";
      p += got;
      offset += static_cast<uint64_t>(got);
      n -= static_cast<size_t>(got);
    }
    return {};
  }

 private:
  int fd_;
  uint64_t size_;
};

class MemorySource final : public SafetensorsSource {
 public:
  MemorySource(std::string name, std::string bytes)
      : SafetensorsSource(std::move(name)), bytes_(std::move(bytes)) {}
  uint64_t size() const override { return bytes_.size(); }
  std::string read(uint64_t offset, void* dst, size_t n) const override {
    if (offset > bytes_.size() || n > bytes_.size() - offset) return "read past the end";
    std::memcpy(dst, bytes_.data() + offset, n);
    return {};
  }

 private:
  std::string bytes_;
};

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw UserError("safetensors file '" + path + "': " + what);
}

// A JSON string literal for a name, so that odd characters stay on one line.
std::string quote(const std::string& s) {
  return Json(s).dump(-1, ' ', false, Json::error_handler_t::replace);
}

const char* json_type(const Json& j) {
  if (j.is_number_integer()) return "integer";
  if (j.is_number_float()) return "float";
  return j.type_name();
}

struct DtypeInfo {
  const char* name;
  at::ScalarType dtype;
};
// Ordered by element size, largest first, as the writer lays out the data buffer.
constexpr DtypeInfo kDtypes[] = {
    {"F64", at::ScalarType::Double},
    {"I64", at::ScalarType::Long},
    {"F32", at::ScalarType::Float},
    {"I32", at::ScalarType::Int},
    {"F16", at::ScalarType::Half},
    {"BF16", at::ScalarType::BFloat16},
    {"I16", at::ScalarType::Short},
    {"I8", at::ScalarType::Char},
    {"U8", at::ScalarType::Byte},
    {"BOOL", at::ScalarType::Bool},
    // DeepSeek-V3's published weights (torch.float8_e4m3fn); e5m2 for completeness.
    {"F8_E4M3", at::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", at::ScalarType::Float8_e5m2},
};

// Checks that need no JSON parser, run first: a NUL byte (nlohmann takes it for the end of the
// input and would ignore whatever follows; JSON never holds a raw NUL) and the nesting depth of
// brackets outside strings (bounds what the parser spends on inputs like 100 MB of '['; a valid
// header nests 3 deep: root object, entry object, shape array). Returns "" or the problem.
std::string json_prescan(const char* s, size_t n, size_t max_depth) {
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < n; ++i) {
    char c = s[i];
    if (c == '\0') return "header holds a NUL byte at header byte " + std::to_string(i);
    if (in_string) {
      if (c == '\\') {
        if (i + 1 < n && s[i + 1] != '\0') ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return "header JSON nests more than " + std::to_string(max_depth) +
               " levels deep; a valid header nests 3";
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return {};
}

// Collects the syntax error of a header that failed to parse, without exceptions.
struct SyntaxErrorSax : nlohmann::json_sax<Json> {
  std::string message;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    // what() is "[json.exception.parse_error.101] parse error at line 1, column 7: syntax error
    // while parsing value - invalid literal; last read: '...'": keep the middle, drop the
    // echoed input (arbitrary bytes).
    std::string w = ex.what();
    auto b = w.find("] ");
    w = b == std::string::npos ? w : w.substr(b + 2);
    auto e = w.find("; last read");
    if (e != std::string::npos) w.resize(e);
    message = w + " (header byte " + std::to_string(position) + ")";
    return false;
  }
};

// A JSON integer in [0, max], or false.
bool get_uint(const Json& j, uint64_t max, uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<uint64_t>();
  } else if (j.is_number_integer()) {
    int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    out = static_cast<uint64_t>(v);
  } else {
    return false;
  }
  return out <= max;
}

constexpr size_t kMaxJsonDepth = 16;
constexpr size_t kMaxRank = 64;

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const Json& j,
                             uint64_t data_size) {
  const std::string where = "tensor " + quote(name);
  if (!j.is_object()) {
    fail(path, where + " is a JSON " + json_type(j) +
                   "; it must be an object with dtype, shape and data_offsets");
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      fail(path, where + " has unknown key " + quote(it.key()) +
                     "; allowed keys: dtype, shape, data_offsets");
    }
  }
  for (const char* k : {"dtype", "shape", "data_offsets"}) {
    if (!j.contains(k)) fail(path, where + " has no " + k);
  }
  SafetensorsEntry e;
  e.name = name;

  const Json& dtype = j["dtype"];
  if (!dtype.is_string()) {
    fail(path, where + ": dtype is a JSON " + json_type(dtype) + "; it must be a string");
  }
  if (!safetensors_dtype_from_name(dtype.get_ref<const std::string&>(), e.dtype)) {
    fail(path, where + ": unknown dtype " + quote(dtype.get_ref<const std::string&>()) +
                   "; allowed: " + safetensors_allowed_dtypes());
  }

  const Json& shape = j["shape"];
  if (!shape.is_array()) {
    fail(path, where + ": shape is a JSON " + json_type(shape) +
                   "; it must be an array of non-negative integers");
  }
  if (shape.size() > kMaxRank) {
    fail(path, where + ": shape has " + std::to_string(shape.size()) + " dimensions; at most " +
                   std::to_string(kMaxRank) + " are allowed");
  }
  // The product of the non-zero dims must fit int64_t, so that at::empty never sees an
  // overflowing size even when another dim is 0.
  constexpr uint64_t kMaxDim = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t nonzero_product = 1;
  bool has_zero = false;
  for (const Json& d : shape) {
    uint64_t v = 0;
    if (!get_uint(d, kMaxDim, v)) {
      fail(path, where + ": shape entry " + d.dump() + " is not an integer in [0, 2^63 - 1]");
    }
    if (v == 0)
      has_zero = true;
    else if (__builtin_mul_overflow(nonzero_product, v, &nonzero_product) ||
             nonzero_product > kMaxDim) {
      fail(path, where + ": shape " + shape.dump() + " has more than 2^63 - 1 elements");
    }
    e.shape.push_back(static_cast<int64_t>(v));
  }
  uint64_t numel = has_zero ? 0 : nonzero_product;

  const Json& offsets = j["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 ||
      !get_uint(offsets[0], std::numeric_limits<uint64_t>::max(), e.begin) ||
      !get_uint(offsets[1], std::numeric_limits<uint64_t>::max(), e.end)) {
    fail(path, where + ": data_offsets " + offsets.dump() +
                   " must be an array of two non-negative integers [begin, end]");
  }
  if (e.end < e.begin) {
    fail(path, where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                   "] end before they begin");
  }
  if (e.end > data_size) {
    fail(path, where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                   "] run past the " + std::to_string(data_size) + "-byte data buffer");
  }
  uint64_t nbytes = 0;
  uint64_t elem = c10::elementSize(e.dtype);
  if (__builtin_mul_overflow(numel, elem, &nbytes) || nbytes != e.end - e.begin) {
    fail(path, where + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                   "] span " + std::to_string(e.end - e.begin) + " bytes; shape " + shape.dump() +
                   " of " + dtype.get<std::string>() + " needs " + std::to_string(numel) + " x " +
                   std::to_string(elem) + " bytes");
  }
  return e;
}

}  // namespace

// ---- The parsing core ------------------------------------------------------------------------

bool safetensors_dtype_from_name(const std::string& name, at::ScalarType& out) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      out = d.dtype;
      return true;
    }
  }
  return false;
}

const char* safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  TORCH_CHECK(false, "safetensors: dtype ", dtype,
              " is not supported; allowed: ", safetensors_allowed_dtypes());
}

const char* safetensors_allowed_dtypes() {
  return "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2";
}

uint64_t parse_safetensors_header_length(const unsigned char (&prefix)[8], uint64_t file_size,
                                         const std::string& path) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kSafetensorsMaxHeaderBytes) {
    fail(path, "header length " + std::to_string(n) + " bytes exceeds the limit of " +
                   std::to_string(kSafetensorsMaxHeaderBytes) + " bytes");
  }
  if (file_size < 8 || n > file_size - 8) {
    fail(path, "header length " + std::to_string(n) + " bytes runs past the end of the " +
                   std::to_string(file_size) + "-byte file");
  }
  return n;
}

SafetensorsHeader parse_safetensors_header(const char* json, size_t json_size, uint64_t data_size,
                                           const std::string& path) {
  std::string problem = json_prescan(json, json_size, kMaxJsonDepth);
  if (!problem.empty()) fail(path, problem);
  // nlohmann keeps the last of repeated keys; a repeated tensor name (or field) is ambiguous, so
  // watch the keys of every object as they are parsed. One set per open object.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  Json::parser_callback_t watch_keys = [&](int, Json::parse_event_t ev, Json& parsed) {
    if (ev == Json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (ev == Json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (ev == Json::parse_event_t::key && !open_objects.empty() && duplicate.empty()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(k).second) duplicate = k;
    }
    return true;
  };
  Json root = Json::parse(json, json + json_size, watch_keys, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    SyntaxErrorSax sax;
    Json::sax_parse(json, json + json_size, &sax);
    fail(path, "header is not valid JSON: " + (sax.message.empty() ? "syntax error" : sax.message));
  }
  if (!duplicate.empty()) {
    fail(path,
         "header repeats the key " + quote(duplicate) + "; tensor names and fields must be unique");
  }
  if (!root.is_object()) {
    fail(path, std::string("header is a JSON ") + json_type(root) + "; it must be an object");
  }

  SafetensorsHeader h;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      const Json& m = it.value();
      if (m.is_null()) continue;
      if (!m.is_object()) {
        fail(path, std::string("__metadata__ is a JSON ") + json_type(m) +
                       "; it must be an object of strings");
      }
      for (auto mit = m.begin(); mit != m.end(); ++mit) {
        if (!mit.value().is_string()) {
          fail(path, "__metadata__ value of " + quote(mit.key()) + " is a JSON " +
                         json_type(mit.value()) + "; metadata values must be strings");
        }
        h.metadata[mit.key()] = mit.value().get<std::string>();
      }
      continue;
    }
    h.entries.push_back(parse_entry(path, it.key(), it.value(), data_size));
  }

  // Sorted by offset, the tensors must tile the data buffer: no overlap, no gap, nothing after.
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  const SafetensorsEntry* prev = nullptr;
  auto span = [](const SafetensorsEntry& e) {
    return quote(e.name) + " [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ")";
  };
  for (const auto& e : h.entries) {
    if (e.begin < covered) {
      fail(path,
           "tensors " + span(*prev) + " and " + span(e) + " overlap; tensors must not share bytes");
    }
    if (e.begin > covered) {
      fail(path, "data bytes [" + std::to_string(covered) + ", " + std::to_string(e.begin) +
                     ") belong to no tensor; tensors must tile the data buffer without gaps");
    }
    covered = e.end;
    prev = &e;
  }
  if (covered != data_size) {
    fail(path, "the data buffer is " + std::to_string(data_size) + " bytes but the tensors cover " +
                   std::to_string(covered) + "; the last tensor must end where the file ends");
  }
  return h;
}

// ---- Reader ----------------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    fail(path, std::string("cannot be opened (") + std::strerror(err) + ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(path, std::string("cannot be read (") + std::strerror(err) + ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, S_ISDIR(st.st_mode) ? "is a directory, not a file" : "is not a regular file");
  }
  auto source = std::make_shared<FileSource>(path, fd, static_cast<uint64_t>(st.st_size));
  return from_source(std::move(source));
}

SafetensorsFile SafetensorsFile::open_from_memory(std::string bytes, const std::string& name) {
  return from_source(std::make_shared<MemorySource>(name, std::move(bytes)));
}

SafetensorsFile SafetensorsFile::from_source(std::shared_ptr<const SafetensorsSource> source) {
  const std::string& path = source->name();
  uint64_t size = source->size();
  if (size < 8) {
    fail(path, "is " + std::to_string(size) +
                   " bytes long; a safetensors file starts with an 8-byte header length");
  }
  unsigned char prefix[8];
  std::string err = source->read(0, prefix, 8);
  if (!err.empty()) fail(path, "cannot be read (" + err + ")");
  uint64_t n = parse_safetensors_header_length(prefix, size, path);
  std::string json(static_cast<size_t>(n), '\0');
  err = source->read(8, json.data(), json.size());
  if (!err.empty()) fail(path, "cannot read the header (" + err + ")");
  SafetensorsHeader h = parse_safetensors_header(json.data(), json.size(), size - 8 - n, path);

  SafetensorsFile f;
  f.path_ = path;
  f.source_ = std::move(source);
  f.data_start_ = 8 + n;
  f.entries_ = std::move(h.entries);
  f.metadata_ = std::move(h.metadata);
  for (size_t i = 0; i < f.entries_.size(); ++i) f.index_[f.entries_[i].name] = i;
  return f;
}

bool SafetensorsFile::contains(const std::string& name) const {
  return index_.count(name) != 0;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail(path_, "has no tensor " + quote(name));
  return entries_[it->second];
}

at::Tensor SafetensorsFile::get(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  return read_span(e, e.shape, 0, e.end - e.begin);
}

at::Tensor SafetensorsFile::get_rows(const std::string& name, int64_t row_begin,
                                     int64_t rows) const {
  const SafetensorsEntry& e = entry(name);
  TORCH_CHECK(!e.shape.empty(), "get_rows: tensor '", name, "' in ", path_, " is a scalar");
  TORCH_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= e.shape[0], "get_rows: rows [",
              row_begin, ", ", row_begin + rows, ") are outside tensor '", name, "' of ",
              e.shape[0], " rows in ", path_);
  int64_t row_numel = 1;
  for (size_t d = 1; d < e.shape.size(); ++d) row_numel *= e.shape[d];
  const uint64_t row_bytes = static_cast<uint64_t>(row_numel) * c10::elementSize(e.dtype);
  std::vector<int64_t> shape = e.shape;
  shape[0] = rows;
  return read_span(e, shape, static_cast<uint64_t>(row_begin) * row_bytes,
                   static_cast<uint64_t>(rows) * row_bytes);
}

at::Tensor SafetensorsFile::read_span(const SafetensorsEntry& e, const std::vector<int64_t>& shape,
                                      uint64_t skip, uint64_t nbytes_u) const {
  const std::string& name = e.name;
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(e.dtype));
  const size_t nbytes = static_cast<size_t>(nbytes_u);
  if (nbytes == 0) return t;
  const uint64_t at_offset = data_start_ + e.begin + skip;
  std::string err = source_->read(at_offset, t.data_ptr(), nbytes);
  if (!err.empty()) {
    fail(path_, "cannot read tensor " + quote(name) + " (" + std::to_string(nbytes) +
                    " bytes at file offset " + std::to_string(at_offset) + "): " + err);
  }
  if (e.dtype == at::ScalarType::Bool) {
    // Any byte other than 0 or 1 is not a C++ bool; refuse it rather than hand it on.
    const auto* p = static_cast<const unsigned char*>(t.data_ptr());
    auto bad = std::find_if(p, p + nbytes, [](unsigned char c) { return c > 1; });
    if (bad != p + nbytes) {
      fail(path_, "tensor " + quote(name) + " (BOOL) holds byte " + std::to_string(*bad) +
                      " at element " + std::to_string(skip + static_cast<uint64_t>(bad - p)) +
                      "; BOOL bytes must be 0 or 1");
    }
  }
  return t;
}

// ---- Writer ----------------------------------------------------------------------------------

namespace {

// Removes the temporary file unless the write was committed.
struct TempFile {
  std::string path;
  int fd = -1;
  bool committed = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!committed) ::unlink(path.c_str());
  }
};

// `err` is the errno of the failed call, captured before any other call can change it.
[[noreturn]] void write_fail(const std::string& path, int err, const std::string& what) {
  throw UserError("cannot write safetensors file '" + path + "': " + what + " (" +
                  std::strerror(err) + ")");
}

void write_all(TempFile& tmp, const std::string& path, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(tmp.fd, p, n);
    if (w < 0) {
      int err = errno;
      if (err == EINTR) continue;
      write_fail(path, err, "writing " + tmp.path + " failed");
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  struct Item {
    size_t index;  // into `tensors`
    size_t elem;   // bytes per element
    uint64_t nbytes;
  };
  std::vector<Item> items;
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    TORCH_CHECK(t.defined(), "save_safetensors(", path, "): tensor '", name, "' is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, "save_safetensors(", path, "): tensor '", name,
                "' is not a dense tensor");
    TORCH_CHECK(name != "__metadata__", "save_safetensors(", path,
                "): '__metadata__' is reserved and cannot name a tensor");
    TORCH_CHECK(names.insert(name).second, "save_safetensors(", path, "): tensor '", name,
                "' appears twice");
    safetensors_dtype_name(t.scalar_type());  // throws for an unsupported dtype
    const auto elem = static_cast<size_t>(t.element_size());
    items.push_back({i, elem, static_cast<uint64_t>(t.numel()) * elem});
  }
  // Largest elements first, then by name: every offset is a multiple of its element size.
  std::sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    if (a.elem != b.elem) return a.elem > b.elem;
    return tensors[a.index].first < tensors[b.index].first;
  });

  Json header = Json::object();  // keys come out sorted by name
  uint64_t offset = 0;
  for (const auto& it : items) {
    const at::Tensor& t = tensors[it.index].second;
    header[tensors[it.index].first] = {{"dtype", safetensors_dtype_name(t.scalar_type())},
                                       {"shape", t.sizes().vec()},
                                       {"data_offsets", {offset, offset + it.nbytes}}};
    offset += it.nbytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "save_safetensors(", path,
                "): a tensor name or metadata string is not "
                "valid UTF-8: ",
                e.what());
  }
  // Pad so the data buffer (at 8 + N) starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  TempFile tmp;
  tmp.path = path + ".tmp." + std::to_string(::getpid());
  tmp.fd = ::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (tmp.fd < 0) {
    int err = errno;
    tmp.committed = true;  // nothing was created, nothing to remove
    write_fail(path, err, "cannot create " + tmp.path);
  }
  write_all(tmp, path, prefix, 8);
  write_all(tmp, path, text.data(), text.size());
  for (const auto& it : items) {
    if (it.nbytes == 0) continue;
    // One tensor at a time on the host, so a model on the GPU never has two host copies.
    at::Tensor c = tensors[it.index].second.detach().resolve_neg().contiguous().cpu();
    write_all(tmp, path, c.data_ptr(), static_cast<size_t>(it.nbytes));
  }
  if (::fsync(tmp.fd) != 0) write_fail(path, errno, "fsync of " + tmp.path + " failed");
  int fd = tmp.fd;
  tmp.fd = -1;
  if (::close(fd) != 0) write_fail(path, errno, "closing " + tmp.path + " failed");
  if (::rename(tmp.path.c_str(), path.c_str()) != 0) {
    write_fail(path, errno, "renaming " + tmp.path + " over it failed");
  }
  tmp.committed = true;
  // Make the rename itself durable. Best effort: some file systems refuse fsync on folders.
  std::string dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
  if (dir.empty()) dir = "/";
  fsync_dir(dir);
}

}  // namespace titan
