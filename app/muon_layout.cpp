#include "app/muon_layout.h"

#include "core/config/param_groups.h"

namespace titan {

ShardedMatrixLayout::ShardedMatrixLayout(Model& model, FullyShardedDataParallel* fsdp)
    : model_(model), fsdp_(fsdp) {}

bool ShardedMatrixLayout::rows_split(const Param& p) const {
  return fsdp_ && p.sharded() && p.value.dim() == 2;
}

bool ShardedMatrixLayout::tp_split(const Param& p) const {
  // A 3-D expert tensor split on dim 0 holds whole experts.
  return p.tp_dim >= 0 && !(p.value.dim() == 3 && p.tp_dim == 0) && model_.tensor_parallel();
}

bool ShardedMatrixLayout::split(int64_t i) const {
  const Param& p = model_.params()[i];
  return rows_split(p) || tp_split(p);
}

at::Tensor ShardedMatrixLayout::gather(int64_t i, const at::Tensor& local) {
  const Param& p = model_.params()[i];
  at::Tensor t = local;
  if (rows_split(p)) t = fsdp_->gather_rows(i, t);  // the tp slice's rows, (rows, cols)
  if (tp_split(p)) {
    const int64_t d = p.tp_dim;
    t = model_.tensor_parallel()->gather_last(t.movedim(d, -1).contiguous()).movedim(-1, d);
  }
  return t.contiguous();
}

at::Tensor ShardedMatrixLayout::mine(int64_t i, const at::Tensor& whole) {
  const Param& p = model_.params()[i];
  at::Tensor t = whole;
  if (tp_split(p)) {
    const int64_t d = p.tp_dim;
    t = t.narrow(d, p.tp_offset, p.full_shape()[static_cast<size_t>(d)]);
  }
  if (!rows_split(p)) return t;
  at::Tensor out = at::zeros(p.value.sizes(), t.options());  // padding rows stay 0
  out.narrow(0, 0, p.dim0_rows).copy_(t.narrow(0, p.dim0_offset, p.dim0_rows));
  return out;
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
