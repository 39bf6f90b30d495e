// The training run, in phases that read top to bottom: distributed set-up, data, model and
// its parallelization, optimizer and schedule, resume, the loop, finish.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "app/checkpointer.h"
#include "app/compiled_step.h"
#include "app/data_setup.h"
#include "app/muon_layout.h"
#include "app/pipeline_step.h"
#include "app/preemption.h"
#include "app/train_step.h"
#include "core/config/config.h"
#include "core/data/blend.h"
#include "core/data/loader.h"
#include "core/train/lr_schedule.h"
#include "core/telemetry/metrics.h"
#include "core/train/model.h"
#include "core/train/optimizer.h"
#include "core/telemetry/profiler.h"
#include "core/tokenizer/tokenizer.h"
#include "parallel/ddp.h"
#include "parallel/expert_parallel.h"
#include "parallel/fsdp.h"
#include "parallel/launch_env.h"
#include "parallel/mesh.h"
#include "parallel/process_group.h"
#include "parallel/tensor_parallel.h"

namespace titan {

class Trainer {
 public:
  Trainer(const JobConfig& cfg, const LaunchEnv& launch);
  ~Trainer();
  // Sets up, trains and finishes. Returns the process exit status.
  int run();

 private:
  using Clock = std::chrono::steady_clock;

  // ---- set-up phases, in order
  void setup_distributed();
  void setup_data();
  // Every rank calls it once per raw-text source: the cache builders after building.
  void store_barrier(const std::string& name);
  void setup_model();
  void parallelize();
  void parallelize_pipeline();
  void gather_whole_model(Model* whole);
  void apply_tp();
  void log_comm_per_step(const std::map<std::string, ProcessGroup::CommCount>& before,
                         int64_t steps) const;
  // The expert-parallel exchange of moe.ep_exchange, ep_capacity_factor and ep_drop_policy
  // (UserError: the drop policy with the exact exchange).
  EpExchangeOptions ep_options() const;
  // Installs the exchange over `group` in the model, with its capacity control.
  void set_expert_exchange(ProcessGroup& group);
  // Fills the model (or this rank's shards of it) from checkpoint.initial_load_path.
  void warn_if_no_documents() const;
  void setup_float8();
  void probe_cpu_float8(float8::Options& opts);
  void log_async_tp(std::map<std::string, double>& extra);
  void load_hf_init();
  void setup_optimizer();
  void setup_step();
  void log_plan() const;
  void resume();
  std::string load_checkpoint_agreed();  // ckpt_->load on every rank, failing together
  // ---- the loop
  int train_loop();
  std::vector<MicroBatch> next_micro_batches();
  // False when the loss is not finite (the run stops with status 1).
  bool log_step(int64_t step, const StepResult& r, double lr);
  int report_non_finite_loss(int64_t step);
  void trim_metrics_after(int64_t step);
  void validate(int64_t step);
  void save(bool model_only);
  int write_seed_checkpoint();
  // ---- finish
  void finish();
  void export_hf();

  const JobConfig cfg_;
  const LaunchEnv launch_;
  const DerivedConfig d_;
  const Clock::time_point t_exec_;
  bool cuda_ = false, bf16_ = false;
  at::Device device_ = at::kCPU;

  std::unique_ptr<ProcessGroup> pg_;
  std::unique_ptr<Mesh> mesh_;
  bool fsdp_ = false;  // the model is sharded (FSDP, HSDP, expert parallelism)

  std::string tok_path_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Blend> blend_, val_blend_;  // val_blend_: validation.dataset_path, if given
  std::unique_ptr<Loader> loader_;

  bool hf_init_ = false;          // initial weights come from a Hugging Face folder
  double nonfinite_loss_ = 0;     // the loss log_step found nan or inf
  int64_t last_finite_step_ = 0;  // the last step whose loss log_step read finite
  bool preempted_ = false;        // the loop stopped for a pre-emption signal (after saving)
  std::unique_ptr<Model> model_;
  int64_t pp_ = 1;  // parallelism.pipeline_parallel_degree
  // Pipeline parallelism, outermost in the mesh (global rank = stage rank x dp + dp rank):
  // the ranks of this rank's stage group (the mesh's world) and of its pipeline.
  std::unique_ptr<ProcessGroup> stage_pg_, pipe_pg_;
  std::unique_ptr<PipelineTraining> pipeline_;  // this rank's stages, their schedule
  std::unique_ptr<FullyShardedDataParallel> sharded_;
  std::unique_ptr<DataParallel> ddp_;
  std::unique_ptr<TensorParallelGradSync> tp_sync_;
  std::shared_ptr<TensorParallelComm> tp_comm_;  // tensor parallelism's collectives
  bool async_fallback_logged_ = false;
  GradSync* grad_sync_ = nullptr;
  int64_t tp_ = 1;       // parallelism.tensor_parallel_degree
  int64_t cp_ = 1;       // parallelism.context_parallel_degree
  int64_t dp_rank_ = 0;  // this rank's data shard (the global rank / (cp x tp))
  std::unique_ptr<ShardedMatrixLayout> muon_layout_;  // optimizer.name = "Muon" only
  std::unique_ptr<Optimizer> opt_;
  std::unique_ptr<LRSchedule> sched_;

  StepInputs inputs_;                              // the step's persistent input buffers
  std::unique_ptr<EpCapacityControl> ep_control_;  // expert parallelism (app/ep_capacity.h)
  // The one step's phases: the whole model's, or the pipeline's (app/train_step.h).
  std::unique_ptr<StepPhases> phases_;
  std::unique_ptr<CompiledStep> compiled_;  // compile.enable: captured (CUDA) or checked (CPU)
  std::unique_ptr<StepProfiler> profiler_;
  std::unique_ptr<MetricsLogger> metrics_;
  std::unique_ptr<Checkpointer> ckpt_;
  TrainingState state_;
  std::unique_ptr<PreemptionAgreement> preempt_;

  // Accumulated since the last log line.
  Clock::time_point t_last_log_;
  int64_t tokens_since_log_ = 0;
  double data_ms_ = 0;          // host time the steps waited for data, since the last log line
  int64_t replays_logged_ = 0;  // compiled_->replays() at the last log line
  std::unique_ptr<PhaseTimer> phase_timer_;  // forward+backward and optimizer time per step
};

}  // namespace titan
