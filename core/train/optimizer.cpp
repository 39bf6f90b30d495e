#include "core/train/optimizer.h"

#include <algorithm>
#include <cmath>

namespace titan {

AdamW::AdamW(std::vector<at::Tensor> params, std::vector<bool> decay, const OptimizerSection& cfg)
    : AdamW(std::move(params), std::move(decay), cfg, {}) {}

AdamW::AdamW(std::vector<at::Tensor> params, std::vector<bool> decay, const OptimizerSection& cfg,
             const std::vector<ParamOverride>& set)
    : params_(std::move(params)), cfg_(cfg) {
  // The CPU kernel reads the tensor as a double, so the update equals the double-lr overload
  // bit for bit; the CUDA kernel reads fp32 from device memory.
  const at::TensorOptions o = params_.empty() ? at::TensorOptions() : params_[0].options();
  lr_ = at::zeros({}, o.dtype(o.device().is_cpu() ? at::kDouble : at::kFloat));
  groups_.push_back({{}, cfg_.weight_decay, 1.0, lr_});
  groups_.push_back({{}, 0.0, 1.0, lr_});
  for (size_t i = 0; i < params_.size(); ++i) {
    exp_avg_.push_back(at::zeros_like(params_[i], at::MemoryFormat::Contiguous));
    exp_avg_sq_.push_back(at::zeros_like(params_[i], at::MemoryFormat::Contiguous));
    steps_.push_back(at::zeros({}, params_[i].options().dtype(at::kFloat)));
    const ParamOverride ov = set.empty() ? ParamOverride{} : set[i];
    if (ov.lr < 0 && ov.weight_decay < 0) {
      groups_[decay[i] ? 0 : 1].idx.push_back(i);
      continue;
    }
    // A param_groups entry's own lr (relative to optimizer.lr, so the schedule's factor
    // scales it alike) and weight decay (for every parameter of the group, decay flag or not).
    const double wd = ov.weight_decay >= 0 ? ov.weight_decay : (decay[i] ? cfg_.weight_decay : 0);
    const double scale = ov.lr < 0 ? 1.0 : (cfg_.lr > 0 ? ov.lr / cfg_.lr : 0.0);
    auto it = std::find_if(groups_.begin() + 2, groups_.end(),
                           [&](const Group& g) { return g.wd == wd && g.lr_scale == scale; });
    if (it == groups_.end()) {
      groups_.push_back({{}, wd, scale, scale == 1.0 ? lr_ : at::zeros_like(lr_)});
      it = groups_.end() - 1;
    }
    it->idx.push_back(i);
  }
}

void AdamW::set_lr(double lr) {
  at::NoGradGuard ng;
  lr_.fill_(lr);  // a host-to-device write of a scalar, never a read
  for (Group& g : groups_)
    if (g.lr_scale != 1.0) g.lr.fill_(lr * g.lr_scale);
  host_lr_ = lr;
}

void AdamW::step() {
  at::NoGradGuard ng;
  for (const Group& g : groups_) step_group(g);
}

void AdamW::step_group(const Group& grp) {
  std::vector<at::Tensor> p, g, m, v, s;
  for (size_t i : grp.idx) {
    if (!params_[i].grad().defined()) continue;
    p.push_back(params_[i]);
    g.push_back(params_[i].grad());
    m.push_back(exp_avg_[i]);
    v.push_back(exp_avg_sq_[i]);
    s.push_back(steps_[i]);
  }
  if (p.empty()) return;
  at::_foreach_add_(s, 1.0);
  if (cfg_.implementation == "fused") {
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, grp.lr, cfg_.beta1, cfg_.beta2, grp.wd,
                      cfg_.eps, /*amsgrad=*/false, /*maximize=*/false);
  } else if (cfg_.implementation == "foreach") {
    foreach_step(p, g, m, v, s, grp.wd, grp.lr);
  } else {
    loop_step(p, g, m, v, s, grp.wd, host_lr_ * grp.lr_scale);
  }
}

void AdamW::foreach_step(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g,
                         std::vector<at::Tensor>& m, std::vector<at::Tensor>& v,
                         std::vector<at::Tensor>& s, double wd, const at::Tensor& lr) const {
  // Multi-tensor kernels with the bias corrections on the device (no host read of the step)
  // and the lr read from the lr tensor (no host scalar that changes between steps):
  // p = p (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).
  // On the CPU the lr is fp64 and 1 - lr wd is formed in fp64 as the host did, then rounded to
  // fp32 by the kernel as a host scalar is: the update is bit for bit the host-lr one.
  if (wd != 0) at::_foreach_mul_(p, 1.0 - lr * wd);
  at::_foreach_lerp_(m, g, 1.0 - cfg_.beta1);
  at::_foreach_mul_(v, cfg_.beta2);
  at::_foreach_addcmul_(v, g, g, 1.0 - cfg_.beta2);
  auto bc1 = at::_foreach_pow(cfg_.beta1, s);  // beta1^t, then 1 - beta1^t
  at::_foreach_neg_(bc1);
  at::_foreach_add_(bc1, 1.0);
  auto bc2 = at::_foreach_pow(cfg_.beta2, s);
  at::_foreach_neg_(bc2);
  at::_foreach_add_(bc2, 1.0);
  at::_foreach_sqrt_(bc2);
  auto step = at::_foreach_div(bc1, lr);  // -lr / bc1 after the two in-place ops
  at::_foreach_reciprocal_(step);
  at::_foreach_neg_(step);
  auto denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, bc2);
  at::_foreach_add_(denom, cfg_.eps);
  at::_foreach_div_(denom, step);  // m / (denom / step) = step * m / denom
  at::_foreach_addcdiv_(p, m, denom);
}

void AdamW::loop_step(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g,
                      std::vector<at::Tensor>& m, std::vector<at::Tensor>& v,
                      std::vector<at::Tensor>& s, double wd, double lr) const {
  // The textbook update, one parameter at a time, reading the step on the host: a reference
  // for checking the other two, not for speed (refused under compile.enable).
  for (size_t j = 0; j < p.size(); ++j) {
    const double t = s[j].item<double>();
    p[j].mul_(1.0 - lr * wd);
    m[j].lerp_(g[j], 1.0 - cfg_.beta1);
    v[j].mul_(cfg_.beta2).addcmul_(g[j], g[j], 1.0 - cfg_.beta2);
    const double bc1 = 1.0 - std::pow(cfg_.beta1, t);
    const double bc2 = 1.0 - std::pow(cfg_.beta2, t);
    at::Tensor denom = (v[j].sqrt() / std::sqrt(bc2)).add_(cfg_.eps);
    p[j].addcdiv_(m[j], denom, -lr / bc1);
  }
}

void AdamW::zero_grad() {
  // In place (torch's zero_grad(set_to_none=False)): the next backward accumulates into the
  // same storage, 0 + g = g exactly, so the losses do not change; the gradients stay
  // allocated through the next forward (docs/training.md weighs that memory).
  std::vector<at::Tensor> grads;
  for (auto& p : params_)
    if (p.grad().defined()) grads.push_back(p.mutable_grad());
  if (!grads.empty()) at::_foreach_zero_(grads);
}

at::Tensor grad_norm_sq(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty())
    return at::zeros({}, params.empty() ? at::TensorOptions() : params[0].options());
  // CPU kernels accumulate fp32 norms with a relative error near 1e-4 on embedding-sized
  // tensors, which would make the same gradients report different norms under different
  // shardings; fp64 accumulation there. CUDA's tree reductions are accurate in fp32.
  const bool cpu = grads[0].is_cpu();
  auto norms =
      at::_foreach_norm(grads, 2, cpu ? std::optional<at::ScalarType>(at::kDouble) : std::nullopt);
  at::Tensor n = at::stack(norms);
  return (cpu ? n.pow(2).sum() : n.to(at::kFloat).pow(2).sum()).to(at::kFloat);
}

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                          const at::Tensor& total_norm) {
  if (max_norm > 0) {
    std::vector<at::Tensor> grads;
    for (auto& p : params)
      if (p.grad().defined()) grads.push_back(p.grad());
    // coef = min(1, max_norm / (norm + 1e-6)), kept on the device.
    at::Tensor coef = at::clamp_max(max_norm / (total_norm + 1e-6), 1.0);
    at::_foreach_mul_(grads, coef);
  }
  return total_norm;
}

}  // namespace titan

namespace titan {

Optimizer::Optimizer(std::vector<at::Tensor> params, std::vector<bool> decay,
                     const OptimizerSection& cfg)
    : cfg_(cfg) {
  std::vector<OptParam> ps;
  for (size_t i = 0; i < params.size(); ++i)
    ps.push_back({"", params[i], static_cast<bool>(decay[i]), params[i].sizes().vec(),
                  static_cast<int64_t>(i)});
  build(ps, std::vector<OptimizerKind>(ps.size(), OptimizerKind::AdamW), nullptr);
}

Optimizer::Optimizer(const std::vector<OptParam>& params, const OptimizerSection& cfg,
                     MatrixLayout* layout)
    : cfg_(cfg) {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (auto& p : params) {
    names.push_back(p.name);
    shapes.push_back(p.whole_shape);
  }
  build(params,
        route_params(names, shapes, cfg.name == "Muon", parse_param_groups(cfg.param_groups)),
        layout);
}

Optimizer::Optimizer(const std::vector<OptParam>& params, const std::vector<OptimizerKind>& kinds,
                     const OptimizerSection& cfg, MatrixLayout* layout)
    : cfg_(cfg) {
  TORCH_CHECK(kinds.size() == params.size(), "Optimizer: one kind per parameter");
  build(params, kinds, layout);
}

void Optimizer::build(const std::vector<OptParam>& params, const std::vector<OptimizerKind>& kinds,
                      MatrixLayout* layout) {
  std::vector<at::Tensor> a, m;
  std::vector<bool> decay;
  std::vector<int64_t> ids;
  std::vector<std::vector<int64_t>> whole;
  for (size_t i = 0; i < params.size(); ++i) {
    params_.push_back(params[i].value);
    if (kinds[i] == OptimizerKind::Muon) {
      where_.push_back({OptimizerKind::Muon, m.size()});
      m.push_back(params[i].value);
      ids.push_back(params[i].index);
      whole.push_back(params[i].whole_shape);
    } else {
      where_.push_back({OptimizerKind::AdamW, a.size()});
      a.push_back(params[i].value);
      decay.push_back(params[i].decay);
    }
  }
  // optimizer.param_groups' own lr and weight decay, from the entry that routed each one.
  std::vector<ParamOverride> set_a, set_m;
  const std::vector<ParamGroupRule> rules =
      cfg_.name == "Muon" ? parse_param_groups(cfg_.param_groups) : std::vector<ParamGroupRule>{};
  for (size_t i = 0; i < params.size(); ++i)
    (kinds[i] == OptimizerKind::Muon ? set_m : set_a)
        .push_back(rules.empty() ? ParamOverride{} : param_override(params[i].name, rules));
  adamw_ = std::make_unique<AdamW>(a, decay, cfg_, set_a);  // possibly empty: holds the lr tensor
  if (!m.empty())
    muon_ = std::make_unique<Muon>(m, ids, whole, MuonArgs::from(cfg_), layout, set_m);
}

void Optimizer::set_lr(double lr) {
  adamw_->set_lr(lr);
  // The schedule's factor lr / optimizer.lr applied to Muon's peak; a zero peak keeps Muon
  // at zero as the schedule keeps AdamW.
  if (muon_) muon_->set_lr(cfg_.lr > 0 ? lr / cfg_.lr * cfg_.muon_lr : 0.0);
}

void Optimizer::step() {
  adamw_->step();
  if (muon_) muon_->step();
}

void Optimizer::zero_grad() {
  std::vector<at::Tensor> grads;
  for (auto& p : params_)
    if (p.grad().defined()) grads.push_back(p.mutable_grad());
  if (!grads.empty()) at::_foreach_zero_(grads);
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::param_state(size_t slot) {
  auto [kind, k] = where_[slot];
  if (kind == OptimizerKind::Muon) return {{"momentum_buffer", muon_->momentum_buffer()[k]}};
  return {{"exp_avg", adamw_->exp_avg()[k]}, {"exp_avg_sq", adamw_->exp_avg_sq()[k]}};
}

at::Tensor Optimizer::step_count(size_t slot) {
  auto [kind, k] = where_[slot];
  return kind == OptimizerKind::AdamW ? adamw_->steps()[k] : at::Tensor();
}

int64_t Optimizer::state_bytes() const {
  int64_t b = 0;
  auto bytes = [](const at::Tensor& t) { return static_cast<int64_t>(t.storage().nbytes()); };
  for (auto& t : adamw_->exp_avg()) b += bytes(t);
  for (auto& t : adamw_->exp_avg_sq()) b += bytes(t);
  if (muon_)
    for (auto& t : muon_->momentum_buffer()) b += bytes(t);
  return b;
}

}  // namespace titan
