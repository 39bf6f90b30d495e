// Llama-3 (dense): RMSNorm, RoPE (optionally Llama-3.1-scaled), grouped-query attention,
// SwiGLU feed-forward, tied or untied output.
#pragma once

#include <string>
#include <vector>

#include "core/train/model.h"
#include "models/layers.h"

namespace titan {

struct Llama3Args {
  int64_t dim = 256;
  int64_t n_layers = 6;
  int64_t n_heads = 16;
  int64_t n_kv_heads = 16;
  int64_t vocab_size = 2048;
  int64_t multiple_of = 256;
  double ffn_dim_multiplier = 0;  // 0: none
  double norm_eps = 1e-5;
  double rope_theta = 500000;
  // Llama-3.1 scaling, which torchtitan 0.2.2 gives every flavor, the debug model included.
  RopeScaling rope_scaling = {8.0, 1.0, 4.0, 8192};
  int64_t max_seq_len = 2048;  // the longest sequence a run may use (and the RoPE table's rows)
  bool tie_embeddings = false;
  bool depth_init = true;  // init std of output projections scales with layer depth
};

// torchtitan's init std of the output projections (wo, w2, w3) of block `layer`:
// 0.02 / sqrt(2 * (layer + 1)) with depth init, else 0.02 / sqrt(2 * n_layers).
double llama_out_std(int64_t layer, int64_t n_layers, bool depth_init);
// The untied output layer: N(0, 1/sqrt(dim)) truncated at 3 std.
InitSpec llama_output_init(int64_t dim);

// h = int(2 * 4 * dim / 3); h = int(multiplier * h) if set; rounded up to multiple_of.
int64_t llama_ffn_hidden(int64_t dim, int64_t multiple_of, double ffn_dim_multiplier);

Llama3Args llama3_flavor(const std::string& flavor);  // throws UserError
std::vector<std::string> llama3_flavor_names();

class Llama3 : public Model {
 public:
  Llama3(const Llama3Args& args, at::Device device);
  const ModelInfo& info() const override { return info_; }
  const Llama3Args& args() const { return args_; }

 protected:
  Head forward_head(const at::Tensor& tokens) override;

 private:
  struct LayerIdx {
    int64_t attn_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  };
  at::Tensor block(const at::Tensor& x, const std::vector<at::Tensor>& w) const;
  void declare_tp_plan(const Llama3Args& a, int64_t ffn);

  Llama3Args args_;
  ModelInfo info_;
  RopeTables rope_;
  int64_t tok_emb_ = -1, norm_ = -1, output_ = -1;
  std::vector<LayerIdx> layers_;
};

}  // namespace titan
