// What a checkpoint holds and how the live training state goes into and out of one: the
// model (fp32 masters, sharded rows), AdamW moments and step counts, the model's buffers
// (MoE expert biases), the RNG, the step and the data loader's position. The file format is
// core/checkpoint/checkpoint.h; this is the wiring (docs/checkpointing.md).
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/checkpoint/checkpoint.h"
#include "core/config/config.h"
#include "core/train/model.h"
#include "core/train/optimizer.h"

namespace titan {

// The live training state a checkpoint captures and restores.
struct TrainingState {
  Model* model = nullptr;
  Optimizer* optimizer = nullptr;
  // The data loader's position, as JSON (independent of the world size).
  std::function<nlohmann::json()> data_state;
  std::function<void(const nlohmann::json&)> load_data_state;
  int64_t step = 0;            // optimizer steps completed
  int64_t lr_step_offset = 0;  // lr = schedule(step - offset); set when lr_scheduler is excluded
  // Pipeline parallelism: each rank holds some stages' parameters (the others are meta) and
  // the optimizer only theirs. opt_slot[i] is model parameter i's slot in the optimizer, -1
  // when another rank holds it; empty: every parameter, in order. A rank writes and reads the
  // parameters, moments and step counts it holds, and the buffers `holds_buffer` names.
  std::vector<int64_t> opt_slot;
  std::function<bool(const std::string&)> holds_buffer;
  // Pipeline parallelism with FSDP of the stages: every shard rank writes its rows, and only
  // this one (the stage's shard rank 0) the stage's unsharded values (step counts, buffers).
  bool stage_lead = true;
};

class Checkpointer {
 public:
  // A single process: no group.
  Checkpointer(const JobConfig& cfg, int64_t rank, int64_t world_size);
  Checkpointer(const JobConfig& cfg, CheckpointGroup group, int64_t world_size);

  const std::string& root() const { return writer_.root(); }
  // Restores from the latest complete checkpoint under root() (or checkpoint.load_step), else
  // from checkpoint.initial_load_path. Returns a description of what was loaded, or "" when
  // training starts fresh. Throws UserError for a missing or incompatible checkpoint.
  std::string load(TrainingState& st);
  // Saves step st.step (in the background with checkpoint.async_mode). model_only drops the
  // optimizer and training state and writes the model in checkpoint.export_dtype
  // (checkpoint.last_save_model_only on the final save).
  void save(const TrainingState& st, bool model_only);
  // Waits for a background save; rethrows its error.
  void wait() { writer_.wait(); }

  // Removes the step-N.tmp-PID folders of earlier runs whose writer (rank 0, process PID) is
  // gone: saves killed mid-write (kill -9, a node lost), never checkpoints, which would
  // otherwise stay forever. A folder whose PID is alive on this host is kept. Returns one
  // line per folder, removed or kept, for the log. Rank 0 only, before this run's first save.
  std::vector<std::string> remove_stale_temporaries() const;

  static std::vector<int64_t> complete_steps(const std::string& root) {
    return CheckpointWriter::complete_steps(root);
  }

 private:
  CheckpointSnapshot snapshot(const TrainingState& st, bool model_only);
  // Copies a tensor for the save: a fresh CPU tensor, or with async_with_pinned_mem a
  // reused (pinned, on CUDA) staging buffer filled by a non-blocking copy.
  at::Tensor stage(const std::string& key, const at::Tensor& t);
  void load_folder(const std::string& dir, TrainingState& st, bool model_only);
  void restore_model(CheckpointReader& r, TrainingState& st);
  void restore_optimizer(CheckpointReader& r, TrainingState& st);
  void restore_progress(CheckpointReader& r, TrainingState& st);
  bool excluded(const char* part) const;

  JobConfig cfg_;
  CheckpointGroup group_;
  int64_t world_;
  CheckpointWriter writer_;
  std::map<std::string, at::Tensor> staging_;  // async_with_pinned_mem: reused host buffers
  bool staged_on_device_ = false;              // a staging copy is in flight this save
};

}  // namespace titan
