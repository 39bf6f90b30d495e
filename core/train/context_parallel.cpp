#include "core/train/context_parallel.h"

#include <c10/util/Exception.h>

namespace titan {

std::vector<int64_t> cp_positions(int64_t T, int64_t cp, int64_t rank, CpBalancer b) {
  const int64_t chunks = b == CpBalancer::HeadTail ? 2 * cp : cp;
  TORCH_CHECK(cp >= 1 && rank >= 0 && rank < cp && T % chunks == 0, "context parallel: ", T,
              " tokens do not split into ", chunks, " chunks");
  const int64_t c = T / chunks;
  std::vector<int64_t> pos;
  pos.reserve(static_cast<size_t>(T / cp));
  auto chunk = [&](int64_t k) {
    for (int64_t t = k * c; t < (k + 1) * c; ++t) pos.push_back(t);
  };
  chunk(rank);
  if (b == CpBalancer::HeadTail) chunk(2 * cp - 1 - rank);
  return pos;
}

int64_t cp_causal_pairs(int64_t T, int64_t cp, int64_t rank, CpBalancer b) {
  int64_t pairs = 0;
  for (int64_t p : cp_positions(T, cp, rank, b)) pairs += p + 1;  // keys 0..p
  return pairs;
}

std::vector<CpChunk> cp_chunks(int64_t T, int64_t cp, int64_t rank, CpBalancer b) {
  const int64_t chunks = b == CpBalancer::HeadTail ? 2 * cp : cp;
  TORCH_CHECK(cp >= 1 && rank >= 0 && rank < cp && T % chunks == 0, "context parallel: ", T,
              " tokens do not split into ", chunks, " chunks");
  const int64_t c = T / chunks;
  std::vector<CpChunk> out{{0, rank * c, c}};
  if (b == CpBalancer::HeadTail) out.push_back({c, (2 * cp - 1 - rank) * c, c});
  return out;
}

int64_t cp_computed_pairs(int64_t T, int64_t cp, int64_t rank, CpBalancer b) {
  int64_t pairs = 0;
  for (const CpChunk& k : cp_chunks(T, cp, rank, b)) pairs += k.len * (k.global + k.len);
  return pairs;
}

namespace {

// Every rank's positions in rank order: the gathered keys' global positions, (T).
std::vector<int64_t> gathered_positions(int64_t T, int64_t cp, CpBalancer b) {
  std::vector<int64_t> all;
  for (int64_t r = 0; r < cp; ++r) {
    std::vector<int64_t> p = cp_positions(T, cp, r, b);
    all.insert(all.end(), p.begin(), p.end());
  }
  return all;
}

}  // namespace

const at::Tensor& ContextParallel::cached(const std::string& kind, int64_t local,
                                          at::Device device) const {
  auto key = std::make_pair(kind + "/" + std::to_string(local), device.str());
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  const int64_t T = local * size();
  auto to_tensor = [](const std::vector<int64_t>& v, at::Device d) {
    return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(d);
  };
  at::Tensor t;
  if (kind == "positions") {
    t = to_tensor(cp_positions(T, size(), rank(), balancer_), device);
  } else if (kind == "mask") {
    at::Tensor q = cached("positions", local, device);
    at::Tensor k = to_tensor(gathered_positions(T, size(), balancer_), device);
    t = q.unsqueeze(1).ge(k.unsqueeze(0));  // (T/cp, T)
  } else if (kind.rfind("chunk", 0) == 0) {  // "chunk<i>": chunk i's (len, global + len) mask
    const CpChunk k = chunks(local).at(std::stoul(kind.substr(5)));
    at::Tensor q = at::arange(k.global, k.global + k.len, at::TensorOptions().dtype(at::kLong));
    at::Tensor keys = at::arange(k.global + k.len, at::TensorOptions().dtype(at::kLong));
    t = q.unsqueeze(1).ge(keys.unsqueeze(0)).to(device);
  } else {  // "order": where global position p sits among the gathered tokens
    std::vector<int64_t> g = gathered_positions(T, size(), balancer_), inv(g.size());
    for (size_t j = 0; j < g.size(); ++j) inv[static_cast<size_t>(g[j])] = static_cast<int64_t>(j);
    t = to_tensor(inv, device);
  }
  return cache_.emplace(key, t).first->second;
}

at::Tensor ContextParallel::shard(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() >= 2 && x.size(1) % size() == 0, "context parallel: sequence length ",
              x.size(1), " does not split over ", size(), " ranks");
  return x.index_select(1, positions(x.size(1) / size(), x.device()));
}

at::Tensor ContextParallel::positions(int64_t local, at::Device device) const {
  return cached("positions", local, device);
}

at::Tensor ContextParallel::causal_mask(int64_t local, at::Device device) const {
  return cached("mask", local, device);
}

std::vector<CpChunk> ContextParallel::chunks(int64_t local) const {
  return cp_chunks(local * size(), size(), rank(), balancer_);
}

at::Tensor ContextParallel::chunk_mask(int64_t local, size_t i, at::Device device) const {
  return cached("chunk" + std::to_string(i), local, device);
}

at::Tensor ContextParallel::to_global_order(const at::Tensor& gathered) const {
  TORCH_CHECK(gathered.size(1) % size() == 0, "context parallel: ", gathered.size(1),
              " gathered tokens over ", size(), " ranks");
  return gathered.index_select(1, cached("order", gathered.size(1) / size(), gathered.device()));
}

at::Tensor ContextParallel::unshard(const at::Tensor& x) const {
  at::NoGradGuard ng;
  return seq_->gather_seq(x).index_select(1, cached("order", x.size(1), x.device()));
}

}  // namespace titan
