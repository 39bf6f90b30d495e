#include "core/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "core/durable_io.h"
#include "core/errors.h"
#include "core/log.h"
#include "core/safetensors.h"

namespace titan {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::atomic<int> g_signal{0};
extern "C" void on_preempt(int sig) {
  g_signal.store(sig);
}

std::string shape_str(at::IntArrayRef s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

std::string rank_file(int64_t rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05lld.safetensors", static_cast<long long>(rank));
  return buf;
}

json read_json(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw UserError("checkpoint file '" + p.string() + "': cannot be read");
  std::stringstream ss;
  ss << f.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw UserError("checkpoint file '" + p.string() + "': not a JSON object (corrupt?)");
  return j;
}

}  // namespace

void install_preemption_handlers() {
  std::signal(SIGTERM, on_preempt);
  std::signal(SIGUSR1, on_preempt);
}
int preemption_signal() {
  return g_signal.load();
}

Checkpointer::Checkpointer(const JobConfig& cfg, int64_t rank, int64_t world_size, int64_t dp_size)
    : Checkpointer(cfg, CheckpointGroup{rank, true, 1, std::to_string(::getpid()), {}, {}},
                   world_size, dp_size) {}

Checkpointer::Checkpointer(const JobConfig& cfg, CheckpointGroup group, int64_t world_size,
                           int64_t dp_size)
    : cfg_(cfg),
      group_(std::move(group)),
      rank_(group_.rank),
      world_(world_size),
      dp_(dp_size > 0 ? dp_size : world_size) {
  root_ = (fs::path(cfg.job.dump_folder) / cfg.checkpoint.folder).string();
}

Checkpointer::~Checkpointer() {
  if (writer_.joinable()) writer_.join();
}

std::vector<int64_t> Checkpointer::complete_steps(const std::string& root) {
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

Checkpointer::Snapshot Checkpointer::snapshot(const TrainingState& st, bool model_only) const {
  at::NoGradGuard ng;
  Snapshot s;
  s.step = st.step;
  const bool rank0 = rank_ == 0;
  auto cpu_copy = [](const at::Tensor& t) {
    return t.detach().to(at::kCPU, false, true).contiguous();
  };
  // A parameter's value or optimizer state: its valid rows when sharded.
  auto add_param_like = [&](const std::string& key, const Param& p, const at::Tensor& t) {
    if (p.sharded() ? !group_.writes : !rank0) return;
    s.entries.push_back({key, cpu_copy(p.valid(t)), p.full_shape(), p.dim0_offset});
  };
  auto add_replicated = [&](const std::string& key, const at::Tensor& t) {
    if (rank0) s.entries.push_back({key, cpu_copy(t), t.sizes().vec(), 0});
  };
  const auto& params = st.model->params().all();
  for (auto& p : params) add_param_like("model/" + p.name, p, p.value);
  for (auto& [name, t] : st.model->buffers()) add_replicated("buffers/" + name, t);
  json ts;
  ts["format"] = 1;
  ts["step"] = st.step;
  ts["model_only"] = model_only;
  ts["world_size"] = world_;
  if (!model_only) {
    for (size_t i = 0; i < params.size(); ++i) {
      add_param_like("optimizer/exp_avg/" + params[i].name, params[i], st.optimizer->exp_avg()[i]);
      add_param_like("optimizer/exp_avg_sq/" + params[i].name, params[i],
                     st.optimizer->exp_avg_sq()[i]);
      add_replicated("optimizer/step/" + params[i].name, st.optimizer->steps()[i]);
    }
    add_replicated("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
    ts["lr_step_offset"] = st.lr_step_offset;
    auto ls = st.loader->state();
    ts["dataloader"] = {{"epoch", ls.epoch}, {"cursor", ls.cursor}, {"dp", dp_}};
  }
  ts["config"] = dump_config_toml(cfg_);
  s.train_state_json = ts.dump(1);
  return s;
}

void Checkpointer::write(const Snapshot& s) {
  const fs::path final_dir = fs::path(root_) / ("step-" + std::to_string(s.step));
  const fs::path tmp =
      fs::path(root_) / ("step-" + std::to_string(s.step) + ".tmp-" + group_.token);
  const std::string key = "checkpoint/step-" + std::to_string(s.step);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) return;  // this step is already saved and complete
  auto fail = [&](const std::string& why) {
    if (group_.counter) group_.counter(key + "/failed", 1);
    if (rank_ == 0) fs::remove_all(tmp, ec);
    auto prev = complete_steps(root_);
    std::string kept =
        prev.empty() ? "there is no earlier checkpoint"
                     : "the previous checkpoint step-" + std::to_string(prev.back()) + " is kept";
    throw UserError("checkpoint save of step " + std::to_string(s.step) + " to '" + tmp.string() +
                    "' failed" + (world_ > 1 ? " on rank " + std::to_string(rank_) : "") + ": " +
                    why + "; " + kept);
  };
  try {
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
      save_safetensors((tmp / rank_file(rank_)).string(), tensors,
                       {{"format", "titan-train checkpoint 1"}});
      write_file_durable((tmp / (rank_file(rank_) + ".json")).string(), part.dump());
    }
    if (group_.counter && group_.writes) group_.counter(key + "/written", 1);
    if (rank_ == 0) finalize(tmp.string(), s);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  if (rank_ == 0) {
    log_info("checkpoint: saved step " + std::to_string(s.step) + " to " + final_dir.string());
    prune();
  }
}

void Checkpointer::finalize(const std::string& tmp_dir, const Snapshot& s) {
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
  std::vector<fs::path> parts;
  for (auto& e : fs::directory_iterator(tmp))
    if (e.path().extension() == ".json" && e.path().filename().string().rfind("rank-", 0) == 0)
      parts.push_back(e.path());
  std::sort(parts.begin(), parts.end());
  for (auto& pp : parts) {
    json part = read_json(pp);
    const std::string file = pp.stem().string();  // rank-RRRRR.safetensors
    for (auto& [name, e] : part.items()) {
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
  if (const char* d = std::getenv("TITAN_TEST_CHECKPOINT_DELAY_MS"))  // tests: a slow disk
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(d)));
  fsync_dir(tmp.string());
  fs::rename(tmp, final_dir);
  fsync_dir(root_);
}

void Checkpointer::prune() {
  const int64_t k = cfg_.checkpoint.keep_latest_k;
  if (k <= 0) return;
  auto steps = complete_steps(root_);
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(k) < steps.size(); ++i)
    fs::remove_all(fs::path(root_) / ("step-" + std::to_string(steps[i])), ec);
}

void Checkpointer::save(const TrainingState& st, bool model_only) {
  wait();
  Snapshot s = snapshot(st, model_only);
  if (cfg_.checkpoint.async_mode == "disabled") {
    write(s);
    return;
  }
  // Async: the snapshot is already a CPU copy; the write overlaps the next steps.
  writer_ = std::thread([this, s = std::move(s)]() {
    try {
      write(s);
    } catch (...) {
      writer_error_ = std::current_exception();
    }
  });
}

void Checkpointer::wait() {
  if (writer_.joinable()) writer_.join();
  if (writer_error_) {
    auto e = writer_error_;
    writer_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void Checkpointer::load_folder(const std::string& dir, TrainingState& st, bool model_only,
                               const std::vector<std::string>& exclude) {
  at::NoGradGuard ng;
  auto excluded = [&](const char* part) {
    return std::find(exclude.begin(), exclude.end(), part) != exclude.end();
  };
  const fs::path d(dir);
  json meta = read_json(d / "metadata.json");
  json ts = read_json(d / "train_state.json");
  if (!meta.contains("tensors") || !meta["tensors"].is_object())
    throw UserError("checkpoint file '" + (d / "metadata.json").string() +
                    "': has no \"tensors\" map");
  std::map<std::string, SafetensorsFile> files;
  auto file = [&](const std::string& name) -> SafetensorsFile& {
    auto it = files.find(name);
    if (it == files.end())
      it = files.emplace(name, SafetensorsFile::open((d / name).string())).first;
    return it->second;
  };
  // Rows [begin, begin + count) of a global tensor (count -1: all of them), assembled from
  // the dim-0 shards that overlap them; nullopt when the checkpoint lacks the tensor. The
  // checkpoint may have been saved by any number of ranks: this is where it is resharded.
  auto fetch_rows =
      [&](const std::string& key, int64_t begin,
          int64_t count) -> std::optional<std::pair<at::Tensor, std::vector<int64_t>>> {
    if (!meta["tensors"].contains(key)) return std::nullopt;
    const json& e = meta["tensors"][key];
    auto shape = e["shape"].get<std::vector<int64_t>>();
    const int64_t rows = shape.empty() ? 1 : shape[0];
    if (count < 0) count = rows - begin;
    if (count == 0) {  // no rows of this tensor on this rank
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
      if ((t.dim() == 0 ? 1 : t.size(0)) != n)
        throw UserError("checkpoint '" + dir + "': shard " + sh["key"].get<std::string>() + " in " +
                        sh["file"].get<std::string>() + " has " +
                        std::to_string(t.dim() == 0 ? 1 : t.size(0)) +
                        " rows but metadata.json says " + std::to_string(n));
      if (shape.empty()) return std::make_pair(t, shape);
      parts.emplace_back(lo, t.narrow(0, lo - off, std::max<int64_t>(0, hi - lo)));
      covered += std::max<int64_t>(0, hi - lo);
    }
    if (covered != count)
      throw UserError("checkpoint '" + dir + "': the shards of " + key + " cover " +
                      std::to_string(covered) + " of rows [" + std::to_string(begin) + ", " +
                      std::to_string(begin + count) + ") (a missing or corrupt rank file?)");
    std::sort(parts.begin(), parts.end(), [](auto& a, auto& b) { return a.first < b.first; });
    std::vector<at::Tensor> ts;
    for (auto& p : parts) ts.push_back(p.second);
    return std::make_pair(ts.size() == 1 ? ts[0] : at::cat(ts, 0), shape);
  };
  auto fetch = [&](const std::string& key) -> std::optional<at::Tensor> {
    auto r = fetch_rows(key, 0, -1);
    if (!r) return std::nullopt;
    return r->first;
  };
  // Copies rows [begin, begin + rows) (rows -1: all) of the checkpoint's tensor `key`, whose
  // global shape must be `want`, into dst. False when it is absent and not required.
  auto restore_rows = [&](const std::string& key, const std::vector<int64_t>& want, int64_t begin,
                          int64_t rows, at::Tensor dst, bool required) {
    auto r = fetch_rows(key, begin, rows);
    if (!r) {
      if (required)
        throw UserError("checkpoint '" + dir + "': no tensor " + key +
                        "; the model expects one of shape " + shape_str(want) +
                        " (was it saved with another model config?)");
      return false;
    }
    if (r->second != want)
      throw UserError("checkpoint '" + dir + "': tensor " + key + " has shape " +
                      shape_str(r->second) + " but the model expects " + shape_str(want) +
                      " (a different model config?)");
    dst.copy_(r->first);
    return true;
  };
  auto restore = [&](const std::string& key, const at::Tensor& dst, bool required) {
    return restore_rows(key, dst.sizes().vec(), 0, -1, dst, required);
  };
  // A tensor laid out like p.value (the parameter or its AdamW moments): this rank's rows
  // when p is sharded, the padding rows zeroed.
  auto restore_param = [&](const std::string& key, const Param& p, const at::Tensor& dst,
                           bool required) {
    if (!p.sharded()) return restore_rows(key, p.full_shape(), 0, -1, dst, required);
    if (!restore_rows(key, p.full_shape(), p.dim0_offset, p.dim0_rows, p.valid(dst), required))
      return false;
    dst.narrow(0, p.dim0_rows, dst.size(0) - p.dim0_rows).zero_();
    return true;
  };

  auto& params = st.model->params().all();
  if (!excluded("model")) {
    std::set<std::string> expected;
    for (auto& p : params) expected.insert("model/" + p.name);
    for (auto& [k, v] : meta["tensors"].items())
      if (k.rfind("model/", 0) == 0 && !expected.count(k))
        throw UserError("checkpoint '" + dir + "': holds " + k + " of shape " +
                        shape_str(v["shape"].get<std::vector<int64_t>>()) +
                        ", which this model does not have (a different model config?)");
    for (auto& p : params) restore_param("model/" + p.name, p, p.value, true);
  }
  for (auto& [name, t] : st.model->buffers()) restore("buffers/" + name, t, false);
  const bool ckpt_model_only = ts.value("model_only", false);
  if (model_only || ckpt_model_only) return;
  if (!excluded("optimizer"))
    for (size_t i = 0; i < params.size(); ++i) {
      restore_param("optimizer/exp_avg/" + params[i].name, params[i], st.optimizer->exp_avg()[i],
                    true);
      restore_param("optimizer/exp_avg_sq/" + params[i].name, params[i],
                    st.optimizer->exp_avg_sq()[i], true);
      restore("optimizer/step/" + params[i].name, st.optimizer->steps()[i], true);
    }
  if (auto rng = fetch("rng/cpu")) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the global one
    gen.set_state(*rng);
  }
  const int64_t step = ts.value("step", int64_t{0});
  if (!excluded("train_state")) st.step = step;
  st.lr_step_offset = excluded("lr_scheduler") ? st.step : ts.value("lr_step_offset", int64_t{0});
  if (!excluded("dataloader") && ts.contains("dataloader")) {
    PackedLoader::State ls;
    ls.epoch = ts["dataloader"]["epoch"].get<int64_t>();
    const int64_t old_dp = ts["dataloader"]["dp"].get<int64_t>();
    // Ranks consume windows in lockstep, so the global position is cursor * dp.
    ls.cursor = ts["dataloader"]["cursor"].get<int64_t>() * old_dp / dp_;
    st.loader->load_state(ls);
  }
}

std::string Checkpointer::load(TrainingState& st) {
  const auto& c = cfg_.checkpoint;
  auto steps = complete_steps(root_);
  if (c.load_step >= 0) {
    if (!fs::is_directory(root_))
      throw UserError("checkpoint.load_step = " + std::to_string(c.load_step) +
                      ": the checkpoint folder '" + root_ + "' does not exist");
    if (!std::count(steps.begin(), steps.end(), c.load_step)) {
      std::string avail;
      for (auto s : steps) avail += (avail.empty() ? "" : ", ") + std::to_string(s);
      throw UserError("checkpoint.load_step = " + std::to_string(c.load_step) +
                      ": no complete checkpoint step-" + std::to_string(c.load_step) + " in '" +
                      root_ + "'; available: " + (avail.empty() ? "none" : avail));
    }
    steps = {c.load_step};
  }
  if (!steps.empty()) {
    const std::string dir = (fs::path(root_) / ("step-" + std::to_string(steps.back()))).string();
    load_folder(dir, st, false, c.exclude_from_loading);
    return "resumed from " + dir + " at step " + std::to_string(st.step);
  }
  if (!c.initial_load_path.empty()) {
    if (!fs::is_directory(c.initial_load_path))
      throw UserError(
          "checkpoint.initial_load_path = '" + c.initial_load_path +
          "': no such checkpoint folder; allowed: a step-N folder of a titan-train checkpoint");
    load_folder(c.initial_load_path, st, c.initial_load_model_only, c.exclude_from_loading);
    return "initialized from " + c.initial_load_path +
           (c.initial_load_model_only ? " (model only)" : "");
  }
  return "";
}

}  // namespace titan
