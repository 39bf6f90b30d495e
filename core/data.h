// Training data: documents from text, JSONL or pre-tokenized files; a held-out split;
// packing into windows of seq_len + 1 tokens; a per-rank, resumable loader.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tokenizer.h"

namespace titan {

// Tokenized documents: doc d is tokens[offsets[d], offsets[d + 1]) (no BOS/EOS yet).
struct TokenizedDocs {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets{0};
  int64_t vocab_size = 0;
  int64_t num_docs() const { return static_cast<int64_t>(offsets.size()) - 1; }
};

// Reads documents from a .txt (blank-line separated), .jsonl ("text" field) or .tok file
// (already tokenized; its vocab must not exceed the tokenizer's). Throws UserError for a
// missing, empty or non-UTF-8 file, naming it.
TokenizedDocs load_documents(const std::string& path, const Tokenizer& tok);
std::vector<std::string> read_text_documents(const std::string& path);

// Pre-tokenized file: magic "TITANTOK", u32 version 1, u32 bytes per token (2 or 4),
// u64 docs, u64 tokens, u64 vocab, then u64 offsets[docs + 1], then the tokens (LE).
void write_token_file(const std::string& path, const TokenizedDocs& docs);
TokenizedDocs read_token_file(const std::string& path);

// The last `holdout_fraction` of the documents (at least one when > 0 and there are two or
// more documents) form the held-out split. Each split is packed as
// [BOS doc EOS][BOS doc EOS]... into one token stream.
struct Splits {
  std::vector<int32_t> train, heldout;
};
Splits split_and_pack(const TokenizedDocs& docs, double holdout_fraction, int32_t bos, int32_t eos);

struct Batch {
  at::Tensor tokens;  // (B, T) int64, CPU
  at::Tensor labels;  // (B, T) int64, CPU: tokens shifted left by one
};

// Cuts the stream into non-overlapping windows of seq_len + 1 tokens. Each epoch visits the
// windows in a seeded random order (or in order when shuffle is false); data-parallel rank r
// of n takes every n-th window of that order, so ranks read disjoint windows. The position
// (epoch, cursor) is the loader's whole state.
class PackedLoader {
 public:
  PackedLoader(const std::vector<int32_t>* stream, int64_t seq_len, int64_t batch_size,
               int64_t dp_rank, int64_t dp_size, uint64_t seed, bool shuffle);
  Batch next();
  int64_t windows_per_rank() const { return per_rank_; }

  struct State {
    int64_t epoch = 0;
    int64_t cursor = 0;  // windows of this rank consumed in the current epoch
  };
  State state() const { return st_; }
  void load_state(const State& s);

 private:
  void build_order();
  const std::vector<int32_t>* stream_;
  int64_t seq_len_, batch_, rank_, dp_;
  uint64_t seed_;
  bool shuffle_;
  int64_t n_windows_ = 0, per_rank_ = 0;
  std::vector<int64_t> order_;  // this rank's window indices for the current epoch
  State st_;
};

}  // namespace titan
