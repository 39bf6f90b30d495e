#include "app/pipeline_step.h"

#include <ATen/record_function.h>

#include <cstdlib>
#include <sstream>

#include "core/base/log.h"

namespace titan {

int64_t stage_seq_divisor(const JobConfig& cfg) {
  return cfg.parallelism.context_parallel_degree * cfg.parallelism.tensor_parallel_degree;
}

PipelineTraining::PipelineTraining(const JobConfig& cfg, Model& model, ProcessGroup& pp,
                                   at::ScalarType dtype, at::Device device, uint64_t seed,
                                   bool allocate)
    : cfg_(cfg), model_(model), pp_(pp), dtype_(dtype), device_(device) {
  // A tied output (no output.weight: Llama-3.2, the small Qwen3) cannot be cut (exit 2).
  plan_ = plan_pipeline(cfg, model.info().n_layers,
                        /*tied_embeddings=*/model.params().index_of("output.weight") < 0);
  const auto& par = cfg.parallelism;
  // Under tensor parallelism the blocks pass sequence shards (sequence parallel): each tp
  // rank sends its own shard to the same tp rank of the next stage. Under context
  // parallelism a rank holds T/cp tokens of each sequence (its head-tail chunks), sent to the
  // rank of the same cp index.
  std::vector<int64_t> activation{par.pipeline_parallel_microbatch_size,
                                  cfg.training.seq_len / stage_seq_divisor(cfg), model.info().dim};
  runner_ = std::make_unique<PipelineRunner>(model, pp, plan_.stages, plan_.schedule,
                                             std::move(activation), dtype, device);
  params_ = runner_->stage_params();
  runner_->set_overlap_pairs(plan_.overlap_pairs);  // DualPipeV's pairs (plan_pipeline)
  if (!allocate) return;
  model.params().materialize(params_);
  model.init_weights(seed);  // draws only the allocated parameters (the streams are by name)
}

bool PipelineTraining::holds_last_stage() const {
  return plan_.stages.stage_to_rank().back() == runner_->rank();
}

at::Tensor PipelineTraining::eval_loss_sum(const MicroBatch& batch) {
  const int64_t mbs = cfg_.parallelism.pipeline_parallel_microbatch_size;
  const int64_t n = batch.tokens.size(0) / mbs;
  if (!eval_runner_) {
    const auto& v = cfg_.validation;
    TORCH_CHECK(v.local_batch_size % mbs == 0, "validation batch ", v.local_batch_size,
                " for micro-batches of ", mbs);  // validate_config refuses it
    std::vector<int64_t> activation{mbs, v.seq_len / stage_seq_divisor(cfg_), model_.info().dim};
    const PipelineStagePlan& sp = plan_.stages;
    eval_runner_ = std::make_unique<PipelineRunner>(
        model_, pp_, sp, make_forward_schedule(sp.stage_to_rank(), sp.pp_degree, n),
        std::move(activation), dtype_, device_);
  }
  std::vector<MicroBatch> pieces;
  for (int64_t k = 0; k < n; ++k)
    pieces.push_back({batch.tokens.narrow(0, k * mbs, mbs), batch.labels.narrow(0, k * mbs, mbs)});
  return eval_runner_->run(pieces, /*global_tokens=*/1.0, /*aux_div=*/1.0);
}

int64_t PipelineTraining::rank_of_param(int64_t i) const {
  const std::vector<ParamUnit> units = model_.param_units();
  for (const PipelineStageSpec& spec : plan_.stages.stages)
    for (int64_t u = spec.first_unit(); u < spec.end_unit(); ++u)
      for (int64_t k : units[static_cast<size_t>(u)].params)
        if (k == i) return spec.rank;
  TORCH_CHECK(false, "PipelineTraining: parameter ", i, " is in no stage");
}

int64_t PipelineTraining::rank_of_buffer(const std::string& name) const {
  const std::string prefix = "layers.";
  if (name.rfind(prefix, 0) != 0) return 0;
  const int64_t l = std::atoll(name.c_str() + prefix.size());
  for (const PipelineStageSpec& spec : plan_.stages.stages)
    if (l >= spec.first_layer && l < spec.end_layer) return spec.rank;
  return 0;
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
  if (plan_.overlap_pairs)
    os << "; each forward + backward pair overlaps its expert all-to-alls "
          "(pipeline_parallel_expert_parallel_overlap)";
  else if (plan_.has_pairs && cfg_.parallelism.expert_parallel_degree > 1)
    os << "; the forward + backward pairs run one after the other"
       << (cfg_.compile.enable ? " (compile.enable: the captured step is one stream)"
                               : " (pipeline_parallel_expert_parallel_overlap = false)");
  return os.str();
}

at::Tensor PipelineTraining::forward_backward(const std::vector<MicroBatch>& micro,
                                              const StepObjective& obj, const StepTestHooks& hooks,
                                              GradSync* sync) {
  const int64_t mbs = cfg_.parallelism.pipeline_parallel_microbatch_size;
  const int64_t n = plan_.microbatches;
  // The auxiliary loss of a pipeline micro-batch is a mean over its sequences: the step's is
  // the mean over every sequence, as the plain step's.
  const double aux_div = static_cast<double>(micro.size() * n) * static_cast<double>(obj.dp_degree);
  // The schedule interleaves the backwards of its micro-batches, so no backward is "the last
  // micro-batch's": the replicas' gradients are summed in reduce_gradients, once.
  if (sync) sync->begin_micro_batch(false);
  at::Tensor total;
  for (const MicroBatch& big : micro) {
    TORCH_CHECK(big.tokens.size(0) == n * mbs, "pipeline step: a micro-batch of ",
                big.tokens.size(0), " sequences for ", n, " pipeline micro-batches of ", mbs);
    std::vector<MicroBatch> pieces;
    for (int64_t k = 0; k < n; ++k)
      pieces.push_back({big.tokens.narrow(0, k * mbs, mbs), big.labels.narrow(0, k * mbs, mbs)});
    at::Tensor loss = runner_->run(pieces, obj.global_tokens, aux_div);
    // Whenever the schedule has pairs under expert parallelism, overlapped or not: the count
    // says what ran (0 with pipeline_parallel_expert_parallel_overlap = false).
    if (plan_.has_pairs && cfg_.parallelism.expert_parallel_degree > 1 && !overlap_logged_) {
      overlap_logged_ = true;
      log_info("=> pipeline: " + std::to_string(runner_->last_overlapped_pairs()) +
               " forward + backward pairs ran overlapped, passing the turn " +
               std::to_string(runner_->last_overlap_turns()) +
               " times at their expert all-to-alls");
    }
    if (hooks.plant_host_read && holds_last_stage()) plant_host_read(loss);
    compute_ms_ += runner_->last_compute_ms();
    total_ms_ += runner_->last_total_ms();
    total = total.defined() ? total + loss : loss;
  }
  return total;
}

std::vector<at::Tensor> PipelineTraining::param_tensors() const {
  std::vector<at::Tensor> out;
  for (int64_t i : params_) out.push_back(model_.params()[i].value);
  return out;
}

void PipelineTraining::reduce_norm_sq_over_stages(at::Tensor& norm_sq) {
  pp_.allreduce(norm_sq, ReduceOp::Sum);
}

void PipelineTraining::log_metrics(std::map<std::string, double>& extra, bool cuda) {
  const std::string prefix = "moe/layer";
  for (auto it = extra.begin(); it != extra.end();) {
    const std::string& k = it->first;
    if (k.rfind(prefix, 0) == 0 && !holds_layer(std::atoll(k.c_str() + prefix.size())))
      it = extra.erase(it);
    else
      ++it;
  }
  extra["pp/bubble_scheduled"] = scheduled_bubble();
  const double measured = take_measured_bubble();
  if (!cuda && measured >= 0) extra["pp/bubble_measured"] = measured;
}

void PipelineTraining::bind_checkpoint_state(TrainingState& st, bool stage_lead) {
  st.opt_slot.assign(static_cast<size_t>(model_.params().size()), -1);
  for (size_t k = 0; k < params_.size(); ++k)  // ascending, the optimizer's order
    st.opt_slot[static_cast<size_t>(params_[k])] = static_cast<int64_t>(k);
  st.holds_buffer = [this](const std::string& name) { return holds_buffer(name); };
  st.stage_lead = stage_lead;
}

}  // namespace titan
