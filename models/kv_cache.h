// Incremental decoding for every family through the shared attention entry points: while a
// KvCacheScope is alive on this thread, rope_rows() reads the rows of the cache's positions
// and causal_attention() appends each layer's new keys and values to the cache and attends
// all of them (models/layers.cpp). A family needs no code of its own: its layers call those
// two functions in the same order in every forward, so the n-th attention call of a forward
// is layer n's (docs/models.md, "Generation").
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "models/layers.h"

namespace titan {

class KvCache {
 public:
  // Room for max_len positions of a batch of `batch` sequences.
  KvCache(int64_t batch, int64_t max_len) : batch_(batch), max_len_(max_len) {}
  // Opens a forward of `new_tokens` tokens at positions [pos(), pos() + new_tokens).
  void begin(int64_t new_tokens);
  // Closes it: the tokens are now cached (pos() advances).
  void end();
  int64_t pos() const { return pos_; }
  int64_t max_len() const { return max_len_; }
  // Rows [pos, pos + local) of the tables.
  RopeTables rope_rows(const RopeTables& rope, int64_t local) const;
  // The next attention layer of this forward: q (B, T, H, Dqk), k (B, T, Hkv, Dqk),
  // v (B, T, Hkv, Dv) of the new tokens -> (B, T, H * Dv), each query attending the cached
  // keys and the new ones up to its own position.
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
  // For attention of a family's own (GPT-OSS's sinks and sliding windows): stores the next
  // layer's new k, v (B, T, Hkv, D) and returns every cached position's keys and values so
  // far, (B, pos() + T, Hkv, D), with `first` = pos(), the position of the first new query.
  struct Cached {
    at::Tensor k, v;
    int64_t first = 0;
  };
  Cached append(const at::Tensor& k, const at::Tensor& v);

  // The cache of the innermost live KvCacheScope on this thread, or nullptr.
  static KvCache* active();

 private:
  int64_t batch_, max_len_;
  int64_t pos_ = 0, new_ = 0;
  size_t layer_ = 0;  // the next attention call's layer in this forward
  bool open_ = false;
  std::vector<at::Tensor> k_, v_;  // per layer: (B, max_len, Hkv, D), filled up to pos_
};

// Routes this thread's attention through `cache` while alive.
class KvCacheScope {
 public:
  explicit KvCacheScope(KvCache& cache);
  ~KvCacheScope();
  KvCacheScope(const KvCacheScope&) = delete;
  KvCacheScope& operator=(const KvCacheScope&) = delete;

 private:
  KvCache* prev_;
};

}  // namespace titan
