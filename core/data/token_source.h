// Pre-tokenized training data read through mmap as one token stream per source.
//
// A source is a path spec: one file, a Megatron prefix, a folder or a glob. Its shards are
// .tok v2 files, Megatron-LM indexed datasets (PREFIX.bin + PREFIX.idx) or llm.c shards, all
// of one format, in sorted path order; the source's stream is their tokens back to back.
// Opening reads headers only (O(files)); nothing proportional to the tokens or documents is
// allocated or read. Layouts and checks: docs/data.md "Formats".
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/base/mmap_file.h"

namespace titan {

enum class TokenFormat { Tok, Megatron, LlmC };
const char* token_format_name(TokenFormat f);  // "tok v2", "megatron", "llm.c"

// Element type of the tokens in a shard's file.
enum class TokenDtype { U8, I8, I16, U16, I32, U32, I64 };

// One file of a source (a Megatron .bin/.idx pair counts as one). Shards are built by
// TokenSource::open; their fields are read-only afterwards.
struct TokenShard {
  std::string path;  // the token file: the .tok, the .bin (Megatron and llm.c)
  TokenFormat format = TokenFormat::Tok;
  TokenDtype dtype = TokenDtype::U16;
  int item_size = 2;     // bytes per token
  MmapFile file;         // the token file, whole
  MmapFile index;        // Megatron: the .idx; otherwise unmapped
  size_t data_offset = 0;  // byte offset of token 0 in `file`
  int64_t num_tokens = 0;
  int64_t num_docs = -1;  // -1: unknown (llm.c)
  int64_t max_id = -1;    // from the header (.tok v2); -1: unknown, checked per read
  // Where document boundaries live (offsets into `file` or `index`).
  size_t doc_offsets_at = 0;     // .tok v2: u64[D + 1] token offsets
  int64_t megatron_seqs = 0;     // Megatron: S
  size_t pointers_at = 0;        // Megatron: i64 pointers[S] in the .idx
  size_t doc_indices_at = 0;     // Megatron: i64 document_indices[D + 1] in the .idx

  // Token offset (within this shard) where document d starts; d in [0, num_docs], d ==
  // num_docs gives num_tokens. O(1): one or two loads from the mapped index.
  int64_t doc_start(int64_t d) const;
};

class TokenSource {
 public:
  // Opens a path spec (a .tok, a Megatron .bin, .idx or prefix, an llm.c .bin, a folder or a
  // glob). vocab > 0: token ids must be below it — checked here from the header where the
  // format records the max id (.tok v2), otherwise on every read, naming file and offset.
  // Throws UserError for anything unreadable, naming the file and what was found.
  // `origin`: the user's file this one was tokenized from (a token cache of a .txt/.jsonl);
  // errors then name it first, with the cache file after it.
  static std::shared_ptr<const TokenSource> open(const std::string& spec, int64_t vocab,
                                                 const std::string& origin = "");

  const std::string& spec() const { return spec_; }
  TokenFormat format() const { return format_; }
  int64_t num_tokens() const { return token_starts_.back(); }
  int64_t num_docs() const { return doc_starts_.empty() ? -1 : doc_starts_.back(); }
  size_t num_shards() const { return shards_.size(); }
  const TokenShard& shard(size_t i) const { return *shards_[i]; }
  int64_t vocab() const { return vocab_; }

  // Stream position where document d starts, d in [0, num_docs()]. num_docs() must be known.
  int64_t doc_start(int64_t d) const;

  struct Location {
    size_t shard = 0;
    int64_t offset = 0;  // token offset within the shard
  };
  Location locate(int64_t pos) const;  // pos in [0, num_tokens())

  // Copies stream tokens [pos, pos + n) to out as int64, across shard boundaries. Ids in
  // shards without a header max are checked against [0, vocab): a bad one is a UserError
  // naming the shard and the token offset within it.
  void read(int64_t pos, int64_t n, int64_t* out) const;
  // Starts the I/O for stream tokens [pos, pos + n) without waiting (madvise WILLNEED).
  void will_need(int64_t pos, int64_t n) const;

 private:
  std::string spec_;
  static std::shared_ptr<const TokenSource> open(const std::string& spec, int64_t vocab,
                                                 const std::string& origin, std::nullptr_t);
  std::string origin_;  // the raw file a token cache was made from; empty otherwise
  // How errors name shard `path`, quoted: the user's raw file and its cache, or the path.
  std::string shown(const std::string& path) const;
  TokenFormat format_ = TokenFormat::Tok;
  int64_t vocab_ = 0;
  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::vector<int64_t> token_starts_{0};  // [num_shards + 1] cumulative tokens
  std::vector<int64_t> doc_starts_;       // [num_shards + 1] cumulative docs; empty if unknown
};

// Raw text the tokenize cache handles (.txt, .jsonl, .json, .gz, .zst, .parquet), by name.
bool is_raw_text_path(const std::string& path);

// Writes a .tok v2 file (temp file + rename). tokens are the already framed documents;
// doc_offsets[D + 1] run from 0 to tokens.size(); vocab is the tokenizer's vocabulary
// (u16 tokens when vocab <= 65536). For tests and small tools: everything is in memory.
void write_tok_v2(const std::string& path, const std::vector<int32_t>& tokens,
                  const std::vector<int64_t>& doc_offsets, int64_t vocab);

// .tok v2 header layout (docs/data.md).
constexpr size_t kTokHeaderBytes = 64;
constexpr size_t kTokAlign = 4096;  // the tokens section starts at a multiple of this

}  // namespace titan
