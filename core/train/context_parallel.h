// Context parallelism as the model sees it (docs/distributed.md, "Context parallel").
//
// Each of the cp ranks of a data-parallel rank holds T/cp tokens of every sequence: with the
// head-tail load balancer (torchtitan's default for causal attention) the sequence is cut
// into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r, so every rank has the same
// causal work. Queries stay local; keys and values are all-gathered over the cp ranks
// (backward: reduce-scattered), and the causal mask compares global positions. RoPE reads
// the tables at the global positions. parallel/ builds this over the cp process group and
// installs it with Model::set_context_parallel; the model never sees a process group.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/train/tensor_parallel.h"

namespace titan {

enum class CpBalancer {
  HeadTail,  // chunks r and 2 cp - 1 - r of 2 cp (torchtitan's "headtail")
  None,      // the contiguous chunk r of cp (torchtitan's None)
};

// The global positions of rank `rank`'s T / cp tokens of a sequence of T, in the order the
// rank holds them. T must split into 2 cp (head-tail) or cp (none) chunks.
std::vector<int64_t> cp_positions(int64_t T, int64_t cp, int64_t rank, CpBalancer b);

// The query-key pairs rank `rank`'s queries attend under the causal mask (the attention
// work), for tests and the balancer's promise.
int64_t cp_causal_pairs(int64_t T, int64_t cp, int64_t rank, CpBalancer b);

// A run of consecutive global positions among a rank's tokens: local rows [local, local +
// len) hold global positions [global, global + len). Its queries attend only the keys at
// global positions below global + len, so attention runs on that key prefix (causal within
// the chunk's own block) and never computes the fully masked rest.
struct CpChunk {
  int64_t local = 0, global = 0, len = 0;
};
// Rank `rank`'s chunks in the order it holds them: head and tail (head-tail), or one (none).
std::vector<CpChunk> cp_chunks(int64_t T, int64_t cp, int64_t rank, CpBalancer b);
// The query-key scores rank `rank` computes with chunked attention: len x (global + len)
// per chunk (the masked part of each chunk's diagonal block included).
int64_t cp_computed_pairs(int64_t T, int64_t cp, int64_t rank, CpBalancer b);

class ContextParallel {
 public:
  // `seq`: the sequence collectives over the cp ranks (all-gather along dim 1 in rank order,
  // backward reduce-scatter), as tensor parallelism's over its group.
  ContextParallel(std::shared_ptr<TensorParallelComm> seq, CpBalancer b)
      : seq_(std::move(seq)), balancer_(b) {}
  int64_t size() const { return seq_->size(); }
  int64_t rank() const { return seq_->rank(); }
  CpBalancer balancer() const { return balancer_; }
  // (B, T, ...) -> this rank's tokens (B, T/cp, ...) (no autograd needed: token ids, labels).
  at::Tensor shard(const at::Tensor& x) const;
  // (T/cp) int64 on `device`: this rank's global positions for a local length `local`.
  at::Tensor positions(int64_t local, at::Device device) const;
  // Keys or values (B, T/cp, ...) -> (B, T, ...), every rank's tokens in rank order;
  // backward reduce-scatters the gradients to their ranks.
  at::Tensor gather_kv(const at::Tensor& x) const { return seq_->gather_seq(x); }
  // (T/cp, T) bool, true where this rank's query i may attend gathered key j (global
  // position of j <= that of i).
  at::Tensor causal_mask(int64_t local, at::Device device) const;
  // This rank's chunks for a local length `local` (cp_chunks).
  std::vector<CpChunk> chunks(int64_t local) const;
  // (len, global + len) bool for chunk `i` of chunks(local): query row q may attend key
  // position k of the prefix when k <= global + q.
  at::Tensor chunk_mask(int64_t local, size_t i, at::Device device) const;
  // Gathered keys or values (B, T, ...) in rank order -> global position order, with
  // autograd (the gradient goes back to rank order).
  at::Tensor to_global_order(const at::Tensor& gathered) const;
  // (B, T/cp, ...) on every rank -> (B, T, ...) in global order, no autograd (logits).
  at::Tensor unshard(const at::Tensor& x) const;

 private:
  // The index tensors are built once per (local length, device) and reused, so a captured
  // step reads the same addresses and no step copies from the host.
  const at::Tensor& cached(const std::string& kind, int64_t local, at::Device device) const;
  std::shared_ptr<TensorParallelComm> seq_;
  CpBalancer balancer_;
  mutable std::map<std::pair<std::string, std::string>, at::Tensor> cache_;
};

}  // namespace titan
