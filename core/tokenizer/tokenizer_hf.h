// Internal parts of the Hugging Face tokenizer.json reader (core/tokenizer/tokenizer_*.cpp);
// users go through core/tokenizer/tokenizer.h. Each part mirrors one stage of HF `tokenizers`
// 0.23: Unicode helpers, regex splitting with Oniguruma's iteration rules, normalizers,
// pre-tokenizers, the BPE model, the added vocabulary and the decoders. Every stage works on
// bytes, so text that is not valid UTF-8 passes through: an invalid byte acts as a one-byte
// character that no pattern, table or vocabulary entry matches.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace titan::tok {

using nlohmann::json;

// ---- Errors ----------------------------------------------------------------------------------

// Where we are in a tokenizer.json, for one-line UserErrors: "tokenizer file 'PATH': KEY ...".
struct Ctx {
  std::string path;
  [[noreturn]] void fail(const std::string& what) const;
  // The value of j[key] as a bool/string/etc., `def` when absent or null; UserError naming
  // `where.key` when it has the wrong type.
  bool get_bool(const json& j, const char* key, bool def, const std::string& where) const;
  std::string get_string(const json& j, const char* key, const std::string& def,
                         const std::string& where) const;
  // A string field that must be present.
  std::string need_string(const json& j, const char* key, const std::string& where) const;
};
std::string describe(const json& j);  // short JSON rendering for messages

// Token ids a tokenizer.json may use: [0, 2^24). The BPE model keeps an id -> token table of
// max id + 1 entries and the embedding has as many rows, so one stray id near 2^31 would ask
// for 16 GiB; 2^24 (16.7M) is 64x the largest released vocabulary (Gemma's 262K).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;
inline bool valid_token_id(const json& j) {
  return j.is_number_integer() && j.get<int64_t>() >= 0 && j.get<int64_t>() <= kMaxTokenId;
}
inline constexpr char kTokenIdRule[] = "ids must be integers in [0, 2^24)";

// ---- UTF-8 and Unicode properties -------------------------------------------------------------

// Decodes the character at p[0..n): its length, or 0 when p[0] starts no valid UTF-8
// sequence (overlong forms, surrogates and values past U+10FFFF are invalid, as in Rust).
inline size_t utf8_decode(const unsigned char* p, size_t n, uint32_t& cp) {
  unsigned c = p[0];
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  if (c < 0xC2 || c > 0xF4) return 0;
  if (c < 0xE0) {
    if (n < 2 || (p[1] & 0xC0) != 0x80) return 0;
    cp = ((c & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    return 2;
  }
  if (c < 0xF0) {
    if (n < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
    cp = ((c & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    return (cp < 0x800 || (cp >= 0xD800 && cp < 0xE000)) ? 0 : 3;
  }
  if (n < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
  cp = ((c & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
  return (cp < 0x10000 || cp > 0x10FFFF) ? 0 : 4;
}

// One "character" of s at byte i: a valid UTF-8 sequence, or a single invalid byte (then
// valid is false and cp is the byte's value).
struct Utf8Char {
  uint32_t cp;
  uint32_t len;
  bool valid;
};
inline Utf8Char utf8_char(std::string_view s, size_t i) {
  uint32_t cp = 0;
  size_t n = utf8_decode(reinterpret_cast<const unsigned char*>(s.data()) + i, s.size() - i, cp);
  if (n == 0) return {static_cast<uint8_t>(s[i]), 1, false};
  return {cp, static_cast<uint32_t>(n), true};
}
void utf8_append(std::string& out, uint32_t cp);
// Byte length of the last character of s (1 for an invalid trailing byte); s non-empty.
size_t utf8_last_len(std::string_view s);

bool is_white_space(uint32_t cp);  // White_Space: Rust char::is_whitespace, regex \s
bool is_word_char(uint32_t cp);    // Rust regex \w: Alphabetic, Mark, Nd, Pc, Join_Control
bool is_numeric(uint32_t cp);      // Rust char::is_numeric: Nd, Nl, No
bool is_punctuation(uint32_t cp);  // HF's is_punc: ASCII punctuation or category P*
bool is_mark(uint32_t cp);         // category M* (StripAccents)

enum class NormForm { NFC, NFD, NFKC, NFKD };
// Appends the normalized form of s to out; invalid bytes are copied unchanged and split the
// text around them.
void normalize_unicode(std::string_view s, NormForm form, std::string& out);
// Rust's char::to_lowercase applied to each character (full mapping, no context).
void lowercase(std::string_view s, std::string& out);

// ---- Regex ----------------------------------------------------------------------------------

// A PCRE2 pattern, iterated as HF iterates its Oniguruma regexes (rust-onig's find_iter):
// every match in order, including empty ones except an empty match right where the previous
// match ended. Invalid UTF-8 is allowed in the subject; no match covers it.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const Ctx& ctx, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Calls on_match(begin, end) with byte offsets; on_match returns nothing.
  template <typename F>
  void find_iter(std::string_view text, const F& on_match) const;
  // (begin, end) of the next match at or after `from`, or false.
  bool search(std::string_view text, size_t from, size_t& b, size_t& e) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  std::string literal_;   // the pattern of a non-empty {"String": ...}
};

template <typename F>
void Regex::find_iter(std::string_view text, const F& on_match) const {
  if (!literal_.empty()) {
    // A non-empty literal has no empty matches: plain substring search gives the same list.
    for (size_t b = text.find(literal_); b != std::string_view::npos;
         b = text.find(literal_, b + literal_.size()))
      on_match(b, b + literal_.size());
    return;
  }
  size_t last_end = 0;
  size_t last_match_end = SIZE_MAX;
  while (last_end <= text.size()) {
    size_t b, e;
    if (!search(text, last_end, b, e)) break;
    if (b == e && last_match_end == e) {
      last_end += last_end < text.size() ? utf8_char(text, last_end).len : 1;
      continue;
    }
    last_end = last_match_end = e;
    on_match(b, e);
  }
}

// ---- Splitting (HF's SplitDelimiterBehavior) -------------------------------------------------

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
SplitBehavior parse_behavior(const json& j, const Ctx& ctx, const std::string& where);

struct Span {
  uint32_t begin, end;
  bool is_match;
};
// HF's NormalizedString::split over the (offsets, is_match) spans that tile a text: the
// pieces to keep, as (begin, end) byte ranges, empty ones dropped.
void apply_behavior(const std::vector<Span>& spans, SplitBehavior behavior,
                    std::vector<std::pair<uint32_t, uint32_t>>& pieces);
// Spans of a regex's matches and the gaps between them (HF's Pattern for a regex).
void regex_spans(const Regex& re, std::string_view text, bool invert, std::vector<Span>& spans);

// ---- Normalizers ------------------------------------------------------------------------------

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // out = normalize(in); out is cleared first.
  virtual void apply(std::string_view in, std::string& out) const = 0;
};
// null json -> nullptr. Throws UserError naming the key for unsupported types.
std::unique_ptr<Normalizer> parse_normalizer(const json& j, const Ctx& ctx,
                                             const std::string& where);

// ---- Pre-tokenizers ---------------------------------------------------------------------------

// A piece of text on its way to the model. `mapped` means its logical text is the GPT-2
// byte-to-unicode image of `text` (the ByteLevel pre-tokenizer defers that mapping to the
// BPE model, which reads the bytes directly); `origin` that it starts at offset 0 of the
// original input (Metaspace's prepend_scheme "first").
struct Piece {
  std::string_view text;
  bool origin = false;
  bool mapped = false;
};

// A non-owning callable reference (the pipeline calls it once per piece).
template <typename Sig>
class FnRef;
template <typename R, typename... A>
class FnRef<R(A...)> {
 public:
  template <typename F>
  FnRef(const F& f)  // NOLINT: implicit by design
      : obj_(&f), call_([](const void* o, A... a) -> R {
          return (*static_cast<const F*>(o))(std::forward<A>(a)...);
        }) {}
  R operator()(A... a) const { return call_(obj_, std::forward<A>(a)...); }

 private:
  const void* obj_;
  R (*call_)(const void*, A...);
};
using PieceSink = FnRef<void(Piece)>;

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void run(Piece p, const PieceSink& next) const = 0;
};
// null json -> empty list. A Sequence is flattened into its stages.
void parse_pre_tokenizer(const json& j, const Ctx& ctx, const std::string& where,
                         std::vector<std::unique_ptr<PreTokenizer>>& stages);
// The logical text of a piece: the byte-level image of `text` when mapped.
std::string_view materialize(const Piece& p, std::string& buf);

// GPT-2's byte-to-unicode table as UTF-8 strings (also exported by core/tokenizer/tokenizer.h).
const std::array<std::string, 256>& byte_level_table();

// ---- BPE model -------------------------------------------------------------------------------

class BpeModel {
 public:
  BpeModel(const json& model, const Ctx& ctx);
  // Appends the ids of one pre-token. Thread-safe: the word cache is per thread.
  void tokenize(const Piece& p, std::vector<int32_t>& out) const;
  int32_t token_to_id(std::string_view token) const;                    // -1 when absent
  const std::string* id_to_token(int32_t id) const;                     // null when absent
  int64_t size() const { return static_cast<int64_t>(vocab_.size()); }  // HF get_vocab_size()
  int64_t max_id_plus_one() const { return static_cast<int64_t>(id_to_token_.size()); }

 private:
  struct Merge {
    int32_t rank, new_id;
  };
  void parse_vocab(const json& vocab, const Ctx& ctx);
  void parse_merges(const json& merges, const Ctx& ctx);
  void tokenize_uncached(const Piece& p, std::vector<int32_t>& out) const;
  // Initial symbols of a word per HF's BPE::merge_word (vocab lookups, byte fallback, unk).
  void initial_symbols(const Piece& p, std::vector<int32_t>& syms) const;
  void add_char(std::string_view ch, bool first, bool last, std::vector<int32_t>& syms,
                int32_t& pending_unk) const;
  void merge_all(std::vector<int32_t>& syms) const;
  void tokenize_word(const Piece& p, std::vector<int32_t>& out) const;
  const Merge* find_merge(int32_t a, int32_t b) const;

  const Ctx* ctx_;
  std::string unk_token_;
  int32_t unk_id_ = -1;  // -1: no unk token; -2: unk_token names no vocabulary entry
  bool has_unk_ = false;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string prefix_, suffix_;                     // continuing_subword_prefix, end_of_word_suffix
  std::unordered_map<std::string, int32_t> vocab_;  // token -> id
  std::vector<const std::string*> id_to_token_;     // id -> key in vocab_, null for holes
  std::unordered_map<uint32_t, int32_t> char_id_;   // one-character tokens, by code point
  std::array<int32_t, 256> byte_level_id_{};        // id of byte_level_char(b), -1 if absent
  std::array<int32_t, 256> fallback_id_{};          // id of "<0xNN>", -1 if absent
  std::array<int32_t, 128> ascii_id_{};             // id of the one-character ASCII token
  bool simple_chars_ = true;                        // no prefix/suffix: per-char ids are fixed
  // SentencePiece-style text reaches the model as whole sentences ("▁a▁b"). When no
  // vocabulary token has "▁" after another character, no merge can cross the start of a
  // "▁..." word, so each such word can be merged (and cached) on its own with the same ids.
  bool split_at_metaspace_ = false;
  // Merges: open-addressing table keyed by (a << 32 | b).
  std::vector<uint64_t> merge_keys_;
  std::vector<Merge> merge_vals_;
  uint64_t merge_mask_ = 0;
  uint64_t instance_ = 0;  // identifies this model in the per-thread word caches
};

// ---- Added vocabulary --------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
  bool operator==(const AddedToken& o) const {
    return content == o.content && single_word == o.single_word && lstrip == o.lstrip &&
           rstrip == o.rstrip && normalized == o.normalized && special == o.special;
  }
};

// HF's AddedVocabulary: id assignment as add_tokens does it, and the split of the input into
// added tokens and plain text (leftmost-longest, with single_word / lstrip / rstrip).
class AddedVocab {
 public:
  // Adds tokens as HF's add_tokens: an exact duplicate is ignored, a known content keeps its
  // id (added first, then model vocabulary), a new one takes the next id after the model's
  // vocabulary (or after the largest added id).
  void add(const std::vector<AddedToken>& tokens, const BpeModel& model,
           const Normalizer* normalizer);
  int32_t find(std::string_view content) const;  // id of an added token, -1 if none
  // id -> the string HF's decode uses (normalized content for normalized tokens), or null.
  const std::string* decode_string(int32_t id) const;
  bool has_raw() const { return has_raw_; }
  bool has_normalized() const { return has_norm_; }
  int64_t max_id_plus_one() const;
  // Splits text on the raw (non-normalized) or the normalized tokens: emit(piece, id, offset)
  // with id -1 for plain text; empty plain pieces are skipped.
  void split(std::string_view text, bool normalized_set,
             const FnRef<void(std::string_view, int32_t, size_t)>& emit) const;

 private:
  struct Trie {
    struct Node {
      std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
      int32_t id = -1;
    };
    std::vector<Node> nodes{Node{}};
    std::array<bool, 256> first{};
    void insert(std::string_view s, int32_t id);
    // Longest token starting at text[i]: its length (0 if none) and id.
    size_t longest(std::string_view text, size_t i, int32_t& id) const;
  };
  void rebuild();
  std::unordered_map<std::string, int32_t> by_content_;
  std::unordered_map<int32_t, AddedToken> by_id_;
  std::unordered_map<int32_t, std::string> normalized_content_;
  Trie raw_, norm_;
  bool has_raw_ = false, has_norm_ = false;
};

// ---- Decoders ---------------------------------------------------------------------------------

class Decoder {
 public:
  virtual ~Decoder() = default;
  // HF's decode_chain on byte strings: no U+FFFD repair of invalid UTF-8.
  virtual void chain(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> parse_decoder(const json& j, const Ctx& ctx, const std::string& where);

}  // namespace titan::tok

namespace titan {
class Tokenizer;
namespace tok {
// The tokenizer of a parsed tokenizer.json (`path` for messages). `config` is the parsed
// tokenizer_config.json beside it, or null: its special tokens are added as torchtitan's
// HuggingFaceTokenizer adds them, and its bos_token / eos_token name BOS and EOS.
std::unique_ptr<Tokenizer> make_hf_tokenizer(const json& doc, const std::string& path,
                                             const nlohmann::ordered_json* config,
                                             const std::string& config_path);
}  // namespace tok
}  // namespace titan
