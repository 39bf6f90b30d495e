#include "core/train/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/accumulate.h>

#include <cmath>

#include "core/base/counter_rng.h"
#include "core/train/capture_check.h"
#include "core/train/float8_linears.h"
#include "core/train/functional.h"
#include "core/kernels/fused_loss.h"
#include "core/kernels/ops.h"

namespace titan {

namespace {
thread_local bool g_defer_params = false;

// A float8 linear's amax all-reduce over the model's tp group (core/kernels/float8_tp.h).
class TpAmaxAllReduce : public float8::AmaxAllReduce {
 public:
  explicit TpAmaxAllReduce(std::shared_ptr<TensorParallelComm> tp) : tp_(std::move(tp)) {}
  void max_(at::Tensor& amax) const override { tp_->allreduce(amax, /*max=*/true); }

 private:
  std::shared_ptr<TensorParallelComm> tp_;
};
}  // namespace

DeferParams::DeferParams(bool on) : prev_(g_defer_params) {
  g_defer_params = on;
}
DeferParams::~DeferParams() {
  g_defer_params = prev_;
}
bool DeferParams::active() {
  return g_defer_params;
}

int64_t ParamStore::add(const std::string& name, std::vector<int64_t> shape, at::Device device,
                        bool weight_decay, InitSpec init, ParamKind kind) {
  TORCH_CHECK(index_of(name) < 0, "duplicate parameter ", name);
  auto opts = at::TensorOptions().dtype(at::kFloat).device(g_defer_params ? at::kMeta : device);
  Param p{name, at::empty(shape, opts).requires_grad_(true), weight_decay, init, kind};
  p.device = device;
  params_.push_back(std::move(p));
  return size() - 1;
}

void ParamStore::assign(int64_t i, const at::Tensor& full) {
  at::NoGradGuard ng;
  Param& p = params_[static_cast<size_t>(i)];
  TORCH_CHECK(full.sizes().vec() == p.model_shape(), "assign: ", p.name, " has another shape");
  TORCH_CHECK(!p.value.is_meta(), "assign: ", p.name, " is not materialized");
  // This tp rank's slice first, then this FSDP rank's rows of it.
  const at::Tensor mine =
      p.tp_dim < 0 ? full : full.narrow(p.tp_dim, p.tp_offset, p.full_shape()[p.tp_dim]);
  if (!p.sharded()) {
    p.value.copy_(mine);
  } else if (p.dim0_rows > 0) {
    p.value.narrow(0, 0, p.dim0_rows).copy_(mine.narrow(0, p.dim0_offset, p.dim0_rows));
  }
}

// Each parameter draws from its own counter-based stream (core/base/counter_rng.h), and only
// the rows this rank holds: the cost per rank is its shard, and the values of a row do not
// depend on the layout. Drawn on the CPU (scalar code, so bit-identical for any shard
// boundary) one parameter at a time, then copied to the parameter's device.
void ParamStore::initialize(uint64_t seed) {
  at::NoGradGuard ng;
  for (Param& p : params_) {
    if (p.value.is_meta()) continue;  // shapes only (titan-train estimate): nothing to draw
    const InitSpec& s = p.init;
    if (s.kind == InitSpec::Kind::Zeros || s.kind == InitSpec::Kind::Ones) {
      // No draws: fill only the valid rows (padding rows of a shard stay zero).
      p.valid(p.value).fill_(s.kind == InitSpec::Kind::Ones ? 1.0 : 0.0);
      continue;
    }
    at::Tensor dst = p.valid(p.value);
    const std::vector<int64_t> full = p.model_shape();
    const int64_t row_numel =
        full.size() <= 1 ? 1 : c10::multiply_integers(full.begin() + 1, full.end());
    const int64_t row0 = (p.sharded() ? p.dim0_offset : 0) + (p.tp_dim == 0 ? p.tp_offset : 0);
    at::Tensor cpu = at::empty(dst.sizes(), at::kFloat);
    const uint64_t key = param_stream_key(seed, p.name);
    auto draw = [&](at::Tensor& out, int64_t first) {
      if (s.kind == InitSpec::Kind::Normal)
        counter_normal_(out, key, first, s.std);
      else
        counter_trunc_normal_(out, key, first, s.std, s.lo, s.hi);
    };
    if (p.tp_dim >= 1) {
      // A slice along dim d >= 1 (FSDP cuts only dim 0): for each index of the dims before
      // d, one contiguous run of the slice's len x inner elements, drawn from the whole
      // tensor's stream at that run's first element.
      const int64_t d = p.tp_dim;
      const int64_t mid = c10::multiply_integers(full.begin() + 1, full.begin() + d);
      const int64_t inner = c10::multiply_integers(full.begin() + d + 1, full.end());
      const int64_t whole = full[static_cast<size_t>(d)];
      at::Tensor runs = cpu.view({-1, cpu.size(d) * inner});  // (rows x mid, len x inner)
      for (int64_t q = 0; q < runs.size(0); ++q) {
        at::Tensor run = at::empty({runs.size(1)}, at::kFloat);
        draw(run, ((row0 * mid + q) * whole + p.tp_offset) * inner);
        runs[q].copy_(run);
      }
    } else {
      draw(cpu, row0 * row_numel);
    }
    dst.copy_(cpu);
  }
}

void ParamStore::materialize() {
  std::vector<int64_t> all(params_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  materialize(all);
}

void ParamStore::materialize(const std::vector<int64_t>& indices) {
  at::NoGradGuard ng;
  for (int64_t i : indices) {
    Param& p = params_[static_cast<size_t>(i)];
    if (p.value.is_meta())
      p.value = at::zeros(p.value.sizes(), p.value.options().device(p.device)).requires_grad_(true);
  }
}

int64_t ParamStore::index_of(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) return static_cast<int64_t>(i);
  return -1;
}

int64_t ParamStore::numel() const {
  int64_t n = 0;
  for (auto& p : params_) n += p.value.numel();
  return n;
}

std::vector<at::Tensor> ParamStore::tensors() const {
  std::vector<at::Tensor> t;
  for (auto& p : params_) t.push_back(p.value);
  return t;
}

void trunc_normal_(at::Tensor& t, double mean, double std, double a, double b, at::Generator& gen) {
  // Sample U in [cdf(a), cdf(b)] and map through the inverse normal CDF.
  auto cdf = [](double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); };
  const double lo = cdf((a - mean) / std), hi = cdf((b - mean) / std);
  at::NoGradGuard ng;
  t.uniform_(2 * lo - 1, 2 * hi - 1, gen);
  t.erfinv_();
  t.mul_(std * std::sqrt(2.0)).add_(mean);
  t.clamp_(a, b);
}

void Model::init_weights(uint64_t seed) {
  params_.initialize(seed);
  reset_state();
}

void Model::set_float8(const float8::Options& opts, const std::vector<int64_t>& params) {
  float8_opts_ = opts;
  float8_.assign(static_cast<size_t>(params_.size()), false);
  for (int64_t i : params) float8_.at(static_cast<size_t>(i)) = true;
}

std::vector<int64_t> Model::float8_params() const {
  std::vector<int64_t> r;
  for (size_t i = 0; i < float8_.size(); ++i)
    if (float8_[i]) r.push_back(static_cast<int64_t>(i));
  return r;
}

at::Tensor Model::weight(int64_t i) const {
  at::Tensor w = compute_weight(i);
  if (float8_.empty() || !float8_[static_cast<size_t>(i)]) return w;
  mark_float8_weight(w, float8_opts_);
  // A tp slice (column: dim 0, row: dim 1) scales as the whole weight (torchao's
  // Float8ColwiseParallel / Float8RowwiseParallel): its amaxes are all-reduced over tp.
  const int64_t d = params_[i].tp_dim;
  if (tp_ && d >= 0)
    mark_float8_tp(w, {d == 0 ? float8::TpSplit::Column : float8::TpSplit::Row,
                       c10::make_intrusive<TpAmaxAllReduce>(tp_)});
  return w;
}

at::Tensor Model::compute_weight(int64_t i) const {
  if (weight_fn_) return weight_fn_(i);
  const at::Tensor& p = params_[i].value;
  if (p.scalar_type() == compute_dtype_) return p;
  if (!at::GradMode::is_enabled()) return p.to(compute_dtype_);
  // One cast per optimizer step, not per micro-batch: the cast is kept until the optimizer
  // steps (weights_updated()) or the master is written otherwise (its version counter: a
  // load, an in-place op). Every micro-batch's backward flows through the same cast node (it
  // saves no tensor, so that is allowed) into the master's gradient.
  if (cast_cache_.size() < static_cast<size_t>(params_.size()))
    cast_cache_.resize(static_cast<size_t>(params_.size()));
  auto& c = cast_cache_[static_cast<size_t>(i)];
  if (!c.master.is_same(p) || c.version != p._version() || c.generation != weights_generation_ ||
      c.cast.scalar_type() != compute_dtype_) {
    c.cast = p.to(compute_dtype_);
    c.master = p;
    c.version = p._version();
    c.generation = weights_generation_;
  }
  return c.cast;
}

void Model::set_documents(const DocumentOptions& o) {
  TORCH_CHECK(!o.active() || o.eos_id >= 0, "set_documents: documents need the EOS id");
  docs_ = o;
}

std::optional<Documents> Model::documents_of(const at::Tensor& tokens) const {
  if (docs_.mask != AttnMask::BlockCausal && !docs_.positions) return std::nullopt;
  TORCH_CHECK(tokens.defined(), "the model uses documents: a forward needs the tokens");
  return documents_from_tokens(tokens, docs_.eos_id, docs_.mask == AttnMask::BlockCausal,
                               docs_.positions);
}

at::Tensor Model::document_labels(const at::Tensor& tokens, const at::Tensor& labels) const {
  if (!docs_.loss) return labels;
  TORCH_CHECK(tokens.defined(), "per-document loss needs the tokens beside the labels");
  return labels.masked_fill(tokens.eq(docs_.eos_id), -100);
}

at::Tensor Model::forward(const at::Tensor& tokens) {
  // The documents are those of the whole sequences, before context parallelism cuts them:
  // the masks compare global positions.
  const std::optional<Documents> docs = documents_of(tokens);
  DocumentsScope doc_scope(docs ? &*docs : nullptr);
  Head o = forward_head(cp_ ? cp_->shard(tokens) : tokens);
  at::Tensor logits = tp_ ? tp_->gather_last(at::linear(seq_gather(o.h), o.w))  // vocab joined
                          : at::linear(o.h, o.w);                               // (B, T, V)
  return cp_ ? cp_->unshard(logits) : logits;
}

Model::Head Model::forward_head(const at::Tensor& tokens) {
  begin_forward();
  return forward_final(run_blocks(forward_embed(tokens)));
}

at::Tensor Model::forward_stage(const at::Tensor& input, bool embed, int64_t first_block,
                                int64_t end_block, const at::Tensor& tokens) {
  TORCH_CHECK(0 <= first_block && first_block <= end_block && end_block <= num_blocks(),
              "forward_stage: blocks [", first_block, ", ", end_block, ") of ", num_blocks());
  // Every stage computes the documents from the micro-batch's tokens (a few device ops)
  // rather than receiving them: the pipeline sends only hidden states.
  const std::optional<Documents> docs = documents_of(embed ? input : tokens);
  DocumentsScope doc_scope(docs ? &*docs : nullptr);
  begin_forward();
  if (!embed) return run_blocks(input, first_block, end_block);
  return run_blocks(forward_embed(cp_ ? cp_->shard(input) : input), first_block, end_block);
}

at::Tensor Model::head_loss_sum(const at::Tensor& h, const at::Tensor& labels,
                                const at::Tensor& tokens) {
  const at::Tensor l = document_labels(tokens, labels);
  return loss_sum_of(forward_final(h), cp_ ? cp_->shard(l) : l);
}

at::Tensor Model::token_loss_sum(const at::Tensor& tokens, const at::Tensor& labels) {
  // Context parallel: this rank's tokens and their labels, the same cut (as forward_stage
  // and head_loss_sum cut a pipeline's).
  const std::optional<Documents> docs = documents_of(tokens);
  DocumentsScope doc_scope(docs ? &*docs : nullptr);
  const at::Tensor l = document_labels(tokens, labels);
  if (cp_) return loss_sum_of(forward_head(cp_->shard(tokens)), cp_->shard(l));
  return loss_sum_of(forward_head(tokens), l);
}

at::Tensor Model::loss_sum_of(const Head& o, const at::Tensor& labels) {
  ModuleScope scope("output");
  if (tp_) {
    // The whole sequence against this rank's vocabulary rows; the loss combines the ranks'
    // log-sum-exps, so no rank forms the full logits.
    TensorParallelComm* tp = tp_.get();
    VocabShard shard;
    shard.offset = tp->rank() * o.w.size(0);
    shard.allreduce = [tp](at::Tensor& t, bool max) { tp->allreduce(t, max); };
    return fused_linear_cross_entropy(seq_gather(o.h), o.w, labels, 0, LossBackward::kRecompute,
                                      &shard);
  }
  if (!fused_loss_) return titan::token_loss_sum(at::linear(o.h, o.w), labels);
  return fused_linear_cross_entropy(o.h, o.w, labels);
}

at::Tensor Model::embed(const at::Tensor& table, const at::Tensor& tokens) const {
  if (!tp_) return at::embedding(table, tokens);
  // Rows [offset, offset + V/tp) of the table live here: the other tokens look up zeros,
  // and the sum over the ranks (reduce-scattered along the sequence) is the full lookup.
  const int64_t rows = table.size(0), offset = tp_->rank() * rows;
  at::Tensor local = tokens - offset;
  // bitwise_or, not logical_or: `estimate` runs this on meta tensors; only it has a meta kernel.
  at::Tensor outside = local.lt(0).bitwise_or_(local.ge(rows));
  at::Tensor h = at::embedding(table, local.masked_fill(outside, 0));
  return seq_reduce(h.masked_fill(outside.unsqueeze(-1), 0));
}

std::vector<at::Tensor> TensorParallelComm::gather_seq_project(const at::Tensor& x,
                                                               const std::vector<at::Tensor>& ws) {
  const at::Tensor g = gather_seq(x);  // (B, T, D)
  std::vector<at::Tensor> out;
  for (const at::Tensor& w : ws) out.push_back(project(g, w));
  return out;
}

at::Tensor TensorParallelComm::project_reduce_scatter_seq(const at::Tensor& x,
                                                          const at::Tensor& w) {
  return reduce_scatter_seq(project(x, w));
}

std::vector<at::Tensor> Model::seq_gather_project(const at::Tensor& x,
                                                  const std::vector<at::Tensor>& ws) const {
  if (tp_) return tp_->gather_seq_project(x, ws);
  std::vector<at::Tensor> out;
  for (const at::Tensor& w : ws) out.push_back(project(x, w));
  return out;
}

at::Tensor Model::seq_project_reduce(const at::Tensor& x, const at::Tensor& w) const {
  return tp_ ? tp_->project_reduce_scatter_seq(x, w) : project(x, w);
}

at::Tensor Model::seq_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                             const at::Tensor& w3) const {
  if (!tp_) return swiglu(x, w1, w2, w3);
  // As swiglu(): the w1 and w3 GEMMs, silu(a) * b as one node, then w2.
  std::vector<at::Tensor> ab = tp_->gather_seq_project(x, {w1, w3});
  return tp_->project_reduce_scatter_seq(ops::swiglu_act(ab[0], ab[1]), w2);
}

const char* tp_style_name(TpStyle s) {
  switch (s) {
    case TpStyle::Column:
      return "column";
    case TpStyle::Row:
      return "row";
    case TpStyle::Vocab:
      return "vocab";
    case TpStyle::Replicate:
      return "replicate";
    case TpStyle::ExpertColumn:
      return "expert-column";
    case TpStyle::ExpertRow:
      return "expert-row";
  }
  return "?";
}

void Model::add_block(std::vector<int64_t> params, BlockFn fn) {
  block_params_.push_back(std::move(params));
  // Every run of the block (forward, and its recompute in backward) names its ops
  // "layers.<l>" for the capture check (docs/compile.md).
  const int64_t l = static_cast<int64_t>(block_fns_.size());
  block_fns_.push_back(
      [l, fn = std::move(fn)](const at::Tensor& h, const std::vector<at::Tensor>& w) {
        ModuleScope scope("layers", l);
        return fn(h, w);
      });
}

at::Tensor Model::run_blocks(at::Tensor h, int64_t first, int64_t end) const {
  for (size_t l = static_cast<size_t>(first); l < static_cast<size_t>(end); ++l) {
    std::vector<at::Tensor> w;
    for (int64_t i : block_params_[l]) w.push_back(weight(i));
    const int64_t li = static_cast<int64_t>(l);
    if (op_policy_)
      h = checkpoint_block_ops(block_fns_[l], h, w, *op_policy_);
    else
      h = recompute_block(li) ? checkpoint_block(block_fns_[l], h, w) : block_fns_[l](h, w);
    h = block_done(li, h);
  }
  return h;
}

std::vector<ParamUnit> Model::param_units() const {
  std::vector<int64_t> block_of(static_cast<size_t>(params_.size()), -1);
  int64_t first_block_param = params_.size();
  for (size_t l = 0; l < block_params_.size(); ++l)
    for (int64_t i : block_params_[l]) {
      block_of[static_cast<size_t>(i)] = static_cast<int64_t>(l);
      first_block_param = std::min(first_block_param, i);
    }
  std::vector<ParamUnit> units;
  ParamUnit emb{"tok_embeddings", -1, {}}, head{"head", -1, {}};
  for (int64_t i = 0; i < params_.size(); ++i)
    if (block_of[static_cast<size_t>(i)] < 0)
      (i < first_block_param ? emb : head).params.push_back(i);
  if (!emb.params.empty()) units.push_back(emb);
  for (size_t l = 0; l < block_params_.size(); ++l)
    units.push_back({"layers." + std::to_string(l), static_cast<int64_t>(l), block_params_[l]});
  if (!head.params.empty()) units.push_back(head);
  return units;
}

ModelInfo Model::base_info(const std::string& name, int64_t vocab_size, int64_t max_seq_len,
                           int64_t dim, int64_t n_layers) const {
  ModelInfo info;
  info.name = name;
  info.vocab_size = vocab_size;
  info.max_seq_len = max_seq_len;
  info.dim = dim;
  info.n_layers = n_layers;
  info.n_params = params_.numel();
  info.n_params_embedding = vocab_size * dim;
  return info;
}

}  // namespace titan
