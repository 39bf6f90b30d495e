#include "models/qwen3.h"

#include <cmath>
#include <map>
#include <utility>

#include "core/base/errors.h"
#include "core/train/capture_check.h"
#include "core/train/documents.h"
#include "models/flavor_table.h"
#include "models/llama3.h"

namespace titan {

namespace {

Qwen3Args dense(int64_t dim, int64_t layers, int64_t heads, int64_t hidden, bool tie) {
  Qwen3Args a;
  a.dim = dim;
  a.n_layers = layers;
  a.n_heads = heads;
  a.n_kv_heads = 8;
  a.hidden_dim = hidden;
  a.tie_embeddings = tie;
  return a;
}

// torchtitan's MoE flavors: 128 experts (64 in the debug model), top 8 by softmax, the top-k
// weights renormalized to sum to 1, no shared expert, the weights applied to the experts'
// outputs. load_balance_coeff is MoEArgs' default (1e-3), a run option here.
Qwen3Args moe(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t experts,
              int64_t inter) {
  Qwen3Args a = dense(dim, layers, heads, 6144, false);
  a.n_kv_heads = kv_heads;
  a.moe_enabled = true;
  a.moe_inter_dim = inter;
  a.moe.num_experts = experts;
  a.moe.num_shared_experts = 0;
  a.moe.top_k = 8;
  a.moe.score_func = ScoreFunc::Softmax;
  a.moe.route_norm = true;
  a.moe.route_scale = 1.0;
  a.moe.score_before_experts = false;
  return a;
}

const std::map<std::string, Qwen3Args>& flavors() {
  static const std::map<std::string, Qwen3Args> f = [] {
    std::map<std::string, Qwen3Args> m;
    Qwen3Args debug = dense(256, 8, 16, 3072, true);
    debug.vocab_size = 2048;
    m["debugmodel"] = debug;
    m["0.6B"] = dense(1024, 28, 16, 3072, true);
    m["1.7B"] = dense(2048, 28, 16, 6144, true);
    m["4B"] = dense(2560, 36, 32, 9728, true);
    m["8B"] = dense(4096, 36, 32, 12288, false);
    m["14B"] = dense(5120, 40, 40, 17408, false);
    m["32B"] = dense(5120, 64, 64, 25600, false);
    Qwen3Args debug_moe = moe(256, 8, 16, 8, 64, 768);
    debug_moe.vocab_size = 2048;
    debug_moe.hidden_dim = 3072;
    m["debugmodel_moe"] = debug_moe;
    Qwen3Args a30 = moe(2048, 48, 32, 4, 128, 768);
    a30.max_seq_len = 262144;
    m["30B-A3B"] = a30;
    Qwen3Args a235 = moe(4096, 94, 64, 4, 128, 1536);
    a235.hidden_dim = 12288;
    a235.rope_theta = 5000000;
    m["235B-A22B"] = a235;
    return m;
  }();
  return f;
}

}  // namespace

std::vector<std::string> qwen3_flavor_names() {
  return {"debugmodel", "0.6B", "1.7B",           "4B",      "8B",
          "14B",        "32B",  "debugmodel_moe", "30B-A3B", "235B-A22B"};
}

Qwen3Args qwen3_flavor(const std::string& flavor) {
  return find_flavor(flavors(), qwen3_flavor_names(), "qwen3", flavor);
}

at::Tensor apply_rope_half(const at::Tensor& x, const RopeTables& rope) {
  const int64_t B = x.size(0), T = x.size(1), half = x.size(3) / 2;
  // Per-document positions (rope_rows with documents): one table row per token, B * T rows.
  const int64_t rows = rope.per_token ? B * T : T;
  TORCH_CHECK(2 * half == x.size(3) && rope.cos.size(1) == half && rope.cos.size(0) >= rows,
              "apply_rope_half: x ", x.sizes(), " against tables ", rope.cos.sizes());
  // (1 or B, T, 1, D/2) fp32, broadcast over heads (and batch for a shared table).
  const int64_t b = rope.per_token ? B : 1;
  const at::Tensor c = rope.cos.narrow(0, 0, rows).view({b, T, 1, half});
  const at::Tensor s = rope.sin.narrow(0, 0, rows).view({b, T, 1, half});
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor x1 = xf.narrow(3, 0, half), x2 = xf.narrow(3, half, half);
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, 3).to(x.scalar_type());
}

Qwen3::Qwen3(const Qwen3Args& a, at::Device device) : args_(a) {
  if (a.moe_enabled) validate_router_args(a.moe, "qwen3");
  for (auto [name, v] : {std::pair<const char*, int64_t>{"dim", a.dim},
                         {"n_heads", a.n_heads},
                         {"n_kv_heads", a.n_kv_heads},
                         {"head_dim", a.head_dim},
                         {"n_layers", a.n_layers}})
    if (v <= 0)
      throw UserError(std::string("qwen3 ") + name + " = " + std::to_string(v) + "; allowed: > 0");
  if (a.n_heads % a.n_kv_heads != 0)
    throw UserError("qwen3 n_kv_heads = " + std::to_string(a.n_kv_heads) +
                    " does not divide n_heads = " + std::to_string(a.n_heads));
  if (a.head_dim % 2 != 0)
    throw UserError("qwen3 head_dim = " + std::to_string(a.head_dim) + "; allowed: even");
  const int64_t hd = a.head_dim;
  auto P = [&](const std::string& name, std::vector<int64_t> shape, bool decay, InitSpec init) {
    return params_.add(name, std::move(shape), device, decay, init);
  };
  // As Llama-3: N(0, 1) unless it is also the output projection, which takes the output's
  // init (torchtitan re-initializes the tied weight as the output last).
  tok_emb_ = P("tok_embeddings.weight", {a.vocab_size, a.dim}, false,
               a.tie_embeddings ? llama_output_init(a.dim) : InitSpec::normal(1.0));
  const InitSpec in = InitSpec::trunc_normal(0.02);
  ffn_at_ = a.qk_norm ? 8 : 6;
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const double out_std = llama_out_std(l, a.n_layers, a.depth_init);
    const InitSpec out = InitSpec::trunc_normal(out_std);
    std::vector<int64_t> w;
    w.push_back(P(p + "attention_norm.weight", {a.dim}, false, InitSpec::ones()));
    w.push_back(P(p + "attention.wq.weight", {a.n_heads * hd, a.dim}, true, in));
    w.push_back(P(p + "attention.wk.weight", {a.n_kv_heads * hd, a.dim}, true, in));
    w.push_back(P(p + "attention.wv.weight", {a.n_kv_heads * hd, a.dim}, true, in));
    w.push_back(P(p + "attention.wo.weight", {a.dim, a.n_heads * hd}, true, out));
    w.push_back(P(p + "ffn_norm.weight", {a.dim}, false, InitSpec::ones()));
    if (a.qk_norm) {
      w.push_back(P(p + "attention.q_norm.weight", {hd}, false, InitSpec::ones()));
      w.push_back(P(p + "attention.k_norm.weight", {hd}, false, InitSpec::ones()));
    }
    if (a.moe_enabled) {
      moe_.push_back(std::make_unique<MoELayer>(a.moe, a.dim, a.moe_inter_dim, p + "moe.", params_,
                                                device, out_std));
      for (int64_t i : moe_.back()->param_indices()) w.push_back(i);
    } else {
      moe_.push_back(nullptr);
      w.push_back(P(p + "feed_forward.w1.weight", {a.hidden_dim, a.dim}, true, in));
      w.push_back(P(p + "feed_forward.w2.weight", {a.dim, a.hidden_dim}, true, out));
      w.push_back(P(p + "feed_forward.w3.weight", {a.hidden_dim, a.dim}, true, out));
    }
    layers_.push_back(std::move(w));
  }
  norm_ = P("norm.weight", {a.dim}, false, InitSpec::ones());
  if (!a.tie_embeddings)
    output_ = P("output.weight", {a.vocab_size, a.dim}, true, llama_output_init(a.dim));
  rope_ = rope_tables(hd, a.max_seq_len, a.rope_theta, RopeScaling{}, device);
  for (int64_t l = 0; l < a.n_layers; ++l)
    add_block(layers_[static_cast<size_t>(l)],
              [this, l](const at::Tensor& x, const std::vector<at::Tensor>& w) {
                return block(l, x, w);
              });

  declare_tp_plan();
  info_ = base_info("qwen3", a.vocab_size, a.max_seq_len, a.dim, a.n_layers);
  info_.n_active_non_embedding = active_non_embedding_params();
  info_.attn_flops_dims = a.n_layers * a.n_heads * (hd + hd);
}

// h (B, T, D), the normed input -> wo's input (B, T, H * hd), q/k/v projected through the
// sequence-parallel boundary (identities on one tp rank). Under tensor parallelism the
// projections hold whole heads, so q_norm and k_norm (per head, over hd) run on them as they
// are; under context parallelism RoPE reads this rank's positions, and with per-document
// positions each token's position in its document.
at::Tensor Qwen3::attention(const at::Tensor& h, const std::vector<at::Tensor>& w) const {
  std::vector<at::Tensor> qkv = seq_gather_project(h, {w[1], w[2], w[3]});
  const int64_t B = qkv[0].size(0), T = qkv[0].size(1), hd = args_.head_dim;
  at::Tensor q = qkv[0].view({B, T, -1, hd});  // (B, T, H[/tp], hd)
  at::Tensor k = qkv[1].view({B, T, -1, hd});  // (B, T, Hkv[/tp], hd)
  at::Tensor v = qkv[2].view({B, T, -1, hd});
  if (args_.qk_norm) {
    q = rms_norm(q, w[6], args_.norm_eps);
    k = rms_norm(k, w[7], args_.norm_eps);
  }
  // Per-document positions when the forward's documents carry them (docs/attention.md).
  const RopeTables rope = rope_rows(rope_, context_parallel(), B, T, current_documents());
  q = apply_rope_half(q, rope);
  k = apply_rope_half(k, rope);
  // The forward's documents pick the mask (causal, or block-causal: docs/attention.md).
  return titan::attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(hd)), context_parallel(),
                          current_documents());
}

at::Tensor Qwen3::block(int64_t layer, const at::Tensor& x, const std::vector<at::Tensor>& w) {
  at::Tensor y;
  {
    ModuleScope scope("attention");
    y = x + seq_project_reduce(attention(rms_norm(x, w[0], args_.norm_eps), w), w[4]);
  }
  at::Tensor z = rms_norm(y, w[5], args_.norm_eps);
  const std::vector<at::Tensor> ffn(w.begin() + static_cast<std::ptrdiff_t>(ffn_at_), w.end());
  if (MoELayer* m = moe_layer(layer)) return y + m->forward(z, ffn, moe_mode(layer));
  ModuleScope scope("feed_forward");
  return y + seq_swiglu(z, ffn[0], ffn[1], ffn[2]);
}

// Megatron's split as Llama-3's: q/k/v and w1/w3 by output rows (whole heads, hidden units),
// wo and w2 by input columns, the vocabulary by rows. The norms, q_norm and k_norm included,
// stay whole; q_norm and k_norm see this rank's heads, so their gradients, like the other
// norms', are partial sums over the tp ranks. MoE layers as Llama-4's (add_moe_to_tp_plan).
void Qwen3::declare_tp_plan() {
  TpPlan plan;
  plan.vocab.push_back(tok_emb_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::vector<int64_t>& w = layers_[l];
    plan.replicate.insert(plan.replicate.end(), {w[0], w[5]});
    if (args_.qk_norm) plan.replicate.insert(plan.replicate.end(), {w[6], w[7]});
    plan.column.insert(plan.column.end(), {w[1], w[2], w[3]});
    plan.row.push_back(w[4]);
    if (moe_[l]) {
      add_moe_to_tp_plan(plan, *moe_[l]);
    } else {
      plan.column.insert(plan.column.end(), {w[ffn_at_], w[ffn_at_ + 2]});
      plan.row.push_back(w[ffn_at_ + 1]);
    }
  }
  plan.replicate.push_back(norm_);
  if (output_ >= 0) plan.vocab.push_back(output_);
  plan.divisible = {{"n_heads", args_.n_heads},
                    {"n_kv_heads", args_.n_kv_heads},
                    {"vocab_size", args_.vocab_size}};
  if (!args_.moe_enabled)
    plan.divisible.push_back({"the feed-forward hidden size", args_.hidden_dim});
  set_tp_plan(std::move(plan));
}

at::Tensor Qwen3::forward_embed(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.size(1) <= args_.max_seq_len, "sequence longer than max_seq_len");
  at::Tensor emb = weight(tok_emb_);
  if (output_ < 0) tied_emb_ = emb;  // the output weight too: materialized once per forward
  return embed(emb, tokens);         // (B, T, D), or this rank's (B, T/tp, D)
}

Model::Head Qwen3::forward_final(const at::Tensor& h) {
  at::Tensor out = output_ >= 0 ? weight(output_) : std::exchange(tied_emb_, at::Tensor());
  return {rms_norm(h, weight(norm_), args_.norm_eps), out};
}

}  // namespace titan
