#include "app/muon_layout.h"

#include <sstream>

#include "core/config/param_groups.h"

namespace titan {

ShardedMatrixLayout::ShardedMatrixLayout(Model& model, FullyShardedDataParallel* fsdp,
                                         ProcessGroup* tp)
    : model_(model), fsdp_(fsdp), tp_(tp && tp->size() > 1 ? tp : nullptr) {}

bool ShardedMatrixLayout::rows_split(const Param& p) const {
  return fsdp_ && p.sharded() && p.value.dim() == 2;
}

bool ShardedMatrixLayout::tp_split(const Param& p) const {
  // A 3-D expert tensor split on dim 0 holds whole experts.
  return tp_ && p.tp_dim >= 0 && !(p.value.dim() == 3 && p.tp_dim == 0);
}

bool ShardedMatrixLayout::split(int64_t i) const {
  const Param& p = model_.params()[i];
  return rows_split(p) || tp_split(p);
}

void ShardedMatrixLayout::plan(const std::vector<int64_t>& params) {
  std::vector<SharedMatrix> ms;
  for (int64_t i : params) {
    const Param& p = model_.params()[i];
    SharedMatrix m;
    m.local_shape = p.value.sizes().vec();
    // FSDP cut the tp slice's rows (padded to the same count per rank), so its rows come
    // first; then the tp slices, equal on every tp rank.
    if (rows_split(p)) {
      ProcessGroup& g = fsdp_->shard_group(i);
      if (g.size() > 1) m.cuts.push_back({&g, 0, p.full_shape()[0]});
    }
    if (tp_split(p)) {
      const auto d = static_cast<size_t>(p.tp_dim);
      TORCH_CHECK(p.model_shape()[d] == tp_->size() * p.full_shape()[d],
                  "Muon: uneven tensor-parallel slices of ", p.name);
      m.cuts.push_back({tp_, p.tp_dim, -1});
    }
    const auto w = p.model_shape();
    const int64_t E = w.size() == 3 ? w[0] : 1, A = w[w.size() - 2], B = w[w.size() - 1];
    m.cost = static_cast<double>(E) * A * B * std::min(A, B);
    ms.push_back(std::move(m));
  }
  owners_ = std::make_unique<MatrixOwners>(std::move(ms));
}

std::vector<at::Tensor> ShardedMatrixLayout::orthogonalize(
    const std::vector<at::Tensor>& local,
    const std::function<at::Tensor(const at::Tensor&)>& orth) {
  return owners_->run(local, orth);
}

std::string describe_muon_plan(const Optimizer& opt, ProcessGroup* world) {
  const Muon* m = opt.muon();
  Muon::Plan p = m ? m->plan() : Muon::Plan{};
  // (own matrices, own cost, all cost) of every rank: a setup-time collective and host read.
  at::Tensor mine = at::tensor({static_cast<double>(p.own_matrices), p.own_cost, p.all_cost},
                               at::TensorOptions().dtype(at::kDouble));
  const int64_t n = world ? world->size() : 1;
  at::Tensor all = mine;
  if (world && n > 1) {
    all = at::empty({3 * n}, mine.options());
    // gloo on the CPU; NCCL wants device tensors.
    at::Tensor dev = mine;
    if (world->backend_name() == "nccl") {
      dev = mine.cuda();
      all = all.cuda();
    }
    world->all_gather(all, dev);
    all = all.cpu();
  }
  auto a = all.view({n, 3});
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(2);
  os << "=> muon: Newton-Schulz on " << p.own_matrices << " of " << p.all_matrices
     << " matrices per step on rank " << (world ? world->rank() : 0)
     << " (owner plan, docs/training.md); matrices per rank [";
  for (int64_t r = 0; r < n; ++r)
    os << (r ? ", " : "") << static_cast<int64_t>(a[r][0].item<double>());
  os << "], cost per rank relative to one process [";
  for (int64_t r = 0; r < n; ++r) {
    const double all_cost = a[r][2].item<double>();
    os << (r ? ", " : "") << (all_cost > 0 ? a[r][1].item<double>() / all_cost : 0.0);
  }
  os << "]";
  return os.str();
}

std::vector<OptimizerKind> route_model(const Model& model, const OptimizerSection& opt) {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (auto& p : model.params().all()) {
    names.push_back(p.name);
    shapes.push_back(p.model_shape());
  }
  return route_params(names, shapes, opt.name == "Muon", parse_param_groups(opt.param_groups));
}

int64_t full_state_bytes(const Model& model, const OptimizerSection& opt) {
  const auto kinds = route_model(model, opt);
  const auto& all = model.params().all();
  int64_t b = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : all[i].model_shape()) n *= d;
    b += 4 * n * (kinds[i] == OptimizerKind::Muon ? 2 : 3);
  }
  return b;
}

}  // namespace titan
