#include "models/hf_interop.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

#include "core/base/durable_io.h"
#include "core/base/strings.h"
#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/checkpoint/safetensors.h"
#include "models/hf_fp8.h"
#include "models/hf_interop_detail.h"

namespace titan {

namespace fs = std::filesystem;

namespace hf_detail {

std::string strip_slashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

NamedTensors named(const ParamStore& params) {
  NamedTensors r;
  for (auto& p : params.all()) r.emplace_back(p.name, p.value);
  return r;
}

const char* hf_dtype_name(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
}

void add_hf_swiglu(std::vector<HfTensorMap>& m, const std::string& ours, const std::string& hf) {
  m.push_back({ours + "w1.weight", {hf + "gate_proj.weight"}, HfTransform::kNone, 0});
  m.push_back({ours + "w2.weight", {hf + "down_proj.weight"}, HfTransform::kNone, 0});
  m.push_back({ours + "w3.weight", {hf + "up_proj.weight"}, HfTransform::kNone, 0});
}

// `dir`/config.json as an object, or null when the folder (import_hf reports that) or the file
// is missing (warned with `missing_means`). Unreadable JSON is a UserError.
nlohmann::ordered_json read_hf_config(const std::string& dir_arg,
                                      const std::string& missing_means) {
  const std::string dir = strip_slashes(dir_arg);
  const std::string path = dir + "/config.json";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return nullptr;
  if (!fs::exists(path, ec)) {
    log_warn(path + " is missing: " + missing_means);
    return nullptr;
  }
  const std::string text = read_file(path, "Hugging Face config");
  nlohmann::ordered_json cfg;
  try {
    cfg = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw UserError(path + ": not valid JSON: " + e.what());
  }
  if (!cfg.is_object()) throw UserError(path + ": found " + cfg.dump() + "; expected an object");
  return cfg;
}

// Each of `keys` that config.json sets (not null) must equal `want`'s value.
void require_same_fields(const nlohmann::ordered_json& cfg, const nlohmann::ordered_json& want,
                         std::initializer_list<const char*> keys, const std::string& path) {
  for (const char* key : keys) {
    if (cfg.contains(key) && !cfg[key].is_null() && cfg[key] != want[key])
      throw UserError(path + ": " + key + " = " + cfg[key].dump() + "; this model has " +
                      want[key].dump() + " (wrong flavor?)");
  }
}

namespace {

bool json_number(const nlohmann::ordered_json& cfg, const char* key, double& out) {
  if (!cfg.contains(key) || !cfg[key].is_number()) return false;
  out = cfg[key].get<double>();
  return true;
}

// rope_theta, top-level (transformers 4) or in rope_parameters (transformers 5).
bool json_rope_theta(const nlohmann::ordered_json& cfg, double& out) {
  return json_number(cfg, "rope_theta", out) ||
         (cfg.contains("rope_parameters") && cfg["rope_parameters"].is_object() &&
          json_number(cfg["rope_parameters"], "rope_theta", out));
}

}  // namespace

void warn_rope_theta_and_eps(const nlohmann::ordered_json& cfg, double rope_theta, double eps,
                             const std::string& path) {
  double theta = 0, e = 0;
  if (json_rope_theta(cfg, theta) && std::abs(theta - rope_theta) > 1e-9 * rope_theta)
    log_warn(path + ": rope_theta = " + std::to_string(theta) + " but this model uses " +
             std::to_string(rope_theta));
  if (json_number(cfg, "rms_norm_eps", e) && std::abs(e - eps) > 1e-9 * eps)
    log_warn(path + ": rms_norm_eps = " + cfg["rms_norm_eps"].dump() + " but this model uses " +
             nlohmann::ordered_json(eps).dump());
}

}  // namespace hf_detail

using namespace hf_detail;

namespace {

// The shape each HF tensor of `m` has when ours has shape `ours`.
std::vector<int64_t> hf_shape(const HfTensorMap& m, at::IntArrayRef ours) {
  if (m.transform == HfTransform::kSplitExperts) return {ours.begin() + 1, ours.end()};
  return ours.vec();
}

// transformers checkpoints of older versions carry the rotary tables as buffers; they are
// recomputed from config.json, so they are skipped rather than reported as unexpected.
bool ignorable_hf_tensor(const std::string& name) {
  return ends_with(name, "rotary_emb.inv_freq");
}

std::string shard_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

// Pairs each map entry with its target; every target must be mapped and every entry present.
std::vector<const HfImportTarget*> match_targets(const HfImportTargets& targets,
                                                 const std::vector<HfTensorMap>& map) {
  std::map<std::string, const HfImportTarget*> by_name;
  for (auto& t : targets) {
    TORCH_CHECK(by_name.emplace(t.name, &t).second, "hf interop: tensor '", t.name,
                "' given twice");
    if (t.dst.is_meta()) continue;  // another pipeline stage's: checked in the folder, not read
    // dst must be a run of whole rows of full_shape.
    const int64_t dims = static_cast<int64_t>(t.full_shape.size());
    TORCH_CHECK(t.dst.dim() == dims, "hf interop: '", t.name, "' has ", t.dst.dim(),
                " dims but its full shape ", shape_str(t.full_shape), " has ", dims);
    if (dims > 0) {
      TORCH_CHECK(t.dst.sizes().slice(1).vec() ==
                          std::vector<int64_t>(t.full_shape.begin() + 1, t.full_shape.end()) &&
                      t.row_offset >= 0 && t.row_offset + t.dst.size(0) <= t.full_shape[0],
                  "hf interop: '", t.name, "' rows ", shape_str(t.dst.sizes()), " at offset ",
                  t.row_offset, " do not fit its full shape ", shape_str(t.full_shape));
    }
  }
  std::vector<const HfImportTarget*> out;
  for (auto& m : map) {
    auto it = by_name.find(m.ours);
    TORCH_CHECK(it != by_name.end(), "hf interop: the map names '", m.ours,
                "' but the model has no such tensor");
    const std::vector<int64_t>& full = it->second->full_shape;
    if (m.transform == HfTransform::kSplitExperts) {
      TORCH_CHECK(!full.empty() && full[0] == static_cast<int64_t>(m.hf.size()), "hf interop: '",
                  m.ours, "' has shape ", shape_str(full), " but the map splits it into ",
                  m.hf.size(), " experts");
    }
    out.push_back(it->second);
    by_name.erase(it);
  }
  TORCH_CHECK(by_name.empty(), "hf interop: tensor '",
              by_name.empty() ? std::string() : by_name.begin()->first,
              "' has no Hugging Face name in the map");
  return out;
}

std::vector<at::Tensor> match_tensors(const NamedTensors& tensors,
                                      const std::vector<HfTensorMap>& map) {
  const HfImportTargets targets = hf_targets(tensors);
  std::vector<at::Tensor> out;
  for (const HfImportTarget* t : match_targets(targets, map)) out.push_back(t->dst);
  return out;
}

}  // namespace

at::ScalarType hf_export_dtype(const std::string& name, const std::string& what) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw UserError(what + " = \"" + name +
                  "\" is not supported; allowed: float32, bfloat16, float16");
}

void validate_hf_map(const std::vector<HfTensorMap>& map) {
  std::set<std::string> ours, hf;
  for (auto& m : map) {
    TORCH_CHECK(ours.insert(m.ours).second, "hf map: '", m.ours, "' mapped twice");
    TORCH_CHECK(!m.hf.empty(), "hf map: '", m.ours, "' has no HF name");
    TORCH_CHECK(m.transform == HfTransform::kSplitExperts || m.hf.size() == 1, "hf map: '", m.ours,
                "' has several HF names but is not split into experts");
    TORCH_CHECK(m.transform != HfTransform::kRopePermute || m.rope_heads > 0, "hf map: '", m.ours,
                "' needs rope_heads");
    for (auto& h : m.hf) TORCH_CHECK(hf.insert(h).second, "hf map: HF name '", h, "' used twice");
  }
}

std::vector<at::Tensor> to_hf_layout(const HfTensorMap& m, const at::Tensor& ours) {
  switch (m.transform) {
    case HfTransform::kNone:
      return {ours};
    case HfTransform::kRopePermute: {
      const int64_t rows = ours.size(0), cols = ours.size(1), h = m.rope_heads;
      TORCH_CHECK(rows % (2 * h) == 0, "hf interop: '", m.ours, "' rows ", rows,
                  " do not split into ", h, " heads of even size");
      // Within each head, row 2i (the real part of pair i) goes to i and row 2i+1 (the
      // imaginary part) to i + head_dim/2: HF's rotate_half layout.
      return {ours.reshape({h, rows / h / 2, 2, cols}).transpose(1, 2).reshape({rows, cols})};
    }
    case HfTransform::kSplitExperts: {
      std::vector<at::Tensor> r;
      for (int64_t e = 0; e < ours.size(0); ++e) r.push_back(ours.select(0, e));
      return r;
    }
  }
  TORCH_CHECK(false, "unreachable");
}

at::Tensor from_hf_layout(const HfTensorMap& m, const std::vector<at::Tensor>& hf) {
  switch (m.transform) {
    case HfTransform::kNone:
      return hf.at(0);
    case HfTransform::kRopePermute: {
      const at::Tensor& w = hf.at(0);
      const int64_t rows = w.size(0), cols = w.size(1), h = m.rope_heads;
      return w.reshape({h, 2, rows / h / 2, cols}).transpose(1, 2).reshape({rows, cols});
    }
    case HfTransform::kSplitExperts:
      return at::stack(hf, 0);
  }
  TORCH_CHECK(false, "unreachable");
}

// ---- Export ---------------------------------------------------------------------------------

void export_hf(const NamedTensors& tensors, const std::vector<HfTensorMap>& map,
               const nlohmann::ordered_json& config, const std::string& dir_arg,
               const HfExportOptions& opts) {
  validate_hf_map(map);
  TORCH_CHECK(opts.dtype == at::kFloat || opts.dtype == at::kBFloat16 || opts.dtype == at::kHalf,
              "export_hf: dtype must be float32, bfloat16 or float16");
  TORCH_CHECK(opts.max_shard_bytes > 0, "export_hf: max_shard_bytes must be positive");
  const std::vector<at::Tensor> ours = match_tensors(tensors, map);

  // "out/" and "out" name the same folder, and the temp folder is its sibling.
  const std::string dir = strip_slashes(dir_arg);
  if (dir.empty()) throw UserError("export to Hugging Face: the output folder name is empty");
  std::error_code ec;
  const bool exists = fs::exists(dir, ec);
  if (exists) {
    if (!fs::is_directory(dir, ec))
      throw UserError("export to Hugging Face: " + dir + " exists and is not a folder");
    if (!fs::is_empty(dir, ec))
      throw UserError("export to Hugging Face: refusing to overwrite the non-empty folder " + dir +
                      "; remove it or choose another output folder");
  }

  // One item per HF tensor, in map order; shards are filled greedily in that order.
  struct Item {
    size_t entry;
    size_t k;  // index into map[entry].hf
  };
  auto out_dtype = [&](const HfTensorMap& m) { return m.keep_fp32 ? at::kFloat : opts.dtype; };
  std::vector<std::vector<Item>> shards;
  int64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < map.size(); ++i) {
    const std::vector<int64_t> shape = hf_shape(map[i], ours[i].sizes());
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    for (size_t k = 0; k < map[i].hf.size(); ++k) {
      const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(out_dtype(map[i])));
      if (shards.empty() || (shard_bytes > 0 && shard_bytes + bytes > opts.max_shard_bytes)) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().push_back({i, k});
      shard_bytes += bytes;
      total_bytes += bytes;
    }
  }

  const std::string tmp = dir + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) || ec)
    throw UserError("export to Hugging Face: cannot create " + tmp + ": " + ec.message());
  try {
    at::NoGradGuard ng;
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    std::vector<std::pair<std::string, std::string>> placement;  // hf name -> shard file
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string file = shard_name(s + 1, shards.size());
      NamedTensors out;
      for (const Item& it : shards[s]) {
        const HfTensorMap& m = map[it.entry];
        // Cast on the tensor's device first so only the exported dtype crosses to the host.
        at::Tensor t = to_hf_layout(m, ours[it.entry].detach())[it.k];
        out.emplace_back(m.hf[it.k], t.to(out_dtype(m)).to(at::kCPU).contiguous());
        placement.emplace_back(m.hf[it.k], file);
      }
      save_safetensors(tmp + "/" + file, out, {{"format", "pt"}});
    }
    std::sort(placement.begin(), placement.end());
    for (auto& [name, file] : placement) weight_map[name] = file;
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total_bytes}}},
                                    {"weight_map", weight_map}};
    write_file_durable(tmp + "/model.safetensors.index.json", index.dump(2) + "\n");
    write_file_durable(tmp + "/config.json", config.dump(2) + "\n");
    fsync_dir(tmp);
    if (exists) fs::remove(dir, ec);  // empty: checked above
    fs::rename(tmp, dir, ec);
    if (ec)
      throw UserError("export to Hugging Face: cannot rename " + tmp + " to " + dir + ": " +
                      ec.message());
    fsync_dir(fs::absolute(dir).parent_path().string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

void export_hf(const ParamStore& params, const std::vector<HfTensorMap>& map,
               const nlohmann::ordered_json& config, const std::string& dir,
               const HfExportOptions& opts) {
  export_hf(named(params), map, config, dir, opts);
}

// ---- Import ---------------------------------------------------------------------------------

namespace {

// The tensors of an HF folder and which file holds each.
struct HfFolder {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, const SafetensorsFile*> where;
  // Set by check_hf_folder when mapped tensors are block-wise float8 (models/hf_fp8.h).
  std::optional<HfFp8Blocks> fp8;
  int64_t fp8_tensors = 0;
};

HfFolder open_hf_folder(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw UserError("Hugging Face folder " + dir + " does not exist or is not a folder");
  HfFolder f;
  auto add_file = [&](const std::string& path) {
    f.files.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(path)));
    const SafetensorsFile* sf = f.files.back().get();
    for (auto& e : sf->entries()) {
      auto [it, fresh] = f.where.emplace(e.name, sf);
      if (!fresh)
        throw UserError("Hugging Face folder " + dir + ": tensor '" + e.name + "' is in both " +
                        it->second->path() + " and " + path);
    }
  };
  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";
  if (fs::exists(index_path, ec)) {
    const std::string text = read_file(index_path, "Hugging Face index");
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw UserError(index_path + ": not valid JSON: " + e.what());
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw UserError(index_path +
                      ": found no \"weight_map\" object; expected "
                      "{\"weight_map\": {\"<tensor>\": \"<shard file>\", ...}}");
    std::map<std::string, std::string> wanted;  // tensor -> shard file
    std::set<std::string> shard_files;
    for (auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string())
        throw UserError(index_path + ": weight_map[\"" + name + "\"] is " + file.dump() +
                        "; expected a shard file name");
      const std::string s = file.get<std::string>();
      if (s.empty() || s.find('/') != std::string::npos || s == "." || s == "..")
        throw UserError(index_path + ": weight_map[\"" + name + "\"] = \"" + s +
                        "\"; expected a file name in the same folder");
      wanted[name] = s;
      shard_files.insert(s);
    }
    for (auto& s : shard_files) add_file(dir + "/" + s);
    for (auto& [name, file] : wanted) {
      auto it = f.where.find(name);
      if (it == f.where.end() || it->second->path() != dir + "/" + file)
        throw UserError(index_path + " puts tensor '" + name + "' in " + file +
                        ", but that file has no such tensor");
    }
  } else if (fs::exists(single_path, ec)) {
    add_file(single_path);
  } else {
    throw UserError("Hugging Face folder " + dir +
                    " has neither model.safetensors.index.json nor model.safetensors");
  }
  return f;
}

}  // namespace

namespace {

// A float8 tensor `name` of `folder`: checks it and its scale (hf_fp8.h), reading the block
// size from config.json at the first one; returns the scale's name.
std::string check_fp8_tensor(HfFolder& folder, const std::string& name, const std::string& dir) {
  const SafetensorsFile& wf = *folder.where.at(name);
  if (!folder.fp8) folder.fp8 = hf_fp8_blocks(dir, "'" + name + "' in " + wf.path());
  const std::string scale = hf_scale_inv_name(name);
  auto it = folder.where.find(scale);
  const SafetensorsFile* sf = it == folder.where.end() ? nullptr : it->second;
  check_hf_fp8_pair(wf, wf.entry(name), sf, sf ? &sf->entry(scale) : nullptr, *folder.fp8);
  ++folder.fp8_tensors;
  return scale;
}

// Checks every name, shape (the whole one) and dtype of `folder` against the map before
// anything is modified, and returns the bytes of the mapped HF tensors (float8 ones with their
// scales).
int64_t check_hf_folder(HfFolder& folder, const std::vector<HfTensorMap>& map,
                        const std::vector<const HfImportTarget*>& ours, const std::string& dir,
                        const HfSkip& skip) {
  std::set<std::string> expected;
  int64_t total = 0;
  for (size_t i = 0; i < map.size(); ++i) {
    const std::vector<int64_t> want = hf_shape(map[i], ours[i]->full_shape);
    for (auto& name : map[i].hf) {
      expected.insert(name);
      auto it = folder.where.find(name);
      if (it == folder.where.end())
        throw UserError("Hugging Face folder " + dir + " has no tensor '" + name + "' (shape " +
                        shape_str(want) + ", our " + map[i].ours + ")");
      const SafetensorsEntry& e = it->second->entry(name);
      if (e.shape != want)
        throw UserError("Hugging Face tensor '" + name + "' in " + it->second->path() +
                        " has shape " + shape_str(e.shape) + "; expected " + shape_str(want) +
                        " (our " + map[i].ours + " " + shape_str(ours[i]->full_shape) + ")");
      if (at::isFloat8Type(e.dtype)) {
        const std::string scale = check_fp8_tensor(folder, name, dir);
        expected.insert(scale);
        const SafetensorsEntry& s = folder.where.at(scale)->entry(scale);
        total += static_cast<int64_t>(s.end - s.begin);
      } else if (!at::isFloatingType(e.dtype)) {
        throw UserError("Hugging Face tensor '" + name + "' in " + it->second->path() +
                        " has dtype " + safetensors_dtype_name(e.dtype) +
                        "; expected a floating dtype (F64, F32, F16, BF16, or F8_E4M3 with a "
                        "_scale_inv)");
      }
      total += static_cast<int64_t>(e.end - e.begin);
    }
  }
  size_t skipped = 0;
  for (auto& [name, file] : folder.where) {
    if (expected.count(name) || ignorable_hf_tensor(name)) continue;
    if (skip && skip(name)) {
      ++skipped;
      continue;
    }
    throw UserError("Hugging Face tensor '" + name + "' in " + file->path() +
                    " is not part of this model (" + std::to_string(expected.size()) +
                    " tensors expected); wrong model or flavor?");
  }
  if (skipped > 0)
    log_info("Hugging Face import from " + dir + ": skipped " + std::to_string(skipped) +
             " tensors of modules this model does not have");
  return total;
}

// The HF row each of our rows [o, o + n) comes from (kNone and kRopePermute). For the RoPE
// permutation, our row j of a head of d rows is pair j / 2, part j % 2; HF keeps the real
// parts in the head's first half and the imaginary parts in its second (to_hf_layout).
std::vector<int64_t> hf_rows_of(const HfTensorMap& m, int64_t rows_total, int64_t o, int64_t n) {
  std::vector<int64_t> r(static_cast<size_t>(n));
  const int64_t d = m.transform == HfTransform::kRopePermute ? rows_total / m.rope_heads : 0;
  TORCH_CHECK(m.transform != HfTransform::kRopePermute || rows_total % (2 * m.rope_heads) == 0,
              "hf interop: '", m.ours, "' rows ", rows_total, " do not split into ", m.rope_heads,
              " heads of even size");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = o + i;
    if (d == 0) {
      r[static_cast<size_t>(i)] = row;
    } else {
      const int64_t head = row / d, j = row % d;
      r[static_cast<size_t>(i)] = head * d + (j % 2) * (d / 2) + j / 2;
    }
  }
  return r;
}

// Rows `rows` of HF tensor `name`, in that order, read as the contiguous runs the sorted rows
// form (one pread each). Adds the bytes read to `bytes`.
at::Tensor read_hf_rows(const SafetensorsFile& f, const std::string& name,
                        const std::vector<int64_t>& rows, int64_t& bytes) {
  std::vector<int64_t> sorted = rows;
  std::sort(sorted.begin(), sorted.end());
  std::vector<at::Tensor> runs;
  for (size_t a = 0; a < sorted.size();) {
    size_t b = a + 1;
    while (b < sorted.size() && sorted[b] == sorted[b - 1] + 1) ++b;
    runs.push_back(f.get_rows(name, sorted[a], static_cast<int64_t>(b - a)));
    bytes += static_cast<int64_t>(runs.back().nbytes());
    a = b;
  }
  // Float8 rows move as bytes: cat and index_select have no float8 kernels on every device.
  const at::ScalarType dtype = runs[0].scalar_type();
  const bool fp8 = at::isFloat8Type(dtype);
  if (fp8)
    for (at::Tensor& run : runs) run = run.view(at::kByte);
  at::Tensor got = runs.size() == 1 ? runs[0] : at::cat(runs);
  if (sorted != rows) {
    std::vector<int64_t> pos;
    for (int64_t r : rows)
      pos.push_back(std::lower_bound(sorted.begin(), sorted.end(), r) - sorted.begin());
    got = got.index_select(0, at::tensor(pos, at::kLong));
  }
  return fp8 ? got.view(dtype) : got;
}

// `got`: rows `rows` of HF tensor `name` as stored; float8 ones dequantized (to float32).
at::Tensor dequantized(const HfFolder& folder, const std::string& name, const at::Tensor& got,
                       const std::vector<int64_t>& rows, int64_t& bytes) {
  if (!at::isFloat8Type(got.scalar_type())) return got;
  TORCH_CHECK(folder.fp8, "hf interop: float8 tensor '", name, "' was not checked");
  const std::string scale = hf_scale_inv_name(name);
  return dequantize_hf_fp8_rows(got, rows, *folder.where.at(scale), scale, *folder.fp8, bytes);
}

std::vector<int64_t> all_rows(const at::Tensor& t) {
  std::vector<int64_t> r(static_cast<size_t>(t.dim() > 0 ? t.size(0) : 0));
  for (size_t i = 0; i < r.size(); ++i) r[i] = static_cast<int64_t>(i);
  return r;
}

// Target t's rows from the HF tensors of entry m, in t's dtype (on the CPU).
at::Tensor read_target_rows(const HfFolder& folder, const HfTensorMap& m, const HfImportTarget& t,
                            int64_t& bytes) {
  const at::ScalarType dtype = t.dst.scalar_type();
  auto whole = [&](const std::string& name) {
    at::Tensor w = folder.where.at(name)->get(name);
    bytes += static_cast<int64_t>(w.nbytes());
    return dequantized(folder, name, w, all_rows(w), bytes).to(dtype);
  };
  if (t.full_shape.empty()) return whole(m.hf.at(0));  // a scalar has no rows
  const int64_t o = t.row_offset, n = t.dst.size(0);
  if (m.transform == HfTransform::kSplitExperts) {
    std::vector<at::Tensor> experts;
    for (int64_t e = o; e < o + n; ++e) experts.push_back(whole(m.hf.at(static_cast<size_t>(e))));
    return at::stack(experts, 0);
  }
  const std::string& name = m.hf.at(0);
  const std::vector<int64_t> rows = hf_rows_of(m, t.full_shape[0], o, n);
  const at::Tensor got = read_hf_rows(*folder.where.at(name), name, rows, bytes);
  return dequantized(folder, name, got, rows, bytes).to(dtype);
}

}  // namespace

HfImportTargets hf_targets(const NamedTensors& tensors) {
  HfImportTargets r;
  for (auto& [name, t] : tensors) r.push_back({name, t, t.sizes().vec(), 0});
  return r;
}

HfImportTargets hf_targets(const ParamStore& params) {
  HfImportTargets r;
  for (auto& p : params.all())
    r.push_back(
        {p.name, p.valid(p.value.detach()), p.full_shape(), p.sharded() ? p.dim0_offset : 0});
  return r;
}

std::string HfImportStats::describe() const {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(3);
  os << "read " << bytes_read / 1048576.0 << " of " << bytes_total / 1048576.0
     << " MiB of Hugging Face tensor data";
  return os.str();
}

HfImportStats import_hf(const HfImportTargets& targets, const std::vector<HfTensorMap>& map,
                        const std::string& dir_arg, const HfSkip& skip) {
  validate_hf_map(map);
  const std::vector<const HfImportTarget*> ours = match_targets(targets, map);
  const std::string dir = strip_slashes(dir_arg);
  HfFolder folder = open_hf_folder(dir);
  HfImportStats stats;
  stats.bytes_total = check_hf_folder(folder, map, ours, dir, skip);
  if (folder.fp8_tensors > 0)
    log_info("Hugging Face import from " + dir + ": dequantizing " +
             std::to_string(folder.fp8_tensors) + " float8 e4m3 tensors with their [" +
             std::to_string(folder.fp8->rows) + ", " + std::to_string(folder.fp8->cols) +
             "] block scales (_scale_inv) to the model's dtype");
  at::NoGradGuard ng;
  for (size_t i = 0; i < map.size(); ++i) {
    const HfImportTarget& t = *ours[i];
    if (t.dst.is_meta()) continue;                        // another pipeline stage's
    if (t.dst.dim() > 0 && t.dst.size(0) == 0) continue;  // this rank holds none of its rows
    at::Tensor dst = t.dst;
    dst.copy_(read_target_rows(folder, map[i], t, stats.bytes_read));
  }
  return stats;
}

HfImportStats import_hf(const NamedTensors& tensors, const std::vector<HfTensorMap>& map,
                        const std::string& dir, const HfSkip& skip) {
  return import_hf(hf_targets(tensors), map, dir, skip);
}

HfImportStats import_hf(ParamStore& params, const std::vector<HfTensorMap>& map,
                        const std::string& dir) {
  return import_hf(hf_targets(params), map, dir);
}

// ---- Any model ----------------------------------------------------------------------------------

std::vector<std::string> hf_supported_models() {
  return {"llama3", "deepseek_v3", "qwen3", "gpt_oss"};
}

bool hf_supported(const Model& model) {
  return dynamic_cast<const Llama3*>(&model) || dynamic_cast<const DeepSeekV3*>(&model) ||
         dynamic_cast<const Qwen3*>(&model) || dynamic_cast<const GptOss*>(&model);
}

void require_hf_supported(const Model& model, const std::string& what) {
  if (hf_supported(model)) return;
  std::string allowed;
  for (auto& n : hf_supported_models()) allowed += (allowed.empty() ? "" : ", ") + n;
  throw UserError(what + ": Hugging Face weights are supported for model.name = " + allowed +
                  "; found \"" + model.info().name + "\"");
}

NamedTensors hf_tensors(const Model& model) {
  if (auto* ds = dynamic_cast<const DeepSeekV3*>(&model)) return deepseek_v3_hf_tensors(*ds);
  return named(model.params());
}

void export_model_hf(const Model& model, const std::string& dir, const HfExportOptions& opts) {
  require_hf_supported(model, "export to Hugging Face");
  if (auto* llama = dynamic_cast<const Llama3*>(&model)) return export_llama3_hf(*llama, dir, opts);
  if (auto* qwen = dynamic_cast<const Qwen3*>(&model)) return export_qwen3_hf(*qwen, dir, opts);
  if (auto* oss = dynamic_cast<const GptOss*>(&model)) return export_gpt_oss_hf(*oss, dir, opts);
  export_deepseek_v3_hf(dynamic_cast<const DeepSeekV3&>(model), dir, opts);
}

HfImportStats import_model_hf(Model& model, const std::string& dir) {
  require_hf_supported(model, "import from Hugging Face");
  if (auto* llama = dynamic_cast<Llama3*>(&model)) return import_llama3_hf(*llama, dir);
  if (auto* qwen = dynamic_cast<Qwen3*>(&model)) return import_qwen3_hf(*qwen, dir);
  if (auto* oss = dynamic_cast<GptOss*>(&model)) return import_gpt_oss_hf(*oss, dir);
  return import_deepseek_v3_hf(dynamic_cast<DeepSeekV3&>(model), dir);
}

}  // namespace titan
