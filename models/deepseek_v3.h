// DeepSeek-V3 (and the V2 sizes torchtitan ships as flavors): Multi-head Latent Attention with
// decoupled RoPE and YaRN, n_dense_layers dense SwiGLU layers, then MoE layers with shared
// experts (softmax or sigmoid routing, optional group-limited routing; scores applied after
// the experts).
#pragma once

#include <string>
#include <vector>

#include "models/layers.h"
#include "models/moe_model.h"

namespace titan {

struct DeepSeekV3Args {
  int64_t vocab_size = 2048;
  int64_t dim = 256;
  int64_t inter_dim = 1024;     // dense layers' FFN hidden
  int64_t moe_inter_dim = 256;  // each expert's hidden
  int64_t n_layers = 6;
  int64_t n_dense_layers = 1;  // layers [0, n_dense_layers) are dense
  int64_t n_heads = 16;
  double norm_eps = 1e-5;
  MoEArgs moe;
  // torchtitan's attn_type / attn_mask_type (docs/attention.md).
  AttnType attn_type = AttnType::Sdpa;
  AttnMask attn_mask = AttnMask::Causal;
  // Multi-head Latent Attention
  int64_t q_lora_rank = 0;  // 0: a plain wq projection
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  // RoPE with YaRN: applied when max_seq_len > original_seq_len
  int64_t max_seq_len = 2048;  // build_model sets the run's sequence length
  int64_t original_seq_len = 4096;
  double rope_theta = 10000;
  double rope_factor = 40;
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 1.0;
};

// YaRN-scaled RoPE tables for the decoupled rope dims (DeepSeek's precompute_freqs_cis).
RopeTables yarn_rope_tables(const DeepSeekV3Args& a, at::Device device);
// qk_head_dim^-0.5, times mscale^2 with mscale = 0.1 * a.mscale * ln(rope_factor) + 1 when
// YaRN is in use.
double mla_softmax_scale(const DeepSeekV3Args& a);

DeepSeekV3Args deepseek_v3_flavor(const std::string& flavor);  // throws UserError
std::vector<std::string> deepseek_v3_flavor_names();

class DeepSeekV3 : public MoETransformer {
 public:
  DeepSeekV3(const DeepSeekV3Args& args, at::Device device);  // throws UserError for bad args
  const ModelInfo& info() const override { return info_; }
  const DeepSeekV3Args& args() const { return args_; }

 protected:
  at::Tensor forward_embed(const at::Tensor& tokens) override;
  Head forward_final(const at::Tensor& h) override;

 private:
  struct LayerIdx {
    // attn_norm, (wq | wq_a, q_norm, wq_b), wkv_a, kv_norm, wkv_b, wo, ffn_norm, then the
    // dense FFN's w1, w2, w3 or the MoE layer's weights
    std::vector<int64_t> w;
  };
  at::Tensor block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w);
  void declare_tp_plan();

  DeepSeekV3Args args_;
  ModelInfo info_;
  RopeTables rope_;
  double softmax_scale_ = 0;
  int64_t tok_emb_ = -1, norm_ = -1, output_ = -1;
  std::vector<LayerIdx> layers_;
};

}  // namespace titan
