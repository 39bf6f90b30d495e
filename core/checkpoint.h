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

class Checkpointer {
 public:
  // dp_size: the data-parallel degree the loader position refers to (0: world_size). A
  // replicated run saves one copy (rank 0 of world 1) of a loader that runs at dp ranks.
  Checkpointer(const JobConfig& cfg, int64_t rank, int64_t world_size, int64_t dp_size = 0);
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
  struct Snapshot {
    int64_t step = 0;
    std::vector<std::pair<std::string, at::Tensor>> tensors;  // CPU copies
    std::string train_state_json;
  };
  Snapshot snapshot(const TrainingState& st, bool model_only) const;
  void write(const Snapshot& s);  // throws UserError; leaves the previous checkpoint intact
  void load_folder(const std::string& dir, TrainingState& st, bool model_only,
                   const std::vector<std::string>& exclude);
  void prune();

  JobConfig cfg_;
  int64_t rank_, world_, dp_;
  std::string root_;
  std::thread writer_;
  std::exception_ptr writer_error_;
};

// Pre-emption: SIGTERM and SIGUSR1 set a flag that the train loop polls after each step.
void install_preemption_handlers();
int preemption_signal();  // 0 when none arrived

}  // namespace titan
