// One Mixture-of-Experts feed-forward layer: router, dispatch, routed experts, shared
// experts, and the layer's load-balancing state (aux-loss-free expert bias, token counts,
// the optional sequence-wise auxiliary loss). Parameter and buffer names are torchtitan's:
// <prefix>router.gate.weight, <prefix>experts.w1/w2/w3, <prefix>shared_experts.w1.weight, ...,
// <prefix>expert_bias, <prefix>tokens_per_expert (docs/moe.md).
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/train/expert_exchange.h"
#include "core/train/model.h"
#include "moe/experts.h"
#include "moe/router.h"

namespace titan {

struct MoEArgs : RouterArgs {
  int64_t num_shared_experts = 1;    // one dense SwiGLU of hidden * num_shared_experts
  bool gate_bias = false;            // router gate with a bias term
  bool score_before_experts = true;  // scale expert inputs (Llama-4) or outputs (DeepSeek)
  double load_balance_coeff = 1e-3;  // expert-bias update speed; 0: off
  double seq_aux_loss_coeff = 0;     // weight of the sequence-wise balance loss; 0: off
  ExpertsBackend backend = ExpertsBackend::Loop;
  // GPT-OSS's routed experts (moe/experts.h ExpertsExtras): a bias on each of w1, w3 (E,
  // hidden) and w2 (E, dim), and the clamped SwiGLU when swiglu_limit > 0. Its init is
  // torchtitan's GptOssGroupedExperts': every expert tensor N(0, init_std) truncated to [-2, 2].
  bool expert_biases = false;
  double swiglu_limit = 0;  // 0: silu(h1) * h3
  double swiglu_alpha = 1.702;
  // model.converters "quantize.grouped_mm.float8": the kernel of the float8 grouped GEMMs and
  // quantize.grouped_mm.float8.fqns; a layer converts its routed experts when an entry is a
  // substring of its "<prefix>experts" (torchtitan's module filter). Unset: no float8.
  std::optional<Float8GroupedKernel> float8;
  std::vector<std::string> float8_fqns;
};

// Whether an entry of `entries` is a substring of `fqn` (torchtitan's module filter for
// quantize.grouped_mm.float8.fqns).
bool fqn_matches_any(const std::string& fqn, const std::vector<std::string>& entries);

class MoELayer {
 public:
  // How the model is running this forward.
  struct Mode {
    bool training = false;      // a training forward (grad mode on at the model's entry)
    bool checkpointed = false;  // the block will be recomputed in backward
  };

  // Registers the parameters under `prefix` (e.g. "layers.1.moe.") in `store`, with
  // torchtitan's init: experts.w1 N(0, 0.02), w2/w3 and the gate N(0, init_std), all
  // truncated to [-2, 2]; the shared experts like a dense FFN; the gate bias zero.
  MoELayer(const MoEArgs& args, int64_t dim, int64_t hidden, const std::string& prefix,
           ParamStore& store, at::Device device, double init_std);

  // Store indices of the weights forward() takes, in its order.
  const std::vector<int64_t>& param_indices() const { return params_; }
  // Zeroes the balancing state (expert bias, counts) and drops pending recompute counts.
  void reset_state();

  // x: (B, S, D) -> (B, S, D). w: compute forms of param_indices().
  at::Tensor forward(const at::Tensor& x, const std::vector<at::Tensor>& w, Mode mode);

  // The sequence-wise auxiliary loss of the forwards since the last call (undefined if off).
  at::Tensor take_aux_loss();

  const MoEArgs& args() const { return args_; }
  // Expert parallelism: this layer then holds experts [r*E/P, (r+1)*E/P) of ex's rank r
  // (parallel/fsdp.h shards the expert weights to match) and exchanges its routed rows
  // through `ex`.
  void set_expert_exchange(std::shared_ptr<ExpertExchange> ex) { ep_ = std::move(ex); }
  // Expert tensor parallelism: this layer's routed experts hold hidden rows (w1, w3) and
  // columns (w2) [r*H/tp, (r+1)*H/tp) of tp's rank r. forward() then gathers the sequence
  // shards, routes every token (the same on every tp rank), runs them through its slices
  // and reduce-scatters the partial outputs back to sequence shards; the router and the
  // shared experts are unchanged (whole, gradients summed over tp). The token counts are
  // kept on tp rank 0 only, so their sum over all ranks counts each token once.
  void set_expert_tensor_parallel(std::shared_ptr<TensorParallelComm> tp) { etp_ = std::move(tp); }
  // Store indices of the routed experts' weights.
  int64_t w1_index() const { return w1_; }
  int64_t w2_index() const { return w2_; }
  int64_t w3_index() const { return w3_; }
  // The experts' biases (expert_biases), else -1: b1, b3 (E, hidden) split like w1 and w3
  // under expert tensor parallelism, b2 (E, dim) whole (added on tp rank 0 only).
  int64_t b1_index() const { return b1_; }
  int64_t b2_index() const { return b2_; }
  int64_t b3_index() const { return b3_; }
  int64_t hidden() const { return hidden_; }
  int64_t dim() const { return dim_; }
  const std::string& prefix() const { return prefix_; }
  // The routed experts' grouped GEMMs run in float8 (args.float8 and an fqn matched).
  bool float8_experts() const { return args_.float8.has_value(); }
  // Rows per expert group of the aligned layout: 16 with float8 grouped GEMMs, else the
  // backend's.
  int64_t group_alignment() const;

  // Training state. expert_bias (E) fp32: added to the scores for selection only.
  // tokens_per_expert (E) fp32: routed rows counted by training forwards since the last
  // optimizer step. load_since_log (E) fp32: counts of the optimizer steps since the last
  // load-metrics read.
  at::Tensor expert_bias, tokens_per_expert, load_since_log;

  // Rows this layer's training forwards dropped over the static exchange's capacity since the
  // last optimizer step (fp32 scalar), and the steps' sum since the last metrics read.
  at::Tensor dropped_tokens, dropped_since_log;

  // Forgets what this step's training forwards accumulated, for a step that is run again
  // (the static exchange overflowed, docs/moe.md): the token counts and dropped rows (both
  // zero at the start of a step: the balance step moves and zeroes them), pending recompute
  // values and the auxiliary loss.
  void discard_step();

  // Values saved by checkpointed forwards for their recompute.
  size_t pending_recomputes() const { return pending_.size(); }
  void clear_pending() { pending_.clear(); }

 private:
  MoEArgs args_;
  int64_t dim_, hidden_;
  std::string prefix_;
  std::vector<int64_t> params_;
  int64_t gate_w_ = -1, gate_b_ = -1, w1_ = -1, w2_ = -1, w3_ = -1;
  int64_t b1_ = -1, b2_ = -1, b3_ = -1;
  // The biases and activation of this forward's experts (undefined biases: none).
  ExpertsExtras extras_;
  int64_t sw1_ = -1, sw2_ = -1, sw3_ = -1;
  // The routed experts under expert parallelism: rows out to the ranks holding their
  // experts, this rank's experts, rows home.
  // probs: (N) each routed row's gate weight (the static exchange's drop policy ranks by it).
  at::Tensor expert_parallel_experts(const at::Tensor& routed, const at::Tensor& probs,
                                     const at::Tensor& w1, const at::Tensor& w2,
                                     const at::Tensor& w3, const Dispatch& d, Mode mode,
                                     bool recompute);

  // What a checkpointed forward leaves for its recompute, which then makes no host read and,
  // under EP, no counts exchange: the host integers of the layer's one named sync (the loop
  // backend's counts) and the exchange's counts (device, and the exact exchange's host
  // splits).
  struct Pending {
    std::vector<int64_t> host;
    at::Tensor recv_counts;
    std::vector<int64_t> splits;
  };
  // The oldest pending entry when this is a recompute (the forwards' order), else nothing.
  std::optional<Pending> take_pending(bool recompute);
  void keep_pending(Mode mode, bool recompute, Pending p);
  // This rank's experts over the exchange's rows: the local aligned layout on the device,
  // the grouped op or the loop, rows back in arrival order.
  at::Tensor local_experts(const ExpertExchange::Received& got, const at::Tensor& w1,
                           const at::Tensor& w2, const at::Tensor& w3,
                           std::vector<int64_t>& host_counts);
  std::deque<Pending> pending_;
  at::Tensor aux_;
  std::shared_ptr<ExpertExchange> ep_;
  std::shared_ptr<TensorParallelComm> etp_;
};

// Once per optimizer step (DeepSeek's aux-loss-free balancing, arXiv 2408.15664): sums the
// counts over data-parallel ranks with `dp_allreduce` (if set), then per layer
// delta = coeff * sign(mean(count) - count), delta -= mean(delta), bias += delta; moves the
// counts into load_since_log and zeroes them. One collective for all layers.
void moe_balance_step(const std::vector<MoELayer*>& layers,
                      const std::function<void(at::Tensor&)>& dp_allreduce);

// moe/layer<N>/max_mean_load_ratio (max over mean of the per-expert counts) and
// moe/layer<N>/dead_experts (experts with no tokens), from the counts of the optimizer steps
// since the last call (load_since_log), which it then resets. Reads the device: log steps
// only. `layers`: (transformer layer index, layer).
std::map<std::string, double> moe_load_metrics(
    const std::vector<std::pair<int64_t, MoELayer*>>& layers);

}  // namespace titan
