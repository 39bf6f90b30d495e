// Training under pipeline parallelism (docs/distributed.md, "Pipeline parallel"): this
// rank's stages of the model, the schedule that runs them (parallel/pipeline_runner.h) and
// the optimizer step over their parameters, with the gradient norm taken over every stage.
//
// The step is train_step's with the forward and backward replaced by the schedule: each of
// the loader's micro-batches (gradient accumulation) is cut into the schedule's micro-batches
// of parallelism.pipeline_parallel_microbatch_size sequences and run through the pipeline;
// the loss, the auxiliary loss and the gradients are those of one process on the same
// global batch.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "app/checkpointer.h"
#include "app/pipeline_dump.h"
#include "app/train_step.h"
#include "core/config/config.h"
#include "core/train/model.h"
#include "core/train/optimizer.h"
#include "parallel/pipeline_runner.h"
#include "parallel/process_group.h"

namespace titan {

// What a stage's activation holds of each sequence: 1 / (cp x tp) of its tokens (context
// parallel slices, each sequence-parallel over the tp ranks).
int64_t stage_seq_divisor(const JobConfig& cfg);

class PipelineTraining {
 public:
  // `model` was built with its parameters deferred (meta): this allocates and initializes
  // from `seed` only those of this rank's stages, unless `allocate` is false (FSDP of the
  // stages: the caller shards params() and initializes them). `pp` is the pipeline group.
  PipelineTraining(const JobConfig& cfg, Model& model, ProcessGroup& pp, at::ScalarType dtype,
                   at::Device device, uint64_t seed, bool allocate = true);

  // Store indices of this rank's parameters, ascending (what the optimizer steps).
  const std::vector<int64_t>& params() const { return params_; }
  // This rank's parameters, in params()' order.
  std::vector<at::Tensor> param_tensors() const;
  // The schedule over every loader micro-batch, each cut into the schedule's micro-batches;
  // returns this rank's loss share (zero on the ranks without the last stage, so a sum over
  // the ranks is the loss). `sync`: the replicas' gradient sync (null: none).
  at::Tensor forward_backward(const std::vector<MicroBatch>& micro, const StepObjective& obj,
                              const StepTestHooks& hooks, GradSync* sync);
  // Sums a squared gradient norm over the pipeline ranks (every stage's share of the one norm).
  void reduce_norm_sq_over_stages(at::Tensor& norm_sq);
  // A log step's metrics: this rank's idle share (pp/bubble_scheduled, and on the CPU
  // pp/bubble_measured), and only its own stages' MoE layer loads (the others' entries are
  // zero counts here and are dropped).
  void log_metrics(std::map<std::string, double>& extra, bool cuda);
  // What a checkpoint of this rank holds: its stages' optimizer slots and buffers;
  // `stage_lead`: this rank writes the stage's step counts and buffers (shard and tp rank 0).
  void bind_checkpoint_state(TrainingState& st, bool stage_lead);
  // Broadcasts `t` over the pipeline group from pipeline rank `owner` (a stage's tensor to
  // the rank assembling the whole model).
  void broadcast_from_owner(at::Tensor& t, int64_t owner) { pp_.broadcast(t, owner); }
  // Validation: the summed token loss of `batch` (validation.local_batch_size sequences, cut
  // into pipeline micro-batches) through the stages' forwards alone, no gradient; on the
  // ranks holding the last stage, zero elsewhere. Call under NoGradGuard.
  at::Tensor eval_loss_sum(const MicroBatch& batch);
  // Whether this rank holds the last stage (it scores the tokens).
  bool holds_last_stage() const;
  // "pipeline parallel 2 (1F1B, 2 stages, 4 micro-batches of 1): this rank holds stage 0:
  // tok_embeddings, layers.0-2"
  std::string describe() const;
  // This rank's idle share of the schedule's simulated ticks (ScheduleTimeline), and the
  // one measured on the host since the last call (1 - compute / schedule time; -1 when
  // nothing ran). The measure means something on the CPU only (synchronous kernels).
  double scheduled_bubble() const;
  double take_measured_bubble();
  // The pipeline rank whose stages hold model parameter i, and buffer `name` (a layer's
  // buffers live with the layer, the others on rank 0, as holds_buffer says).
  int64_t rank_of_param(int64_t i) const;
  int64_t rank_of_buffer(const std::string& name) const;
  // Whether transformer layer l is in one of this rank's stages.
  bool holds_layer(int64_t l) const;
  // Whether a model buffer ("layers.<l>.moe.expert_bias") belongs to this rank's stages: those
  // of layer l do when it holds layer l; any other to the first stage's rank.
  bool holds_buffer(const std::string& name) const;

 private:
  const JobConfig& cfg_;
  Model& model_;
  ProcessGroup& pp_;
  PipelinePlan plan_;
  bool overlap_logged_ = false;  // the first step's count of overlapped pairs
  std::unique_ptr<PipelineRunner> runner_;
  std::unique_ptr<PipelineRunner> eval_runner_;  // forwards only, validation's shapes
  at::ScalarType dtype_;
  at::Device device_;
  std::vector<int64_t> params_;
  double compute_ms_ = 0, total_ms_ = 0;  // since take_measured_bubble
};

// What a pipeline plugs into the one step (app/train_step.h): the schedule as the
// forward+backward, its stages' parameters for the gradient reduction and the optimizer, and
// the pipeline group for the gradient norm.
class PipelineStepPhases : public StepPhases {
 public:
  PipelineStepPhases(PipelineTraining& pipeline, Model& model, Optimizer& opt, GradSync* sync,
                     const StepObjective& objective, const StepTestHooks& hooks = {})
      : StepPhases(model, opt, sync, objective, hooks), pipeline_(pipeline) {}
  at::Tensor forward_backward(const std::vector<MicroBatch>& micro) override {
    return pipeline_.forward_backward(micro, objective_, hooks_, sync_);
  }

 protected:
  std::vector<at::Tensor> stepped_params() override { return pipeline_.param_tensors(); }
  void reduce_norm_sq_beyond_sync(at::Tensor& norm_sq) override {
    pipeline_.reduce_norm_sq_over_stages(norm_sq);
  }

 private:
  PipelineTraining& pipeline_;
};

}  // namespace titan
