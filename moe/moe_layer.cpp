#include "moe/moe_layer.h"

#include "core/train/capture_check.h"
#include "core/train/functional.h"
#include "core/train/recompute.h"

namespace titan {
namespace {

// n routed rows spread as evenly as possible over E experts.
std::vector<int64_t> balanced_counts(int64_t n, int64_t E) {
  std::vector<int64_t> c(static_cast<size_t>(E), n / E);
  for (int64_t e = 0; e < n % E; ++e) ++c[static_cast<size_t>(e)];
  return c;
}

}  // namespace

MoELayer::MoELayer(const MoEArgs& a, int64_t dim, int64_t hidden, const std::string& prefix,
                   ParamStore& store, at::Device device, double init_std)
    : args_(a), dim_(dim), hidden_(hidden), prefix_(prefix) {
  const int64_t E = a.num_experts;
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay, double std,
               ParamKind kind = ParamKind::Dense) {
    const InitSpec init = std > 0 ? InitSpec::trunc_normal(std) : InitSpec::zeros();
    int64_t i = store.add(prefix + name, std::move(shape), device, decay, init, kind);
    params_.push_back(i);
    return i;
  };
  gate_w_ = P("router.gate.weight", {E, dim}, true, init_std);
  if (a.gate_bias) gate_b_ = P("router.gate.bias", {E}, false, 0.0);
  w1_ = P("experts.w1", {E, hidden, dim}, true, 0.02, ParamKind::Expert);
  w2_ = P("experts.w2", {E, dim, hidden}, true, init_std, ParamKind::Expert);
  w3_ = P("experts.w3", {E, hidden, dim}, true, init_std, ParamKind::Expert);
  if (a.num_shared_experts > 0) {
    const int64_t hs = hidden * a.num_shared_experts;
    sw1_ = P("shared_experts.w1.weight", {hs, dim}, true, 0.02);
    sw2_ = P("shared_experts.w2.weight", {dim, hs}, true, init_std);
    sw3_ = P("shared_experts.w3.weight", {hs, dim}, true, init_std);
  }
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  expert_bias = at::zeros({E}, opts);
  tokens_per_expert = at::zeros({E}, opts);
  load_since_log = at::zeros({E}, opts);
}

void MoELayer::reset_state() {
  at::NoGradGuard ng;
  expert_bias.zero_();
  tokens_per_expert.zero_();
  load_since_log.zero_();
  pending_counts_.clear();
}

at::Tensor MoELayer::forward(const at::Tensor& x3, const std::vector<at::Tensor>& w, Mode mode) {
  const int64_t B = x3.size(0), S = x3.size(1), D = x3.size(2);
  const int64_t E = args_.num_experts, K = args_.top_k;
  ModuleScope scope("moe");
  size_t k = 0;
  const at::Tensor& gw = w[k++];
  at::Tensor gb = gate_b_ >= 0 ? w[k++] : at::Tensor();
  const at::Tensor &w1 = w[k], &w2 = w[k + 1], &w3 = w[k + 2];
  k += 3;
  at::Tensor x = x3.reshape({B * S, D});  // (T, D)

  Routing r = route_tokens(x, gw, gb, expert_bias, args_);
  const bool grouped = args_.backend == ExpertsBackend::GroupedMM;
  // grouped_mm: the permute writes the aligned layout and the combine reads it, so no pad or
  // unpad copy. Expert parallelism sends rows in plain expert order and aligns them locally.
  const bool aligned = grouped && !ep_;
  Dispatch d = plan_dispatch(r.experts, E, aligned ? experts_alignment(args_.backend) : 0);

  // Count once per training forward; a checkpoint recompute repeats the forward, not the step.
  const bool recompute = is_recomputing();
  if (mode.training && !recompute) {
    at::NoGradGuard ng;
    tokens_per_expert.add_(d.counts);
  }

  at::Tensor routed = permute_tokens(x, d);                // (N, D), N = T*K; aligned: (M, D)
  at::Tensor top_sorted = permute_slots(r.top_scores, d);  // (N,) or (M,)
  if (args_.score_before_experts)
    routed = (routed.to(at::kFloat) * top_sorted.unsqueeze(1)).to(x.scalar_type());

  at::Tensor out_sorted;
  if (ep_) {
    out_sorted = expert_parallel_experts(routed, w1, w2, w3, d, mode, recompute);
  } else if (grouped) {
    out_sorted = grouped_experts(routed, w1, w2, w3, d);
  } else {
    // The loop backend's one host sync per layer and forward. A checkpointed forward leaves
    // its counts for the recompute, which then reads no device value either.
    std::vector<int64_t> host;
    if (recompute && !pending_counts_.empty()) {
      host = std::move(pending_counts_.front());
      pending_counts_.pop_front();
    } else {
      // Meta tensors (titan-train estimate) carry no counts: perfectly balanced routing.
      host = routed.is_meta() ? balanced_counts(routed.size(0), d.counts.size(0))
                              : counts_to_host(d.counts);
      if (mode.checkpointed && !recompute) pending_counts_.push_back(host);
    }
    out_sorted = loop_experts(routed, w1, w2, w3, host);
  }

  at::Tensor shared;
  if (sw1_ >= 0) shared = swiglu(x, w[k], w[k + 1], w[k + 2]);  // (T, D)

  // (T, D): each token's K expert outputs, weighted by their scores unless the scores were
  // applied before the experts.
  at::Tensor out = combine_tokens(
      out_sorted, args_.score_before_experts ? at::Tensor() : top_sorted.to(at::kFloat), d);
  if (shared.defined()) out = shared + out;

  TORCH_CHECK(!(args_.seq_aux_loss_coeff > 0 && mode.training && mode.checkpointed),
              "the MoE sequence-wise auxiliary loss cannot be combined with activation "
              "checkpointing (its graph would be lost in the no-grad checkpointed forward)");
  if (args_.seq_aux_loss_coeff > 0 && mode.training && !recompute && at::GradMode::is_enabled()) {
    // DeepSeek-V3's sequence-wise balance loss, per sequence b:
    //   f_i = E / (K * S) * count_i,  P_i = mean_t s'_{i,t} (s' = scores normalized per token),
    //   L = coeff * sum_i f_i P_i, averaged over the B sequences.
    at::Tensor s = r.scores.view({B, S, E});
    at::Tensor p = (s / s.sum(-1, true)).mean(1);  // (B, E)
    at::Tensor cnt = at::zeros({B, E}, s.options())
                         .scatter_add_(1, r.experts.view({B, S * K}),
                                       at::ones({B, S * K}, s.options()));  // (B, E)
    at::Tensor f = cnt * (static_cast<double>(E) / static_cast<double>(K * S));
    at::Tensor l = (f * p).sum(-1).mean() * args_.seq_aux_loss_coeff;
    aux_ = aux_.defined() ? aux_ + l : l;
  }
  return out.view({B, S, D});
}

at::Tensor MoELayer::expert_parallel_experts(const at::Tensor& routed, const at::Tensor& w1,
                                             const at::Tensor& w2, const at::Tensor& w3,
                                             const Dispatch& d, Mode mode, bool recompute) {
  // The exchange's host read of the split sizes is expert parallelism's named sync; a
  // recompute reuses the checkpointed forward's splits (the routing is the same).
  std::vector<int64_t> known;
  if (recompute && !pending_counts_.empty()) {
    known = std::move(pending_counts_.front());
    pending_counts_.pop_front();
  }
  ExpertExchange::Received got = ep_->dispatch(routed, d.counts, known.empty() ? nullptr : &known);
  if (mode.checkpointed && !recompute) pending_counts_.push_back(got.splits);
  const int64_t El = static_cast<int64_t>(got.local_counts.size());
  TORCH_CHECK(w1.size(0) == El, "expert parallelism: this rank holds ", w1.size(0),
              " experts but receives rows for ", El);
  at::Tensor y;
  if (args_.backend == ExpertsBackend::GroupedMM) {
    const auto idx = at::TensorOptions().dtype(at::kLong).device(routed.device());
    // output_size: the row count is known on the host, so repeat_interleave needs no sync.
    at::Tensor ids = at::repeat_interleave(
        at::arange(El, idx), at::tensor(got.local_counts, idx.device(at::kCPU)).to(routed.device()),
        /*dim=*/0, /*output_size=*/got.rows.size(0));
    Dispatch local = plan_dispatch(ids.view({-1, 1}), El, experts_alignment(args_.backend));
    // The rows arrive in expert order (ids ascending), so the aligned permute is one gather.
    y = unpad_groups(grouped_experts(permute_tokens(got.rows, local), w1, w2, w3, local), local);
  } else {
    y = loop_experts(got.rows, w1, w2, w3, got.local_counts);
  }
  return ep_->combine(y, got);
}

at::Tensor MoELayer::take_aux_loss() {
  at::Tensor a = aux_;
  aux_ = at::Tensor();
  return a;
}

void moe_balance_step(const std::vector<MoELayer*>& layers,
                      const std::function<void(at::Tensor&)>& dp_allreduce) {
  if (layers.empty()) return;
  at::NoGradGuard ng;
  std::vector<at::Tensor> c;
  for (auto* l : layers) {
    c.push_back(l->tokens_per_expert);
    l->clear_pending();  // every backward of this step has run
  }
  at::Tensor counts = at::stack(c);  // (L, E)
  if (dp_allreduce) dp_allreduce(counts);
  for (size_t i = 0; i < layers.size(); ++i) {
    MoELayer& l = *layers[i];
    at::Tensor cnt = counts[static_cast<int64_t>(i)];
    const double coeff = l.args().load_balance_coeff;
    if (coeff > 0) {
      at::Tensor delta = at::sign(cnt.mean() - cnt) * coeff;
      delta = delta - delta.mean();
      l.expert_bias.add_(delta);
    }
    l.load_since_log.add_(cnt);
    l.tokens_per_expert.zero_();
  }
}

std::map<std::string, double> moe_load_metrics(
    const std::vector<std::pair<int64_t, MoELayer*>>& layers) {
  std::map<std::string, double> m;
  if (layers.empty()) return m;
  at::NoGradGuard ng;
  std::vector<at::Tensor> c;
  for (auto& [id, l] : layers) c.push_back(l->load_since_log);
  at::Tensor counts = at::stack(c).to(at::kCPU, at::kDouble);  // (L, E): the log step's read
  for (size_t i = 0; i < layers.size(); ++i) {
    at::Tensor cnt = counts[static_cast<int64_t>(i)];
    const double mean = cnt.mean().item<double>();
    const std::string p = "moe/layer" + std::to_string(layers[i].first) + "/";
    m[p + "max_mean_load_ratio"] = mean > 0 ? cnt.max().item<double>() / mean : 0.0;
    m[p + "dead_experts"] = static_cast<double>((cnt == 0).sum().item<int64_t>());
    layers[i].second->load_since_log.zero_();
  }
  return m;
}

}  // namespace titan
