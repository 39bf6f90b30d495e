#include "models/gpt_oss.h"

#include <cmath>
#include <map>
#include <utility>

#include "core/base/errors.h"
#include "models/flavor_table.h"
#include "models/kv_cache.h"
#include "models/llama3.h"
#include "models/qwen3.h"

namespace titan {

namespace {

// Where a block's weights sit in its list (add_block's order); the MoE layer's follow.
enum : size_t { kAttnNorm, kWq, kBq, kWk, kBk, kWv, kBv, kWo, kBo, kSinks, kFfnNorm, kMoE };

// torchtitan's flavors: every one routes by softmax over a biased gate to the top 4,
// renormalized, no shared expert, the weights applied to the experts' outputs.
GptOssArgs flavor(int64_t dim, int64_t layers, int64_t experts) {
  GptOssArgs a;
  a.dim = dim;
  a.n_layers = layers;
  a.moe.num_experts = experts;
  a.moe.num_shared_experts = 0;
  a.moe.top_k = 4;
  a.moe.score_func = ScoreFunc::Softmax;
  a.moe.route_norm = true;
  a.moe.route_scale = 1.0;
  a.moe.gate_bias = true;
  a.moe.score_before_experts = false;
  return a;
}

const std::map<std::string, GptOssArgs>& flavors() {
  static const std::map<std::string, GptOssArgs> f = {{"debugmodel", flavor(256, 4, 8)},
                                                      {"20b", flavor(2880, 24, 32)},
                                                      {"120b", flavor(2880, 36, 128)}};
  return f;
}

}  // namespace

std::vector<std::string> gpt_oss_flavor_names() {
  return {"debugmodel", "20b", "120b"};
}

GptOssArgs gpt_oss_flavor(const std::string& name) {
  return find_flavor(flavors(), gpt_oss_flavor_names(), "gpt_oss", name);
}

RopeTables gpt_oss_rope_tables(const GptOssArgs& a, at::Device device) {
  const int64_t dim = a.head_dim;
  const double base = a.rope_theta;
  // As torchtitan, in fp32: freq = base^(2i / dim), i < dim / 2.
  const at::Tensor idx = at::arange(0, dim, 2, at::kLong).narrow(0, 0, dim / 2).to(at::kFloat);
  const at::Tensor freq = at::pow(base, idx / static_cast<double>(dim));
  at::Tensor inv_freq;
  double mscale = 1.0;
  if (a.rope_factor > 1.0) {
    mscale = 0.1 * std::log(a.rope_factor) + 1.0;
    const double d_half = static_cast<double>(dim) / 2;
    const double pi = std::acos(-1.0);
    const double orig = static_cast<double>(a.original_seq_len);
    const double low = d_half * std::log(orig / (a.ntk_beta * 2 * pi)) / std::log(base);
    const double high = d_half * std::log(orig / (a.ntk_alpha * 2 * pi)) / std::log(base);
    if (!(0 < low && low < high && high < d_half - 1))
      throw UserError("gpt_oss YaRN parameters give an empty NTK-by-parts range: low " +
                      std::to_string(low) + ", high " + std::to_string(high) + " for head_dim " +
                      std::to_string(dim) + "; allowed: 0 < low < high < head_dim / 2 - 1");
    // 1 below `low` (extrapolated, the original frequency), 0 above `high` (interpolated).
    const at::Tensor ramp = (at::arange(dim / 2, at::kFloat) - low) / (high - low);
    const at::Tensor mask = 1 - ramp.clamp(0, 1);
    inv_freq = (1.0 / (freq * a.rope_factor)) * (1 - mask) + (1.0 / freq) * mask;
  } else {
    inv_freq = 1.0 / freq;
  }
  const at::Tensor t = at::arange(a.max_seq_len, at::kFloat);
  RopeTables r;
  const at::Tensor angles = at::outer(t, inv_freq);  // (max_seq_len, dim / 2)
  // mscale on both cos and sin scales the attention logits by mscale^2 (torchtitan's choice).
  r.cos = (angles.cos() * mscale).to(device);
  r.sin = (angles.sin() * mscale).to(device);
  return r;
}

at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& sinks, double scale, int64_t window,
                          const Documents* docs, int64_t q_first) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Hkv = k.size(2), D = v.size(3);
  const int64_t Tk = k.size(1);  // q_first + T: the keys of a KV cache hold earlier positions
  TORCH_CHECK(
      H % Hkv == 0 && sinks.numel() == H && Tk == q_first + T && (docs == nullptr || q_first == 0),
      "sink_attention: q ", q.sizes(), ", k ", k.sizes(), ", sinks ", sinks.sizes(),
      ", first query at ", q_first);
  const at::Tensor qf = q.to(at::kFloat).transpose(1, 2);  // (B, H, T, D)
  // Query head h reads kv head h / (H / Hkv), as torchtitan's enable_gqa.
  const at::Tensor kf = k.to(at::kFloat).transpose(1, 2).repeat_interleave(H / Hkv, 1);
  const at::Tensor vf = v.to(at::kFloat).transpose(1, 2).repeat_interleave(H / Hkv, 1);
  at::Tensor s = at::matmul(qf, kf.transpose(2, 3)) * scale;  // (B, H, T, Tk)
  const auto opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor qpos = at::arange(q_first, q_first + T, opts);
  const at::Tensor diff = qpos.view({T, 1}) - at::arange(Tk, opts).view({1, Tk});  // q - key
  at::Tensor allowed = diff.ge(0);
  // Bitwise ops on bool masks: logical_and has no meta kernel (titan-train estimate).
  if (window > 0) allowed = allowed.bitwise_and(diff.lt(window));
  allowed = allowed.view({1, 1, T, Tk});
  if (docs != nullptr && docs->block_causal) {
    const at::Tensor& id = docs->doc_ids;  // (B, T)
    allowed = allowed.bitwise_and(id.view({B, 1, T, 1}).eq(id.view({B, 1, 1, T})));
  }
  s = s.masked_fill(allowed.bitwise_not(), -std::numeric_limits<double>::infinity());
  const at::Tensor sink = sinks.to(at::kFloat).view({1, H, 1, 1}).expand({B, H, T, 1});
  const at::Tensor p = at::softmax(at::cat({s, sink}, 3), 3).narrow(3, 0, Tk);
  const at::Tensor o = at::matmul(p, vf);  // (B, H, T, D)
  return o.transpose(1, 2).reshape({B, T, H * D}).to(q.scalar_type());
}

GptOss::GptOss(const GptOssArgs& a, at::Device device) : args_(a) {
  validate_router_args(a.moe, "gpt_oss");
  for (auto [name, v] : {std::pair<const char*, int64_t>{"dim", a.dim},
                         {"n_heads", a.n_heads},
                         {"n_kv_heads", a.n_kv_heads},
                         {"head_dim", a.head_dim},
                         {"n_layers", a.n_layers},
                         {"sliding_window_size", a.sliding_window_size}})
    if (v <= 0)
      throw UserError(std::string("gpt_oss ") + name + " = " + std::to_string(v) +
                      "; allowed: > 0");
  if (a.n_heads % a.n_kv_heads != 0)
    throw UserError("gpt_oss n_kv_heads = " + std::to_string(a.n_kv_heads) +
                    " does not divide n_heads = " + std::to_string(a.n_heads));
  if (a.head_dim % 2 != 0)
    throw UserError("gpt_oss head_dim = " + std::to_string(a.head_dim) + "; allowed: even");
  args_.moe.expert_biases = true;
  args_.moe.swiglu_limit = a.swiglu_limit;
  args_.moe.swiglu_alpha = a.swiglu_alpha;
  const int64_t hd = a.head_dim, H = a.n_heads, Hkv = a.n_kv_heads;
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay, InitSpec init) {
    return params_.add(name, std::move(shape), device, decay, init);
  };
  tok_emb_ = P("tok_embeddings.weight", {a.vocab_size, a.dim}, false, InitSpec::normal(1.0));
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    // torchtitan's TransformerBlock.weight_init_std: every attention tensor (biases and the
    // sinks too), the router and the experts.
    const double std = 0.02 / std::sqrt(2.0 * static_cast<double>(l + 1));
    const InitSpec in = InitSpec::trunc_normal(std);
    std::vector<int64_t> w(kMoE);
    w[kAttnNorm] = P(p + "attention_norm.weight", {a.dim}, false, InitSpec::ones());
    w[kWq] = P(p + "attention.wq.weight", {H * hd, a.dim}, true, in);
    w[kBq] = P(p + "attention.wq.bias", {H * hd}, false, in);
    w[kWk] = P(p + "attention.wk.weight", {Hkv * hd, a.dim}, true, in);
    w[kBk] = P(p + "attention.wk.bias", {Hkv * hd}, false, in);
    w[kWv] = P(p + "attention.wv.weight", {Hkv * hd, a.dim}, true, in);
    w[kBv] = P(p + "attention.wv.bias", {Hkv * hd}, false, in);
    w[kWo] = P(p + "attention.wo.weight", {a.dim, H * hd}, true, in);
    w[kBo] = P(p + "attention.wo.bias", {a.dim}, false, in);
    w[kSinks] = P(p + "attention.sinks", {H}, false, in);
    w[kFfnNorm] = P(p + "ffn_norm.weight", {a.dim}, false, InitSpec::ones());
    moe_.push_back(std::make_unique<MoELayer>(args_.moe, a.dim, a.moe_inter_dim, p + "moe.",
                                              params_, device, std));
    for (int64_t i : moe_.back()->param_indices()) w.push_back(i);
    layers_.push_back(std::move(w));
  }
  norm_ = P("norm.weight", {a.dim}, false, InitSpec::ones());
  output_ = P("output.weight", {a.vocab_size, a.dim}, true, llama_output_init(a.dim));
  rope_ = gpt_oss_rope_tables(a, device);
  for (int64_t l = 0; l < a.n_layers; ++l)
    add_block(layers_[static_cast<size_t>(l)],
              [this, l](const at::Tensor& x, const std::vector<at::Tensor>& w) {
                return block(l, x, w);
              });
  declare_tp_plan();
  info_ = base_info("gpt_oss", a.vocab_size, a.max_seq_len, a.dim, a.n_layers);
  info_.n_active_non_embedding = active_non_embedding_params();
  // torchtitan's count (get_moe_model_nparams_and_flops with 2 * head_dim): full attention.
  info_.attn_flops_dims = a.n_layers * a.n_heads * (hd + hd);
}

// h (B, T, D), the normed input -> wo's input (B, T, H * hd). Under tensor parallelism the
// projections, their biases and the sinks hold this rank's whole heads.
at::Tensor GptOss::attention(int64_t layer, const at::Tensor& h,
                             const std::vector<at::Tensor>& w) const {
  std::vector<at::Tensor> qkv = seq_gather_project(h, {w[kWq], w[kWk], w[kWv]});
  const int64_t B = qkv[0].size(0), T = qkv[0].size(1), hd = args_.head_dim;
  at::Tensor q = (qkv[0] + w[kBq]).view({B, T, -1, hd});  // (B, T, H[/tp], hd)
  at::Tensor k = (qkv[1] + w[kBk]).view({B, T, -1, hd});  // (B, T, Hkv[/tp], hd)
  at::Tensor v = (qkv[2] + w[kBv]).view({B, T, -1, hd});
  const RopeTables rope = rope_rows(rope_, nullptr, T);  // a KV cache's positions, if any
  q = apply_rope_half(q, rope);
  k = apply_rope_half(k, rope);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const int64_t window = sliding(layer) ? args_.sliding_window_size : 0;
  // Generation: the new tokens' queries against every cached key (models/kv_cache.h).
  if (KvCache* cache = KvCache::active()) {
    const KvCache::Cached c = cache->append(k, v);
    return sink_attention(q, c.k, c.v, w[kSinks], scale, window, nullptr, c.first);
  }
  return sink_attention(q, k, v, w[kSinks], scale, window, current_documents());
}

at::Tensor GptOss::block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w) {
  at::Tensor y;
  {
    ModuleScope scope("attention");
    at::Tensor o =
        seq_project_reduce(attention(layer, rms_norm(x, w[kAttnNorm], args_.norm_eps), w), w[kWo]);
    y = x + (o + w[kBo]);  // wo's bias once, after the tensor-parallel sum
  }
  at::Tensor z = rms_norm(y, w[kFfnNorm], args_.norm_eps);
  const std::vector<at::Tensor> ffn(w.begin() + kMoE, w.end());
  return y + moe_layer(layer)->forward(z, ffn, moe_mode(layer));
}

// Megatron's split as Llama-3's, by whole heads: q/k/v with their biases and the sinks by
// output rows, wo by input columns; wo's bias and the norms whole (their gradients partial
// sums over tp); the vocabulary by rows; the MoE layer as Llama-4's (add_moe_to_tp_plan).
void GptOss::declare_tp_plan() {
  TpPlan plan;
  plan.vocab.push_back(tok_emb_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<int64_t>& w = layers_[l];
    plan.replicate.insert(plan.replicate.end(), {w[kAttnNorm], w[kFfnNorm], w[kBo]});
    plan.column.insert(plan.column.end(),
                       {w[kWq], w[kBq], w[kWk], w[kBk], w[kWv], w[kBv], w[kSinks]});
    plan.row.push_back(w[kWo]);
    add_moe_to_tp_plan(plan, *moe_[l]);
  }
  plan.replicate.push_back(norm_);
  plan.vocab.push_back(output_);
  plan.divisible = {{"n_heads", args_.n_heads},
                    {"n_kv_heads", args_.n_kv_heads},
                    {"vocab_size", args_.vocab_size}};
  set_tp_plan(std::move(plan));
}

at::Tensor GptOss::forward_embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.size(1) <= args_.max_seq_len, "sequence longer than max_seq_len");
  return embed(weight(tok_emb_), tokens);  // (B, T, D), or this rank's (B, T/tp, D)
}

Model::Head GptOss::forward_final(const at::Tensor& h) {
  return {rms_norm(h, weight(norm_), args_.norm_eps), weight(output_)};
}

}  // namespace titan
