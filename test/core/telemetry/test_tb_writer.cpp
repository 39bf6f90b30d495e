// TensorBoard event files: CRC32C against published vectors, the exact bytes against Python
// protobuf's, and a read-back through TensorBoard's own event loader.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/base/crc32c.h"
#include "core/base/errors.h"
#include "core/telemetry/tb_writer.h"
#include "test_util.h"

using namespace titan;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string r;
  for (unsigned char c : bytes) {
    r += digits[c >> 4];
    r += digits[c & 15];
  }
  return r;
}

// The textbook one-bit-at-a-time CRC32C, to check the table-driven one against.
uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : s) {
    crc ^= c;
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0);
  }
  return ~crc;
}

// Reads an event folder back with TensorBoard. The CRCs are checked here with a bitwise
// CRC32C of the snippet's own, because TensorBoard's loader logs and skips a corrupt record
// instead of failing. Prints "RESULT {json}".
const char* kReadBackPy = R"PY(
import json, os, struct, sys
from tensorboard.compat.proto import event_pb2
from tensorboard.backend.event_processing import event_accumulator

def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF

def masked(c):
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

folder = sys.argv[1]
files = [f for f in os.listdir(folder) if f.startswith("events.out.tfevents.")]
assert len(files) == 1, files
raw = open(os.path.join(folder, files[0]), "rb").read()
pos, events = 0, []
while pos < len(raw):
    header = raw[pos : pos + 8]
    (n,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack("<I", raw[pos + 8 : pos + 12])
    if hcrc != masked(crc32c(header)):
        sys.exit("header crc mismatch at %d" % pos)
    data = raw[pos + 12 : pos + 12 + n]
    tail = raw[pos + 12 + n : pos + 16 + n]
    if len(data) != n or len(tail) != 4 or struct.unpack("<I", tail)[0] != masked(crc32c(data)):
        sys.exit("data crc mismatch at %d" % pos)
    events.append(event_pb2.Event.FromString(data))
    pos += 16 + n
assert events[0].file_version == "brain.Event:2", events[0]
acc = event_accumulator.EventAccumulator(folder)
acc.Reload()
scalars = {t: [[s.step, s.value, s.wall_time] for s in acc.Scalars(t)]
           for t in acc.Tags()["scalars"]}
print("RESULT " + json.dumps({"records": len(events), "scalars": scalars}))
)PY";

test::CmdResult read_back(const test::TempDir& scratch, const std::string& folder) {
  std::string script = scratch.file("read_back.py");
  test::write_file(script, kReadBackPy);
  return test::run(test::shell_quote(test::python()) + " " + test::shell_quote(script) + " " +
                   test::shell_quote(folder));
}

nlohmann::json result_json(const std::string& out) {
  auto at = out.rfind("RESULT ");
  REQUIRE(at != std::string::npos);
  return nlohmann::json::parse(out.substr(at + 7, out.find('\n', at) - at - 7));
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

}  // namespace

TEST_CASE("tensorboard: crc32c matches the published check values", "[tensorboard]") {
  CHECK(crc32c(std::string("123456789")) == 0xE3069283u);
  CHECK(crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  CHECK(crc32c(std::string(32, '\xff')) == 0x62A8AB43u);  // RFC 3720 B.4
  CHECK(crc32c(std::string()) == 0u);
  // The masked CRC of the 8-byte length 24, as tensorboard's record writer frames it.
  std::string len24("\x18\0\0\0\0\0\0\0", 8);
  CHECK(crc32c_mask(crc32c(len24)) == 0x224B7FA3u);
}

TEST_CASE("tensorboard: slicing-by-8 crc32c equals the bitwise one at every length and offset",
          "[tensorboard]") {
  std::string data;
  uint32_t x = 12345;
  for (int i = 0; i < 300; ++i) {
    x = x * 1103515245u + 12345u;
    data += char(x >> 24);
  }
  for (size_t off = 0; off < 8; ++off) {
    for (size_t n = 0; off + n <= data.size(); n += (n < 40 ? 1 : 37)) {
      std::string s = data.substr(off, n);
      INFO("offset " << off << " length " << n);
      REQUIRE(crc32c(s) == crc32c_bitwise(s));
      // Extending in two pieces gives the CRC of the whole.
      size_t cut = n / 3;
      REQUIRE(crc32c_extend(crc32c(s.data(), cut), s.data() + cut, n - cut) == crc32c(s));
    }
  }
}

TEST_CASE("tensorboard: event file bytes equal Python protobuf's", "[tensorboard]") {
  // Generated once with tensorboard 2.21 / protobuf 7.36 (the test venv), independently of
  // the C++ encoder: each Event built with tensorboard.compat.proto.event_pb2, serialized with
  // SerializeToString() and framed by tensorboard.summary.writer.record_writer.RecordWriter
  // into an io.BytesIO, then printed with .hex():
  //   Event(wall_time=1700000000.25, file_version="brain.Event:2")
  //   Event(wall_time=1700000000.25, step=42), summary.value.add(tag="loss/train",
  //       simple_value=3.14159)
  //   Event(wall_time=1700000001.5, step=0),   summary.value.add(tag="lr", simple_value=0.0)
  //   Event(wall_time=1700000001.5, step=-3),  summary.value.add(tag="x", simple_value=-1.5)
  const std::string file_version =
      "1800000000000000a37f4b220900001040fc54d9411a0d627261696e2e4576656e743a32338d2fe9";
  const std::string loss =
      "200000000000000029eda9500900001040fc54d941102a2a130a110a0a6c6f73732f747261696e15d00f4940"
      "4664471b";
  // proto3 omits step 0 but always writes a oneof member, so simple_value 0.0 stays.
  const std::string step0 =
      "16000000000000004f61be280900006040fc54d9412a0b0a090a026c721500000000d5013b37";
  // A negative int64 is a ten-byte varint.
  const std::string negative_step =
      "200000000000000029eda9500900006040fc54d94110fdffffffffffffffff012a0a0a080a0178150000c0bf"
      "5beafe38";

  test::TempDir dir("tb-golden");
  std::string path;
  {
    TensorBoardWriter w(dir.path.string(), "events.out.tfevents.golden", 1700000000.25);
    path = w.path();
    w.flush();
    CHECK(hex(test::read_file(path)) == file_version);
    w.add_scalar("loss/train", 3.14159, 42, 1700000000.25);
    w.add_scalar("lr", 0.0, 0, 1700000001.5);
    w.add_scalar("x", -1.5, -3, 1700000001.5);
  }  // the destructor flushes
  CHECK(path == dir.file("events.out.tfevents.golden"));
  std::string got = hex(test::read_file(path));
  size_t at = 0;
  for (const std::string* want : {&file_version, &loss, &step0, &negative_step}) {
    CHECK(got.substr(at, want->size()) == *want);
    at += want->size();
  }
  CHECK(got.size() == at);
}

TEST_CASE("tensorboard: scalars read back through TensorBoard's event accumulator",
          "[tensorboard]") {
  test::TempDir dir("tb-read");
  std::string folder = dir.file("runs/nested");  // created by the writer
  const std::vector<int64_t> steps = {1, 2, 3, 10, 250};
  auto loss_at = [](int64_t s) { return 10.0 / double(s + 1) + 0.123456789; };
  auto lr_at = [](int64_t s) { return 3e-4 * double(s) / 7.0; };
  double before = now_seconds();
  std::string name;
  {
    TensorBoardWriter w(folder);
    name = fs::path(w.path()).filename().string();
    for (int64_t s : steps) {
      w.add_scalar("loss/train", loss_at(s), s);
      w.add_scalar("lr", lr_at(s), s);
    }
    w.flush();
  }
  double after = now_seconds();

  INFO(name);
  std::smatch m;
  REQUIRE(
      std::regex_match(name, m, std::regex(R"(events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.titan)")));
  CHECK(std::stoll(m[1]) >= int64_t(before) - 1);
  CHECK(std::stoll(m[1]) <= int64_t(after) + 1);
  CHECK(std::stoll(m[3]) == ::getpid());

  auto r = read_back(dir, folder);
  INFO(r.out);
  REQUIRE(r.rc == 0);
  auto j = result_json(r.out);
  CHECK(j["records"] == 1 + 2 * steps.size());
  auto& scalars = j["scalars"];
  REQUIRE(scalars.size() == 2);
  for (auto [tag, fn] : {std::pair<std::string, double (*)(int64_t)>{"loss/train", +loss_at},
                         std::pair<std::string, double (*)(int64_t)>{"lr", +lr_at}}) {
    INFO(tag);
    REQUIRE(scalars.contains(tag));
    auto& got = scalars[tag];
    REQUIRE(got.size() == steps.size());
    for (size_t i = 0; i < steps.size(); ++i) {
      CHECK(got[i][0].get<int64_t>() == steps[i]);
      // float32 on disk: exactly the float rounding of what was logged.
      CHECK(got[i][1].get<double>() == double(static_cast<float>(fn(steps[i]))));
      double wall = got[i][2].get<double>();
      CHECK(wall >= before - 1);
      CHECK(wall <= after + 1);
    }
  }
}

TEST_CASE("tensorboard: the read-back check rejects a corrupted record", "[tensorboard]") {
  test::TempDir dir("tb-corrupt");
  std::string path;
  {
    TensorBoardWriter w(dir.path.string(), "events.out.tfevents.corrupt", 1700000000.25);
    w.add_scalar("loss", 1.0, 1, 1700000000.5);
    path = w.path();
  }
  REQUIRE(read_back(dir, dir.path.string()).rc == 0);
  std::string bytes = test::read_file(path);
  bytes[bytes.size() - 6] ^= 0x01;  // inside the scalar event's data (the float)
  test::write_file(path, bytes);
  auto r = read_back(dir, dir.path.string());
  INFO(r.out);
  CHECK(r.rc != 0);
  CHECK_THAT(r.out, Contains("data crc mismatch"));
}

TEST_CASE("tensorboard: an unusable folder is a UserError naming the path", "[tensorboard]") {
  test::TempDir dir("tb-error");
  std::string blocker = dir.file("not_a_folder");
  test::write_file(blocker, "x");
  std::string folder = blocker + "/runs";
  try {
    TensorBoardWriter w(folder);
    FAIL("no error for " << folder);
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Contains(folder));
  }
  try {
    TensorBoardWriter w(blocker);
    FAIL("no error for " << blocker);
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Contains(blocker));
  }
}
