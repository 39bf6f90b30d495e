// Building blocks shared by the model families: RoPE and causal attention (RMSNorm and
// SwiGLU are in core/train/functional.h, because the MoE layer uses them too).
#pragma once

#include <ATen/ATen.h>

#include "core/train/context_parallel.h"
#include "core/train/functional.h"

namespace titan {

struct RopeScaling {
  double factor = 1.0;  // 1: no scaling. Llama-3.1 uses 8, Llama-3.2 uses 32.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_seq_len = 8192;
};

// Rotary embedding tables cos(t * freq) and sin(t * freq): (max_seq_len, head_dim / 2) fp32
// each, the real and imaginary parts of torchtitan's complex e^(i * t * freq) table.
struct RopeTables {
  at::Tensor cos, sin;
};
// The tables of angles (max_seq_len, head_dim / 2) fp32, on `device`.
RopeTables rope_tables_from_angles(const at::Tensor& angles, at::Device device);
RopeTables rope_tables(int64_t head_dim, int64_t max_seq_len, double theta,
                       const RopeScaling& scaling, at::Device device);

// Rotates adjacent pairs (x[2i], x[2i+1]) of the last dim, as torchtitan's complex form does,
// with the fused op of core/kernels/ops.h (one autograd node, no fp32 copy of x). x: (B, T, H, D), any
// strides with unit stride in D; rows 0..T-1 of the tables are used. Math in fp32, returned
// contiguous in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

// The tables a sequence of `local` tokens reads: rows 0..local-1, or under context
// parallelism (cp non-null) the rows of this rank's global positions, or while a KvCache is
// active (models/kv_cache.h) the rows of the cache's next positions.
RopeTables rope_rows(const RopeTables& rope, const ContextParallel* cp, int64_t local);

// Causal self-attention core. q: (B, T, H, Dqk), k: (B, T, Hkv, Dqk), v: (B, T, Hkv, Dv) ->
// (B, T, H * Dv). Hkv divides H (grouped-query attention). Under context parallelism (cp
// non-null) T is this rank's T/cp tokens: k and v are gathered over the cp ranks and the
// queries attend them under the causal mask of the global positions. While a KvCache is
// active (generation) the keys and values are appended to it and the queries attend all
// cached ones (KvCache::attend).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, const ContextParallel* cp = nullptr);

// Grouped-query self-attention of Llama-3 and Llama-4 blocks, from the normed input h
// (B, T, D) to the output projection's result (B, T, D): q/k/v projections, RoPE on q and k,
// causal SDPA, wo. wq: (H * hd, D); wk, wv: (Hkv * hd, D); wo: (D, H * hd), hd the RoPE
// table's head dim. Under tensor parallelism the weights hold a slice of whole heads (H/tp
// and Hkv/tp) and the result is this rank's partial sum of wo's product. Under context
// parallelism h holds this rank's tokens (rope_rows, causal_attention).
at::Tensor gqa_attention(const at::Tensor& h, const at::Tensor& wq, const at::Tensor& wk,
                         const at::Tensor& wv, const at::Tensor& wo, int64_t n_heads,
                         int64_t n_kv_heads, const RopeTables& rope,
                         const ContextParallel* cp = nullptr);

// gqa_attention between the projections: q_flat (B, T, H * hd), k_flat and v_flat
// (B, T, Hkv * hd), the q/k/v projections' results -> (B, T, H * hd), wo's input. A
// sequence-parallel block projects and gathers itself (Model::seq_gather_project).
at::Tensor gqa_attention_core(const at::Tensor& q_flat, const at::Tensor& k_flat,
                              const at::Tensor& v_flat, int64_t n_heads, int64_t n_kv_heads,
                              const RopeTables& rope, const ContextParallel* cp = nullptr);

}  // namespace titan
