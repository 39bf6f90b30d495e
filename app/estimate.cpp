#include "app/estimate.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/errors.h"
#include "core/fused_loss.h"
#include "core/model.h"
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

// Activation bytes saved per token by one block (fp32 or bf16 elements), from the tensors a
// Llama-style block keeps for backward: the block input, the two norm outputs, q/k/v, the
// attention output, the residual, and the SwiGLU's w1/w3 outputs and their product.
double block_saved_per_token(const ModelInfo& info, int64_t act_bytes) {
  const double d = static_cast<double>(info.dim);
  const double ffn = static_cast<double>(info.n_active_non_embedding) /
                     std::max<int64_t>(1, info.n_layers) / (3.0 * d) - 4.0 * d / 3.0;
  return static_cast<double>(act_bytes) * (8.0 * d + 3.0 * std::max(ffn, d));
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

// Activations held at the peak of backward for one micro-batch: every block's saved
// tensors (none: all blocks; full: the block inputs plus one block recomputed; selective:
// every Nth block recomputed), plus the loss's chunk buffers.
double activation_bytes(const JobConfig& cfg, const ModelInfo& info, const Plan& pl,
                        int64_t act_bytes) {
  const double tokens = static_cast<double>(pl.local_batch * pl.seq_len);
  const double block = block_saved_per_token(info, act_bytes) * tokens;
  const double input = static_cast<double>(info.dim * act_bytes) * tokens;
  const double layers = static_cast<double>(info.n_layers);
  double acts = layers * block;
  if (pl.ac == "full") {
    acts = layers * input + block;
  } else if (pl.ac == "selective") {
    const std::string& o = cfg.activation_checkpoint.selective_ac_option;
    const double every = o == "op" ? 0 : std::max(1.0, std::stod(o));
    if (every > 0) {
      const double recomputed = std::floor(layers / every);
      acts = (layers - recomputed) * block + recomputed * input + block;
    }
  }
  const double chunk_tokens =
      std::min(tokens, static_cast<double>(default_loss_chunk_tokens(info.vocab_size)));
  const double loss = 2.0 * 4.0 * chunk_tokens * static_cast<double>(info.vocab_size) +
                      tokens * static_cast<double>(info.dim) * 4.0;
  return acts + loss;
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
  const int64_t act_bytes = pl.param_bytes;
  const double acts = activation_bytes(cfg, info, pl, act_bytes);
  double buffers = 0;
  if (pl.shard > 1) {
    // The gathered block plus the prefetched one, the root units (kept gathered until their
    // backward), and up to 2 reduce-scatter send buffers in flight.
    buffers = 2 * s.max_unit + s.root_units +
              2 * s.max_unit / static_cast<double>(pl.param_bytes) *
                  static_cast<double>(pl.reduce_bytes);
  }
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
  print_gib("FSDP gathered units incl. prefetch + RS buffers", buffers);
  print_gib("activations (approximate) + loss chunks", acts);
  print_gib("total", s.params + s.grads + s.optim + buffers + acts);
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
              "activations from a Llama-style block's saved tensors (MoE and MLA blocks are "
              "approximated by their active parameters)\n",
              g.peak_flops, 100 * g.efficiency, intra ? "NVLink" : "inter-node",
              bw, static_cast<long long>(g.per_node));
  return 0;
}

}  // namespace titan
