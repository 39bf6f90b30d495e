// Raw text -> token shards, in parallel and in bounded memory:
//
//   reader thread (TextSource: files in order, cut into ~1 MiB batches of records)
//     -> N worker threads (decode_record + Tokenizer::encode + BOS/EOS framing, per batch)
//     -> the calling thread writes the batches in input order (TokenShardWriter)
//
// Batches are numbered by the reader and written in that order, so the output is the same
// for every thread count. At most 2N + 2 batches are alive at once (read, queued, encoded
// or waiting for their turn), which bounds memory at a few MiB per thread plus the longest
// document, whatever the input's size.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/data/token_writer.h"
#include "core/tokenizer/tokenizer.h"

namespace titan {

struct TokenizeProgress {
  int64_t docs = 0, tokens = 0;
  uint64_t bytes_done = 0, bytes_total = 0;  // input file bytes (compressed for .gz/.zst)
  double seconds = 0;
};

struct TokenizeOptions {
  TokenFileFormat format = TokenFileFormat::kTok;
  int64_t shard_tokens = 0;  // see TokenWriterOptions
  int threads = 1;           // encoding threads; 0: one per CPU
  std::string field = "text";
  size_t batch_bytes = 1 << 20;  // text per work item (TextReaderOptions::batch_bytes)
  bool bos = true, eos = true;   // frame each document; skipped with a warning when the
                                 // tokenizer has no such token
  // Called on the calling thread about twice a second while running.
  std::function<void(const TokenizeProgress&)> progress;
  // Polled as often; returning true stops the run with a UserError, temporaries removed.
  std::function<bool()> cancelled;
};

struct TokenizeResult {
  int64_t docs = 0, tokens = 0;
  uint64_t input_bytes = 0;
  double seconds = 0;
  int threads = 0;                   // encoding threads used (0: no encoding, a .tok conversion)
  std::vector<std::string> outputs;  // .tok files, or the .bin of each Megatron pair
};

// Tokenizes text files (each a format open_text_source reads; see expand_input_specs)
// into shards at `output` (token_shard_path names them). Throws UserError for bad input,
// naming the file and where; nothing is left at `output` then.
TokenizeResult tokenize_files(const std::vector<std::string>& files, const Tokenizer& tok,
                              const std::string& output, const TokenizeOptions& opts);

// Rewrites a version-1 .tok file (documents stored without BOS/EOS) as version 2, framing
// each document as opts says. Streams; memory does not grow with the file.
TokenizeResult convert_tok_v1(const std::string& input, const Tokenizer& tok,
                              const std::string& output, const TokenizeOptions& opts);

// The first 12 bytes say whether `path` is a .tok file, and of which version (0: not one).
uint32_t tok_file_version(const std::string& path);

// "12,345 docs  3.4M tokens  12.3 MB/s  ETA 0:42" for a progress line.
std::string format_progress(const TokenizeProgress& p);

}  // namespace titan
