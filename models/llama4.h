// Llama-4 (text, MoE): Llama-3 blocks whose feed-forward is a Mixture-of-Experts layer every
// interleave_moe_layer_step layers (sigmoid top-1 routing, one shared expert, scores applied
// before the experts). Attention is Llama-3's, with torchtitan's iRoPE where the flavor sets
// every_n_layers_nope (docs/attention.md); no QK-norm (docs/models.md).
#pragma once

#include <string>
#include <vector>

#include "models/layers.h"
#include "models/llama3.h"
#include "models/moe_model.h"

namespace titan {

struct Llama4Args : LlamaArgs {           // rope_scaling: none unless a flavor sets it
  int64_t interleave_moe_layer_step = 2;  // layer l is MoE when (l + 1) % step == 0
  bool auto_scale_hidden_dim = true;      // expert hidden / (top_k + shared experts)
  MoEArgs moe;
  // iRoPE (torchtitan's): with every_n_layers_nope = n > 0, layers l with l % n == 0 use no
  // RoPE and the model's mask; the others RoPE and the mask cut into chunks of
  // fixed_attn_block_size tokens (chunked local attention). 0: every layer RoPE, unchunked.
  int64_t every_n_layers_nope = 0;
  int64_t fixed_attn_block_size = 8192;
};

// Hidden size of the routed and shared experts (torchtitan's rule): int(2 * 4 * dim / 3),
// times ffn_dim_multiplier, divided by (top_k + num_shared_experts) when auto-scaled, rounded
// up to multiple_of. debugmodel: 682 / 2 = 341 -> 512.
int64_t llama4_expert_hidden(const Llama4Args& a);

Llama4Args llama4_flavor(const std::string& flavor);  // throws UserError
std::vector<std::string> llama4_flavor_names();

class Llama4 : public MoETransformer {
 public:
  Llama4(const Llama4Args& args, at::Device device);  // throws UserError for bad MoE args
  const ModelInfo& info() const override { return info_; }
  const Llama4Args& args() const { return args_; }

 protected:
  at::Tensor forward_embed(const at::Tensor& tokens) override;
  Head forward_final(const at::Tensor& h) override;

 private:
  at::Tensor block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w);
  void declare_tp_plan(int64_t ffn);

  Llama4Args args_;
  ModelInfo info_;
  RopeTables rope_;
  int64_t tok_emb_ = -1, norm_ = -1, output_ = -1;
  // per block: attn_norm, wq, wk, wv, wo, ffn_norm, then w1, w2, w3 or the MoE layer's
  std::vector<std::vector<int64_t>> layers_;
};

}  // namespace titan
