#include "core/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <sstream>

#include <unistd.h>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/checkpoint.h"
#include "core/cuda_info.h"
#include "core/data.h"
#include "core/errors.h"
#include "core/log.h"
#include "core/lr_schedule.h"
#include "core/metrics.h"
#include "core/tokenizer.h"
#include "models/hf_interop.h"
#include "models/llama3.h"
#include "models/moe_model.h"
#include "parallel/ddp.h"
#include "parallel/fsdp.h"
#include "parallel/mesh.h"
#include "parallel/process_group.h"

namespace titan {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

std::string resolve_dataset(const std::string& name, const std::vector<std::string>& paths,
                            const char* key) {
  if (paths.size() > 1)
    throw UserError(std::string(key) + "_path lists " + std::to_string(paths.size()) +
                    " datasets; blends are not supported yet; allowed: one path");
  if (!paths.empty()) return paths[0];
  if (name == "kjv") return titan_cache_dir() + "/data/kjv.txt";
  throw UserError(std::string(key) + " = \"" + name +
                  "\" is not a bundled dataset; allowed: kjv, or give a file with the matching "
                  "dataset_path key");
}

std::string resolve_tokenizer(const ModelSection& m) {
  if (!m.tokenizer_path.empty()) return m.tokenizer_path;
  if (!m.hf_assets_path.empty()) return m.hf_assets_path + "/tokenizer.json";
  return titan_cache_dir() + "/data/tokenizer.json";
}

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

std::string titan_cache_dir() {
  const char* e = std::getenv("TITAN_CACHE");
  if (e && *e) return e;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/titan-train";
}

at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.reshape({-1, V}).to(at::kFloat), labels.reshape({-1}), {},
                                at::Reduction::Sum);
}

StepResult train_step(Model& model, AdamW& opt, const std::vector<MicroBatch>& micro,
                      double global_tokens, double lr, double max_norm, bool time_phases,
                      GradSync* grad_sync) {
  const auto t0 = Clock::now();
  at::Tensor total;
  for (const auto& mb : micro) {
    at::Tensor logits = model.forward(mb.tokens);
    at::Tensor loss = token_loss_sum(logits, mb.labels) / global_tokens;
    at::Tensor aux = model.aux_loss();
    at::Tensor objective = aux.defined() ? loss + aux / static_cast<double>(micro.size()) : loss;
    objective.backward();
    total = total.defined() ? total + loss.detach() : loss.detach();
  }
  const bool sync = time_phases && !total.is_cpu();
  if (sync) (void)total.cpu();  // named sync: phase timing on log steps only
  StepResult r;
  r.fwdbwd_ms = ms_since(t0);
  const auto t1 = Clock::now();
  auto params = model.params().tensors();
  if (grad_sync) grad_sync->reduce_gradients(params);
  at::Tensor norm_sq = grad_norm_sq(params);
  // After the gradient all-reduce every rank holds the same full gradient, so the local norm
  // already is the global one under pure replication; the hook exists for sharded layouts.
  if (grad_sync) grad_sync->reduce_norm_sq(norm_sq);
  at::Tensor norm = at::sqrt(norm_sq);
  clip_grad_norm(params, max_norm, norm);
  opt.step(lr);
  opt.zero_grad();
  model.after_optimizer_step();
  if (sync) (void)norm.cpu();
  r.opt_ms = ms_since(t1);
  r.loss = total;
  r.grad_norm = norm;
  return r;
}

int run_training(const JobConfig& cfg, const LaunchEnv& launch) {
  const auto t_exec = Clock::now();
  install_preemption_handlers();
  const DerivedConfig d = derive_config(cfg, launch.world_size);
  if (cfg.compile.enable)
    log_warn(
        "compile.enable = true: CUDA-graph capture of the train step is not implemented "
        "yet; training runs eagerly");
  log_info("resolved config:\n" + config_table(cfg));
  if (cfg.job.print_config) log_info("\n" + dump_config_toml(cfg));
  const bool cuda = at::hasCUDA();

  // ---- process group and mesh --------------------------------------------------------------
  // torchrun with one rank still gets a process group (torchrun --nproc_per_node 1
  // runs the same collective code path, e.g. a one-GPU NCCL check).
  std::unique_ptr<ProcessGroup> pg;
  std::unique_ptr<Mesh> mesh;
  if (launch.world_size > 1 || launch.source == "torchrun") {
    pg = std::make_unique<ProcessGroup>(launch, cfg.comm, cuda);
    pg->check_same_config(config_hash(cfg));
    mesh = build_mesh(*pg, cfg.parallelism.data_parallel_replicate_degree, d.dp_shard,
                      cfg.parallelism.expert_parallel_degree);
  }
  // dp_shard > 1 (or expert parallelism) shards the model (FSDP, HSDP with replicas);
  // otherwise the replicas hold it whole and all-reduce gradients (DDP).
  const bool fsdp = mesh && (mesh->shard > 1 || mesh->ep > 1);

  // ---- device and determinism -------------------------------------------------------------
  at::Device device = cuda ? at::Device(at::kCUDA, static_cast<int>(launch.local_rank)) : at::kCPU;
  if (cfg.debug.deterministic) {
    at::globalContext().setDeterministicAlgorithms(true, false);
    if (cuda) setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  }
  const bool bf16 = cuda && cfg.training.mixed_precision_param == "bfloat16";

  // ---- tokenizer, data, model ---------------------------------------------------------------
  const std::string tok_path = resolve_tokenizer(cfg.model);
  auto tokenizer = load_tokenizer(tok_path);
  const auto& cc = cfg.checkpoint;
  const std::string ckpt_root = (std::filesystem::path(cfg.job.dump_folder) / cc.folder).string();
  // Hugging Face weights initialize the whole model, before it is sharded.
  const bool hf_init = cc.enable && cc.initial_load_in_hf && !cc.initial_load_path.empty() &&
                       Checkpointer::complete_steps(ckpt_root).empty();
  // Sharded runs leave the parameters unallocated until FSDP has cut them, then initialize
  // only their own rows: no rank ever holds the whole model (Hugging Face initial weights
  // still load into a whole model first).
  const bool defer_params = fsdp && !hf_init;
  auto model = build_model(cfg, device, defer_params);
  const ModelInfo& info = model->info();
  if (tokenizer->vocab_size() != info.vocab_size)
    throw UserError("tokenizer '" + tok_path + "' has a vocabulary of " +
                    std::to_string(tokenizer->vocab_size()) + " tokens but model " +
                    cfg.model.name + "/" + cfg.model.flavor + " has " +
                    std::to_string(info.vocab_size) +
                    "; allowed: a tokenizer whose vocabulary matches the flavor");
  if (cfg.training.seq_len > info.max_seq_len)
    throw UserError("training.seq_len = " + std::to_string(cfg.training.seq_len) +
                    " exceeds what " + cfg.model.name + "/" + cfg.model.flavor +
                    " supports; allowed: <= " + std::to_string(info.max_seq_len));
  if (cfg.validation.enable && cfg.validation.seq_len > info.max_seq_len)
    throw UserError("validation.seq_len = " + std::to_string(cfg.validation.seq_len) +
                    " exceeds the model's max_seq_len " + std::to_string(info.max_seq_len));
  const std::string data_path =
      resolve_dataset(cfg.training.dataset, cfg.training.dataset_path, "training.dataset");
  TokenizedDocs docs = load_documents(data_path, *tokenizer);
  Splits splits =
      split_and_pack(docs, cfg.training.holdout_fraction, tokenizer->bos_id(), tokenizer->eos_id());
  if (cfg.validation.enable &&
      (!cfg.validation.dataset_path.empty() || !cfg.validation.dataset.empty())) {
    std::string vpath =
        resolve_dataset(cfg.validation.dataset, cfg.validation.dataset_path, "validation.dataset");
    splits.heldout = split_and_pack(load_documents(vpath, *tokenizer), 0.0, tokenizer->bos_id(),
                                    tokenizer->eos_id())
                         .train;
  }
  // Pure replication: the dp rank is the global rank (validate_config: dp degree = world).
  const int64_t dp_rank = launch.rank;
  PackedLoader loader(&splits.train, cfg.training.seq_len, cfg.training.local_batch_size, dp_rank,
                      d.dp_degree, static_cast<uint64_t>(cfg.debug.seed), /*shuffle=*/true);

  if (bf16) model->set_compute_dtype(at::kBFloat16);
  const auto& ac = cfg.activation_checkpoint;
  if (ac.mode == "full") {
    model->set_recompute_policy([](int64_t) { return true; });
  } else if (ac.mode == "selective") {
    if (ac.selective_ac_option == "op")  // the config accepts it; the models do not have it yet
      throw UserError(
          "activation_checkpoint.selective_ac_option = \"op\" is not implemented yet; allowed: "
          "a positive integer N (every Nth block), or mode = \"full\" or \"none\"");
    const int64_t every = std::stoll(ac.selective_ac_option);
    model->set_recompute_policy([every](int64_t l) { return (l + 1) % every == 0; });
  }
  if (cc.enable && (cc.initial_load_in_hf || cc.last_save_in_hf))
    require_hf_supported(*model, "checkpoint.initial_load_in_hf / last_save_in_hf");
  if (hf_init) {
    import_model_hf(*model, cc.initial_load_path);
    log_info("=> checkpoint: initialized from Hugging Face weights in " + cc.initial_load_path);
  }

  const int64_t ep = cfg.parallelism.expert_parallel_degree;
  if (ep > 1) {
    auto* moe = dynamic_cast<MoETransformer*>(model.get());
    if (!moe)
      throw UserError("parallelism.expert_parallel_degree = " + std::to_string(ep) + ": model " +
                      cfg.model.name +
                      " has no experts; allowed: 1 (or an MoE model: llama4, "
                      "deepseek_v3)");
    const int64_t E = moe->num_experts();
    if (E % ep != 0)
      throw UserError("parallelism.expert_parallel_degree = " + std::to_string(ep) +
                      " does not divide the " + std::to_string(E) + " experts of " +
                      cfg.model.name + "/" + cfg.model.flavor +
                      "; allowed: a divisor of the expert count that divides the shard degree " +
                      std::to_string(d.dp_shard));
    if (mesh) {
      ExpertParallel e;
      e.size = ep;
      e.rank = mesh->ep_index;
      e.all_to_all = [g = mesh->ep_group](
                         at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& os,
                         const std::vector<int64_t>& is) { g->all_to_all(out, in, os, is); };
      moe->set_expert_parallel(e);
    }
  }
  std::unique_ptr<FullyShardedDataParallel> sharded;
  if (fsdp) {
    FsdpOptions fo;
    fo.param_dtype = bf16 ? at::kBFloat16 : at::kFloat;
    fo.reduce_dtype =
        cuda && cfg.training.mixed_precision_reduce == "bfloat16" ? at::kBFloat16 : at::kFloat;
    fo.reshard_after_forward = cfg.parallelism.fsdp_reshard_after_forward != "never";
    sharded = std::make_unique<FullyShardedDataParallel>(*model, *mesh, fo);
    if (defer_params) model->init_weights(static_cast<uint64_t>(cfg.debug.seed));
  }
  std::vector<bool> decay;
  for (auto& p : model->params().all()) decay.push_back(p.weight_decay);
  AdamW opt(model->params().tensors(), decay, cfg.optimizer);
  LRSchedule sched(cfg.lr_scheduler, cfg.optimizer.lr, cfg.training.steps);
  std::unique_ptr<DataParallel> ddp;
  GradSync* grad_sync = nullptr;
  if (sharded) {
    grad_sync = sharded.get();
  } else if (pg) {
    ddp = std::make_unique<DataParallel>(*pg, model->params().tensors());
    grad_sync = ddp.get();
  }
  if (pg) {
    // MoE load counts are summed over every data-parallel rank so every rank updates its
    // expert biases identically.
    model->set_dp_allreduce([p = pg.get()](at::Tensor& t) { p->allreduce(t, ReduceOp::Sum); });
  }

  const int64_t flops_per_token = info.flops_per_token(cfg.training.seq_len);
  std::string dev_name = "CPU";
  double peak = 0;
  if (cuda) {
    CudaDeviceInfo ci = cuda_device_info(device.index());
    dev_name = "CUDA:" + std::to_string(device.index()) + " " + ci.name + " (sm_" +
               std::to_string(ci.major) + std::to_string(ci.minor) + ")";
    peak = peak_flops_for_device(ci.name);
  }
  log_info("=> device = " + dev_name + (bf16 ? " (bf16 compute, fp32 master weights)" : " (fp32)"));
  log_info("=> model = " + cfg.model.name + "/" + cfg.model.flavor + ": " + human(info.n_params) +
           " parameters (" + human(info.n_active_non_embedding) + " active non-embedding), " +
           human(flops_per_token) + " FLOPs per token at seq_len " +
           std::to_string(cfg.training.seq_len));
  log_info("=> tokenizer = " + tok_path + " (vocab " + std::to_string(tokenizer->vocab_size()) +
           ")");
  log_info("=> data = " + data_path + ": " + std::to_string(docs.num_docs()) + " documents, " +
           human(static_cast<int64_t>(splits.train.size())) + " training tokens, " +
           human(static_cast<int64_t>(splits.heldout.size())) + " held-out tokens, " +
           std::to_string(loader.windows_per_rank()) + " windows per rank");
  std::string layout = "single process";
  if (sharded)
    layout = std::string(mesh->replicate > 1 ? "HSDP" : "FSDP") + ", " + mesh->describe() + ", " +
             sharded->describe();
  else if (ddp)
    layout = "DDP (replicated), " + std::to_string(ddp->num_buckets()) + " gradient buckets";
  log_info("=> world_size = " + std::to_string(launch.world_size) + " (" + launch.source +
           "), dp = " + std::to_string(d.dp_degree) + ": " + layout);
  {
    const int64_t mine = local_state_bytes(*model, opt), whole = full_state_bytes(*model);
    std::ostringstream os;
    os.precision(4);
    os << "=> memory: parameters + AdamW state on this rank " << mine / 1048576.0 << " MiB of "
       << whole / 1048576.0 << " MiB for the whole model (ratio "
       << static_cast<double>(mine) / static_cast<double>(whole) << ")";
    log_info(os.str());
  }
  log_info("=> global_batch_size = " + std::to_string(d.global_batch) +
           ", grad_accum_steps = " + std::to_string(d.grad_accum_steps) +
           ", tokens_per_step = " + std::to_string(d.tokens_per_step));
  log_info("=> lr schedule: warmup " + std::to_string(sched.warmup_steps()) + ", stable " +
           std::to_string(sched.stable_steps()) + ", decay " + std::to_string(sched.decay_steps()) +
           " (" + cfg.lr_scheduler.decay_type + ")");

  const bool writer = launch.rank == 0 || cfg.metrics.save_for_all_ranks;
  MetricsLogger metrics(cfg.job.dump_folder, writer, cfg.metrics.enable_tensorboard,
                        cfg.metrics.save_tb_folder,
                        !cfg.metrics.disable_color_printing && log_is_tty(), launch.rank);

  auto validate = [&](int64_t step) {
    at::NoGradGuard ng;
    PackedLoader vl(&splits.heldout, cfg.validation.seq_len, cfg.validation.local_batch_size,
                    dp_rank, d.dp_degree, 0, /*shuffle=*/false);
    int64_t n = cfg.validation.steps < 0 ? vl.windows_per_rank() / cfg.validation.local_batch_size
                                         : cfg.validation.steps;
    at::Tensor sum = at::zeros({}, at::TensorOptions().device(device).dtype(at::kDouble));
    int64_t tokens = 0;
    for (int64_t i = 0; i < n; ++i) {
      Batch b = vl.next();
      at::Tensor logits = model->forward(b.tokens.to(device));
      sum += token_loss_sum(logits, b.labels.to(device)).to(at::kDouble);
      tokens += b.labels.numel();
    }
    if (pg) {  // each rank scored its own windows
      at::Tensor tk = at::full({}, static_cast<double>(tokens), sum.options());
      pg->allreduce(sum);
      pg->allreduce(tk);
      tokens = static_cast<int64_t>(tk.item<double>());
    }
    double loss = sum.item<double>() / static_cast<double>(tokens);  // validation's sync
    metrics.log_validation(step, loss, std::exp(loss), tokens);
  };

  // ---- resume ----------------------------------------------------------------------------------
  // Every rank's loader runs in lockstep (same position, different windows), so one position
  // is saved; it is recorded at the real dp degree, so a resume on another world size
  // rescales it. Sharded parameters are written by every rank of the first replica and
  // resharded on load from the dim-0 ranges in metadata.json.
  CheckpointGroup cg;
  cg.rank = launch.rank;
  cg.writes = launch.rank == 0 || (sharded && mesh->replicate_index == 0);
  cg.writers = sharded ? mesh->shard : 1;
  if (pg) {
    if (launch.rank == 0) pg->store_set("checkpoint/token", std::to_string(::getpid()));
    cg.token = pg->store_get("checkpoint/token");
    cg.counter = [p = pg.get()](const std::string& k, int64_t v) { return p->store_add(k, v); };
    cg.timeout = std::chrono::seconds(cfg.comm.train_timeout_seconds);
  } else {
    cg.token = std::to_string(::getpid());
  }
  Checkpointer ckpt(cfg, cg, launch.world_size, d.dp_degree);
  TrainingState state{model.get(), &opt, &loader, 0, 0};
  if (cc.enable && !hf_init) {
    std::string what = ckpt.load(state);
    log_info("=> checkpoint: " +
             (what.empty() ? "none found under " + ckpt.root() + ", starting fresh" : what));
  }
  auto save = [&](bool model_only) {
    // Every rank snapshots its part; rank 0 renames the folder once all parts are written.
    ckpt.save(state, model_only);
    if (pg) pg->barrier();
  };
  if (ddp) ddp->broadcast_state(*model);
  if (mesh) mesh->start_training();  // the world and its sub-groups

  // ---- the loop --------------------------------------------------------------------------------
  const double global_tokens = static_cast<double>(d.tokens_per_step);
  auto t_last_log = Clock::now();
  int64_t tokens_since_log = 0;
  double data_ms = 0, fwdbwd_ms = 0, opt_ms = 0;
  bool first_step_logged = false;
  struct PendingFlag {
    int64_t step = 0;
    at::Tensor host;                    // the all-reduced pre-emption flag, on the host
    std::unique_ptr<c10::Event> ready;  // CUDA: the device-to-host copy's completion
  };
  constexpr int64_t kPreemptLag = 2;
  std::deque<PendingFlag> pending_flags;
  for (int64_t step = state.step + 1; step <= cfg.training.steps; ++step) {
    const bool log_step =
        step == 1 || step % cfg.metrics.log_freq == 0 || step == cfg.training.steps;
    auto t0 = Clock::now();
    std::vector<MicroBatch> micro;
    for (int64_t m = 0; m < d.grad_accum_steps; ++m) {
      Batch b = loader.next();
      micro.push_back({b.tokens.to(device, /*non_blocking=*/true), b.labels.to(device, true)});
    }
    data_ms += ms_since(t0);
    const double lr = sched.lr(step - state.lr_step_offset);
    StepResult r = train_step(*model, opt, micro, global_tokens, lr, cfg.training.max_norm,
                              log_step, grad_sync);
    fwdbwd_ms += r.fwdbwd_ms;
    opt_ms += r.opt_ms;
    tokens_since_log += cfg.training.local_batch_size * d.grad_accum_steps * cfg.training.seq_len;
    if (!first_step_logged) {
      const auto unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
      log_info("=> first step done " + std::to_string(static_cast<int64_t>(ms_since(t_exec))) +
               " ms after start (unix_ms " + std::to_string(unix_ms) + ")");
      first_step_logged = true;
    }
    if (log_step) {
      StepMetrics m;
      m.step = step;
      if (pg) {
        // r.loss is this rank's share of the global mean; dp x that is the rank's own mean.
        at::Tensor mean = r.loss.to(at::kDouble);
        at::Tensor rank_max = mean * static_cast<double>(d.dp_degree);
        pg->allreduce(mean, ReduceOp::Sum);
        pg->allreduce(rank_max, ReduceOp::Max);
        m.loss = mean.item<double>();
        m.loss_max = rank_max.item<double>();
      } else {
        m.loss = r.loss.item<double>();  // the log step's sync
        m.loss_max = m.loss;
      }
      m.grad_norm = r.grad_norm.item<double>();
      m.lr = lr;
      const double secs = std::chrono::duration<double>(Clock::now() - t_last_log).count();
      m.tps = static_cast<double>(tokens_since_log) / secs;
      m.tflops = m.tps * static_cast<double>(flops_per_token) / 1e12;
      m.mfu = peak > 0 ? 100.0 * m.tflops * 1e12 / peak : -1;
      if (cuda) {
        m.memory_gib = static_cast<double>(cuda_peak_allocated(device.index())) / (1 << 30);
        m.memory_kind = "cuda max allocated";
      } else {
        m.memory_gib = max_rss_gib();
      }
      const double steps_in = static_cast<double>(step == 1 ? 1 : cfg.metrics.log_freq);
      m.data_ms = data_ms / steps_in;
      m.fwdbwd_ms = fwdbwd_ms / steps_in;
      m.opt_ms = opt_ms / steps_in;
      m.extra = model->extra_metrics();
      metrics.log_step(m);
      if (!std::isfinite(m.loss)) {
        log_warn("loss is " + std::to_string(m.loss) + " at step " + std::to_string(step) +
                 "; stopping");
        return 1;
      }
      t_last_log = Clock::now();
      tokens_since_log = 0;
      data_ms = fwdbwd_ms = opt_ms = 0;
    } else {
      metrics.progress(step, cfg.training.steps,
                       std::chrono::duration<double>(Clock::now() - t0).count());
    }
    if (cfg.validation.enable && step % cfg.validation.freq == 0) validate(step);
    state.step = step;
    int sig = preemption_signal();
    if (pg) {
      // Ranks see a signal after different steps; they must agree on the step they stop at
      // (one leaving alone would make the others fail in the next collective). Each step
      // all-reduces the flag (MAX) and starts copying it to the host without waiting; the
      // value is read kPreemptLag steps later, when the copy has long finished, so no step
      // waits for the device. Every rank reads the same step's value at the same step.
      at::Tensor f = at::full({}, sig, at::TensorOptions().dtype(at::kInt).device(device));
      pg->allreduce(f, ReduceOp::Max);
      PendingFlag p;
      p.step = step;
      if (f.is_cpu()) {
        p.host = f;
      } else {
        p.host = at::empty({}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
        p.host.copy_(f, /*non_blocking=*/true);
        p.ready = std::make_unique<c10::Event>(device.type());
        p.ready->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
      }
      pending_flags.push_back(std::move(p));
      sig = 0;
      if (pending_flags.front().step + kPreemptLag <= step) {
        PendingFlag& due = pending_flags.front();
        if (due.ready) due.ready->synchronize();  // recorded kPreemptLag steps ago
        sig = due.host.item<int>();
        pending_flags.pop_front();
      }
    }
    if (sig) {
      log_info("received signal " + std::to_string(sig) + " (" + strsignal(sig) + ") after step " +
               std::to_string(step) +
               (cfg.checkpoint.enable ? ": saving and exiting"
                                      : ": checkpointing is disabled, exiting without saving"));
      if (cfg.checkpoint.enable) {
        save(/*model_only=*/false);
        ckpt.wait();
      }
      return 0;
    }
    if (cfg.checkpoint.enable && step % cfg.checkpoint.interval == 0 && step != cfg.training.steps)
      save(/*model_only=*/false);
  }
  if (cfg.checkpoint.enable && state.step == cfg.training.steps)
    save(cfg.checkpoint.last_save_model_only);
  ckpt.wait();
  if (cc.enable && cc.last_save_in_hf) {
    const std::string dir = ckpt.root() + "/step-" + std::to_string(state.step) + "-hf";
    // Under FSDP the whole model is gathered (a collective) into an unsharded CPU copy on
    // rank 0, which exports it; buffers (MoE expert biases) are replicated already.
    std::unique_ptr<Model> whole;
    if (sharded) {
      if (launch.rank == 0) {
        // A CPU copy for export only: the experts backend is irrelevant there, and grouped_mm
        // (chosen for the GPU) cannot be built on the CPU.
        JobConfig ecfg = cfg;
        ecfg.moe.experts_backend = "loop";
        whole = build_model(ecfg, at::kCPU);
      }
      at::NoGradGuard ng;
      for (size_t i = 0; i < model->params().all().size(); ++i) {
        at::Tensor full = sharded->full_param(static_cast<int64_t>(i));
        if (whole) whole->params().all()[i].value.copy_(full);
      }
      if (whole) {
        auto src = model->buffers(), dst = whole->buffers();
        for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second);
      }
    }
    if (launch.rank == 0) {
      HfExportOptions o;
      o.dtype = hf_export_dtype(cc.export_dtype, "checkpoint.export_dtype");
      if (!std::filesystem::exists(dir)) export_model_hf(whole ? *whole : *model, dir, o);
      log_info("checkpoint: Hugging Face weights (" + cc.export_dtype + ") in " + dir);
    }
  }
  // Rank 0 hosts the store: nobody leaves while a peer may still be in a collective.
  if (pg) pg->barrier();
  log_info("training done: " + std::to_string(cfg.training.steps) + " steps");
  return 0;
}

}  // namespace titan
