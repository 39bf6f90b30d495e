// safetensors: bit-exact round trips of every supported dtype, interop with the Python package
// in both directions, one UserError naming the file for every kind of corrupt file, and the
// atomic write.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>

#include "core/base/errors.h"
#include "core/checkpoint/safetensors.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const std::vector<at::ScalarType> kAllDtypes = {
    at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
    at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool,
};

// Values that exercise the whole dtype: signs, fractions and (for floats) inf/nan/-0.
at::Tensor sample(at::ScalarType dtype, std::vector<int64_t> shape, int seed) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  auto base = at::arange(n, at::kDouble).mul(7.25).add(seed * 3).sub(n * 3.0).fmod(120);
  at::Tensor t;
  if (dtype == at::kBool) {
    t = at::arange(n, at::kLong).add(seed).remainder(2).to(at::kBool);
  } else if (dtype == at::kByte) {
    t = base.abs().to(dtype);
  } else {
    t = base.to(dtype);
  }
  if (at::isFloatingType(dtype) && n >= 4) {
    t[0] = std::numeric_limits<double>::infinity();
    t[1] = std::numeric_limits<double>::quiet_NaN();
    t[2] = -0.0;
  }
  return t.reshape(shape);
}

// Byte-level equality (at::equal treats NaN != NaN and -0 == 0).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// FNV-1a over the raw little-endian bytes; the Python helpers below compute the same.
uint64_t fnv1a(const at::Tensor& t) {
  auto c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string shape_str(at::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

// One line per tensor: "name dtype [shape] fnv1a float64-sum", as the Python side prints it.
std::string describe(const std::string& name, const at::Tensor& t) {
  std::ostringstream o;
  double sum = t.to(at::kDouble).nan_to_num(0, 0, 0).sum().item<double>();
  o << name << " " << safetensors_dtype_name(t.scalar_type()) << " " << shape_str(t.sizes()) << " "
    << fnv1a(t) << " " << std::llround(sum * 1000);
  return o.str();
}

const char* kPythonDescribe = R"(
import torch
NAMES = {torch.float64: 'F64', torch.float32: 'F32', torch.float16: 'F16',
         torch.bfloat16: 'BF16', torch.int64: 'I64', torch.int32: 'I32', torch.int16: 'I16',
         torch.int8: 'I8', torch.uint8: 'U8', torch.bool: 'BOOL'}
def describe(name, t):
    b = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    h = 1469598103934665603
    for x in b:
        h = ((h ^ x) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    s = t.double().nan_to_num(0, 0, 0).sum().item()
    shape = '[' + ','.join(str(d) for d in t.shape) + ']'
    return f'{name} {NAMES[t.dtype]} {shape} {h} {round(s * 1000)}'
)";

test::CmdResult run_python(const test::TempDir& dir, const std::string& body,
                           const std::string& args) {
  std::string script = dir.file("script.py");
  test::write_file(script, std::string(kPythonDescribe) + body);
  return test::run(test::python() + " " + script + " " + args);
}

std::vector<std::string> sorted_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) {
    if (!l.empty()) lines.push_back(l);
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}

// The tensors every round trip uses: each dtype as a matrix, a 0-d scalar, a 0-element tensor
// and a non-contiguous view.
std::vector<std::pair<std::string, at::Tensor>> sample_set() {
  std::vector<std::pair<std::string, at::Tensor>> ts;
  int seed = 0;
  for (auto dt : kAllDtypes) {
    std::string n = safetensors_dtype_name(dt);
    ts.push_back({"m." + n, sample(dt, {3, 5}, ++seed)});
    ts.push_back({"s." + n, sample(dt, {}, ++seed)});
    ts.push_back({"e." + n, sample(dt, {0, 4}, ++seed)});
    ts.push_back({"t." + n, sample(dt, {4, 3}, ++seed).t()});  // transposed: not contiguous
  }
  return ts;
}

std::string header_json(const std::string& path) {
  std::string bytes = test::read_file(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  return bytes.substr(8, n);
}

// A file from a raw header and data buffer.
std::string make_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t(header.size()) >> (8 * i));
  return out + header + data;
}

// Opens the file and reads every tensor; returns the UserError message, or "" when none.
// Any other exception escapes and fails the test.
std::string load_error(const std::string& path) {
  try {
    auto f = SafetensorsFile::open(path);
    for (const auto& e : f.entries()) f.get(e.name);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::string load_error_from_memory(const std::string& bytes, const std::string& name) {
  try {
    auto f = SafetensorsFile::open_from_memory(bytes, name);
    for (const auto& e : f.entries()) f.get(e.name);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors: every dtype round trips bit-exactly with metadata", "[safetensors]") {
  test::TempDir dir("st");
  auto ts = sample_set();
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}, {"note", "a\nb"}};
  std::string path = dir.file("all.safetensors");
  save_safetensors(path, ts, meta);

  auto f = SafetensorsFile::open(path);
  CHECK(f.path() == path);
  CHECK(f.metadata() == meta);
  REQUIRE(f.entries().size() == ts.size());
  for (const auto& [name, t] : ts) {
    INFO(name);
    REQUIRE(f.contains(name));
    at::Tensor got = f.get(name);
    CHECK(got.device().is_cpu());
    CHECK(got.is_contiguous());
    CHECK(got.scalar_type() == t.scalar_type());
    CHECK(got.sizes() == t.sizes());
    CHECK(same_bits(got, t));
    if (!at::isFloatingType(t.scalar_type())) CHECK(at::equal(got, t));
  }
  CHECK_FALSE(f.contains("missing"));
  CHECK_THROWS_AS(f.get("missing"), UserError);

  // Entries come sorted by offset, each aligned to its element size, and the data buffer starts
  // 8-byte aligned in the file.
  uint64_t prev = 0;
  for (const auto& e : f.entries()) {
    CHECK(e.begin >= prev);
    CHECK(e.begin % c10::elementSize(e.dtype) == 0);
    prev = e.begin;
  }
  CHECK((8 + header_json(path).size()) % 8 == 0);

  // The same bytes from memory give the same result.
  auto m = SafetensorsFile::open_from_memory(test::read_file(path), "mem");
  CHECK(m.path() == "mem");
  REQUIRE(m.entries().size() == f.entries().size());
  for (const auto& [name, t] : ts) CHECK(same_bits(m.get(name), t));

  // An empty file (no tensors, no metadata) round trips too.
  save_safetensors(dir.file("empty.safetensors"), {});
  auto e = SafetensorsFile::open(dir.file("empty.safetensors"));
  CHECK(e.entries().empty());
  CHECK(e.metadata().empty());
}

TEST_CASE("safetensors: get_rows reads exactly a range of dim-0 rows", "[safetensors]") {
  // Against get() of the whole tensor, narrowed: every dtype, every range of the 3x5 and
  // 5x4 (transposed on write) tensors, from the file and from memory.
  test::TempDir dir("st-rows");
  auto ts = sample_set();
  const std::string path = dir.file("rows.safetensors");
  save_safetensors(path, ts);
  auto f = SafetensorsFile::open(path);
  auto m = SafetensorsFile::open_from_memory(test::read_file(path), "mem");
  for (const auto& [name, t] : ts) {
    if (t.dim() == 0) {
      CHECK_THROWS_AS(f.get_rows(name, 0, 1), c10::Error);  // a scalar has no rows
      continue;
    }
    const at::Tensor whole = f.get(name);
    const int64_t rows = whole.size(0);
    for (int64_t b = 0; b <= rows; ++b)
      for (int64_t n = 0; b + n <= rows; ++n) {
        INFO(name << " rows [" << b << ", " << b + n << ")");
        at::Tensor got = f.get_rows(name, b, n);
        CHECK(got.sizes() == whole.narrow(0, b, n).sizes());
        CHECK(got.scalar_type() == t.scalar_type());
        CHECK(got.is_contiguous());
        CHECK(same_bits(got, whole.narrow(0, b, n).contiguous()));
        CHECK(same_bits(m.get_rows(name, b, n), got));
      }
    CHECK_THROWS_AS(f.get_rows(name, rows, 1), c10::Error);
    CHECK_THROWS_AS(f.get_rows(name, -1, 1), c10::Error);
  }
}

TEST_CASE("safetensors: the Python package reads our files identically", "[safetensors]") {
  test::TempDir dir("st-py");
  auto ts = sample_set();
  std::string path = dir.file("ours.safetensors");
  save_safetensors(path, ts, {{"who", "titan"}});
  auto r = run_python(dir, R"(
import sys
from safetensors import safe_open
from safetensors.torch import load_file
d = load_file(sys.argv[1])
for k, t in d.items():
    print(describe(k, t))
with safe_open(sys.argv[1], framework='pt') as f:
    print('META', f.metadata())
)",
                      path);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  std::vector<std::string> expect;
  for (const auto& [name, t] : ts) expect.push_back(describe(name, t));
  expect.push_back("META {'who': 'titan'}");
  std::sort(expect.begin(), expect.end());
  CHECK(sorted_lines(r.out) == expect);
}

TEST_CASE("safetensors: files written by the Python package load identically", "[safetensors]") {
  test::TempDir dir("st-py");
  std::string path = dir.file("theirs.safetensors");
  auto r = run_python(dir, R"(
import sys
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
ts = {
  'embed.weight': torch.randn(7, 5, generator=g).to(torch.bfloat16),
  'norm.weight': torch.randn(5, generator=g).to(torch.float16),
  'w': torch.randn(3, 2, 2, generator=g),
  'w64': torch.randn(4, generator=g).double(),
  'ids': torch.arange(-5, 6),
  'i32': torch.arange(10, dtype=torch.int32).reshape(2, 5),
  'i16': torch.tensor([-300, 7], dtype=torch.int16),
  'i8': torch.tensor([-128, 127, 0], dtype=torch.int8),
  'u8': torch.tensor([0, 255, 3], dtype=torch.uint8),
  'mask': torch.tensor([True, False, True]),
  'scalar': torch.tensor(2.5),
  'empty': torch.zeros(0, 3),
}
save_file(ts, sys.argv[1], metadata={'format': 'pt', 'k': 'v'})
for k, t in ts.items():
    print(describe(k, t))
)",
                      path);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto f = SafetensorsFile::open(path);
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"k", "v"}});
  std::string ours;
  for (const auto& e : f.entries()) ours += describe(e.name, f.get(e.name)) + "\n";
  CHECK(f.entries().size() == 12);
  CHECK(sorted_lines(ours) == sorted_lines(r.out));
  CHECK(f.get("embed.weight").scalar_type() == at::kBFloat16);
  CHECK(f.get("scalar").dim() == 0);
}

TEST_CASE("safetensors: every kind of corrupt file is one UserError naming the file",
          "[safetensors]") {
  test::TempDir dir("st-bad");
  std::string good_path = dir.file("good.safetensors");
  save_safetensors(good_path,
                   {{"a", at::arange(6, at::kFloat).reshape({2, 3})},
                    {"b", at::arange(4, at::kShort)},
                    {"c", at::ones({3}, at::kBool)}},
                   {{"k", "v"}});
  const std::string good = test::read_file(good_path);
  REQUIRE(load_error(good_path).empty());
  const std::string hdr = header_json(good_path);
  const std::string data = good.substr(8 + hdr.size());
  REQUIRE(data.size() == 24 + 8 + 3);

  auto expect_error = [&](const std::string& what, const std::string& bytes,
                          const std::string& fragment) {
    std::string path = dir.file("bad.safetensors");
    test::write_file(path, bytes);
    INFO(what);
    std::string msg = load_error(path);
    INFO(msg);
    CHECK_THAT(msg, Contains(path));
    CHECK_THAT(msg, Contains(fragment));
    CHECK(msg.find('\n') == std::string::npos);
    // The same check through memory, named by what it stands for.
    std::string mem = load_error_from_memory(bytes, "mem:" + what);
    CHECK_THAT(mem, Contains("mem:" + what));
  };

  SECTION("truncated anywhere") {
    for (size_t len : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(9), size_t(20),
                       8 + hdr.size() - 1, 8 + hdr.size(), 8 + hdr.size() + 5, good.size() - 1}) {
      expect_error("truncated to " + std::to_string(len), good.substr(0, len), "");
    }
    expect_error("7 bytes", good.substr(0, 7), "8-byte header length");
  }
  SECTION("header length") {
    auto with_length = [&](uint64_t n) {
      std::string b = good;
      for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(n >> (8 * i));
      return b;
    };
    expect_error("huge", with_length(~0ull), "exceeds the limit of 100000000 bytes");
    expect_error("cap + 1", with_length(100'000'001), "exceeds the limit");
    expect_error("past the end", with_length(good.size()), "runs past the end");
    expect_error("one short", with_length(hdr.size() - 1), "");
    expect_error("one long", with_length(hdr.size() + 1), "");
    expect_error("zero", with_length(0), "not valid JSON");
    expect_error("NUL then junk", make_file(std::string("{}\0junk", 7), ""),
                 "NUL byte at header byte 2");
  }
  SECTION("bad JSON") {
    expect_error("syntax", make_file("{\"a\": {", data), "not valid JSON");
    expect_error("garbage", make_file("hello", data), "not valid JSON");
    expect_error("array", make_file("[1, 2]", ""), "it must be an object");
    expect_error("string", make_file("\"x\"", ""), "it must be an object");
    expect_error("bad utf-8", make_file("{\"\xff\xfe\": 1}", ""), "not valid JSON");
    expect_error("trailing junk", make_file("{} x", ""), "not valid JSON");
    expect_error("deep", make_file(std::string(100000, '['), ""), "nests more than");
    expect_error("entry not object", make_file(R"({"a": 5})", ""), "tensor \"a\" is a JSON");
  }
  const std::string a_ok = R"("a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]})";
  const std::string bc_ok = R"("b": {"dtype": "I16", "shape": [4], "data_offsets": [24, 32]},)"
                            R"("c": {"dtype": "BOOL", "shape": [3], "data_offsets": [32, 35]})";
  auto with_a = [&](const std::string& a) { return make_file("{" + a + "," + bc_ok + "}", data); };
  REQUIRE(load_error_from_memory(with_a(a_ok), "x").empty());
  SECTION("entry fields") {
    expect_error("no dtype", with_a(R"("a": {"shape": [2, 3], "data_offsets": [0, 24]})"),
                 "has no dtype");
    expect_error("no shape", with_a(R"("a": {"dtype": "F32", "data_offsets": [0, 24]})"),
                 "has no shape");
    expect_error("no offsets", with_a(R"("a": {"dtype": "F32", "shape": [2, 3]})"),
                 "has no data_offsets");
    expect_error("extra key",
                 with_a(R"("a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24], "x": 1})"),
                 "unknown key \"x\"");
    expect_error("dtype type",
                 with_a(R"("a": {"dtype": 4, "shape": [6], "data_offsets": [0, 24]})"),
                 "dtype is a JSON integer");
    expect_error("unknown dtype",
                 with_a(R"("a": {"dtype": "C64", "shape": [3], "data_offsets": [0, 24]})"),
                 "unknown dtype \"C64\"; allowed: F64, F32");
    expect_error("lowercase dtype",
                 with_a(R"("a": {"dtype": "f32", "shape": [6], "data_offsets": [0, 24]})"),
                 "unknown dtype");
    expect_error("shape type",
                 with_a(R"("a": {"dtype": "F32", "shape": "6", "data_offsets": [0, 24]})"),
                 "shape is a JSON string");
    expect_error("negative dim",
                 with_a(R"("a": {"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]})"),
                 "not an integer in [0, 2^63 - 1]");
    expect_error("float dim",
                 with_a(R"("a": {"dtype": "F32", "shape": [6.0], "data_offsets": [0, 24]})"),
                 "not an integer");
    expect_error("dim over int64",
                 with_a(R"("a": {"dtype": "F32", "shape": [9223372036854775808, 0],)"
                        R"( "data_offsets": [0, 0]})"),
                 "not an integer in [0, 2^63 - 1]");
    expect_error("dim over uint64",
                 with_a(R"("a": {"dtype": "F32", "shape": [99999999999999999999999],)"
                        R"( "data_offsets": [0, 24]})"),
                 "not an integer");
    // 2^62 * 4 wraps to 0 in 64-bit arithmetic, which would match an empty span.
    expect_error("product overflow",
                 with_a(R"("a": {"dtype": "F32", "shape": [4611686018427387904, 4],)"
                        R"( "data_offsets": [0, 0]})"),
                 "more than 2^63 - 1 elements");
    expect_error("overflow next to zero",
                 with_a(R"("a": {"dtype": "F32", "shape": [4294967296, 4294967296, 0],)"
                        R"( "data_offsets": [0, 0]})"),
                 "more than 2^63 - 1 elements");
    expect_error("bytes overflow",
                 with_a(R"("a": {"dtype": "F64", "shape": [4611686018427387904],)"
                        R"( "data_offsets": [0, 0]})"),
                 "needs 4611686018427387904 x 8 bytes");
    std::string ones;
    for (int i = 0; i < 65; ++i) ones += "1,";
    expect_error(
        "too many dims",
        with_a(R"("a": {"dtype": "F32", "shape": [)" + ones + R"(6], "data_offsets": [0, 24]})"),
        "shape has 66 dimensions; at most 64");
    expect_error("offsets type",
                 with_a(R"("a": {"dtype": "F32", "shape": [6], "data_offsets": "0-24"})"),
                 "array of two non-negative integers");
    expect_error("offsets length",
                 with_a(R"("a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24, 3]})"),
                 "array of two non-negative integers");
    expect_error("negative offset",
                 with_a(R"("a": {"dtype": "F32", "shape": [6], "data_offsets": [-24, 0]})"),
                 "array of two non-negative integers");
  }
  SECTION("offsets and layout") {
    expect_error("end before begin",
                 with_a(R"("a": {"dtype": "F32", "shape": [0], "data_offsets": [24, 0]})"),
                 "end before they begin");
    expect_error("past the buffer",
                 with_a(R"("a": {"dtype": "F32", "shape": [6], "data_offsets": [100, 124]})"),
                 "run past the 35-byte data buffer");
    expect_error("wrong byte count",
                 with_a(R"("a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 24]})"),
                 "span 24 bytes; shape [2,2] of F32 needs 4 x 4 bytes");
    expect_error("overlap",
                 make_file("{" + a_ok + "," +
                               R"("b": {"dtype": "I16", "shape": [4], "data_offsets": [20, 28]},)"
                               R"("c": {"dtype": "BOOL", "shape": [7], "data_offsets": [28, 35]})" +
                               "}",
                           data),
                 "overlap");
    expect_error("gap",
                 make_file("{" + a_ok + "," +
                               R"("b": {"dtype": "I16", "shape": [4], "data_offsets": [24, 32]},)"
                               R"("c": {"dtype": "BOOL", "shape": [2], "data_offsets": [33, 35]})" +
                               "}",
                           data),
                 "data bytes [32, 33) belong to no tensor");
    expect_error(
        "gap at start",
        make_file(R"({"a": {"dtype": "U8", "shape": [3], "data_offsets": [1, 4]}})", "abcd"),
        "data bytes [0, 1) belong to no tensor");
    expect_error("trailing bytes", make_file("{" + a_ok + "," + bc_ok + "}", data + "xyz"),
                 "the data buffer is 38 bytes but the tensors cover 35");
    expect_error("data without tensors", make_file("{}", "x"), "the data buffer is 1 bytes");
    expect_error(
        "zero-size inside another",
        make_file("{" + a_ok + "," + bc_ok + "," +
                      R"("z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]})" + "}",
                  data),
        "overlap");
  }
  SECTION("names and metadata") {
    expect_error("duplicate name", make_file("{" + a_ok + "," + a_ok + "," + bc_ok + "}", data),
                 "repeats the key \"a\"");
    expect_error("duplicate field",
                 with_a(R"("a": {"dtype": "F32", "dtype": "F32", "shape": [6],)"
                        R"( "data_offsets": [0, 24]})"),
                 "repeats the key \"dtype\"");
    expect_error("metadata not an object",
                 make_file("{\"__metadata__\": [\"k\", \"v\"], " + a_ok + "," + bc_ok + "}", data),
                 "__metadata__ is a JSON array");
    expect_error("metadata value not a string",
                 make_file("{\"__metadata__\": {\"k\": 1}, " + a_ok + "," + bc_ok + "}", data),
                 "__metadata__ value of \"k\" is a JSON integer");
    expect_error("bool byte",
                 make_file("{" + a_ok + "," + bc_ok + "}", data.substr(0, 33) + "\x02" + "\x01"),
                 "BOOL bytes must be 0 or 1");
  }
  SECTION("not a file") {
    std::string missing = dir.file("missing.safetensors");
    CHECK_THAT(load_error(missing), Contains(missing) && Contains("cannot be opened"));
    CHECK_THAT(load_error(dir.path.string()), Contains(dir.path.string()) && Contains("directory"));
    std::string fifo = dir.file("fifo.safetensors");  // must not block waiting for a writer
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK_THAT(load_error(fifo), Contains(fifo) && Contains("not a regular file"));
  }
  SECTION("file shrinks after open") {
    std::string path = dir.file("shrinks.safetensors");
    test::write_file(path, good);
    auto f = SafetensorsFile::open(path);
    fs::resize_file(path, good.size() - 2);
    CHECK_THAT(load_error(path), Contains(path));
    try {
      f.get("c");
      FAIL("no error");
    } catch (const UserError& e) {
      CHECK_THAT(e.what(), Contains(path) && Contains("ended early"));
    }
    CHECK(same_bits(f.get("a"), at::arange(6, at::kFloat).reshape({2, 3})));
  }
}

TEST_CASE("safetensors: valid variations of the format are accepted", "[safetensors]") {
  // Leading whitespace, padding with spaces, null metadata, keys in any order, tensors in the
  // buffer in an order unrelated to their names.
  std::string bytes = make_file(
      " {\"z\": {\"data_offsets\": [0, 2], \"shape\": [], \"dtype\": \"BF16\"},"
      " \"__metadata__\": null, \"a\": {\"dtype\": \"U8\", \"shape\": [1, 2],"
      " \"data_offsets\": [2, 4]}}      ",
      std::string("\x80\x3f\x05\x06", 4));
  auto f = SafetensorsFile::open_from_memory(bytes, "mem");
  REQUIRE(f.entries().size() == 2);
  CHECK(f.entries()[0].name == "z");
  CHECK(f.entries()[1].name == "a");
  CHECK(f.metadata().empty());
  CHECK(f.get("z").item<float>() == 1.0f);
  CHECK(at::equal(f.get("a"), at::tensor({5, 6}, at::kByte).reshape({1, 2})));
}

TEST_CASE("safetensors: the write is atomic and names the path on failure", "[safetensors]") {
  test::TempDir dir("st-write");
  std::string path = dir.file("model.safetensors");
  save_safetensors(path, {{"x", at::ones({2, 2})}});
  save_safetensors(path, {{"x", at::zeros({3})}}, {{"v", "2"}});  // replaces the old file
  std::vector<std::string> names;
  for (auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"model.safetensors"});
  auto f = SafetensorsFile::open(path);
  CHECK(f.metadata().at("v") == "2");
  CHECK(at::equal(f.get("x"), at::zeros({3})));

  std::string nowhere = dir.file("no/such/folder/model.safetensors");
  try {
    save_safetensors(nowhere, {{"x", at::ones({2})}});
    FAIL("no error");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Contains(nowhere) && Contains("No such file or directory"));
  }
  CHECK_FALSE(fs::exists(dir.file("no")));

  // Programming errors are not UserErrors.
  CHECK_THROWS_AS(save_safetensors(path, {{"x", at::ones({1})}, {"x", at::ones({1})}}), c10::Error);
  CHECK_THROWS_AS(save_safetensors(path, {{"c", at::ones({1}, at::kComplexFloat)}}), c10::Error);
  CHECK_THROWS_AS(save_safetensors(path, {{"__metadata__", at::ones({1})}}), c10::Error);
  names.clear();
  for (auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"model.safetensors"});
}
