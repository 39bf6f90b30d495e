#include "core/kernels/fused_loss.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace titan {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Logits of rows [i0, i1): the GEMM in the compute dtype, then fp32, exactly as
// at::linear(h, W).float() rounds them. (n, V) fp32.
at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& w, int64_t i0, int64_t i1) {
  return at::linear(h.slice(0, i0, i1), w).to(at::kFloat);
}

// Turns softmax probabilities p (n, V) fp32 into d loss / d logits in place:
// scale * (p - onehot(label)) with scale = g on valid rows and 0 on ignored ones. `hit`
// (vocabulary parallel): the rows whose label is in this slice; the others get no one-hot.
void probs_to_grad(at::Tensor& p, const at::Tensor& lab, const at::Tensor& valid,
                   const at::Tensor& g, const at::Tensor& hit = at::Tensor()) {
  at::Tensor scale = (valid.to(at::kFloat) * g).unsqueeze(1);  // (n, 1)
  p.mul_(scale);
  const at::Tensor& onehot = hit.defined() ? hit : valid;
  p.scatter_add_(1, at::where(onehot, lab, 0).unsqueeze(1),
                 hit.defined() ? -scale * hit.to(at::kFloat).unsqueeze(1) : -scale);
}

// dh[i0:i1] = dl W (one GEMM), dw += dl^T h[i0:i1] (one GEMM, fp32 accumulator). dl: (n, V)
// fp32, rounded to the GEMM dtype first as linear's backward would see it.
void accumulate_grads(const at::Tensor& dl, const at::Tensor& h, const at::Tensor& w,
                      int64_t i0, int64_t i1, at::Tensor& dh, at::Tensor& dw) {
  at::Tensor dlc = dl.to(h.scalar_type());
  at::Tensor hc = h.slice(0, i0, i1);
  if (dh.defined()) {
    at::Tensor dh_c = dh.slice(0, i0, i1);
    at::mm_out(dh_c, dlc, w);
  }
  if (!dw.defined()) return;
  if (h.scalar_type() == at::kFloat)
    dw.addmm_(dlc.t(), hc);
  else if (dw.is_cuda())
    at::addmm_out(dw, dw, dlc.t(), hc, at::kFloat);  // bf16 GEMM into fp32 (CUDA only)
  else
    dw.add_(at::mm(dlc.t(), hc));
}

// Recomputes each chunk's logits; softmax = exp(logits - lse). With `offset` >= 0 (a
// vocabulary slice starting there) labels are global ids and lse the combined one.
std::pair<at::Tensor, at::Tensor> recompute_grads(const at::Tensor& h, const at::Tensor& w,
                                                  const at::Tensor& labels, const at::Tensor& lse,
                                                  const at::Tensor& g, int64_t chunk, bool need_h,
                                                  bool need_w, int64_t offset = -1) {
  const int64_t N = h.size(0), V = w.size(0), D = h.size(1);
  at::Tensor dh, dw;
  if (need_h) dh = at::empty({N, D}, h.options());
  if (need_w) dw = at::zeros({V, D}, w.options().dtype(at::kFloat));
  for (int64_t i0 = 0; i0 < N && (need_h || need_w); i0 += chunk) {
    const int64_t i1 = std::min(N, i0 + chunk);
    at::Tensor p = chunk_logits(h, w, i0, i1);
    p.sub_(lse.slice(0, i0, i1).unsqueeze(1)).exp_();
    at::Tensor lab = labels.slice(0, i0, i1);
    if (offset < 0) {
      probs_to_grad(p, lab, lab.ne(kIgnoreIndex), g);
    } else {
      at::Tensor local = lab - offset;
      at::Tensor hit = local.ge(0).bitwise_and_(local.lt(V));  // bitwise: has a meta kernel
      probs_to_grad(p, local, lab.ne(kIgnoreIndex), g, hit);
    }
    accumulate_grads(p, h, w, i0, i1, dh, dw);
  }
  return {dh, dw};
}

// Vocabulary-parallel loss: h (N, D) whole, w (V/tp, D) this rank's rows, labels global.
struct VocabParallelCrossEntropyFn : torch::autograd::Function<VocabParallelCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& labels, int64_t chunk, int64_t shard_ptr) {
    const auto* shard = reinterpret_cast<const VocabShard*>(shard_ptr);
    const int64_t N = h.size(0), V = w.size(0);
    at::Tensor lse = at::empty({N}, h.options().dtype(at::kFloat));
    at::Tensor picked = at::zeros({N}, lse.options());
    at::Tensor valid = labels.ne(kIgnoreIndex);
    at::Tensor local = labels - shard->offset;
    at::Tensor hit = local.ge(0).bitwise_and_(local.lt(V)).bitwise_and_(valid);
    at::Tensor idx = at::where(hit, local, 0);
    for (int64_t i0 = 0; i0 < N; i0 += chunk) {
      const int64_t i1 = std::min(N, i0 + chunk);
      at::Tensor logits = chunk_logits(h, w, i0, i1);  // (n, V/tp)
      at::Tensor p = logits.gather(1, idx.slice(0, i0, i1).unsqueeze(1)).squeeze(1);
      picked.slice(0, i0, i1).copy_(at::where(hit.slice(0, i0, i1), p, 0));
      at::Tensor m = logits.amax(1);
      logits.sub_(m.unsqueeze(1)).exp_();
      lse.slice(0, i0, i1).copy_(at::log(logits.sum(1)).add_(m));
    }
    // log sum_r exp(lse_r) = M + log sum_r exp(lse_r - M), M the max over the ranks.
    at::Tensor gmax = lse.clone();
    shard->allreduce(gmax, /*max=*/true);
    at::Tensor s = (lse - gmax).exp_();
    shard->allreduce(s, /*max=*/false);
    shard->allreduce(picked, /*max=*/false);
    at::Tensor full_lse = s.log_().add_(gmax);
    at::Tensor loss = at::where(valid, full_lse - picked, 0).sum();
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["offset"] = shard->offset;
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    ctx->save_for_backward({h, w, labels, full_lse});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list go) {
    at::Tensor g = go[0].to(at::kFloat);
    auto s = ctx->get_saved_variables();
    auto [dh, dw] = recompute_grads(s[0], s[1], s[2], s[3], g, ctx->saved_data["chunk"].toInt(),
                                    ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                    ctx->saved_data["offset"].toInt());
    if (dw.defined()) dw = dw.to(static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()));
    return {dh, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// h: (N, D), w: (V, D), labels: (N) int64 -> 0-d fp32.
struct LinearCrossEntropyFn : torch::autograd::Function<LinearCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& labels, int64_t chunk, bool in_forward,
                            bool need_h, bool need_w) {
    const int64_t N = h.size(0), V = w.size(0), D = h.size(1);
    const bool grads = in_forward && (need_h || need_w);
    at::Tensor lse = in_forward ? at::Tensor() : at::empty({N}, h.options().dtype(at::kFloat));
    at::Tensor loss = at::zeros({}, h.options().dtype(at::kFloat));
    at::Tensor one = at::ones({}, loss.options());
    at::Tensor dh, dw;  // for an upstream gradient of 1
    if (grads && need_h) dh = at::empty({N, D}, h.options());
    if (grads && need_w) dw = at::zeros({V, D}, w.options().dtype(at::kFloat));
    for (int64_t i0 = 0; i0 < N; i0 += chunk) {
      const int64_t i1 = std::min(N, i0 + chunk);
      at::Tensor logits = chunk_logits(h, w, i0, i1);  // (n, V)
      at::Tensor lab = labels.slice(0, i0, i1);
      at::Tensor valid = lab.ne(kIgnoreIndex);
      at::Tensor picked = logits.gather(1, at::where(valid, lab, 0).unsqueeze(1)).squeeze(1);
      // log-sum-exp in place: max, subtract, exp, sum, log, add back.
      at::Tensor m = logits.amax(1);
      logits.sub_(m.unsqueeze(1)).exp_();
      at::Tensor sum = logits.sum(1);
      at::Tensor l = at::log(sum).add_(m);
      loss.add_(at::where(valid, l - picked, 0).sum());
      if (!in_forward) {
        lse.slice(0, i0, i1).copy_(l);
      } else if (grads) {
        logits.div_(sum.unsqueeze(1));  // softmax
        probs_to_grad(logits, lab, valid, one);
        accumulate_grads(logits, h, w, i0, i1, dh, dw);
      }
    }
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["in_forward"] = in_forward;
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    if (in_forward)
      ctx->save_for_backward({dh, dw});
    else
      ctx->save_for_backward({h, w, labels, lse});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list go) {
    at::Tensor g = go[0].to(at::kFloat);
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    at::Tensor dh, dw;
    if (ctx->saved_data["in_forward"].toBool()) {
      // Scaled in place: the unit gradients serve one backward (a second one is refused).
      TORCH_CHECK(!ctx->saved_data.count("consumed"),
                  "fused_linear_cross_entropy: backward ran twice through a loss that formed its "
                  "gradients in forward (LossBackward::kRecompute allows retain_graph)");
      ctx->saved_data["consumed"] = true;
      auto s = ctx->get_saved_variables();
      if (need_h && s[0].defined()) dh = s[0].mul_(g);
      if (need_w && s[1].defined()) dw = s[1].mul_(g);
    } else {
      auto s = ctx->get_saved_variables();
      std::tie(dh, dw) = recompute_grads(s[0], s[1], s[2], s[3], g,
                                         ctx->saved_data["chunk"].toInt(), need_h, need_w);
    }
    if (dw.defined()) dw = dw.to(static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()));
    return {dh, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t default_loss_chunk_tokens(int64_t vocab) {
  const int64_t n = kLossChunkBytes / (4 * std::max<int64_t>(vocab, 1));
  return n >= 16 ? n / 16 * 16 : std::max<int64_t>(n, 1);
}

at::Tensor fused_linear_cross_entropy(const at::Tensor& h, const at::Tensor& W,
                                      const at::Tensor& labels, int64_t chunk_tokens,
                                      LossBackward mode, const VocabShard* shard) {
  const char* op = "fused_linear_cross_entropy";
  TORCH_CHECK(h.dim() == 2 || h.dim() == 3, op, ": h must be (N, D) or (B, T, D), got ",
              h.sizes());
  TORCH_CHECK(W.dim() == 2 && W.size(1) == h.size(-1), op, ": W must be (V, ", h.size(-1),
              "), got ", W.sizes());
  TORCH_CHECK(h.scalar_type() == W.scalar_type(), op, ": h and W differ in dtype (",
              h.scalar_type(), " vs ", W.scalar_type(), ")");
  TORCH_CHECK(labels.scalar_type() == at::kLong, op, ": labels must be int64");
  TORCH_CHECK(h.device() == W.device() && h.device() == labels.device(), op,
              ": h, W and labels must be on one device");
  const int64_t D = h.size(-1);
  at::Tensor h2 = h.reshape({-1, D});
  TORCH_CHECK(labels.numel() == h2.size(0), op, ": ", labels.numel(), " labels for ", h2.size(0),
              " tokens");
  const int64_t chunk = chunk_tokens > 0 ? chunk_tokens : default_loss_chunk_tokens(W.size(0));
  if (shard != nullptr) {
    TORCH_CHECK(shard->allreduce, op, ": a vocabulary shard needs its all-reduce");
    return VocabParallelCrossEntropyFn::apply(h2, W, labels.reshape({-1}), chunk,
                                              reinterpret_cast<int64_t>(shard));
  }
  // Gradients are formed in forward only for inputs that will get one.
  const bool grad_mode = at::GradMode::is_enabled();
  return LinearCrossEntropyFn::apply(h2, W, labels.reshape({-1}), chunk,
                                     mode == LossBackward::kInForward,
                                     grad_mode && h2.requires_grad(), grad_mode && W.requires_grad());
}

}  // namespace titan
