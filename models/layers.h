// Building blocks shared by the model families: RoPE and causal attention (RMSNorm and
// SwiGLU are in core/train/functional.h, because the MoE layer uses them too).
#pragma once

#include <ATen/ATen.h>

#include "core/train/context_parallel.h"
#include "core/train/documents.h"
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
  // Per-document positions (rope_rows with documents): one row per token of a (B, T)
  // sequence, (B * T, head_dim / 2), and apply_rope runs the B sequences as one of B * T.
  bool per_token = false;
};
// The tables of angles (max_seq_len, head_dim / 2) fp32, on `device`.
RopeTables rope_tables_from_angles(const at::Tensor& angles, at::Device device);
RopeTables rope_tables(int64_t head_dim, int64_t max_seq_len, double theta,
                       const RopeScaling& scaling, at::Device device);

// Rotates adjacent pairs (x[2i], x[2i+1]) of the last dim, as torchtitan's complex form does,
// with the fused op of core/kernels/ops.h (one autograd node, no fp32 copy of x). x: (B, T, H, D),
// any strides with unit stride in D; rows 0..T-1 of the tables are used. Math in fp32, returned
// contiguous in x's dtype.
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);

// The tables a sequence of `local` tokens reads: rows 0..local-1, or under context
// parallelism (cp non-null) the rows of this rank's global positions, or while a KvCache is
// active (models/kv_cache.h) the rows of the cache's next positions.
RopeTables rope_rows(const RopeTables& rope, const ContextParallel* cp, int64_t local);
// The same with the forward's documents: when they carry per-document positions (B, T_global),
// the rows of each token's position in its document (per_token tables, B * local rows).
RopeTables rope_rows(const RopeTables& rope, const ContextParallel* cp, int64_t batch,
                     int64_t local, const Documents* docs);

// Causal self-attention core. q: (B, T, H, Dqk), k: (B, T, Hkv, Dqk), v: (B, T, Hkv, Dv) ->
// (B, T, H * Dv). Hkv divides H (grouped-query attention). Under context parallelism (cp
// non-null) T is this rank's T/cp tokens: k and v are gathered over the cp ranks and the
// queries attend them under the causal mask of the global positions. While a KvCache is
// active (generation) the keys and values are appended to it and the queries attend all
// cached ones (KvCache::attend).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, const ContextParallel* cp = nullptr);

// The attention entry point every family calls: the variant comes from `docs` (the
// forward's documents, current_documents(); null or not block-causal: causal_attention).
// Block-causal: a query attends only keys of its own document at or before it; the kernel is
// picked by device (block_causal_attention); under context parallelism the chunks' masks
// compare the global sequence's document ids. Shapes as causal_attention.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                     const ContextParallel* cp, const Documents* docs);
// Block-causal attention of one rank: q (B, T, H, Dqk), k (B, T, Hkv, Dqk), v (B, T, Hkv, Dv),
// doc_ids (B, T) int64 -> (B, T, H * Dv). CPU: masked SDPA over static query tiles, each
// against its causal key prefix. CUDA: variable-length flash attention over the packed
// documents (bf16/fp16, head dim <= 256), else the memory-efficient kernel's varlen form; the
// maximum length is fixed to T so capture sees static shapes.
at::Tensor block_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& doc_ids, double scale);

// Grouped-query self-attention of Llama-3 and Llama-4 blocks, from the normed input h
// (B, T, D) to the output projection's result (B, T, D): q/k/v projections, RoPE on q and k,
// causal SDPA, wo. wq: (H * hd, D); wk, wv: (Hkv * hd, D); wo: (D, H * hd), hd the RoPE
// table's head dim. Under tensor parallelism the weights hold a slice of whole heads (H/tp
// and Hkv/tp) and the result is this rank's partial sum of wo's product. Under context
// parallelism h holds this rank's tokens (rope_rows, causal_attention).
at::Tensor gqa_attention(const at::Tensor& h, const at::Tensor& wq, const at::Tensor& wk,
                         const at::Tensor& wv, const at::Tensor& wo, int64_t n_heads,
                         int64_t n_kv_heads, const RopeTables& rope,
                         const ContextParallel* cp = nullptr, bool use_rope = true,
                         int64_t chunk = 0);

// use_rope false: no RoPE (Llama-4's NoPE layers). chunk > 0: queries attend only keys of
// their own chunk of `chunk` global positions as well (Llama-4's chunked local attention),
// run as block-causal attention over document ids refined by the chunk (chunked_documents).
// gqa_attention between the projections: q_flat (B, T, H * hd), k_flat and v_flat
// (B, T, Hkv * hd), the q/k/v projections' results -> (B, T, H * hd), wo's input. A
// sequence-parallel block projects and gathers itself (Model::seq_gather_project).
at::Tensor gqa_attention_core(const at::Tensor& q_flat, const at::Tensor& k_flat,
                              const at::Tensor& v_flat, int64_t n_heads, int64_t n_kv_heads,
                              const RopeTables& rope, const ContextParallel* cp = nullptr,
                              bool use_rope = true, int64_t chunk = 0);

}  // namespace titan
