#include "app/estimate.h"

#include "core/config/param_groups.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/base/errors.h"
#include "app/meta_kernels.h"
#include "app/pipeline_dump.h"
#include "app/train_step.h"
#include "core/telemetry/memory_stats.h"
#include "core/train/documents.h"
#include "core/train/model.h"
#include "models/moe_model.h"
#include "models/registry.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"

namespace titan {
namespace {

// What the estimate assumes of a GPU: dense bf16 peak, the fraction of it matmuls reach,
// and the bandwidth one rank gets inside a node (NVLink) and across nodes (the NIC).
struct Gpu {
  double peak_flops, efficiency, intra_bytes_s, inter_bytes_s;
  int64_t per_node;
  double memory_gib;  // the total CUDA reports for one card (SXM parts)
};

// Held back from the card's memory before a plan is said to fit: the CUDA context and
// cuBLAS/NCCL workspaces (about 1-2 GiB on an H100) and the caching allocator's fragmentation.
constexpr double kReserveGib = 4.0;

Gpu gpu_named(const std::string& g) {
  static const std::map<std::string, Gpu> table = {
      // Memory: A100 80GB and H100 80GB report 79.2 GiB, H200 141 GB 139.8 GiB, B200 (180 GB
      // usable) 178.4 GiB as their device total.
      {"a100", {312e12, 0.5, 300e9, 25e9, 8, 79.2}},
      {"h100", {989e12, 0.45, 450e9, 50e9, 8, 79.2}},
      {"h200", {989e12, 0.45, 450e9, 50e9, 8, 139.8}},
      {"b200", {2250e12, 0.45, 900e9, 50e9, 8, 178.4}},
  };
  auto it = table.find(g);
  if (it == table.end())
    throw UserError("estimate --gpu " + g + ": unknown; allowed: a100, h100, h200, b200");
  return it->second;
}

struct Plan {
  int64_t world = 1, replicate = 1, shard = 1, ep = 1, tp = 1;
  bool etp = false;  // routed experts split over tp (expert_tensor_parallel_degree = tp > 1)
  int64_t cp = 1;    // context parallel; `shard` is FSDP's group, dp_shard x cp (parallel/mesh.h)
  int64_t micro_batches = 1, local_batch = 1, seq_len = 1;
  int64_t param_bytes = 4, reduce_bytes = 4;  // all-gather / reduce-scatter element sizes
  bool reshard = true;
  std::string ac;
  // optimizer.name = "Muon": the matrices Muon takes keep one fp32 state tensor, not two.
  bool muon = false;
  std::vector<std::string> param_groups;
};

struct Sizes {
  double params = 0, grads = 0, optim = 0;       // bytes on one rank
  double max_unit = 0, root_units = 0;           // full (gathered) bytes, param dtype
  double gather = 0, reduce = 0, replicate = 0;  // bytes one rank sends per step
  // Tensor parallel: the sequence-parallel all-gathers and reduce-scatters of activations
  // (each of act_bytes, the gathered size) and the loss's all-reduces of loss_bytes.
  double tp_collectives = 0, act_bytes = 0, loss_bytes = 0, tp_sent = 0;
  double cp_sent = 0;  // context parallel: K/V all-gathers and their reduce-scatters
  // optimizer.name = "Muon": the owner plan's bf16 update rows of each FSDP-sharded matrix,
  // sent to its owner and its result's rows sent back, once per step (app/muon_layout.h),
  // after the backward, so on the critical path.
  double muon_gather = 0;
};

int64_t rows_of(const Param& p) {
  return p.value.dim() == 0 ? 1 : p.value.size(0);
}

// Walks the FSDP units exactly as parallel/fsdp.cpp cuts them.
Sizes size_plan(const Model& m, const Plan& pl) {
  Sizes s;
  const auto& params = m.params().all();
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (const Param& p : params) {
    names.push_back(p.name);
    shapes.push_back(p.model_shape());
  }
  const std::vector<OptimizerKind> kinds =
      route_params(names, shapes, pl.muon, parse_param_groups(pl.param_groups));
  for (const ParamUnit& u : m.param_units()) {
    double unit_full[2] = {0, 0};
    for (int64_t i : u.params) {
      const Param& p = params[static_cast<size_t>(i)];
      const bool ex = p.expert() && pl.ep > 1;
      const int64_t rows = rows_of(p) / (ex ? pl.ep : 1);
      const int64_t group = pl.shard / (ex ? pl.ep : 1);
      const int64_t row_numel = p.value.numel() / std::max<int64_t>(1, rows_of(p));
      const int64_t chunk = (rows + group - 1) / group;
      const double local = static_cast<double>(chunk * row_numel);
      s.params += 4 * local;
      s.grads += 4 * local;
      const bool muon = kinds[static_cast<size_t>(i)] == OptimizerKind::Muon;
      s.optim += (muon ? 4 : 8) * local;
      if (muon && pl.shard > 1 && p.model_shape().size() == 2)
        // A rank sends its rows of the (group - 1) / group matrices it does not own (2 bytes
        // each) and, as owner of 1 / group of them, (group - 1) ranks' rows of the result.
        s.muon_gather += 2.0 * 2.0 * static_cast<double>(group - 1) / group * local;
      unit_full[ex] += static_cast<double>(group * chunk * row_numel);
      if (pl.shard > 1) {
        const double passes = u.block >= 0 && pl.reshard ? 2 : 1;  // forward (+ regather)
        s.gather += passes * pl.micro_batches * static_cast<double>(group - 1) * local *
                    static_cast<double>(pl.param_bytes);
        s.reduce += pl.micro_batches * static_cast<double>(group - 1) * local *
                    static_cast<double>(pl.reduce_bytes);
      }
      const double rep = pl.shard > 1 ? pl.replicate : pl.world / pl.tp;
      s.replicate += 2.0 * (rep - 1) / rep * local * static_cast<double>(pl.reduce_bytes);
    }
    for (double f : unit_full) {
      if (u.block >= 0)
        s.max_unit = std::max(s.max_unit, f * static_cast<double>(pl.param_bytes));
      else
        s.root_units += f * static_cast<double>(pl.param_bytes);
    }
  }
  return s;
}

// Per block and micro-batch: forward all-gathers before attention and the MLP and
// reduce-scatters after them (4), the same in backward (4), and the forward's 4 again when
// blocks are recomputed (full activation checkpointing); plus the embedding's reduce-scatter
// and the loss input's all-gather, each with its backward twin; plus the loss's 3 all-reduces
// of one fp32 per token. An MoE layer's feed-forward has the MLP's pair only under expert
// tensor parallelism (the routed experts' gather and reduce-scatter); with whole experts its
// router, experts and shared experts run on the rank's sequence shard, with no collective.
void size_tp(const Model& m, const Plan& pl, Sizes& s) {
  if (pl.tp == 1) return;
  const double tokens = static_cast<double>(pl.local_batch * pl.seq_len);
  s.act_bytes = tokens * static_cast<double>(m.info().dim * pl.param_bytes);
  s.loss_bytes = tokens * 4;
  const double per_part = pl.ac == "full" ? 6 : 4;  // attention or MLP: fwd, bwd (, recompute)
  const auto* moe = dynamic_cast<const MoETransformer*>(&m);
  const int64_t silent = moe && !pl.etp ? static_cast<int64_t>(moe->moe_layers().size()) : 0;
  const double parts = static_cast<double>(2 * m.info().n_layers - silent);
  s.tp_collectives = static_cast<double>(pl.micro_batches) * (per_part * parts + 4);
  const double frac = static_cast<double>(pl.tp - 1) / static_cast<double>(pl.tp);
  s.tp_sent = frac * (s.tp_collectives * s.act_bytes +
                      2.0 * 3 * static_cast<double>(pl.micro_batches) * s.loss_bytes);
}

// The tensor-parallel collectives with the shapes they would have, on the meta device:
// gathers repeat the shard, reduce-scatters slice it (what a rank holds either way).
// `sent`, when given, adds the bytes each gather sends from this rank ((n - 1) x its shard):
// context parallelism's K/V all-gathers.
class ShapeOnlyTensorParallel : public TensorParallelComm {
 public:
  explicit ShapeOnlyTensorParallel(int64_t n, std::shared_ptr<double> sent = nullptr)
      : n_(n), sent_(std::move(sent)) {}
  int64_t size() const override { return n_; }
  int64_t rank() const override { return 0; }
  at::Tensor gather_seq(const at::Tensor& x) override {
    if (sent_)
      *sent_ += static_cast<double>((n_ - 1) * x.numel()) * static_cast<double>(x.element_size());
    std::vector<int64_t> rep(static_cast<size_t>(x.dim()), 1);
    rep[1] = n_;
    return x.repeat(rep);
  }
  at::Tensor reduce_scatter_seq(const at::Tensor& x) override {
    return x.narrow(1, 0, x.size(1) / n_).clone();
  }
  void allreduce(at::Tensor&, bool) override {}
  at::Tensor gather_last(const at::Tensor& x) override {
    std::vector<int64_t> rep(static_cast<size_t>(x.dim()), 1);
    rep.back() = n_;
    return x.repeat(rep);
  }

 private:
  int64_t n_;
  std::shared_ptr<double> sent_;
};

}  // namespace

namespace {

Plan make_plan(const JobConfig& cfg, int64_t world) {
  validate_for_world(cfg, world);
  const DerivedConfig d = derive_config(cfg, world);
  Plan pl;
  pl.world = world;
  pl.cp = cfg.parallelism.context_parallel_degree;
  pl.shard = d.dp_shard * pl.cp;
  pl.replicate = cfg.parallelism.data_parallel_replicate_degree;
  pl.ep = cfg.parallelism.expert_parallel_degree;
  pl.tp = cfg.parallelism.tensor_parallel_degree;
  pl.etp = pl.tp > 1 && cfg.parallelism.expert_tensor_parallel_degree > 1;
  pl.micro_batches = d.grad_accum_steps;
  pl.local_batch = cfg.training.local_batch_size;
  pl.seq_len = cfg.training.seq_len;
  pl.param_bytes = cfg.training.mixed_precision_param == "bfloat16" ? 2 : 4;
  pl.reduce_bytes = cfg.training.mixed_precision_reduce == "bfloat16" ? 2 : 4;
  pl.reshard = cfg.parallelism.fsdp_reshard_after_forward != "never";
  pl.ac = cfg.activation_checkpoint.mode;
  pl.muon = cfg.optimizer.name == "Muon";
  pl.param_groups = cfg.optimizer.param_groups;
  return pl;
}

// What one micro-batch's forward and backward hold beyond the parameters, gradients and
// optimizer state, counted rather than modelled: the model is built on the meta device with
// the run's activation checkpointing, its gradients pre-allocated (a step after the first
// finds them allocated), and one forward and backward run on (local_batch, seq_len) meta
// tokens while a counting allocator sums the bytes of every meta tensor. So the figure is
// exactly the tensors each block saves for backward (the recompute's too) and every
// transient, the loss's chunk buffers and its in-forward gradients included. Meta tensors
// carry no routing: MoE layers assume perfectly balanced experts, and attention holds what a
// flash kernel saves (q, k, v, output, log-sum-exp), not SDPA's meta math path.
struct Activations {
  double after_forward = 0;  // held at the end of the forward: saved tensors + loss grads
  double forward_peak = 0;   // the most held at once during the forward (the loss's chunks)
  double backward_peak = 0;  // the most held at once during the backward
  // Context parallel: bytes this rank sends per micro-batch, the K/V all-gathers (forward and
  // recompute) and their gradients' reduce-scatters (one per forward gather with grad).
  double cp_sent = 0;
};

// Expert tensor parallelism as the trainer applies it (etp = tp > 1, with or without ep).
bool split_experts(const JobConfig& cfg) {
  return cfg.parallelism.expert_tensor_parallel_degree > 1;
}

// The model as measure_activations counts it: on the meta device, cut for tensor
// parallelism, weights in the compute dtype, the run's activation checkpointing, gradients
// pre-allocated. `cp_sent` counts the bytes the context-parallel gathers send.
std::unique_ptr<Model> activation_model(const JobConfig& cfg, const Plan& pl,
                                        const std::shared_ptr<double>& cp_sent) {
  install_meta_memory_counter();
  register_meta_kernels();
  std::unique_ptr<Model> m = build_model(cfg, at::kMeta, /*defer_params=*/false);
  if (pl.tp > 1) {
    split_for_tensor_parallel(*m, pl.tp, 0, split_experts(cfg));
    auto comm = std::make_shared<ShapeOnlyTensorParallel>(pl.tp);
    m->set_tensor_parallel(comm);
    if (m->tp_plan().split_experts) m->set_expert_tensor_parallel(comm);
  }
  // Context parallel: the rank's T/cp tokens of each sequence, keys and values gathered to T
  // (counted as the gathered tensors the attention saves).
  if (pl.cp > 1)
    m->set_context_parallel(std::make_shared<ContextParallel>(
        std::make_shared<ShapeOnlyTensorParallel>(pl.cp, cp_sent),
        cp_balancer(cfg.parallelism.context_parallel_load_balancer)));
  if (pl.param_bytes == 2) {
    // bf16 weights as FSDP gathers them (and as the cast cache holds them without FSDP,
    // counted separately): neither the casts nor the weights a GEMM saves are activations.
    m->set_compute_dtype(at::kBFloat16);
    for (at::Tensor& p : m->params().tensors()) p.set_data(p.to(at::kBFloat16));
  }
  apply_activation_checkpointing(*m, cfg.activation_checkpoint);
  for (at::Tensor& p : m->params().tensors()) p.mutable_grad() = at::zeros_like(p);
  return m;
}

Activations measure_activations(const JobConfig& cfg, const Plan& pl) {
  auto cp_sent = std::make_shared<double>(0);
  std::unique_ptr<Model> m = activation_model(cfg, pl, cp_sent);
  const auto meta_long = at::TensorOptions().dtype(at::kLong).device(at::kMeta);
  at::Tensor tokens = at::zeros({pl.local_batch, pl.seq_len}, meta_long);
  at::Tensor labels = at::zeros({pl.local_batch, pl.seq_len}, meta_long);
  const int64_t base = meta_memory_stats().allocated;
  reset_meta_memory_peak();
  Activations a;
  {
    at::Tensor loss = m->token_loss_sum(tokens, labels);
    a.after_forward = static_cast<double>(meta_memory_stats().allocated - base);
    a.forward_peak = static_cast<double>(meta_memory_stats().peak - base);
    reset_meta_memory_peak();
    const double forward_gathers = *cp_sent;  // with full checkpointing: without grad
    loss.backward();
    // A block recomputed in backward gathers again; every block has one gather with grad,
    // whose backward reduce-scatters the same bytes: the forward's gathers once more.
    a.cp_sent = *cp_sent + forward_gathers;
  }
  a.backward_peak = static_cast<double>(meta_memory_stats().peak - base);
  return a;
}

std::string fmt_g(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}

void print_gib(const char* what, double bytes) {
  std::printf("  %-48s %12.6f GiB\n", what, bytes / (1024.0 * 1024.0 * 1024.0));
}

// What a pipeline stage's forward of one micro-batch holds at its end (its blocks' saved
// tensors; the last stage's loss too), counted as measure_activations counts the whole model:
// `pl` is one micro-batch (local_batch = the pipeline micro-batch size). Under CP,
// `*cp_exchange` gets the bytes the stage's K/V exchange sends for it, counted as
// measure_activations counts them (its backward is run for that; `cp_sent` is the model's
// counter).
double stage_activations(Model& m, const Plan& pl, const PipelineStageSpec& sp,
                         const double& cp_sent, double* cp_exchange) {
  const double before = cp_sent;
  const auto meta = at::TensorOptions().device(at::kMeta);
  at::Tensor in = sp.has_embeddings
                      ? at::zeros({pl.local_batch, pl.seq_len}, meta.dtype(at::kLong))
                      : at::zeros({pl.local_batch, pl.seq_len / (pl.cp * pl.tp), m.info().dim},
                                  meta.dtype(m.compute_dtype()))
                            .requires_grad_(true);
  const int64_t base = meta_memory_stats().allocated;
  at::Tensor out = m.forward_stage(in, sp.has_embeddings, sp.first_layer, sp.end_layer);
  if (sp.has_head)
    out = m.head_loss_sum(out, at::zeros({pl.local_batch, pl.seq_len}, meta.dtype(at::kLong)));
  const double held = static_cast<double>(meta_memory_stats().allocated - base);
  if (pl.cp > 1) {
    const double forward_gathers = cp_sent - before;  // with full checkpointing: without grad
    out.backward(at::ones_like(out));                 // a recomputed block gathers again
    // Every gather with grad reduce-scatters its bytes in backward: the forward's once more.
    *cp_exchange = cp_sent - before + forward_gathers;
  }
  return held;
}

// The most bytes of activations a pipeline rank holds at once: each forward of one of its
// stages adds that stage's activations, each backward (B, or I) of it frees them again, in
// the rank's schedule order.
double peak_in_flight(const std::vector<Action>& actions, const std::vector<double>& per_stage) {
  double now = 0, peak = 0;
  for (const Action& a : actions) {
    const double b = per_stage[static_cast<size_t>(a.stage)];
    if (a.type == ActionType::kForward) now += b;
    if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) now -= b;
    peak = std::max(peak, now);
  }
  return peak;
}

struct EstimateArgs {
  JobConfig cfg;
  std::string gpu = "h100";
  int64_t world = 1;
  int64_t document_tokens = 0;  // mean document length for a block-causal mask; 0: unknown
};

// --config FILE, --world N, --gpu G, --set section.key=value, and any training override
// (--section.key value), applied as training applies them: defaults < TOML < overrides.
EstimateArgs parse_estimate_args(int argc, char** argv) {
  CLI::App app{"titan-train estimate: memory, FLOPs, communication and step time per rank"};
  EstimateArgs a;
  std::string config_file;
  std::vector<std::string> sets;
  app.add_option("--config", config_file, "job config (TOML)")->required();
  app.add_option("--world", a.world, "number of ranks (GPUs)")->check(CLI::PositiveNumber);
  app.add_option("--gpu", a.gpu, "a100, h100, h200 or b200 (peak FLOP/s and link bandwidths)");
  app.add_option("--set", sets, "key=value overrides, e.g. --set training.seq_len=8192");
  app.add_option("--document-tokens", a.document_tokens,
                 "mean document length in tokens, for a block-causal mask's attention FLOPs")
      ->check(CLI::NonNegativeNumber);
  app.footer(
      "Any training override works too, e.g. --model.flavor 405B "
      "--parallelism.tensor_parallel_degree 8.");
  app.allow_extras();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string("estimate: ") + e.what());
  }
  std::vector<std::string> args = {"titan-train", "--config", config_file};
  for (const std::string& x : app.remaining()) args.push_back(x);
  std::vector<const char*> argv2;
  for (const std::string& x : args) argv2.push_back(x.c_str());
  a.cfg = parse_command_line(static_cast<int>(argv2.size()), argv2.data()).cfg;
  std::vector<std::string> warnings;
  for (const std::string& x : sets) {
    const auto eq = x.find('=');
    const auto dot = x.rfind('.', eq);
    if (eq == std::string::npos || dot == std::string::npos)
      throw UserError("estimate --set " + x + ": expected section.key=value (a TOML value)");
    const std::string toml =
        "[" + x.substr(0, dot) + "]\n" + x.substr(dot + 1, eq - dot - 1) + " = " + x.substr(eq + 1);
    apply_toml_string(a.cfg, toml, "--set " + x, warnings);
  }
  validate_config(a.cfg);
  return a;
}

double print_memory(const Plan& pl, const Sizes& s, const Activations& act) {
  // The step's peak is either at the end of the forward (the loss's chunk buffers and
  // in-forward gradients, with only the root units gathered) or in the backward (with the
  // unit being differentiated gathered, the next one prefetched and the unit's full
  // gradients, the reduce-scatter's send buffer, alive).
  double root = 0, gathered = 0;
  if (pl.shard > 1) {
    root = s.root_units;
    gathered = 2 * s.max_unit + s.max_unit / static_cast<double>(pl.param_bytes) *
                                    static_cast<double>(pl.reduce_bytes);
  }
  const double transient = std::max(act.forward_peak, act.backward_peak + gathered);
  // Unsharded bf16 runs keep one bf16 cast of every weight per optimizer step (Model::weight).
  const double casts = pl.shard == 1 && pl.param_bytes == 2 ? s.params / 2 : 0.0;
  std::printf("memory per rank:\n");
  print_gib(pl.tp > 1 ? "parameters (fp32, tp slices, FSDP shards)" : "parameters (fp32 shards)",
            s.params);
  print_gib("gradients (fp32)", s.grads);
  print_gib(pl.muon ? "optimizer state (fp32: Muon momentum, AdamW exp_avg + exp_avg_sq)"
                    : "AdamW state (fp32 exp_avg, exp_avg_sq)",
            s.optim);
  print_gib("bf16 weight casts (unsharded runs)", casts);
  print_gib("FSDP root units (gathered all step)", root);
  print_gib("FSDP gathered block + prefetch + its gradients", gathered);
  print_gib("activations held after forward (counted)", act.after_forward);
  print_gib("forward peak: activations + loss chunks", act.forward_peak);
  print_gib("backward peak: activations + gradients in flight", act.backward_peak);
  const double total = s.params + s.grads + s.optim + casts + root + transient;
  print_gib("total", total);
  return total;
}

// FITS or DOES NOT FIT on the chosen card, the margin, and for a plan that does not fit the
// keys that shrink the larger part: the sharded state, or the step's activations.
void print_fit(const JobConfig& cfg, const Plan& pl, const Sizes& s, double total, const Gpu& g,
               const std::string& gpu) {
  constexpr double kGib = 1024.0 * 1024.0 * 1024.0;
  const double budget = g.memory_gib - kReserveGib;
  const double margin = budget - total / kGib;
  if (margin >= 0) {
    std::printf(
        "fit: FITS on one %s (%.1f GiB, %.0f GiB held back for the CUDA context, "
        "workspaces and fragmentation): %.2f GiB to spare\n",
        gpu.c_str(), g.memory_gib, kReserveGib, margin);
    return;
  }
  std::printf(
      "fit: DOES NOT FIT on one %s (%.1f GiB, %.0f GiB held back for the CUDA context, "
      "workspaces and fragmentation): %.2f GiB over\n",
      gpu.c_str(), g.memory_gib, kReserveGib, -margin);
  // The keys that shrink a rank's share, each with its current value: more shards cut the
  // parameters, gradients and AdamW state; tensor parallelism cuts weights and activations;
  // the batch shape and activation checkpointing cut activations.
  const double state = s.params + s.grads + s.optim;
  std::printf("  to fit: ");
  if (state / kGib > budget / 4)
    std::printf(
        "shard the parameters, gradients and AdamW state (%.1f GiB per rank) over more "
        "ranks (--world, parallelism.data_parallel_shard_degree, now %lld); ",
        state / kGib, static_cast<long long>(pl.shard));
  std::printf(
      "raise parallelism.tensor_parallel_degree (now %lld) or context_parallel_degree "
      "(now %lld); lower training.local_batch_size (now %lld) or training.seq_len (now "
      "%lld)",
      static_cast<long long>(pl.tp), static_cast<long long>(pl.cp),
      static_cast<long long>(cfg.training.local_batch_size),
      static_cast<long long>(cfg.training.seq_len));
  if (pl.ac != "full")
    std::printf("; set activation_checkpoint.mode = \"full\" (now \"%s\")", pl.ac.c_str());
  std::printf("\n");
}

// The share of attention's FLOPs a block-causal mask keeps: documents of D tokens packed into
// windows of T hold about T/D documents of D(D+1)/2 (query, key) pairs each, against the
// window's T(T+1)/2, so (D+1)/(T+1). Printed with the model's attention FLOPs; 1 for causal
// masks, and when the mean document length is not given (then said so).
double attention_keep(const JobConfig& cfg, const ModelInfo& info, const Plan& pl,
                      int64_t document_tokens) {
  if (model_document_options(cfg, 0).mask != AttnMask::BlockCausal) return 1.0;
  const double attn = 6.0 * static_cast<double>(info.attn_flops_dims * pl.seq_len);
  if (document_tokens == 0) {
    std::printf(
        "attention: block_causal, counted as causal (%.4g FLOPs/token); pass "
        "--document-tokens N (the data's mean document length) to count the mask\n",
        attn);
    return 1.0;
  }
  const double keep =
      std::min(1.0, static_cast<double>(document_tokens + 1) / static_cast<double>(pl.seq_len + 1));
  std::printf(
      "attention: block_causal with documents of %lld tokens in windows of %lld keeps %.3g of "
      "the causal pairs: %.4g -> %.4g attention FLOPs/token\n",
      static_cast<long long>(document_tokens), static_cast<long long>(pl.seq_len), keep, attn,
      attn * keep);
  return keep;
}

void print_time(const ModelInfo& info, const Plan& pl, const Sizes& s, const Gpu& g,
                const std::string& gpu, double attn_keep) {
  // A dp rank's tokens are shared by its cp ranks (each its slice of every sequence, the
  // head-tail balancer evening the attention) and its tp ranks (1/tp of every matmul).
  const double tokens = static_cast<double>(pl.micro_batches * pl.local_batch * pl.seq_len);
  const double fpt =
      static_cast<double>(info.flops_per_token(pl.seq_len)) -
      (1.0 - attn_keep) * 6.0 * static_cast<double>(info.attn_flops_dims * pl.seq_len);
  const double rank_flops = fpt * tokens / static_cast<double>(pl.tp * pl.cp);
  const double compute_s = rank_flops / (g.peak_flops * g.efficiency);
  // TP stays inside a node (NVLink); FSDP/HSDP cross nodes once the world exceeds one.
  const bool intra = pl.world <= g.per_node;
  const double bw = intra ? g.intra_bytes_s : g.inter_bytes_s;
  const double comm_s = (s.gather + s.reduce + s.replicate) / bw;
  // The cp groups sit after the tp ranks: inside a node while cp x tp fits in one.
  const double cp_bw = pl.cp * pl.tp <= g.per_node ? g.intra_bytes_s : g.inter_bytes_s;
  const double tp_s = s.tp_sent / g.intra_bytes_s + s.cp_sent / cp_bw;
  // FSDP's collectives overlap compute; the tensor- and context-parallel ones sit on the
  // critical path (the attention waits for the gathered keys and values).
  const double step_s = std::max(compute_s, comm_s) + tp_s + s.muon_gather / bw;
  std::printf("compute: %.4g FLOPs/token, %.4g tokens per dp rank per step, %.4g FLOPs per rank\n",
              fpt, tokens, rank_flops);
  std::printf(
      "bytes sent per rank per step: all-gather %.4g, reduce-scatter %.4g, "
      "all-reduce %.4g, tensor parallel %.4g\n",
      s.gather, s.reduce, s.replicate, s.tp_sent);
  if (pl.muon)
    std::printf(
        "Muon per step: %.4g bytes sent by the owner plan for FSDP-sharded matrices "
        "(bf16 update rows to each owner, result rows back, after the backward; "
        "tensor-parallel slices not counted)\n",
        s.muon_gather);
  if (pl.cp > 1)
    std::printf(
        "context parallel per step: %.4g bytes sent (K/V all-gathers and their "
        "gradients' reduce-scatters, counted from the meta-device step)\n",
        s.cp_sent);
  if (pl.tp > 1)
    std::printf(
        "tensor parallel per step: %.0f sequence-parallel collectives of %.4g bytes "
        "(activations, gathered size), %lld loss all-reduces of %.4g bytes\n",
        s.tp_collectives, s.act_bytes, static_cast<long long>(3 * pl.micro_batches), s.loss_bytes);
  std::printf(
      "step time: compute %.4g s, communication %.4g s (tensor + context parallel %.4g s), step "
      "%.4g s; MFU %.1f%% (assumed: follows from the assumed efficiency below, not "
      "measured)\n",
      compute_s, comm_s + tp_s, tp_s, step_s, 100.0 * rank_flops / (step_s * g.peak_flops));
  std::printf(
      "assumptions: peak %.4g FLOP/s at %.0f%% efficiency; %s bandwidth %.4g B/s per "
      "rank (%lld GPUs per node), tensor parallel over NVLink %.4g B/s; FSDP "
      "communication overlapped with compute, tensor-parallel not; activations counted "
      "from a meta-device forward and backward of one micro-batch (balanced MoE routing, "
      "flash-attention saved tensors)\n",
      g.peak_flops, 100 * g.efficiency, intra ? "NVLink" : "inter-node", bw,
      static_cast<long long>(g.per_node), g.intra_bytes_s);
  (void)gpu;
}

// The static expert exchange's buffers (compile.enable, or ep_exchange = "static"): per MoE
// layer and forward, at the configured capacity factor, the balanced share, the growth cap and
// the worst case. Not added to the total above, whose activations count balanced routing; the
// experts' rows saved for backward scale by the same factor over balanced.
void print_exchange(const JobConfig& cfg, const Plan& pl, const Model& m) {
  const auto* moe = dynamic_cast<const MoETransformer*>(&m);
  const std::string& x = cfg.moe.ep_exchange;
  if (!moe || pl.ep <= 1 || !(x == "static" || (x == "auto" && cfg.compile.enable))) return;
  const auto layers = moe->moe_layers();
  if (layers.empty()) return;
  const int64_t top_k = layers.front()->args().top_k, E = moe->num_experts();
  // Routed rows (token-expert pairs) per rank and micro-batch: the tensor-parallel ranks share
  // a dp rank's tokens along the sequence, except under expert tensor parallelism, where each
  // routes (and exchanges) the whole sequence for its hidden slices.
  const int64_t seq_share = split_experts(cfg) ? 1 : std::max<int64_t>(1, pl.tp);
  const int64_t n = pl.local_batch * pl.seq_len / seq_share * top_k;
  const int64_t El = E / pl.ep, dim = m.info().dim, eb = pl.param_bytes;
  auto mib = [&](double f) {
    return static_cast<double>(ep_static_buffer_bytes(n, top_k, pl.ep, El, dim, eb, f)) /
           (1024.0 * 1024.0);
  };
  const double f = cfg.moe.ep_capacity_factor;
  const double cap = std::max(f, cfg.moe.ep_capacity_factor_max);
  std::printf(
      "static expert exchange: receive buffer per MoE layer and forward %.1f MiB at "
      "capacity factor %g (balanced %.1f MiB, growth cap %g: %.1f MiB, worst case "
      "%.1f MiB); %zu MoE layers; not in the total above (balanced routing), the "
      "experts' saved rows scale by the same factor\n",
      mib(f), f, mib(1.0), cap, mib(cap), mib(INFINITY), layers.size());
}

// The point-to-point bytes of one step of `plan`, per pipeline rank and in all.
void print_pipeline_p2p(const JobConfig& cfg, const ModelInfo& info, const PipelinePlan& plan) {
  const auto& par = cfg.parallelism;
  // Every transfer is one activation or its gradient: (micro-batch, seq, dim) in the compute
  // dtype. Under TP each tp rank sends its sequence shard (sequence parallel) to the same tp
  // rank of the next stage; under CP each cp rank its T/cp tokens (its head-tail chunks).
  const int64_t dtype_bytes = cfg.training.mixed_precision_param == "bfloat16" ? 2 : 4;
  const int64_t seq =
      cfg.training.seq_len / (par.context_parallel_degree * par.tensor_parallel_degree);
  const double act =
      static_cast<double>(par.pipeline_parallel_microbatch_size * seq * info.dim * dtype_bytes);
  constexpr double kMib = 1024.0 * 1024.0;
  std::printf("p2p per step: activation (%lld, %lld, %lld) %s = %.3f MiB per transfer\n",
              static_cast<long long>(par.pipeline_parallel_microbatch_size),
              static_cast<long long>(seq), static_cast<long long>(info.dim),
              dtype_bytes == 2 ? "bfloat16" : "float32", act / kMib);
  int64_t all_sends = 0;
  for (size_t r = 0; r < plan.schedule.ranks.size(); ++r) {
    int64_t sf = 0, sb = 0, rf = 0, rb = 0;
    for (const Action& x : plan.schedule.ranks[r]) {
      sf += x.type == ActionType::kSendF;
      sb += x.type == ActionType::kSendB;
      rf += x.type == ActionType::kRecvF;
      rb += x.type == ActionType::kRecvB;
    }
    all_sends += sf + sb;
    std::printf(
        "  pipeline rank %zu: sends %lld activations + %lld gradients (%.3f MiB), "
        "receives %lld + %lld (%.3f MiB)\n",
        r, static_cast<long long>(sf), static_cast<long long>(sb),
        static_cast<double>(sf + sb) * act / kMib, static_cast<long long>(rf),
        static_cast<long long>(rb), static_cast<double>(rf + rb) * act / kMib);
  }
  std::printf(
      "  all pipeline ranks, both directions: %lld transfers, %.3f MiB per step (one "
      "pipeline; each data-parallel, cp and tp rank runs its own)\n",
      static_cast<long long>(all_sends), static_cast<double>(all_sends) * act / kMib);
}

// Activations under pipeline parallelism: each stage's forward of one micro-batch counted on
// the meta device, and each rank's peak over its schedule (the micro-batches it keeps in
// flight). `inner` is the job without its pipeline degree, over `stage_world` ranks. Returns
// the bytes each stage's context-parallel K/V exchange sends per micro-batch (zeros without
// CP): the forward's all-gathers, the recompute's, and their reduce-scatters in backward.
std::vector<double> print_pipeline_activations(const JobConfig& inner, int64_t stage_world,
                                               const PipelinePlan& plan, int64_t microbatch,
                                               std::vector<double>& rank_peaks) {
  Plan pl = make_plan(inner, stage_world);
  pl.local_batch = microbatch;
  auto cp_sent = std::make_shared<double>(0);
  std::unique_ptr<Model> m = activation_model(inner, pl, cp_sent);
  std::vector<double> per_stage, cp_bytes;
  std::printf(
      "activations (one micro-batch of %lld x %lld through each stage, counted; then "
      "the most a rank's schedule keeps in flight):\n",
      static_cast<long long>(pl.local_batch), static_cast<long long>(pl.seq_len));
  for (const PipelineStageSpec& sp : plan.stages.stages) {
    cp_bytes.push_back(0);
    per_stage.push_back(stage_activations(*m, pl, sp, *cp_sent, &cp_bytes.back()));
    char name[48];
    std::snprintf(name, sizeof name, "stage %lld, one micro-batch",
                  static_cast<long long>(sp.index));
    print_gib(name, per_stage.back());
  }
  for (size_t r = 0; r < plan.schedule.ranks.size(); ++r) {
    char name[48];
    std::snprintf(name, sizeof name, "pipeline rank %zu, peak in flight", r);
    rank_peaks.push_back(peak_in_flight(plan.schedule.ranks[r], per_stage));
    print_gib(name, rank_peaks.back());
  }
  if (pl.cp > 1)
    for (const PipelineStageSpec& sp : plan.stages.stages)
      std::printf("  stage %lld: cp K/V exchange sends %.3f MiB per micro-batch\n",
                  static_cast<long long>(sp.index),
                  cp_bytes[static_cast<size_t>(sp.index)] / (1024.0 * 1024.0));
  return cp_bytes;
}

// The state a stage keeps: fp32 parameters, gradients and AdamW's two moments (16 bytes a
// parameter), split over FSDP's `dp_shard` ranks (dp_shard x cp: context parallelism folds
// into it) x tp as evenly as FSDP and TP allow; under FSDP also its weights gathered in the
// compute dtype, which stay whole through the step (each micro-batch's forward and backward
// uses them).
// Returns each pipeline rank's bytes: its stages' state and gathered weights.
std::vector<double> print_stage_memory(const JobConfig& cfg, const Model& m,
                                       const PipelineStagePlan& st, int64_t dp_shard) {
  const int64_t tp = cfg.parallelism.tensor_parallel_degree, pp = st.pp_degree;
  const int64_t ep = cfg.parallelism.expert_parallel_degree;
  // The routed experts: split over tp only under expert tensor parallelism, and FSDP gathers
  // them over efsdp = dp_shard / ep only (each ep rank keeps its experts).
  const int64_t etp = cfg.parallelism.expert_tensor_parallel_degree > 1 ? tp : 1;
  const double gathered_bytes = cfg.training.mixed_precision_param == "bfloat16" ? 2.0 : 4.0;
  const auto units = m.param_units();
  const auto& params = m.params().all();
  std::printf(
      "memory per stage (fp32 params + grads + AdamW state over shard %lld x tp %lld, routed "
      "experts over ep %lld x efsdp %lld x etp %lld%s):\n",
      static_cast<long long>(dp_shard), static_cast<long long>(tp), static_cast<long long>(ep),
      static_cast<long long>(dp_shard / ep), static_cast<long long>(etp),
      dp_shard > 1 ? "; then the weights FSDP gathers, held through the step" : "");
  std::vector<double> per_rank(static_cast<size_t>(pp), 0.0);
  for (const PipelineStageSpec& sp : st.stages) {
    int64_t n = 0;
    double local = 0, gathered_n = 0;  // elements per rank: its shards, its gathered weights
    for (int64_t u = sp.first_unit(); u < sp.end_unit(); ++u)
      for (int64_t i : units[static_cast<size_t>(u)].params) {
        const Param& p = params[static_cast<size_t>(i)];
        int64_t k = 1;
        for (int64_t x : p.model_shape()) k *= x;
        n += k;
        const double cut = static_cast<double>(p.expert() ? etp : tp);
        local += static_cast<double>(k) / (cut * static_cast<double>(dp_shard));
        gathered_n += static_cast<double>(k) / (cut * static_cast<double>(p.expert() ? ep : 1));
      }
    const double bytes = 16.0 * local;
    const double gathered = dp_shard > 1 ? gathered_bytes * gathered_n : 0.0;
    per_rank[static_cast<size_t>(sp.rank)] += bytes + gathered;
    char name[64];
    const bool billions = n >= 1000000000;
    std::snprintf(name, sizeof name, "stage %lld (rank %lld), %.3f%s params",
                  static_cast<long long>(sp.index), static_cast<long long>(sp.rank),
                  static_cast<double>(n) / (billions ? 1e9 : 1e6), billions ? "B" : "M");
    print_gib(name, bytes);
    if (dp_shard > 1) {
      std::snprintf(name, sizeof name, "stage %lld, gathered weights",
                    static_cast<long long>(sp.index));
      print_gib(name, gathered);
    }
  }
  for (int64_t r = 0; r < pp; ++r) {
    char name[48];
    std::snprintf(name, sizeof name, "pipeline rank %lld, its stages", static_cast<long long>(r));
    print_gib(name, per_rank[static_cast<size_t>(r)]);
  }
  return per_rank;
}

// The fit verdict of each pipeline rank: its stages' state and gathered weights plus the
// most activations its schedule keeps in flight, against the card (what print_fit says
// without PP), and for a rank that does not fit the keys that shrink the larger part.
void print_pipeline_fit(const JobConfig& cfg, const std::vector<double>& state,
                        const std::vector<double>& activations, const Gpu& g,
                        const std::string& gpu, int64_t dp_shard) {
  constexpr double kGib = 1024.0 * 1024.0 * 1024.0;
  const double budget = g.memory_gib - kReserveGib;
  const auto& par = cfg.parallelism;
  for (size_t r = 0; r < state.size(); ++r) {
    const double total = (state[r] + activations[r]) / kGib, margin = budget - total;
    std::printf(
        "fit: pipeline rank %zu: %s on one %s (%.1f GiB, %.0f GiB held back for the CUDA "
        "context, workspaces and fragmentation): %.2f GiB %s (its stages' state %.2f "
        "GiB + activations in flight %.2f GiB = %.2f GiB)\n",
        r, margin >= 0 ? "FITS" : "DOES NOT FIT", gpu.c_str(), g.memory_gib, kReserveGib,
        std::abs(margin), margin >= 0 ? "to spare" : "over", state[r] / kGib, activations[r] / kGib,
        total);
    if (margin >= 0) continue;
    std::printf("  to fit: ");
    if (state[r] >= activations[r])
      std::printf(
          "spread its stages' parameters, gradients and AdamW state over more ranks: "
          "raise parallelism.pipeline_parallel_degree (now %lld), "
          "data_parallel_shard_degree (now %lld, with --world) or tensor_parallel_degree "
          "(now %lld); ",
          static_cast<long long>(par.pipeline_parallel_degree), static_cast<long long>(dp_shard),
          static_cast<long long>(par.tensor_parallel_degree));
    std::printf(
        "keep fewer activations in flight: lower "
        "parallelism.pipeline_parallel_microbatch_size (now %lld) or training.seq_len "
        "(now %lld), raise context_parallel_degree (now %lld), or a schedule that holds "
        "fewer micro-batches (parallelism.pipeline_parallel_schedule, now \"%s\"; GPipe "
        "holds them all)",
        static_cast<long long>(par.pipeline_parallel_microbatch_size),
        static_cast<long long>(cfg.training.seq_len),
        static_cast<long long>(par.context_parallel_degree),
        par.pipeline_parallel_schedule.c_str());
    if (cfg.activation_checkpoint.mode != "full")
      std::printf("; set activation_checkpoint.mode = \"full\" (now \"%s\")",
                  cfg.activation_checkpoint.mode.c_str());
    std::printf("\n");
  }
}

// The step time under PP, modelled: a stage's forward + backward of one micro-batch from its
// FLOPs (its layers' share of the model's per-token FLOPs, plus the output projection on the
// last stage) over tp ranks at the card's assumed efficiency; a rank's compute over the
// step's micro-batches, stretched by its scheduled idle share (busy / makespan ticks); plus
// its point-to-point sends, not overlapped (across nodes once the world exceeds one).
// Under CP the stages' K/V exchanges (`cp_bytes`, per stage and micro-batch) are added, not
// overlapped, as without PP. FSDP's per-stage gathers and reductions are taken as overlapped,
// tensor parallel's and MoE imbalance are not modelled.
void print_pipeline_time(const JobConfig& cfg, const ModelInfo& info, const PipelinePlan& plan,
                         const Gpu& g, int64_t world, int64_t accum,
                         const std::vector<double>& cp_bytes) {
  const auto& par = cfg.parallelism;
  const int64_t pp = plan.stages.pp_degree;
  // A stage's tokens are split over its cp ranks (slices) and tp ranks (the GEMMs' columns).
  const int64_t split = par.tensor_parallel_degree * par.context_parallel_degree;
  const int64_t seq = cfg.training.seq_len;
  const double fpt = static_cast<double>(info.flops_per_token(seq));
  const double head = 6.0 * static_cast<double>(info.dim * info.vocab_size);
  const double per_layer = (fpt - head) / static_cast<double>(info.n_layers);
  const double mb_tokens = static_cast<double>(par.pipeline_parallel_microbatch_size * seq);
  const double runs = static_cast<double>(plan.microbatches * accum);  // per stage and step
  const double speed = g.peak_flops * g.efficiency;
  std::vector<double> compute(static_cast<size_t>(pp), 0.0), sent(static_cast<size_t>(pp), 0.0);
  std::vector<double> cp_s(static_cast<size_t>(pp), 0.0);
  // The cp groups sit after the tp ranks: inside a node while cp x tp fits in one.
  const double cp_bw = split <= g.per_node ? g.intra_bytes_s : g.inter_bytes_s;
  for (const PipelineStageSpec& sp : plan.stages.stages) {
    const double f =
        per_layer * static_cast<double>(sp.end_layer - sp.first_layer) + (sp.has_head ? head : 0);
    const auto r = static_cast<size_t>(sp.rank);
    compute[r] += f * mb_tokens / static_cast<double>(split) / speed * runs;
    cp_s[r] += cp_bytes[static_cast<size_t>(sp.index)] * runs / cp_bw;
  }
  const int64_t dtype_bytes = cfg.training.mixed_precision_param == "bfloat16" ? 2 : 4;
  const double act = mb_tokens / static_cast<double>(split) * static_cast<double>(info.dim) *
                     static_cast<double>(dtype_bytes);
  for (size_t r = 0; r < plan.schedule.ranks.size(); ++r)
    for (const Action& x : plan.schedule.ranks[r])
      if (x.type == ActionType::kSendF || x.type == ActionType::kSendB)
        sent[r] += act * static_cast<double>(accum);
  const double bw = world <= g.per_node ? g.intra_bytes_s : g.inter_bytes_s;
  double step = 0;
  for (int64_t r = 0; r < pp; ++r) {
    const double busy = static_cast<double>(plan.timeline.busy[static_cast<size_t>(r)]);
    const double stretch = busy > 0 ? static_cast<double>(plan.timeline.makespan) / busy : 1.0;
    const auto i = static_cast<size_t>(r);
    const double t = compute[i] * stretch + sent[i] / bw + cp_s[i];
    std::printf(
        "  pipeline rank %lld: compute %.4g s, x %.3f for its idle ticks, p2p %.4g s%s -> "
        "%.4g s\n",
        static_cast<long long>(r), compute[i], stretch, sent[i] / bw,
        cp_s[i] > 0 ? (", cp K/V " + fmt_g(cp_s[i]) + " s").c_str() : "", t);
    step = std::max(step, t);
  }
  const double rank_flops =
      fpt * mb_tokens * runs / static_cast<double>(split * pp);  // the model's work, shared
  std::printf(
      "step time: %.4g s (the slowest pipeline rank); MFU %.1f%% (assumed: follows from "
      "the assumed efficiency %.0f%% and the schedule's bubble, not measured)\n",
      step, 100.0 * rank_flops / (step * g.peak_flops), 100 * g.efficiency);
}

// Under pipeline parallelism: the schedule's bubble, the point-to-point bytes of a step and
// the training state of each stage. The stage split, schedule and check are --dump-schedule's
// (app/pipeline_dump.h), then each stage's activations and each rank's peak of them, then
// the step time.
int estimate_pipeline(const JobConfig& cfg, int64_t world, const std::string& gpu) {
  const auto& par = cfg.parallelism;
  const int64_t pp = par.pipeline_parallel_degree;
  if (world % pp != 0)
    throw UserError("estimate --world " + std::to_string(world) +
                    " is not a multiple of parallelism.pipeline_parallel_degree = " +
                    std::to_string(pp) + "; allowed: a multiple of it");
  // The ranks of one stage: data and tensor parallel as without PP, over world / pp (the
  // pipeline keys at their defaults, which is all degree 1 allows).
  JobConfig inner = cfg;
  {
    const ParallelismSection def = default_config().parallelism;
    auto& q = inner.parallelism;
    q.pipeline_parallel_degree = 1;
    q.pipeline_parallel_schedule = def.pipeline_parallel_schedule;
    q.pipeline_parallel_schedule_csv = def.pipeline_parallel_schedule_csv;
    q.pipeline_parallel_microbatch_size = def.pipeline_parallel_microbatch_size;
    q.pipeline_parallel_layers_per_stage = def.pipeline_parallel_layers_per_stage;
    q.pipeline_parallel_first_stage_less_layers = def.pipeline_parallel_first_stage_less_layers;
    q.pipeline_parallel_last_stage_less_layers = def.pipeline_parallel_last_stage_less_layers;
    q.pipeline_parallel_expert_parallel_overlap = def.pipeline_parallel_expert_parallel_overlap;
    q.module_fqns_per_model_part = def.module_fqns_per_model_part;
  }
  validate_for_world(inner, world / pp);
  const DerivedConfig d = derive_config(inner, world / pp);
  const int64_t tp = par.tensor_parallel_degree;
  std::unique_ptr<Model> m = build_model(cfg, at::kCPU, /*defer_params=*/true);
  const ModelInfo info = m->info();
  const bool tied = m->params().index_of("output.weight") < 0;
  const PipelinePlan plan = plan_pipeline(cfg, info.n_layers, tied);
  const auto& st = plan.stages;

  std::printf("estimate: %s %s on %lld ranks (%s), pipeline parallel\n", info.name.c_str(),
              cfg.model.flavor.c_str(), static_cast<long long>(world), gpu.c_str());
  std::printf(
      "  plan: pp %lld x dp_replicate %lld x dp_shard %lld%s x tp %lld; %s, %lld stages "
      "(%lld per rank), %lld micro-batches of %lld x %lld tokens\n",
      static_cast<long long>(pp), static_cast<long long>(par.data_parallel_replicate_degree),
      static_cast<long long>(d.dp_shard),
      par.context_parallel_degree > 1
          ? (" x cp " + std::to_string(par.context_parallel_degree)).c_str()
          : "",
      static_cast<long long>(tp), st.schedule.name.c_str(), static_cast<long long>(st.num_stages()),
      static_cast<long long>(st.stages_per_rank), static_cast<long long>(plan.microbatches),
      static_cast<long long>(par.pipeline_parallel_microbatch_size),
      static_cast<long long>(cfg.training.seq_len));
  const auto& c = plan.timeline.costs;
  std::printf(
      "bubble: %.4f of the step idle (simulated in ticks: F %lld, B %lld, I %lld, W %lld; "
      "1F1B and GPipe: (p-1)/(m+p-1))\n",
      plan.timeline.bubble_fraction, static_cast<long long>(c.forward),
      static_cast<long long>(c.backward), static_cast<long long>(c.backward_input),
      static_cast<long long>(c.backward_weight));

  print_pipeline_p2p(cfg, info, plan);

  // FSDP shards each stage over dp_shard x cp (context parallelism folds into it).
  const int64_t shard = d.dp_shard * par.context_parallel_degree;
  const std::vector<double> state = print_stage_memory(cfg, *m, st, shard);
  std::vector<double> peaks;
  const std::vector<double> cp_bytes = print_pipeline_activations(
      inner, world / pp, plan, par.pipeline_parallel_microbatch_size, peaks);
  print_pipeline_fit(cfg, state, peaks, gpu_named(gpu), gpu, d.dp_shard);
  print_pipeline_time(cfg, info, plan, gpu_named(gpu), world, d.grad_accum_steps, cp_bytes);
  return 0;
}

}  // namespace

int run_estimate_command(int argc, char** argv) {
  const EstimateArgs a = parse_estimate_args(argc, argv);
  const JobConfig& cfg = a.cfg;
  const Gpu g = gpu_named(a.gpu);
  if (cfg.parallelism.pipeline_parallel_degree > 1) return estimate_pipeline(cfg, a.world, a.gpu);
  const Plan pl = make_plan(cfg, a.world);
  std::unique_ptr<Model> m = build_model(cfg, at::kCPU, /*defer_params=*/true);
  const ModelInfo info = m->info();
  // This rank's slices (exit 2 for a bad plan).
  split_for_tensor_parallel(*m, pl.tp, 0, split_experts(cfg));
  Sizes s = size_plan(*m, pl);
  size_tp(*m, pl, s);
  const Activations act = measure_activations(cfg, pl);
  s.cp_sent = act.cp_sent * static_cast<double>(pl.micro_batches);
  std::printf("estimate: %s %s on %lld ranks (%s)\n", info.name.c_str(), cfg.model.flavor.c_str(),
              static_cast<long long>(a.world), a.gpu.c_str());
  const std::string cp = pl.cp > 1 ? " x cp " + std::to_string(pl.cp) : "";
  std::printf(
      "  plan: dp_replicate %lld x dp_shard %lld%s x tp %lld (ep %lld), %lld "
      "micro-batch(es) of %lld x %lld tokens, activation checkpointing %s\n",
      static_cast<long long>(pl.replicate), static_cast<long long>(pl.shard / pl.cp), cp.c_str(),
      static_cast<long long>(pl.tp), static_cast<long long>(pl.ep),
      static_cast<long long>(pl.micro_batches), static_cast<long long>(pl.local_batch),
      static_cast<long long>(pl.seq_len), pl.ac.c_str());
  const double total = print_memory(pl, s, act);
  print_fit(cfg, pl, s, total, g, a.gpu);
  print_exchange(cfg, pl, *m);
  print_time(info, pl, s, g, a.gpu, attention_keep(cfg, info, pl, a.document_tokens));
  if (float8_linear_enabled(cfg))
    std::printf(
        "float8 linears (model.converters): not modeled; the GEMM time, the activations and the "
        "FSDP all-gather bytes above are those of bf16 linears (docs/float8.md)\n");
  return 0;
}

}  // namespace titan
