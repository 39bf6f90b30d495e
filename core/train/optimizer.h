// AdamW over the model's fp32 master parameters, and global-norm gradient clipping.
//
// Two groups: parameters flagged weight_decay (matrices) decay, the rest (norm gains,
// embeddings) do not (docs/training.md). The step count lives in a device tensor per
// parameter; the learning rate, a host double computed from the step number, is written into
// a device tensor that the fused kernel reads, so a step performs no device-to-host
// synchronization and keeps the same tensors from step to step (capture-ready, docs/training.md).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "core/config/config.h"

namespace titan {

class AdamW {
 public:
  AdamW(std::vector<at::Tensor> params, std::vector<bool> decay, const OptimizerSection& cfg);
  // Writes the learning rate into the device tensor every implementation reads. Called
  // before the step (before a graph replay), never inside it: a captured step then reads
  // each replay's lr from device memory instead of baking in the capture-time value.
  void set_lr(double lr);
  // One update with the lr last written by set_lr: no host scalar that changes from step to
  // step reaches a kernel (the for-loop reference excepted, which reads the step count).
  void step();
  void step(double lr) {  // set_lr + step, for callers outside a captured step
    set_lr(lr);
    step();
  }
  // Zeroes the gradients in place: they keep their storage from step to step.
  void zero_grad();
  // The learning rate of the last step, as the fused kernel reads it (0-d, on the device).
  const at::Tensor& lr_tensor() const { return lr_; }

  // State for checkpoints: per parameter exp_avg, exp_avg_sq and step (fp32 scalars).
  std::vector<at::Tensor>& exp_avg() { return exp_avg_; }
  std::vector<at::Tensor>& exp_avg_sq() { return exp_avg_sq_; }
  std::vector<at::Tensor>& steps() { return steps_; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  void step_group(const std::vector<size_t>& idx, double wd);
  // optimizer.implementation = "foreach": multi-tensor ATen ops, no host read.
  void foreach_step(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g,
                    std::vector<at::Tensor>& m, std::vector<at::Tensor>& v,
                    std::vector<at::Tensor>& s, double wd) const;
  // optimizer.implementation = "for-loop": one parameter at a time (a reference).
  void loop_step(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g,
                 std::vector<at::Tensor>& m, std::vector<at::Tensor>& v,
                 std::vector<at::Tensor>& s, double wd) const;

  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
  at::Tensor lr_;  // fp32 on CUDA (the kernel reads a float*), fp64 on the CPU
  double host_lr_ = 0;  // what set_lr wrote; only the for-loop reference reads it
  std::vector<size_t> decay_idx_, no_decay_idx_;
  OptimizerSection cfg_;
};

// Squared L2 norm of the local gradients of `params`, a 0-d fp32 device tensor. Distributed
// runs all-reduce it before taking the root, so the norm spans every shard.
at::Tensor grad_norm_sq(const std::vector<at::Tensor>& params);
// Scales the gradients in place so their global norm `total_norm` (0-d device tensor) is
// at most max_norm; max_norm <= 0 only measures. Returns total_norm; reading it on the host
// is the caller's (logging) sync.
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                          const at::Tensor& total_norm);

}  // namespace titan
