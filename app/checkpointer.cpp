#include "app/checkpointer.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "core/base/errors.h"
#include "models/hf_interop.h"

namespace titan {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A tensor laid out like p.value (the parameter or its AdamW moments): this rank's rows when
// p is sharded, the padding rows zeroed; this tp rank's slice of the whole (saved) tensor
// when p is tensor-parallel: rows [tp_offset, ...) of dim-0 splits, and for splits along
// dim 1 or 2 (row-parallel weights, the routed experts under expert tensor parallelism) the
// whole rows with this rank's slice kept.
bool restore_param(CheckpointReader& r, const std::string& key, const Param& p,
                   const at::Tensor& dst, bool required) {
  at::NoGradGuard ng;
  const int64_t first = (p.sharded() ? p.dim0_offset : 0) + (p.tp_dim == 0 ? p.tp_offset : 0);
  const int64_t rows = p.sharded() ? p.dim0_rows : (p.tp_dim >= 0 ? dst.size(0) : -1);
  const at::Tensor mine = p.valid(dst);
  if (p.tp_dim >= 1) {
    // The whole rows (every column of the split dim), then this rank's slice of them.
    std::vector<int64_t> shape = mine.sizes().vec();
    shape[static_cast<size_t>(p.tp_dim)] = p.tp_shape[static_cast<size_t>(p.tp_dim)];
    at::Tensor whole = at::empty(shape, dst.options());
    if (!r.restore_rows(key, p.model_shape(), first, mine.size(0), whole, required)) return false;
    mine.copy_(whole.narrow(p.tp_dim, p.tp_offset, mine.size(p.tp_dim)));
  } else if (!r.restore_rows(key, p.model_shape(), first, rows, mine, required)) {
    return false;
  }
  if (p.sharded()) dst.narrow(0, p.dim0_rows, dst.size(0) - p.dim0_rows).zero_();
  return true;
}

// A parameter's first state tensor ("exp_avg" for AdamW, "momentum_buffer" for Muon) is
// missing but the other optimizer's is there: the run switched optimizer (optimizer.name, or
// the routing of optimizer.param_groups). Exit 2 naming the keys rather than a bare missing key.
void check_optimizer_kind(CheckpointReader& r, const std::string& param, const std::string& want,
                          const std::set<std::string>& saved, const std::string& opt_name) {
  if (saved.count("optimizer/" + want + "/" + param)) return;
  const bool muon = want == "momentum_buffer";
  const std::string other = muon ? "exp_avg" : "momentum_buffer";
  if (!saved.count("optimizer/" + other + "/" + param)) return;  // restore_param reports it
  throw UserError("checkpoint '" + r.dir() + "': " + param + " was saved with " +
                  (muon ? "AdamW" : "Muon") + " state, but optimizer.name = \"" + opt_name +
                  "\" (with optimizer.param_groups) now gives it " + (muon ? "Muon" : "AdamW") +
                  "; allowed: resume with the optimizer it was saved with, or add \"optimizer\" "
                  "to checkpoint.exclude_from_loading to start the optimizer state afresh");
}

// "; skipped step-N: ..." for each step-N folder newer than `step` that is not a complete
// checkpoint (no metadata.json or train_state.json: a save that never finished its rename, or
// a folder damaged since), so a resume from an older step never happens unexplained.
std::string skipped_newer(const std::string& root, int64_t step) {
  std::string out;
  std::error_code ec;
  std::vector<std::pair<int64_t, std::string>> found;
  for (auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.size() == 5 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos || !e.is_directory())
      continue;
    const int64_t n = std::stoll(name.substr(5));
    if (n <= step) continue;
    std::string missing;
    for (const char* f : {"metadata.json", "train_state.json"})
      if (!fs::exists(e.path() / f)) missing += (missing.empty() ? "" : " and ") + std::string(f);
    found.emplace_back(n, "; skipped " + e.path().string() + ": it has no " + missing +
                              " (an incomplete or damaged checkpoint)");
  }
  std::sort(found.begin(), found.end());
  for (auto& [n, line] : found) out += line;
  return out;
}

}  // namespace

Checkpointer::Checkpointer(const JobConfig& cfg, int64_t rank, int64_t world_size)
    : Checkpointer(cfg, CheckpointGroup{rank, true, 1, std::to_string(::getpid()), {}, {}},
                   world_size) {}

Checkpointer::Checkpointer(const JobConfig& cfg, CheckpointGroup group, int64_t world_size)
    : cfg_(cfg),
      group_(group),
      world_(world_size),
      writer_((fs::path(cfg.job.dump_folder) / cfg.checkpoint.folder).string(), std::move(group),
              world_size, cfg.checkpoint.keep_latest_k) {
  writer_.set_test_delay_ms(cfg.debug.checkpoint_delay_ms);
}

bool Checkpointer::excluded(const char* part) const {
  const auto& ex = cfg_.checkpoint.exclude_from_loading;
  return std::find(ex.begin(), ex.end(), part) != ex.end();
}

// ---- Saving --------------------------------------------------------------------------------

at::Tensor Checkpointer::stage(const std::string& key, const at::Tensor& t) {
  at::Tensor src = t.detach();
  if (cfg_.checkpoint.async_mode != "async_with_pinned_mem")
    return src.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
  // Staging buffers are allocated once and reused by every save (the previous write has
  // finished: save() waits for it first). On CUDA they are pinned and filled without
  // blocking, so the training thread does not wait for the device-to-host copies.
  at::Tensor& buf = staging_[key];
  if (!buf.defined() || buf.sizes() != src.sizes() || buf.scalar_type() != src.scalar_type())
    buf = at::empty(src.sizes(), src.options().device(at::kCPU).pinned_memory(!src.is_cpu()));
  buf.copy_(src, /*non_blocking=*/!src.is_cpu());
  if (!src.is_cpu()) staged_on_device_ = true;
  return buf;
}

CheckpointSnapshot Checkpointer::snapshot(const TrainingState& st, bool model_only) {
  at::NoGradGuard ng;
  CheckpointSnapshot s;
  s.step = st.step;
  staged_on_device_ = false;
  const bool rank0 = group_.rank == 0;
  // A parameter's value or optimizer state: its valid rows when sharded, by every writing
  // rank; replicated values by rank 0 only. Under tensor parallelism the file holds the whole
  // tensor's rows: dim-0 slices are written by each tp rank at their global rows, slices
  // along dim 1 or 2 gathered over the tp ranks (a collective of the writing ranks) and
  // written by tp rank 0, like the replicated parameters.
  TensorParallelComm* tp = st.model->tensor_parallel();
  const bool staged = !st.opt_slot.empty();  // pipeline stages: each rank writes its own
  auto add_param_like = [&](const std::string& key, const Param& p, const at::Tensor& t,
                            at::ScalarType dtype) {
    if (p.value.is_meta()) return;  // another pipeline stage's
    if ((p.sharded() || tp || staged) ? !group_.writes : !rank0) return;
    at::Tensor v = p.valid(t);
    int64_t first = p.sharded() ? p.dim0_offset : 0;
    if (p.tp_dim >= 1)  // gathered along the split dim (moved last for the gather)
      v = tp->gather_last(v.movedim(p.tp_dim, -1).contiguous()).movedim(-1, p.tp_dim).contiguous();
    else if (p.tp_dim == 0)
      first += p.tp_offset;
    if (tp && p.tp_dim != 0 && tp->rank() != 0) return;
    at::Tensor c = stage(key, v);
    s.entries.push_back({key, c.scalar_type() == dtype ? c : c.to(dtype), p.model_shape(), first});
  };
  auto add_replicated = [&](const std::string& key, const at::Tensor& t) {
    if (rank0) s.entries.push_back({key, stage(key, t), t.sizes().vec(), 0});
  };
  const auto& params = st.model->params().all();
  const at::ScalarType model_dtype =
      model_only ? hf_export_dtype(cfg_.checkpoint.export_dtype, "checkpoint.export_dtype")
                 : at::kFloat;
  for (auto& p : params) add_param_like("model/" + p.name, p, p.value, model_dtype);
  for (auto& [name, t] : st.model->buffers()) {
    if (!st.holds_buffer)
      add_replicated("buffers/" + name, t);
    else if (group_.writes && st.stage_lead && st.holds_buffer(name))
      s.entries.push_back({"buffers/" + name, stage("buffers/" + name, t), t.sizes().vec(), 0});
  }
  json ts;
  ts["format"] = 1;
  ts["step"] = st.step;
  ts["model_only"] = model_only;
  ts["world_size"] = world_;
  if (!model_only) {
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t k = staged ? st.opt_slot[i] : static_cast<int64_t>(i);
      if (k < 0) continue;  // another pipeline stage's
      const auto slot = static_cast<size_t>(k);
      // AdamW: exp_avg, exp_avg_sq and step; Muon: momentum_buffer (its only state).
      for (auto& [state, t] : st.optimizer->param_state(slot))
        add_param_like("optimizer/" + state + "/" + params[i].name, params[i], t, at::kFloat);
      const std::string key = "optimizer/step/" + params[i].name;
      at::Tensor step = st.optimizer->step_count(slot);
      if (!step.defined())
        continue;
      else if (!staged)
        add_replicated(key, step);
      else if (group_.writes && st.stage_lead)
        s.entries.push_back({key, stage(key, step), step.sizes().vec(), 0});
    }
    add_replicated("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
    ts["lr_step_offset"] = st.lr_step_offset;
    if (st.data_state) ts["dataloader"] = st.data_state();
  }
  ts["config"] = dump_config_toml(cfg_);
  s.train_state_json = ts.dump(1);
  if (staged_on_device_) {
    // The non-blocking copies were queued on the current stream of the parameters' device.
    at::Device dev = params.front().value.device();
    for (auto& p : params)  // a pipeline rank's first parameter may be another stage's (meta)
      if (!p.value.is_meta()) {
        dev = p.value.device();
        break;
      }
    c10::Event done(dev.type());
    done.record(c10::impl::VirtualGuardImpl(dev.type()).getStream(dev));
    auto ev = std::make_shared<c10::Event>(std::move(done));
    s.ready = [ev] { ev->synchronize(); };
  }
  return s;
}

void Checkpointer::save(const TrainingState& st, bool model_only) {
  writer_.wait();  // the staging buffers and the writer thread are free again
  const std::string& mode = cfg_.checkpoint.async_mode;
  writer_.save(snapshot(st, model_only), mode == "async" || mode == "async_with_pinned_mem");
}

std::vector<std::string> Checkpointer::remove_stale_temporaries() const {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(root(), ec)) return out;
  for (auto& e : fs::directory_iterator(root(), ec)) {
    const std::string name = e.path().filename().string();
    const auto at = name.find(".tmp-");
    if (name.rfind("step-", 0) != 0 || at == std::string::npos || !e.is_directory()) continue;
    const std::string token = name.substr(at + 5);
    if (token.empty() || token == group_.token ||
        token.find_first_not_of("0123456789") != std::string::npos)
      continue;
    // kill(pid, 0): 0 or EPERM means such a process exists here (perhaps another run writing
    // into this folder); ESRCH that none does, so nothing can still write this folder.
    const long pid = std::strtol(token.c_str(), nullptr, 10);
    if (pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM)) {
      out.push_back("kept " + e.path().string() + ": process " + token + " is alive");
      continue;
    }
    uintmax_t bytes = 0;
    for (auto& f : fs::recursive_directory_iterator(e.path(), ec))
      if (f.is_regular_file(ec)) bytes += f.file_size(ec);
    ec.clear();
    fs::remove_all(e.path(), ec);
    out.push_back((ec ? "could not remove " : "removed ") + e.path().string() +
                  " (an unfinished save of process " + token + ", which is gone; " +
                  std::to_string(bytes / 1048576) + " MiB)" + (ec ? ": " + ec.message() : ""));
  }
  return out;
}

// ---- Loading -------------------------------------------------------------------------------

void Checkpointer::restore_model(CheckpointReader& r, TrainingState& st) {
  auto& params = st.model->params().all();
  if (!excluded("model")) {
    std::set<std::string> expected;
    for (auto& p : params) expected.insert("model/" + p.name);
    for (auto& [k, shape] : r.keys("model/"))
      if (!expected.count(k))
        throw UserError("checkpoint '" + r.dir() + "': holds " + k + " of shape " +
                        shape_str(shape) +
                        ", which this model does not have (a different model config?)");
    for (auto& p : params)
      if (!p.value.is_meta()) restore_param(r, "model/" + p.name, p, p.value, true);
  }
  for (auto& [name, t] : st.model->buffers())
    r.restore_rows("buffers/" + name, t.sizes().vec(), 0, -1, t, false);
}

void Checkpointer::restore_optimizer(CheckpointReader& r, TrainingState& st) {
  if (excluded("optimizer")) return;
  std::set<std::string> saved;  // the optimizer state keys the checkpoint holds
  for (auto& [k, shape] : r.keys("optimizer/")) saved.insert(k);
  auto& params = st.model->params().all();
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    const int64_t k = st.opt_slot.empty() ? static_cast<int64_t>(i) : st.opt_slot[i];
    if (k < 0) continue;  // another pipeline stage's
    const auto slot = static_cast<size_t>(k);
    const auto state = st.optimizer->param_state(slot);
    check_optimizer_kind(r, p.name, state.front().first, saved, cfg_.optimizer.name);
    for (auto& [name, t] : state) restore_param(r, "optimizer/" + name + "/" + p.name, p, t, true);
    at::Tensor step = st.optimizer->step_count(slot);
    if (step.defined())
      r.restore_rows("optimizer/step/" + p.name, step.sizes().vec(), 0, -1, step, true);
  }
}

void Checkpointer::restore_progress(CheckpointReader& r, TrainingState& st) {
  if (auto rng = r.get("rng/cpu")) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the global one
    gen.set_state(*rng);
  }
  const json& ts = r.train_state();
  if (!excluded("train_state")) st.step = ts.value("step", int64_t{0});
  st.lr_step_offset = excluded("lr_scheduler") ? st.step : ts.value("lr_step_offset", int64_t{0});
  if (!excluded("dataloader") && ts.contains("dataloader") && st.load_data_state)
    st.load_data_state(ts["dataloader"]);
}

void Checkpointer::load_folder(const std::string& dir, TrainingState& st, bool model_only) {
  CheckpointReader r(dir);
  restore_model(r, st);
  if (model_only || r.train_state().value("model_only", false)) return;
  restore_optimizer(r, st);
  restore_progress(r, st);
}

std::string Checkpointer::load(TrainingState& st) {
  const auto& c = cfg_.checkpoint;
  const std::string& root = writer_.root();
  // checkpoint.enable = false: no resume, but initial_load_path still initializes the model
  // (validate_config refuses load_step there).
  auto steps = c.enable ? complete_steps(root) : std::vector<int64_t>{};
  if (c.load_step >= 0) {
    if (!fs::is_directory(root))
      throw UserError("checkpoint.load_step = " + std::to_string(c.load_step) +
                      ": the checkpoint folder '" + root + "' does not exist");
    if (!std::count(steps.begin(), steps.end(), c.load_step)) {
      std::string avail;
      for (auto s : steps) avail += (avail.empty() ? "" : ", ") + std::to_string(s);
      throw UserError("checkpoint.load_step = " + std::to_string(c.load_step) +
                      ": no complete checkpoint step-" + std::to_string(c.load_step) + " in '" +
                      root + "'; available: " + (avail.empty() ? "none" : avail));
    }
    steps = {c.load_step};
  }
  if (!steps.empty()) {
    const int64_t step = steps.back();
    const std::string dir = (fs::path(root) / ("step-" + std::to_string(step))).string();
    try {
      load_folder(dir, st, false);
    } catch (const UserError& e) {
      // A damaged newest checkpoint: name the one before, which the user can fall back to.
      const auto all = complete_steps(root);
      const auto prev = std::lower_bound(all.begin(), all.end(), step);
      if (c.load_step >= 0 || prev == all.begin()) throw;
      throw UserError(std::string(e.what()) +
                      "; to resume from the previous checkpoint: "
                      "checkpoint.load_step = " +
                      std::to_string(*(prev - 1)));
    }
    return "resumed from " + dir + " at step " + std::to_string(st.step) +
           skipped_newer(root, step);
  }
  if (!c.initial_load_path.empty()) {
    if (!fs::is_directory(c.initial_load_path))
      throw UserError(
          "checkpoint.initial_load_path = '" + c.initial_load_path +
          "': no such checkpoint folder; allowed: a step-N folder of a titan-train checkpoint");
    load_folder(c.initial_load_path, st, c.initial_load_model_only);
    return "initialized from " + c.initial_load_path +
           (c.initial_load_model_only ? " (model only)" : "");
  }
  return "";
}

}  // namespace titan
