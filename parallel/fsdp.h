// Fully sharded data parallelism (FSDP, and HSDP with a replicate dimension).
//
// Every parameter is split along dim 0 over its shard group; the ParamStore then holds only
// this rank's rows (padded to an equal row count per rank), so parameters, gradients and
// AdamW state take about 1/N of the memory. Parameters are grouped into units: one per
// transformer block, one for the token embeddings and one for the final norm and output.
//
// The model asks Model::weight(i) for a full weight. The first request of a unit in a
// forward all-gathers the whole unit (one collective) through an autograd function whose
// backward reduce-scatters the full gradients back to the shards (in fp32). After a block's
// forward its gathered weights are released (fsdp_reshard_after_forward) and gathered again
// when the gradient reaches the block's output in backward. HSDP then sums the shard
// gradients over the replicate group once per step. Expert weights under expert parallelism
// hold only this ep rank's experts and are sharded over the remaining (efsdp) ranks
// (docs/distributed.md).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/train/grad_sync.h"
#include "core/train/model.h"
#include "core/train/optimizer.h"
#include "parallel/process_group.h"
#include "parallel/mesh.h"

namespace titan {

struct FsdpOptions {
  at::ScalarType param_dtype = at::kFloat;   // dtype of the all-gather and of compute
  at::ScalarType reduce_dtype = at::kFloat;  // dtype of the gradient reduce-scatter
  bool reshard_after_forward = true;         // blocks only; the root units stay gathered
  bool prefetch = true;                      // forward: start the next unit's all-gather early
  bool backward_prefetch = true;             // backward: start the previous block's regather early
  // Reduce-scatters (and HSDP's replica all-reduces) started in backward and not yet waited
  // for, at most; a new one first waits for the oldest beyond this (memory: each holds its
  // unit's full-size gradient buffer until done). 0: no overlap, every reduce-scatter (and
  // replica all-reduce) is waited for as soon as it starts.
  int64_t max_inflight_reductions = 2;
  // Float8 all-gather (quantize.linear.float8.enable_fsdp_float8_all_gather, docs/float8.md):
  // these store indices, the float8 linears' weights (tensorwise recipe), are gathered as e4m3
  // bytes, cast from the fp32 shards with the scale of the whole weight (448 / its amax, the
  // shards' amaxes all-reduced with max), and handed to the model in that form: the float8
  // linear uses the gathered bytes as they are. Their gradients reach the shards through the
  // reduce-scatter as the others'. Empty: every weight is gathered in param_dtype.
  std::vector<int64_t> float8_params;
  // precompute_float8_dynamic_scale_for_fsdp: the float8 weights' scales are computed after
  // each optimizer step, all at once (one fused amax, one all-reduce), instead of one
  // all-reduce per unit at each forward gather.
  bool float8_precompute = false;
  // Pipeline parallelism: only these store indices (this rank's stages) are sharded; the
  // rest stay unallocated (meta). Empty: every parameter.
  std::vector<int64_t> only_params;
  // Pipeline parallelism: a unit is gathered once per step and every later forward of the
  // step (the schedule's other micro-batches) gets aliases of the same full weights, each
  // with its own autograd node (its own reduce-scatter in backward); the full weights are
  // freed when reduce_gradients ends the step. Needs reshard_after_forward = false.
  bool gather_once_per_step = false;
};

class FullyShardedDataParallel : public GradSync {
 public:
  // Shards `model`'s parameters in place and installs its weight and block hooks. Call
  // before creating the optimizer (which must see the shards). Every rank must hold the
  // same full parameters on entry (the same seed, or the same checkpoint).
  FullyShardedDataParallel(Model& model, Mesh& mesh, const FsdpOptions& opts);
  ~FullyShardedDataParallel() override;

  void begin_micro_batch(bool last) override { last_micro_batch_ = last; }
  // Waits for the reduce-scatters that backward started (and HSDP's replica all-reduces,
  // started as each unit's reduce-scatter finishes in the last backward) and writes the
  // shard gradients. A step whose backwards never ran as the last micro-batch (a pipeline
  // schedule's, begin_micro_batch(false) before it) all-reduces every unit over the replicas
  // here, once.
  void reduce_gradients(const std::vector<at::Tensor>& params) override;
  // gather_once_per_step: frees the units gathered since the last step (an evaluation's
  // forwards), so that the next forward gathers again.
  void release_gathered();
  // Sums the squared norm of the local shards over the shard group.
  void reduce_norm_sq(at::Tensor& norm_sq) override;
  // With float8_precompute: the next step's float8 all-gather scales, from the updated shards.
  void after_optimizer_step() override;

  // The whole of parameter i (fp32, on every rank of its group): a collective, for exports.
  at::Tensor full_param(int64_t i);
  // Parameter i's shard group: the ranks whose padded rows make its whole rows (Muon's owner
  // plan exchanges the update's rows over it, app/muon_layout.h).
  ProcessGroup& shard_group(int64_t i) const;
  // Human-readable layout for the startup log.
  std::string describe() const;
  int64_t num_units() const;

 private:
  struct Unit;
  struct Gather;
  struct Regather;
  struct Reduction;
  struct Replication;
  // Cuts parameter i to this rank's rows and appends it to unit u (index ui).
  void shard_param(Unit& u, int64_t ui, int64_t i);
  at::Tensor weight(int64_t i);
  // gather_once_per_step: fresh aliases of unit u's gathered weights for another forward.
  void alias_full(Unit& u);
  at::Tensor after_block(int64_t block, const at::Tensor& out);
  // A rank's flat share of unit u: its shards in param_dtype, or with float8 weights its
  // bytes (float8 ones cast with `scales`, one per float8 weight of u).
  at::Tensor pack(const Unit& u, const std::vector<at::Tensor>& shards, const at::Tensor& scales);
  // regather: the backward's gather of a released unit, which reuses its forward's scales.
  void prefetch(Unit& u, bool regather);
  // Float8 all-gather: the byte layout of unit u's rows; the scales of its float8 weights for
  // a forward gather (fp32, one each); the precomputed scales of every float8 weight.
  void layout_float8(Unit& u);
  at::Tensor float8_scales(Unit& u, const std::vector<at::Tensor>& shards);
  void precompute_float8_scales();
  void reduce_over_tp(at::Tensor& amax) const;  // max over the tp group, when there is one
  // Copies the gathered rows (grid, one row per rank) into the unit's full weights.
  void unpack(Unit& u, const at::Tensor& grid, bool refill);
  void gather_into(Unit& u, const std::vector<at::Tensor>& shards, bool refill);
  void start_reduce_scatter(Unit& u, const std::vector<at::Tensor>& grads);
  void finish_oldest_reduction();
  std::vector<at::Tensor> shards_of(int64_t unit) const;  // its parameters' shards, in order
  void start_replication(int64_t unit);
  void release(Unit& u);

  Model& model_;
  Mesh& mesh_;
  FsdpOptions opts_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<std::pair<int64_t, int64_t>> where_;  // param -> (unit, position in unit)
  std::vector<std::vector<int64_t>> block_units_;   // block -> its units
  std::vector<Reduction> reductions_;  // in flight, in start order (the same on every rank)
  std::vector<Replication> replications_;
  bool last_micro_batch_ = true;
  // Precomputed float8 scales (float8_precompute): slot j is float8 weight f8_order_[j]; each
  // unit's weights are consecutive slots. The buffer is written in place, so a captured
  // optimizer step and forward read and write the same memory every replay.
  std::vector<int64_t> f8_order_;
  at::Tensor f8_scales_;  // (slots) fp32
};

// Bytes of parameters and optimizer state held by this rank (what sharding divides).
int64_t local_state_bytes(const Model& model, Optimizer& opt);
// The same for the whole model, unsharded (fp32 parameters + exp_avg + exp_avg_sq).
int64_t full_state_bytes(const Model& model);

}  // namespace titan
