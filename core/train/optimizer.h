// AdamW over the model's fp32 master parameters, and global-norm gradient clipping.
//
// Two groups: parameters flagged weight_decay (matrices) decay, the rest (norm gains,
// embeddings) do not (docs/training.md). The step count lives in a device tensor per
// parameter; the learning rate, a host double computed from the step number, is written into
// a device tensor that the fused kernel reads, so a step performs no device-to-host
// synchronization and keeps the same tensors from step to step (capture-ready, docs/training.md).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/config/param_groups.h"
#include "core/train/muon.h"

namespace titan {

class AdamW {
 public:
  AdamW(std::vector<at::Tensor> params, std::vector<bool> decay, const OptimizerSection& cfg);
  // With optimizer.param_groups' settings per parameter (empty: none): a parameter whose
  // group sets lr or weight_decay steps in a group of its own with that lr (scaled by the
  // schedule as optimizer.lr is) and weight decay.
  AdamW(std::vector<at::Tensor> params, std::vector<bool> decay, const OptimizerSection& cfg,
        const std::vector<ParamOverride>& set);
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
  // Parameters stepping with one weight decay and one lr (lr_ times lr_scale).
  struct Group {
    std::vector<size_t> idx;
    double wd = 0, lr_scale = 1;
    at::Tensor lr;  // lr_ itself when lr_scale is 1, else its own tensor (set_lr fills it)
  };
  void step_group(const Group& grp);
  // optimizer.implementation = "foreach": multi-tensor ATen ops, no host read.
  void foreach_step(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g,
                    std::vector<at::Tensor>& m, std::vector<at::Tensor>& v,
                    std::vector<at::Tensor>& s, double wd, const at::Tensor& lr) const;
  // optimizer.implementation = "for-loop": one parameter at a time (a reference).
  void loop_step(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g, std::vector<at::Tensor>& m,
                 std::vector<at::Tensor>& v, std::vector<at::Tensor>& s, double wd,
                 double lr) const;

  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
  at::Tensor lr_;       // fp32 on CUDA (the kernel reads a float*), fp64 on the CPU
  double host_lr_ = 0;  // what set_lr wrote; only the for-loop reference reads it
  // Decay (optimizer.weight_decay), no decay, then one per distinct param_groups setting.
  std::vector<Group> groups_;
  OptimizerSection cfg_;
};

// A parameter as the optimizer sees it: its local tensor and what routes it.
struct OptParam {
  std::string name;                  // torchtitan's fully qualified name
  at::Tensor value;                  // the local tensor (a slice under FSDP or tensor parallelism)
  bool decay = true;                 // AdamW: in the weight-decay group
  std::vector<int64_t> whole_shape;  // before any parallelism cut it (Param::model_shape)
  int64_t index = -1;                // in the model's ParamStore (for a MatrixLayout)
};

// The one optimizer step the train step drives: members per parameter group, each with its
// own state (docs/training.md, "Muon"). optimizer.name = "AdamW": one AdamW member for every
// parameter; "Muon": a Muon member for the matrices the routing gives it
// (core/config/param_groups.h) and an AdamW member for the rest. Slots are the parameters in
// the order given; checkpoints and the pipeline address state by slot.
class Optimizer {
 public:
  // Every parameter on AdamW (the tests' and the plain form).
  Optimizer(std::vector<at::Tensor> params, std::vector<bool> decay, const OptimizerSection& cfg);
  // Routed by cfg.name and cfg.param_groups; a group rule matching nothing throws UserError.
  // `layout` gathers split matrices for Muon (null: nothing is split).
  Optimizer(const std::vector<OptParam>& params, const OptimizerSection& cfg, MatrixLayout* layout);
  // With the routing done by the caller (kinds[i] for params[i]): a pipeline rank routes the
  // whole model, so that a rule matching only another stage's parameters is not refused.
  Optimizer(const std::vector<OptParam>& params, const std::vector<OptimizerKind>& kinds,
            const OptimizerSection& cfg, MatrixLayout* layout);
  // The schedule's lr (for optimizer.lr); Muon gets it scaled by muon_lr / optimizer.lr.
  // Written into device tensors, never read back (capture-ready, as AdamW::set_lr).
  void set_lr(double lr);
  void step();
  void step(double lr) {
    set_lr(lr);
    step();
  }
  void zero_grad();
  const std::vector<at::Tensor>& params() const { return params_; }
  // AdamW's lr tensor (0-d, on the device): what its fused kernel reads.
  const at::Tensor& lr_tensor() const { return adamw_->lr_tensor(); }

  OptimizerKind kind(size_t slot) const { return where_[slot].first; }
  // The slot's state tensors laid out like its parameter, with their checkpoint names:
  // exp_avg and exp_avg_sq for AdamW, momentum_buffer for Muon.
  std::vector<std::pair<std::string, at::Tensor>> param_state(size_t slot);
  // AdamW's step count of the slot (0-d fp32); undefined for Muon (it has none).
  at::Tensor step_count(size_t slot);
  // Bytes of every state tensor on this rank (AdamW 8 per element, Muon 4).
  int64_t state_bytes() const;
  int64_t num_muon() const { return muon_ ? static_cast<int64_t>(muon_->params().size()) : 0; }
  const Muon* muon() const { return muon_.get(); }  // null without Muon parameters

 private:
  void build(const std::vector<OptParam>& params, const std::vector<OptimizerKind>& kinds,
             MatrixLayout* layout);
  std::vector<at::Tensor> params_;
  std::vector<std::pair<OptimizerKind, size_t>> where_;  // slot -> (member, index in it)
  std::unique_ptr<AdamW> adamw_;
  std::unique_ptr<Muon> muon_;
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
