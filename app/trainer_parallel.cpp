// The Trainer's parallelize phase (app/trainer.h): tensor, context and expert parallelism,
// then FSDP/HSDP or DDP over the data-parallel ranks, or the pipeline's stages with the same
// wrappers over each stage; the gradient sync the one step uses (docs/distributed.md).
#include "app/trainer.h"

#include <algorithm>
#include <sstream>

#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/train/float8_linears.h"
#include "moe/experts.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"

namespace titan {
namespace {

// The dtype gradients are summed in across data-parallel ranks (DDP and FSDP alike).
at::ScalarType reduce_dtype(const JobConfig& cfg) {
  return cfg.training.mixed_precision_reduce == "bfloat16" ? at::kBFloat16 : at::kFloat;
}

}  // namespace

// Tensor parallelism cuts the parameters first (parallel/tensor_parallel.h); FSDP then shards
// the slices over the data-parallel ranks of each tp index.
void Trainer::apply_tp() {
  if (tp_ == 1) return;
  const auto& cc = cfg_.checkpoint;
  if (cc.initial_load_in_hf || cc.last_save_in_hf)
    throw UserError("parallelism.tensor_parallel_degree = " + std::to_string(tp_) +
                    " with checkpoint.initial_load_in_hf / last_save_in_hf: Hugging Face import "
                    "and export of tensor-parallel slices are not implemented yet; allowed: "
                    "tensor_parallel_degree = 1, or both false (native checkpoints work)");
  if (cfg_.moe.seq_aux_loss_coeff > 0 && model_->num_experts() > 0)
    throw UserError("parallelism.tensor_parallel_degree = " + std::to_string(tp_) +
                    " with moe.seq_aux_loss_coeff > 0: the sequence-wise balance loss needs whole "
                    "sequences, and tensor parallelism routes sequence shards; allowed: "
                    "seq_aux_loss_coeff = 0 under tensor parallelism");
  // Expert tensor parallelism (etp = tp; config.cpp refuses other values): the routed experts
  // are cut along their hidden size as well, and with expert parallelism each tp index's ep
  // group exchanges the rows for its slices (docs/distributed.md).
  const int64_t etp = cfg_.parallelism.expert_tensor_parallel_degree;
  const bool split_experts = etp > 1 && model_->num_experts() > 0;
  const bool async = cfg_.parallelism.enable_async_tensor_parallel;
  tp_comm_ = apply_tensor_parallel(*model_, *mesh_->tp_group, split_experts, async);
  if (async)
    log_info(
        "=> async tensor parallel: the all-gathers before the column-parallel GEMMs and "
        "the reduce-scatters after the row-parallel ones run in chunks of the sequence, "
        "each overlapping another chunk's GEMM (forward and backward)");
  // The chunked ops run plain GEMMs; a float8 linear falls back to plain TP's composition
  // (parallel/tensor_parallel.cpp), so its collectives are not overlapped (docs/float8.md).
  if (async && float8_linear_enabled(cfg_))
    log_info(
        "=> async tensor parallel with float8 linears: the float8 linears keep plain TP's "
        "all-gather and reduce-scatter (not chunked, not overlapped); only the high-precision "
        "linears are chunked");
  if (split_experts) {
    int64_t mine = 0, whole = 0;
    const TpPlan& plan = model_->tp_plan();
    for (const auto* list : {&plan.expert_column, &plan.expert_row})
      for (int64_t i : *list) {
        const Param& p = model_->params()[i];
        mine += p.value.numel();
        whole += c10::multiply_integers(p.model_shape());
      }
    log_info("=> expert tensor parallel: etp " + std::to_string(etp) +
             ", the routed experts split along their hidden size (w1/w3 rows, w2 columns) over "
             "the tp ranks; each tp rank routes the whole sequence" +
             (cfg_.parallelism.expert_parallel_degree > 1
                  ? ", exchanges its rows over its tp index's ep group (ep " +
                        std::to_string(cfg_.parallelism.expert_parallel_degree) + ")"
                  : std::string()) +
             " and reduce-scatters the partial outputs; routed-expert parameters on this tp "
             "rank " +
             std::to_string(mine) + " of " + std::to_string(whole));
  }
}

EpExchangeOptions Trainer::ep_options() const {
  EpExchangeOptions o;
  // auto: static under capture (it needs fixed shapes and no host read), exact otherwise
  // (no drops and no worst-case buffer: docs/moe.md).
  const std::string& x = cfg_.moe.ep_exchange;
  o.fixed = x == "static" || (x == "auto" && cfg_.compile.enable);
  o.capacity_factor = cfg_.moe.ep_capacity_factor;
  o.drop_policy = cfg_.moe.ep_drop_policy == "probs" ? EpDropPolicy::Probs : EpDropPolicy::None;
  if (o.drop_policy == EpDropPolicy::Probs && !o.fixed)
    throw UserError(
        "moe.ep_drop_policy = \"probs\" drops rows over the static exchange's "
        "capacity, but moe.ep_exchange = \"" +
        x +
        "\" runs the exact exchange here, "
        "which drops nothing; allowed: ep_drop_policy = \"none\", or ep_exchange = "
        "\"static\" (\"auto\" with compile.enable)");
  return o;
}

void Trainer::set_expert_exchange(ProcessGroup& group) {
  const EpExchangeOptions o = ep_options();
  auto ex = make_expert_exchange(group, o);
  model_->set_expert_exchange(ex);
  EpCapacityPolicy p;
  p.rerun = o.fixed && o.drop_policy == EpDropPolicy::None;
  p.max_factor = std::max(cfg_.moe.ep_capacity_factor_max, o.capacity_factor);
  // Every rank re-runs or none: FSDP's gathers span several ep groups, and a pipeline's
  // transfers span the stages.
  if (pg_ && pg_->size() > group.size())
    p.agree = [w = pg_.get()](at::Tensor& flag) { w->allreduce(flag, ReduceOp::Max); };
  ep_control_ = std::make_unique<EpCapacityControl>(ex, p);
}

// Pipeline parallelism: tensor parallelism first (the stages' parameters become tp slices)
// and context parallelism (each rank runs its slice of every sequence through its stages),
// then only this rank's stages are allocated and drawn, sharded (FSDP, HSDP) or replicated
// (DDP) over the stage's data-parallel ranks. The MoE load counts of a layer live on its
// stage: summed over the stage group, never along the pipeline.
void Trainer::parallelize_pipeline() {
  apply_tp();
  // Context parallelism inside each stage: the stage group's cp ranks (same pipeline rank)
  // cut every micro-batch as a whole batch, and the pipeline links equal cp indices.
  if (cp_ > 1) log_info(apply_context_parallel(*model_, *mesh_->cp_group, cfg_));
  if (cfg_.parallelism.expert_parallel_degree > 1) set_expert_exchange(*mesh_->ep_group);
  pipeline_ = std::make_unique<PipelineTraining>(cfg_, *model_, *pipe_pg_,
                                                 bf16_ ? at::kBFloat16 : at::kFloat, device_,
                                                 static_cast<uint64_t>(cfg_.debug.seed),
                                                 /*allocate=*/!fsdp_);
  if (fsdp_) {
    // As torchtitan: no reshard after forward inside a step (the schedule runs each stage's
    // forward once per micro-batch), so a unit is gathered once per step.
    FsdpOptions fo;
    fo.param_dtype = bf16_ ? at::kBFloat16 : at::kFloat;
    fo.reduce_dtype = reduce_dtype(cfg_);
    fo.reshard_after_forward = false;
    fo.gather_once_per_step = true;
    fo.only_params = pipeline_->params();
    if (!cfg_.debug.comm_overlap) {
      fo.backward_prefetch = false;
      fo.max_inflight_reductions = 0;
    }
    if (float8_linear_enabled(cfg_) && cfg_.float8.enable_fsdp_float8_all_gather) {
      const std::vector<int64_t>& mine = fo.only_params;  // this rank's stages' float8 weights
      for (int64_t i : model_->float8_params())
        if (std::find(mine.begin(), mine.end(), i) != mine.end()) fo.float8_params.push_back(i);
      fo.float8_precompute = cfg_.float8.precompute_float8_dynamic_scale_for_fsdp;
    }
    sharded_ = std::make_unique<FullyShardedDataParallel>(*model_, *mesh_, fo);
    if (!hf_init_) model_->init_weights(static_cast<uint64_t>(cfg_.debug.seed));
    grad_sync_ = sharded_.get();
  } else if (mesh_->dp_degree() > 1) {
    // DDP replicas of the pipeline: each stage's parameters summed over its replicas once
    // the schedule is done (no overlap: a schedule's backwards interleave micro-batches).
    std::vector<at::Tensor> mine;
    for (int64_t i : pipeline_->params()) mine.push_back(model_->params()[i].value);
    ddp_ = std::make_unique<DataParallel>(*mesh_->replicate_group, mine, reduce_dtype(cfg_),
                                          25 << 20, /*overlap=*/false);
    grad_sync_ = ddp_.get();
  }
  if (tp_ > 1) {
    tp_sync_ = std::make_unique<TensorParallelGradSync>(*model_, *mesh_->tp_group, grad_sync_);
    grad_sync_ = tp_sync_.get();
  }
  // Each rank reads its stages' tensors (its rows of them under FSDP) from the folder.
  if (hf_init_) load_hf_init();
  if (mesh_->world->size() > 1)
    model_->set_dp_allreduce([g = mesh_->world](at::Tensor& t) { g->allreduce(t, ReduceOp::Sum); });
}

void Trainer::parallelize() {
  if (pp_ > 1) {
    parallelize_pipeline();
    return;
  }
  apply_tp();
  if (cp_ > 1) log_info(apply_context_parallel(*model_, *mesh_->cp_group, cfg_));
  const int64_t ep = cfg_.parallelism.expert_parallel_degree;
  if (ep > 1) {
    const int64_t E = model_->num_experts();
    if (E == 0)
      throw UserError("parallelism.expert_parallel_degree = " + std::to_string(ep) + ": model " +
                      cfg_.model.name +
                      " has no experts; allowed: 1 (or an MoE model: llama4, deepseek_v3)");
    if (E % ep != 0)
      throw UserError("parallelism.expert_parallel_degree = " + std::to_string(ep) +
                      " does not divide the " + std::to_string(E) + " experts of " +
                      cfg_.model.name + "/" + cfg_.model.flavor +
                      "; allowed: a divisor of the expert count that divides the shard degree " +
                      std::to_string(d_.dp_shard * cp_));
    if (mesh_) set_expert_exchange(*mesh_->ep_group);
  } else if (cfg_.debug.force_ep && mesh_ && model_->num_experts() > 0) {
    // As debug.force_fsdp: the expert-parallel exchange over a world of one rank, so its
    // collectives can be checked on a single GPU (scripts/gpu_check.sh).
    set_expert_exchange(*mesh_->world);
    log_info("=> expert parallel: the exchange runs over the world (debug.force_ep)");
  }
  if (fsdp_) {
    FsdpOptions fo;
    fo.param_dtype = bf16_ ? at::kBFloat16 : at::kFloat;
    fo.reduce_dtype = reduce_dtype(cfg_);
    fo.reshard_after_forward = cfg_.parallelism.fsdp_reshard_after_forward != "never";
    if (!cfg_.debug.comm_overlap) {
      fo.backward_prefetch = false;  // the forward prefetch predates the overlap work
      fo.max_inflight_reductions = 0;
    }
    if (float8_linear_enabled(cfg_) && cfg_.float8.enable_fsdp_float8_all_gather) {
      fo.float8_params = model_->float8_params();  // tensorwise: validate_config
      fo.float8_precompute = cfg_.float8.precompute_float8_dynamic_scale_for_fsdp;
    }
    sharded_ = std::make_unique<FullyShardedDataParallel>(*model_, *mesh_, fo);
    if (hf_init_)
      load_hf_init();
    else
      model_->init_weights(static_cast<uint64_t>(cfg_.debug.seed));
    grad_sync_ = sharded_.get();
  } else if (tp_ > 1) {
    // The deferred tp slices, allocated and drawn here; replicas (if any) all-reduce.
    model_->params().materialize();
    model_->init_weights(static_cast<uint64_t>(cfg_.debug.seed));
    const at::ScalarType reduce =
        cfg_.training.mixed_precision_reduce == "bfloat16" ? at::kBFloat16 : at::kFloat;
    if (mesh_->dp_degree() > 1) {
      ddp_ = std::make_unique<DataParallel>(*mesh_->replicate_group, model_->params().tensors(),
                                            reduce, 25 << 20, cfg_.debug.comm_overlap);
      grad_sync_ = ddp_.get();
    }
  } else if (pg_) {
    ddp_ = std::make_unique<DataParallel>(*pg_, model_->params().tensors(), reduce_dtype(cfg_),
                                          25 << 20, cfg_.debug.comm_overlap);
    grad_sync_ = ddp_.get();
  }
  if (tp_ > 1) {
    tp_sync_ = std::make_unique<TensorParallelGradSync>(*model_, *mesh_->tp_group, grad_sync_);
    grad_sync_ = tp_sync_.get();
  }
  if (pg_) {
    // MoE load counts are summed over every data-parallel rank so every rank updates its
    // expert biases identically.
    model_->set_dp_allreduce([p = pg_.get()](at::Tensor& t) { p->allreduce(t, ReduceOp::Sum); });
  }
}

// Async TP's boundaries since the last log line, chunked or fallen back to plain TP's
// composition (tp/async_chunked_calls, tp/async_fallback_calls), and one line naming the
// first fallback's reason: the fallback is never silent.
void Trainer::log_async_tp(std::map<std::string, double>& extra) {
  const TensorParallelComm::AsyncCounts c = tp_comm_->take_async_counts();
  extra["tp/async_chunked_calls"] = static_cast<double>(c.chunked);
  extra["tp/async_fallback_calls"] = static_cast<double>(c.fallback);
  if (c.fallback > 0 && !async_fallback_logged_) {
    async_fallback_logged_ = true;
    log_info("=> async tensor parallel: " + std::to_string(c.fallback) + " of " +
             std::to_string(c.chunked + c.fallback) +
             " sequence-parallel boundaries since the last log line ran plain TP's "
             "all-gather / reduce-scatter, not chunked (first reason: " +
             c.first_fallback + ")");
  }
}

}  // namespace titan
