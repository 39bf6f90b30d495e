#include "models/kv_cache.h"

#include <c10/util/Exception.h>

namespace titan {

namespace {
thread_local KvCache* g_active = nullptr;
}  // namespace

KvCache* KvCache::active() {
  return g_active;
}

KvCacheScope::KvCacheScope(KvCache& cache) : prev_(g_active) {
  g_active = &cache;
}
KvCacheScope::~KvCacheScope() {
  g_active = prev_;
}

void KvCache::begin(int64_t new_tokens) {
  TORCH_CHECK(!open_, "KvCache::begin: the previous forward was not closed");
  TORCH_CHECK(new_tokens > 0 && pos_ + new_tokens <= max_len_, "KvCache: ", new_tokens,
              " tokens at position ", pos_, " exceed the cache's ", max_len_);
  new_ = new_tokens;
  layer_ = 0;
  open_ = true;
}

void KvCache::end() {
  TORCH_CHECK(open_, "KvCache::end without begin");
  pos_ += new_;
  open_ = false;
}

RopeTables KvCache::rope_rows(const RopeTables& rope, int64_t local) const {
  TORCH_CHECK(open_ && local == new_, "KvCache::rope_rows outside a forward of ", new_, " tokens");
  TORCH_CHECK(pos_ + local <= rope.cos.size(0), "KvCache: position ", pos_ + local,
              " is past the RoPE table's ", rope.cos.size(0), " rows");
  return {rope.cos.narrow(0, pos_, local), rope.sin.narrow(0, pos_, local)};
}

KvCache::Cached KvCache::append(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(open_ && k.size(1) == new_, "KvCache::append outside a forward of ", new_, " tokens");
  const int64_t B = k.size(0), T = k.size(1), Hkv = k.size(2);
  if (layer_ == k_.size()) {  // the first forward meets this layer: its buffers
    k_.push_back(at::zeros({batch_, max_len_, Hkv, k.size(3)}, k.options()));
    v_.push_back(at::zeros({batch_, max_len_, Hkv, v.size(3)}, v.options()));
  }
  at::Tensor& kc = k_[layer_];
  at::Tensor& vc = v_[layer_];
  ++layer_;
  TORCH_CHECK(B == batch_ && kc.size(2) == Hkv, "KvCache: layer shapes changed between forwards");
  kc.narrow(1, pos_, T).copy_(k);
  vc.narrow(1, pos_, T).copy_(v);
  return {kc.narrow(1, 0, pos_ + T), vc.narrow(1, 0, pos_ + T), pos_};
}

at::Tensor KvCache::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double scale) {
  TORCH_CHECK(open_ && q.size(1) == new_, "KvCache::attend outside a forward of ", new_, " tokens");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2);
  const Cached c = append(k, v);
  const int64_t keys = pos_ + T;
  // (B, heads, len, D) views of the queries and of every cached position so far.
  const at::Tensor qt = q.transpose(1, 2);
  const at::Tensor kt = c.k.transpose(1, 2);
  const at::Tensor vt = c.v.transpose(1, 2);
  // Query i sits at position pos + i and sees keys 0..pos + i: one token (decoding) sees all
  // of them, and a first forward is plainly causal; otherwise an explicit mask.
  at::Tensor o;
  if (T == 1 || pos_ == 0) {
    o = at::scaled_dot_product_attention(qt, kt, vt, {}, 0.0, /*is_causal=*/T > 1, scale,
                                         /*enable_gqa=*/Hkv != H);
  } else {
    const at::Tensor qpos = at::arange(pos_, keys, q.options().dtype(at::kLong)).unsqueeze(1);
    const at::Tensor kpos = at::arange(keys, q.options().dtype(at::kLong)).unsqueeze(0);
    o = at::scaled_dot_product_attention(qt, kt, vt, kpos <= qpos, 0.0, false, scale,
                                         /*enable_gqa=*/Hkv != H);
  }
  return o.transpose(1, 2).reshape({B, T, H * v.size(3)});
}

}  // namespace titan
