#include "parallel/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <functional>
#include <sstream>

#include "core/base/errors.h"
#include "core/kernels/weight_grad_store.h"
#include "core/train/float8_linears.h"
#include "core/train/recompute.h"

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
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, bool gather) {
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
  int64_t group_id() const { return reinterpret_cast<int64_t>(&g_); }
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

// ---- async tensor parallelism -----------------------------------------------------------
// Each rank's sequence shard (B, T/tp, ...) is cut into c chunks of L rows; chunk j of the
// whole sequence is chunk j of every rank's shard, (tp, B, L, ...). Its collective is issued
// before the previous chunk's GEMM runs and waited just before its own, so the transfer
// overlaps compute (NCCL: on NCCL's stream, ordered by events, capturable; gloo: in the
// backend's worker thread). Same math as plain TP: only the GEMMs' row blocks and, in the
// backward of the gather, the order in which the q/k/v (w1/w3) input gradients are summed
// differ (docs/distributed.md, "Async tensor parallel").

// Chunks per shard. 2 measured no worse than 4 on gloo (each chunk's collective pays the
// latency again; docs/distributed.md); at most (c - 1) / c of a collective can be hidden.
constexpr int64_t kMaxChunks = 2;

// The largest divisor of a shard's rows up to kMaxChunks.
int64_t chunk_count(int64_t rows) {
  for (int64_t c = std::min(kMaxChunks, rows); c > 1; --c)
    if (rows % c == 0) return c;
  return 1;
}

// Chunk j of every rank's block of x (B, T, F), T = n * c * L -> (n, B, L, F), contiguous.
at::Tensor chunk_rows(const at::Tensor& x, int64_t n, int64_t c, int64_t j) {
  const int64_t B = x.size(0), F = x.size(2), L = x.size(1) / (n * c);
  return x.reshape({B, n, c, L, F}).select(2, j).permute({1, 0, 2, 3}).contiguous();
}

// The chunks back in sequence order: (c, n, B, L, F) -> (B, T, F).
at::Tensor unchunk(const at::Tensor& s) {
  const int64_t c = s.size(0), n = s.size(1), B = s.size(2), L = s.size(3), F = s.size(4);
  return s.permute({2, 1, 0, 3, 4}).reshape({B, n * c * L, F});
}

// All-gathers x's chunks (B, T/tp, D) into `buf` (c, n, B, L, D), chunk j+1's issued before
// `use(j)` runs on chunk j. The chunk inputs stay alive until their waits.
void gathered_chunks(ProcessGroup& pg, const at::Tensor& x, at::Tensor& buf,
                     const std::function<void(int64_t)>& use) {
  const int64_t c = buf.size(0), L = buf.size(3);
  std::vector<at::Tensor> in(static_cast<size_t>(c));
  std::vector<CommWork> works(static_cast<size_t>(c));
  auto start = [&](int64_t j) {
    in[j] = x.narrow(1, j * L, L).contiguous();
    at::Tensor out = buf.select(0, j);  // contiguous: rank r's (B, L, D) at block r
    works[j] = pg.all_gather_start(out, in[j]);
  };
  start(0);
  for (int64_t j = 0; j < c; ++j) {
    if (j + 1 < c) start(j + 1);
    works[j].wait();
    use(j);
  }
}

// Reduce-scatters `part(j)` (n, B, L, D), chunk j's partial sums, each started as soon as it
// is computed, into this rank's (B, T/tp, D); `between` runs before the waits.
at::Tensor reduce_scattered_chunks(ProcessGroup& pg, int64_t c,
                                   const std::function<at::Tensor(int64_t)>& part,
                                   const std::function<void()>& between) {
  std::vector<at::Tensor> in(static_cast<size_t>(c)), out(static_cast<size_t>(c));
  std::vector<CommWork> works(static_cast<size_t>(c));
  for (int64_t j = 0; j < c; ++j) {
    in[j] = part(j);
    out[j] = at::empty({in[j].size(1), in[j].size(2), in[j].size(3)}, in[j].options());
    works[j] = pg.reduce_scatter_start(out[j], in[j]);
  }
  if (between) between();
  for (auto& w : works) w.wait();
  return at::cat(out, 1);
}

// project(gather_seq(x), w_i) for up to three weights, chunked; backward: the input
// gradient's chunks reduce-scattered as they are computed, the weight GEMMs while the last
// ones run.
struct AsyncGatherProject : public torch::autograd::Function<AsyncGatherProject> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w0,
                               const at::Tensor& w1, const at::Tensor& w2, int64_t group) {
    at::NoGradGuard ng;
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    const int64_t n = pg.size(), B = x.size(0), D = x.size(2);
    const int64_t c = chunk_count(x.size(1)), L = x.size(1) / c;
    std::vector<at::Tensor> ws;
    for (const at::Tensor& w : {w0, w1, w2})
      if (w.numel() > 0) ws.push_back(w);                      // an empty one stands for no weight
    at::Tensor buf = at::empty({c, n, B, L, D}, x.options());  // the gathered input
    std::vector<std::vector<at::Tensor>> ys(ws.size());
    gathered_chunks(pg, x, buf, [&](int64_t j) {
      for (size_t i = 0; i < ws.size(); ++i) ys[i].push_back(at::linear(buf.select(0, j), ws[i]));
    });
    variable_list out;
    for (auto& y : ys) out.push_back(unchunk(at::stack(y)));  // (B, T, O_i)
    ctx->save_for_backward({buf, w0, w1, w2});
    ctx->saved_data["group"] = group;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list gy) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& buf = saved[0];
    const int64_t c = buf.size(0), n = buf.size(1), D = buf.size(4);
    std::vector<int64_t> live;  // the outputs that received a gradient
    for (size_t i = 0; i < gy.size(); ++i)
      if (gy[i].defined()) live.push_back(static_cast<int64_t>(i));
    variable_list grads(5);
    auto part = [&](int64_t j) {
      at::Tensor sum;
      for (int64_t i : live) {
        at::Tensor g = at::matmul(chunk_rows(gy[i], n, c, j), saved[1 + i]);  // (n, B, L, D)
        sum = sum.defined() ? sum.add_(g) : g;
      }
      return sum.defined() ? sum : at::zeros({n, buf.size(2), buf.size(3), D}, buf.options());
    };
    auto weight_grads = [&] {
      for (int64_t i : live) {
        auto gw = [g = gy[i].reshape({-1, gy[i].size(2)}), buf, D] {
          return g.t().mm(unchunk(buf).reshape({-1, D}));  // (B * T, O)^T (B * T, D)
        };
        // A zero-bubble I leaves the weight GEMMs to its W (core/kernels/weight_grad_store.h).
        if (WeightGradStore* store = weight_grad_deferral())
          store->add(saved[1 + i], gw);
        else
          grads[1 + i] = gw();
      }
    };
    grads[0] = reduce_scattered_chunks(pg, c, part, weight_grads);
    return grads;
  }
};

// reduce_scatter_seq(project(x, w)), chunked; backward: the output gradient's chunks
// all-gathered one ahead of the input-gradient GEMMs.
struct AsyncProjectReduce : public torch::autograd::Function<AsyncProjectReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            int64_t group) {
    at::NoGradGuard ng;
    auto& pg = *reinterpret_cast<ProcessGroup*>(group);
    const int64_t n = pg.size();
    TORCH_CHECK(x.dim() == 3 && x.size(1) % n == 0, "sequence length ", x.size(1),
                " does not split over ", n, " tensor-parallel ranks");
    const int64_t c = chunk_count(x.size(1) / n);
    ctx->save_for_backward({x, w});
    ctx->saved_data["group"] = group;
    return reduce_scattered_chunks(
        pg, c, [&](int64_t j) { return at::linear(chunk_rows(x, n, c, j), w); }, nullptr);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    auto& pg = *reinterpret_cast<ProcessGroup*>(ctx->saved_data["group"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor& go = g[0];  // (B, T/tp, D)
    const int64_t n = pg.size(), B = go.size(0), D = go.size(2);
    const int64_t c = chunk_count(go.size(1)), L = go.size(1) / c;
    at::Tensor buf = at::empty({c, n, B, L, D}, go.options());  // the gathered gradient
    std::vector<at::Tensor> gx;
    gathered_chunks(pg, go, buf, [&](int64_t j) { gx.push_back(at::matmul(buf.select(0, j), w)); });
    auto grad_w = [buf, x, D] {
      return unchunk(buf).reshape({-1, D}).t().mm(x.reshape({-1, x.size(2)}));
    };
    at::Tensor gw;
    if (WeightGradStore* store = weight_grad_deferral())  // a zero-bubble I: W computes it
      store->add(w, grad_w);
    else
      gw = grad_w();
    return {unchunk(at::stack(gx)), gw, at::Tensor()};
  }
};

// Plain TP's collectives, with the GEMM-fused boundaries chunked and overlapped. Falls back to
// plain TP's composition where the chunked ops do not apply: float8 weights (their GEMMs
// are float8_linear's), op-level checkpointing (its tape replays project()), the meta
// device, or a shard of one row.
class AsyncTensorParallel : public C10dTensorParallel {
 public:
  using C10dTensorParallel::C10dTensorParallel;
  std::vector<at::Tensor> gather_seq_project(const at::Tensor& x,
                                             const std::vector<at::Tensor>& ws) override {
    const char* why = ws.empty() || ws.size() > 3 ? "not 1 to 3 fused weights" : unchunkable(x, ws);
    if (why) {
      fell_back(why);
      return TensorParallelComm::gather_seq_project(x, ws);
    }
    ++counts_.chunked;
    // Absent weights as empty tensors: autograd records every tensor input's device.
    auto w = [&](size_t i) { return i < ws.size() ? ws[i] : at::empty({0}, x.options()); };
    return AsyncGatherProject::apply(x, w(0), w(1), w(2), group_id());
  }
  at::Tensor project_reduce_scatter_seq(const at::Tensor& x, const at::Tensor& w) override {
    const char* why = unchunkable(x, {w});
    if (!why && x.dim() == 3 && x.size(1) % size() != 0) why = "a sequence the ranks do not divide";
    if (why) {
      fell_back(why);
      return TensorParallelComm::project_reduce_scatter_seq(x, w);
    }
    ++counts_.chunked;
    return AsyncProjectReduce::apply(x, w, group_id());
  }
  AsyncCounts take_async_counts() override {
    AsyncCounts c = counts_;
    counts_.chunked = counts_.fallback = 0;  // the first reason stays: it is reported once
    return c;
  }

 private:
  // Why the chunked ops do not apply to x and ws (null: they do).
  static const char* unchunkable(const at::Tensor& x, const std::vector<at::Tensor>& ws) {
    if (x.dim() != 3) return "an input that is not (B, T, D)";
    if (x.is_meta()) return "the meta device";
    if (x.size(1) < 2) return "a shard of one row";
    if (op_tape_active()) return "op-level activation checkpointing";
    for (const at::Tensor& w : ws)
      if (float8_options_of(w)) return "float8 weights";
    return nullptr;
  }
  void fell_back(const char* why) {
    ++counts_.fallback;
    if (counts_.first_fallback.empty()) counts_.first_fallback = why;
  }
  AsyncCounts counts_;
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
                      model.info().name + "/" + model.info().flavor + "; allowed: a divisor of " +
                      std::to_string(n));
}

std::shared_ptr<TensorParallelComm> apply_tensor_parallel(Model& model, ProcessGroup& tp_group,
                                                          bool split_experts, bool async) {
  split_for_tensor_parallel(model, tp_group.size(), tp_group.rank(), split_experts);
  if (tp_group.size() == 1) return nullptr;
  auto comm = make_tp_comm(tp_group, async);
  model.set_tensor_parallel(comm);
  if (model.tp_plan().split_experts) model.set_expert_tensor_parallel(comm);
  return comm;
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

std::shared_ptr<TensorParallelComm> make_tp_comm(ProcessGroup& group, bool async) {
  if (async) return std::make_shared<AsyncTensorParallel>(group);
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
