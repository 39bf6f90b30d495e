// Sharded, atomic, resumable checkpoints.
//
// Layout: <job.dump_folder>/<checkpoint.folder>/step-N/
//   rank-RRRRR.safetensors  this rank's shards (model, optimizer state, buffers, RNG)
//   metadata.json           every global tensor: shape, dtype, and which rows of dim 0 each
//                           shard holds, so a checkpoint saved on N ranks loads on M
//   train_state.json        step, data-loader positions per rank, world size, the config
// Each save goes to step-N.tmp-<pid> and is renamed to step-N only when every file is on
// disk, so a folder named step-N is always complete (docs/checkpointing.md).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/data.h"
#include "core/optimizer.h"
#include "models/model.h"

namespace titan {

// The live training state a checkpoint captures and restores.
struct TrainingState {
  Model* model = nullptr;
  AdamW* optimizer = nullptr;
  PackedLoader* loader = nullptr;
  int64_t step = 0;            // optimizer steps completed
  int64_t lr_step_offset = 0;  // lr = schedule(step - offset); set when lr_scheduler is excluded
};

// How the ranks of a job share one save. A single process needs none of it (the default).
// Sharded parameters (Param::sharded) are written by every rank with `writes`; everything
// else (replicated values) by rank 0 only. Rank 0 merges the per-rank parts into
// metadata.json and renames the folder once every writer has reported its file.
struct CheckpointGroup {
  int64_t rank = 0;
  bool writes = true;   // this rank writes its shards (replicate index 0)
  int64_t writers = 1;  // ranks that write
  std::string token;    // the same on every rank: names the shared temp folder
  // Counter in the job's store (ProcessGroup::store_add); unset for one process.
  std::function<int64_t(const std::string& key, int64_t delta)> counter;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // waiting for the writers
};

class Checkpointer {
 public:
  // dp_size: the data-parallel degree the loader position refers to (0: world_size); every
  // rank's loader runs in lockstep, so one position (rank 0's) is saved.
  Checkpointer(const JobConfig& cfg, int64_t rank, int64_t world_size, int64_t dp_size = 0);
  Checkpointer(const JobConfig& cfg, CheckpointGroup group, int64_t world_size, int64_t dp_size);
  ~Checkpointer();

  const std::string& root() const { return root_; }
  // Restores from the latest complete checkpoint under root() (or checkpoint.load_step), else
  // from checkpoint.initial_load_path. Returns a description of what was loaded, or "" when
  // training starts fresh. Throws UserError for a missing or incompatible checkpoint.
  std::string load(TrainingState& st);
  // Saves step st.step (async when checkpoint.async_mode says so). model_only drops the
  // optimizer and training state (checkpoint.last_save_model_only on the final save).
  void save(const TrainingState& st, bool model_only);
  // Waits for a background save; rethrows its error.
  void wait();

  // Steps of the complete checkpoints under `root`, ascending.
  static std::vector<int64_t> complete_steps(const std::string& root);

 private:
  struct Entry {
    std::string key;
    at::Tensor t;                       // CPU copy of this rank's rows
    std::vector<int64_t> global_shape;  // of the whole tensor
    int64_t dim0_offset = 0;            // first global row in t
  };
  struct Snapshot {
    int64_t step = 0;
    std::vector<Entry> entries;  // what this rank writes
    std::string train_state_json;
  };
  Snapshot snapshot(const TrainingState& st, bool model_only) const;
  void write(const Snapshot& s);  // throws UserError; leaves the previous checkpoint intact
  void load_folder(const std::string& dir, TrainingState& st, bool model_only,
                   const std::vector<std::string>& exclude);
  void prune();

  void finalize(const std::string& tmp, const Snapshot& s);  // rank 0: merge, rename

  JobConfig cfg_;
  CheckpointGroup group_;
  int64_t rank_, world_, dp_;
  std::string root_;
  std::thread writer_;
  std::exception_ptr writer_error_;
};

// Pre-emption: SIGTERM and SIGUSR1 set a flag that the train loop polls after each step.
void install_preemption_handlers();
int preemption_signal();  // 0 when none arrived

}  // namespace titan
