// Streaming writers of tokenized documents: .tok version 2 shards (docs/data.md, "Token
// files") or Megatron-LM indexed datasets (.bin + .idx, byte-identical to what megatron-core's
// IndexedDatasetBuilder writes with one sequence per document).
//
// Memory is O(1) in the data: tokens and per-document sizes are spilled to temporary files
// next to the output while a shard fills, and the shard is assembled when it is complete.
// Nothing is half-written: every file is written under a temporary name, and only commit()
// renames them, all at once, to their final names; a writer destroyed without commit()
// removes its temporaries.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace titan {

enum class TokenFileFormat { kTok, kMegatron };

struct TokenWriterOptions {
  TokenFileFormat format = TokenFileFormat::kTok;
  // A shard holds at most this many tokens (whole documents; a longer document gets a shard
  // of its own). 0: one shard.
  int64_t shard_tokens = 0;
  int64_t vocab_size = 0;  // of the tokenizer; picks the token width
};

// The output's path without its format extension (.tok; .bin or .idx).
std::string token_output_base(const std::string& output, TokenFileFormat f);
// Final file of shard i of n: BASE.tok when n == 1, else BASE_000000.tok, ... (for Megatron,
// the .bin; its .idx sits next to it).
std::string token_shard_path(const std::string& base, TokenFileFormat f, int64_t i, int64_t n);

// .tok v2 header fields (docs/data.md). The reader (core/data/token_source.h) has its own copies of
// the sizes; these names keep clear of them.
constexpr char kTokV2Magic[8] = {'T', 'I', 'T', 'A', 'N', 'T', 'O', 'K'};
constexpr uint32_t kTokV2Version = 2;
constexpr uint64_t kTokV2HeaderBytes = 64;
constexpr uint64_t kTokV2Align = 4096;
// Bytes per token for a vocabulary: 2 up to 65536 ids, else 4.
inline uint32_t tok_token_bytes(int64_t vocab) {
  return vocab <= 65536 ? 2 : 4;
}
// Megatron's rule (DType.optimal_dtype): uint16 (code 8) below 65500 ids, else int32 (code 4).
inline bool megatron_uses_u16(int64_t vocab) {
  return vocab < 65500;
}

class TokenShardWriter {
 public:
  TokenShardWriter(const std::string& output, const TokenWriterOptions& opts);
  ~TokenShardWriter();
  TokenShardWriter(const TokenShardWriter&) = delete;
  TokenShardWriter& operator=(const TokenShardWriter&) = delete;

  // One framed document; ids must be in [0, vocab_size).
  void add_document(const int32_t* ids, size_t n);
  // Completes the last shard, fsyncs and renames every shard to its final name. Returns
  // the final paths (.tok files, or the .bin of each Megatron pair).
  std::vector<std::string> commit();

  int64_t documents() const { return docs_; }
  int64_t tokens() const { return tokens_; }
  int64_t shards() const { return static_cast<int64_t>(shards_.size()); }

  class Shard;

 private:
  void start_shard();

  std::string base_;
  TokenWriterOptions opts_;
  std::vector<std::unique_ptr<Shard>> shards_;
  int64_t docs_ = 0, tokens_ = 0;
  bool committed_ = false;
};

}  // namespace titan
