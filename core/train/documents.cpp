#include "core/train/documents.h"

#include <ATen/core/grad_mode.h>

#include "core/base/errors.h"

namespace titan {
namespace {
thread_local const Documents* g_current = nullptr;
}  // namespace

AttnMask parse_attn_mask(const std::string& s, const std::string& key) {
  if (s == "causal") return AttnMask::Causal;
  if (s == "block_causal") return AttnMask::BlockCausal;
  throw UserError(key + " = \"" + s + "\" is not an attention mask; allowed: causal, block_causal");
}

AttnType parse_attn_type(const std::string& s, const std::string& key) {
  if (s == "sdpa") return AttnType::Sdpa;
  if (s == "flex") return AttnType::Flex;
  if (s == "varlen") return AttnType::Varlen;
  throw UserError(key + " = \"" + s + "\" is not an attention type; allowed: sdpa, flex, varlen");
}

const char* attn_mask_name(AttnMask m) {
  return m == AttnMask::BlockCausal ? "block_causal" : "causal";
}

const char* attn_type_name(AttnType t) {
  switch (t) {
    case AttnType::Sdpa:
      return "sdpa";
    case AttnType::Flex:
      return "flex";
    case AttnType::Varlen:
      return "varlen";
  }
  return "?";
}

Documents documents_from_tokens(const at::Tensor& tokens, int64_t eos_id, bool block_causal,
                                bool positions) {
  TORCH_CHECK(tokens.dim() == 2, "documents_from_tokens: tokens ", tokens.sizes());
  TORCH_CHECK(eos_id >= 0, "documents_from_tokens: no EOS id");
  at::NoGradGuard ng;
  Documents d;
  d.block_causal = block_causal;
  const at::Tensor eos = tokens.eq(eos_id).to(at::kLong);  // (B, T)
  // Exclusive prefix sum: the EOS itself still belongs to the document it ends.
  d.doc_ids = at::cumsum(eos, 1).sub_(eos);
  if (positions) {
    const int64_t T = tokens.size(1);
    const at::Tensor t = at::arange(T, tokens.options().dtype(at::kLong)).expand_as(eos);
    // A document starts at t = 0 and after each EOS; its start is the running maximum of the
    // start positions seen so far.
    at::Tensor starts = at::zeros_like(eos);
    if (T > 1) starts.narrow(1, 1, T - 1).copy_(eos.narrow(1, 0, T - 1).mul(t.narrow(1, 1, T - 1)));
    d.positions = t - std::get<0>(at::cummax(starts, 1));
  }
  return d;
}

Documents chunked_documents(const Documents* docs, int64_t B, int64_t T, int64_t chunk,
                            at::Device device) {
  TORCH_CHECK(chunk > 0, "chunked_documents: chunk ", chunk);
  Documents d;
  d.block_causal = true;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor c = at::arange(T, opts).div_(chunk, "floor").unsqueeze(0).expand({B, T});
  if (docs == nullptr || !docs->block_causal) {
    d.doc_ids = c.contiguous();
  } else {
    const int64_t chunks = (T + chunk - 1) / chunk;
    d.doc_ids = docs->doc_ids * chunks + c;
  }
  if (docs != nullptr) d.positions = docs->positions;
  return d;
}

at::Tensor block_causal_mask(const at::Tensor& q_doc, const at::Tensor& k_doc,
                             const at::Tensor& q_pos, const at::Tensor& k_pos) {
  at::Tensor same = q_doc.unsqueeze(2).eq(k_doc.unsqueeze(1));    // (B, Tq, Tk)
  at::Tensor causal = k_pos.unsqueeze(0).le(q_pos.unsqueeze(1));  // (Tq, Tk)
  return same.logical_and_(causal.unsqueeze(0));
}

at::Tensor varlen_cu_seqlens(const at::Tensor& doc_ids) {
  at::NoGradGuard ng;
  const int64_t B = doc_ids.size(0), T = doc_ids.size(1), N = B * T;
  // A token starts a sequence when it starts its window or its document.
  at::Tensor start = at::ones_like(doc_ids, doc_ids.options().dtype(at::kBool));
  if (T > 1)
    start.narrow(1, 1, T - 1).copy_(doc_ids.narrow(1, 1, T - 1).ne(doc_ids.narrow(1, 0, T - 1)));
  start = start.reshape({N});
  const at::Tensor flat = at::arange(N, doc_ids.options().dtype(at::kLong));
  const at::Tensor k = at::cumsum(start.to(at::kLong), 0).sub_(1);  // sequence index of a start
  const at::Tensor pad = at::full({N}, N, flat.options());
  at::Tensor cu = at::full({N + 1}, N, flat.options());
  // Every non-start writes N into slot N, which already holds N: the result is the same in
  // any order.
  cu.scatter_(0, at::where(start, k, pad), at::where(start, flat, pad));
  return cu.to(at::kInt);
}

const Documents* current_documents() {
  return g_current;
}

DocumentsScope::DocumentsScope(const Documents* docs) : prev_(g_current) {
  g_current = docs;
}
DocumentsScope::~DocumentsScope() {
  g_current = prev_;
}

}  // namespace titan
