#include "core/train/muon.h"

#include <algorithm>
#include <cmath>

#include <ATen/core/grad_mode.h>

namespace titan {

MuonArgs MuonArgs::from(const OptimizerSection& o) {
  MuonArgs a;
  a.lr = o.muon_lr;
  a.weight_decay = o.muon_weight_decay;
  a.momentum = o.muon_momentum;
  a.nesterov = o.muon_enable_nesterov;
  TORCH_CHECK(o.muon_ns_coefficients.size() == 3, "validate_config checks the coefficients");
  a.ns = {o.muon_ns_coefficients[0], o.muon_ns_coefficients[1], o.muon_ns_coefficients[2]};
  a.ns_steps = o.muon_ns_steps;
  a.eps = o.muon_eps;
  a.adjust_lr_fn = o.muon_adjust_lr_fn;
  return a;
}

double muon_lr_ratio(const std::string& fn, int64_t rows, int64_t cols) {
  const double A = static_cast<double>(rows), B = static_cast<double>(cols);
  // torch.optim.Muon's _adjust_lr (original, match_rms_adamw) and the unclamped spectral
  // scaling torchtitan's main branch accepts (sqrt(A/B), which original clamps at 1).
  if (fn == "original") return std::sqrt(std::max(1.0, A / B));
  if (fn == "match_rms_adamw") return 0.2 * std::sqrt(std::max(A, B));
  if (fn == "spectral_unclamped") return std::sqrt(A / B);
  TORCH_CHECK(false, "muon_lr_ratio: unknown adjust_lr_fn ", fn, " (the registry checks it)");
  return 1.0;
}

at::Tensor newton_schulz(const at::Tensor& g, const std::array<double, 3>& abc, int64_t steps,
                         double eps) {
  TORCH_CHECK(g.dim() == 2, "newton_schulz: a matrix, got ", g.sizes());
  // The same ops in the same order as torch's _zeropower_via_newtonschulz, so one rank equals
  // torch.optim.Muon bit for bit on the CPU: bf16 throughout, the Gram matrix on the short
  // side (x x^T is min(A, B) square).
  const bool tall = g.size(0) > g.size(1);
  at::Tensor x = g.to(at::kBFloat16, /*non_blocking=*/false, /*copy=*/true);
  if (tall) x = x.t();
  x.div_(x.norm().clamp_min(eps));  // spectral norm <= Frobenius norm <= 1
  for (int64_t s = 0; s < steps; ++s) {
    at::Tensor gram = at::mm(x, x.t());
    at::Tensor update = at::addmm(gram, gram, gram, /*beta=*/abc[1], /*alpha=*/abc[2]);
    x = at::addmm(x, update, x, /*beta=*/abc[0]);
  }
  return tall ? x.t() : x;
}

at::Tensor newton_schulz_batched(const at::Tensor& g, const std::array<double, 3>& abc,
                                 int64_t steps, double eps) {
  TORCH_CHECK(g.dim() == 3, "newton_schulz_batched: (E, A, B), got ", g.sizes());
  // newton_schulz on each of the E matrices at once: the same ops, batched (bmm, baddbmm and
  // a norm per matrix), E times fewer kernel launches for the routed experts.
  const bool tall = g.size(1) > g.size(2);
  at::Tensor x = g.to(at::kBFloat16, /*non_blocking=*/false, /*copy=*/true);
  if (tall) x = x.transpose(1, 2);
  x = x / at::linalg_vector_norm(x, 2, {1, 2}, /*keepdim=*/true).clamp_min(eps);
  for (int64_t s = 0; s < steps; ++s) {
    at::Tensor gram = at::bmm(x, x.transpose(1, 2));
    at::Tensor update = at::baddbmm(gram, gram, gram, /*beta=*/abc[1], /*alpha=*/abc[2]);
    x = at::baddbmm(x, update, x, /*beta=*/abc[0]);
  }
  return tall ? x.transpose(1, 2).contiguous() : x;
}

Muon::Muon(std::vector<at::Tensor> params, std::vector<int64_t> ids,
           std::vector<std::vector<int64_t>> whole, const MuonArgs& args, MatrixLayout* layout,
           const std::vector<ParamOverride>& set)
    : params_(std::move(params)), ids_(std::move(ids)), args_(args), layout_(layout) {
  std::vector<int64_t> split_ids;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& w = whole[i];
    TORCH_CHECK(w.size() == 2 || w.size() == 3, "Muon: matrices only, got a ", w.size(),
                "-D parameter (the routing refuses it)");
    // A (E, A, B) tensor is E matrices of (A, B): the lr ratio is per matrix.
    const int64_t A = w[w.size() - 2], B = w[w.size() - 1];
    ratio_.push_back(muon_lr_ratio(args_.adjust_lr_fn, A, B));
    buf_.push_back(at::zeros_like(params_[i], at::MemoryFormat::Contiguous));
    const ParamOverride ov = set.empty() ? ParamOverride{} : set[i];
    lr_scale_.push_back(ov.lr < 0 ? 1.0 : (args_.lr > 0 ? ov.lr / args_.lr : 0.0));
    wd_.push_back(ov.weight_decay < 0 ? args_.weight_decay : ov.weight_decay);
    is_split_.push_back(layout_ && layout_->split(ids_[i]));
    if (is_split_.back()) {
      split_.push_back(i);
      split_ids.push_back(ids_[i]);
    }
  }
  if (layout_) layout_->plan(split_ids);
  // What the plan leaves this rank: its whole (unsplit) matrices and the split ones it owns.
  std::vector<bool> own(params_.size(), true);
  for (size_t j = 0; j < split_.size(); ++j) own[split_[j]] = layout_->owns(j);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& w = whole[i];
    const int64_t E = w.size() == 3 ? w[0] : 1, A = w[w.size() - 2], B = w[w.size() - 1];
    const double cost = static_cast<double>(E) * A * B * std::min(A, B);
    plan_.all_matrices += E;
    plan_.all_cost += cost;
    if (own[i]) {
      plan_.own_matrices += E;
      plan_.own_cost += cost;
    }
  }
  const at::TensorOptions o = params_.empty() ? at::TensorOptions() : params_[0].options();
  lr_ = at::zeros({}, o.dtype(o.device().is_cpu() ? at::kDouble : at::kFloat));
}

void Muon::set_lr(double lr) {
  at::NoGradGuard ng;
  lr_.fill_(lr);  // a host-to-device write, never a read
}

void Muon::step() {
  at::NoGradGuard ng;
  const double mu = args_.momentum;
  const size_t n = params_.size();
  // U in bf16: Newton-Schulz's first op casts to bf16, so casting before the exchange is
  // exact and halves what the owner plan sends.
  std::vector<at::Tensor> u(n), o(n);
  for (size_t i = 0; i < n; ++i) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) {
      // A split matrix's collective needs every rank's piece: zeros, result unused.
      if (is_split_[i]) u[i] = at::zeros(p.sizes(), p.options().dtype(at::kBFloat16));
      continue;
    }
    const at::Tensor& g = p.grad();
    at::Tensor& b = buf_[i];
    // Element-wise on whatever slice this rank holds (FSDP padding rows stay 0).
    b.lerp_(g, 1.0 - mu);
    u[i] = (args_.nesterov ? g.lerp(b, mu) : b).to(at::kBFloat16);
  }
  auto orth = [&](const at::Tensor& w) {
    at::Tensor r;
    if (w.dim() == 2) {
      r = newton_schulz(w, args_.ns, args_.ns_steps, args_.eps);
      ns_calls_ += 1;
    } else {
      // Routed experts (E, A, B): each expert's matrix orthogonalized alone, as
      // torch.optim.Muon would treat E separate parameters, in one batched iteration.
      r = newton_schulz_batched(w, args_.ns, args_.ns_steps, args_.eps);
      ns_calls_ += w.size(0);
    }
    return r;
  };
  for (size_t i = 0; i < n; ++i)
    if (!is_split_[i] && u[i].defined()) o[i] = orth(u[i]);
  if (!split_.empty()) {
    std::vector<at::Tensor> local;
    for (size_t i : split_) local.push_back(u[i]);
    std::vector<at::Tensor> mine = layout_->orthogonalize(local, orth);
    for (size_t j = 0; j < split_.size(); ++j) o[split_[j]] = mine[j];
  }
  for (size_t i = 0; i < n; ++i) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    // p (1 - lr wd) - lr s O: the lr from the device tensor (fp64 on the CPU, so 1 - lr wd is
    // formed as torch forms it on the host); O in fp32 as torch's add_ promotes it.
    // A param_groups entry's own lr: lr_ scaled on the device (no host read).
    const at::Tensor lr = lr_scale_[i] == 1.0 ? lr_ : lr_ * lr_scale_[i];
    if (wd_[i] != 0) p.mul_(1.0 - lr * wd_[i]);
    p.add_(o[i].to(p.scalar_type()) * (lr * -ratio_[i]));
  }
}

}  // namespace titan
