// Documents packed into a training window: their static-shape description, computed on the
// device from the tokens, and how it reaches the attention (docs/attention.md).
//
// torchtitan 0.2.2 packs documents, each ended by the tokenizer's EOS, into windows of T + 1
// tokens; the token after an EOS starts the next document. A window's structure is kept as
// per-token document ids (B, T): doc[b, t] = the number of EOS among tokens[b, 0..t-1]
// (torchtitan's get_document_mask_mod), a cumulative sum on the device with no host read,
// so the captured step and every executor get it from the token buffer alone.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace titan {

// The attention mask of a model (torchtitan's attn_mask_type).
enum class AttnMask { Causal, BlockCausal };
// torchtitan's attn_type: which kernel family the flavor asks for. titan-train picks the
// kernel per device from the mask (docs/attention.md); the type is kept for the flavor table
// and the log.
enum class AttnType { Sdpa, Flex, Varlen };

// Throws UserError naming `key` when `s` is not "causal" / "block_causal".
AttnMask parse_attn_mask(const std::string& s, const std::string& key);
// Throws UserError naming `key` when `s` is not "sdpa" / "flex" / "varlen".
AttnType parse_attn_type(const std::string& s, const std::string& key);
const char* attn_mask_name(AttnMask m);
const char* attn_type_name(AttnType t);

// What a model does with the documents of its windows (Model::set_documents).
struct DocumentOptions {
  AttnMask mask = AttnMask::Causal;
  AttnType type = AttnType::Sdpa;
  int64_t eos_id = -1;     // the tokenizer's EOS; needed when anything below is on
  bool positions = false;  // RoPE positions restart at 0 in each document
  bool loss = false;       // no label across a boundary: an EOS input's label is ignored
  bool active() const { return mask == AttnMask::BlockCausal || positions || loss; }
};

// One forward's documents, for the whole sequence (before context parallelism cuts it).
struct Documents {
  at::Tensor doc_ids;    // (B, T) int64: document index of each token within its window
  at::Tensor positions;  // (B, T) int64: position within its document; undefined: plain
  bool block_causal = false;
};

// doc_ids, and with `positions` the per-document positions, of tokens (B, T) int64. All
// device ops (eq, cumsum, cummax), no host read.
Documents documents_from_tokens(const at::Tensor& tokens, int64_t eos_id, bool block_causal,
                                bool positions);

// Llama-4's chunked attention as documents: ids that are equal exactly when two tokens share
// both their document (docs; null: one document per window) and their chunk of `chunk`
// positions of a sequence of T, so block-causal attention over them is torchtitan's
// causal & document & fixed-block mask. Keeps docs' positions.
Documents chunked_documents(const Documents* docs, int64_t B, int64_t T, int64_t chunk,
                            at::Device device);

// (B, Tq, Tk) bool, true where query i may attend key j: same document and key position <=
// query position. q_doc (B, Tq), k_doc (B, Tk) int64; q_pos (Tq), k_pos (Tk) int64 global
// positions (arange for a whole window).
at::Tensor block_causal_mask(const at::Tensor& q_doc, const at::Tensor& k_doc,
                             const at::Tensor& q_pos, const at::Tensor& k_pos);

// Varlen flash attention's cumulative sequence lengths for the B * T tokens of doc_ids (B, T)
// flattened row after row (each window's documents are separate sequences): (B * T + 1)
// int32, the start offset of every document in order, then B * T repeated (zero-length
// sequences), so the shape does not depend on the data. Device ops only (scatter).
at::Tensor varlen_cu_seqlens(const at::Tensor& doc_ids);

// The documents of the forward running on this thread (null: plain causal, nothing
// per-document). Model installs them for the length of a forward; activation checkpointing
// keeps them with a block and installs them again for its recompute (core/train/recompute.h).
const Documents* current_documents();

class DocumentsScope {
 public:
  explicit DocumentsScope(const Documents* docs);  // null: none while alive
  ~DocumentsScope();
  DocumentsScope(const DocumentsScope&) = delete;
  DocumentsScope& operator=(const DocumentsScope&) = delete;

 private:
  const Documents* prev_;
};

}  // namespace titan
