// The Trainer's checkpoint wiring (app/trainer.h): the writer group and what a checkpoint
// holds of this run (resume), the agreed load, the seed checkpoint, saves, the finish and
// the Hugging Face export (assembling the whole model under FSDP or PP)
// (docs/checkpointing.md).
#include "app/trainer.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "models/hf_interop.h"
#include "models/registry.h"

namespace titan {

// Each rank reads the checkpoint rows it holds, so a corrupt shard fails only the ranks that
// read it. A rank that stopped alone would leave the others waiting in the next collective
// until the timeout; instead every rank reports to the store and waits for all, and when any
// failed they all stop with the first message (docs/checkpointing.md).
std::string Trainer::load_checkpoint_agreed() {
  std::string what, error;
  try {
    what = ckpt_->load(state_);
  } catch (const UserError& e) {
    error = e.what();
  }
  if (!pg_) {
    if (!error.empty()) throw UserError(error);
    return what;
  }
  if (!error.empty() && pg_->store_add("checkpoint/load/failed", 1) == 1)
    pg_->store_set("checkpoint/load/error", "rank " + std::to_string(launch_.rank) + ": " + error);
  pg_->store_add("checkpoint/load/done", 1);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(cfg_.comm.init_timeout_seconds);
  while (pg_->store_add("checkpoint/load/done", 0) < launch_.world_size) {
    if (std::chrono::steady_clock::now() > deadline)
      throw UserError(
          "checkpoint load: not every rank finished loading within "
          "comm.init_timeout_seconds = " +
          std::to_string(cfg_.comm.init_timeout_seconds));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!error.empty()) throw UserError(error);
  if (pg_->store_add("checkpoint/load/failed", 0) > 0)
    throw UserError("checkpoint load failed on another rank, so every rank stops: " +
                    pg_->store_get("checkpoint/load/error"));
  return what;
}

void Trainer::resume() {
  // Sharded parameters are written by every rank of the first replica and resharded on load
  // from the dim-0 ranges in metadata.json.
  CheckpointGroup cg;
  cg.rank = launch_.rank;
  cg.writes = launch_.rank == 0 || (sharded_ && mesh_->replicate_index == 0) ||
              (tp_ > 1 && !sharded_ && dp_rank_ == 0);
  cg.writers = (sharded_ ? mesh_->shard : 1) * tp_;  // every tp rank of a writing dp rank
  // Under pipeline parallelism replica 0 of each stage writes what the stage holds.
  if (pipeline_) {
    cg.writes = sharded_ ? mesh_->replicate_index == 0 : dp_rank_ == 0;
    cg.writers = pp_ * (sharded_ ? mesh_->shard : 1) * tp_;
  }
  if (pg_) {
    if (launch_.rank == 0) pg_->store_set("checkpoint/token", std::to_string(::getpid()));
    cg.token = pg_->store_get("checkpoint/token");
    cg.counter = [p = pg_.get()](const std::string& k, int64_t v) { return p->store_add(k, v); };
    cg.timeout = std::chrono::seconds(cfg_.comm.train_timeout_seconds);
  } else {
    cg.token = std::to_string(::getpid());
  }
  ckpt_ = std::make_unique<Checkpointer>(cfg_, cg, launch_.world_size);
  state_.model = model_.get();
  state_.optimizer = opt_.get();
  if (pipeline_)
    pipeline_->bind_checkpoint_state(
        state_, (!sharded_ || mesh_->shard_index == 0) && mesh_->tp_index == 0);
  // The loader's position (global samples and draws per source) is the same on every rank
  // and independent of the world size, so a resume on another layout continues it.
  state_.data_state = [this] { return loader_->state().to_json(); };
  state_.load_data_state = [this](const nlohmann::json& j) {
    loader_->load_state(LoaderState::from_json(j, ckpt_->root()));
  };
  // This run has not saved yet, so no folder of its own is among these (docs/checkpointing.md).
  if (cfg_.checkpoint.enable && launch_.rank == 0)
    for (const std::string& line : ckpt_->remove_stale_temporaries())
      log_info("=> checkpoint: " + line);
  const bool initial = !cfg_.checkpoint.initial_load_path.empty();
  if ((cfg_.checkpoint.enable || initial) && !hf_init_ && !cfg_.checkpoint.create_seed_checkpoint) {
    std::string what = load_checkpoint_agreed();
    log_info("=> checkpoint: " +
             (what.empty() ? "none found under " + ckpt_->root() + ", starting fresh" : what));
    if (what.rfind("resumed from", 0) == 0) trim_metrics_after(state_.step);
    if (what.rfind("resumed from", 0) == 0 && state_.step >= cfg_.training.steps)
      log_warn("the checkpoint is at step " + std::to_string(state_.step) +
               ", already at or past the last step (training.steps = " +
               std::to_string(cfg_.training.steps) +
               "): nothing to train; raise training.steps to continue");
  }
  // Pipeline replicas start equal without it: the same per-name streams or checkpoint.
  if (ddp_ && !pipeline_) ddp_->broadcast_state(*model_);
  if (mesh_) mesh_->start_training();  // the world and its sub-groups
  // Under pipeline parallelism the mesh's world is the stage group: the rest here.
  if (pipe_pg_) {
    pg_->start_training();
    pipe_pg_->start_training();
  }
}

// A resumed run re-trains the steps after its checkpoint, so the rows an earlier run logged
// past that step are dropped from this rank's metrics file: each step keeps one row, the
// one of the run that continued. Rewritten in place (same file), so the logger's open
// append-mode stream goes on at the new end.
void Trainer::trim_metrics_after(int64_t step) {
  if (!(launch_.rank == 0 || cfg_.metrics.save_for_all_ranks)) return;
  const std::string path =
      cfg_.job.dump_folder + "/" +
      (launch_.rank == 0 ? "metrics.jsonl"
                         : "metrics_rank" + std::to_string(launch_.rank) + ".jsonl");
  std::ifstream in(path, std::ios::binary);
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<int64_t>() > step) {
      ++dropped;
      continue;
    }
    kept += line + "\n";
  }
  in.close();
  if (dropped == 0) return;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << kept;
  log_info("=> metrics: dropped " + std::to_string(dropped) + " rows after step " +
           std::to_string(step) + " from " + path + " (an earlier run's, retrained now)");
}

// ---- the loop ------------------------------------------------------------------------------

int Trainer::write_seed_checkpoint() {
  // torchtitan's seed checkpoint: the initialised model (and buffers) as step 0, written like
  // its last save, loaded by a later run from the same folder or through initial_load_path.
  state_.step = 0;
  save(cfg_.checkpoint.last_save_model_only);
  ckpt_->wait();
  log_info("created seed checkpoint " + ckpt_->root() + "/step-0");
  return 0;
}

void Trainer::save(bool model_only) {
  // Every rank snapshots its part; rank 0 renames the folder once all parts are written.
  ckpt_->save(state_, model_only);
  if (pg_) pg_->barrier();
}

// ---- finish --------------------------------------------------------------------------------

void Trainer::finish() {
  const auto& cc = cfg_.checkpoint;
  if (cc.enable && state_.step == cfg_.training.steps) save(cc.last_save_model_only);
  ckpt_->wait();
  if (cc.enable && cc.last_save_in_hf) export_hf();
  // Rank 0 hosts the store: nobody leaves while a peer may still be in a collective.
  if (pg_) pg_->barrier();
  log_info("training done: " + std::to_string(cfg_.training.steps) + " steps");
}

void Trainer::export_hf() {
  const std::string dir = ckpt_->root() + "/step-" + std::to_string(state_.step) + "-hf";
  // Under FSDP or PP the whole model is assembled (collectives) into an unsharded CPU copy
  // on rank 0, which exports it.
  std::unique_ptr<Model> whole;
  if (sharded_ || pipeline_) {
    if (launch_.rank == 0) {
      // A CPU copy for export only: the experts backend is irrelevant there, and grouped_mm
      // (chosen for the GPU) cannot be built on the CPU.
      JobConfig ecfg = cfg_;
      ecfg.moe.experts_backend = "loop";
      whole = build_model(ecfg, at::kCPU);
    }
    gather_whole_model(whole.get());
  }
  if (launch_.rank == 0) {
    HfExportOptions o;
    o.dtype = hf_export_dtype(cfg_.checkpoint.export_dtype, "checkpoint.export_dtype");
    if (!std::filesystem::exists(dir)) export_model_hf(whole ? *whole : *model_, dir, o);
    log_info("checkpoint: Hugging Face weights (" + cfg_.checkpoint.export_dtype + ") in " + dir);
  }
}

// Every parameter whole: FSDP gathers a stage's shards over its shard group (every rank of
// the stage takes part); under PP the pipeline group of rank 0 then broadcasts each tensor
// from the pipeline rank that holds it. `whole` (rank 0 only) receives them and the buffers.
void Trainer::gather_whole_model(Model* whole) {
  at::NoGradGuard ng;
  const bool carrier = !pipeline_ || stage_pg_->rank() == 0;  // rank 0's pipeline group
  auto& all = model_->params().all();
  for (int64_t i = 0; i < model_->params().size(); ++i) {
    const Param& p = all[static_cast<size_t>(i)];
    const bool mine = !p.value.is_meta();
    at::Tensor full;
    if (mine) full = sharded_ ? sharded_->full_param(i) : p.value.detach();
    if (pipeline_ && carrier) {
      if (!mine) full = at::empty(p.full_shape(), at::TensorOptions().device(device_));
      full = full.to(at::kFloat).contiguous();
      pipeline_->broadcast_from_owner(full, pipeline_->rank_of_param(i));
    }
    if (whole) whole->params().all()[static_cast<size_t>(i)].value.copy_(full);
  }
  auto src = model_->buffers();
  for (size_t i = 0; i < src.size(); ++i) {
    at::Tensor t = src[i].second.detach().clone();
    if (pipeline_ && carrier)
      pipeline_->broadcast_from_owner(t, pipeline_->rank_of_buffer(src[i].first));
    if (whole) whole->buffers()[i].second.copy_(t);
  }
}

}  // namespace titan
