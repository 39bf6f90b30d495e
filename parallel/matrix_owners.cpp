#include "parallel/matrix_owners.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <numeric>

namespace titan {

namespace {

int64_t numel_of(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
}

}  // namespace

MatrixOwners::MatrixOwners(std::vector<SharedMatrix> matrices) : ms_(std::move(matrices)) {
  const size_t K = ms_.size();
  pos_.resize(K);
  shape_.resize(K);
  owns_.assign(K, false);
  // The tensor at each level: level l + 1 is the concatenation of level l's pieces.
  size_t levels = 0;
  for (size_t k = 0; k < K; ++k) {
    const SharedMatrix& m = ms_[k];
    TORCH_CHECK(!m.cuts.empty(), "MatrixOwners: matrix ", k, " is not shared");
    levels = std::max(levels, m.cuts.size());
    shape_[k].push_back(m.local_shape);
    for (const MatrixCut& c : m.cuts) {
      TORCH_CHECK(c.group && c.group->size() > 1, "MatrixOwners: a cut over one rank");
      std::vector<int64_t> s = shape_[k].back();
      const size_t d = static_cast<size_t>(c.dim);
      TORCH_CHECK(d < s.size(), "MatrixOwners: cut dim ", c.dim, " of a ", s.size(), "-D piece");
      s[d] *= c.group->size();
      if (c.keep >= 0) {
        TORCH_CHECK(c.keep <= s[d], "MatrixOwners: keep ", c.keep, " of ", s[d]);
        s[d] = c.keep;
      }
      shape_[k].push_back(s);
    }
  }
  // Owners, balanced per set of groups (the matrices that the same ranks share): greedy,
  // the costliest first, each to the least loaded of the prod(group sizes) positions. The
  // order and the ties depend on the shapes and k only, so every rank plans alike.
  std::vector<std::vector<ProcessGroup*>> keys;
  std::vector<std::vector<size_t>> members;
  for (size_t k = 0; k < K; ++k) {
    std::vector<ProcessGroup*> key;
    for (const MatrixCut& c : ms_[k].cuts) key.push_back(c.group);
    auto it = std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) {
      keys.push_back(key);
      members.push_back({k});
    } else {
      members[static_cast<size_t>(it - keys.begin())].push_back(k);
    }
  }
  for (size_t g = 0; g < keys.size(); ++g) {
    int64_t slots = 1;
    for (ProcessGroup* pg : keys[g]) slots *= pg->size();
    std::vector<double> load(static_cast<size_t>(slots), 0.0);
    std::vector<size_t> order = members[g];
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return ms_[a].cost > ms_[b].cost; });
    for (size_t k : order) {
      auto slot = static_cast<int64_t>(std::min_element(load.begin(), load.end()) - load.begin());
      load[static_cast<size_t>(slot)] += ms_[k].cost;
      pos_[k].assign(keys[g].size(), 0);
      for (size_t l = keys[g].size(); l-- > 0;) {  // the innermost level most significant
        pos_[k][l] = slot % keys[g][l]->size();
        slot /= keys[g][l]->size();
      }
    }
  }
  // A rank takes part in level l for matrix k when it holds k's level-l tensor: it is the
  // owner position at every level below.
  auto holds = [&](size_t k, size_t l) {
    for (size_t i = 0; i < l; ++i)
      if (pos_[k][i] != ms_[k].cuts[i].group->rank()) return false;
    return true;
  };
  for (size_t k = 0; k < K; ++k) owns_[k] = holds(k, ms_[k].cuts.size());
  for (size_t l = 0; l < levels; ++l) {
    const size_t first = exchanges_.size();
    for (size_t k = 0; k < K; ++k) {
      if (l >= ms_[k].cuts.size() || !holds(k, l)) continue;
      ProcessGroup* g = ms_[k].cuts[l].group;
      auto it = std::find_if(exchanges_.begin() + static_cast<std::ptrdiff_t>(first),
                             exchanges_.end(), [&](const Exchange& e) { return e.group == g; });
      if (it == exchanges_.end()) {
        exchanges_.push_back({static_cast<int64_t>(l), g, {k}});
      } else {
        it->ks.push_back(k);
      }
    }
  }
}

std::vector<at::Tensor> MatrixOwners::run(
    const std::vector<at::Tensor>& local,
    const std::function<at::Tensor(const at::Tensor&)>& orth) {
  at::NoGradGuard ng;
  const size_t K = ms_.size();
  TORCH_CHECK(local.size() == K, "MatrixOwners::run: ", local.size(), " pieces for ", K);
  if (K == 0) return {};
  const at::TensorOptions opts = local[0].options();
  std::vector<at::Tensor> cur = local;
  // Gather: every piece to its owner, level by level.
  for (const Exchange& ex : exchanges_) {
    const auto l = static_cast<size_t>(ex.level);
    ProcessGroup& g = *ex.group;
    const int64_t n = g.size(), me = g.rank();
    std::vector<at::Tensor> parts;
    std::vector<int64_t> in_splits(static_cast<size_t>(n), 0);
    int64_t owned = 0;  // elements of one rank's pieces of the matrices this rank owns
    for (int64_t q = 0; q < n; ++q)
      for (size_t k : ex.ks)
        if (pos_[k][l] == q) {
          TORCH_CHECK(cur[k].sizes().vec() == shape_[k][l], "MatrixOwners::run: piece ", k, " is ",
                      cur[k].sizes(), ", planned ", shape_[k][l]);
          parts.push_back(cur[k].reshape({-1}));
          in_splits[static_cast<size_t>(q)] += numel_of(shape_[k][l]);
          if (q == me) owned += numel_of(shape_[k][l]);
        }
    at::Tensor send = at::cat(parts);
    at::Tensor recv = at::empty({n * owned}, opts);
    g.all_to_all(recv, send, std::vector<int64_t>(static_cast<size_t>(n), owned), in_splits);
    // recv: rank q's pieces of the owned matrices (k order) at q * owned.
    int64_t off = 0;
    for (size_t k : ex.ks) {
      if (pos_[k][l] != me) continue;
      const MatrixCut& c = ms_[k].cuts[l];
      const int64_t e = numel_of(shape_[k][l]);
      std::vector<at::Tensor> pieces;
      for (int64_t q = 0; q < n; ++q)
        pieces.push_back(recv.narrow(0, q * owned + off, e).view(shape_[k][l]));
      at::Tensor whole = at::cat(pieces, c.dim);
      if (c.keep >= 0) whole = whole.narrow(c.dim, 0, c.keep);
      cur[k] = whole.contiguous();
      off += e;
    }
  }
  std::vector<at::Tensor> res(K);
  for (size_t k = 0; k < K; ++k) {
    if (!owns_[k]) continue;
    res[k] = orth(cur[k]);
    TORCH_CHECK(res[k].sizes() == cur[k].sizes() && res[k].dtype() == cur[k].dtype(),
                "MatrixOwners: orth must keep its input's shape and dtype");
  }
  // Scatter: each rank's piece of the result back, the outermost level first.
  for (auto it = exchanges_.rbegin(); it != exchanges_.rend(); ++it) {
    const Exchange& ex = *it;
    const auto l = static_cast<size_t>(ex.level);
    ProcessGroup& g = *ex.group;
    const int64_t n = g.size(), me = g.rank();
    std::vector<int64_t> out_splits(static_cast<size_t>(n), 0);
    int64_t owned = 0;
    std::vector<at::Tensor> wholes;  // the owned results, padded to n pieces along the cut
    for (size_t k : ex.ks) {
      out_splits[static_cast<size_t>(pos_[k][l])] += numel_of(shape_[k][l]);
      if (pos_[k][l] != me) continue;
      owned += numel_of(shape_[k][l]);
      const MatrixCut& c = ms_[k].cuts[l];
      at::Tensor w = res[k];
      if (c.keep >= 0) {
        std::vector<int64_t> padded = shape_[k][l + 1];
        padded[static_cast<size_t>(c.dim)] = n * shape_[k][l][static_cast<size_t>(c.dim)];
        at::Tensor z = at::zeros(padded, w.options());  // FSDP's padding rows stay 0
        z.narrow(c.dim, 0, c.keep).copy_(w);
        w = z;
      }
      wholes.push_back(w);
    }
    std::vector<at::Tensor> parts;
    for (int64_t q = 0; q < n; ++q) {
      size_t j = 0;
      for (size_t k : ex.ks) {
        if (pos_[k][l] != me) continue;
        const int64_t d = ms_[k].cuts[l].dim, w = shape_[k][l][static_cast<size_t>(d)];
        parts.push_back(wholes[j++].narrow(d, q * w, w).reshape({-1}));
      }
    }
    at::Tensor send = parts.empty() ? at::empty({0}, opts) : at::cat(parts);
    int64_t total = 0;
    for (int64_t s : out_splits) total += s;
    at::Tensor recv = at::empty({total}, opts);
    g.all_to_all(recv, send, out_splits, std::vector<int64_t>(static_cast<size_t>(n), owned));
    // recv: from each owner q its piece of every matrix q owns, in k order.
    int64_t off = 0;
    for (int64_t q = 0; q < n; ++q)
      for (size_t k : ex.ks)
        if (pos_[k][l] == q) {
          const int64_t e = numel_of(shape_[k][l]);
          res[k] = recv.narrow(0, off, e).view(shape_[k][l]);
          off += e;
        }
  }
  return res;
}

}  // namespace titan
