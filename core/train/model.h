// The model interface the trainer drives, and the parameter store every model owns.
//
// Parameters live in a flat, named ParamStore (fp32 master copies). Model code never holds
// a weight directly: it asks `weight(i)` for the compute form of parameter i. That one call
// is where mixed precision (a differentiable cast to bf16) and, under FSDP, the all-gather of
// a sharded parameter happen, so parallelism and precision change how a full weight is
// materialized, not the model code (docs/design.md).
//
// This interface is what parallel/ sees of a model: the parameters with their kind (dense or
// expert), the units they are gathered in (embeddings, one per block, head), and the hooks
// FSDP installs. parallel/ never parses parameter names.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/kernels/float8_linear.h"
#include "core/train/context_parallel.h"
#include "core/train/documents.h"
#include "core/train/expert_exchange.h"
#include "core/train/recompute.h"
#include "core/train/tensor_parallel.h"

namespace titan {

// How a parameter is initialized (torchtitan's schemes). Normal draws are N(0, std); the
// truncated normal is clipped to the absolute bounds [lo, hi] (torch.nn.init.trunc_normal_).
struct InitSpec {
  enum class Kind { Zeros, Ones, Normal, TruncNormal };
  Kind kind = Kind::Zeros;
  double std = 0, lo = -2.0, hi = 2.0;
  static InitSpec zeros() { return {Kind::Zeros}; }
  static InitSpec ones() { return {Kind::Ones}; }
  static InitSpec normal(double std) { return {Kind::Normal, std}; }
  static InitSpec trunc_normal(double std, double lo = -2.0, double hi = 2.0) {
    return {Kind::TruncNormal, std, lo, hi};
  }
};

// Dense parameters are replicated or sharded over the data-parallel ranks; expert
// parameters have the routed experts on dim 0, which expert parallelism splits first.
enum class ParamKind { Dense, Expert };

struct Param {
  std::string name;   // torchtitan's fully qualified name, e.g. "layers.0.attention.wq.weight"
  at::Tensor value;   // fp32 master copy, requires_grad (meta while deferred, see DeferParams)
  bool weight_decay;  // matrices decay; norms, embeddings and biases do not
  InitSpec init;
  ParamKind kind = ParamKind::Dense;
  at::Device device = at::kCPU;  // where the value lives (or will, once materialized)
  // Sharding (parallel/fsdp.h). Unsharded: global_shape is empty and value is the whole
  // tensor. Sharded: value holds global rows [dim0_offset, dim0_offset + dim0_rows) of a
  // tensor of global_shape, followed by zero padding rows that are never saved.
  std::vector<int64_t> global_shape;
  int64_t dim0_offset = 0;
  int64_t dim0_rows = -1;
  // Tensor parallelism (parallel/tensor_parallel.h), applied before FSDP: the parameter is
  // this tp rank's slice [tp_offset, + its size) along tp_dim of a tensor of tp_shape, and
  // everything above (FSDP's global_shape, full_shape()) speaks of that slice. tp_dim -1:
  // not split.
  int64_t tp_dim = -1;
  int64_t tp_offset = 0;
  std::vector<int64_t> tp_shape;
  bool sharded() const { return !global_shape.empty(); }
  bool expert() const { return kind == ParamKind::Expert; }
  // The rows of value that hold real data (all of it when unsharded).
  at::Tensor valid(const at::Tensor& t) const { return sharded() ? t.narrow(0, 0, dim0_rows) : t; }
  std::vector<int64_t> full_shape() const { return sharded() ? global_shape : value.sizes().vec(); }
  // The whole model tensor's shape, before tensor and data parallelism cut it.
  std::vector<int64_t> model_shape() const { return tp_dim >= 0 ? tp_shape : full_shape(); }
};

// While alive on this thread, ParamStore::add leaves parameters unallocated (meta tensors,
// Param::device says where they belong), so a sharding step can allocate only its rows
// before init_weights runs (parallel/fsdp.h).
class DeferParams {
 public:
  explicit DeferParams(bool on);
  ~DeferParams();
  static bool active();

 private:
  bool prev_;
};

class ParamStore {
 public:
  // Registers a parameter of `shape` (fp32 on `device`) and returns its index. Its name
  // keys its initialization stream (ParamStore::initialize).
  int64_t add(const std::string& name, std::vector<int64_t> shape, at::Device device,
              bool weight_decay, InitSpec init, ParamKind kind = ParamKind::Dense);
  const std::vector<Param>& all() const { return params_; }
  std::vector<Param>& all() { return params_; }
  const Param& operator[](int64_t i) const { return params_[static_cast<size_t>(i)]; }
  int64_t size() const { return static_cast<int64_t>(params_.size()); }
  int64_t index_of(const std::string& name) const;  // -1 when absent
  // Writes a whole-tensor value (model_shape()) into parameter i: all of it, or only this
  // rank's slice when the parameter is split (tensor parallel) or sharded (FSDP).
  void assign(int64_t i, const at::Tensor& full);
  // Draws this rank's rows of every parameter from its InitSpec on the stream keyed by (seed,
  // name) (core/base/counter_rng.h): bit-identical values for every device, rank and layout.
  void initialize(uint64_t seed);
  // Allocates every still-deferred (meta) parameter, zero-filled, on its device.
  void materialize();
  // Only parameters `indices` (a pipeline rank's stages); the others stay meta.
  void materialize(const std::vector<int64_t>& indices);
  int64_t numel() const;
  std::vector<at::Tensor> tensors() const;

 private:
  std::vector<Param> params_;
};

// In-place truncated normal on a CPU fp32 tensor: N(mean, std) clipped to [a, b] by
// inverse-CDF sampling from `gen`.
void trunc_normal_(at::Tensor& t, double mean, double std, double a, double b, at::Generator& gen);

// How a full weight is materialized for compute. The default returns the parameter, cast
// to the compute dtype when that differs (the cast is recorded by autograd, so gradients
// reach the fp32 master copy).
using WeightFn = std::function<at::Tensor(int64_t index)>;

// Parameters gathered and reduced together by FSDP, in forward order: the embeddings, one
// unit per transformer block, then the head (final norm and output).
struct ParamUnit {
  std::string name;    // "tok_embeddings", "layers.<l>", "head"
  int64_t block = -1;  // the transformer block, or -1 for the embeddings and the head
  std::vector<int64_t> params;
};

struct ModelInfo {
  std::string name;  // "llama3", ...
  std::string flavor;
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  int64_t dim = 0;
  int64_t n_layers = 0;
  int64_t n_params = 0;                // every parameter
  int64_t n_params_embedding = 0;      // token embedding table
  int64_t n_active_non_embedding = 0;  // non-embedding parameters a token touches (MoE: top-k)
  int64_t attn_flops_dims = 0;         // n_layers * n_heads * (qk_head_dim + v_head_dim)

  // 6 * N_active_non_embedding + 6 * layers * heads * (qk + v head dims) * seq_len.
  int64_t flops_per_token(int64_t seq_len) const {
    return 6 * n_active_non_embedding + 6 * attn_flops_dims * seq_len;
  }
};

class Model {
 public:
  virtual ~Model() = default;

  // tokens: (B, T) int64 -> logits (B, T, vocab) in the compute dtype (under context
  // parallelism every rank returns the whole sequence's logits).
  at::Tensor forward(const at::Tensor& tokens);
  // The training and validation loss: the sum over tokens of the fp32 cross-entropy of the
  // logits against labels (B, T) (label -100 ignored), as a 0-d fp32 tensor. By default the
  // output projection and the loss run fused and chunked over tokens (core/kernels/fused_loss.h),
  // so the (B, T, vocab) logits never exist; the same numbers as
  // titan::token_loss_sum(forward(tokens), labels) to fp32 rounding. Under context
  // parallelism: the sum over this rank's tokens only (the cp ranks' sums add up to it).
  at::Tensor token_loss_sum(const at::Tensor& tokens, const at::Tensor& labels);
  // Pipeline stages (parallel/pipeline_runner.h): the same forward cut at block boundaries.
  // With `embed`, `input` is the tokens (B, T) and the embeddings run first; otherwise it is
  // the previous stage's hidden state (B, T, D) in the compute dtype. Then blocks
  // [first_block, end_block) run, as forward would run them; returns their hidden state.
  // Under context parallelism the tokens are whole sequences, cut here as token_loss_sum
  // cuts them, and a hidden state is this rank's (B, T/cp[/tp], D).
  // `tokens`: the micro-batch's tokens (B, T), which a stage without the embeddings needs
  // when the model uses documents (set_documents): every stage computes the document ids
  // from them (docs/attention.md). Ignored with `embed` (input is the tokens).
  at::Tensor forward_stage(const at::Tensor& input, bool embed, int64_t first_block,
                           int64_t end_block, const at::Tensor& tokens = at::Tensor());
  // The last stage's end: the final norm of the hidden state h, then the summed token loss
  // exactly as token_loss_sum computes it from there. Labels are whole sequences (B, T); under
  // context parallelism the sum is over this rank's tokens only.
  // `tokens` (B, T): needed with per-document loss (DocumentOptions::loss).
  at::Tensor head_loss_sum(const at::Tensor& h, const at::Tensor& labels,
                           const at::Tensor& tokens = at::Tensor());
  int64_t num_blocks() const { return static_cast<int64_t>(block_fns_.size()); }
  // false: token_loss_sum materializes the logits (the reference path, for tests/benchmarks).
  void set_fused_loss(bool on) { fused_loss_ = on; }
  bool fused_loss() const { return fused_loss_; }
  virtual const ModelInfo& info() const = 0;
  // Re-initializes every parameter from `seed` (torchtitan's scheme, docs/models.md) and
  // resets the training state buffers.
  void init_weights(uint64_t seed);

  // Extra loss terms (e.g. MoE auxiliary balance loss) accumulated by the last forward.
  virtual at::Tensor aux_loss() { return at::Tensor(); }
  // Called once per optimizer step, after the optimizer (MoE expert-bias update).
  virtual void after_optimizer_step() {}
  // Forgets what the step's training forwards accumulated (MoE token counts, dropped rows,
  // values saved for recompute), for a step whose forward+backward is run again (an
  // overflow of the static expert-parallel exchange, docs/moe.md).
  virtual void discard_step_state() {}
  // Named training state that is not a parameter (MoE expert biases, token counts), saved
  // with checkpoints. The tensors are the live ones: loading copies into them.
  virtual std::vector<std::pair<std::string, at::Tensor>> buffers() { return {}; }
  // Extra per-log-step metrics (MoE load statistics). May read device values: it is only
  // called on log steps.
  virtual std::map<std::string, double> extra_metrics() { return {}; }
  // The routed experts' resolved backend ("grouped_mm", "cutlass", "loop"); "" without experts.
  virtual std::string experts_backend() const { return ""; }
  // Routed experts per MoE layer; 0 for a dense model.
  virtual int64_t num_experts() const { return 0; }
  // Expert parallelism: the MoE layers send their routed rows through `ex` (parallel/).
  virtual void set_expert_exchange(std::shared_ptr<ExpertExchange> ex) { (void)ex; }
  // Expert tensor parallelism (parallel/tensor_parallel.h): the routed experts are cut along
  // their hidden size over `tp`'s ranks; MoE models then run the whole sequence through their
  // slices. Default: no MoE layers, nothing to do.
  virtual void set_expert_tensor_parallel(std::shared_ptr<TensorParallelComm> tp) { (void)tp; }

  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  // The FSDP units, in forward order (the embeddings unit holds the parameters registered
  // before the first block, the head those after the last).
  std::vector<ParamUnit> param_units() const;

  void set_weight_fn(WeightFn fn) { weight_fn_ = std::move(fn); }
  // Called with each transformer block's output right after the block's forward (FSDP
  // frees the block's gathered weights there). Default: identity.
  void set_block_done_fn(std::function<at::Tensor(int64_t block, const at::Tensor& out)> fn) {
    block_done_ = std::move(fn);
  }
  void set_compute_dtype(at::ScalarType t) { compute_dtype_ = t; }
  // Float8 training (docs/float8.md): the linears whose weights are store indices `params`
  // compute their GEMMs with float8_linear and `opts` (weight() marks their compute form).
  void set_float8(const float8::Options& opts, const std::vector<int64_t>& params);
  int64_t float8_linears() const {
    return static_cast<int64_t>(std::count(float8_.begin(), float8_.end(), true));
  }
  // The store indices set_float8 converted, ascending.
  std::vector<int64_t> float8_params() const;
  // The optimizer has updated the fp32 masters in place. at::_fused_adamw_ does not bump the
  // version counters of the tensors it writes, so without this the compute-dtype casts
  // weight() keeps would go stale and every forward would see the first step's weights.
  // train_step calls it after each optimizer step.
  void weights_updated() { ++weights_generation_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // Activation checkpointing: recompute block i in backward when recompute_block(i).
  void set_recompute_policy(std::function<bool(int64_t)> p) { recompute_ = std::move(p); }
  // Op-level selective checkpointing of every block (core/train/recompute.h); replaces the
  // block policy above.
  void set_op_checkpointing(const OpCheckpointPolicy& p) {
    op_policy_ = std::make_unique<OpCheckpointPolicy>(p);
  }
  // Sums a tensor over the data-parallel ranks in place (MoE token counts). Default: one rank.
  void set_dp_allreduce(std::function<void(at::Tensor&)> fn) { dp_allreduce_ = std::move(fn); }

  // The tensor-parallel plan the model declares (core/train/tensor_parallel.h); an
  // undeclared plan (declared() false) means the model does not support tensor parallelism.
  const TpPlan& tp_plan() const { return tp_plan_; }
  void set_tp_plan(TpPlan p) { tp_plan_ = std::move(p); }
  // Installed by parallel/ after it cut the parameters by the plan; null: one tp rank.
  void set_tensor_parallel(std::shared_ptr<TensorParallelComm> tp) { tp_ = std::move(tp); }
  TensorParallelComm* tensor_parallel() const { return tp_.get(); }
  // Sequence-parallel boundaries, identities without tensor parallelism. seq_gather: before
  // a column-parallel input, the sequence shards (B, T/tp, D) become the whole (B, T, D).
  // seq_reduce: after a row-parallel output, the partial sums (B, T, D) become this rank's
  // sequence shard of their sum.
  at::Tensor seq_gather(const at::Tensor& x) const { return tp_ ? tp_->gather_seq(x) : x; }
  at::Tensor seq_reduce(const at::Tensor& x) const { return tp_ ? tp_->reduce_scatter_seq(x) : x; }
  // The same boundaries with the GEMMs beside them (TensorParallelComm::gather_seq_project,
  // project_reduce_scatter_seq; async tensor parallelism overlaps them): project(seq_gather(x),
  // w) for each w, and seq_reduce(project(x, w)). seq_swiglu: the feed-forward between them,
  // seq_reduce(swiglu(seq_gather(x), w1, w2, w3)).
  std::vector<at::Tensor> seq_gather_project(const at::Tensor& x,
                                             const std::vector<at::Tensor>& ws) const;
  at::Tensor seq_project_reduce(const at::Tensor& x, const at::Tensor& w) const;
  at::Tensor seq_swiglu(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                        const at::Tensor& w3) const;
  // Packed documents (core/train/documents.h, docs/attention.md): the attention mask, and
  // per-document RoPE positions and loss. Every forward computes the documents of its
  // whole sequences from the tokens (EOS ends a document) and installs them for the blocks.
  void set_documents(const DocumentOptions& o);
  const DocumentOptions& documents() const { return docs_; }
  // Context parallelism (core/train/context_parallel.h), installed by parallel/; null: one
  // cp rank. forward and token_loss_sum then take whole sequences and run this rank's tokens;
  // the families read global positions and gather keys and values through it.
  void set_context_parallel(std::shared_ptr<ContextParallel> cp) { cp_ = std::move(cp); }
  const ContextParallel* context_parallel() const { return cp_.get(); }

 protected:
  // What forward computes before the output projection: the final normed hidden state
  // h (B, T, D) and the output weight W (V, D) (the embedding table when tied), both in
  // compute form. The logits are h W^T.
  struct Head {
    at::Tensor h, w;
  };
  // The forward in the three parts every family has: the embeddings (B, T) -> (B, T, D),
  // the blocks (run_blocks), then the final norm with the output weight (forward_final).
  // begin_forward runs first in every forward, whole or a pipeline stage's.
  virtual void begin_forward() {}
  virtual at::Tensor forward_embed(const at::Tensor& tokens) = 0;
  virtual Head forward_final(const at::Tensor& h) = 0;
  Head forward_head(const at::Tensor& tokens);
  // The documents of whole sequences `tokens` (B, T) when the mask or the positions need
  // them; nullopt otherwise.
  std::optional<Documents> documents_of(const at::Tensor& tokens) const;
  // labels with per-document loss: an EOS input's label (the next document's first token)
  // is ignored (-100). Unchanged otherwise.
  at::Tensor document_labels(const at::Tensor& tokens, const at::Tensor& labels) const;
  // The output projection and the summed token loss of forward_final's result.
  at::Tensor loss_sum_of(const Head& o, const at::Tensor& labels);
  // Zeroes the training-state buffers (MoE expert biases and counts).
  virtual void reset_state() {}
  at::Tensor weight(int64_t i) const;
  // The token embedding lookup; under tensor parallelism the table holds this rank's
  // vocabulary rows and the result is this rank's sequence shard of the summed lookups.
  at::Tensor embed(const at::Tensor& table, const at::Tensor& tokens) const;
  bool recompute_block(int64_t i) const { return op_policy_ || (recompute_ && recompute_(i)); }
  at::Tensor block_done(int64_t i, const at::Tensor& out) const {
    return block_done_ ? block_done_(i, out) : out;
  }
  // Registers the next transformer block: the store indices of its weights, in the order
  // `fn` takes their compute forms.
  void add_block(std::vector<int64_t> params, BlockFn fn);
  // Runs the blocks in order on h, the same way for every family: each block's weights are
  // materialized with weight(), the block is recomputed in backward when the activation
  // checkpointing policy says so, and block_done() sees its output.
  at::Tensor run_blocks(at::Tensor h) const { return run_blocks(std::move(h), 0, num_blocks()); }
  at::Tensor run_blocks(at::Tensor h, int64_t first, int64_t end) const;
  // The ModelInfo fields every family fills the same way (the parameter counts come from
  // the store); the family adds n_active_non_embedding and attn_flops_dims.
  ModelInfo base_info(const std::string& name, int64_t vocab_size, int64_t max_seq_len, int64_t dim,
                      int64_t n_layers) const;

  ParamStore params_;
  WeightFn weight_fn_;
  at::ScalarType compute_dtype_ = at::kFloat;
  std::function<bool(int64_t)> recompute_;
  std::function<void(at::Tensor&)> dp_allreduce_;
  std::function<at::Tensor(int64_t, const at::Tensor&)> block_done_;
  bool fused_loss_ = true;
  TpPlan tp_plan_;
  std::shared_ptr<TensorParallelComm> tp_;
  std::shared_ptr<ContextParallel> cp_;
  DocumentOptions docs_;
  // weight()'s compute-dtype casts without a weight_fn, reused while the master is unchanged.
  struct CachedCast {
    at::Tensor cast, master;  // master: the parameter tensor it was cast from
    int64_t version = -1;     // the master's version counter then (in-place writes, loads)
    uint64_t generation = 0;  // weights_generation_ then (optimizer steps)
  };
  mutable std::vector<CachedCast> cast_cache_;
  uint64_t weights_generation_ = 1;
  std::vector<bool> float8_;  // by store index; empty: no float8
  float8::Options float8_opts_;

 private:
  at::Tensor compute_weight(int64_t i) const;  // weight() before the float8 mark
  std::vector<std::vector<int64_t>> block_params_;
  std::vector<BlockFn> block_fns_;  // must outlive backward (checkpoint_block keeps &fn)
  std::unique_ptr<OpCheckpointPolicy> op_policy_;  // likewise kept by address in backward
};

}  // namespace titan
