#include "core/checkpoint/checkpoint.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <regex>

#include "core/base/crc32c.h"
#include "core/base/durable_io.h"
#include "core/base/errors.h"
#include "core/base/log.h"

namespace titan {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string rank_file(int64_t rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05lld.safetensors", static_cast<long long>(rank));
  return buf;
}

json read_json(const fs::path& p) {
  json j = json::parse(read_file(p.string(), "checkpoint file"), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw UserError("checkpoint file '" + p.string() + "': not a JSON object (corrupt?)");
  return j;
}

// CRC32C and size of a whole file, read in 4 MiB pieces.
std::pair<uint32_t, uint64_t> file_crc32c(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw UserError("checkpoint file '" + path + "': cannot be opened");
  std::vector<char> buf(size_t{4} << 20);
  uint32_t crc = 0;
  uint64_t bytes = 0;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0; bytes += n)
    crc = crc32c_extend(crc, buf.data(), n);
  const bool err = std::ferror(f);
  std::fclose(f);
  if (err) throw UserError("checkpoint file '" + path + "': read error");
  return {crc, bytes};
}

// A non-negative integer of metadata.json (below 2^62, so sums and products of two stay in
// int64), or -1.
int64_t meta_count(const json& v) {
  if (v.is_number_unsigned())
    return v.get<uint64_t>() < (uint64_t{1} << 62) ? v.get<int64_t>() : -1;
  if (v.is_number_integer())
    return v.get<int64_t>() >= 0 && v.get<int64_t>() < (int64_t{1} << 62) ? v.get<int64_t>() : -1;
  return -1;
}

// A shard's file name: a plain name inside the step folder, never a path out of it.
bool plain_file_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\0') == std::string::npos;
}

// metadata.json is a file a user can edit or damage: every field the reader relies on is
// checked here once, so that the reader can trust it. Throws UserError naming the file and
// the tensor.
void check_tensor_meta(const std::string& key, const json& t, const std::string& where) {
  auto bad = [&](const std::string& what) {
    throw UserError(where + ": tensor \"" + key + "\" " + what + " (corrupt or edited?)");
  };
  if (!t.is_object() || !t.contains("shape") || !t["shape"].is_array() || !t.contains("shards") ||
      !t["shards"].is_array() || !t.contains("dtype") || !t["dtype"].is_string())
    bad("needs \"shape\" (a list), \"dtype\" (a string) and \"shards\" (a list)");
  int64_t numel = 1;
  for (const json& d : t["shape"]) {
    const int64_t n = meta_count(d);
    if (n < 0 || __builtin_mul_overflow(numel, n, &numel) || numel >= (int64_t{1} << 62))
      bad("has shape " + t["shape"].dump() +
          "; allowed: non-negative sizes, fewer than 2^62 elements");
  }
  const bool scalar = t["shape"].empty();
  const int64_t rows = scalar ? 1 : t["shape"][0].get<int64_t>();
  for (const json& sh : t["shards"]) {
    if (!sh.is_object() || !sh.contains("file") || !sh["file"].is_string() ||
        !plain_file_name(sh["file"].get<std::string>()) || !sh.contains("key") ||
        !sh["key"].is_string() || !sh.contains("dim0_offset") || !sh.contains("dim0_rows"))
      bad("has shard " + sh.dump() +
          "; allowed: {\"file\": a file name in the folder, \"key\", \"dim0_offset\", "
          "\"dim0_rows\"}");
    const int64_t off = meta_count(sh["dim0_offset"]), n = meta_count(sh["dim0_rows"]);
    if (off < 0 || n < 0 || off + n > rows || (scalar && (off != 0 || n != 1)))
      bad("has shard " + sh.dump() + " outside its " + std::to_string(rows) + " rows");
  }
}

void check_metadata(const json& meta, const std::string& path) {
  const std::string where = "checkpoint file '" + path + "'";
  if (!meta.contains("tensors") || !meta["tensors"].is_object())
    throw UserError(where + ": has no \"tensors\" map");
  for (auto& [key, t] : meta["tensors"].items()) check_tensor_meta(key, t, where);
  if (!meta.contains("files")) return;  // checkpoints written before the CRCs
  if (!meta["files"].is_object())
    throw UserError(where + ": \"files\" is not a map of file name to CRC (corrupt or edited?)");
  for (auto& [name, f] : meta["files"].items())
    if (!plain_file_name(name) || !f.is_object() || !f.contains("crc32c") || !f.contains("bytes") ||
        meta_count(f["crc32c"]) < 0 || meta_count(f["crc32c"]) > 0xffffffffll ||
        meta_count(f["bytes"]) < 0)
      throw UserError(
          where + ": \"files\" entry \"" + name + "\" is " + f.dump() +
          "; allowed: {\"crc32c\": a 32-bit count, \"bytes\": a count} (corrupt or edited?)");
}

}  // namespace

// ---- Writing -------------------------------------------------------------------------------

CheckpointWriter::CheckpointWriter(std::string root, CheckpointGroup group, int64_t world_size,
                                   int64_t keep_latest_k)
    : root_(std::move(root)),
      group_(std::move(group)),
      world_(world_size),
      keep_latest_k_(keep_latest_k) {}

CheckpointWriter::~CheckpointWriter() {
  if (writer_.joinable()) writer_.join();
}

std::vector<int64_t> CheckpointWriter::complete_steps(const std::string& root) {
  std::vector<int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return steps;
  static const std::regex re("^step-([0-9]+)$");
  for (auto& e : fs::directory_iterator(root, ec)) {
    std::smatch m;
    std::string name = e.path().filename().string();
    if (!e.is_directory() || !std::regex_match(name, m, re)) continue;
    // The rename makes a folder complete; the marker files are a second guard.
    if (fs::exists(e.path() / "metadata.json") && fs::exists(e.path() / "train_state.json"))
      steps.push_back(std::stoll(m[1]));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

void CheckpointWriter::write(const CheckpointSnapshot& s) {
  const fs::path final_dir = fs::path(root_) / ("step-" + std::to_string(s.step));
  const fs::path tmp =
      fs::path(root_) / ("step-" + std::to_string(s.step) + ".tmp-" + group_.token);
  const std::string key = "checkpoint/step-" + std::to_string(s.step);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) return;  // this step is already saved and complete
  auto fail = [&](const std::string& why) {
    if (group_.counter) group_.counter(key + "/failed", 1);
    if (group_.rank == 0) fs::remove_all(tmp, ec);
    auto prev = complete_steps(root_);
    std::string kept =
        prev.empty() ? "there is no earlier checkpoint"
                     : "the previous checkpoint step-" + std::to_string(prev.back()) + " is kept";
    throw UserError("checkpoint save of step " + std::to_string(s.step) + " to '" + tmp.string() +
                    "' failed" + (world_ > 1 ? " on rank " + std::to_string(group_.rank) : "") +
                    ": " + why + "; " + kept);
  };
  try {
    if (s.ready) s.ready();
    if (!s.entries.empty()) {
      fs::create_directories(tmp);
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      json part = json::object();
      for (auto& e : s.entries) {
        tensors.emplace_back(e.key, e.t);
        part[e.key] = {{"shape", e.global_shape},
                       {"dtype", std::string(c10::toString(e.t.scalar_type()))},
                       {"dim0_offset", e.dim0_offset},
                       {"dim0_rows", e.t.dim() == 0 ? 1 : e.t.size(0)}};
      }
      const std::string file = (tmp / rank_file(group_.rank)).string();
      save_safetensors(file, tensors, {{"format", "titan-train checkpoint 1"}});
      // The file's CRC32C, read back from the page cache: a later load names a damaged shard.
      const auto [crc, bytes] = file_crc32c(file);
      json doc = {{"tensors", part}, {"crc32c", crc}, {"bytes", bytes}};
      write_file_durable((tmp / (rank_file(group_.rank) + ".json")).string(), doc.dump());
    }
    if (group_.counter && group_.writes) group_.counter(key + "/written", 1);
    if (group_.rank == 0) finalize(tmp.string(), s);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  if (group_.rank == 0) {
    log_info("checkpoint: saved step " + std::to_string(s.step) + " to " + final_dir.string());
    prune();
  }
}

void CheckpointWriter::finalize(const std::string& tmp_dir, const CheckpointSnapshot& s) {
  const fs::path tmp(tmp_dir);
  const fs::path final_dir = fs::path(root_) / ("step-" + std::to_string(s.step));
  const std::string key = "checkpoint/step-" + std::to_string(s.step);
  if (group_.counter) {  // wait for every writer's file
    const auto deadline = std::chrono::steady_clock::now() + group_.timeout;
    while (group_.counter(key + "/written", 0) < group_.writers) {
      if (group_.counter(key + "/failed", 0) > 0)
        throw std::runtime_error("another rank failed to write its shards");
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("timed out waiting for the other ranks' shards");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // Merge the per-rank parts into metadata.json.
  json meta;
  meta["format"] = 1;
  meta["world_size"] = world_;
  json& tensors = meta["tensors"];
  tensors = json::object();
  json& files = meta["files"];
  files = json::object();
  std::vector<fs::path> parts;
  for (auto& e : fs::directory_iterator(tmp))
    if (e.path().extension() == ".json" && e.path().filename().string().rfind("rank-", 0) == 0)
      parts.push_back(e.path());
  std::sort(parts.begin(), parts.end());
  for (auto& pp : parts) {
    json doc = read_json(pp);
    const std::string file = pp.stem().string();  // rank-RRRRR.safetensors
    files[file] = {{"crc32c", doc["crc32c"]}, {"bytes", doc["bytes"]}};
    for (auto& [name, e] : doc["tensors"].items()) {
      json& t = tensors[name];
      if (!t.contains("shape")) {
        t["shape"] = e["shape"];
        t["dtype"] = e["dtype"];
        t["shards"] = json::array();
      }
      t["shards"].push_back({{"file", file},
                             {"key", name},
                             {"dim0_offset", e["dim0_offset"]},
                             {"dim0_rows", e["dim0_rows"]}});
    }
  }
  write_file_durable((tmp / "metadata.json").string(), meta.dump(1));
  write_file_durable((tmp / "train_state.json").string(), s.train_state_json);
  for (auto& pp : parts) fs::remove(pp);
  if (test_delay_ms_ > 0)  // debug.checkpoint_delay_ms: a slow disk
    std::this_thread::sleep_for(std::chrono::milliseconds(test_delay_ms_));
  fsync_dir(tmp.string());
  fs::rename(tmp, final_dir);
  fsync_dir(root_);
}

void CheckpointWriter::prune() {
  const int64_t k = keep_latest_k_;
  if (k <= 0) return;
  auto steps = complete_steps(root_);
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(k) < steps.size(); ++i)
    fs::remove_all(fs::path(root_) / ("step-" + std::to_string(steps[i])), ec);
}

void CheckpointWriter::save(CheckpointSnapshot s, bool async) {
  wait();
  if (!async) {
    write(s);
    return;
  }
  // The write (and any copy still in flight) overlaps the next steps.
  writer_ = std::thread([this, s = std::move(s)]() {
    try {
      write(s);
    } catch (...) {
      writer_error_ = std::current_exception();
    }
  });
}

void CheckpointWriter::wait() {
  if (writer_.joinable()) writer_.join();
  if (writer_error_) {
    auto e = writer_error_;
    writer_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

// ---- Reading -------------------------------------------------------------------------------

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  const fs::path d(dir_);
  meta_ = read_json(d / "metadata.json");
  train_state_ = read_json(d / "train_state.json");
  check_metadata(meta_, (d / "metadata.json").string());
}

bool CheckpointReader::contains(const std::string& key) const {
  return meta_["tensors"].contains(key);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> CheckpointReader::keys(
    const std::string& prefix) const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (auto& [k, v] : meta_["tensors"].items())
    if (k.rfind(prefix, 0) == 0) out.emplace_back(k, v["shape"].get<std::vector<int64_t>>());
  return out;
}

SafetensorsFile& CheckpointReader::file(const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return it->second;
  const std::string path = (fs::path(dir_) / name).string();
  if (meta_.contains("files") && meta_["files"].contains(name)) {
    const json& want = meta_["files"][name];
    const auto [crc, bytes] = file_crc32c(path);
    if (crc != want["crc32c"].get<uint32_t>() || bytes != want["bytes"].get<uint64_t>()) {
      char got[64], rec[64];
      std::snprintf(got, sizeof got, "CRC32C %08x, %llu bytes", crc,
                    static_cast<unsigned long long>(bytes));
      std::snprintf(rec, sizeof rec, "CRC32C %08x, %llu bytes", want["crc32c"].get<uint32_t>(),
                    static_cast<unsigned long long>(want["bytes"].get<uint64_t>()));
      throw UserError("checkpoint '" + dir_ + "': shard " + name + " is corrupt: it has " + got +
                      " but metadata.json recorded " + rec + " when it was saved");
    }
  }
  return files_.emplace(name, SafetensorsFile::open(path)).first->second;
}

std::optional<std::pair<at::Tensor, std::vector<int64_t>>> CheckpointReader::fetch_rows(
    const std::string& key, int64_t begin, int64_t count) {
  if (!contains(key)) return std::nullopt;
  const json& e = meta_["tensors"][key];
  auto shape = e["shape"].get<std::vector<int64_t>>();
  const int64_t rows = shape.empty() ? 1 : shape[0];
  if (count < 0) count = rows - begin;
  if (count == 0 && !shape.empty()) {  // no rows of this tensor on this rank
    std::vector<int64_t> empty_shape = shape;
    empty_shape[0] = 0;
    return std::make_pair(at::empty(empty_shape), shape);
  }
  std::vector<std::pair<int64_t, at::Tensor>> parts;
  int64_t covered = 0;
  for (auto& sh : e["shards"]) {
    const int64_t off = sh["dim0_offset"].get<int64_t>(), n = sh["dim0_rows"].get<int64_t>();
    const int64_t lo = std::max(off, begin), hi = std::min(off + n, begin + count);
    if (lo >= hi) continue;
    at::Tensor t = file(sh["file"].get<std::string>()).get(sh["key"].get<std::string>());
    const int64_t got = t.dim() == 0 ? 1 : t.size(0);
    if ((t.dim() == 0) != shape.empty() ||
        (!shape.empty() &&
         !std::equal(shape.begin() + 1, shape.end(), t.sizes().begin() + 1, t.sizes().end())))
      throw UserError("checkpoint '" + dir_ + "': shard " + sh["key"].get<std::string>() + " in " +
                      sh["file"].get<std::string>() + " has shape " + shape_str(t.sizes()) +
                      " but metadata.json says rows of " + shape_str(shape) + " for " + key);
    if (got != n)
      throw UserError("checkpoint '" + dir_ + "': shard " + sh["key"].get<std::string>() + " in " +
                      sh["file"].get<std::string>() + " has " + std::to_string(got) +
                      " rows but metadata.json says " + std::to_string(n));
    if (shape.empty()) return std::make_pair(t, shape);
    parts.emplace_back(lo, t.narrow(0, lo - off, hi - lo));
    covered += hi - lo;
  }
  if (covered != count)
    throw UserError("checkpoint '" + dir_ + "': the shards of " + key + " cover " +
                    std::to_string(covered) + " of rows [" + std::to_string(begin) + ", " +
                    std::to_string(begin + count) + ") (a missing or corrupt rank file?)");
  std::sort(parts.begin(), parts.end(), [](auto& a, auto& b) { return a.first < b.first; });
  std::vector<at::Tensor> ts;
  for (auto& p : parts) ts.push_back(p.second);
  return std::make_pair(ts.size() == 1 ? ts[0] : at::cat(ts, 0), shape);
}

bool CheckpointReader::restore_rows(const std::string& key, const std::vector<int64_t>& want,
                                    int64_t begin, int64_t rows, at::Tensor dst, bool required) {
  at::NoGradGuard ng;
  auto r = fetch_rows(key, begin, rows);
  if (!r) {
    if (required)
      throw UserError("checkpoint '" + dir_ + "': no tensor " + key +
                      "; the model expects one of shape " + shape_str(want) +
                      " (was it saved with another model config?)");
    return false;
  }
  if (r->second != want)
    throw UserError("checkpoint '" + dir_ + "': tensor " + key + " has shape " +
                    shape_str(r->second) + " but the model expects " + shape_str(want) +
                    " (a different model config?)");
  dst.copy_(r->first);
  return true;
}

std::optional<at::Tensor> CheckpointReader::get(const std::string& key) {
  auto r = fetch_rows(key, 0, -1);
  if (!r) return std::nullopt;
  return r->first;
}

}  // namespace titan
