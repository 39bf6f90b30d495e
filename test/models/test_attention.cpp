// Document-aware attention (docs/attention.md): document ids from the tokens, block-causal
// attention (GQA and MLA head shapes) and Llama-4's chunked form against PyTorch's own
// scaled_dot_product_attention (math kernel, fp64) with an explicit mask built here by loops
// over the tokens, forward and gradients to 1e-5 (relative: max|ours - ref| / max|ref|);
// per-document positions and loss, and recompute, on a small Llama-3.
#include <catch2/catch.hpp>

#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <vector>

#include "core/base/errors.h"
#include "core/train/documents.h"
#include "models/deepseek_v3.h"
#include "models/layers.h"
#include "models/llama3.h"
#include "models/qwen3.h"
#include "test_util.h"

using namespace titan;
using test::rel_err;

namespace {

constexpr int64_t kEos = 7;

// (B, T) tokens with EOS where `eos[b]` says, other tokens 100 + t (never EOS).
at::Tensor make_tokens(int64_t T, const std::vector<std::vector<int64_t>>& eos) {
  at::Tensor t = at::arange(100, 100 + T, at::kLong).repeat({static_cast<int64_t>(eos.size()), 1});
  for (size_t b = 0; b < eos.size(); ++b)
    for (int64_t p : eos[b]) t[static_cast<int64_t>(b)][p] = kEos;
  return t.contiguous();
}

// The mask torchtitan's document_mask & causal_mask describe, by loops: key j is visible to
// query i when j <= i and no EOS lies in [j, i) (an EOS ends its own document); with chunk
// > 0 also i / chunk == j / chunk.
at::Tensor reference_mask(const at::Tensor& tokens, int64_t chunk = 0, bool docs = true) {
  const int64_t B = tokens.size(0), T = tokens.size(1);
  at::Tensor m = at::zeros({B, 1, T, T}, at::kBool);
  auto tk = tokens.accessor<int64_t, 2>();
  auto acc = m.accessor<bool, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = i; j >= 0; --j) {
        if (docs && j < i && tk[b][j] == kEos) break;
        if (chunk > 0 && i / chunk != j / chunk) break;
        acc[b][0][i][j] = true;
      }
  return m;
}

struct Grads {
  at::Tensor out, dq, dk, dv;
};

// q (B, T, H, Dqk), k (B, T, Hkv, Dqk), v (B, T, Hkv, Dv) fp32; ours through the entry point.
Grads ours(const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0, const Documents& d,
           const at::Tensor& gout) {
  at::Tensor q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(),
             v = v0.clone().requires_grad_();
  at::Tensor o = attention(q, k, v, 0.3, nullptr, &d);
  o.backward(gout);
  return {o.detach(), q.grad(), k.grad(), v.grad()};
}

// PyTorch's SDPA (math) in fp64 with the explicit mask, kv heads repeated.
Grads reference(const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0,
                const at::Tensor& mask, const at::Tensor& gout) {
  const int64_t B = q0.size(0), T = q0.size(1), H = q0.size(2), Hkv = k0.size(2);
  at::Tensor q = q0.to(at::kDouble).requires_grad_(), k = k0.to(at::kDouble).requires_grad_(),
             v = v0.to(at::kDouble).requires_grad_();
  at::Tensor kk = k.repeat_interleave(H / Hkv, 2), vv = v.repeat_interleave(H / Hkv, 2);
  // The math kernel takes an additive mask (the bool conversion is SDPA's front end's).
  at::Tensor add = at::zeros(mask.sizes(), at::kDouble).masked_fill(mask.logical_not(), -INFINITY);
  at::Tensor o = std::get<0>(at::_scaled_dot_product_attention_math(
      q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), add, 0.0, false, std::nullopt,
      0.3));
  o = o.transpose(1, 2).reshape({B, T, -1});
  o.backward(gout.to(at::kDouble));
  return {o.detach(), q.grad(), k.grad(), v.grad()};
}

void check_against_reference(int64_t H, int64_t Hkv, int64_t dqk, int64_t dv,
                             const at::Tensor& tokens, int64_t chunk = 0) {
  const int64_t B = tokens.size(0), T = tokens.size(1);
  at::manual_seed(3);
  at::Tensor q = at::randn({B, T, H, dqk}), k = at::randn({B, T, Hkv, dqk}),
             v = at::randn({B, T, Hkv, dv}), gout = at::randn({B, T, H * dv});
  Documents d = documents_from_tokens(tokens, kEos, /*block_causal=*/true, false);
  if (chunk > 0) d = chunked_documents(&d, B, T, chunk, at::kCPU);
  Grads a = ours(q, k, v, d, gout);
  Grads r = reference(q, k, v, reference_mask(tokens, chunk), gout);
  CHECK(rel_err(a.out, r.out.to(at::kFloat)) < 1e-5);
  CHECK(rel_err(a.dq, r.dq.to(at::kFloat)) < 1e-5);
  CHECK(rel_err(a.dk, r.dk.to(at::kFloat)) < 1e-5);
  CHECK(rel_err(a.dv, r.dv.to(at::kFloat)) < 1e-5);
}

}  // namespace

TEST_CASE("documents: ids, positions and varlen offsets from the tokens", "[attention]") {
  // Window 0: EOS at 0 (a 1-token document), 3 and the last position; window 1: none.
  const int64_t T = 8;
  at::Tensor tok = make_tokens(T, {{0, 3, 7}, {}});
  Documents d = documents_from_tokens(tok, kEos, true, /*positions=*/true);
  CHECK(d.doc_ids.equal(
      at::tensor({0, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0}, at::kLong).view({2, T})));
  CHECK(d.positions.equal(
      at::tensor({0, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7}, at::kLong).view({2, T})));
  // Sequences start at 0, 1, 4 (window 0) and 8 (window 1); then 16 repeated.
  std::vector<int> want = {0, 1, 4, 8};
  want.resize(17, 16);
  CHECK(varlen_cu_seqlens(d.doc_ids).equal(at::tensor(want, at::kInt)));
}

TEST_CASE("attention: block-causal GQA equals SDPA with an explicit document mask", "[attention]") {
  // T = 384: three CPU query tiles, documents crossing the tiles' edges.
  const int64_t T = 384;
  SECTION("documents ending at the window's edges") {
    check_against_reference(4, 2, 8, 8, make_tokens(T, {{0, 127, 128, 200, 383}, {255, 256}}));
  }
  SECTION("one document per window equals causal") {
    at::Tensor tok = make_tokens(T, {{}, {}});
    check_against_reference(4, 2, 8, 8, tok);
    at::manual_seed(5);
    at::Tensor q = at::randn({2, T, 4, 8}), k = at::randn({2, T, 2, 8}),
               v = at::randn({2, T, 2, 8});
    Documents d = documents_from_tokens(tok, kEos, true, false);
    CHECK(rel_err(attention(q, k, v, 0.3, nullptr, &d), causal_attention(q, k, v, 0.3)) < 1e-6);
  }
  SECTION("every token its own document") {
    std::vector<int64_t> all(T);
    for (int64_t t = 0; t < T; ++t) all[static_cast<size_t>(t)] = t;
    check_against_reference(4, 2, 8, 8, make_tokens(T, {all, all}));
  }
}

TEST_CASE("attention: block-causal MLA shapes (qk head 12, v head 8) equal the reference",
          "[attention]") {
  const int64_t T = 260;
  check_against_reference(3, 3, 12, 8, make_tokens(T, {{5, 6, 7, 130, 259}}));
  std::vector<int64_t> all(T);
  for (int64_t t = 0; t < T; ++t) all[static_cast<size_t>(t)] = t;
  check_against_reference(3, 3, 12, 8, make_tokens(T, {all}));
}

TEST_CASE("attention: Llama-4 chunked attention equals the causal & document & chunk mask",
          "[attention]") {
  // Chunks of 64 over documents that cross them.
  check_against_reference(4, 2, 8, 8, make_tokens(256, {{30, 100, 191}, {}}), /*chunk=*/64);
}

TEST_CASE("attention: bad mask or attention type names the key", "[attention]") {
  CHECK_THROWS_AS(parse_attn_mask("sliding", "model.attn_mask_type"), UserError);
  CHECK_THROWS_WITH(parse_attn_type("flash", "model.attn_type"),
                    Catch::Contains("model.attn_type") && Catch::Contains("sdpa, flex, varlen"));
  CHECK(parse_attn_mask("block_causal", "k") == AttnMask::BlockCausal);
  CHECK(llama3_flavor("debugmodel_varlen_attn").attn_mask == AttnMask::BlockCausal);
  CHECK(deepseek_v3_flavor("16B").attn_mask == AttnMask::BlockCausal);
}

namespace {

Llama3Args tiny() {
  Llama3Args a;
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 128;
  a.multiple_of = 32;
  a.max_seq_len = 64;
  return a;
}

double loss_of(Model& m, const at::Tensor& tok, const at::Tensor& lab) {
  return m.token_loss_sum(tok, lab).item<double>();
}

}  // namespace

TEST_CASE("documents: block-causal, per-document positions and loss on a small Llama-3",
          "[attention]") {
  Llama3 m(tiny(), at::kCPU);
  m.init_weights(11);
  {
    // Sharper attention than the init's near-uniform scores (q.k ~ 0), so that positions,
    // which only enter through q.k, move the loss well past the tolerance.
    at::NoGradGuard ng;
    for (auto& p : m.params().all())
      if (p.name.find(".wq.") != std::string::npos || p.name.find(".wk.") != std::string::npos)
        p.value.mul_(8.0);
  }
  const int64_t T = 32;
  at::Tensor with_docs = make_tokens(T, {{5, 20}, {9}}).remainder(128);
  at::Tensor no_docs = make_tokens(T, {{}, {}}).remainder(128);
  at::Tensor lab_d = with_docs.roll(-1, 1), lab_n = no_docs.roll(-1, 1);
  const double base_d = loss_of(m, with_docs, lab_d), base_n = loss_of(m, no_docs, lab_n);
  auto with = [&](DocumentOptions o) {
    o.eos_id = kEos;
    m.set_documents(o);
    std::pair<double, double> r{loss_of(m, with_docs, lab_d), loss_of(m, no_docs, lab_n)};
    m.set_documents({});
    return r;
  };
  // fp32 sums of 64 token losses: equal runs agree to 1e-5 relative, changed ones differ by
  // far more.
  auto same = [](double a, double b) { return std::abs(a - b) <= 1e-5 * std::abs(b); };
  DocumentOptions bc;
  bc.mask = AttnMask::BlockCausal;
  auto r = with(bc);
  CHECK_FALSE(same(r.first, base_d));
  CHECK(same(r.second, base_n));
  DocumentOptions pos;
  pos.positions = true;
  r = with(pos);
  CHECK_FALSE(same(r.first, base_d));
  CHECK(same(r.second, base_n));
  DocumentOptions loss;
  loss.loss = true;
  r = with(loss);
  CHECK_FALSE(same(r.first, base_d));
  CHECK(same(r.second, base_n));
  // Per-document loss drops exactly the EOS inputs' labels (3 here).
  at::Tensor per_token = lab_d.clone();
  per_token.masked_fill_(with_docs.eq(kEos), -100);
  CHECK(same(r.first, loss_of(m, with_docs, per_token)));
}

TEST_CASE("documents: a recomputed block sees its own micro-batch's documents", "[attention]") {
  // Forward A, then forward B (another packing), then A's backward: with activation
  // checkpointing the recompute of A's blocks must use A's mask (as a pipeline schedule
  // interleaves micro-batches). Reference: A's gradients without checkpointing. Same ops in
  // the same order, so the tolerance is fp32 rounding (1e-6 relative).
  const int64_t T = 32;
  at::Tensor a = make_tokens(T, {{3, 17}}).remainder(128), b = make_tokens(T, {{8}}).remainder(128);
  DocumentOptions o;
  o.mask = AttnMask::BlockCausal;
  o.positions = true;
  o.eos_id = kEos;
  auto grads = [&](bool recompute) {
    Llama3 m(tiny(), at::kCPU);
    m.init_weights(5);
    m.set_documents(o);
    if (recompute) m.set_recompute_policy([](int64_t) { return true; });
    at::Tensor la = m.token_loss_sum(a, a.roll(-1, 1));
    at::Tensor lb = m.token_loss_sum(b, b.roll(-1, 1));
    la.backward();
    std::vector<at::Tensor> g;
    for (auto& p : m.params().all()) g.push_back(p.value.grad().clone());
    return g;
  };
  auto ref = grads(false), got = grads(true);
  REQUIRE(ref.size() == got.size());
  for (size_t i = 0; i < ref.size(); ++i) CHECK(rel_err(got[i], ref[i]) < 1e-6);
}

// Per-document positions in Qwen3 (half-rotation RoPE, q/k norms, GQA). RoPE's scores depend
// only on the distance between tokens, so under the block-causal mask a packed document is
// computed as if alone at the start of a window, with or without restarted positions: the
// second document of a packed window gets the logits it gets on its own, to 1e-5 relative.
// Positions show under the causal mask, where the second document also sees the first: there
// restarting them changes its logits, and changes nothing on a window without an EOS.
TEST_CASE("documents: Qwen3 per-document positions and the block-causal mask",
          "[attention][qwen3]") {
  Qwen3Args a;
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.head_dim = 32;
  a.hidden_dim = 96;
  a.vocab_size = 128;
  a.max_seq_len = 64;
  Qwen3 m(a, at::kCPU);
  m.init_weights(5);
  {
    at::NoGradGuard ng;  // sharper q.k, so positions move the logits well past the tolerance
    for (auto& p : m.params().all())
      if (p.name.find(".wq.") != std::string::npos || p.name.find(".wk.") != std::string::npos)
        p.value.mul_(8.0);
  }
  const int64_t T = 24, first = 10;  // document A: tokens 0..9 (EOS at 9); B: 10..23
  at::Tensor packed = make_tokens(T, {{first - 1}}).remainder(128);
  at::Tensor alone = packed.narrow(1, first, T - first).contiguous();
  at::Tensor plain = make_tokens(T, {{}}).remainder(128);
  auto logits = [&](AttnMask mask, bool positions, const at::Tensor& tok) {
    at::NoGradGuard ng;
    DocumentOptions o;
    o.mask = mask;
    o.positions = positions;
    o.eos_id = kEos;
    m.set_documents(o);
    at::Tensor y = m.forward(tok).to(at::kDouble);
    m.set_documents({});
    return y;
  };
  auto rel = [](const at::Tensor& x, const at::Tensor& ref) {
    return (x - ref).abs().max().item<double>() / ref.abs().max().item<double>();
  };
  const auto BC = AttnMask::BlockCausal, C = AttnMask::Causal;
  const at::Tensor ref = logits(BC, true, alone);
  CHECK(rel(logits(BC, true, packed).narrow(1, first, T - first), ref) < 1e-5);
  CHECK(rel(logits(BC, false, packed).narrow(1, first, T - first), ref) < 1e-5);
  CHECK(rel(logits(C, true, packed), logits(C, false, packed)) > 1e-3);
  CHECK(rel(logits(C, true, plain), logits(C, false, plain)) < 1e-6);
}
