// The device mesh: world = dp_replicate x dp_shard, with the expert-parallel degree borrowed
// from dp_shard (torchtitan's dp2ep): dp_shard = efsdp x ep, where experts are split over
// the ep ranks and sharded (FSDP) over the efsdp ranks (docs/distributed.md).
//
// Tensor parallelism is the innermost dimension, as torchtitan orders its mesh
// [dp_replicate, dp_shard, tp]: global rank = dp_rank * tp + tp_index, with
// dp_rank = (replicate_index * dp_shard) + shard_index and
// shard_index = efsdp_index * ep + ep_index, so a tp group is a run of adjacent ranks (one
// node's GPUs) and an ep group a run of adjacent dp ranks.
//
// Context parallelism folds into the shard dimension, as torchtitan's dp_shard_cp: `shard`
// is dp_shard x cp and shard_index = dp_shard_index x cp + cp_index, so FSDP shards the
// parameters over (and sums the gradients of) every rank of dp_shard x cp, while the cp ranks
// of one data-parallel rank read the same batch (dp_rank divides the cp index out) and each
// run its slice of every sequence (parallel/context_parallel.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/process_group.h"

namespace titan {

struct Mesh {
  int64_t replicate = 1, shard = 1, ep = 1, tp = 1, cp = 1;  // shard: dp_shard x cp
  int64_t replicate_index = 0, shard_index = 0, ep_index = 0, efsdp_index = 0, tp_index = 0;
  int64_t cp_index = 0;
  int64_t efsdp() const { return shard / ep; }
  // This rank's place among the data-parallel ranks (its data shard), and their number; the
  // cp ranks of a data-parallel rank share it.
  int64_t dp_rank() const { return (replicate_index * shard + shard_index) / cp; }
  int64_t dp_degree() const { return replicate * shard / cp; }

  // The groups this rank belongs to. A group spanning the whole world is the world itself,
  // and one of a single rank runs locally, so no communicator is created twice.
  // Every group but the world and tp_group holds ranks of one tp index.
  ProcessGroup* world = nullptr;            // every rank
  ProcessGroup* shard_group = nullptr;      // same replicate index
  ProcessGroup* replicate_group = nullptr;  // same shard index
  ProcessGroup* ep_group = nullptr;         // same replicate and efsdp index (ep > 1 only)
  ProcessGroup* efsdp_group = nullptr;      // same replicate and ep index (ep > 1 only)
  ProcessGroup* tp_group = nullptr;         // same dp rank (tp > 1 only)
  ProcessGroup* cp_group = nullptr;         // same dp rank and tp index (cp > 1 only)

  // Switches the world and every sub-group from the init timeout to the train timeout.
  void start_training();
  // "dp_replicate 2 x dp_shard 2 (ep 1)", for the startup log.
  std::string describe() const;

  std::vector<std::unique_ptr<ProcessGroup>> owned;  // the sub-groups that are not the world
};

// Creates the sub-groups this rank belongs to. The degrees were validated against the world
// size by validate_for_world. `shard` is data_parallel_shard_degree; cp multiplies it.
std::unique_ptr<Mesh> build_mesh(ProcessGroup& world, int64_t replicate, int64_t shard, int64_t ep,
                                 int64_t tp = 1, int64_t cp = 1);

}  // namespace titan
