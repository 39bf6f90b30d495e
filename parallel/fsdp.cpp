#include "parallel/fsdp.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

#include "core/kernels/float8_linear.h"
#include "core/kernels/weight_grad_store.h"
#include "core/train/float8_linears.h"
#include "parallel/flat_grad_allreduce.h"

namespace titan {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One all-gather unit: parameters gathered and reduced together over one group.
struct FullyShardedDataParallel::Unit {
  std::string name;
  ProcessGroup* group = nullptr;
  bool reshard_after_forward = false;
  std::vector<int64_t> params;                   // store indices
  std::vector<std::vector<int64_t>> full_shape;  // the gathered shape (dim 0: rows over group)
  std::vector<int64_t> chunk_rows;               // rows per rank (ceil(rows / group size))
  std::vector<int64_t> chunk_numel;              // chunk_rows x the other dims
  int64_t chunk_total = 0;                       // sum of chunk_numel: one rank's flat share
  int64_t next = -1;  // forward: the unit whose all-gather starts when this one is gathered
  int64_t prev = -1;  // backward: the unit whose regather starts when this one is regathered
  // A started all-gather of this unit (prefetch): the buffers and the collective.
  at::Tensor prefetch_send, prefetch_recv;
  CommWork prefetch_work;
  // Live state of the current forward.
  std::vector<at::Tensor> full;  // the gathered weights handed to the model (autograd outputs)
  std::vector<bool> handed;      // returned by weight() since the last gather
  bool released = false;         // storages freed after the block's forward
  // Float8 all-gather (FsdpOptions::float8_params): a rank's row is bytes, the param_dtype
  // shards first (so each starts at a multiple of its element size), then the e4m3 ones.
  std::vector<int64_t> f8_slot;   // per param: its index among the unit's float8 weights, or -1
  std::vector<int64_t> byte_off;  // per param: where its chunk starts in a rank's row (bytes)
  int64_t row_bytes = 0;          // a rank's row, padded to 16 bytes
  int64_t f8_count = 0;           // float8 weights in the unit
  int64_t f8_first = 0;           // the first one's slot in the precomputed scales
  at::Tensor scales;              // (f8_count) fp32: those of the current gather
  at::Tensor prefetch_scales;     // those the started all-gather was cast with
  // Per param: the gathered e4m3 weight (full[k] is then a stand-in of its shape, with no
  // values, that carries the autograd edge to the reduce-scatter); undefined for the others.
  std::vector<at::Tensor> full8;
  bool float8() const { return f8_count > 0; }
};

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Frees a tensor's storage but keeps the tensor (and every autograd reference to it).
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

// Gives a freed tensor fresh storage of its full size.
void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

// A tensor of `shape` and the options' dtype whose elements all alias one zero (strides 0):
// what the model is handed for a weight gathered in float8. Its values are never read (the
// float8 linear uses the gathered e4m3 weight); it has the weight's shape and dtype so that
// the gradient autograd gives it is the weight's.
at::Tensor standin(const std::vector<int64_t>& shape, const at::TensorOptions& opt) {
  at::Tensor one = at::zeros({1}, opt);
  at::Tensor t = at::empty({0}, opt);
  t.set_(one.storage(), 0, shape, std::vector<int64_t>(shape.size(), 0));
  return t;
}

// A unit's flat layout is `grid` [n, chunk_total]: row r holds rank r's shards back to back,
// this parameter's at column `off`, c rows each. Calls fn(grid_part, whole_part) for the (at
// most two) matching pieces of grid and of the parameter's whole tensor `whole` [rows, ...]
// (contiguous): the ranks whose c rows are all real, then the one partly padded rank. Rows
// past the end of `whole` (padding) have no piece.
template <class F>
void match_rows(const at::Tensor& grid, int64_t off, int64_t c, const at::Tensor& whole, F fn) {
  const int64_t rows = whole.size(0);
  const int64_t row_numel = rows > 0 ? whole.numel() / rows : 0;
  const at::Tensor flat = whole.view({rows, row_numel});
  const int64_t full_ranks = rows / c, rem = rows - full_ranks * c;
  if (full_ranks > 0)
    fn(grid.narrow(0, 0, full_ranks).narrow(1, off, c * row_numel),
       flat.narrow(0, 0, full_ranks * c).view({full_ranks, c * row_numel}));
  if (rem > 0)
    fn(grid[full_ranks].narrow(0, off, rem * row_numel),
       flat.narrow(0, full_ranks * c, rem).reshape({-1}));
}

}  // namespace

// A unit's reduce-scatter, started in backward: `send` is the full-size gradient buffer
// (gloo sums it in place), `recv` this rank's shard of the sum.
struct FullyShardedDataParallel::Reduction {
  int64_t unit = -1;
  at::Tensor send, recv;
  CommWork work;
  bool last = true;  // in the step's last backward: HSDP then all-reduces over replicas
};

// HSDP: a unit's shard gradients (flat, reduce dtype) being summed over the replicas.
struct FullyShardedDataParallel::Replication {
  int64_t unit = -1;
  FlatGradAllReduce flat;
};

// forward: shards -> full weights (all-gather); backward: full grads -> shard grads
// (reduce-scatter).
struct FullyShardedDataParallel::Gather : public torch::autograd::Function<Gather> {
  // alias: another forward of the step under gather_once_per_step (no collective).
  static variable_list forward(AutogradContext* ctx, int64_t self_ptr, int64_t unit, bool alias,
                               at::TensorList shards) {
    auto* self = reinterpret_cast<FullyShardedDataParallel*>(self_ptr);
    ctx->saved_data["self"] = self_ptr;
    ctx->saved_data["unit"] = unit;
    Unit& u = *self->units_[static_cast<size_t>(unit)];
    // A weight without a gradient stays undefined: start_reduce_scatter sends zeros for it,
    // and a zero-bubble I (below) holds no full-size zeros.
    ctx->set_materialize_grads(false);
    if (alias)
      self->alias_full(u);
    else
      self->gather_into(u, shards.vec(), /*refill=*/false);
    return u.full;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* self = reinterpret_cast<FullyShardedDataParallel*>(ctx->saved_data["self"].toInt());
    const int64_t unit = ctx->saved_data["unit"].toInt();
    Unit& u = *self->units_[static_cast<size_t>(unit)];
    if (WeightGradStore* store = weight_grad_deferral()) {
      // A zero-bubble I: the linear weights' gradients come later, in the W, through this
      // node again. Hold the ones that came now (norms) until then, so the unit is
      // reduce-scattered once; if the W never reaches this node (no deferred linear in
      // the unit), its flush reduce-scatters them after its backward.
      auto held = std::make_shared<variable_list>(std::move(grads));
      ctx->saved_data["held"] = reinterpret_cast<int64_t>(held.get());
      store->after_flush([self, unit, held] {
        if (held->empty()) return;  // the W merged them
        self->start_reduce_scatter(*self->units_[static_cast<size_t>(unit)], *held);
        held->clear();
      });
      return variable_list(3 + u.params.size());
    }
    if (auto it = ctx->saved_data.find("held"); it != ctx->saved_data.end()) {
      auto& held = *reinterpret_cast<variable_list*>(it->second.toInt());  // the I's, alive
      for (size_t k = 0; k < held.size() && k < grads.size(); ++k)
        if (held[k].defined()) grads[k] = grads[k].defined() ? grads[k] + held[k] : held[k];
      held.clear();
    }
    // The shard gradients arrive when the reduce-scatter is waited for (reduce_gradients),
    // not through autograd, so backward goes on while it runs.
    self->start_reduce_scatter(u, grads);
    // Reshard after backward; once per step instead when later micro-batches share them.
    if (!self->opts_.gather_once_per_step) self->release(u);
    return variable_list(3 + u.params.size());
  }
};

// Identity on a block's output whose backward gathers the block's weights again, before
// autograd reaches any node of the block that saved them.
struct FullyShardedDataParallel::Regather : public torch::autograd::Function<Regather> {
  static variable_list forward(AutogradContext* ctx, int64_t self_ptr, int64_t unit,
                               const at::Tensor& x) {
    ctx->saved_data["self"] = self_ptr;
    ctx->saved_data["unit"] = unit;
    return {x};  // returned as-is: autograd makes it a view with this node as its history
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* self = reinterpret_cast<FullyShardedDataParallel*>(ctx->saved_data["self"].toInt());
    Unit& u = *self->units_[static_cast<size_t>(ctx->saved_data["unit"].toInt())];
    if (u.released) {
      std::vector<at::Tensor> shards;
      for (int64_t i : u.params) shards.push_back(self->model_.params()[i].value);
      self->gather_into(u, shards, /*refill=*/true);  // uses the prefetch when one was started
    }
    // Start the regather of the block before this one: it runs while this block's backward
    // computes. Every rank runs the same backward graph, so the order matches everywhere.
    if (u.prev >= 0) {
      Unit& p = *self->units_[static_cast<size_t>(u.prev)];
      if (p.released) self->prefetch(p, /*regather=*/true);
    }
    return {at::Tensor(), at::Tensor(), grads[0]};
  }
};

void FullyShardedDataParallel::shard_param(Unit& u, int64_t ui, int64_t i) {
  Param& p = model_.params().all()[static_cast<size_t>(i)];
  TORCH_CHECK(!p.sharded(), "parameter ", p.name, " is already sharded");
  // Under expert parallelism this rank's experts are rows [ep_index * E/ep, + E/ep).
  const std::vector<int64_t> global = p.value.sizes().vec();
  TORCH_CHECK(!global.empty(), "cannot shard the scalar parameter ", p.name);
  int64_t base = 0, rows = global[0];
  if (p.expert() && mesh_.ep > 1) {
    TORCH_CHECK(rows % mesh_.ep == 0, p.name, ": ", rows, " experts over ep ", mesh_.ep);
    rows /= mesh_.ep;
    base = mesh_.ep_index * rows;
  }
  const int64_t n = u.group->size(), r = u.group->rank();
  const int64_t chunk = (rows + n - 1) / n;
  const int64_t begin = std::min(rows, r * chunk);
  const int64_t valid = std::min(rows, begin + chunk) - begin;
  std::vector<int64_t> shard_shape = global;
  shard_shape[0] = chunk;
  // A deferred (meta) parameter is allocated here for the first time, shard-sized; the
  // caller initializes it afterwards (ParamStore::initialize writes this rank's rows).
  at::Tensor shard =
      at::zeros(shard_shape, p.value.options().device(p.device).requires_grad(false));
  if (valid > 0 && !p.value.is_meta())
    shard.narrow(0, 0, valid).copy_(p.value.narrow(0, base + begin, valid));
  std::vector<int64_t> full_shape = global;
  full_shape[0] = rows;
  u.params.push_back(i);
  u.full_shape.push_back(full_shape);
  u.chunk_rows.push_back(chunk);
  u.chunk_numel.push_back(numel_of(shard_shape));
  u.chunk_total += numel_of(shard_shape);
  where_[static_cast<size_t>(i)] = {ui, static_cast<int64_t>(u.params.size() - 1)};
  p.global_shape = global;
  p.dim0_offset = base + begin;
  p.dim0_rows = valid;
  p.value = shard.requires_grad_(true);
}

FullyShardedDataParallel::FullyShardedDataParallel(Model& model, Mesh& mesh,
                                                   const FsdpOptions& opts)
    : model_(model), mesh_(mesh), opts_(opts) {
  at::NoGradGuard ng;
  auto& params = model.params().all();
  block_units_.resize(static_cast<size_t>(model.info().n_layers));
  where_.resize(params.size(), {-1, -1});
  std::vector<bool> own(params.size(), opts.only_params.empty());
  for (int64_t i : opts.only_params) own[static_cast<size_t>(i)] = true;
  TORCH_CHECK(!opts.gather_once_per_step || !opts.reshard_after_forward,
              "FSDP: gather_once_per_step needs reshard_after_forward = false");
  // The model's units, in forward order; under expert parallelism a block's expert weights
  // form a unit of their own over the efsdp group.
  std::vector<int64_t> order;
  for (const ParamUnit& pu : model.param_units()) {
    std::vector<int64_t> dense, expert;
    for (int64_t i : pu.params)
      if (own[static_cast<size_t>(i)])
        (params[static_cast<size_t>(i)].expert() && mesh.ep > 1 ? expert : dense).push_back(i);
    for (auto* part : {&dense, &expert}) {
      if (part->empty()) continue;
      const bool ex = part == &expert;
      auto u = std::make_unique<Unit>();
      u->name = pu.name + (ex ? ".experts" : "");
      u->group = ex ? mesh.efsdp_group : mesh.shard_group;
      u->reshard_after_forward = pu.block >= 0 && opts.reshard_after_forward;
      const int64_t ui = static_cast<int64_t>(units_.size());
      if (pu.block >= 0) block_units_[static_cast<size_t>(pu.block)].push_back(ui);
      order.push_back(ui);
      for (int64_t i : *part) shard_param(*u, ui, i);
      units_.push_back(std::move(u));
    }
  }
  // Each unit prefetches the next one of its own process group in forward; in backward a
  // block unit prefetches the previous resharded one of its group.
  if (opts.prefetch)
    for (size_t a = 0; a < order.size(); ++a)
      for (size_t b = a + 1; b < order.size(); ++b) {
        Unit& ua = *units_[static_cast<size_t>(order[a])];
        Unit& ub = *units_[static_cast<size_t>(order[b])];
        if (ub.group != ua.group) continue;
        ua.next = order[b];
        if (opts.backward_prefetch && ua.reshard_after_forward && ub.reshard_after_forward)
          ub.prev = order[a];
        break;
      }
  if (!opts.float8_params.empty()) {
    for (auto& u : units_) layout_float8(*u);
    TORCH_CHECK(f8_order_.size() == opts.float8_params.size(),
                "FSDP float8 all-gather: a float8 weight is in no unit");
  }
  model.set_weight_fn([this](int64_t i) { return weight(i); });
  model.set_block_done_fn([this](int64_t b, const at::Tensor& out) { return after_block(b, out); });
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  model_.set_weight_fn(nullptr);
  model_.set_block_done_fn(nullptr);
}

int64_t FullyShardedDataParallel::num_units() const {
  return static_cast<int64_t>(units_.size());
}

std::string FullyShardedDataParallel::describe() const {
  std::ostringstream os;
  os << units_.size() << " units, " << (opts_.reshard_after_forward ? "" : "no ")
     << "reshard after forward, " << (opts_.prefetch ? "" : "no ") << "prefetch, "
     << (opts_.backward_prefetch ? "" : "no ") << "backward prefetch, all-gather in "
     << c10::toString(opts_.param_dtype) << ", reduce-scatter in "
     << c10::toString(opts_.reduce_dtype);
  if (opts_.max_inflight_reductions > 0)
    os << ", reduce-scatters waited for before the norm (at most " << opts_.max_inflight_reductions
       << " in flight)";
  else
    os << ", reduce-scatters waited for at once";
  if (mesh_.replicate > 1)
    os << ", then an async all-reduce per unit over " << mesh_.replicate << " replicas";
  if (!f8_order_.empty())
    os << "; float8 all-gather of " << f8_order_.size()
       << " linear weights (e4m3, the whole weight's tensorwise scale: "
       << (opts_.float8_precompute
               ? "precomputed after each optimizer step, one fused amax and one all-reduce)"
               : "one amax all-reduce per unit at each forward gather)");
  return os.str();
}

at::Tensor FullyShardedDataParallel::pack(const Unit& u, const std::vector<at::Tensor>& shards,
                                          const at::Tensor& scales) {
  if (!u.float8()) {
    std::vector<at::Tensor> flat;
    for (auto& s : shards) flat.push_back(s.detach().reshape({-1}));
    return at::cat(flat).to(opts_.param_dtype);
  }
  // Zeros: the padding bytes are gathered too, and then every step sends the same.
  at::Tensor row = at::zeros({u.row_bytes}, shards[0].options().dtype(at::kByte));
  const int64_t esize = static_cast<int64_t>(c10::elementSize(opts_.param_dtype));
  for (size_t k = 0; k < u.params.size(); ++k) {
    const at::Tensor flat = shards[k].detach().reshape({-1});
    const int64_t slot = u.f8_slot[k];
    if (slot >= 0)  // torchao's fsdp_pre_all_gather: the fp32 shard cast with the whole's scale
      row.narrow(0, u.byte_off[k], u.chunk_numel[k])
          .view(at::kFloat8_e4m3fn)
          .copy_(float8::to_float8_saturated(flat, scales[slot], at::kFloat8_e4m3fn));
    else
      row.narrow(0, u.byte_off[k], u.chunk_numel[k] * esize).view(opts_.param_dtype).copy_(flat);
  }
  return row;
}

void FullyShardedDataParallel::prefetch(Unit& u, bool regather) {
  if (u.prefetch_work.pending() || u.prefetch_recv.defined()) return;
  if (opts_.gather_once_per_step && !u.full.empty() && !u.released) return;  // gathered
  at::NoGradGuard ng;
  std::vector<at::Tensor> shards;
  for (int64_t i : u.params) shards.push_back(model_.params()[i].value);
  if (u.float8()) u.prefetch_scales = regather ? u.scales : float8_scales(u, shards);
  u.prefetch_send = pack(u, shards, u.prefetch_scales);
  u.prefetch_recv = at::empty({u.group->size() * u.prefetch_send.numel()},
                              u.prefetch_send.options().requires_grad(false));
  u.prefetch_work = u.group->all_gather_start(u.prefetch_recv, u.prefetch_send);
}

void FullyShardedDataParallel::gather_into(Unit& u, const std::vector<at::Tensor>& shards,
                                           bool refill) {
  at::NoGradGuard ng;
  const int64_t n = u.group->size();
  at::Tensor recv;
  if (u.prefetch_recv.defined()) {  // started while the neighbouring block computed
    u.prefetch_work.wait();
    recv = u.prefetch_recv;
    u.scales = u.prefetch_scales;
    u.prefetch_send = u.prefetch_recv = u.prefetch_scales = at::Tensor();
  } else {
    // A regather keeps the scales of the forward's gather: the shards have not changed.
    if (u.float8() && !refill) u.scales = float8_scales(u, shards);
    at::Tensor send = pack(u, shards, u.scales);
    recv = at::empty({n * send.numel()}, send.options().requires_grad(false));
    u.group->all_gather(recv, send);
  }
  unpack(u, recv.view({n, -1}), refill);  // row r: rank r's shards, concatenated
}

void FullyShardedDataParallel::unpack(Unit& u, const at::Tensor& grid, bool refill) {
  const auto opt = model_.params()[u.params[0]].value.options().dtype(opts_.param_dtype);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(opts_.param_dtype));
  if (!refill) {
    u.full.clear();
    u.full8.assign(u.params.size(), at::Tensor());
    u.handed.assign(u.params.size(), false);
  }
  int64_t off = 0;
  for (size_t k = 0; k < u.params.size(); ++k) {
    const int64_t slot = u.float8() ? u.f8_slot[k] : -1;
    // This param's columns of the grid, typed: (n, chunk_numel[k]).
    at::Tensor from = grid.narrow(1, off, u.chunk_numel[k]);
    if (u.float8())
      from = slot >= 0
                 ? grid.narrow(1, u.byte_off[k], u.chunk_numel[k]).view(at::kFloat8_e4m3fn)
                 : grid.narrow(1, u.byte_off[k], u.chunk_numel[k] * esize).view(opts_.param_dtype);
    at::Tensor dst;
    if (refill) {
      // Write through a separate alias: copying into the tensor itself would bump the
      // version counter autograd checks when it unpacks the saved weight.
      const at::Tensor& t = slot >= 0 ? u.full8[k] : u.full[k];
      alloc_storage(t);
      dst = at::empty({0}, t.options().requires_grad(false));
      dst.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
    } else if (slot >= 0) {
      dst = at::empty(u.full_shape[k], opt.dtype(at::kFloat8_e4m3fn).requires_grad(false));
      u.full8[k] = dst;
      u.full.push_back(standin(u.full_shape[k], opt.requires_grad(false)));
      attach_float8_weight(u.full.back(), {dst, u.scales[slot]});
    } else {
      // Always a fresh tensor (never a view of recv): its storage is freed and refilled alone.
      dst = at::empty(u.full_shape[k], opt.requires_grad(false));
      u.full.push_back(dst);
    }
    match_rows(from, 0, u.chunk_rows[k], dst,
               [](const at::Tensor& f, const at::Tensor& to) { to.copy_(f); });
    off += u.chunk_numel[k];
  }
  u.released = false;
}

void FullyShardedDataParallel::layout_float8(Unit& u) {
  const std::vector<int64_t>& f8 = opts_.float8_params;
  u.f8_slot.assign(u.params.size(), -1);
  u.byte_off.assign(u.params.size(), 0);
  u.f8_first = static_cast<int64_t>(f8_order_.size());
  for (size_t k = 0; k < u.params.size(); ++k) {
    if (std::find(f8.begin(), f8.end(), u.params[k]) == f8.end()) continue;
    const Param& p = model_.params()[u.params[k]];
    TORCH_CHECK(u.group == mesh_.shard_group && u.full_shape[k].size() == 2,
                "FSDP float8 all-gather: ", p.name, " is not a dense 2-D weight");
    u.f8_slot[k] = u.f8_count++;
    f8_order_.push_back(u.params[k]);
  }
  if (!u.float8()) return;
  const int64_t esize = static_cast<int64_t>(c10::elementSize(opts_.param_dtype));
  int64_t off = 0;
  for (size_t k = 0; k < u.params.size(); ++k)
    if (u.f8_slot[k] < 0) {
      u.byte_off[k] = off;
      off += u.chunk_numel[k] * esize;
    }
  for (size_t k = 0; k < u.params.size(); ++k)
    if (u.f8_slot[k] >= 0) {
      u.byte_off[k] = off;
      off += u.chunk_numel[k];
    }
  u.row_bytes = (off + 15) / 16 * 16;
}

// Under tensor parallelism a shard is of a tp slice: the whole weight's amax is also the max
// over the tp ranks (torchao's Float8ColwiseParallel / Float8RowwiseParallel weights are
// DTensors over both meshes). Under TP only tp-split linears are float8 (the replicated ones
// stay in high precision), and a max over equal values would change nothing anyway.
void FullyShardedDataParallel::reduce_over_tp(at::Tensor& amax) const {
  if (mesh_.tp_group && mesh_.tp_group->size() > 1) mesh_.tp_group->allreduce(amax, ReduceOp::Max);
}

at::Tensor FullyShardedDataParallel::float8_scales(Unit& u, const std::vector<at::Tensor>& shards) {
  if (opts_.float8_precompute) {
    // The first step's first gather: no optimizer step has computed them yet (the shards are
    // initialized or loaded by then: the trainer loads before the first step).
    if (!f8_scales_.defined()) precompute_float8_scales();
    // A copy: the buffer is rewritten after the optimizer step, the copy is this gather's.
    return f8_scales_.narrow(0, u.f8_first, u.f8_count).clone();
  }
  // torchao's dynamic path (tensor_to_amax with reduce_amax): the whole weight's amax is the
  // max of the shards' amaxes. One all-reduce for the unit's float8 weights together (torchao
  // issues one per weight); the same values.
  std::vector<at::Tensor> amax;
  for (size_t k = 0; k < u.params.size(); ++k)
    if (u.f8_slot[k] >= 0) amax.push_back(at::amax(at::abs(shards[k].detach())));
  at::Tensor a = at::stack(amax).to(at::kFloat);  // (f8_count)
  u.group->allreduce(a, ReduceOp::Max);
  reduce_over_tp(a);
  return float8::amax_to_scale(a, at::kFloat8_e4m3fn, /*power_of_2=*/false);
}

// torchao's precompute_float8_dynamic_scale_for_fsdp: after the optimizer step, the amax of
// every float8 weight in one fused op (its torch._foreach_norm with ord inf: max |w| of each
// shard), one all-reduce (max) over the shard group for all of them, then the e4m3 scales
// (amax_to_scale: 448 / max(amax, 1e-12) in fp64, then fp32, as torchao 0.18 does). On the
// device: nothing is read on the host.
void FullyShardedDataParallel::precompute_float8_scales() {
  at::NoGradGuard ng;
  std::vector<at::Tensor> shards;
  for (int64_t i : f8_order_) shards.push_back(model_.params()[i].value);
  at::Tensor amax = at::stack(at::_foreach_norm(shards, std::numeric_limits<double>::infinity()))
                        .to(at::kFloat);  // (slots)
  mesh_.shard_group->allreduce(amax, ReduceOp::Max);
  reduce_over_tp(amax);
  at::Tensor s = float8::amax_to_scale(amax, at::kFloat8_e4m3fn, /*power_of_2=*/false);
  if (f8_scales_.defined())
    f8_scales_.copy_(s);
  else
    f8_scales_ = s;
}

void FullyShardedDataParallel::after_optimizer_step() {
  if (opts_.float8_precompute && !f8_order_.empty()) precompute_float8_scales();
}

void FullyShardedDataParallel::start_reduce_scatter(Unit& u, const std::vector<at::Tensor>& grads) {
  at::NoGradGuard ng;
  const int64_t n = u.group->size();
  auto& params = model_.params().all();
  const auto opt =
      params[static_cast<size_t>(u.params[0])].value.options().dtype(opts_.reduce_dtype);
  Reduction r;
  r.unit = where_[static_cast<size_t>(u.params[0])].first;
  r.last = last_micro_batch_;
  // The gather's layout, with zeros for padding rows and for weights that got no gradient.
  r.send = at::zeros({n, u.chunk_total}, opt);
  int64_t col = 0;
  for (size_t k = 0; k < u.params.size(); ++k) {
    if (k < grads.size() && grads[k].defined())
      match_rows(r.send, col, u.chunk_rows[k], grads[k].contiguous(),
                 [](const at::Tensor& to, const at::Tensor& from) { to.copy_(from); });
    col += u.chunk_numel[k];
  }
  r.recv = at::empty({u.chunk_total}, opt);
  r.work = u.group->reduce_scatter_start(r.recv, r.send);
  reductions_.push_back(std::move(r));
  // Bound the buffers held in flight. A fixed schedule, not a poll of which reductions are
  // done already: the step's control flow must not depend on host timing, so that every
  // step issues the same ops in the same order (what a captured CUDA graph replays).
  while (static_cast<int64_t>(reductions_.size()) > opts_.max_inflight_reductions)
    finish_oldest_reduction();
}

// Waits for the oldest reduce-scatter and adds its shard gradients to the parameters' grads
// (accumulating over micro-batches); in the last backward, HSDP then starts the replica
// all-reduce. Always the oldest: every rank finishes, and so starts the all-reduces, in the
// same order.
void FullyShardedDataParallel::finish_oldest_reduction() {
  at::NoGradGuard ng;
  Reduction r = std::move(reductions_.front());
  reductions_.erase(reductions_.begin());
  r.work.wait();
  r.send = at::Tensor();
  Unit& u = *units_[static_cast<size_t>(r.unit)];
  auto& params = model_.params().all();
  int64_t off = 0;
  for (size_t k = 0; k < u.params.size(); ++k) {
    at::Tensor p = params[static_cast<size_t>(u.params[k])].value;
    at::Tensor g = r.recv.narrow(0, off, u.chunk_numel[k]).view_as(p).to(p.scalar_type());
    if (p.grad().defined())
      p.mutable_grad().add_(g);
    else
      p.mutable_grad() = g;
    off += u.chunk_numel[k];
  }
  if (r.last && mesh_.replicate > 1) start_replication(r.unit);
}

std::vector<at::Tensor> FullyShardedDataParallel::shards_of(int64_t unit) const {
  const auto& params = model_.params().all();
  std::vector<at::Tensor> r;
  for (int64_t i : units_[static_cast<size_t>(unit)]->params)
    r.push_back(params[static_cast<size_t>(i)].value);
  return r;
}

void FullyShardedDataParallel::start_replication(int64_t unit) {
  Replication rep;
  rep.unit = unit;
  rep.flat.start(*mesh_.replicate_group, shards_of(unit), opts_.reduce_dtype);
  if (opts_.max_inflight_reductions == 0) rep.flat.work.wait();
  replications_.push_back(std::move(rep));
}

void FullyShardedDataParallel::release(Unit& u) {
  for (size_t k = 0; k < u.full.size(); ++k)  // a stand-in has no storage worth freeing
    free_storage(u.float8() && u.f8_slot[k] >= 0 ? u.full8[k] : u.full[k]);
  u.released = true;
}

at::Tensor FullyShardedDataParallel::weight(int64_t i) {
  auto [ui, k] = where_[static_cast<size_t>(i)];
  Unit& u = *units_[static_cast<size_t>(ui)];
  // A second request for the same weight means a new forward: gather again, so each forward
  // has its own autograd node (and its own reduce-scatter in backward).
  if (u.full.empty() || u.handed[static_cast<size_t>(k)] || u.released) {
    const bool alias = opts_.gather_once_per_step && !u.full.empty() && !u.released;
    std::vector<at::Tensor> shards;
    for (int64_t j : u.params) shards.push_back(model_.params()[j].value);
    if (at::GradMode::is_enabled()) {
      Gather::apply(reinterpret_cast<int64_t>(this), ui, alias, at::TensorList(shards));
      // Gather::forward stored the outputs in u.full; apply wrapped the same tensors.
    } else if (alias) {
      alias_full(u);
    } else {
      gather_into(u, shards, /*refill=*/false);
    }
    // Start the next unit's all-gather now, so it overlaps this block's compute. Every rank
    // runs the same forward, so the collectives stay in the same order on every rank.
    if (u.next >= 0) prefetch(*units_[static_cast<size_t>(u.next)], /*regather=*/false);
  }
  u.handed[static_cast<size_t>(k)] = true;
  return u.full[static_cast<size_t>(k)];
}

void FullyShardedDataParallel::alias_full(Unit& u) {
  at::NoGradGuard ng;
  for (at::Tensor& t : u.full) {
    at::Tensor a = at::empty({0}, t.options().requires_grad(false));
    a.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
    copy_float8_mark(t, a);  // a float8-gathered weight's stand-in: its e4m3 form goes along
    t = a;                   // the earlier forward's tensor lives on in its own autograd graph
  }
  u.handed.assign(u.params.size(), false);
}

at::Tensor FullyShardedDataParallel::after_block(int64_t block, const at::Tensor& out) {
  at::Tensor h = out;
  for (int64_t ui : block_units_[static_cast<size_t>(block)]) {
    Unit& u = *units_[static_cast<size_t>(ui)];
    if (!u.reshard_after_forward || u.full.empty()) continue;
    release(u);
    if (at::GradMode::is_enabled() && h.requires_grad())
      h = Regather::apply(reinterpret_cast<int64_t>(this), ui, h)[0];
  }
  return h;
}

void FullyShardedDataParallel::reduce_gradients(const std::vector<at::Tensor>&) {
  at::NoGradGuard ng;
  while (!reductions_.empty()) finish_oldest_reduction();
  if (!last_micro_batch_ && mesh_.replicate > 1)  // no backward started them: all at once
    for (size_t ui = 0; ui < units_.size(); ++ui) start_replication(static_cast<int64_t>(ui));
  for (Replication& rep : replications_) rep.flat.finish(shards_of(rep.unit));
  replications_.clear();
  if (opts_.gather_once_per_step) release_gathered();  // the step's schedule is done with them
  // A backward prefetch nobody consumed (a block whose output got no gradient) holds the
  // weights from before the optimizer step: finish it and drop it.
  for (auto& u : units_) {
    u->prefetch_work.wait();
    u->prefetch_send = u->prefetch_recv = u->prefetch_scales = at::Tensor();
  }
  last_micro_batch_ = true;
}

void FullyShardedDataParallel::release_gathered() {
  for (auto& u : units_) {
    if (!u->full.empty() && !u->released) release(*u);
    u->prefetch_work.wait();  // a prefetch nobody consumed: stale after the next step
    u->prefetch_send = u->prefetch_recv = u->prefetch_scales = at::Tensor();
  }
}

void FullyShardedDataParallel::reduce_norm_sq(at::Tensor& norm_sq) {
  // Padding rows have zero gradients, so the local sum is this rank's exact share. Expert
  // shards are distinct across the whole shard group too (ep x efsdp), so one sum covers all.
  mesh_.shard_group->allreduce(norm_sq, ReduceOp::Sum);
}

at::Tensor FullyShardedDataParallel::full_param(int64_t i) {
  at::NoGradGuard ng;
  auto [ui, k] = where_[static_cast<size_t>(i)];
  Unit& u = *units_[static_cast<size_t>(ui)];
  const Param& p = model_.params()[i];
  const int64_t n = u.group->size();
  std::vector<int64_t> padded = u.full_shape[static_cast<size_t>(k)];
  padded[0] = n * u.chunk_rows[static_cast<size_t>(k)];
  at::Tensor recv = at::empty(padded, p.value.options().requires_grad(false));
  u.group->all_gather(recv, p.value.detach().contiguous());
  at::Tensor mine = recv.narrow(0, 0, u.full_shape[static_cast<size_t>(k)][0]);
  if (mesh_.ep == 1 || p.full_shape()[0] == mine.size(0)) return mine;
  // Expert weights: gather the ep ranks' experts too.
  at::Tensor all = at::empty(p.full_shape(), mine.options());
  mesh_.ep_group->all_gather(all, mine.contiguous());
  return all;
}

ProcessGroup& FullyShardedDataParallel::shard_group(int64_t i) const {
  return *units_[static_cast<size_t>(where_[static_cast<size_t>(i)].first)]->group;
}

int64_t local_state_bytes(const Model& model, Optimizer& opt) {
  int64_t b = 0;
  auto bytes = [](const at::Tensor& t) { return static_cast<int64_t>(t.storage().nbytes()); };
  for (auto& p : model.params().all())
    if (!p.value.is_meta()) b += bytes(p.value);  // another pipeline stage's: not here
  return b + opt.state_bytes();
}

int64_t full_state_bytes(const Model& model) {
  int64_t n = 0;
  for (auto& p : model.params().all()) n += numel_of(p.model_shape());
  return 3 * 4 * n;
}

}  // namespace titan
