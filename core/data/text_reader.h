// Streaming readers of raw-text inputs: .txt (documents separated by blank lines), .jsonl,
// .jsonl.gz, .jsonl.zst (one JSON object per line, the document in a string field) and
// Parquet (a string column). Memory is bounded by the batch size and the longest document,
// never by the file: compressed inputs are decompressed in 1 MiB steps, Parquet is read in
// record batches with a buffered page stream.
//
// Work is split in two so that the expensive half runs on many threads: a TextSource cuts
// a file into raw records on one thread (lines, blank-line-separated documents, column
// values), and decode_record() turns one record into document text (UTF-8 check, JSON
// parse) on any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace titan {

enum class TextFormat { kTxt, kJsonl, kJsonlGz, kJsonlZst, kParquet };

// The format named by a file's extension (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet), or
// false when it is none of them.
bool text_format_of(const std::string& path, TextFormat* out);
const char* text_format_name(TextFormat f);
// "a .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file" (or without .parquet when this
// build has no Parquet support), for error messages.
std::string text_formats_allowed();
bool parquet_supported();

// Expands input specs into files, in order: a file is itself; a folder is its files whose
// extension `accept` takes, sorted by name (others are skipped; hidden files always);
// a glob (*, ?, [) is its matches, sorted, each of which must be accepted. Throws UserError
// for a missing path, an empty folder or glob, or a file `accept` refuses; `allowed` is
// the text the error gives as the allowed inputs.
std::vector<std::string> expand_input_specs(const std::vector<std::string>& specs,
                                            bool (*accept)(const std::string& path),
                                            const std::string& allowed);

// Raw records cut from one file, back to back in `data`: record i is
// data[ends[i-1], ends[i]). `offsets` locates each record for error messages: its byte
// offset in the (decompressed) file for .txt/.jsonl, its row for Parquet; `lines` is its
// 1-based line number (JSONL only, else empty).
struct TextBatch {
  std::string path;
  TextFormat format = TextFormat::kTxt;
  std::string data;
  std::vector<size_t> ends;
  std::vector<uint64_t> offsets;
  std::vector<int64_t> lines;
  size_t size() const { return ends.size(); }
  std::string_view record(size_t i) const {
    const size_t b = i ? ends[i - 1] : 0;
    return std::string_view(data).substr(b, ends[i] - b);
  }
  void clear() {
    data.clear();
    ends.clear();
    offsets.clear();
    lines.clear();
  }
};

struct TextReaderOptions {
  std::string field = "text";    // JSON key / Parquet column holding the document
  size_t batch_bytes = 1 << 20;  // a batch ends at the first record that reaches this size
};

class TextSource {
 public:
  virtual ~TextSource() = default;
  // Replaces `batch` with the next records (at least one); false at the end of the file.
  // Throws UserError for unreadable or corrupt input (naming the file and offset), for a
  // Parquet file without the field, and, at the end, for a file with no documents.
  virtual bool next(TextBatch& batch) = 0;
  // Input progress in file bytes (compressed bytes for .gz/.zst), for rate and ETA.
  virtual uint64_t bytes_done() const = 0;
  virtual uint64_t bytes_total() const = 0;
};

std::unique_ptr<TextSource> open_text_source(const std::string& path,
                                             const TextReaderOptions& opts);

// The document text of record i: a view into the batch (.txt, Parquet) or into `scratch`
// (JSONL, after unescaping). Throws UserError naming the file and byte offset for invalid
// UTF-8, and the file and line for a JSONL line that is not an object with a string `field`.
// Safe to call from many threads on different scratch strings.
std::string_view decode_record(const TextBatch& batch, size_t i, const std::string& field,
                               std::string& scratch);

// All documents of one file, in order (small files, tests).
std::vector<std::string> read_documents(const std::string& path,
                                        const TextReaderOptions& opts = {});

// Offset of the first invalid UTF-8 sequence in s, or npos. Overlong forms, surrogates and
// code points above U+10FFFF are invalid, as in Python's strict decoder.
size_t invalid_utf8_at(std::string_view s);

}  // namespace titan
