#include "app/trainer.h"

#include <cstdio>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "app/fatal.h"
#include "core/train/float8_linears.h"
#include "core/telemetry/cuda_info.h"
#include "core/base/errors.h"
#include "core/train/functional.h"
#include "core/base/log.h"
#include "core/base/timing.h"
#include "models/hf_interop.h"
#include "models/registry.h"
#include "moe/experts.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"

namespace titan {
namespace {

std::string human(int64_t n) {
  std::ostringstream os;
  os.precision(3);
  if (n >= 1000000000)
    os << n / 1e9 << "B";
  else if (n >= 1000000)
    os << n / 1e6 << "M";
  else if (n >= 1000)
    os << n / 1e3 << "K";
  else
    os << n;
  return os.str();
}

}  // namespace

Trainer::Trainer(const JobConfig& cfg, const LaunchEnv& launch)
    : cfg_(cfg),
      launch_(launch),
      d_(derive_config(cfg, launch.world_size)),
      t_exec_(Clock::now()) {}

Trainer::~Trainer() = default;

int Trainer::run() {
  install_preemption_handlers();
  log_info("resolved config:\n" + config_table(cfg_));
  if (cfg_.job.print_config) log_info("\n" + dump_config_toml(cfg_));
  setup_distributed();
  setup_data();
  setup_model();
  parallelize();
  setup_optimizer();
  setup_step();
  log_plan();
  resume();
  if (cfg_.checkpoint.create_seed_checkpoint) return write_seed_checkpoint();
  const int status = train_loop();
  if (status == 0 && !preempted_) finish();
  return status;
}

// ---- set-up ------------------------------------------------------------------------------

namespace {

// training.device -> whether this rank trains on CUDA. "auto" takes CUDA when a GPU is
// visible. A LOCAL_RANK with no GPU of its own is a launch error (more ranks per node than
// GPUs), never a silent fall back to GPU 0 or the CPU.
bool resolve_cuda(const std::string& device, int64_t local_rank) {
  if (device == "cpu") return false;
  const int64_t gpus = cuda_device_count();
  if (device == "cuda" && gpus == 0)
    throw UserError(
        "training.device = \"cuda\": no CUDA device is visible to this process "
        "(CUDA_VISIBLE_DEVICES='" +
        std::string(std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES")
                                                        : "") +
        "'); allowed here: cpu, auto");
  if (gpus == 0) return false;
  if (local_rank >= gpus)
    throw UserError("LOCAL_RANK " + std::to_string(local_rank) + " has no GPU: this node shows " +
                    std::to_string(gpus) + " CUDA device(s) (0.." + std::to_string(gpus - 1) +
                    "); start at most " + std::to_string(gpus) +
                    " ranks per node, or train on the CPU with --training.device cpu");
  return true;
}

}  // namespace

void Trainer::setup_distributed() {
  cuda_ = resolve_cuda(cfg_.training.device, launch_.local_rank);
  // Before any CUDA work: this rank's GPU is the current device for NCCL and every op.
  if (cuda_) cuda_set_device(static_cast<int>(launch_.local_rank));
  device_ = cuda_ ? at::Device(at::kCUDA, static_cast<int>(launch_.local_rank)) : at::kCPU;
  phase_timer_ = std::make_unique<PhaseTimer>(cuda_);
  // bf16 compute on the GPU; on the CPU only under the capture check, so that it certifies
  // the op stream (bf16 casts, the same grouped and loss paths) the GPU step runs
  // (docs/compile.md). A plain CPU run stays in fp32.
  bf16_ = cfg_.training.mixed_precision_param == "bfloat16" && (cuda_ || cfg_.compile.enable);
  if (cfg_.debug.deterministic) {
    at::globalContext().setDeterministicAlgorithms(true, false);
    if (cuda_) setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  }
  if (cuda_ && cfg_.compile.enable) {
    // NCCL collectives inside a captured graph: no host-blocking wait, no NaN-check kernel
    // that reads on the host (docs/compile.md). Read when the process group is made.
    setenv("TORCH_NCCL_BLOCKING_WAIT", "0", 1);
    setenv("TORCH_NCCL_NAN_CHECK", "0", 1);
  }
  // torchrun with one rank still gets a process group (torchrun --nproc_per_node 1 runs
  // the same collective code path, e.g. a one-GPU NCCL check).
  if (launch_.world_size > 1 || launch_.source == "torchrun") {
    pg_ = std::make_unique<ProcessGroup>(launch_, cfg_.comm, cuda_);
    pg_->check_same_config(config_hash(cfg_));
    tp_ = cfg_.parallelism.tensor_parallel_degree;
    pp_ = cfg_.parallelism.pipeline_parallel_degree;
    cp_ = cfg_.parallelism.context_parallel_degree;
    ProcessGroup* mesh_world = pg_.get();
    if (pp_ > 1) {
      // torchtitan's order, the pipeline outermost: the world is pp blocks of dp x tp ranks.
      const int64_t inner = launch_.world_size / pp_, me = launch_.rank % inner;
      std::vector<int64_t> stage, pipe;
      for (int64_t i = 0; i < inner; ++i) stage.push_back(launch_.rank - me + i);
      for (int64_t s = 0; s < pp_; ++s) pipe.push_back(s * inner + me);
      stage_pg_ = pg_->subgroup("pp_stage", stage);
      pipe_pg_ = pg_->subgroup("pp", pipe);
      mesh_world = stage_pg_.get();
    }
    mesh_ = build_mesh(*mesh_world, cfg_.parallelism.data_parallel_replicate_degree, d_.dp_shard,
                       cfg_.parallelism.expert_parallel_degree, tp_, cp_);
    dp_rank_ = mesh_->dp_rank();
  }
  // dp_shard > 1 (or expert parallelism) shards the model (FSDP, HSDP with replicas);
  // otherwise the replicas hold it whole and all-reduce gradients (DDP). The test seam
  // debug.force_fsdp shards even over one rank, so FSDP's collectives run on a single GPU.
  fsdp_ = mesh_ && (mesh_->shard > 1 || mesh_->ep > 1 || cfg_.debug.force_fsdp);
  // Pure replication, sharding or both: the dp rank is the global rank (dp degree = world).
  auto allreduce_max = [p = pg_.get()](at::Tensor& t) { p->allreduce(t, ReduceOp::Max); };
  preempt_ = std::make_unique<PreemptionAgreement>(
      pg_ ? std::function<void(at::Tensor&)>(allreduce_max) : nullptr, device_);
}

void Trainer::store_barrier(const std::string& name) {
  if (!pg_) return;
  // Through the store, not a collective: building a cache may take longer than any
  // collective timeout, and the builders arrive only when done.
  const std::string key = "barrier/" + name;
  pg_->store_add(key, 1);
  while (pg_->store_add(key, 0) < launch_.world_size)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

void Trainer::setup_data() {
  tok_path_ = resolve_tokenizer_path(cfg_.model);
  tokenizer_ = load_tokenizer(tok_path_);
  // Token files must hold ids this run's tokenizer makes: a file of a 2048-token tokenizer
  // under the 258-token byte tokenizer is another tokenizer's data (the model pads its
  // vocabulary, so its size alone would let such ids through). A tokenizer larger than the
  // model is refused by setup_model.
  const int64_t vocab = std::min(model_vocab_size(cfg_), tokenizer_->vocab_size());
  RawTextContext raw;
  raw.tokenizer = tokenizer_.get();
  raw.tokenizer_path = tok_path_;
  raw.builder = launch_.local_rank == 0;
  int64_t barriers = 0;
  raw.barrier = [this, &barriers] { store_barrier("tokcache/" + std::to_string(barriers++)); };
  raw.log = [](const std::string& line) { log_info("=> " + line); };
  const auto& t = cfg_.training;
  blend_ = open_blend(dataset_specs(t.dataset, t.dataset_path, t.dataset_weights, "training"),
                      vocab, t.holdout_fraction, raw);
  // Validation keys are resolved only when validation runs.
  const auto& v = cfg_.validation;
  if (v.enable && !v.dataset_path.empty())
    val_blend_ =
        open_blend(dataset_specs(v.dataset, v.dataset_path, {}, "validation"), vocab, 0.0, raw);
  // Too little validation data is found now, before training, not at the first validation.
  if (v.enable)
    ValidationReader(val_blend_ ? *val_blend_ : *blend_, /*holdout=*/!val_blend_, v.seq_len,
                     v.local_batch_size, dp_rank_, d_.dp_degree, device_);
  loader_ =
      std::make_unique<Loader>(*blend_, t.seq_len, t.local_batch_size, dp_rank_, d_.dp_degree,
                               d_.grad_accum_steps, static_cast<uint64_t>(cfg_.debug.seed), device_,
                               /*prefetch_depth=*/2);
}

void Trainer::setup_model() {
  const auto& cc = cfg_.checkpoint;
  const std::string ckpt_root = (std::filesystem::path(cfg_.job.dump_folder) / cc.folder).string();
  // Initial weights load with or without checkpoint.enable (which is about saving and
  // resuming); with it, only when the run has no checkpoint of its own to resume.
  hf_init_ = cc.initial_load_in_hf && !cc.initial_load_path.empty() &&
             (!cc.enable || Checkpointer::complete_steps(ckpt_root).empty());
  // Sharded runs leave the parameters unallocated until FSDP has cut them, then initialize
  // (or read from the Hugging Face folder) only their own rows: no rank ever holds the whole
  // model.
  model_ = build_model(cfg_, device_, /*defer_params=*/fsdp_ || tp_ > 1 || pp_ > 1);
  model_->set_documents(model_document_options(cfg_, tokenizer_->eos_id()));  // docs/attention.md
  if (const DocumentOptions& d = model_->documents(); d.active())
    log_info(std::string("=> attention: ") + attn_mask_name(d.mask) + " (" +
             attn_type_name(d.type) + "), documents end at EOS " + std::to_string(d.eos_id) +
             ", document positions " + (d.positions ? "on" : "off") + ", document loss " +
             (d.loss ? "on" : "off"));
  warn_if_no_documents();
  if (cfg_.model.name == "llama3" && cfg_.model.flavor.rfind("hf:", 0) == 0) {
    const Llama3Args a = llama3_flavor(cfg_.model.flavor);
    const std::string match = llama3_matching_flavor(a);
    log_info("=> model: flavor " + cfg_.model.flavor + ": " + describe_llama3_args(a) + " (" +
             (match.empty() ? "a custom flavor" : "as the built-in flavor " + match) + ")");
  }
  const ModelInfo& info = model_->info();
  if (tokenizer_->vocab_size() > info.vocab_size)
    throw UserError("tokenizer '" + tok_path_ + "' has a vocabulary of " +
                    std::to_string(tokenizer_->vocab_size()) + " tokens but model " +
                    cfg_.model.name + "/" + cfg_.model.flavor + " has " +
                    std::to_string(info.vocab_size) +
                    "; allowed: a tokenizer vocabulary at most the model's (models pad theirs)");
  if (cfg_.training.seq_len > info.max_seq_len)
    throw UserError("training.seq_len = " + std::to_string(cfg_.training.seq_len) +
                    " exceeds what " + cfg_.model.name + "/" + cfg_.model.flavor +
                    " supports; allowed: <= " + std::to_string(info.max_seq_len));
  if (cfg_.validation.enable && cfg_.validation.seq_len > info.max_seq_len)
    throw UserError("validation.seq_len = " + std::to_string(cfg_.validation.seq_len) +
                    " exceeds the model's max_seq_len " + std::to_string(info.max_seq_len));
  if (bf16_) model_->set_compute_dtype(at::kBFloat16);
  setup_float8();
  if (apply_activation_checkpointing(*model_, cfg_.activation_checkpoint) == "op")
    log_info(
        "=> activation checkpointing: selective op (GEMM and attention outputs saved, "
        "the ops between them recomputed)");
  if (cc.initial_load_in_hf || cc.last_save_in_hf)  // validate_config: both can act
    require_hf_supported(*model_, "checkpoint.initial_load_in_hf / last_save_in_hf");
  if (hf_init_ && !fsdp_ && tp_ == 1 && pp_ == 1) load_hf_init();
}

// Documents end at EOS: data without one in its first million tokens would make block-causal
// attention, per-document positions and loss all equal the plain model, silently.
void Trainer::warn_if_no_documents() const {
  const DocumentOptions& d = model_->documents();
  if (!d.active() || !blend_) return;
  for (size_t i = 0; i < blend_->size(); ++i) {
    auto [read, eos] = blend_->count_in_prefix(i, d.eos_id, int64_t{1} << 20);
    if (read > 0 && eos == 0)
      log_warn("model.attn_mask_type / document_positions / document_loss: the first " +
               std::to_string(read) + " training tokens of '" + blend_->source(i).spec() +
               "' hold no EOS (id " + std::to_string(d.eos_id) +
               "), so they form one document and the mask, positions and loss act as plain "
               "causal; tokenize with an EOS after each document (docs/attention.md)");
  }
}

// model.converters = ["float8"]: the model's linears (not the output, embedding or router)
// compute in float8 unless filtered (core/train/float8_linears.h, docs/float8.md).
void Trainer::setup_float8() {
  if (!float8_linear_enabled(cfg_)) return;
  const Float8Section& f = cfg_.float8;
  float8::Options opts;
  opts.recipe = *float8::parse_recipe(f.recipe_name);  // the registry admits only these names
  opts.emulate = f.emulate;
  if (cuda_ && !opts.emulate) {
    // torchtitan's rule: float8 GEMMs need SM89 or later; emulation must be asked for.
    CudaDeviceInfo ci = cuda_device_info(device_.index());
    if (ci.major * 10 + ci.minor < 89)
      throw UserError(
          "model.converters = [\"float8\"] needs a GPU of compute capability 8.9 or "
          "later, but " +
          ci.name + " is sm_" + std::to_string(ci.major) + std::to_string(ci.minor) +
          "; allowed: quantize.linear.float8.emulate = true (emulated float8 GEMMs)");
  }
  if (!cuda_ && !opts.emulate && opts.recipe == float8::Recipe::Tensorwise) probe_cpu_float8(opts);
  Float8Plan plan = plan_float8_linears(model_->params(), f.filter_fqns, opts.recipe);
  if (tp_ > 1) keep_tp_replicated_high_precision(model_->tp_plan(), model_->params(), plan);
  model_->set_float8(opts, plan.converted);
  std::string filtered;
  for (size_t i = 0; i < plan.filtered.size(); ++i) {
    if (i == 3) {
      filtered += ", ...";
      break;
    }
    filtered += (i ? ", " : " (") + plan.filtered[i] + ": " + plan.filtered_reasons[i];
  }
  if (!plan.filtered.empty()) filtered += ")";
  log_info("=> " + float8::describe(opts, device_) + "; " + std::to_string(plan.converted.size()) +
           " linears converted, " + std::to_string(plan.filtered.size()) + " filtered" + filtered +
           "; output, embedding and router in high precision");
  // torchtitan applies the float8 all-gather only where FSDP shards (dp_shard > 1).
  if (f.enable_fsdp_float8_all_gather && !fsdp_)
    log_info(
        "=> float8: enable_fsdp_float8_all_gather has nothing to gather without FSDP "
        "(parallelism.data_parallel_shard_degree 1): the weights are cast where they are, "
        "as torchtitan does");
}

// ATen's CPU _scaled_mm is hundreds of times slower than the emulation on some processors
// (core/kernels/float8_linear.h): measured once at start, and emulated where it is slow. The
// ranks agree (the slowest rank's verdict), so every rank computes the same numbers.
void Trainer::probe_cpu_float8(float8::Options& opts) {
  const float8::CpuProbe p = float8::probe_cpu_scaled_mm(bf16_ ? at::kBFloat16 : at::kFloat,
                                                         cfg_.debug.float8_plant_slow_scaled_mm_ms);
  bool slow = p.slow;
  if (pg_) {
    at::Tensor t = at::full({1}, slow ? 1.0 : 0.0, at::TensorOptions().device(device_));
    pg_->allreduce(t, ReduceOp::Max);
    slow = t.item<double>() > 0;
  }
  opts.cpu_scaled_mm = !slow;
  log_info(std::string("=> float8: ") + p.describe() +
           (slow ? (p.slow ? ": too slow, the CPU GEMMs are emulated (same recipe, fp32 "
                             "arithmetic of the dequantized operands)"
                           : ": another rank measured it too slow, the CPU GEMMs are emulated")
                 : ": using it"));
}

void Trainer::load_hf_init() {
  const std::string& dir = cfg_.checkpoint.initial_load_path;
  const HfImportStats stats = import_model_hf(*model_, dir);
  std::string most;
  if (pg_) {
    // The most any rank read: with FSDP about 1/shard of the folder.
    at::Tensor t = at::full({1}, static_cast<double>(stats.bytes_read),
                            at::TensorOptions().dtype(at::kDouble).device(device_));
    pg_->allreduce(t, ReduceOp::Max);
    std::ostringstream os;
    os.setf(std::ios::fixed);
    os.precision(3);
    os << " (at most " << t.item<double>() / 1048576.0 << " MiB on any rank)";
    most = os.str();
  }
  log_info("=> checkpoint: initialized from Hugging Face weights in " + dir + ": " +
           stats.describe() + " on rank 0" + most);
}

void Trainer::setup_optimizer() {
  const bool decay_all = cfg_.optimizer.weight_decay_scope == "all";  // torchtitan's rule
  std::vector<OptParam> params;
  std::vector<OptimizerKind> kinds;
  const auto& all = model_->params().all();
  // Routed over the whole model, so a param_groups entry for another stage's parameters is
  // not "matching nothing" here.
  const std::vector<OptimizerKind> routed = route_model(*model_, cfg_.optimizer);
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].value.is_meta()) continue;  // another pipeline stage's
    params.push_back({all[i].name, all[i].value, decay_all || all[i].weight_decay,
                      all[i].model_shape(), static_cast<int64_t>(i)});
    kinds.push_back(routed[i]);
  }
  // Muon's owner plan for matrices split over ranks (app/muon_layout.h).
  if (cfg_.optimizer.name == "Muon")
    muon_layout_ = std::make_unique<ShardedMatrixLayout>(*model_, sharded_.get(),
                                                         mesh_ ? mesh_->tp_group : nullptr);
  opt_ = std::make_unique<Optimizer>(params, kinds, cfg_.optimizer, muon_layout_.get());
  if (cfg_.optimizer.name == "Muon") log_info(describe_muon_plan(*opt_, pg_.get()));
  sched_ = std::make_unique<LRSchedule>(cfg_.lr_scheduler, cfg_.optimizer.lr, cfg_.training.steps);
  const bool writer = launch_.rank == 0 || cfg_.metrics.save_for_all_ranks;
  profiler_ =
      std::make_unique<StepProfiler>(cfg_.profiling, cfg_.job.dump_folder, launch_.rank, cuda_);
  metrics_ = std::make_unique<MetricsLogger>(
      cfg_.job.dump_folder, writer, cfg_.metrics.enable_tensorboard, cfg_.metrics.save_tb_folder,
      !cfg_.metrics.disable_color_printing && log_is_tty(), launch_.rank);
}

// The one step (app/train_step.h): its phases, the whole model's or the pipeline's, and
// under compile.enable the captured (CUDA) or checked (CPU) executor around them.
void Trainer::setup_step() {
  StepObjective obj;
  obj.global_tokens = static_cast<double>(d_.tokens_per_step);
  obj.dp_degree = d_.dp_degree;
  obj.max_norm = cfg_.training.max_norm;
  StepTestHooks hooks;
  hooks.plant_host_read = cfg_.debug.plant_error == "host_read";
  if (pipeline_)
    phases_ =
        std::make_unique<PipelineStepPhases>(*pipeline_, *model_, *opt_, grad_sync_, obj, hooks);
  else
    phases_ = std::make_unique<PlainStepPhases>(*model_, *opt_, grad_sync_, obj, hooks);
  if (!cfg_.compile.enable) return;
  const bool moe = model_->num_experts() > 0;
  // The backend the model resolved (with compile.enable: static_step) for its shapes.
  const bool loop = moe && model_->experts_backend() == "loop";
  check_compile_config(cfg_, moe, loop);
  compiled_ = std::make_unique<CompiledStep>(*phases_, cuda_, /*warmup_steps=*/3);
  compiled_->set_capture_check_context(cfg_.debug.capture_check_context);
  log_info(cuda_ ? "=> compile: the train step runs as 2 CUDA graphs (fwd+bwd with the gradient "
                   "collectives; clip+AdamW+MoE bias update) after 3 eager warm-up steps"
                 : std::string("=> compile: no CUDA here; the step runs eagerly under the "
                               "capture check (the same op sequence every step, no host read, "
                               "no collective changing size; docs/compile.md), ") +
                       (bf16_ ? "in bf16 compute as the GPU step (training.mixed_precision_param)"
                              : "in fp32 compute (training.mixed_precision_param = float32)"));
}

void Trainer::log_plan() const {
  const ModelInfo& info = model_->info();
  std::string dev_name = "CPU";
  if (cuda_) {
    CudaDeviceInfo ci = cuda_device_info(device_.index());
    dev_name = "CUDA:" + std::to_string(device_.index()) + " " + ci.name + " (sm_" +
               std::to_string(ci.major) + std::to_string(ci.minor) + ")";
  }
  log_info("=> device = " + dev_name +
           (bf16_ ? " (bf16 compute, fp32 master weights)" : " (fp32)"));
  log_info("=> model = " + cfg_.model.name + "/" + cfg_.model.flavor + ": " + human(info.n_params) +
           " parameters (" + human(info.n_active_non_embedding) + " active non-embedding), " +
           human(info.flops_per_token(cfg_.training.seq_len)) + " FLOPs per token at seq_len " +
           std::to_string(cfg_.training.seq_len));
  log_info("=> tokenizer = " + tok_path_ + " (vocab " + std::to_string(tokenizer_->vocab_size()) +
           ", model vocab " + std::to_string(info.vocab_size) + ")");
  log_info("=> data: training blend\n" +
           blend_->describe(cfg_.training.seq_len, cfg_.training.steps, d_.global_batch));
  const std::string repeats =
      blend_->repeat_warning(cfg_.training.seq_len, cfg_.training.steps, d_.global_batch);
  if (!repeats.empty()) log_warn(repeats);
  std::string layout = "single process";
  if (sharded_)
    layout = std::string(mesh_->replicate > 1 ? "HSDP" : "FSDP") + ", " + mesh_->describe() + ", " +
             sharded_->describe();
  else if (ddp_)
    layout = "DDP (replicated), " + ddp_->describe();
  if (tp_ > 1)
    layout =
        (sharded_ || ddp_ ? layout + "; " : mesh_->describe() + ", ") + describe_tp(*model_, tp_);
  if (pipeline_)  // what each stage's ranks do, if more than one holds it
    layout = pipeline_->describe() +
             (layout == "single process" ? std::string() : "; each stage: " + layout);
  log_info("=> world_size = " + std::to_string(launch_.world_size) + " (" + launch_.source +
           "), dp = " + std::to_string(d_.dp_degree) + ": " + layout);
  const int64_t mine = local_state_bytes(*model_, *opt_),
                whole = full_state_bytes(*model_, cfg_.optimizer);
  std::ostringstream os;
  os.precision(4);
  os << "=> memory: parameters + " << (cfg_.optimizer.name == "Muon" ? "Muon + AdamW" : "AdamW")
     << " state on this rank " << mine / 1048576.0 << " MiB of " << whole / 1048576.0
     << " MiB for the whole model (ratio " << static_cast<double>(mine) / static_cast<double>(whole)
     << ")";
  log_info(os.str());
  log_info("=> global_batch_size = " + std::to_string(d_.global_batch) +
           ", grad_accum_steps = " + std::to_string(d_.grad_accum_steps) +
           ", tokens_per_step = " + std::to_string(d_.tokens_per_step));
  if (cfg_.lr_scheduler.warmup_steps > sched_->warmup_steps())
    log_warn("lr_scheduler.warmup_steps = " + std::to_string(cfg_.lr_scheduler.warmup_steps) +
             " is longer than the run (training.steps = " + std::to_string(cfg_.training.steps) +
             "): warmup is clipped to " + std::to_string(sched_->warmup_steps()) +
             " steps, so the lr never decays");
  log_info("=> lr schedule: warmup " + std::to_string(sched_->warmup_steps()) + ", stable " +
           std::to_string(sched_->stable_steps()) + ", decay " +
           std::to_string(sched_->decay_steps()) + " (" + cfg_.lr_scheduler.decay_type + ")");
}

std::vector<MicroBatch> Trainer::next_micro_batches() {
  std::vector<MicroBatch> micro;
  for (int64_t m = 0; m < d_.grad_accum_steps; ++m) micro.push_back(loader_->next());
  return micro;
}

int Trainer::train_loop() {
  t_last_log_ = Clock::now();
  StepDrivers o;
  o.timer = phase_timer_.get();
  o.ep = ep_control_.get();
  const int64_t first_step = state_.step + 1;
  last_finite_step_ = state_.step;  // the checkpoint resumed from trained on finite losses
  const auto counts0 = ProcessGroup::comm_counts();
  for (int64_t step = first_step; step <= cfg_.training.steps; ++step) {
    const bool log = step == 1 || step % cfg_.metrics.log_freq == 0 || step == cfg_.training.steps;
    const auto t0 = Clock::now();
    profiler_->before_step(step);
    const std::vector<MicroBatch>& micro = inputs_.stage(next_micro_batches());
    data_ms_ += loader_->wait_ms();  // what the prefetch thread did not hide
    o.lr = sched_->lr(step - state_.lr_step_offset);
    ProcessGroup::count_comm_waits(true);
    StepResult r = compiled_ ? compiled_->step(micro, o) : run_step(*phases_, micro, o);
    ProcessGroup::count_comm_waits(false);
    if (compiled_) {
      const std::string report = compiled_->take_report();
      if (!report.empty()) log_info(report);
    }
    tokens_since_log_ +=  // a cp rank runs its slice of each sequence
        cfg_.training.local_batch_size * d_.grad_accum_steps * cfg_.training.seq_len / cp_;
    if (step == first_step) {
      const auto unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
      log_info("=> first step done " + std::to_string(static_cast<int64_t>(ms_since(t_exec_))) +
               " ms after start (unix_ms " + std::to_string(unix_ms) + ")");
    }
    if (log) {
      if (!log_step(step, r, o.lr)) return report_non_finite_loss(step);
    } else {
      metrics_->progress(step, cfg_.training.steps,
                         std::chrono::duration<double>(Clock::now() - t0).count());
    }
    if (cfg_.validation.enable && step % cfg_.validation.freq == 0) validate(step);
    profiler_->after_step(step);
    state_.step = step;
    if (int sig = preempt_->poll(step)) {
      log_info("received signal " + std::to_string(sig) + " (" + strsignal(sig) + ") after step " +
               std::to_string(step) +
               (cfg_.checkpoint.enable ? ": saving and exiting"
                                       : ": checkpointing is disabled, exiting without saving"));
      if (cfg_.checkpoint.enable) {
        save(/*model_only=*/false);
        ckpt_->wait();
      }
      preempted_ = true;
      return 0;
    }
    if (cfg_.checkpoint.enable && step % cfg_.checkpoint.interval == 0 &&
        step != cfg_.training.steps)
      save(/*model_only=*/false);
  }
  profiler_->finish(state_.step);  // a window the last step cut short
  log_comm_per_step(counts0, state_.step - first_step + 1);
  return 0;
}

// "=> collectives per step on this rank: all-gather 14.0 x 65.5 KiB; ... total 917.0 KiB per
// step": the counted traffic of the loop (logging's all-reduces included), for layout
// comparisons. Under compile.enable on CUDA each replay adds the collectives its capture
// recorded (CompiledStep's CommRecord), so the figure equals the eager run's.
void Trainer::log_comm_per_step(const std::map<std::string, ProcessGroup::CommCount>& before,
                                int64_t steps) const {
  if (!pg_ || steps <= 0) return;
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << "=> collectives per step on this rank:";
  int64_t total = 0;
  for (const auto& [kind, c] : ProcessGroup::comm_counts()) {
    auto it = before.find(kind);
    const int64_t calls = c.calls - (it == before.end() ? 0 : it->second.calls);
    const int64_t bytes = c.bytes - (it == before.end() ? 0 : it->second.bytes);
    if (calls == 0) continue;
    total += bytes;
    os << " " << kind << " " << static_cast<double>(calls) / static_cast<double>(steps) << " x "
       << static_cast<double>(bytes) / static_cast<double>(calls) / 1024.0 << " KiB;";
  }
  os << " total " << static_cast<double>(total) / static_cast<double>(steps) / 1024.0
     << " KiB per step";
  log_info(os.str());
}

bool Trainer::log_step(int64_t step, const StepResult& r, double lr) {
  StepMetrics m;
  m.step = step;
  if (pg_) {
    // r.loss is this rank's share of the global mean; dp x that is the rank's own mean.
    at::Tensor mean = r.loss.to(at::kDouble);
    at::Tensor rank_max = mean * static_cast<double>(d_.dp_degree);
    if (cp_ > 1) mesh_->cp_group->allreduce(rank_max, ReduceOp::Sum);  // the cp ranks' shares
    mean.div_(static_cast<double>(tp_));  // the tp ranks of a dp rank hold the same loss
    pg_->allreduce(mean, ReduceOp::Sum);
    pg_->allreduce(rank_max, ReduceOp::Max);
    m.loss = mean.item<double>();
    m.loss_max = rank_max.item<double>();
  } else {
    m.loss = r.loss.item<double>();  // the log step's sync
    m.loss_max = m.loss;
  }
  m.grad_norm = r.grad_norm.item<double>();
  m.lr = lr;
  const double secs = std::chrono::duration<double>(Clock::now() - t_last_log_).count();
  // Per rank: the pipeline's ranks share each token's work (torchtitan divides likewise).
  m.tps = static_cast<double>(tokens_since_log_) / secs / static_cast<double>(pp_);
  m.tflops =
      m.tps * static_cast<double>(model_->info().flops_per_token(cfg_.training.seq_len)) / 1e12;
  // The peak of the math the GEMMs run in: bf16 compute, else fp32 (TF32 if cuBLAS may use it).
  const PeakMath math = bf16_                                   ? PeakMath::BF16
                        : at::globalContext().allowTF32CuBLAS() ? PeakMath::TF32
                                                                : PeakMath::FP32;
  const double peak =
      cuda_ ? peak_flops_for_device(cuda_device_info(device_.index()).name, math) : 0;
  m.mfu = peak > 0 ? 100.0 * m.tflops * 1e12 / peak : -1;
  const MemoryStats mem = cuda_ ? cuda_memory_stats(device_.index()) : cpu_memory_stats();
  m.memory_gib = static_cast<double>(mem.allocated) / (1 << 30);
  m.memory_peak_gib = static_cast<double>(mem.peak) / (1 << 30);
  m.memory_kind = cuda_ ? "cuda" : "cpu";
  m.rss_gib = max_rss_gib();
  // The next line's peak is that of its own steps.
  if (cuda_)
    cuda_reset_memory_peak(device_.index());
  else
    reset_cpu_memory_peak();
  // Every step is timed the same way (PhaseTimer); the line shows the mean per step since
  // the last line. The host has just waited for the loss, so reading the events costs nothing.
  const PhaseTimer::Totals phases = phase_timer_->take();
  const double steps_in = static_cast<double>(std::max<int64_t>(phases.steps, 1));
  m.data_ms = data_ms_ / steps_in;
  m.fwdbwd_ms = phases.fwdbwd_ms / steps_in;
  m.opt_ms = phases.opt_ms / steps_in;
  m.comm_wait_ms = ProcessGroup::take_comm_wait_ms() / steps_in;
  if (compiled_) {
    // A replayed step's collectives run inside the graph, where no wait can be timed (the
    // wait events are left out of the capture): with such a step since the last line the
    // mean is unknown, not the eager steps' alone (docs/compile.md).
    const int64_t replays = compiled_->replays();
    if (replays > replays_logged_ && !compiled_->comm_record().empty()) m.comm_wait_ms = -1;
    replays_logged_ = replays;
    m.compile_captures = compiled_->captures();
    m.compile_replays = replays;
    if (!cuda_) m.compile_checked_steps = compiled_->checked_steps();
  }
  m.extra = model_->extra_metrics();
  if (pipeline_) pipeline_->log_metrics(m.extra, cuda_);
  if (ep_control_) m.extra.merge(ep_control_->take_metrics());
  if (tp_comm_ && cfg_.parallelism.enable_async_tensor_parallel) log_async_tp(m.extra);
  metrics_->log_step(m);
  if (!std::isfinite(m.loss)) {
    nonfinite_loss_ = m.loss;
    return false;
  }
  last_finite_step_ = step;
  t_last_log_ = Clock::now();
  tokens_since_log_ = 0;
  data_ms_ = 0;
  return true;
}

// A diverged run stops with its own status (app/fatal.h kExitNonFiniteLoss) and says on
// stderr where to go back to: the newest complete checkpoint at or before the last step
// whose loss was read finite.
int Trainer::report_non_finite_loss(int64_t step) {
  if (ckpt_) ckpt_->wait();
  if (launch_.rank == 0) {
    std::ostringstream os;
    os << "titan-train: error: the loss is " << nonfinite_loss_ << " at step " << step
       << " (read every metrics.log_freq = " << cfg_.metrics.log_freq << " steps); ";
    // A save after the last finite loss read may already hold nan weights (log_freq > 1).
    std::vector<int64_t> steps;
    if (cfg_.checkpoint.enable)
      for (int64_t s : Checkpointer::complete_steps(ckpt_->root()))
        if (s <= last_finite_step_) steps.push_back(s);
    if (!steps.empty())
      os << "the last good checkpoint is " << ckpt_->root() << "/step-" << steps.back()
         << " (rerun with checkpoint.load_step = " << steps.back()
         << " and a lower optimizer.lr or training.max_norm)";
    else
      os << "no checkpoint to go back to ("
         << (cfg_.checkpoint.enable ? "none saved yet" : "checkpoint.enable = false")
         << "); lower optimizer.lr or training.max_norm";
    std::fprintf(stderr, "%s\n", os.str().c_str());
  }
  if (pg_) pg_->barrier();  // rank 0 hosts the store: nobody leaves while a peer still reads
  return kExitNonFiniteLoss;
}

void Trainer::validate(int64_t step) {
  at::NoGradGuard ng;
  const auto& v = cfg_.validation;
  const bool own = val_blend_ != nullptr;
  ValidationReader vr(own ? *val_blend_ : *blend_, /*holdout=*/!own, v.seq_len, v.local_batch_size,
                      dp_rank_, d_.dp_degree, device_);
  const int64_t n = v.steps < 0 ? vr.batches() : std::min(v.steps, vr.batches());
  at::Tensor sum = at::zeros({}, at::TensorOptions().device(device_).dtype(at::kDouble));
  int64_t tokens = 0;
  for (int64_t i = 0; i < n; ++i) {
    MicroBatch b = vr.next();
    if (pipeline_) {  // the last stage's ranks score the pipeline's batch
      sum += pipeline_->eval_loss_sum(b).to(at::kDouble);
      tokens += pipeline_->holds_last_stage() ? b.labels.numel() / cp_ : 0;
      continue;
    }
    sum += model_->token_loss_sum(b.tokens, b.labels).to(at::kDouble);
    tokens += b.labels.numel() / cp_;  // a cp rank scores its slice of each sequence
  }
  // FSDP of pipeline stages keeps a unit gathered until its step ends: drop validation's, so
  // that every train step starts from the shards (the same ops each step).
  if (pipeline_ && sharded_) sharded_->release_gathered();
  if (pg_) {  // each rank scored its own windows
    at::Tensor tk = at::full({}, static_cast<double>(tokens), sum.options());
    pg_->allreduce(sum);
    pg_->allreduce(tk);
    tokens = static_cast<int64_t>(tk.item<double>());
  }
  if (tokens == 0) {
    log_warn("validation at step " + std::to_string(step) +
             ": no whole batch of validation windows; skipped");
    return;
  }
  const double loss = sum.item<double>() / static_cast<double>(tokens);  // validation's sync
  metrics_->log_validation(step, loss, std::exp(loss), tokens);
}

}  // namespace titan
