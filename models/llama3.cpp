#include "models/llama3.h"

#include <cmath>
#include <map>
#include <utility>

#include "core/base/errors.h"
#include "core/train/capture_check.h"
#include "models/flavor_table.h"
#include "models/hf_interop.h"

namespace titan {

double llama_out_std(int64_t layer, int64_t n_layers, bool depth_init) {
  const double depth =
      depth_init ? 2.0 * static_cast<double>(layer + 1) : 2.0 * static_cast<double>(n_layers);
  return 0.02 / std::sqrt(depth);
}

InitSpec llama_output_init(int64_t dim) {
  const double std = 1.0 / std::sqrt(static_cast<double>(dim));
  return InitSpec::trunc_normal(std, -3 * std, 3 * std);
}

int64_t llama_ffn_hidden(int64_t dim, int64_t multiple_of, double ffn_dim_multiplier) {
  int64_t h = static_cast<int64_t>(2.0 * 4.0 * static_cast<double>(dim) / 3.0);
  if (ffn_dim_multiplier > 0) h = static_cast<int64_t>(ffn_dim_multiplier * static_cast<double>(h));
  return multiple_of * ((h + multiple_of - 1) / multiple_of);
}

std::vector<int64_t> add_llama_block_params(ParamStore& params, const LlamaArgs& s, int64_t layer,
                                            int64_t ffn_hidden, at::Device device) {
  const std::string p = "layers." + std::to_string(layer) + ".";
  const int64_t hd = s.dim / s.n_heads;
  const InitSpec in = InitSpec::trunc_normal(0.02);
  const InitSpec out = InitSpec::trunc_normal(llama_out_std(layer, s.n_layers, s.depth_init));
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay, InitSpec init) {
    return params.add(p + name, std::move(shape), device, decay, init);
  };
  std::vector<int64_t> w;
  w.push_back(P("attention_norm.weight", {s.dim}, false, InitSpec::ones()));
  w.push_back(P("attention.wq.weight", {s.n_heads * hd, s.dim}, true, in));
  w.push_back(P("attention.wk.weight", {s.n_kv_heads * hd, s.dim}, true, in));
  w.push_back(P("attention.wv.weight", {s.n_kv_heads * hd, s.dim}, true, in));
  w.push_back(P("attention.wo.weight", {s.dim, s.n_heads * hd}, true, out));
  w.push_back(P("ffn_norm.weight", {s.dim}, false, InitSpec::ones()));
  if (ffn_hidden > 0) {
    w.push_back(P("feed_forward.w1.weight", {ffn_hidden, s.dim}, true, in));
    w.push_back(P("feed_forward.w2.weight", {s.dim, ffn_hidden}, true, out));
    w.push_back(P("feed_forward.w3.weight", {ffn_hidden, s.dim}, true, out));
  }
  return w;
}

at::Tensor llama_attention_residual(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                    int64_t n_heads, int64_t n_kv_heads, double norm_eps,
                                    const RopeTables& rope, const Model* sp,
                                    const IRopeLayer& irope) {
  at::Tensor h = rms_norm(x, w[0], norm_eps);
  if (sp == nullptr)
    return x + gqa_attention(h, w[1], w[2], w[3], w[4], n_heads, n_kv_heads, rope, nullptr,
                             irope.use_rope, irope.chunk);
  ModuleScope scope("attention");
  // The all-gather fused with the q/k/v GEMMs and wo's GEMM with the reduce-scatter
  // (Model::seq_gather_project; async tensor parallelism overlaps them).
  std::vector<at::Tensor> qkv = sp->seq_gather_project(h, {w[1], w[2], w[3]});
  return x + sp->seq_project_reduce(
                 gqa_attention_core(qkv[0], qkv[1], qkv[2], n_heads, n_kv_heads, rope,
                                    sp->context_parallel(), irope.use_rope, irope.chunk),
                 w[4]);
}

namespace {

const std::map<std::string, Llama3Args>& flavors() {
  static const std::map<std::string, Llama3Args> f = [] {
    std::map<std::string, Llama3Args> m;
    Llama3Args debug;  // the struct defaults are the debug model
    m["debugmodel"] = debug;
    auto big = [](int64_t dim, int64_t layers, int64_t heads, double mult, int64_t multiple_of,
                  double rope_factor, bool tie) {
      Llama3Args a;
      a.dim = dim;
      a.n_layers = layers;
      a.n_heads = heads;
      a.n_kv_heads = 8;
      a.vocab_size = 128256;
      a.multiple_of = multiple_of;
      a.ffn_dim_multiplier = mult;
      a.rope_theta = 500000;
      a.rope_scaling.factor = rope_factor;
      a.max_seq_len = 131072;
      a.tie_embeddings = tie;
      return a;
    };
    m["1B"] = big(2048, 16, 32, 1.5, 256, 32, true);    // Llama-3.2 1B
    m["3B"] = big(3072, 28, 24, 1.0, 256, 32, true);    // Llama-3.2 3B
    m["8B"] = big(4096, 32, 32, 1.3, 1024, 8, false);   // Llama-3.1 8B
    m["70B"] = big(8192, 80, 64, 1.3, 4096, 8, false);  // Llama-3.1 70B
    m["405B"] = big(16384, 126, 128, 1.2, 4096, 8, false);
    // torchtitan's attention variants: the same sizes, block-causal.
    auto variant = [](Llama3Args a, AttnType t) {
      a.attn_type = t;
      a.attn_mask = AttnMask::BlockCausal;
      return a;
    };
    m["debugmodel_flex_attn"] = variant(debug, AttnType::Flex);
    m["debugmodel_varlen_attn"] = variant(debug, AttnType::Varlen);
    m["8B_flex"] = variant(m["8B"], AttnType::Flex);
    m["8B_varlen"] = variant(m["8B"], AttnType::Varlen);
    return m;
  }();
  return f;
}

}  // namespace

std::vector<std::string> llama3_flavor_names() {
  return {"debugmodel",
          "debugmodel_flex_attn",
          "debugmodel_varlen_attn",
          "1B",
          "3B",
          "8B",
          "8B_flex",
          "8B_varlen",
          "70B",
          "405B"};
}

Llama3Args llama3_flavor(const std::string& flavor) {
  // "hf:DIR": the dimensions of a Hugging Face folder's config.json (a custom flavor).
  if (flavor.rfind("hf:", 0) == 0) return llama3_args_from_hf_config(flavor.substr(3));
  return find_flavor(flavors(), llama3_flavor_names(), "llama3", flavor);
}

Llama3::Llama3(const Llama3Args& a, at::Device device) : args_(a) {
  const int64_t hd = a.dim / a.n_heads;
  const int64_t ffn = llama_ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier);
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay, InitSpec init) {
    return params_.add(name, std::move(shape), device, decay, init);
  };
  // torchtitan's N(0, 1) table, except when it is also the output projection (1B, 3B): then
  // it takes the output's init, or the first logits have std sqrt(dim) (a first loss of ~1800
  // instead of ~12 on the 1B flavor).
  tok_emb_ = P("tok_embeddings.weight", {a.vocab_size, a.dim}, false,
               a.tie_embeddings ? llama_output_init(a.dim) : InitSpec::normal(1.0));
  for (int64_t l = 0; l < a.n_layers; ++l)
    layers_.push_back(add_llama_block_params(params_, a, l, ffn, device));
  norm_ = P("norm.weight", {a.dim}, false, InitSpec::ones());
  if (!a.tie_embeddings)
    output_ = P("output.weight", {a.vocab_size, a.dim}, true, llama_output_init(a.dim));
  rope_ = rope_tables(hd, a.max_seq_len, a.rope_theta, a.rope_scaling, device);
  for (const std::vector<int64_t>& idx : layers_)
    add_block(
        idx, [this](const at::Tensor& x, const std::vector<at::Tensor>& w) { return block(x, w); });

  declare_tp_plan(a, ffn);
  info_ = base_info("llama3", a.vocab_size, a.max_seq_len, a.dim, a.n_layers);
  info_.n_active_non_embedding = info_.n_params - info_.n_params_embedding;
  info_.attn_flops_dims = a.n_layers * a.n_heads * (hd + hd);
}

at::Tensor Llama3::block(const at::Tensor& x, const std::vector<at::Tensor>& w) const {
  // w: attn_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3 (compute form)
  // seq_gather / seq_reduce: the sequence-parallel boundaries (identities on one rank).
  at::Tensor y =
      llama_attention_residual(x, w, args_.n_heads, args_.n_kv_heads, args_.norm_eps, rope_, this);
  ModuleScope scope("feed_forward");
  return y + seq_swiglu(rms_norm(y, w[5], args_.norm_eps), w[6], w[7], w[8]);
}

// Megatron's split: q/k/v and w1/w3 by output rows (whole heads, hidden units), wo and w2 by
// input columns, the embedding and output by vocabulary rows, norms whole.
void Llama3::declare_tp_plan(const Llama3Args& a, int64_t ffn) {
  TpPlan plan;
  plan.vocab.push_back(tok_emb_);
  // Each layer's indices: attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3
  // (add_llama_block_params).
  for (const std::vector<int64_t>& w : layers_) {
    plan.replicate.insert(plan.replicate.end(), {w[0], w[5]});
    plan.column.insert(plan.column.end(), {w[1], w[2], w[3], w[6], w[8]});
    plan.row.insert(plan.row.end(), {w[4], w[7]});
  }
  plan.replicate.push_back(norm_);
  if (output_ >= 0) plan.vocab.push_back(output_);
  plan.divisible = {{"n_heads", a.n_heads},
                    {"n_kv_heads", a.n_kv_heads},
                    {"the feed-forward hidden size", ffn},
                    {"vocab_size", a.vocab_size}};
  set_tp_plan(std::move(plan));
}

at::Tensor Llama3::forward_embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.size(1) <= args_.max_seq_len, "sequence longer than max_seq_len");
  at::Tensor emb = weight(tok_emb_);
  if (output_ < 0) tied_emb_ = emb;  // the output weight too: materialized once per forward
  return embed(emb, tokens);         // (B, T, D), or this rank's (B, T/tp, D)
}

Model::Head Llama3::forward_final(const at::Tensor& h) {
  at::Tensor out = output_ >= 0 ? weight(output_) : std::exchange(tied_emb_, at::Tensor());
  return {rms_norm(h, weight(norm_), args_.norm_eps), out};
}

}  // namespace titan
