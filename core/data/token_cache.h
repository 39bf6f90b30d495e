// Raw text (.txt, .jsonl, ...) used directly as training data is tokenized once into a
// cached .tok v2 file, so a restart (or another rank) maps tokens instead of tokenizing again.
//
// The cache file is $TITAN_CACHE/tokcache/<name>-<key>.tok (TITAN_CACHE defaults to
// ~/.cache/titan-train). <key> is a 64-bit hash of: the input's absolute path, size and
// mtime (ns); the tokenizer file's content hash; the BOS/EOS framing and the JSON field. A
// sidecar <name>-<key>.key holds the key's text, and a file is reused only when it matches,
// so a hash collision rebuilds instead of reusing. Editing or touching the input, or changing
// the tokenizer, therefore builds a new file; old ones stay until deleted by hand.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/data/tokenize_pipeline.h"
#include "core/tokenizer/tokenizer.h"

namespace titan {

struct TokenCacheOptions {
  std::string cache_dir;  // empty: $TITAN_CACHE/tokcache
  int threads = 0;        // encoding threads of the builder; 0: one per CPU
  std::string field = "text";
  bool bos = true, eos = true;
  // Whether this process builds a missing cache file: the node's local rank 0. Several
  // builders (one per node on a shared file system) are safe: each writes a temporary file
  // and renames it, and the files are identical.
  bool builder = true;
  // Called exactly once by every process: by the builder after building (also when building
  // failed), by the others before they look for the file. The trainer passes a barrier over
  // the node's ranks; leave it empty in a single process.
  std::function<void()> barrier;
  std::function<void(const TokenizeProgress&)> progress;  // builder only
};

struct TokenCacheResult {
  std::string path;              // the cached .tok v2 file
  bool reused = false;           // true: found complete; this process tokenized nothing
  int64_t docs = 0, tokens = 0;  // of the build; 0 when reused (the file's header has them)
  std::string log_line;          // one line for the start-up log, saying reused or built
};

// Returns the cache file for `raw_path`, building it first if this process is the builder
// and it is missing. `tokenizer_file` is the path `tok` was loaded from ("bytes" for the
// byte tokenizer). Throws UserError for bad input (as tokenize_files does) and, on a
// non-builder, when the builder produced no file.
TokenCacheResult ensure_token_cache(const std::string& raw_path, const Tokenizer& tok,
                                    const std::string& tokenizer_file,
                                    const TokenCacheOptions& opts);

// The cache file ensure_token_cache would use, without building it (for logs and tests).
std::string token_cache_path(const std::string& raw_path, const std::string& tokenizer_file,
                             const TokenCacheOptions& opts);

// "\ntokenizer_config <hash>" when a tokenizer_config.json sits beside the tokenizer file
// (it can change ids), else "": part of the cache key.
std::string tokenizer_config_hash(const std::string& tokenizer_file);

// 64-bit FNV-1a of a file's bytes, as 16 hex digits; "bytes" hashes the name itself.
std::string file_content_hash(const std::string& path);

}  // namespace titan
