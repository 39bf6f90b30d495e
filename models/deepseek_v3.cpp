#include "models/deepseek_v3.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>

#include "core/base/errors.h"
#include "core/train/capture_check.h"
#include "models/flavor_table.h"
#include "models/llama3.h"

namespace titan {

RopeTables yarn_rope_tables(const DeepSeekV3Args& a, at::Device device) {
  const int64_t dim = a.qk_rope_head_dim;
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  // fp32 throughout, like the reference implementation.
  at::Tensor freqs = 1.0 / at::pow(a.rope_theta, at::arange(0, dim, 2, f32) / dim);  // (dim/2)
  if (a.max_seq_len > a.original_seq_len) {
    // YaRN: interpolate the low frequencies by rope_factor, keep the high ones, ramp between.
    auto correction_dim = [&](double rotations) {
      return dim * std::log(a.original_seq_len / (rotations * 2 * M_PI)) /
             (2 * std::log(a.rope_theta));
    };
    double low = std::max(std::floor(correction_dim(a.beta_fast)), 0.0);
    double high = std::min(std::ceil(correction_dim(a.beta_slow)), static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    at::Tensor ramp = at::clamp((at::arange(dim / 2, f32) - low) / (high - low), 0, 1);
    at::Tensor smooth = 1 - ramp;
    freqs = freqs / a.rope_factor * (1 - smooth) + freqs * smooth;
  }
  at::Tensor angles = at::outer(at::arange(a.max_seq_len, f32), freqs);  // (T, dim/2)
  return rope_tables_from_angles(angles, device);
}

double mla_softmax_scale(const DeepSeekV3Args& a) {
  double s = 1.0 / std::sqrt(static_cast<double>(a.qk_nope_head_dim + a.qk_rope_head_dim));
  if (a.max_seq_len > a.original_seq_len) {
    const double m = 0.1 * a.mscale * std::log(a.rope_factor) + 1.0;
    s *= m * m;
  }
  return s;
}

namespace {

const std::map<std::string, DeepSeekV3Args>& flavors() {
  static const std::map<std::string, DeepSeekV3Args> f = [] {
    std::map<std::string, DeepSeekV3Args> m;
    DeepSeekV3Args debug;  // the struct defaults plus:
    debug.moe.num_experts = 8;
    debug.moe.num_shared_experts = 2;
    debug.moe.top_k = 3;
    debug.moe.score_func = ScoreFunc::Softmax;
    debug.moe.route_norm = false;
    debug.moe.score_before_experts = false;
    debug.mscale = 0.70;
    m["debugmodel"] = debug;
    DeepSeekV3Args flex = debug;
    flex.attn_type = AttnType::Flex;
    flex.attn_mask = AttnMask::BlockCausal;
    m["debugmodel_flex_attn"] = flex;

    // torchtitan 0.2.2 runs the three large flavors with flex attention, block-causal.
    DeepSeekV3Args v2lite = flex;  // DeepSeek-V2-Lite sizes
    v2lite.vocab_size = 102400;
    v2lite.dim = 2048;
    v2lite.inter_dim = 10944;
    v2lite.moe_inter_dim = 1408;
    v2lite.n_layers = 27;
    v2lite.n_dense_layers = 1;
    v2lite.n_heads = 16;
    v2lite.moe.num_experts = 64;
    v2lite.moe.top_k = 6;
    m["16B"] = v2lite;

    DeepSeekV3Args v2 = v2lite;  // DeepSeek-V2 sizes
    v2.dim = 5120;
    v2.inter_dim = 12288;
    v2.moe_inter_dim = 1536;
    v2.n_layers = 60;
    v2.n_heads = 128;
    v2.moe.num_experts = 160;
    v2.moe.num_expert_groups = 8;
    v2.moe.num_limited_groups = 3;
    v2.moe.route_scale = 16.0;
    v2.q_lora_rank = 1536;
    v2.mscale = 1.0;
    m["236B"] = v2;

    DeepSeekV3Args v3 = v2;  // DeepSeek-V3
    v3.vocab_size = 129280;
    v3.dim = 7168;
    v3.inter_dim = 18432;
    v3.moe_inter_dim = 2048;
    v3.n_layers = 61;
    v3.n_dense_layers = 3;
    v3.moe.num_experts = 256;
    v3.moe.num_shared_experts = 1;
    v3.moe.top_k = 8;
    v3.moe.num_expert_groups = 8;
    v3.moe.num_limited_groups = 4;
    v3.moe.score_func = ScoreFunc::Sigmoid;
    v3.moe.route_norm = true;
    v3.moe.route_scale = 2.5;
    m["671B"] = v3;
    return m;
  }();
  return f;
}

}  // namespace

std::vector<std::string> deepseek_v3_flavor_names() {
  return {"debugmodel", "debugmodel_flex_attn", "16B", "236B", "671B"};
}

DeepSeekV3Args deepseek_v3_flavor(const std::string& flavor) {
  return find_flavor(flavors(), deepseek_v3_flavor_names(), "deepseek_v3", flavor);
}

DeepSeekV3::DeepSeekV3(const DeepSeekV3Args& a, at::Device device) : args_(a) {
  validate_router_args(a.moe, "deepseek_v3");
  if (a.n_dense_layers < 0 || a.n_dense_layers > a.n_layers)
    throw UserError("deepseek_v3 n_dense_layers = " + std::to_string(a.n_dense_layers) +
                    " with n_layers = " + std::to_string(a.n_layers) +
                    "; allowed: 0 <= n_dense_layers <= n_layers");
  if (a.qk_rope_head_dim % 2 != 0)
    throw UserError("deepseek_v3 qk_rope_head_dim = " + std::to_string(a.qk_rope_head_dim) +
                    "; allowed: an even number");
  const int64_t H = a.n_heads, qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay, InitSpec init) {
    return params_.add(name, std::move(shape), device, decay, init);
  };
  tok_emb_ = P("tok_embeddings.weight", {a.vocab_size, a.dim}, false, InitSpec::normal(1.0));
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    // torchtitan's DeepSeek blocks always use depth init.
    const double out_std = llama_out_std(l, a.n_layers, /*depth_init=*/true);
    const InitSpec in = InitSpec::trunc_normal(0.02), out = InitSpec::trunc_normal(out_std);
    const InitSpec ones = InitSpec::ones();
    LayerIdx L;
    L.w.push_back(P(p + "attention_norm.weight", {a.dim}, false, ones));
    if (a.q_lora_rank == 0) {
      L.w.push_back(P(p + "attention.wq.weight", {H * qk, a.dim}, true, in));
    } else {
      L.w.push_back(P(p + "attention.wq_a.weight", {a.q_lora_rank, a.dim}, true, in));
      L.w.push_back(P(p + "attention.q_norm.weight", {a.q_lora_rank}, false, ones));
      L.w.push_back(P(p + "attention.wq_b.weight", {H * qk, a.q_lora_rank}, true, in));
    }
    L.w.push_back(
        P(p + "attention.wkv_a.weight", {a.kv_lora_rank + a.qk_rope_head_dim, a.dim}, true, in));
    L.w.push_back(P(p + "attention.kv_norm.weight", {a.kv_lora_rank}, false, ones));
    L.w.push_back(P(p + "attention.wkv_b.weight",
                    {H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank}, true, in));
    L.w.push_back(P(p + "attention.wo.weight", {a.dim, H * a.v_head_dim}, true, out));
    L.w.push_back(P(p + "ffn_norm.weight", {a.dim}, false, ones));
    if (l >= a.n_dense_layers) {
      moe_.push_back(std::make_unique<MoELayer>(a.moe, a.dim, a.moe_inter_dim, p + "moe.", params_,
                                                device, out_std));
      for (int64_t i : moe_.back()->param_indices()) L.w.push_back(i);
    } else {
      moe_.push_back(nullptr);
      L.w.push_back(P(p + "feed_forward.w1.weight", {a.inter_dim, a.dim}, true, in));
      L.w.push_back(P(p + "feed_forward.w2.weight", {a.dim, a.inter_dim}, true, out));
      L.w.push_back(P(p + "feed_forward.w3.weight", {a.inter_dim, a.dim}, true, out));
    }
    layers_.push_back(L);
  }
  norm_ = P("norm.weight", {a.dim}, false, InitSpec::ones());
  output_ = P("output.weight", {a.vocab_size, a.dim}, true, llama_output_init(a.dim));
  rope_ = yarn_rope_tables(a, device);
  softmax_scale_ = mla_softmax_scale(a);
  for (int64_t l = 0; l < a.n_layers; ++l)
    add_block(layers_[static_cast<size_t>(l)].w,
              [this, l](const at::Tensor& x, const std::vector<at::Tensor>& w) {
                return block(l, x, w);
              });

  declare_tp_plan();
  info_ = base_info("deepseek_v3", a.vocab_size, a.max_seq_len, a.dim, a.n_layers);
  info_.n_active_non_embedding = active_non_embedding_params();
  info_.attn_flops_dims = a.n_layers * H * (qk + a.v_head_dim);
}

at::Tensor DeepSeekV3::block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w) {
  const auto& a = args_;
  const int64_t B = x.size(0);
  const int64_t nope = a.qk_nope_head_dim, rope = a.qk_rope_head_dim;
  size_t k = 0;
  auto attention = std::make_unique<ModuleScope>("attention");  // ends after the output projection
  // The sequence-parallel boundaries (identities on one rank), fused with the GEMMs beside
  // them: the gathered normed input feeds the query projection (wq, or wq_a) and wkv_a.
  at::Tensor xn = rms_norm(x, w[k++], a.norm_eps);
  const size_t iq = k, ikv = a.q_lora_rank == 0 ? k + 1 : k + 3;
  std::vector<at::Tensor> g = seq_gather_project(xn, {w[iq], w[ikv]});
  const int64_t T = g[0].size(1);  // under context parallelism this rank's T/cp tokens
  const Documents* docs = current_documents();
  const RopeTables rt = rope_rows(rope_, context_parallel(), B, T, docs);
  // Queries: (B, T, H, nope + rope), RoPE on the rope part only.
  at::Tensor q = g[0];
  ++k;
  if (a.q_lora_rank != 0) {
    at::Tensor qn = rms_norm(q, w[k++], a.norm_eps);
    q = project(qn, w[k++]);
  }
  const int64_t H = q.size(-1) / (nope + rope);  // this tp rank's heads (all on one rank)
  q = q.view({B, T, H, nope + rope});
  q = at::cat({q.slice(-1, 0, nope), apply_rope(q.slice(-1, nope), rt)}, -1);
  // Keys and values from the compressed latent (B, T, kv_lora_rank) plus one shared rope key.
  at::Tensor kv = g[1];  // (B, T, kv_lora_rank + rope)
  ++k;
  at::Tensor k_pe = apply_rope(kv.slice(-1, a.kv_lora_rank).unsqueeze(2), rt);  // (B,T,1,rope)
  at::Tensor latent = rms_norm(kv.slice(-1, 0, a.kv_lora_rank), w[k++], a.norm_eps);
  at::Tensor kvb = project(latent, w[k++]).view({B, T, H, nope + a.v_head_dim});
  at::Tensor key = at::cat({kvb.slice(-1, 0, nope), k_pe.expand({B, T, H, rope})}, -1);
  at::Tensor v = kvb.slice(-1, nope);  // (B, T, H, v_head_dim)
  // Context parallel: key and v gathered over the cp ranks inside (B, T, H * v_head_dim).
  at::Tensor attn = titan::attention(q, key, v, softmax_scale_, context_parallel(), docs);
  at::Tensor y = x + seq_project_reduce(attn, w[k++]);
  attention.reset();
  at::Tensor z = rms_norm(y, w[k++], a.norm_eps);
  if (MoELayer* m = moe_layer(layer))  // on this rank's sequence shard
    return y + m->forward(z, std::vector<at::Tensor>(w.begin() + static_cast<int64_t>(k), w.end()),
                          moe_mode(layer));
  ModuleScope scope("feed_forward");
  return y + seq_swiglu(z, w[k], w[k + 1], w[k + 2]);
}

// MLA split by heads: the query projection (wq, or wq_b after the replicated wq_a and
// q_norm) and the key/value up-projection wkv_b are column groups, wo a row group. The
// shared down-projection wkv_a and kv_norm are replicated: every rank computes the same
// latent from the whole sequence, and their gradients (each rank's heads' share) are summed
// over the tp ranks, as the norms' are. Dense layers as llama3; MoE layers whole, on the
// rank's sequence shard, as llama4's.
void DeepSeekV3::declare_tp_plan() {
  TpPlan plan;
  plan.vocab = {tok_emb_, output_};
  bool dense = false;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<int64_t>& w = layers_[l].w;
    size_t k = 0;
    plan.replicate.push_back(w[k++]);  // attention_norm
    if (args_.q_lora_rank == 0) {
      plan.column.push_back(w[k++]);
    } else {
      plan.replicate.insert(plan.replicate.end(), {w[k], w[k + 1]});  // wq_a, q_norm
      plan.column.push_back(w[k + 2]);
      k += 3;
    }
    plan.replicate.insert(plan.replicate.end(), {w[k], w[k + 1]});  // wkv_a, kv_norm
    plan.column.push_back(w[k + 2]);                                // wkv_b
    plan.row.push_back(w[k + 3]);                                   // wo
    plan.replicate.push_back(w[k + 4]);                             // ffn_norm
    k += 5;
    if (moe_[l]) {
      add_moe_to_tp_plan(plan, *moe_[l]);  // w[k..]: the MoE layer's parameters
    } else {
      plan.column.insert(plan.column.end(), {w[k], w[k + 2]});
      plan.row.push_back(w[k + 1]);
      dense = true;
    }
  }
  plan.replicate.push_back(norm_);
  plan.divisible = {{"n_heads", args_.n_heads}, {"vocab_size", args_.vocab_size}};
  if (dense) plan.divisible.push_back({"inter_dim", args_.inter_dim});
  set_tp_plan(std::move(plan));
}

at::Tensor DeepSeekV3::forward_embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.size(1) <= args_.max_seq_len, "sequence longer than max_seq_len");
  return embed(weight(tok_emb_), tokens);  // (B, T, D), or this rank's (B, T/tp, D)
}

Model::Head DeepSeekV3::forward_final(const at::Tensor& h) {
  // torchtitan builds the final norm without an eps: RMSNorm then uses the machine epsilon
  // of the input's dtype (fp32 1.19e-7, bf16 7.8e-3).
  const double eps = h.scalar_type() == at::kBFloat16
                         ? 0.0078125
                         : static_cast<double>(std::numeric_limits<float>::epsilon());
  return {rms_norm(h, weight(norm_), eps), weight(output_)};
}

}  // namespace titan
