// The training loop and the one-step function it and the parity tests share.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "core/config.h"
#include "core/optimizer.h"
#include "models/model.h"
#include "parallel/launch_env.h"

namespace titan {

struct MicroBatch {
  at::Tensor tokens;  // (B, T) int64 on the model's device
  at::Tensor labels;  // (B, T) int64
};

// Sum over tokens of the cross-entropy, computed in fp32. logits: (B, T, V); labels: (B, T).
at::Tensor token_loss_sum(const at::Tensor& logits, const at::Tensor& labels);

struct StepResult {
  at::Tensor loss;       // 0-d: this rank's summed token loss / global token count
  at::Tensor grad_norm;  // 0-d: global gradient norm before clipping
  double fwdbwd_ms = 0;  // host time of forward+backward, and of clip+optimizer; exact on
  double opt_ms = 0;     // CPU, and on CUDA when time_phases synchronizes between them
};

// One optimizer step: forward and backward over the micro-batches (gradient accumulation),
// the loss normalized by `global_tokens`, clipping to max_norm, AdamW at `lr`, then the
// model's own post-step update (MoE expert bias). Nothing here reads device values unless
// time_phases asks for a synchronization between the phases (log steps on CUDA).
// Data-parallel reduction hooks of train_step. A single process passes none, so its step
// runs no collective at all.
class GradSync {
 public:
  virtual ~GradSync() = default;
  // After the last backward: makes every rank's gradients the sum over the ranks.
  virtual void reduce_gradients(const std::vector<at::Tensor>& params) = 0;
  // Sums the local squared gradient norm (0-d fp32) over the ranks, in place.
  virtual void reduce_norm_sq(at::Tensor& norm_sq) = 0;
};

StepResult train_step(Model& model, AdamW& opt, const std::vector<MicroBatch>& micro,
                      double global_tokens, double lr, double max_norm, bool time_phases = false,
                      GradSync* sync = nullptr);

// Builds everything from the config and trains. Returns the process exit status.
int run_training(const JobConfig& cfg, const LaunchEnv& launch);

// Where the bundled corpus and tokenizer live ($TITAN_CACHE, else ~/.cache/titan-train).
std::string titan_cache_dir();

}  // namespace titan
