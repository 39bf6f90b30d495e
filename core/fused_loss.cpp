#include "core/fused_loss.h"

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

struct LinearCrossEntropyFn : torch::autograd::Function<LinearCrossEntropyFn> {
  // h: (N, D), w: (V, D), labels: (N) int64 -> 0-d fp32.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& labels, int64_t chunk) {
    const int64_t N = h.size(0);
    at::Tensor lse = at::empty({N}, h.options().dtype(at::kFloat));
    at::Tensor loss = at::zeros({}, h.options().dtype(at::kFloat));
    for (int64_t i0 = 0; i0 < N; i0 += chunk) {
      const int64_t i1 = std::min(N, i0 + chunk);
      at::Tensor logits = chunk_logits(h, w, i0, i1);  // (n, V)
      at::Tensor lab = labels.slice(0, i0, i1);
      at::Tensor valid = lab.ne(kIgnoreIndex);
      at::Tensor picked = logits.gather(1, at::where(valid, lab, 0).unsqueeze(1)).squeeze(1);
      // log-sum-exp in place: max, subtract, exp, sum, log, add back.
      at::Tensor m = logits.amax(1);
      logits.sub_(m.unsqueeze(1)).exp_();
      at::Tensor l = logits.sum(1).log_().add_(m);
      lse.slice(0, i0, i1).copy_(l);
      loss.add_(at::where(valid, l - picked, 0).sum());
    }
    ctx->save_for_backward({h, w, labels, lse});
    ctx->saved_data["chunk"] = chunk;
    return loss;
  }

  // d loss / d logits = g * (softmax - onehot(label)) on valid rows, 0 on ignored ones, formed
  // per chunk from the recomputed logits and the saved lse.
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &h = s[0], &w = s[1], &labels = s[2], &lse = s[3];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const int64_t N = h.size(0), V = w.size(0), D = h.size(1);
    const bool need_h = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    at::Tensor g = go[0].to(at::kFloat);
    at::Tensor dh, dw;
    if (need_h) dh = at::empty({N, D}, h.options());
    // dW sums over every chunk; an fp32 accumulator keeps bf16 from rounding each partial sum.
    if (need_w) dw = at::zeros({V, D}, w.options().dtype(at::kFloat));
    const bool low_precision = h.scalar_type() != at::kFloat;
    for (int64_t i0 = 0; i0 < N && (need_h || need_w); i0 += chunk) {
      const int64_t i1 = std::min(N, i0 + chunk);
      at::Tensor dl = chunk_logits(h, w, i0, i1);  // (n, V) fp32, becomes d loss / d logits
      at::Tensor lab = labels.slice(0, i0, i1);
      at::Tensor valid = lab.ne(kIgnoreIndex);
      at::Tensor scale = (valid.to(at::kFloat) * g).unsqueeze(1);  // (n, 1)
      dl.sub_(lse.slice(0, i0, i1).unsqueeze(1)).exp_().mul_(scale);
      dl.scatter_add_(1, at::where(valid, lab, 0).unsqueeze(1), -scale);
      at::Tensor dlc = dl.to(h.scalar_type());  // the GEMM dtype, as linear's backward sees it
      at::Tensor hc = h.slice(0, i0, i1);
      if (need_h) {
        at::Tensor dh_c = dh.slice(0, i0, i1);
        at::mm_out(dh_c, dlc, w);
      }
      if (need_w) {
        if (!low_precision)
          dw.addmm_(dlc.t(), hc);
        else if (dw.is_cuda())
          at::addmm_out(dw, dw, dlc.t(), hc, at::kFloat);  // bf16 GEMM into fp32 (CUDA only)
        else
          dw.add_(at::mm(dlc.t(), hc));
      }
    }
    if (need_w) dw = dw.to(w.scalar_type());
    return {dh, dw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t default_loss_chunk_tokens(int64_t vocab) {
  const int64_t n = kLossChunkBytes / (4 * std::max<int64_t>(vocab, 1));
  return n >= 16 ? n / 16 * 16 : std::max<int64_t>(n, 1);
}

at::Tensor fused_linear_cross_entropy(const at::Tensor& h, const at::Tensor& W,
                                      const at::Tensor& labels, int64_t chunk_tokens) {
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
  return LinearCrossEntropyFn::apply(h2, W, labels.reshape({-1}), chunk);
}

}  // namespace titan
