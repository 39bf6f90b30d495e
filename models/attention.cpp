// The attention entry point (models/layers.h) and its block-causal kernels: masked SDPA over
// static query tiles on the CPU, ATen's variable-length flash attention on CUDA (the
// memory-efficient kernel where flash does not apply). docs/attention.md.
#include <ATen/ops/_efficient_attention_backward.h>
#include <ATen/ops/_efficient_attention_forward.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include "core/base/errors.h"
#include "core/train/capture_check.h"
#include "core/train/functional.h"
#include "models/layers.h"

namespace titan {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Queries of this many rows attend the keys up to their tile's end with the document mask,
// so the scores above the diagonal tiles are never computed.
constexpr int64_t kCpuTiles = 8;
constexpr int64_t kCpuMinTile = 128;

// The first key any query of the tile starting at `s` may see: the start of the document
// that holds query s, earliest over the batch rows. doc (B, T) int64 on the CPU, document ids
// nondecreasing along each row. Reads host memory (no device), so only the CPU path calls it,
// and not under the capture check, whose steps must keep their shapes.
int64_t tile_first_key(const at::Tensor& doc, int64_t s) {
  const at::Tensor d = doc.contiguous();
  const int64_t B = d.size(0), T = d.size(1);
  const int64_t* ids = d.const_data_ptr<int64_t>();
  int64_t first = s;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = ids + b * T;
    int64_t j = s;
    while (j > 0 && row[j - 1] == row[s]) --j;
    first = std::min(first, j);
  }
  return first;
}

// q (B, H, T, D), k/v (B, Hkv, T, D), doc (B, T) -> (B, H, T, Dv). Each tile's mask is built
// from the document ids. Eagerly, a tile attends only keys from the start of its first
// query's document (tile_first_key): with ~500-token documents at T = 2048 that skips most
// of the causal prefix. Under the capture check (compile.enable) every tile attends its whole
// causal prefix instead, the static shapes a captured step has (docs/attention.md).
at::Tensor block_causal_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& doc, double scale, bool gqa) {
  const int64_t T = q.size(2);
  const int64_t tiles = std::max<int64_t>(1, std::min(kCpuTiles, T / kCpuMinTile));
  const int64_t len = (T + tiles - 1) / tiles;
  const bool skip = !capture_check_active() && !q.is_meta();
  const at::Tensor pos = at::arange(T, doc.options());
  std::vector<at::Tensor> outs;
  for (int64_t s = 0; s < T; s += len) {
    const int64_t n = std::min(len, T - s), end = s + n;
    const int64_t k0 = skip ? tile_first_key(doc, s) : 0;
    at::Tensor mask = block_causal_mask(doc.narrow(1, s, n), doc.narrow(1, k0, end - k0),
                                        pos.narrow(0, s, n), pos.narrow(0, k0, end - k0));
    outs.push_back(masked_sdpa(q.narrow(2, s, n), k.narrow(2, k0, end - k0),
                               v.narrow(2, k0, end - k0), mask.unsqueeze(1), scale, gqa));
  }
  return outs.size() == 1 ? outs.front() : at::cat(outs, 2);
}

// Varlen flash attention over the packed tokens: q (N, H, D), k/v (N, Hkv, D) bf16/fp16,
// cu (S + 1) int32. max_q = max_k = T, the window length, a bound of every document's
// length that does not depend on the data, so the captured graph is valid for any packing.
struct VarlenFlash : torch::autograd::Function<VarlenFlash> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& cu, int64_t max_len,
                            double scale) {
    auto r = at::_flash_attention_forward(q, k, v, cu, cu, max_len, max_len, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, /*return_debug_mask=*/false, scale);
    at::Tensor out = std::get<0>(r);
    ctx->save_for_backward({q, k, v, out, std::get<1>(r), cu, std::get<2>(r), std::get<3>(r)});
    ctx->saved_data["max_len"] = max_len;
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto s = ctx->get_saved_variables();
    const int64_t max_len = ctx->saved_data["max_len"].toInt();
    auto r = at::_flash_attention_backward(g[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5],
                                           s[5], max_len, max_len, /*dropout_p=*/0.0,
                                           /*is_causal=*/true, s[6], s[7],
                                           ctx->saved_data["scale"].toDouble());
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r),
            at::Tensor(),   at::Tensor(),   at::Tensor()};
  }
};

// The memory-efficient kernel's varlen form (fp32, or head dims flash does not take):
// q (1, N, H, D), k/v (1, N, H, D) (kv heads already repeated), causal from the top left of
// each sequence (custom_mask_type 1).
struct VarlenEfficient : torch::autograd::Function<VarlenEfficient> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& cu, int64_t max_len,
                            double scale) {
    auto r = at::_efficient_attention_forward(q, k, v, /*bias=*/std::nullopt, cu, cu, max_len,
                                              max_len, /*dropout_p=*/0.0, /*custom_mask_type=*/1,
                                              /*compute_log_sumexp=*/true, scale);
    at::Tensor out = std::get<0>(r);
    ctx->save_for_backward({q, k, v, out, std::get<1>(r), cu, std::get<2>(r), std::get<3>(r)});
    ctx->saved_data["max_len"] = max_len;
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto s = ctx->get_saved_variables();
    const int64_t max_len = ctx->saved_data["max_len"].toInt();
    auto r = at::_efficient_attention_backward(
        g[0].contiguous(), s[0], s[1], s[2], /*bias=*/std::nullopt, s[3], s[5], s[5], max_len,
        max_len, s[4], /*dropout_p=*/0.0, s[6], s[7], /*custom_mask_type=*/1,
        /*bias_requires_grad=*/false, ctx->saved_data["scale"].toDouble());
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r),
            at::Tensor(),   at::Tensor(),   at::Tensor()};
  }
};

// CUDA: q (B, T, H, Dqk), k (B, T, Hkv, Dqk), v (B, T, Hkv, Dv) -> (B, T, H, Dv).
at::Tensor block_causal_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& doc, double scale) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2);
  const int64_t dqk = q.size(3), dv = v.size(3), N = B * T;
  // Every token may start a document, so the sequence count is bounded by N; the kernels
  // put sequences on a grid dimension of at most 65535.
  if (N + 1 > 65536)
    throw UserError(
        "attention: block_causal on CUDA packs local_batch_size * seq_len = " + std::to_string(N) +
        " tokens per micro-batch; allowed: at most 65535 (a smaller local batch)");
  const at::Tensor cu = varlen_cu_seqlens(doc);
  const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  // MLA's value head (128) is narrower than its query-key head (192): the kernels want one
  // head dim, so the values are zero-padded and the padding cut from the output.
  at::Tensor vp = dv == dqk ? v : at::constant_pad_nd(v, {0, dqk - dv});
  at::Tensor o;
  if (half && dqk % 8 == 0 && dqk <= 256) {
    o = VarlenFlash::apply(q.reshape({N, H, dqk}).contiguous(),
                           k.reshape({N, Hkv, dqk}).contiguous(),
                           vp.reshape({N, Hkv, dqk}).contiguous(), cu, T, scale);
  } else {
    at::Tensor kk = k, vv = vp;
    if (Hkv != H) {  // the efficient kernel has no grouped-query form
      kk = k.repeat_interleave(H / Hkv, 2);
      vv = vp.repeat_interleave(H / Hkv, 2);
    }
    o = VarlenEfficient::apply(q.reshape({1, N, H, dqk}).contiguous(),
                               kk.reshape({1, N, H, dqk}).contiguous(),
                               vv.reshape({1, N, H, dqk}).contiguous(), cu, T, scale);
  }
  o = o.reshape({B, T, H, dqk});
  return dv == dqk ? o : o.narrow(3, 0, dv);
}

// Context parallel with documents: as cp_attention in layers.cpp, each chunk's queries
// against the key prefix before the chunk's end, with the document ids of the global
// sequence (doc (B, T_global)) added to the chunk's causal mask.
at::Tensor cp_block_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& doc, double scale, const ContextParallel& cp) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2);
  at::Tensor kg = cp.to_global_order(cp.gather_kv(k)).transpose(1, 2);  // (B, Hkv, Tg, D)
  at::Tensor vg = cp.to_global_order(cp.gather_kv(v)).transpose(1, 2);
  at::Tensor qt = q.transpose(1, 2);
  const at::Tensor pos = at::arange(doc.size(1), doc.options());
  std::vector<at::Tensor> outs;
  for (const CpChunk& c : cp.chunks(T)) {
    const int64_t keys = c.global + c.len;
    at::Tensor mask = block_causal_mask(doc.narrow(1, c.global, c.len), doc.narrow(1, 0, keys),
                                        pos.narrow(0, c.global, c.len), pos.narrow(0, 0, keys));
    outs.push_back(masked_sdpa(qt.narrow(2, c.local, c.len), kg.narrow(2, 0, keys),
                               vg.narrow(2, 0, keys), mask.unsqueeze(1), scale, Hkv != H));
  }
  at::Tensor o = outs.size() == 1 ? outs.front() : at::cat(outs, 2);
  return o.transpose(1, 2).reshape({B, T, H * v.size(3)});
}

}  // namespace

at::Tensor block_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& doc_ids, double scale) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2);
  TORCH_CHECK(doc_ids.dim() == 2 && doc_ids.size(0) == B && doc_ids.size(1) == T,
              "block_causal_attention: doc ids ", doc_ids.sizes(), " for q ", q.sizes());
  if (q.is_cuda()) return block_causal_cuda(q, k, v, doc_ids, scale).reshape({B, T, H * v.size(3)});
  at::Tensor o = block_causal_cpu(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), doc_ids,
                                  scale, Hkv != H);
  return o.transpose(1, 2).reshape({B, T, H * v.size(3)});
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                     const ContextParallel* cp, const Documents* docs) {
  if (docs == nullptr || !docs->block_causal) return causal_attention(q, k, v, scale, cp);
  if (cp != nullptr) return cp_block_causal(q, k, v, docs->doc_ids, scale, *cp);
  return block_causal_attention(q, k, v, docs->doc_ids, scale);
}

}  // namespace titan
