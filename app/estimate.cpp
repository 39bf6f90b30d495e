#include "app/estimate.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/base/errors.h"
#include "app/meta_kernels.h"
#include "app/train_step.h"
#include "core/telemetry/memory_stats.h"
#include "core/train/model.h"
#include "models/registry.h"

namespace titan {
namespace {

// What the estimate assumes of a GPU: dense bf16 peak, the fraction of it matmuls reach,
// and the bandwidth one rank gets inside a node (NVLink) and across nodes (the NIC).
struct Gpu {
  double peak_flops, efficiency, intra_bytes_s, inter_bytes_s;
  int64_t per_node;
};

Gpu gpu_named(const std::string& g) {
  static const std::map<std::string, Gpu> table = {
      {"a100", {312e12, 0.5, 300e9, 25e9, 8}},
      {"h100", {989e12, 0.45, 450e9, 50e9, 8}},
      {"h200", {989e12, 0.45, 450e9, 50e9, 8}},
      {"b200", {2250e12, 0.45, 900e9, 50e9, 8}},
  };
  auto it = table.find(g);
  if (it == table.end())
    throw UserError("estimate --gpu " + g + ": unknown; allowed: a100, h100, h200, b200");
  return it->second;
}

struct Plan {
  int64_t world = 1, replicate = 1, shard = 1, ep = 1;
  int64_t micro_batches = 1, local_batch = 1, seq_len = 1;
  int64_t param_bytes = 4, reduce_bytes = 4;  // all-gather / reduce-scatter element sizes
  bool reshard = true;
  std::string ac;
};

struct Sizes {
  double params = 0, grads = 0, optim = 0;    // bytes on one rank
  double max_unit = 0, root_units = 0;        // full (gathered) bytes, param dtype
  double gather = 0, reduce = 0, replicate = 0;  // bytes one rank sends per step
};

int64_t rows_of(const Param& p) { return p.value.dim() == 0 ? 1 : p.value.size(0); }

// Walks the FSDP units exactly as parallel/fsdp.cpp cuts them.
Sizes size_plan(const Model& m, const Plan& pl) {
  Sizes s;
  const auto& params = m.params().all();
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
      s.optim += 8 * local;
      unit_full[ex] += static_cast<double>(group * chunk * row_numel);
      if (pl.shard > 1) {
        const double passes = u.block >= 0 && pl.reshard ? 2 : 1;  // forward (+ regather)
        s.gather += passes * pl.micro_batches * static_cast<double>(group - 1) * local *
                    static_cast<double>(pl.param_bytes);
        s.reduce += pl.micro_batches * static_cast<double>(group - 1) * local *
                    static_cast<double>(pl.reduce_bytes);
      }
      const double rep = pl.shard > 1 ? pl.replicate : pl.world;
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

}  // namespace

namespace {

Plan make_plan(const JobConfig& cfg, int64_t world) {
  validate_for_world(cfg, world);
  const DerivedConfig d = derive_config(cfg, world);
  Plan pl;
  pl.world = world;
  pl.shard = d.dp_shard;
  pl.replicate = cfg.parallelism.data_parallel_replicate_degree;
  pl.ep = cfg.parallelism.expert_parallel_degree;
  pl.micro_batches = d.grad_accum_steps;
  pl.local_batch = cfg.training.local_batch_size;
  pl.seq_len = cfg.training.seq_len;
  pl.param_bytes = cfg.training.mixed_precision_param == "bfloat16" ? 2 : 4;
  pl.reduce_bytes = cfg.training.mixed_precision_reduce == "bfloat16" ? 2 : 4;
  pl.reshard = cfg.parallelism.fsdp_reshard_after_forward != "never";
  pl.ac = cfg.activation_checkpoint.mode;
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
};

Activations measure_activations(const JobConfig& cfg, const Plan& pl) {
  install_meta_memory_counter();
  register_meta_kernels();
  std::unique_ptr<Model> m = build_model(cfg, at::kMeta, /*defer_params=*/false);
  if (pl.param_bytes == 2) {
    // bf16 weights as FSDP gathers them (and as the cast cache holds them without FSDP,
    // counted separately): neither the casts nor the weights a GEMM saves are activations.
    m->set_compute_dtype(at::kBFloat16);
    for (at::Tensor& p : m->params().tensors()) p.set_data(p.to(at::kBFloat16));
  }
  apply_activation_checkpointing(*m, cfg.activation_checkpoint);
  for (at::Tensor& p : m->params().tensors()) p.mutable_grad() = at::zeros_like(p);
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
    loss.backward();
  }
  a.backward_peak = static_cast<double>(meta_memory_stats().peak - base);
  return a;
}

void print_gib(const char* what, double bytes) {
  std::printf("  %-48s %12.6f GiB\n", what, bytes / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace

int run_estimate_command(int argc, char** argv) {
  CLI::App app{"titan-train estimate: memory, FLOPs, communication and step time per rank"};
  std::string config_file, gpu = "h100";
  int64_t world = 1;
  std::vector<std::string> sets;
  app.add_option("--config", config_file, "job config (TOML)")->required();
  app.add_option("--world", world, "number of ranks (GPUs)")->check(CLI::PositiveNumber);
  app.add_option("--gpu", gpu, "a100, h100, h200 or b200 (peak FLOP/s and link bandwidths)");
  app.add_option("--set", sets, "key=value overrides, e.g. --set training.seq_len=8192");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string("estimate: ") + e.what());
  }
  JobConfig cfg = default_config();
  std::vector<std::string> warnings;
  apply_toml_file(cfg, config_file, warnings);
  for (const std::string& s : sets) {
    const auto eq = s.find('=');
    const auto dot = s.rfind('.', eq);
    if (eq == std::string::npos || dot == std::string::npos)
      throw UserError("estimate --set " + s + ": expected section.key=value (a TOML value)");
    const std::string toml =
        "[" + s.substr(0, dot) + "]\n" + s.substr(dot + 1, eq - dot - 1) + " = " + s.substr(eq + 1);
    apply_toml_string(cfg, toml, "--set " + s, warnings);
  }
  validate_config(cfg);
  const Gpu g = gpu_named(gpu);
  const Plan pl = make_plan(cfg, world);
  std::unique_ptr<Model> m = build_model(cfg, at::kCPU, /*defer_params=*/true);
  const ModelInfo& info = m->info();
  const Sizes s = size_plan(*m, pl);
  const Activations act = measure_activations(cfg, pl);
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
  std::printf("estimate: %s %s on %lld ranks (%s)\n", info.name.c_str(), cfg.model.flavor.c_str(),
              static_cast<long long>(world), gpu.c_str());
  std::printf("  plan: dp_replicate %lld x dp_shard %lld (ep %lld), %lld micro-batch(es) of "
              "%lld x %lld tokens, activation checkpointing %s\n",
              static_cast<long long>(pl.replicate), static_cast<long long>(pl.shard),
              static_cast<long long>(pl.ep), static_cast<long long>(pl.micro_batches),
              static_cast<long long>(pl.local_batch), static_cast<long long>(pl.seq_len),
              pl.ac.c_str());
  std::printf("memory per rank:\n");
  print_gib("parameters (fp32 shards)", s.params);
  print_gib("gradients (fp32)", s.grads);
  print_gib("AdamW state (fp32 exp_avg, exp_avg_sq)", s.optim);
  print_gib("bf16 weight casts (unsharded runs)", casts);
  print_gib("FSDP root units (gathered all step)", root);
  print_gib("FSDP gathered block + prefetch + its gradients", gathered);
  print_gib("activations held after forward (counted)", act.after_forward);
  print_gib("forward peak: activations + loss chunks", act.forward_peak);
  print_gib("backward peak: activations + gradients in flight", act.backward_peak);
  print_gib("total", s.params + s.grads + s.optim + casts + root + transient);
  const double tokens = static_cast<double>(pl.micro_batches * pl.local_batch * pl.seq_len);
  const double fpt = static_cast<double>(info.flops_per_token(pl.seq_len));
  const double compute_s = fpt * tokens / (g.peak_flops * g.efficiency);
  const bool intra = world <= g.per_node;
  const double bw = intra ? g.intra_bytes_s : g.inter_bytes_s;
  const double comm_s = (s.gather + s.reduce + s.replicate) / bw;
  const double step_s = std::max(compute_s, comm_s);  // full overlap assumed
  std::printf("compute: %.4g FLOPs/token, %.4g tokens per rank per step\n", fpt, tokens);
  std::printf("bytes sent per rank per step: all-gather %.4g, reduce-scatter %.4g, "
              "all-reduce %.4g\n", s.gather, s.reduce, s.replicate);
  std::printf("step time: compute %.4g s, communication %.4g s, step %.4g s; MFU %.1f%%\n",
              compute_s, comm_s, step_s, 100.0 * fpt * tokens / (step_s * g.peak_flops));
  std::printf("assumptions: peak %.4g FLOP/s at %.0f%% efficiency; %s bandwidth %.4g B/s per "
              "rank (%lld GPUs per node); communication fully overlapped with compute; "
              "activations counted from a meta-device forward and backward of one micro-batch "
              "(balanced MoE routing, flash-attention saved tensors)\n",
              g.peak_flops, 100 * g.efficiency, intra ? "NVLink" : "inter-node",
              bw, static_cast<long long>(g.per_node));
  return 0;
}

}  // namespace titan
