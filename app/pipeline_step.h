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

#include <memory>
#include <string>
#include <vector>

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

class PipelineTraining : public StepPhases {
 public:
  // `model` was built with its parameters deferred (meta): this allocates and initializes
  // from `seed` only those of this rank's stages, unless `allocate` is false (FSDP of the
  // stages: the caller shards params() and initializes them). `pp` is the pipeline group.
  PipelineTraining(const JobConfig& cfg, Model& model, ProcessGroup& pp, at::ScalarType dtype,
                   at::Device device, uint64_t seed, bool allocate = true);

  // Store indices of this rank's parameters, ascending (what the optimizer steps).
  const std::vector<int64_t>& params() const { return params_; }
  // One optimizer step. StepResult::loss is this rank's share of the global mean (zero on the
  // ranks without the last stage, so a sum over the ranks is the loss); grad_norm is the
  // global norm over every stage's gradients, on every rank.
  // `sync` sums the gradients over the pipeline's data-parallel replicas (null: none).
  StepResult step(Optimizer& opt, const std::vector<MicroBatch>& micro, const StepOptions& o,
                  GradSync* sync = nullptr);
  // The optimizer and gradient sync the phases below use (step() binds them too).
  void bind(Optimizer& opt, GradSync* sync);
  // StepPhases, for the capture check and the CUDA graphs (app/compiled_step.h): the schedule
  // over every micro-batch (the loss share); the data-parallel gradient reduction; the norm
  // over every stage, clipping, AdamW and the post-step update (the global norm).
  at::Tensor forward_backward(const std::vector<MicroBatch>& micro, const StepOptions& o) override;
  void reduce_gradients() override;
  at::Tensor optimizer(const StepOptions& o) override;
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
  Optimizer* opt_ = nullptr;
  GradSync* sync_ = nullptr;
  std::vector<at::Tensor> mine() const;   // this rank's parameters, in params_' order
  double compute_ms_ = 0, total_ms_ = 0;  // since take_measured_bubble
};

}  // namespace titan
