// The checkpoint file format: sharded, atomic, resharding on load.
//
// Layout: <root>/step-N/
//   rank-RRRRR.safetensors  one rank's tensors (its rows of sharded ones)
//   metadata.json           every global tensor: shape, dtype, and which rows of dim 0 each
//                           file holds, so a checkpoint saved on N ranks loads on M
//   train_state.json        the step, data-loader position, world size, the config
// Each save goes to step-N.tmp-<token> and is renamed to step-N only when every file is on
// disk, so a folder named step-N is always complete (docs/checkpointing.md). What goes into
// a checkpoint (model, optimizer, loader) is the app's business (app/checkpointer.h).
#pragma once

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/checkpoint/safetensors.h"

namespace titan {

// One tensor of a save: this rank's rows [dim0_offset, dim0_offset + t.size(0)) of a global
// tensor of global_shape (all of it when unsharded).
struct CheckpointEntry {
  std::string key;
  at::Tensor t;
  std::vector<int64_t> global_shape;
  int64_t dim0_offset = 0;
};

// What one rank contributes to a save. The tensors are ready to write (CPU), or about to
// be once `ready` returns (a device-to-host copy still in flight).
struct CheckpointSnapshot {
  int64_t step = 0;
  std::vector<CheckpointEntry> entries;
  std::string train_state_json;  // rank 0's train_state.json
  std::function<void()> ready;   // waits for the copies; empty when there are none
};

// How the ranks of a job share one save. A single process needs none of it (the default).
// Rank 0 merges the per-rank parts into metadata.json and renames the folder once every
// writer has reported its file.
struct CheckpointGroup {
  int64_t rank = 0;
  bool writes = true;   // this rank writes a file (replicate index 0 under HSDP)
  int64_t writers = 1;  // ranks that write
  std::string token;    // the same on every rank: names the shared temp folder
  // Counter in the job's store (ProcessGroup::store_add); unset for one process.
  std::function<int64_t(const std::string& key, int64_t delta)> counter;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // waiting for the writers
};

class CheckpointWriter {
 public:
  CheckpointWriter(std::string root, CheckpointGroup group, int64_t world_size,
                   int64_t keep_latest_k);
  ~CheckpointWriter();

  const std::string& root() const { return root_; }
  // Test seam (debug.checkpoint_delay_ms): sleep this long between writing a save's files
  // and its rename into place, a slow disk.
  void set_test_delay_ms(int64_t ms) { test_delay_ms_ = ms; }
  // Writes the snapshot now, or in a background thread when `async` (after waiting for the
  // previous one). Throws UserError for a failed save; the previous checkpoint is kept.
  void save(CheckpointSnapshot s, bool async);
  // Waits for a background save; rethrows its error.
  void wait();

  // Steps of the complete checkpoints under `root`, ascending.
  static std::vector<int64_t> complete_steps(const std::string& root);

 private:
  void write(const CheckpointSnapshot& s);
  void finalize(const std::string& tmp, const CheckpointSnapshot& s);  // rank 0: merge, rename
  void prune();

  std::string root_;
  CheckpointGroup group_;
  int64_t world_;
  int64_t keep_latest_k_;
  int64_t test_delay_ms_ = 0;
  std::thread writer_;
  std::exception_ptr writer_error_;
};

// One complete step-N folder, read on demand. Every inconsistency is a UserError naming the
// folder and the tensor.
class CheckpointReader {
 public:
  explicit CheckpointReader(std::string dir);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& train_state() const { return train_state_; }
  bool contains(const std::string& key) const;
  // Keys starting with `prefix`, with their global shapes.
  std::vector<std::pair<std::string, std::vector<int64_t>>> keys(const std::string& prefix) const;
  // Copies rows [begin, begin + rows) (rows -1: all) of tensor `key`, whose global shape must
  // be `want`, into dst (converting the dtype). Returns false when the checkpoint lacks the
  // tensor and it is not `required`. The rows may come from any number of files: this is where
  // a checkpoint saved on N ranks is resharded.
  bool restore_rows(const std::string& key, const std::vector<int64_t>& want, int64_t begin,
                    int64_t rows, at::Tensor dst, bool required);
  // The whole tensor `key` (nullopt when absent).
  std::optional<at::Tensor> get(const std::string& key);

 private:
  // Rows [begin, begin + count) assembled from the shards that overlap them, with the
  // tensor's global shape; nullopt when absent.
  std::optional<std::pair<at::Tensor, std::vector<int64_t>>> fetch_rows(const std::string& key,
                                                                        int64_t begin,
                                                                        int64_t count);
  SafetensorsFile& file(const std::string& name);

  std::string dir_;
  nlohmann::json meta_, train_state_;
  std::map<std::string, SafetensorsFile> files_;
};

}  // namespace titan
