// Runs a pipeline rank's schedule (docs/distributed.md, "Pipeline parallel"): the rank's list
// of actions (parallel/pipeline_schedule.h), in order, over the model's stages this rank
// holds (parallel/pipeline_stages.h), with its transfers batched per tick over the pipeline
// group (parallel/pipeline_p2p.h).
//
// The model is one Model whose parameters outside this rank's stages were never allocated;
// a stage's forward is Model::forward_stage over its blocks, the last stage's adds
// Model::head_loss_sum. A stage's input that arrives from another stage is a leaf that
// requires grad, so its backward yields the gradient the schedule sends back.
//
// Split backwards (the zero-bubble schedules' I and W): a stage's forward under such a
// schedule routes its linear layers through deferrable_linear (core/kernels/weight_grad_store.h);
// I backpropagates with a WeightGradStore of the (stage, micro-batch) deferring, so the
// input gradient and the parameters outside the linear layers (norms, embeddings, the
// router's gate) get their gradients while the linear layers' and the routed experts' grad_w
// GEMMs are stashed (their grad_out and x); W runs those GEMMs and backpropagates them from the
// recorded weights. What stays in I is listed in docs/distributed.md ("Split backwards").
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/data/loader.h"
#include "core/kernels/weight_grad_store.h"
#include "core/train/model.h"
#include "parallel/pipeline_p2p.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/pipeline_stages.h"
#include "parallel/process_group.h"

namespace titan {

class PipelineRunner {
 public:
  // `pp` is the pipeline group (its rank r holds plan.stages_of_rank(r)); `schedule` is the
  // compute-only or lowered schedule for plan's stages (lowered here when it has no
  // transfers, and checked); `activation` is one micro-batch's hidden state
  // (micro-batch size, seq, dim), `dtype` the model's compute dtype.
  PipelineRunner(Model& model, ProcessGroup& pp, PipelineStagePlan plan,
                 const PipelineSchedule& schedule, std::vector<int64_t> activation,
                 at::ScalarType dtype, at::Device device);

  // The forward and backward of the schedule's micro-batches, `micro` (its size the
  // schedule's micro-batch count), through this rank's stages in its schedule's order. The
  // gradients accumulate into the parameters of this rank's stages; the objective of a
  // micro-batch is its summed token loss / `global_tokens` plus each MoE layer's
  // auxiliary loss / `aux_div`, as train_step's. Returns this rank's loss share (0-d): the
  // token-loss part of the micro-batches whose last stage is here, zero on other ranks.
  at::Tensor run(const std::vector<MicroBatch>& micro, double global_tokens, double aux_div);

  // Host time of the last run(): in this rank's compute actions, and in all. On the CPU
  // (synchronous kernels) 1 - compute / total is the rank's measured bubble; on CUDA the
  // kernels are asynchronous and these say nothing.
  double last_compute_ms() const { return compute_ms_; }
  double last_total_ms() const { return total_ms_; }

  // DualPipeV's paired forward + backward actions run overlapped (parallel/overlap_pair.h):
  // each expert all-to-all of one half is in flight while the other half computes. Off,
  // they run one after the other. Either way the numbers are the same.
  void set_overlap_pairs(bool on) { overlap_pairs_ = on; }
  // Pairs of the last run() that ran overlapped, and the turns they passed.
  int64_t last_overlapped_pairs() const { return overlapped_pairs_; }
  int64_t last_overlap_turns() const { return overlap_turns_; }

  int64_t rank() const { return rank_; }
  const std::vector<int64_t>& stages() const { return stages_; }  // this rank's, in order
  // Store indices of the parameters of this rank's stages (the model's ParamUnits
  // [first_unit, end_unit) of each), ascending.
  std::vector<int64_t> stage_params() const;

 private:
  using Key = std::pair<int64_t, int64_t>;  // stage, micro-batch
  void forward(const Action& a, const std::vector<MicroBatch>& micro, double global_tokens,
               double aux_div);
  void backward(const Action& a);
  void backward_weight(const Action& a);
  void transfer(const std::vector<Action>& batch);
  void reset();

  Model& model_;
  PipelineStagePlan plan_;
  PipelineSchedule schedule_;  // with its transfers
  int64_t rank_ = 0;
  std::vector<int64_t> stages_;
  std::unique_ptr<PipelineP2P> p2p_;
  // One step's state per (stage, micro-batch).
  std::map<Key, at::Tensor> input_;      // a stage's input leaf (not the first stage's)
  std::map<Key, at::Tensor> output_;     // a stage's output, until its backward
  std::map<Key, at::Tensor> objective_;  // the last stage's objective / another's aux term
  std::map<Key, at::Tensor> grad_out_;   // the gradient received for a stage's output
  std::map<Key, WeightGradStore> deferred_;  // an I's weight-gradient GEMMs, until its W
  bool split_ = false;                       // the schedule has W actions
  bool overlap_pairs_ = false;
  int64_t overlapped_pairs_ = 0, overlap_turns_ = 0;
  at::Tensor loss_;
  double compute_ms_ = 0, total_ms_ = 0;
};

}  // namespace titan
