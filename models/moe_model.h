// What the MoE model families (Llama-4, DeepSeek-V3) share: the Model hooks for expert load
// balancing, training-state buffers, load metrics and the auxiliary loss, the MoE-aware
// active-parameter count, and how a job config sets up their MoE layers.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/train/model.h"
#include "moe/moe_layer.h"

namespace titan {

class MoETransformer : public Model {
 public:
  // Sum of the MoE layers' sequence-wise auxiliary losses of the last forward (undefined
  // when the loss is off or the forward was not a training forward).
  at::Tensor aux_loss() override;
  // Expert-bias update from the token counts of this step, summed over data-parallel ranks.
  void after_optimizer_step() override;
  // Every MoE layer's discard_step().
  void discard_step_state() override;
  // layers.<l>.moe.expert_bias and layers.<l>.moe.tokens_per_expert.
  std::vector<std::pair<std::string, at::Tensor>> buffers() override;
  // moe/layer<l>/max_mean_load_ratio and moe/layer<l>/dead_experts since the last log step.
  std::map<std::string, double> extra_metrics() override;

  // The MoE layer of transformer layer l, or nullptr for a dense layer.
  MoELayer* moe_layer(int64_t l) const { return moe_[static_cast<size_t>(l)].get(); }
  std::vector<MoELayer*> moe_layers() const;
  int64_t num_experts() const override;
  std::string experts_backend() const override;
  // Installs expert parallelism in every MoE layer (see MoELayer::set_expert_exchange).
  void set_expert_exchange(std::shared_ptr<ExpertExchange> ex) override;
  // Installs expert tensor parallelism in every MoE layer (MoELayer::set_expert_tensor_parallel).
  void set_expert_tensor_parallel(std::shared_ptr<TensorParallelComm> tp) override;

 protected:
  void reset_state() override;
  // Every forward (whole or a pipeline stage's) starts here: one with grad mode on is a
  // training forward.
  void begin_forward() override { training_ = at::GradMode::is_enabled(); }
  MoELayer::Mode moe_mode(int64_t l) const { return {training_, training_ && recompute_block(l)}; }
  // torchtitan's count: every non-embedding parameter, with routed experts scaled by K / E.
  int64_t active_non_embedding_params() const;

  std::vector<std::unique_ptr<MoELayer>> moe_;  // one slot per transformer layer
  bool training_ = false;
};

// A MoE layer's part of the tensor-parallel plan: the router and the shared experts
// replicated (on sequence shards, gradients summed over tp), the routed experts in the
// expert groups (split along their hidden size only under expert tensor parallelism).
void add_moe_to_tp_plan(TpPlan& plan, const MoELayer& m);

// Applies the job's [moe] section to a flavor's MoE arguments: the experts backend for
// `device` (logged) for experts of model dim `dim` and hidden size `expert_hidden` (the
// grouped kernels need multiples of 8 and bf16), the balancing coefficients. Throws UserError
// for a combination that cannot run (grouped_mm off SM90+, the sequence-wise loss with
// activation checkpointing).
void configure_moe(MoEArgs& moe, const JobConfig& cfg, at::Device device, int64_t dim,
                   int64_t expert_hidden);
// quantize.grouped_mm.float8.fqns against the built model: an entry that is a substring of no
// MoE layer's "layers.<l>.moe.experts" throws UserError naming the key; logs which layers'
// routed experts are float8. Nothing without the converter.
void check_float8_grouped_fqns(const JobConfig& cfg, const MoETransformer& m);
// The longest sequence the run feeds the model: training, and validation when enabled.
int64_t run_max_seq_len(const JobConfig& cfg);

}  // namespace titan
