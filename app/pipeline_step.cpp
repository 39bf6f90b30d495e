#include "app/pipeline_step.h"

#include <ATen/record_function.h>

#include <cstdlib>
#include <sstream>

namespace titan {

PipelineTraining::PipelineTraining(const JobConfig& cfg, Model& model, ProcessGroup& pp,
                                   at::ScalarType dtype, at::Device device, uint64_t seed)
    : cfg_(cfg), model_(model), pp_(pp) {
  plan_ = plan_pipeline(cfg, model.info().n_layers, /*tied_embeddings=*/false);
  const auto& par = cfg.parallelism;
  std::vector<int64_t> activation{par.pipeline_parallel_microbatch_size, cfg.training.seq_len,
                                  model.info().dim};
  runner_ = std::make_unique<PipelineRunner>(model, pp, plan_.stages, plan_.schedule,
                                             std::move(activation), dtype, device);
  params_ = runner_->stage_params();
  model.params().materialize(params_);
  model.init_weights(seed);  // draws only the allocated parameters (the streams are by name)
}

bool PipelineTraining::holds_layer(int64_t l) const {
  for (int64_t s : runner_->stages()) {
    const PipelineStageSpec& spec = plan_.stages.stages[static_cast<size_t>(s)];
    if (l >= spec.first_layer && l < spec.end_layer) return true;
  }
  return false;
}

double PipelineTraining::scheduled_bubble() const {
  const ScheduleTimeline& t = plan_.timeline;
  const int64_t busy = t.busy[static_cast<size_t>(runner_->rank())];
  return t.makespan > 0 ? 1.0 - static_cast<double>(busy) / static_cast<double>(t.makespan) : 0;
}

double PipelineTraining::take_measured_bubble() {
  const double b = total_ms_ > 0 ? 1.0 - compute_ms_ / total_ms_ : -1;
  compute_ms_ = total_ms_ = 0;
  return b;
}

bool PipelineTraining::holds_buffer(const std::string& name) const {
  const std::string prefix = "layers.";
  if (name.rfind(prefix, 0) == 0) return holds_layer(std::atoll(name.c_str() + prefix.size()));
  return runner_->rank() == 0;
}

std::string PipelineTraining::describe() const {
  std::ostringstream os;
  const PipelineStagePlan& sp = plan_.stages;
  os << "pipeline parallel " << sp.pp_degree << " (" << sp.schedule.name << ", " << sp.num_stages()
     << " stages, " << plan_.microbatches << " micro-batches of "
     << cfg_.parallelism.pipeline_parallel_microbatch_size << ", bubble "
     << plan_.timeline.bubble_fraction << "): this rank holds";
  for (int64_t s : runner_->stages()) {
    const PipelineStageSpec& spec = sp.stages[static_cast<size_t>(s)];
    os << " stage " << s << " [";
    for (size_t i = 0; i < spec.fqns.size(); ++i) os << (i ? " " : "") << spec.fqns[i];
    os << "]";
  }
  return os.str();
}

StepResult PipelineTraining::step(AdamW& opt, const std::vector<MicroBatch>& micro,
                                  const StepOptions& o, GradSync* sync) {
  auto mark = [&o](PhaseTimer::Phase p) {
    if (o.timer) o.timer->mark(p);
  };
  opt.set_lr(o.lr);
  mark(PhaseTimer::kStart);
  const int64_t mbs = cfg_.parallelism.pipeline_parallel_microbatch_size;
  const int64_t n = plan_.microbatches;
  // The auxiliary loss of a pipeline micro-batch is a mean over its sequences: the step's is
  // the mean over every sequence, as train_step's.
  const double aux_div = static_cast<double>(micro.size() * n) * static_cast<double>(o.dp_degree);
  StepResult r;
  for (const MicroBatch& big : micro) {
    TORCH_CHECK(big.tokens.size(0) == n * mbs, "pipeline step: a micro-batch of ",
                big.tokens.size(0), " sequences for ", n, " pipeline micro-batches of ", mbs);
    std::vector<MicroBatch> pieces;
    for (int64_t k = 0; k < n; ++k)
      pieces.push_back({big.tokens.narrow(0, k * mbs, mbs), big.labels.narrow(0, k * mbs, mbs)});
    at::Tensor loss = runner_->run(pieces, o.global_tokens, aux_div);
    compute_ms_ += runner_->last_compute_ms();
    total_ms_ += runner_->last_total_ms();
    r.loss = r.loss.defined() ? r.loss + loss : loss;
  }
  std::vector<at::Tensor> mine;
  for (int64_t i : params_) mine.push_back(model_.params()[i].value);
  if (sync) sync->reduce_gradients(mine);
  mark(PhaseTimer::kForwardBackwardDone);
  RECORD_USER_SCOPE("titan::optimizer");
  at::Tensor norm_sq = grad_norm_sq(mine);
  if (sync) sync->reduce_norm_sq(norm_sq);
  pp_.allreduce(norm_sq, ReduceOp::Sum);  // every stage's share of the one norm
  r.grad_norm = at::sqrt(norm_sq);
  clip_grad_norm(mine, o.max_norm, r.grad_norm);
  opt.step();
  model_.weights_updated();
  opt.zero_grad();
  model_.after_optimizer_step();
  if (sync) sync->after_optimizer_step();
  mark(PhaseTimer::kOptimizerDone);
  return r;
}

}  // namespace titan
