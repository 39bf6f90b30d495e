#include "models/moe_model.h"

#include <algorithm>

#include "core/base/errors.h"
#include "core/base/log.h"

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
    if (i == m.w1_index() || i == m.w3_index() || i == m.b1_index() || i == m.b3_index())
      plan.expert_column.push_back(i);
    else if (i == m.w2_index())
      plan.expert_row.push_back(i);
    else
      plan.replicate.push_back(i);
  }
}

namespace {

// moe.experts_backend, resolved; with float8 grouped GEMMs the grouped layout is required: on
// the CPU auto takes it (with the CPU kernel), and the loop exits 2.
ExpertsBackend select_float8_aware_backend(const JobConfig& cfg, at::Device device,
                                           const ExpertsGemmShape& shape) {
  const std::string& req = cfg.moe.experts_backend;
  const bool f8 = float8_grouped_enabled(cfg);
  if (f8 && req == "auto" && !device.is_cuda()) {
    log_info(
        "=> MoE experts backend = grouped_mm on the CPU (auto with model.converters = "
        "quantize.grouped_mm.float8: the grouped layout with the CPU kernel)");
    return ExpertsBackend::GroupedMM;
  }
  const ExpertsBackend b = select_experts_backend(req, device, cfg.compile.enable, shape);
  if (f8 && b == ExpertsBackend::Loop)
    throw UserError("moe.experts_backend = \"" + req +
                    "\" resolves to the loop here, which "
                    "model.converters = \"quantize.grouped_mm.float8\" cannot use (float8 "
                    "grouped GEMMs need the grouped layout); allowed: auto or grouped_mm where "
                    "they resolve to a grouped kernel (bf16 on CUDA: training."
                    "mixed_precision_param = \"bfloat16\"), cutlass, or no grouped float8");
  return b;
}

}  // namespace

void check_float8_grouped_fqns(const JobConfig& cfg, const MoETransformer& m) {
  if (!float8_grouped_enabled(cfg)) return;
  std::vector<std::string> experts;
  for (const MoELayer* l : m.moe_layers()) experts.push_back(l->prefix() + "experts");
  std::string converted;
  int64_t n = 0;
  for (const MoELayer* l : m.moe_layers())
    if (l->float8_experts()) converted += (n++ ? ", " : "") + l->prefix() + "experts";
  for (const std::string& e : cfg.float8.grouped_mm_fqns) {
    bool hit = false;
    for (const std::string& f : experts) hit = hit || fqn_matches_any(f, {e});
    if (!hit)
      throw UserError("quantize.grouped_mm.float8.fqns entry \"" + e +
                      "\" matches no routed experts module of " + cfg.model.name + "/" +
                      cfg.model.flavor + "; allowed: a substring of one of " +
                      (experts.empty() ? std::string("(none: no MoE layer)")
                                       : experts.front() + " ... " + experts.back()) +
                      ", e.g. \"experts\"");
  }
  log_info("=> float8 grouped GEMMs: routed experts of " + std::to_string(n) + " of " +
           std::to_string(experts.size()) + " MoE layers (" + converted +
           "); shared experts and router untouched by this converter");
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
  moe.backend = select_float8_aware_backend(cfg, device, shape);
  if (float8_grouped_enabled(cfg)) {
    std::string why;
    moe.float8 = choose_float8_grouped_kernel(cuda_compute_capability(device), dim, expert_hidden,
                                              shape.dtype, &why);
    moe.float8_fqns = cfg.float8.grouped_mm_fqns;
    log_info(std::string("=> float8 grouped GEMMs (quantize.grouped_mm.float8): torchao's "
                         "rowwise recipe, e4m3, power-of-2 scales; ") +
             float8_grouped_kernel_name(*moe.float8) + " on " +
             (device.is_cuda() ? "CUDA" : "the CPU") + " (" + why + ")");
  }
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
