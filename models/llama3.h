// Llama-3 (dense): RMSNorm, RoPE (optionally Llama-3.1-scaled), grouped-query attention,
// SwiGLU feed-forward, tied or untied output.
#pragma once

#include <string>
#include <vector>

#include "core/train/model.h"
#include "models/layers.h"

namespace titan {

// The fields Llama-3 and Llama-4 share (torchtitan's TransformerModelArgs); the defaults are
// the debug model's.
struct LlamaArgs {
  int64_t dim = 256;
  int64_t n_layers = 6;
  int64_t n_heads = 16;
  int64_t n_kv_heads = 16;
  int64_t vocab_size = 2048;
  int64_t multiple_of = 256;
  double ffn_dim_multiplier = 0;  // 0: none
  double norm_eps = 1e-5;
  double rope_theta = 500000;
  RopeScaling rope_scaling;    // factor 1: none
  int64_t max_seq_len = 2048;  // the longest sequence a run may use (and the RoPE table's rows)
  bool depth_init = true;      // init std of output projections scales with layer depth
  // torchtitan's attn_type / attn_mask_type (docs/attention.md); model.attn_mask_type
  // overrides the mask.
  AttnType attn_type = AttnType::Sdpa;
  AttnMask attn_mask = AttnMask::Causal;
};

struct Llama3Args : LlamaArgs {
  // Llama-3.1 scaling, which torchtitan 0.2.2 gives every flavor, the debug model included.
  Llama3Args() { rope_scaling = {8.0, 1.0, 4.0, 8192}; }
  bool tie_embeddings = false;
};

// torchtitan's init std of the output projections (wo, w2, w3) of block `layer`:
// 0.02 / sqrt(2 * (layer + 1)) with depth init, else 0.02 / sqrt(2 * n_layers).
double llama_out_std(int64_t layer, int64_t n_layers, bool depth_init);
// The untied output layer: N(0, 1/sqrt(dim)) truncated at 3 std.
InitSpec llama_output_init(int64_t dim);

// h = int(2 * 4 * dim / 3); h = int(multiplier * h) if set; rounded up to multiple_of.
int64_t llama_ffn_hidden(int64_t dim, int64_t multiple_of, double ffn_dim_multiplier);

// Registers block `layer`'s weights in `params` under "layers.<layer>.", in torchtitan's
// order and init: attention_norm, wq, wk, wv, wo, ffn_norm, then, when ffn_hidden > 0, the
// dense feed_forward w1, w2, w3. Returns their indices in that order.
std::vector<int64_t> add_llama_block_params(ParamStore& params, const LlamaArgs& args,
                                            int64_t layer, int64_t ffn_hidden, at::Device device);
// The first half of a Llama block, x + attention(rms_norm(x)) (B, T, D); w[0..4] are
// attention_norm, wq, wk, wv, wo in compute form. With `sp`, the attention input and output
// cross the model's sequence-parallel boundaries (Model::seq_gather, seq_reduce).
// Llama-4's iRoPE (`irope` non-null): a NoPE layer (no rope, global mask), or a RoPE
// layer whose attention is also cut into chunks of `chunk` tokens.
struct IRopeLayer {
  bool use_rope = true;
  int64_t chunk = 0;  // 0: not chunked
};
at::Tensor llama_attention_residual(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                    int64_t n_heads, int64_t n_kv_heads, double norm_eps,
                                    const RopeTables& rope, const Model* sp = nullptr,
                                    const IRopeLayer& irope = {});

Llama3Args llama3_flavor(const std::string& flavor);  // throws UserError
std::vector<std::string> llama3_flavor_names();

class Llama3 : public Model {
 public:
  Llama3(const Llama3Args& args, at::Device device);
  const ModelInfo& info() const override { return info_; }
  const Llama3Args& args() const { return args_; }

 protected:
  at::Tensor forward_embed(const at::Tensor& tokens) override;
  Head forward_final(const at::Tensor& h) override;

 private:
  at::Tensor block(const at::Tensor& x, const std::vector<at::Tensor>& w) const;
  void declare_tp_plan(const Llama3Args& a, int64_t ffn);

  Llama3Args args_;
  ModelInfo info_;
  RopeTables rope_;
  int64_t tok_emb_ = -1, norm_ = -1, output_ = -1;
  at::Tensor tied_emb_;  // tied output: the embedding's compute form, from embed to head
  // per block: attn_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3
  std::vector<std::vector<int64_t>> layers_;
};

}  // namespace titan
