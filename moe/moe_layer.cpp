#include "moe/moe_layer.h"

#include "models/layers.h"

#include <torch/csrc/autograd/custom_function.h>

namespace titan {

MoELayer::MoELayer(const MoEArgs& a, int64_t dim, int64_t hidden, const std::string& prefix,
                   ParamStore& store, at::Device device)
    : args_(a), dim_(dim), hidden_(hidden), prefix_(prefix) {
  const int64_t E = a.num_experts;
  auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay) {
    int64_t i = store.add(prefix + name, at::empty(shape, opts), decay);
    params_.push_back(i);
    return i;
  };
  gate_w_ = P("router.gate.weight", {E, dim}, true);
  if (a.gate_bias) gate_b_ = P("router.gate.bias", {E}, false);
  w1_ = P("experts.w1", {E, hidden, dim}, true);
  w2_ = P("experts.w2", {E, dim, hidden}, true);
  w3_ = P("experts.w3", {E, hidden, dim}, true);
  if (a.num_shared_experts > 0) {
    const int64_t hs = hidden * a.num_shared_experts;
    sw1_ = P("shared_experts.w1.weight", {hs, dim}, true);
    sw2_ = P("shared_experts.w2.weight", {dim, hs}, true);
    sw3_ = P("shared_experts.w3.weight", {hs, dim}, true);
  }
  expert_bias = at::zeros({E}, opts);
  tokens_per_expert = at::zeros({E}, opts);
  load_since_log = at::zeros({E}, opts);
}

void MoELayer::init_weights(ParamStore& store, at::Generator& gen, double init_std) {
  at::NoGradGuard ng;
  auto trunc = [&](int64_t i, double std) {
    if (i < 0) return;
    at::Tensor cpu = at::empty(store[i].full_shape(), at::kFloat);
    trunc_normal_(cpu, 0.0, std, -2.0, 2.0, gen);
    store.assign(i, cpu);
  };
  trunc(gate_w_, init_std);
  if (gate_b_ >= 0) store.fill(gate_b_, 0.0);
  trunc(w1_, 0.02);
  trunc(w2_, init_std);
  trunc(w3_, init_std);
  trunc(sw1_, 0.02);
  trunc(sw2_, init_std);
  trunc(sw3_, init_std);
  expert_bias.zero_();
  tokens_per_expert.zero_();
  load_since_log.zero_();
  pending_counts_.clear();
}

at::Tensor MoELayer::forward(const at::Tensor& x3, const std::vector<at::Tensor>& w, Mode mode) {
  const int64_t B = x3.size(0), S = x3.size(1), D = x3.size(2);
  const int64_t E = args_.num_experts, K = args_.top_k;
  size_t k = 0;
  const at::Tensor& gw = w[k++];
  at::Tensor gb = gate_b_ >= 0 ? w[k++] : at::Tensor();
  const at::Tensor &w1 = w[k], &w2 = w[k + 1], &w3 = w[k + 2];
  k += 3;
  at::Tensor x = x3.reshape({B * S, D});  // (T, D)

  Routing r = route_tokens(x, gw, gb, expert_bias, args_);
  const bool grouped = args_.backend == ExpertsBackend::GroupedMM;
  Dispatch d = plan_dispatch(r.experts, E, grouped ? experts_alignment(args_.backend) : 0);

  // Count once per training forward; a checkpoint recompute repeats the forward, not the step.
  const bool recompute = is_recomputing();
  if (mode.training && !recompute) {
    at::NoGradGuard ng;
    tokens_per_expert.add_(d.counts);
  }

  at::Tensor routed = permute_tokens(x, d);                                     // (N, D), N = T*K
  at::Tensor top_sorted = r.top_scores.reshape({-1}).index_select(0, d.order);  // (N,)
  if (args_.score_before_experts)
    routed = (routed.to(at::kFloat) * top_sorted.unsqueeze(1)).to(x.scalar_type());

  at::Tensor out_sorted;
  if (ep_.size > 1) {
    out_sorted = expert_parallel_experts(routed, w1, w2, w3, d, ep_, args_.backend);
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
      host = counts_to_host(d.counts);
      if (mode.checkpointed && !recompute) pending_counts_.push_back(host);
    }
    out_sorted = loop_experts(routed, w1, w2, w3, host);
  }

  at::Tensor shared;
  if (sw1_ >= 0) shared = swiglu(x, w[k], w[k + 1], w[k + 2]);  // (T, D)

  at::Tensor per_slot = unpermute_tokens(out_sorted, d);  // (T, K, D)
  at::Tensor out;
  if (args_.score_before_experts) {
    out = per_slot.sum(1);
  } else {
    out = at::bmm(r.top_scores.reshape({-1, 1, K}), per_slot.to(at::kFloat))
              .to(x.scalar_type())
              .squeeze(1);  // (T, D)
  }
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

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Differentiable row all-to-all: the gradient travels back along the reversed splits.
struct AllToAll : public torch::autograd::Function<AllToAll> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t ep_ptr,
                               std::vector<int64_t> out_splits, std::vector<int64_t> in_splits) {
    const auto& ep = *reinterpret_cast<const ExpertParallel*>(ep_ptr);
    ctx->saved_data["ep"] = ep_ptr;
    ctx->saved_data["out"] = out_splits;
    ctx->saved_data["in"] = in_splits;
    int64_t rows = 0;
    for (int64_t n : out_splits) rows += n;
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = rows;
    at::Tensor out = at::empty(shape, x.options());
    ep.all_to_all(out, x.contiguous(), out_splits, in_splits);
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto& ep = *reinterpret_cast<const ExpertParallel*>(ctx->saved_data["ep"].toInt());
    auto out_splits = ctx->saved_data["out"].toIntVector();
    auto in_splits = ctx->saved_data["in"].toIntVector();
    int64_t rows = 0;
    for (int64_t n : in_splits) rows += n;
    std::vector<int64_t> shape = g[0].sizes().vec();
    shape[0] = rows;
    at::Tensor gx = at::empty(shape, g[0].options());
    ep.all_to_all(gx, g[0].contiguous(), in_splits, out_splits);
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor expert_parallel_experts(const at::Tensor& x_sorted, const at::Tensor& w1,
                                   const at::Tensor& w2, const at::Tensor& w3, const Dispatch& d,
                                   const ExpertParallel& ep, ExpertsBackend backend) {
  const int64_t P = ep.size, E = d.num_experts, El = E / P;
  TORCH_CHECK(El * P == E && w1.size(0) == El, "expert parallelism: ", E, " experts over ", P,
              " ranks but this rank holds ", w1.size(0));
  // 1. Counts: recv_counts[src * El + j] = rows rank src sends to local expert j.
  at::Tensor send_counts = d.counts.to(at::kLong).contiguous();
  at::Tensor recv_counts = at::empty({E}, send_counts.options());
  const std::vector<int64_t> even(static_cast<size_t>(P), El);
  {
    at::NoGradGuard ng;
    ep.all_to_all(recv_counts, send_counts, even, even);
  }
  // 2. The expert-parallel host sync: the row splits must be host integers.
  at::Tensor both = at::cat({send_counts, recv_counts}).to(at::kCPU);
  const int64_t* c = both.data_ptr<int64_t>();
  std::vector<int64_t> in_splits(static_cast<size_t>(P), 0), out_splits(static_cast<size_t>(P), 0);
  std::vector<int64_t> local_counts(static_cast<size_t>(El), 0);
  for (int64_t r = 0; r < P; ++r)
    for (int64_t j = 0; j < El; ++j) {
      in_splits[static_cast<size_t>(r)] += c[r * El + j];
      out_splits[static_cast<size_t>(r)] += c[E + r * El + j];
      local_counts[static_cast<size_t>(j)] += c[E + r * El + j];
    }
  // 3. Rows out: x_sorted is in expert order, so each destination's rows are contiguous.
  at::Tensor recv = AllToAll::apply(x_sorted, reinterpret_cast<int64_t>(&ep), out_splits,
                                    in_splits)[0];  // (R, D): [src][local expert]
  // 4. Regroup [src][expert] -> [expert][src]; within an expert, rows keep source-rank order
  //    and each source's own order.
  std::vector<int64_t> block_start(static_cast<size_t>(E));
  int64_t pos = 0;
  for (int64_t r = 0; r < P; ++r)
    for (int64_t j = 0; j < El; ++j) {
      block_start[static_cast<size_t>(r * El + j)] = pos;
      pos += c[E + r * El + j];
    }
  std::vector<int64_t> perm;
  perm.reserve(static_cast<size_t>(pos));
  for (int64_t j = 0; j < El; ++j)
    for (int64_t r = 0; r < P; ++r) {
      const int64_t s = block_start[static_cast<size_t>(r * El + j)];
      for (int64_t i = 0; i < c[E + r * El + j]; ++i) perm.push_back(s + i);
    }
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i)
    inv[static_cast<size_t>(perm[i])] = static_cast<int64_t>(i);
  const auto idx_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor perm_t = at::tensor(perm, idx_opts).to(x_sorted.device());
  at::Tensor inv_t = at::tensor(inv, idx_opts).to(x_sorted.device());
  at::Tensor x_local = recv.index_select(0, perm_t);
  // 5. The local experts.
  at::Tensor y_local;
  if (backend == ExpertsBackend::GroupedMM) {
    at::Tensor ids =
        at::repeat_interleave(at::arange(El, idx_opts.device(x_sorted.device())),
                              at::tensor(local_counts, idx_opts).to(x_sorted.device()));
    Dispatch dl = plan_dispatch(ids.view({-1, 1}), El, experts_alignment(backend));
    y_local = grouped_experts(x_local, w1, w2, w3, dl);
  } else {
    y_local = loop_experts(x_local, w1, w2, w3, local_counts);
  }
  // 6. Back to [src][expert] order, and home.
  at::Tensor y_recv = y_local.index_select(0, inv_t);
  return AllToAll::apply(y_recv, reinterpret_cast<int64_t>(&ep), in_splits, out_splits)[0];
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
