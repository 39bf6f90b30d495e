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

Muon::Muon(std::vector<at::Tensor> params, std::vector<int64_t> ids,
           std::vector<std::vector<int64_t>> whole, const MuonArgs& args, MatrixLayout* layout)
    : params_(std::move(params)), ids_(std::move(ids)), args_(args), layout_(layout) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& w = whole[i];
    TORCH_CHECK(w.size() == 2 || w.size() == 3, "Muon: matrices only, got a ", w.size(),
                "-D parameter (the routing refuses it)");
    // A (E, A, B) tensor is E matrices of (A, B): the lr ratio is per matrix.
    ratio_.push_back(muon_lr_ratio(args_.adjust_lr_fn, w[w.size() - 2], w[w.size() - 1]));
    buf_.push_back(at::zeros_like(params_[i], at::MemoryFormat::Contiguous));
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
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    const at::Tensor& g = p.grad();
    at::Tensor& b = buf_[i];
    // Element-wise on whatever slice this rank holds (FSDP padding rows stay 0).
    b.lerp_(g, 1.0 - mu);
    at::Tensor u = args_.nesterov ? g.lerp(b, mu) : b;
    const bool split = layout_ && layout_->split(ids_[i]);
    at::Tensor whole = split ? layout_->gather(ids_[i], u) : u;
    at::Tensor o;
    if (whole.dim() == 2) {
      o = newton_schulz(whole, args_.ns, args_.ns_steps, args_.eps);
    } else {
      // Routed experts (E, A, B): each expert's matrix alone, as torch.optim.Muon would treat
      // E separate parameters. A batched (bmm) form is faster but not bit-equal (docs).
      std::vector<at::Tensor> os;
      for (int64_t e = 0; e < whole.size(0); ++e)
        os.push_back(newton_schulz(whole[e], args_.ns, args_.ns_steps, args_.eps));
      o = at::stack(os);
    }
    if (split) o = layout_->mine(ids_[i], o);
    // p (1 - lr wd) - lr s O: the lr from the device tensor (fp64 on the CPU, so 1 - lr wd is
    // formed as torch forms it on the host); O in fp32 as torch's add_ promotes it.
    if (args_.weight_decay != 0) p.mul_(1.0 - lr_ * args_.weight_decay);
    p.add_(o.to(p.scalar_type()) * (lr_ * -ratio_[i]));
  }
}

}  // namespace titan
