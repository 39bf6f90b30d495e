// Text <-> token ids: a raw byte tokenizer, and any BPE tokenizer.json of Hugging Face
// `tokenizers` (byte-level as GPT-2 / Llama-3, SentencePiece-style as Llama-2 / Mistral /
// Gemma; what loads and why: docs/tokenizer.md).
//
// Contract of encode(): the input is any byte string, valid UTF-8 or not. For valid UTF-8 the
// ids equal Hugging Face tokenizers' `encode(text, add_special_tokens=False).ids`. Invalid
// UTF-8 cannot be compared with HF (a Python str cannot hold it), so for it we promise only
// that decode(encode(bytes)) == bytes when the tokenizer can represent every byte (byte-level
// BPE, or byte_fallback without a text-changing normalizer). encode() is const and
// thread-safe without locks: many threads may encode with one Tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace titan {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // No BOS/EOS added; see encode_document.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // HF's decode(ids, skip_special_tokens=False), but raw bytes, not repaired to valid UTF-8
  // (HF returns U+FFFD instead), so that decode inverts encode byte for byte. Throws
  // std::out_of_range for an id the vocabulary lacks.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // Max id + 1, counting added tokens.
  virtual int64_t vocab_size() const = 0;
  // -1 when the tokenizer has no such token.
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
};

// ids 0..255 are the bytes, 256 is BOS and 257 EOS. BOS/EOS decode to nothing: they mark
// document boundaries, not text.
class ByteTokenizer : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return 258; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
};

// Loads a Hugging Face tokenizer.json (model type BPE), or returns the ByteTokenizer when
// path == "bytes". A tokenizer_config.json in the same folder adds its special tokens and
// names BOS/EOS, as torchtitan's HuggingFaceTokenizer does. Throws UserError for a missing,
// unreadable, malformed or unsupported file (one line naming the file and the JSON key).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// encode() with BOS in front and/or EOS at the end. Throws UserError when asked for a
// special token the tokenizer lacks.
std::vector<int32_t> encode_document(const Tokenizer& tok, std::string_view text, bool bos,
                                     bool eos);

// The GPT-2 byte-to-unicode table used by the ByteLevel pre-tokenizer and decoder: printable
// bytes map to themselves, the others to U+0100 + n in byte order. Returned as UTF-8.
const std::string& byte_level_char(uint8_t byte);

}  // namespace titan
