#include "models/llama4.h"

#include <cmath>
#include <map>

#include "core/base/errors.h"
#include "core/train/capture_check.h"
#include "models/flavor_table.h"
#include "models/llama3.h"

namespace titan {

int64_t llama4_expert_hidden(const Llama4Args& a) {
  int64_t h = static_cast<int64_t>(2.0 * 4.0 * static_cast<double>(a.dim) / 3.0);
  if (a.ffn_dim_multiplier > 0)
    h = static_cast<int64_t>(a.ffn_dim_multiplier * static_cast<double>(h));
  if (a.auto_scale_hidden_dim)
    h = static_cast<int64_t>(static_cast<double>(h) /
                             static_cast<double>(a.moe.top_k + a.moe.num_shared_experts));
  return a.multiple_of * ((h + a.multiple_of - 1) / a.multiple_of);
}

namespace {

const std::map<std::string, Llama4Args>& flavors() {
  static const std::map<std::string, Llama4Args> f = [] {
    std::map<std::string, Llama4Args> m;
    Llama4Args debug;                // the struct defaults are the debug model
    debug.rope_scaling.factor = 16;  // torchtitan's RoPEScalingArgs() defaults
    debug.rope_scaling.low_freq_factor = 1;
    debug.rope_scaling.high_freq_factor = 1;
    debug.rope_scaling.original_max_seq_len = 8192;
    debug.moe.num_experts = 8;
    debug.moe.top_k = 1;
    debug.moe.num_shared_experts = 1;
    debug.moe.score_func = ScoreFunc::Sigmoid;
    debug.moe.score_before_experts = true;
    m["debugmodel"] = debug;
    auto big = [&](int64_t experts, int64_t interleave, bool scaled_rope) {
      Llama4Args a = debug;
      a.dim = 5120;
      a.n_layers = 48;
      a.n_heads = 40;
      a.n_kv_heads = 8;
      a.vocab_size = 202048;
      a.ffn_dim_multiplier = 1.2;
      a.multiple_of = 2048;
      a.max_seq_len = 131072;
      if (!scaled_rope) a.rope_scaling = RopeScaling{};
      a.moe.num_experts = experts;
      a.interleave_moe_layer_step = interleave;
      return a;
    };
    m["17bx16e"] = big(16, 1, true);     // Llama-4 Scout
    m["17bx128e"] = big(128, 2, false);  // Llama-4 Maverick
    // torchtitan's iRoPE variants (flex attention, block-causal, NoPE every 4th layer).
    auto irope = [](Llama4Args a, int64_t block) {
      a.attn_type = AttnType::Flex;
      a.attn_mask = AttnMask::BlockCausal;
      a.every_n_layers_nope = 4;
      a.fixed_attn_block_size = block;
      return a;
    };
    m["debugmodel_irope"] = irope(debug, 256);
    m["17bx16e_irope"] = irope(m["17bx16e"], 8192);
    m["17bx128e_irope"] = irope(m["17bx128e"], 8192);
    return m;
  }();
  return f;
}

}  // namespace

std::vector<std::string> llama4_flavor_names() {
  return {"debugmodel",    "debugmodel_irope", "17bx16e",
          "17bx16e_irope", "17bx128e",         "17bx128e_irope"};
}

Llama4Args llama4_flavor(const std::string& flavor) {
  return find_flavor(flavors(), llama4_flavor_names(), "llama4", flavor);
}

Llama4::Llama4(const Llama4Args& a, at::Device device) : args_(a) {
  validate_router_args(a.moe, "llama4");
  if (a.interleave_moe_layer_step < 1)
    throw UserError("llama4 interleave_moe_layer_step = " +
                    std::to_string(a.interleave_moe_layer_step) + "; allowed: >= 1");
  if (a.n_heads % a.n_kv_heads != 0)
    throw UserError("llama4 n_kv_heads = " + std::to_string(a.n_kv_heads) +
                    " does not divide n_heads = " + std::to_string(a.n_heads));
  const int64_t hd = a.dim / a.n_heads;
  const int64_t ffn = llama_ffn_hidden(a.dim, a.multiple_of, a.ffn_dim_multiplier);
  const int64_t expert_hidden = llama4_expert_hidden(a);
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay, InitSpec init) {
    return params_.add(name, std::move(shape), device, decay, init);
  };
  tok_emb_ = P("tok_embeddings.weight", {a.vocab_size, a.dim}, false, InitSpec::normal(1.0));
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const bool moe = (l + 1) % a.interleave_moe_layer_step == 0;
    std::vector<int64_t> w = add_llama_block_params(params_, a, l, moe ? 0 : ffn, device);
    if (moe) {
      moe_.push_back(std::make_unique<MoELayer>(
          a.moe, a.dim, expert_hidden, "layers." + std::to_string(l) + ".moe.", params_, device,
          llama_out_std(l, a.n_layers, a.depth_init)));
      for (int64_t i : moe_.back()->param_indices()) w.push_back(i);
    } else {
      moe_.push_back(nullptr);
    }
    layers_.push_back(std::move(w));
  }
  norm_ = P("norm.weight", {a.dim}, false, InitSpec::ones());
  output_ = P("output.weight", {a.vocab_size, a.dim}, true, llama_output_init(a.dim));
  rope_ = rope_tables(hd, a.max_seq_len, a.rope_theta, a.rope_scaling, device);
  for (int64_t l = 0; l < a.n_layers; ++l)
    add_block(layers_[static_cast<size_t>(l)],
              [this, l](const at::Tensor& x, const std::vector<at::Tensor>& w) {
                return block(l, x, w);
              });

  declare_tp_plan(ffn);
  info_ = base_info("llama4", a.vocab_size, a.max_seq_len, a.dim, a.n_layers);
  info_.n_active_non_embedding = active_non_embedding_params();
  info_.attn_flops_dims = a.n_layers * a.n_heads * (hd + hd);
}

at::Tensor Llama4::block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w) {
  // w: attn_norm, wq, wk, wv, wo, ffn_norm, then the FFN's or the MoE layer's weights
  // seq_gather / seq_reduce: the sequence-parallel boundaries (identities on one rank). The
  // MoE layer takes this rank's sequence shard (routed here, or under expert tensor
  // parallelism gathered inside the layer).
  IRopeLayer irope;
  if (args_.every_n_layers_nope > 0) {
    irope.use_rope = layer % args_.every_n_layers_nope != 0;
    irope.chunk = irope.use_rope ? args_.fixed_attn_block_size : 0;
  }
  at::Tensor y = llama_attention_residual(x, w, args_.n_heads, args_.n_kv_heads, args_.norm_eps,
                                          rope_, this, irope);
  at::Tensor z = rms_norm(y, w[5], args_.norm_eps);
  if (MoELayer* m = moe_layer(layer))
    return y + m->forward(z, std::vector<at::Tensor>(w.begin() + 6, w.end()), moe_mode(layer));
  ModuleScope scope("feed_forward");
  return y + seq_swiglu(z, w[6], w[7], w[8]);
}

// As llama3's plan for attention, dense feed-forward layers and the vocabulary. The MoE
// layers' router and shared experts stay whole on every tp rank and run on its sequence
// shard, so their gradients, like the norms', are summed over the tp ranks; the routed
// experts likewise, unless expert tensor parallelism splits them (add_moe_to_tp_plan).
void Llama4::declare_tp_plan(int64_t ffn) {
  TpPlan plan;
  plan.vocab = {tok_emb_, output_};
  bool dense = false;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<int64_t>& w = layers_[l];
    plan.replicate.insert(plan.replicate.end(), {w[0], w[5]});
    plan.column.insert(plan.column.end(), {w[1], w[2], w[3]});
    plan.row.push_back(w[4]);
    if (moe_[l]) {
      add_moe_to_tp_plan(plan, *moe_[l]);  // w[6..]: the MoE layer's parameters
    } else {
      plan.column.insert(plan.column.end(), {w[6], w[8]});
      plan.row.push_back(w[7]);
      dense = true;
    }
  }
  plan.replicate.push_back(norm_);
  plan.divisible = {{"n_heads", args_.n_heads},
                    {"n_kv_heads", args_.n_kv_heads},
                    {"vocab_size", args_.vocab_size}};
  if (dense) plan.divisible.push_back({"the feed-forward hidden size", ffn});
  set_tp_plan(std::move(plan));
}

at::Tensor Llama4::forward_embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.size(1) <= args_.max_seq_len, "sequence longer than max_seq_len");
  return embed(weight(tok_emb_), tokens);  // (B, T, D), or this rank's (B, T/tp, D)
}

Model::Head Llama4::forward_final(const at::Tensor& h) {
  return {rms_norm(h, weight(norm_), args_.norm_eps), weight(output_)};
}

}  // namespace titan
