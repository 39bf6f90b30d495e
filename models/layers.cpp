#include "models/layers.h"

#include <cmath>
#include <vector>

#include "core/kernels/ops.h"
#include "core/train/capture_check.h"
#include "models/kv_cache.h"

namespace titan {

RopeTables rope_tables(int64_t head_dim, int64_t max_seq_len, double theta, const RopeScaling& s,
                       at::Device device) {
  // freqs_i = theta^(-2i/D), i < D/2, computed in double then stored as fp32.
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor freqs = at::pow(theta, -at::arange(0, head_dim, 2, opts).slice(0, 0, head_dim / 2) /
                                        static_cast<double>(head_dim));
  freqs = freqs.to(at::kFloat).to(at::kDouble);  // torchtitan builds freqs in fp32
  if (s.factor != 1.0) {
    // Llama-3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and the
    // band in between is interpolated smoothly.
    const double low_wavelen = s.original_max_seq_len / s.low_freq_factor;
    const double high_wavelen = s.original_max_seq_len / s.high_freq_factor;
    auto acc = freqs.accessor<double, 1>();
    for (int64_t i = 0; i < freqs.size(0); ++i) {
      double f = acc[i];
      double wavelen = 2 * M_PI / f;
      if (wavelen < high_wavelen) continue;
      if (wavelen > low_wavelen) {
        acc[i] = f / s.factor;
      } else {
        double smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
        acc[i] = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  at::Tensor t = at::arange(max_seq_len, opts.dtype(at::kFloat));
  at::Tensor angles = at::outer(t, freqs.to(at::kFloat));  // (T, D/2), fp32 like torchtitan
  return rope_tables_from_angles(angles, device);
}

RopeTables rope_tables_from_angles(const at::Tensor& angles, at::Device device) {
  // torch.polar(1, angle) is (cos angle, sin angle), so these are the complex table's parts.
  return {at::cos(angles).contiguous().to(device), at::sin(angles).contiguous().to(device)};
}

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
  if (!rope.per_token) return ops::apply_rope(x, rope.cos, rope.sin);
  // (B, T, H, D) as one sequence of B * T tokens, each with its own table row.
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  return ops::apply_rope(x.reshape({1, B * T, H, D}), rope.cos, rope.sin).view({B, T, H, D});
}

RopeTables rope_rows(const RopeTables& rope, const ContextParallel* cp, int64_t local) {
  if (KvCache* cache = KvCache::active()) return cache->rope_rows(rope, local);  // generation
  if (cp == nullptr) return rope;  // apply_rope reads rows 0..local-1
  const at::Tensor pos = cp->positions(local, rope.cos.device());
  return {rope.cos.index_select(0, pos), rope.sin.index_select(0, pos)};
}

RopeTables rope_rows(const RopeTables& rope, const ContextParallel* cp, int64_t batch,
                     int64_t local, const Documents* docs) {
  if (docs == nullptr || !docs->positions.defined()) return rope_rows(rope, cp, local);
  at::Tensor pos = cp != nullptr ? cp->shard(docs->positions) : docs->positions;  // (B, local)
  TORCH_CHECK(pos.size(0) == batch && pos.size(1) == local, "rope_rows: positions ", pos.sizes(),
              " for (", batch, ", ", local, ")");
  pos = pos.reshape({-1});
  return {rope.cos.index_select(0, pos), rope.sin.index_select(0, pos), /*per_token=*/true};
}

// Context parallel: this rank's queries against every rank's keys and values. The gathered
// keys are put in global order, and each of the rank's chunks (head and tail) attends only
// its causal prefix, the keys before its end, under a mask that is causal on the chunk's own
// block: the scores past a chunk's end, all masked, are never computed, so the head-tail
// balancer evens the work actually done (docs/distributed.md, "Context parallel").
// masked_sdpa is not on the op-checkpointing tape: op-level checkpointing recomputes this
// attention rather than saving it.
static at::Tensor cp_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double scale, const ContextParallel& cp) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2);
  // (B, Hkv, T * cp, D), global order.
  at::Tensor kg = cp.to_global_order(cp.gather_kv(k)).transpose(1, 2);
  at::Tensor vg = cp.to_global_order(cp.gather_kv(v)).transpose(1, 2);
  at::Tensor qt = q.transpose(1, 2);  // (B, H, T, D)
  const std::vector<CpChunk> chunks = cp.chunks(T);
  std::vector<at::Tensor> outs;
  outs.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const CpChunk& c = chunks[i];
    const int64_t keys = c.global + c.len;
    outs.push_back(masked_sdpa(qt.narrow(2, c.local, c.len), kg.narrow(2, 0, keys),
                               vg.narrow(2, 0, keys), cp.chunk_mask(T, i, q.device()), scale,
                               /*enable_gqa=*/Hkv != H));
  }
  at::Tensor o = outs.size() == 1 ? outs.front() : at::cat(outs, 2);  // (B, H, T, Dv)
  return o.transpose(1, 2).reshape({B, T, H * v.size(3)});
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, const ContextParallel* cp) {
  if (KvCache* cache = KvCache::active()) return cache->attend(q, k, v, scale);  // generation
  if (cp != nullptr) return cp_attention(q, k, v, scale, *cp);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2);
  // (B, heads, T, D) views. With Hkv < H, SDPA's enable_gqa lets each group of H / Hkv query
  // heads read its kv head in place (the CPU flash kernel and the CUDA kernels support it), so
  // K and V are never expanded and copied to H heads. causal_sdpa: op-level checkpointing.
  at::Tensor o = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale,
                             /*enable_gqa=*/Hkv != H);
  return o.transpose(1, 2).reshape({B, T, H * v.size(3)});
}

at::Tensor gqa_attention(const at::Tensor& h, const at::Tensor& wq, const at::Tensor& wk,
                         const at::Tensor& wv, const at::Tensor& wo, int64_t n_heads,
                         int64_t n_kv_heads, const RopeTables& rope_all, const ContextParallel* cp,
                         bool use_rope, int64_t chunk) {
  ModuleScope scope("attention");
  at::Tensor attn = gqa_attention_core(project(h, wq), project(h, wk), project(h, wv), n_heads,
                                       n_kv_heads, rope_all, cp, use_rope, chunk);
  return project(attn, wo);
}

at::Tensor gqa_attention_core(const at::Tensor& q_flat, const at::Tensor& k_flat,
                              const at::Tensor& v_flat, int64_t n_heads, int64_t n_kv_heads,
                              const RopeTables& rope_all, const ContextParallel* cp, bool use_rope,
                              int64_t chunk) {
  const int64_t B = q_flat.size(0), T = q_flat.size(1);
  // The head dim is the RoPE table's; the head counts are the projections' widths, so a
  // tensor-parallel rank holding a slice of the heads (wq, wk, wv column-split) runs its own.
  const int64_t hd = 2 * rope_all.cos.size(1);
  const Documents* docs = current_documents();
  const RopeTables rope = rope_rows(rope_all, cp, B, T, docs);
  const int64_t heads = q_flat.size(2) / hd, kv_heads = k_flat.size(2) / hd;
  TORCH_CHECK(heads * hd == q_flat.size(2) && n_heads % heads == 0 && kv_heads > 0 &&
                  n_kv_heads % kv_heads == 0 && heads % kv_heads == 0,
              "gqa_attention: q ", q_flat.sizes(), " / k ", k_flat.sizes(),
              " do not hold whole heads of ", hd);
  at::Tensor q = q_flat.view({B, T, heads, hd});
  at::Tensor k = k_flat.view({B, T, kv_heads, hd});
  at::Tensor v = v_flat.view({B, T, kv_heads, hd});
  if (use_rope) {
    q = apply_rope(q, rope);
    k = apply_rope(k, rope);
  }
  Documents chunked;
  if (chunk > 0) {
    // The whole sequence's length: under context parallelism this rank holds T / cp of it.
    const int64_t T_global = cp != nullptr ? T * cp->size() : T;
    chunked = chunked_documents(docs, B, T_global, chunk, q.device());
    docs = &chunked;
  }
  return attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(hd)), cp, docs);
}

}  // namespace titan
