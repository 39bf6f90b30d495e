#include "core/train/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <optional>

#include "core/kernels/weight_grad_store.h"
#include "core/train/documents.h"
#include "core/train/float8_linears.h"

namespace titan {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

thread_local int g_recompute_depth = 0;
std::atomic<int64_t> g_replays{0};

struct RecomputeScope {
  RecomputeScope() { ++g_recompute_depth; }
  ~RecomputeScope() { --g_recompute_depth; }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

// A zero-bubble I deferred the rerun's weight GEMMs (core/kernels/weight_grad_store.h) with
// the detached copies of the block's weights as their weights: each record is pointed at the
// weight as the block received it (saved[i], whose history leads to the parameter). A record
// on another tensor (a weight the block transformed before its GEMM) is computed now and
// differentiated back to the copies through the retained graph, into `out`.
void retarget_deferred(WeightGradStore& store, size_t first, const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& saved, const std::vector<at::Tensor>& need,
                       const std::vector<size_t>& where, variable_list& out) {
  std::vector<at::Tensor> roots, dws;
  for (auto& [w, gemm] : store.take_from(first)) {
    size_t i = 1;
    while (i < inputs.size() && !inputs[i].is_same(w)) ++i;
    if (i < inputs.size()) {
      store.add(saved[i], std::move(gemm));
    } else {
      at::NoGradGuard no_grad;
      roots.push_back(w);
      dws.push_back(gemm());
    }
  }
  if (roots.empty()) return;
  NoWeightGradDeferral now;
  auto g = torch::autograd::grad(roots, need, dws, /*retain_graph=*/false,
                                 /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t j = 0; j < where.size(); ++j)
    if (g[j].defined()) out[where[j]] = out[where[j]].defined() ? out[where[j]] + g[j] : g[j];
}

// Reruns a block with grad on detached copies of its saved inputs [x, w...] and returns the
// gradients of those inputs (undefined where an input needs none).
variable_list rerun_and_grad(
    const std::function<at::Tensor(const at::Tensor&, const std::vector<at::Tensor>&)>& run,
    const std::vector<at::Tensor>& saved, size_t n_inputs, const at::Tensor& grad_y) {
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < n_inputs; ++i) {
    inputs.push_back(saved[i].detach().requires_grad_(saved[i].requires_grad()));
    if (i > 0) copy_float8_mark(saved[i], inputs[i]);  // a float8 linear's weight stays one
  }
  std::vector<at::Tensor> w(inputs.begin() + 1, inputs.end());
  at::Tensor y;
  {
    at::AutoGradMode grad(true);
    RecomputeScope scope;
    y = run(inputs[0], w);
  }
  std::vector<at::Tensor> need;
  std::vector<size_t> where;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].requires_grad()) need.push_back(inputs[i]), where.push_back(i);
  WeightGradStore* store = weight_grad_deferral();  // a zero-bubble I (see below)
  const size_t first = store ? store->size() : 0;
  auto grads = torch::autograd::grad({y}, need, {grad_y}, /*retain_graph=*/store != nullptr,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  variable_list out(inputs.size());
  for (size_t j = 0; j < where.size(); ++j) out[where[j]] = grads[j];
  if (store) retarget_deferred(*store, first, inputs, saved, need, where, out);
  return out;
}

// The forward's documents (core/train/documents.h) go with the checkpointed block, so its
// recompute in backward sees the same mask and positions even when another micro-batch's
// forward has run since (pipeline schedules) or backward runs on another thread.
void save_documents(AutogradContext* ctx) {
  const Documents* d = current_documents();
  if (d == nullptr) return;
  ctx->saved_data["doc_ids"] = d->doc_ids;
  ctx->saved_data["doc_positions"] = d->positions;
  ctx->saved_data["doc_block_causal"] = d->block_causal;
}

std::optional<Documents> saved_documents(AutogradContext* ctx) {
  if (ctx->saved_data.find("doc_ids") == ctx->saved_data.end()) return std::nullopt;
  Documents d;
  d.doc_ids = ctx->saved_data["doc_ids"].toTensor();
  d.positions = ctx->saved_data["doc_positions"].toTensor();
  d.block_causal = ctx->saved_data["doc_block_causal"].toBool();
  return d;
}

struct CheckpointBlock : public torch::autograd::Function<CheckpointBlock> {
  static variable_list forward(AutogradContext* ctx, int64_t fn_ptr, const at::Tensor& x,
                               at::TensorList weights) {
    ctx->saved_data["fn"] = fn_ptr;
    save_documents(ctx);
    std::vector<at::Tensor> to_save{x};
    to_save.insert(to_save.end(), weights.begin(), weights.end());
    ctx->save_for_backward(to_save);
    const auto& fn = *reinterpret_cast<const BlockFn*>(fn_ptr);
    at::NoGradGuard no_grad;
    return {fn(x, weights.vec())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto& fn = *reinterpret_cast<const BlockFn*>(ctx->saved_data["fn"].toInt());
    auto saved = ctx->get_saved_variables();
    const std::optional<Documents> docs = saved_documents(ctx);
    DocumentsScope doc_scope(docs ? &*docs : nullptr);
    variable_list g = rerun_and_grad(fn, saved, saved.size(), grad_out[0]);
    g.insert(g.begin(), at::Tensor());  // fn_ptr
    return g;
  }
};

// ---- Op-level checkpointing: the tape ----

enum EntryKind : int64_t { kLinear = 0, kAttnCpuFlash = 1, kAttnRecomputed = 2, kSavedOp = 3 };

// What one block's no-grad forward saved, in call order: a kind per taped call and the
// tensors of the calls that saved something.
struct OpTape {
  bool replay = false;
  const OpCheckpointPolicy* policy = nullptr;
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> kinds;
  size_t next_tensor = 0, next_kind = 0;
  int64_t mm_count = 0;  // GEMMs seen in this run of the block (torchtitan's mm_count)

  void push(EntryKind k, std::initializer_list<at::Tensor> ts) {
    kinds.push_back(k);
    tensors.insert(tensors.end(), ts);
  }
  int64_t pop_kind() {
    TORCH_CHECK(next_kind < kinds.size(),
                "op-level checkpointing: the recomputed block made more taped calls than its "
                "forward (the block must run the same ops each time)");
    return kinds[next_kind++];
  }
  std::vector<at::Tensor> take(size_t n) {
    TORCH_CHECK(next_tensor + n <= tensors.size(), "op-level checkpointing: tape underflow");
    std::vector<at::Tensor> out(tensors.begin() + static_cast<int64_t>(next_tensor),
                                tensors.begin() + static_cast<int64_t>(next_tensor + n));
    next_tensor += n;
    return out;
  }
};

thread_local OpTape* g_tape = nullptr;

struct TapeScope {
  OpTape* prev;
  explicit TapeScope(OpTape* t) : prev(g_tape) { g_tape = t; }
  ~TapeScope() { g_tape = prev; }
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;
};

// y = x w^T whose forward hands back the recorded y. Its backward is what autograd does for
// at::linear without bias (x folded to 2-D, one mm each for dx and dw), so the gradients
// are the same bits.
struct TapedLinear : public torch::autograd::Function<TapedLinear> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                               const at::Tensor& y) {
    ctx->save_for_backward({x, w});
    return {y.detach()};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1];
    at::Tensor g = grad_out[0].reshape({-1, w.size(0)});
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = g.mm(w).view(x.sizes());
    if (ctx->needs_input_grad(1)) {
      const at::Tensor x2 = x.reshape({-1, x.size(-1)});
      if (WeightGradStore* store = weight_grad_deferral())  // a zero-bubble I: W runs it
        store->add(w, [g, x2] { return g.t().mm(x2); });
      else
        dw = g.t().mm(x2);
    }
    return {dx, dw, at::Tensor()};
  }
};

// Causal attention whose forward hands back the recorded output of the CPU flash kernel;
// its backward is that kernel's backward, fed the recorded output and logsumexp.
struct TapedCpuFlash : public torch::autograd::Function<TapedCpuFlash> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                               double scale) {
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = scale;
    return {out.detach()};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto s = ctx->get_saved_variables();
    auto g = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out[0], s[0], s[1], s[2], s[3], s[4], /*dropout_p=*/0.0, /*is_causal=*/true,
        /*attn_mask=*/{}, ctx->saved_data["scale"].toDouble());
    return {std::get<0>(g), std::get<1>(g), std::get<2>(g),
            at::Tensor(),   at::Tensor(),   at::Tensor()};
  }
};

bool force_recompute(const OpTape& t, const at::Tensor& w) {
  for (const auto& shape : t.policy->force_recompute_shapes)
    if (w.sizes() == at::IntArrayRef(shape)) return true;
  return false;
}

at::Tensor plain_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      bool gqa) {
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, scale, gqa);
}

// The attention that can be saved: what scaled_dot_product_attention would run, when that
// is the CPU flash kernel (1 = SDPBackend::flash_attention). Everything else is recomputed.
// The CPU flash kernel and its backward read grouped kv heads in place (GQA), the same
// arithmetic as SDPA with enable_gqa.
bool cpu_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
               bool gqa) {
  // Meta tensors (titan-train estimate) take the flash path wherever its shapes allow.
  if (q.is_meta()) return q.size(-1) == v.size(-1);
  return q.device().is_cpu() && at::_fused_sdp_choice(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                      /*is_causal=*/true, scale, gqa) == 1;
}

struct CheckpointBlockOps : public torch::autograd::Function<CheckpointBlockOps> {
  static variable_list forward(AutogradContext* ctx, int64_t fn_ptr, int64_t policy_ptr,
                               const at::Tensor& x, at::TensorList weights) {
    const auto& fn = *reinterpret_cast<const BlockFn*>(fn_ptr);
    OpTape tape;
    tape.policy = reinterpret_cast<const OpCheckpointPolicy*>(policy_ptr);
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      TapeScope scope(&tape);
      y = fn(x, weights.vec());
    }
    std::vector<at::Tensor> to_save{x};
    to_save.insert(to_save.end(), weights.begin(), weights.end());
    to_save.insert(to_save.end(), tape.tensors.begin(), tape.tensors.end());
    ctx->save_for_backward(to_save);
    ctx->saved_data["fn"] = fn_ptr;
    ctx->saved_data["policy"] = policy_ptr;
    ctx->saved_data["n_inputs"] = static_cast<int64_t>(1 + weights.size());
    ctx->saved_data["kinds"] = tape.kinds;
    save_documents(ctx);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto& fn = *reinterpret_cast<const BlockFn*>(ctx->saved_data["fn"].toInt());
    auto saved = ctx->get_saved_variables();
    const auto n_inputs = static_cast<size_t>(ctx->saved_data["n_inputs"].toInt());
    OpTape tape;
    tape.replay = true;
    tape.policy = reinterpret_cast<const OpCheckpointPolicy*>(ctx->saved_data["policy"].toInt());
    tape.tensors.assign(saved.begin() + static_cast<int64_t>(n_inputs), saved.end());
    tape.kinds = ctx->saved_data["kinds"].toIntVector();
    const std::optional<Documents> docs = saved_documents(ctx);
    DocumentsScope doc_scope(docs ? &*docs : nullptr);
    auto run = [&](const at::Tensor& x, const std::vector<at::Tensor>& w) {
      TapeScope scope(&tape);
      return fn(x, w);
    };
    variable_list g = rerun_and_grad(run, saved, n_inputs, grad_out[0]);
    TORCH_CHECK(tape.next_kind == tape.kinds.size() && tape.next_tensor == tape.tensors.size(),
                "op-level checkpointing: the recomputed block made fewer taped calls than its "
                "forward");
    g.insert(g.begin(), {at::Tensor(), at::Tensor()});  // fn_ptr, policy_ptr
    return g;
  }
};

}  // namespace

at::Tensor checkpoint_block(const BlockFn& fn, const at::Tensor& x,
                            const std::vector<at::Tensor>& weights) {
  if (!at::GradMode::is_enabled()) return fn(x, weights);
  return CheckpointBlock::apply(reinterpret_cast<int64_t>(&fn), x, at::TensorList(weights))[0];
}

at::Tensor checkpoint_block_ops(const BlockFn& fn, const at::Tensor& x,
                                const std::vector<at::Tensor>& weights,
                                const OpCheckpointPolicy& policy) {
  if (!at::GradMode::is_enabled()) return fn(x, weights);
  return CheckpointBlockOps::apply(reinterpret_cast<int64_t>(&fn),
                                   reinterpret_cast<int64_t>(&policy), x,
                                   at::TensorList(weights))[0];
}

bool is_recomputing() {
  return g_recompute_depth > 0;
}

int64_t op_tape_replays() {
  return g_replays.load();
}

bool op_tape_active() {
  return g_tape != nullptr;
}

at::Tensor tape_project(const at::Tensor& x, const at::Tensor& w) {
  OpTape& t = *g_tape;
  // torchtitan's op policy: forced shapes are not counted; of the others, every second GEMM
  // (the 2nd, 4th, ...) is recomputed.
  if (force_recompute(t, w) || ++t.mm_count % 2 == 0)  // in a zero-bubble I: deferrable
    return weight_grad_deferral() ? deferrable_linear(x, w) : at::linear(x, w);
  if (!t.replay) {
    at::Tensor y = at::linear(x, w);
    t.push(kLinear, {y});
    return y;
  }
  TORCH_CHECK(t.pop_kind() == kLinear, "op-level checkpointing: tape out of step at a GEMM");
  ++g_replays;
  return TapedLinear::apply(x, w, t.take(1)[0])[0];
}

at::Tensor tape_causal_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, bool gqa) {
  OpTape& t = *g_tape;
  if (!t.replay) {
    if (!cpu_flash(q, k, v, scale, gqa)) {
      t.push(kAttnRecomputed, {});
      return plain_sdpa(q, k, v, scale, gqa);
    }
    auto r = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, /*dropout_p=*/0.0,
                                                             /*is_causal=*/true, {}, scale);
    t.push(kAttnCpuFlash, {std::get<0>(r), std::get<1>(r)});
    return std::get<0>(r);
  }
  const int64_t kind = t.pop_kind();
  TORCH_CHECK(kind == kAttnCpuFlash || kind == kAttnRecomputed,
              "op-level checkpointing: tape out of step at an attention");
  if (kind == kAttnRecomputed) return plain_sdpa(q, k, v, scale, gqa);
  auto s = t.take(2);
  // With grad on, PyTorch could pick another kernel than the no-grad forward did; then the
  // saved output is dropped and attention is recomputed the way the original forward ran.
  if (!cpu_flash(q, k, v, scale, gqa)) return plain_sdpa(q, k, v, scale, gqa);
  ++g_replays;
  return TapedCpuFlash::apply(q, k, v, s[0], s[1], scale)[0];
}

bool op_tape_recording() {
  return g_tape != nullptr && !g_tape->replay;
}

bool op_tape_replaying() {
  return g_tape != nullptr && g_tape->replay;
}

void op_tape_save(const std::vector<at::Tensor>& outputs) {
  TORCH_CHECK(op_tape_recording(), "op_tape_save: no tape is recording");
  g_tape->kinds.push_back(kSavedOp);
  g_tape->kinds.push_back(static_cast<int64_t>(outputs.size()));
  g_tape->tensors.insert(g_tape->tensors.end(), outputs.begin(), outputs.end());
}

std::vector<at::Tensor> op_tape_restore(size_t n) {
  TORCH_CHECK(op_tape_replaying(), "op_tape_restore: no tape is replaying");
  OpTape& t = *g_tape;
  TORCH_CHECK(t.pop_kind() == kSavedOp && t.pop_kind() == static_cast<int64_t>(n),
              "op-level checkpointing: tape out of step at a saved op");
  ++g_replays;
  return t.take(n);
}

}  // namespace titan
