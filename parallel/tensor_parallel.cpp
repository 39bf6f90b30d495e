#include "parallel/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <sstream>

#include "core/base/errors.h"

namespace titan {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// The plan's groups with their style and split dimension.
struct Group {
  const std::vector<int64_t>* params;
  TpStyle style;
  int64_t dim;  // -1: whole
};

// The routed experts split along their hidden size under expert tensor parallelism, else
// whole (replicated, as the rest of the MoE layer).
std::vector<Group> groups(const TpPlan& p) {
  const bool s = p.split_experts;
  return {{&p.column, TpStyle::Column, 0},
          {&p.row, TpStyle::Row, 1},
          {&p.vocab, TpStyle::Vocab, 0},
          {&p.replicate, TpStyle::Replicate, -1},
          {&p.expert_column, s ? TpStyle::ExpertColumn : TpStyle::Replicate, s ? 1 : -1},
          {&p.expert_row, s ? TpStyle::ExpertRow : TpStyle::Replicate, s ? 2 : -1}};
}

// (B, T/tp, rest) on every rank -> (B, T, rest): the ranks' blocks of the sequence in order.
at::Tensor all_gather_seq(ProcessGroup& g, const at::Tensor& x) {
  const int64_t n = g.size();
  std::vector<int64_t> shape = x.sizes().vec();
  at::Tensor out = at::empty({n * x.numel()}, x.options());
  g.all_gather(out, x.contiguous());
  std::vector<int64_t> grid = {n};
  grid.insert(grid.end(), shape.begin(), shape.end());  // (n, B, T/tp, rest)
  shape[1] *= n;
  return out.view(grid).transpose(0, 1).reshape(shape);
}

// (B, T, rest) partial sums -> this rank's (B, T/tp, rest) of the sum.
at::Tensor reduce_scatter_seq_impl(ProcessGroup& g, const at::Tensor& x) {
  const int64_t n = g.size();
  std::vector<int64_t> shape = x.sizes().vec();
  TORCH_CHECK(shape.size() >= 2 && shape[1] % n == 0, "sequence length ", shape[1],
              " does not split over ", n, " tensor-parallel ranks");
  std::vector<int64_t> split = {shape[0], n, shape[1] / n};
  split.insert(split.end(), shape.begin() + 2, shape.end());
  at::Tensor in = x.reshape(split).transpose(0, 1).contiguous().view({-1});  // rank blocks
  shape[1] /= n;
  at::Tensor out = at::empty(shape, x.options());
  g.reduce_scatter(out, in);
  return out;
}

// The two sequence-parallel boundaries, each the other's backward: gather = all-gather along
// the sequence (backward: reduce-scatter), else reduce-scatter (backward: all-gather).
struct SeqCollective : public torch::autograd::Function<SeqCollective> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group,
                            bool gather) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["gather"] = gather;
    at::NoGradGuard ng;
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    return gather ? all_gather_seq(pg, x) : reduce_scatter_seq_impl(pg, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
    const bool gather = ctx->saved_data["gather"].toBool();
    return {gather ? reduce_scatter_seq_impl(pg, g[0]) : all_gather_seq(pg, g[0]), at::Tensor(),
            at::Tensor()};
  }
};

class C10dTensorParallel : public TensorParallelComm {
 public:
  explicit C10dTensorParallel(ProcessGroup& g) : g_(g) {}
  int64_t size() const override { return g_.size(); }
  int64_t rank() const override { return g_.rank(); }
  at::Tensor gather_seq(const at::Tensor& x) override {
    return SeqCollective::apply(x, reinterpret_cast<int64_t>(&g_), true);
  }
  at::Tensor reduce_scatter_seq(const at::Tensor& x) override {
    return SeqCollective::apply(x, reinterpret_cast<int64_t>(&g_), false);
  }
  void allreduce(at::Tensor& t, bool max) override {
    g_.allreduce(t, max ? ReduceOp::Max : ReduceOp::Sum);
  }
  at::Tensor gather_last(const at::Tensor& x) override {
    at::NoGradGuard ng;
    const int64_t n = g_.size(), d = x.dim() - 1;
    at::Tensor out = at::empty({n * x.numel()}, x.options());
    g_.all_gather(out, x.contiguous());
    std::vector<int64_t> grid = {n};
    for (int64_t i = 0; i < x.dim(); ++i) grid.push_back(x.size(i));
    // (n, ..., V/tp) -> (..., n, V/tp) -> (..., V)
    std::vector<int64_t> shape = x.sizes().vec();
    shape[static_cast<size_t>(d)] *= n;
    return out.view(grid).movedim(0, d).reshape(shape);
  }

 private:
  ProcessGroup& g_;
};

}  // namespace

void check_tp_plan(const Model& model, int64_t tp) {
  if (tp == 1) return;
  const TpPlan& plan = model.tp_plan();
  const std::string who = "parallelism.tensor_parallel_degree = " + std::to_string(tp) + ": ";
  if (!plan.declared())
    throw UserError(who + "model " + model.info().name +
                    " declares no tensor-parallel plan; allowed: 1 for this model");
  const auto& params = model.params();
  std::vector<const char*> seen(static_cast<size_t>(params.size()), nullptr);
  for (const Group& g : groups(plan))
    for (int64_t i : *g.params) {
      if (i < 0 || i >= params.size())
        throw UserError(who + "the tensor-parallel plan of " + model.info().name +
                        " names parameter index " + std::to_string(i) + ", but the model has " +
                        std::to_string(params.size()) + " parameters");
      const std::string& name = params[i].name;
      if (seen[static_cast<size_t>(i)])
        throw UserError(who + "the tensor-parallel plan puts " + name + " in two groups (" +
                        seen[static_cast<size_t>(i)] + " and " + tp_style_name(g.style) +
                        "); allowed: exactly one");
      seen[static_cast<size_t>(i)] = tp_style_name(g.style);
      const std::vector<int64_t> shape = params[i].model_shape();
      if (g.dim >= static_cast<int64_t>(shape.size()) ||
          (g.dim >= 0 && shape[static_cast<size_t>(g.dim)] % tp != 0))
        throw UserError(who + name + " " + shape_str(shape) + " is " + tp_style_name(g.style) +
                        "-parallel (split along dim " + std::to_string(g.dim) +
                        "), which tp does not divide; allowed: a divisor of that dim");
    }
  for (int64_t i = 0; i < params.size(); ++i)
    if (!seen[static_cast<size_t>(i)])
      throw UserError(who + "parameter " + params[i].name +
                      " is in no group of the tensor-parallel plan of " + model.info().name +
                      "; allowed: each parameter column, row, vocab or replicate");
  for (auto& [what, n] : plan.divisible)
    if (n % tp != 0)
      throw UserError(who + "does not divide " + what + " = " + std::to_string(n) + " of " +
                      model.info().name + "/" + model.info().flavor +
                      "; allowed: a divisor of " + std::to_string(n));
}

void apply_tensor_parallel(Model& model, ProcessGroup& tp_group, bool split_experts) {
  split_for_tensor_parallel(model, tp_group.size(), tp_group.rank(), split_experts);
  if (tp_group.size() == 1) return;
  auto comm = make_tp_comm(tp_group);
  model.set_tensor_parallel(comm);
  if (model.tp_plan().split_experts) model.set_expert_tensor_parallel(comm);
}

void split_for_tensor_parallel(Model& model, int64_t tp, int64_t r, bool split_experts) {
  if (tp > 1 && split_experts && model.tp_plan().has_experts()) {
    TpPlan plan = model.tp_plan();
    plan.split_experts = true;
    model.set_tp_plan(std::move(plan));
  }
  check_tp_plan(model, tp);
  if (tp == 1) return;
  at::NoGradGuard ng;
  auto& params = model.params().all();
  for (const Group& g : groups(model.tp_plan())) {
    if (g.dim < 0) continue;
    for (int64_t i : *g.params) {
      Param& p = params[static_cast<size_t>(i)];
      TORCH_CHECK(!p.sharded() && p.tp_dim < 0, p.name, " is already split");
      p.tp_shape = p.value.sizes().vec();
      const int64_t len = p.tp_shape[static_cast<size_t>(g.dim)] / tp;
      p.tp_dim = g.dim;
      p.tp_offset = r * len;
      std::vector<int64_t> local = p.tp_shape;
      local[static_cast<size_t>(g.dim)] = len;
      if (p.value.is_meta())
        p.value = at::empty(local, p.value.options()).requires_grad_(true);
      else
        p.value = p.value.narrow(g.dim, p.tp_offset, len).contiguous().requires_grad_(true);
    }
  }
}

std::shared_ptr<TensorParallelComm> make_tp_comm(ProcessGroup& group) {
  return std::make_shared<C10dTensorParallel>(group);
}

std::string describe_tp(const Model& model, int64_t tp) {
  const TpPlan& p = model.tp_plan();
  std::ostringstream os;
  os << "tp " << tp << " (sequence parallel): " << p.column.size() << " column-, " << p.row.size()
     << " row-, " << p.vocab.size() << " vocab-parallel, " << p.replicated().size()
     << " replicated parameters";
  if (p.split_experts)
    os << ", routed experts split over tp (" << p.expert_column.size() << " w1/w3 by hidden rows, "
       << p.expert_row.size() << " w2 by hidden columns)";
  return os.str();
}

TensorParallelGradSync::TensorParallelGradSync(Model& model, ProcessGroup& tp_group,
                                               GradSync* inner)
    : model_(model), tp_(tp_group), inner_(inner) {}

void TensorParallelGradSync::begin_micro_batch(bool last) {
  if (inner_) inner_->begin_micro_batch(last);
}

void TensorParallelGradSync::reduce_gradients(const std::vector<at::Tensor>& params) {
  if (inner_) inner_->reduce_gradients(params);
  at::NoGradGuard ng;
  // Replicated parameters saw only this rank's sequence shard: sum over the tp ranks.
  std::vector<at::Tensor> grads;
  for (int64_t i : model_.tp_plan().replicated()) {
    at::Tensor v = model_.params()[i].value;
    if (v.is_meta()) continue;  // another pipeline stage's
    if (!v.grad().defined()) v.mutable_grad() = at::zeros_like(v);
    grads.push_back(v.grad());
  }
  if (grads.empty()) return;
  std::vector<at::Tensor> flat;
  for (auto& g : grads) flat.push_back(g.reshape({-1}));
  at::Tensor buf = at::cat(flat);
  tp_.allreduce(buf, ReduceOp::Sum);
  int64_t off = 0;
  for (auto& g : grads) {
    g.copy_(buf.narrow(0, off, g.numel()).view_as(g));
    off += g.numel();
  }
}

void TensorParallelGradSync::reduce_norm_sq(at::Tensor& norm_sq) {
  at::NoGradGuard ng;
  // Every tp rank holds the same replicated gradients: count them on tp rank 0 only.
  if (tp_.rank() != 0) {
    for (int64_t i : model_.tp_plan().replicated()) {
      const at::Tensor& g = model_.params()[i].value.grad();
      if (g.defined()) norm_sq.sub_(g.to(at::kDouble).pow(2).sum().to(norm_sq.scalar_type()));
    }
  }
  tp_.allreduce(norm_sq, ReduceOp::Sum);
  if (inner_) inner_->reduce_norm_sq(norm_sq);
}

}  // namespace titan
