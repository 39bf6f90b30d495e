#include "models/moe_model.h"

#include <algorithm>

#include "core/base/errors.h"

namespace titan {

std::vector<MoELayer*> MoETransformer::moe_layers() const {
  std::vector<MoELayer*> v;
  for (auto& m : moe_)
    if (m) v.push_back(m.get());
  return v;
}

at::Tensor MoETransformer::aux_loss() {
  at::Tensor sum;
  for (auto* m : moe_layers()) {
    at::Tensor a = m->take_aux_loss();
    if (a.defined()) sum = sum.defined() ? sum + a : a;
  }
  return sum;
}

void MoETransformer::after_optimizer_step() {
  moe_balance_step(moe_layers(), dp_allreduce_);
}

void MoETransformer::discard_step_state() {
  for (auto* m : moe_layers()) m->discard_step();
}

std::vector<std::pair<std::string, at::Tensor>> MoETransformer::buffers() {
  std::vector<std::pair<std::string, at::Tensor>> b;
  for (auto* m : moe_layers()) {
    b.emplace_back(m->prefix() + "expert_bias", m->expert_bias);
    b.emplace_back(m->prefix() + "tokens_per_expert", m->tokens_per_expert);
  }
  return b;
}

std::map<std::string, double> MoETransformer::extra_metrics() {
  std::vector<std::pair<int64_t, MoELayer*>> v;
  for (size_t l = 0; l < moe_.size(); ++l)
    if (moe_[l]) v.emplace_back(static_cast<int64_t>(l), moe_[l].get());
  return moe_load_metrics(v);
}

int64_t MoETransformer::active_non_embedding_params() const {
  // Only top_k of the num_experts routed experts touch a token.
  const int64_t E = num_experts();
  const int64_t K = E > 0 ? moe_layers().front()->args().top_k : 0;
  int64_t n = 0;
  for (auto& p : params_.all()) {
    if (p.name == "tok_embeddings.weight") continue;
    const int64_t numel = p.value.numel();
    n += p.expert() ? numel * K / E : numel;
  }
  return n;
}

void MoETransformer::reset_state() {
  for (auto* m : moe_layers()) m->reset_state();
}

void add_moe_to_tp_plan(TpPlan& plan, const MoELayer& m) {
  for (int64_t i : m.param_indices()) {
    if (i == m.w1_index() || i == m.w3_index())
      plan.expert_column.push_back(i);
    else if (i == m.w2_index())
      plan.expert_row.push_back(i);
    else
      plan.replicate.push_back(i);
  }
}

void configure_moe(MoEArgs& moe, const JobConfig& cfg, at::Device device, int64_t dim,
                   int64_t expert_hidden) {
  ExpertsGemmShape shape;
  shape.dim = dim;
  shape.hidden = expert_hidden;
  // The trainer computes in bf16 with mixed_precision_param = bfloat16 on CUDA, and on the
  // CPU under the capture check (app/trainer.cpp).
  shape.dtype =
      (device.is_cuda() || cfg.compile.enable) && cfg.training.mixed_precision_param == "bfloat16"
          ? at::kBFloat16
          : at::kFloat;
  moe.backend = select_experts_backend(cfg.moe.experts_backend, device, cfg.compile.enable, shape);
  moe.load_balance_coeff = cfg.moe.load_balance_coeff;
  moe.seq_aux_loss_coeff = cfg.moe.seq_aux_loss_coeff;
  const std::string& ac = cfg.activation_checkpoint.mode;
  if (moe.seq_aux_loss_coeff > 0 && !ac.empty() && ac != "none")
    throw UserError("moe.seq_aux_loss_coeff = " + std::to_string(moe.seq_aux_loss_coeff) +
                    " cannot be combined with activation_checkpoint.mode = \"" + ac +
                    "\" (the loss is built inside the recomputed blocks); allowed: "
                    "moe.seq_aux_loss_coeff = 0, or activation_checkpoint.mode = \"none\"");
}

int64_t run_max_seq_len(const JobConfig& cfg) {
  int64_t n = cfg.training.seq_len;
  if (cfg.validation.enable) n = std::max(n, cfg.validation.seq_len);
  return n;
}

int64_t MoETransformer::num_experts() const {
  for (auto& m : moe_)
    if (m) return m->args().num_experts;
  return 0;
}

std::string MoETransformer::experts_backend() const {
  for (auto& m : moe_)
    if (m) return experts_backend_name(m->args().backend);
  return "";
}

void MoETransformer::set_expert_exchange(std::shared_ptr<ExpertExchange> ex) {
  for (auto& m : moe_)
    if (m) m->set_expert_exchange(ex);
}

void MoETransformer::set_expert_tensor_parallel(std::shared_ptr<TensorParallelComm> tp) {
  for (auto& m : moe_)
    if (m) m->set_expert_tensor_parallel(tp);
}

}  // namespace titan
