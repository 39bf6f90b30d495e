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

bool fqn_matches_any(const std::string& fqn, const std::vector<std::string>& entries) {
  for (const std::string& e : entries)
    if (fqn.find(e) != std::string::npos) return true;
  return false;
}

int64_t MoELayer::group_alignment() const {
  return args_.float8 ? kFloat8GroupAlignment : experts_alignment(args_.backend);
}

MoELayer::MoELayer(const MoEArgs& a, int64_t dim, int64_t hidden, const std::string& prefix,
                   ParamStore& store, at::Device device, double init_std)
    : args_(a), dim_(dim), hidden_(hidden), prefix_(prefix) {
  if (args_.float8 && !fqn_matches_any(prefix + "experts", args_.float8_fqns)) args_.float8.reset();
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
  // GPT-OSS's experts draw every tensor, w1 included, from N(0, init_std).
  w1_ =
      P("experts.w1", {E, hidden, dim}, true, a.expert_biases ? init_std : 0.02, ParamKind::Expert);
  w2_ = P("experts.w2", {E, dim, hidden}, true, init_std, ParamKind::Expert);
  w3_ = P("experts.w3", {E, hidden, dim}, true, init_std, ParamKind::Expert);
  if (a.expert_biases) {
    b1_ = P("experts.w1_bias", {E, hidden}, false, init_std, ParamKind::Expert);
    b2_ = P("experts.w2_bias", {E, dim}, false, init_std, ParamKind::Expert);
    b3_ = P("experts.w3_bias", {E, hidden}, false, init_std, ParamKind::Expert);
  }
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
  dropped_tokens = at::zeros({}, opts);
  dropped_since_log = at::zeros({}, opts);
}

void MoELayer::reset_state() {
  at::NoGradGuard ng;
  expert_bias.zero_();
  tokens_per_expert.zero_();
  load_since_log.zero_();
  dropped_tokens.zero_();
  dropped_since_log.zero_();
  pending_.clear();
}

at::Tensor MoELayer::forward(const at::Tensor& xs3, const std::vector<at::Tensor>& w, Mode mode) {
  ModuleScope scope("moe");
  // Expert tensor parallelism: every tp rank routes the whole sequence (B, T, D) through its
  // hidden slice of the experts; the shared experts stay on this rank's shard xs3. With expert
  // parallelism as well (ep x etp), the rows then travel over this tp index's ep group, whose
  // ranks hold the same hidden slice of their experts, and come home as partial sums.
  const at::Tensor x3 = etp_ ? etp_->gather_seq(xs3) : xs3;
  const int64_t B = x3.size(0), S = x3.size(1), D = x3.size(2);
  const int64_t E = args_.num_experts, K = args_.top_k;
  size_t k = 0;
  const at::Tensor& gw = w[k++];
  at::Tensor gb = gate_b_ >= 0 ? w[k++] : at::Tensor();
  const at::Tensor &w1 = w[k], &w2 = w[k + 1], &w3 = w[k + 2];
  k += 3;
  extras_ = ExpertsExtras{};
  extras_.limit = args_.swiglu_limit;
  extras_.alpha = args_.swiglu_alpha;
  if (b1_ >= 0) {
    extras_.b1 = w[k];
    extras_.b2 = w[k + 1];
    extras_.b3 = w[k + 2];
    k += 3;
    // Expert tensor parallelism sums the tp ranks' partial outputs: w2's bias counts once.
    if (etp_ && etp_->rank() != 0) extras_.b2 = extras_.b2 * 0;
  }
  at::Tensor x = x3.reshape({B * S, D});  // (T, D)

  Routing r = route_tokens(x, gw, gb, expert_bias, args_);
  const bool grouped = args_.backend != ExpertsBackend::Loop;
  // grouped_mm: the permute writes the aligned layout and the combine reads it, so no pad or
  // unpad copy. Expert parallelism sends rows in plain expert order and aligns them locally.
  const bool aligned = grouped && !ep_;
  Dispatch d = plan_dispatch(r.experts, E, aligned ? group_alignment() : 0);

  // Count once per training forward; a checkpoint recompute repeats the forward, not the step.
  const bool recompute = is_recomputing();
  // Under expert tensor parallelism every tp rank routed the same tokens: tp rank 0 counts.
  if (mode.training && !recompute && (!etp_ || etp_->rank() == 0)) {
    at::NoGradGuard ng;
    tokens_per_expert.add_(d.counts);
  }

  at::Tensor routed = permute_tokens(x, d);                // (N, D), N = T*K; aligned: (M, D)
  at::Tensor top_sorted = permute_slots(r.top_scores, d);  // (N,) or (M,)
  if (args_.score_before_experts)
    routed = (routed.to(at::kFloat) * top_sorted.unsqueeze(1)).to(x.scalar_type());

  at::Tensor out_sorted;
  if (ep_) {
    out_sorted = expert_parallel_experts(routed, top_sorted, w1, w2, w3, d, mode, recompute);
  } else if (grouped && extras_.active()) {
    TORCH_CHECK(d.align > 0 && routed.size(0) == d.padded_rows, "the aligned layout");
    out_sorted = grouped_experts_extras(routed, w1, w2, w3, extras_, d.offs, args_.backend);
  } else if (grouped) {
    out_sorted = grouped_experts(routed, w1, w2, w3, d, args_.backend, args_.float8);
  } else {
    // The loop backend's one host sync per layer and forward. A checkpointed forward leaves
    // its counts for the recompute, which then reads no device value either.
    std::optional<Pending> known = take_pending(recompute);
    std::vector<int64_t> host;
    if (known)
      host = std::move(known->host);
    else  // Meta tensors (titan-train estimate) carry no counts: perfectly balanced routing.
      host = routed.is_meta() ? balanced_counts(routed.size(0), d.counts.size(0))
                              : counts_to_host(d.counts);
    keep_pending(mode, recompute, Pending{host, {}, {}});
    out_sorted = extras_.active() ? loop_experts_extras(routed, w1, w2, w3, extras_, host)
                                  : loop_experts(routed, w1, w2, w3, host);
  }

  // (T, D): each token's K expert outputs, weighted by their scores unless the scores were
  // applied before the experts.
  at::Tensor out = combine_tokens(
      out_sorted, args_.score_before_experts ? at::Tensor() : top_sorted.to(at::kFloat), d);
  // Expert tensor parallelism: out is this rank's hidden slices' partial sum; the sum over
  // the tp ranks, this rank's sequence shard of it (B, T/tp, D).
  if (etp_) out = etp_->reduce_scatter_seq(out.reshape({B, S, D})).reshape({-1, D});

  at::Tensor shared;
  if (sw1_ >= 0) shared = swiglu(xs3.reshape({-1, D}), w[k], w[k + 1], w[k + 2]);  // (T, D)
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
  return out.view(xs3.sizes());
}

std::optional<MoELayer::Pending> MoELayer::take_pending(bool recompute) {
  if (!recompute || pending_.empty()) return std::nullopt;
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  return p;
}

void MoELayer::keep_pending(Mode mode, bool recompute, Pending p) {
  if (mode.checkpointed && !recompute) pending_.push_back(std::move(p));
}

at::Tensor MoELayer::expert_parallel_experts(const at::Tensor& routed, const at::Tensor& probs,
                                             const at::Tensor& w1, const at::Tensor& w2,
                                             const at::Tensor& w3, const Dispatch& d, Mode mode,
                                             bool recompute) {
  // A recompute reuses its forward's exchanged counts (the routing is the same): no counts
  // exchange, and under the exact exchange no host read.
  std::optional<Pending> known = take_pending(recompute);
  ExpertExchange::Received ref;
  if (known) {
    ref.recv_counts = known->recv_counts;
    ref.splits = known->splits;
  }
  const bool counted = mode.training && !recompute;
  ExpertExchange::Received got =
      ep_->dispatch(routed, d.counts, probs, args_.top_k, counted, known ? &ref : nullptr);
  TORCH_CHECK(w1.size(0) * ep_->size() == args_.num_experts, "expert parallelism: this rank holds ",
              w1.size(0), " experts of ", args_.num_experts, " over ", ep_->size(), " ranks");
  // Under ep x etp every tp rank exchanged the same rows (their ep groups route alike): the
  // dropped rows are counted on tp rank 0, as the token counts are.
  if (got.dropped.defined() && counted && (!etp_ || etp_->rank() == 0)) {
    at::NoGradGuard ng;
    dropped_tokens.add_(got.dropped);
  }
  std::vector<int64_t> host = known ? known->host : std::vector<int64_t>{};
  at::Tensor y = local_experts(got, w1, w2, w3, host);
  keep_pending(mode, recompute, Pending{host, got.recv_counts, got.splits});
  return ep_->combine(y, got);
}

at::Tensor MoELayer::local_experts(const ExpertExchange::Received& got, const at::Tensor& w1,
                                   const at::Tensor& w2, const at::Tensor& w3,
                                   std::vector<int64_t>& host_counts) {
  // 8 rows even for the loop (its groups are cut from the aligned layout); 16 with float8.
  const int64_t El = w1.size(0), align = args_.float8 ? kFloat8GroupAlignment : 8;
  // Rows grouped by local expert and aligned, on the device; the static exchange's empty
  // slots (local expert El) form one more group after the last, which no GEMM computes.
  Dispatch local = plan_dispatch(got.local_expert.view({-1, 1}), El + 1, align);
  at::Tensor xa = permute_tokens(got.rows, local);  // (M, D)
  at::Tensor ya;
  if (args_.backend != ExpertsBackend::Loop) {
    const at::Tensor offs = local.offs.narrow(0, 0, El);
    ya = extras_.active() ? grouped_experts_extras(xa, w1, w2, w3, extras_, offs, args_.backend)
                          : grouped_experts(xa, w1, w2, w3, offs, args_.backend, args_.float8);
  } else {
    // The loop's host counts: the exact exchange read them already; under the static
    // exchange this is the loop's own sync.
    if (host_counts.empty())
      host_counts = got.host_local_counts.empty() ? counts_to_host(local.counts.narrow(0, 0, El))
                                                  : got.host_local_counts;
    std::vector<int64_t> sizes;  // the aligned groups' rows
    int64_t rows = 0;
    for (int64_t c : host_counts) {
      sizes.push_back((std::max(c, align) + (align - 1)) / align * align);
      rows += sizes.back();
    }
    at::Tensor head = extras_.active()
                          ? loop_experts_extras(xa.narrow(0, 0, rows), w1, w2, w3, extras_, sizes)
                          : loop_experts(xa.narrow(0, 0, rows), w1, w2, w3, sizes);
    ya = at::cat({head, at::zeros({xa.size(0) - rows, xa.size(1)}, head.options())});
  }
  // (R, D) back in arrival order (unpad_groups would leave them sorted by local expert):
  // arrival row a sits at padded row local.rows[i] where local.order[i] == a.
  at::Tensor home = at::empty_like(local.order).index_copy_(0, local.order, local.rows);
  at::Tensor y = ya.index_select(0, home);
  // Empty slots hold no computed row (their values are undefined): zero, as the exchange
  // expects (their gradient is zero as well).
  if (got.has_empty_slots) y = y.masked_fill((got.local_expert == El).unsqueeze(1), 0);
  return y;
}

void MoELayer::discard_step() {
  at::NoGradGuard ng;
  tokens_per_expert.zero_();
  dropped_tokens.zero_();
  pending_.clear();
  aux_ = at::Tensor();
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
    // The layer's counts, then its dropped rows: one collective for both.
    c.push_back(at::cat({l->tokens_per_expert, l->dropped_tokens.view({1})}));
    l->clear_pending();  // every backward of this step has run
  }
  at::Tensor both = at::stack(c);  // (L, E + 1)
  if (dp_allreduce) dp_allreduce(both);
  const int64_t E = both.size(1) - 1;
  for (size_t i = 0; i < layers.size(); ++i) {
    MoELayer& l = *layers[i];
    at::Tensor cnt = both[static_cast<int64_t>(i)].narrow(0, 0, E);
    const double coeff = l.args().load_balance_coeff;
    if (coeff > 0) {
      at::Tensor delta = at::sign(cnt.mean() - cnt) * coeff;
      delta = delta - delta.mean();
      l.expert_bias.add_(delta);
    }
    l.load_since_log.add_(cnt);
    l.dropped_since_log.add_(both[static_cast<int64_t>(i)][E]);
    l.tokens_per_expert.zero_();
    l.dropped_tokens.zero_();
  }
}

std::map<std::string, double> moe_load_metrics(
    const std::vector<std::pair<int64_t, MoELayer*>>& layers) {
  std::map<std::string, double> m;
  if (layers.empty()) return m;
  at::NoGradGuard ng;
  std::vector<at::Tensor> c;
  for (auto& [id, l] : layers)
    c.push_back(at::cat({l->load_since_log, l->dropped_since_log.view({1})}));
  at::Tensor both = at::stack(c).to(at::kCPU, at::kDouble);  // (L, E + 1): the log step's read
  const int64_t E = both.size(1) - 1;
  // Rows dropped over the static exchange's capacity, all layers (0 without drops).
  m["moe_dropped_tokens"] = both.select(1, E).sum().item<double>();
  for (size_t i = 0; i < layers.size(); ++i) {
    at::Tensor cnt = both[static_cast<int64_t>(i)].narrow(0, 0, E);
    const double mean = cnt.mean().item<double>();
    const std::string p = "moe/layer" + std::to_string(layers[i].first) + "/";
    m[p + "max_mean_load_ratio"] = mean > 0 ? cnt.max().item<double>() / mean : 0.0;
    m[p + "dead_experts"] = static_cast<double>((cnt == 0).sum().item<int64_t>());
    layers[i].second->load_since_log.zero_();
    layers[i].second->dropped_since_log.zero_();
  }
  return m;
}

}  // namespace titan
