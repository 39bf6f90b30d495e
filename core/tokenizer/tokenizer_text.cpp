// Regex splitting, normalizers and pre-tokenizers of a tokenizer.json, following HF
// `tokenizers` 0.23 (normalizers/*.rs, pre_tokenizers/*.rs, tokenizer/normalizer.rs).
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdexcept>

#include "core/tokenizer/tokenizer_hf.h"

namespace titan::tok {

// ---- Regex ------------------------------------------------------------------------------------

namespace {

// Per-thread PCRE2 scratch: match data is not shareable between threads, and the JIT stack
// is made larger than PCRE2's 32 KiB default so that long runs (a megabyte of spaces against
// `\s+(?!\S)`) never hit its limit.
struct MatchScratch {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* mctx = pcre2_match_context_create(nullptr);
  MatchScratch() {
    if (!md || !stack || !mctx) throw std::bad_alloc();
    pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(md);
  }
};

MatchScratch& match_scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

Regex::Regex(const std::string& pattern, bool literal, const Ctx& ctx, const std::string& where) {
  int err = 0;
  PCRE2_SIZE off = 0;
  // PCRE2_LITERAL admits only a few other options; UCP is not one of them (nor needed).
  uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   opts, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    ctx.fail(where + ": regex /" + pattern + "/ does not compile at offset " +
             std::to_string(off) + ": " + reinterpret_cast<char*>(msg));
  }
  // The JIT is several times faster; without it (a PCRE2 built without JIT) the interpreter
  // finds the same matches.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
  if (literal) literal_ = pattern;
}

Regex::~Regex() {
  pcre2_code_free(static_cast<pcre2_code*>(code_));
}

bool Regex::search(std::string_view text, size_t from, size_t& b, size_t& e) const {
  MatchScratch& s = match_scratch();
  int rc = pcre2_match(static_cast<const pcre2_code*>(code_),
                       reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from, 0, s.md,
                       s.mctx);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw std::runtime_error(std::string("tokenizer: regex match failed: ") +
                             reinterpret_cast<char*>(msg));
  }
  PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.md);
  b = ov[0];
  e = ov[1];
  return true;
}

// ---- Splitting --------------------------------------------------------------------------------

SplitBehavior parse_behavior(const json& j, const Ctx& ctx, const std::string& where) {
  std::string s = j.is_string() ? j.get<std::string>() : "";
  if (s == "Removed") return SplitBehavior::Removed;
  if (s == "Isolated") return SplitBehavior::Isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (s == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (s == "Contiguous") return SplitBehavior::Contiguous;
  ctx.fail(where + " is " + describe(j) +
           "; allowed: \"Removed\", \"Isolated\", \"MergedWithPrevious\", \"MergedWithNext\", "
           "\"Contiguous\"");
}

void apply_behavior(const std::vector<Span>& spans, SplitBehavior behavior,
                    std::vector<std::pair<uint32_t, uint32_t>>& pieces) {
  pieces.clear();
  bool prev = false;
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const Span& s : spans) pieces.emplace_back(s.begin, s.end);
      break;
    case SplitBehavior::Removed:
      for (const Span& s : spans)
        if (!s.is_match) pieces.emplace_back(s.begin, s.end);
      break;
    case SplitBehavior::Contiguous:
      for (const Span& s : spans) {
        if (s.is_match == prev && !pieces.empty())
          pieces.back().second = s.end;
        else
          pieces.emplace_back(s.begin, s.end);
        prev = s.is_match;
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.is_match && !prev && !pieces.empty())
          pieces.back().second = s.end;
        else
          pieces.emplace_back(s.begin, s.end);
        prev = s.is_match;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !prev && !pieces.empty())
          pieces.back().first = it->begin;
        else
          pieces.emplace_back(it->begin, it->end);
        prev = it->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
  }
  pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                              [](const auto& p) { return p.first == p.second; }),
               pieces.end());
}

void regex_spans(const Regex& re, std::string_view text, bool invert, std::vector<Span>& spans) {
  spans.clear();
  uint32_t prev = 0;
  re.find_iter(text, [&](size_t b, size_t e) {
    if (prev != b) spans.push_back({prev, static_cast<uint32_t>(b), invert});
    spans.push_back({static_cast<uint32_t>(b), static_cast<uint32_t>(e), !invert});
    prev = static_cast<uint32_t>(e);
  });
  if (prev != text.size()) spans.push_back({prev, static_cast<uint32_t>(text.size()), invert});
}

namespace {

// HF's Pattern for a char predicate: every matching character is a match of its own.
template <typename Pred>
void char_spans(std::string_view text, const Pred& pred, std::vector<Span>& spans) {
  spans.clear();
  uint32_t last = 0;
  for (size_t i = 0; i < text.size();) {
    Utf8Char ch = utf8_char(text, i);
    if (ch.valid && pred(ch.cp)) {
      if (last < i) spans.push_back({last, static_cast<uint32_t>(i), false});
      spans.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(i + ch.len), true});
      last = static_cast<uint32_t>(i + ch.len);
    }
    i += ch.len;
  }
  if (last < text.size()) spans.push_back({last, static_cast<uint32_t>(text.size()), false});
}

// Emits each kept piece of p after splitting by `spans` with `behavior`. Pieces inherit the
// mapped flag; only the first keeps the origin flag.
void emit_pieces(const Piece& p, std::string_view text, const std::vector<Span>& spans,
                 SplitBehavior behavior, const PieceSink& next) {
  std::vector<std::pair<uint32_t, uint32_t>> pieces;
  apply_behavior(spans, behavior, pieces);
  for (auto [b, e] : pieces) next(Piece{text.substr(b, e - b), p.origin && b == 0, p.mapped});
}

// Isolated regex split, streamed: the common case (GPT-2 / Llama-3 patterns) needs no lists.
void split_isolated(const Regex& re, const Piece& p, const PieceSink& next) {
  std::string_view t = p.text;
  size_t prev = 0;
  re.find_iter(t, [&](size_t b, size_t e) {
    if (prev != b) next(Piece{t.substr(prev, b - prev), p.origin && prev == 0, p.mapped});
    if (e > b) next(Piece{t.substr(b, e - b), p.origin && b == 0, p.mapped});
    prev = e;
  });
  if (prev != t.size()) next(Piece{t.substr(prev), p.origin && prev == 0, p.mapped});
}

}  // namespace

// ---- Byte-level table -------------------------------------------------------------------------

const std::array<std::string, 256>& byte_level_table() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      utf8_append(t[b], printable ? static_cast<uint32_t>(b) : next++);
    }
    return t;
  }();
  return table;
}

std::string_view materialize(const Piece& p, std::string& buf) {
  if (!p.mapped) return p.text;
  const auto& table = byte_level_table();
  buf.clear();
  for (char c : p.text) buf += table[static_cast<uint8_t>(c)];
  return buf;
}

// ---- Normalizers ------------------------------------------------------------------------------

namespace {

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormForm f) : form_(f) {}
  void apply(std::string_view in, std::string& out) const override {
    out.clear();
    normalize_unicode(in, form_, out);
  }

 private:
  NormForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void apply(std::string_view in, std::string& out) const override {
    out.clear();
    lowercase(in, out);
  }
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Regex> re, std::string content)
      : re_(std::move(re)), content_(std::move(content)) {}
  void apply(std::string_view in, std::string& out) const override {
    out.clear();
    size_t prev = 0;
    re_->find_iter(in, [&](size_t b, size_t e) {
      out.append(in.substr(prev, b - prev));
      out += content_;
      prev = e;
    });
    out.append(in.substr(prev));
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string s) : prefix_(std::move(s)) {}
  void apply(std::string_view in, std::string& out) const override {
    out.clear();
    if (!in.empty()) out.append(prefix_).append(in);
  }

 private:
  std::string prefix_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void apply(std::string_view in, std::string& out) const override {
    size_t b = 0, e = in.size();
    while (left_ && b < e) {
      Utf8Char ch = utf8_char(in, b);
      if (!ch.valid || !is_white_space(ch.cp)) break;
      b += ch.len;
    }
    while (right_ && e > b) {
      size_t n = utf8_last_len(in.substr(b, e - b));
      Utf8Char ch = utf8_char(in, e - n);
      if (!ch.valid || ch.len != n || !is_white_space(ch.cp)) break;
      e -= n;
    }
    out.assign(in.substr(b, e - b));
  }

 private:
  bool left_, right_;
};

// Keeps or maps characters one by one (StripAccents, Nmt, ByteLevel).
template <typename Map>
class CharMapNormalizer : public Normalizer {
 public:
  explicit CharMapNormalizer(Map m) : map_(std::move(m)) {}
  void apply(std::string_view in, std::string& out) const override {
    out.clear();
    for (size_t i = 0; i < in.size();) {
      Utf8Char ch = utf8_char(in, i);
      map_(ch, in.substr(i, ch.len), out);
      i += ch.len;
    }
  }

 private:
  Map map_;
};
template <typename Map>
std::unique_ptr<Normalizer> char_map(Map m) {
  return std::make_unique<CharMapNormalizer<Map>>(std::move(m));
}

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void apply(std::string_view in, std::string& out) const override {
    out.assign(in);
    std::string tmp;
    for (const auto& n : parts_) {
      n->apply(out, tmp);
      out.swap(tmp);
    }
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

// {"String": s} or {"Regex": r}, as Split and Replace store their patterns.
std::unique_ptr<Regex> parse_pattern(const json& j, const Ctx& ctx, const std::string& where) {
  const json pat = j.is_object() && j.contains("pattern") ? j["pattern"] : json();
  bool literal = pat.is_object() && pat.contains("String") && pat["String"].is_string();
  bool regex = pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string();
  if (!literal && !regex)
    ctx.fail(where + ".pattern is " + describe(pat) +
             "; expected {\"String\": \"...\"} or {\"Regex\": \"...\"}");
  return std::make_unique<Regex>(pat[literal ? "String" : "Regex"].get<std::string>(), literal,
                                 ctx, where + ".pattern");
}

}  // namespace

std::unique_ptr<Normalizer> parse_normalizer(const json& j, const Ctx& ctx,
                                             const std::string& where) {
  if (j.is_null()) return nullptr;
  std::string type = j.is_object() ? ctx.get_string(j, "type", "", where) : "";
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormForm::NFC);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormForm::NFD);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormForm::NFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormForm::NFKD);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Replace") {
    auto re = parse_pattern(j, ctx, where);
    return std::make_unique<ReplaceNormalizer>(std::move(re), ctx.need_string(j, "content", where));
  }
  if (type == "Prepend")
    return std::make_unique<PrependNormalizer>(ctx.need_string(j, "prepend", where));
  if (type == "Strip")
    return std::make_unique<StripNormalizer>(ctx.get_bool(j, "strip_left", true, where),
                                             ctx.get_bool(j, "strip_right", true, where));
  if (type == "StripAccents")
    return char_map([](const Utf8Char& c, std::string_view s, std::string& out) {
      if (!c.valid || !is_mark(c.cp)) out.append(s);
    });
  if (type == "Nmt")
    return char_map([](const Utf8Char& c, std::string_view s, std::string& out) {
      uint32_t cp = c.cp;
      if (!c.valid) {
        out.append(s);
      } else if ((cp >= 0x01 && cp <= 0x08) || cp == 0x0B || (cp >= 0x0E && cp <= 0x1F) ||
                 cp == 0x7F || cp == 0x8F || cp == 0x9F) {
        // dropped
      } else if (cp == 0x09 || cp == 0x0A || cp == 0x0C || cp == 0x0D || cp == 0x1680 ||
                 (cp >= 0x200B && cp <= 0x200F) || cp == 0x2028 || cp == 0x2029 ||
                 cp == 0x2581 || cp == 0xFEFF || cp == 0xFFFD) {
        out += ' ';
      } else {
        out.append(s);
      }
    });
  if (type == "ByteLevel")
    return char_map([](const Utf8Char&, std::string_view s, std::string& out) {
      for (char b : s) out += byte_level_table()[static_cast<uint8_t>(b)];
    });
  if (type == "Sequence") {
    if (!j.contains("normalizers") || !j["normalizers"].is_array())
      ctx.fail(where + " of type \"Sequence\" has no \"normalizers\" array");
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (size_t i = 0; i < j["normalizers"].size(); ++i) {
      auto n = parse_normalizer(j["normalizers"][i], ctx,
                                where + ".normalizers[" + std::to_string(i) + "]");
      if (n) parts.push_back(std::move(n));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  ctx.fail(where + ".type is " +
           (j.is_object() && j.contains("type") ? describe(j["type"]) : describe(j)) +
           ", which is not supported; supported: NFC, NFD, NFKC, NFKD, Lowercase, Replace, "
           "Prepend, Strip, StripAccents, Nmt, ByteLevel, Sequence");
}

// ---- Pre-tokenizers ---------------------------------------------------------------------------

namespace {

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPre : public PreTokenizer {
 public:
  ByteLevelPre(bool add_prefix_space, bool use_regex, const Ctx& ctx)
      : add_prefix_space_(add_prefix_space) {
    if (use_regex) gpt2_ = std::make_unique<Regex>(kGpt2Pattern, false, ctx, "GPT-2 pattern");
  }
  void run(Piece p, const PieceSink& next) const override {
    std::string buf, prefixed;
    std::string_view text = materialize(p, buf);
    // A piece can start with a space only as a byte, so the check reads the logical text.
    if (add_prefix_space_ && text[0] != ' ') {
      prefixed.reserve(text.size() + 1);
      prefixed.append(1, ' ').append(text);
      text = prefixed;
    }
    Piece q{text, p.origin, true};
    if (gpt2_)
      split_isolated(*gpt2_, q, next);
    else
      next(q);
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> gpt2_;
};

class SplitPre : public PreTokenizer {
 public:
  SplitPre(std::unique_ptr<Regex> re, SplitBehavior b, bool invert)
      : re_(std::move(re)), behavior_(b), invert_(invert) {}
  void run(Piece p, const PieceSink& next) const override {
    std::string buf;
    std::string_view text = materialize(p, buf);
    Piece q{text, p.origin, false};
    if (behavior_ == SplitBehavior::Isolated && !invert_) {
      split_isolated(*re_, q, next);
      return;
    }
    std::vector<Span> spans;
    regex_spans(*re_, text, invert_, spans);
    emit_pieces(q, text, spans, behavior_, next);
  }

 private:
  std::unique_ptr<Regex> re_;
  SplitBehavior behavior_;
  bool invert_;
};

// Splits on a character class (Digits, Punctuation, WhitespaceSplit, CharDelimiterSplit).
template <typename Pred>
class CharSplitPre : public PreTokenizer {
 public:
  CharSplitPre(Pred pred, SplitBehavior b) : pred_(std::move(pred)), behavior_(b) {}
  void run(Piece p, const PieceSink& next) const override {
    std::string buf;
    std::string_view text = materialize(p, buf);
    std::vector<Span> spans;
    char_spans(text, pred_, spans);
    emit_pieces(Piece{text, p.origin, false}, text, spans, behavior_, next);
  }

 private:
  Pred pred_;
  SplitBehavior behavior_;
};
template <typename Pred>
std::unique_ptr<PreTokenizer> char_split(Pred pred, SplitBehavior b) {
  return std::make_unique<CharSplitPre<Pred>>(std::move(pred), b);
}

// HF's Whitespace: keeps the runs of \w+ and of [^\w\s]+ (Rust regex classes), drops the rest.
class WhitespacePre : public PreTokenizer {
 public:
  void run(Piece p, const PieceSink& next) const override {
    std::string buf;
    std::string_view text = materialize(p, buf);
    // Class of each character: 0 space, 1 word, 2 other (invalid bytes count as other).
    auto cls = [](const Utf8Char& c) {
      if (!c.valid) return 2;
      if (is_word_char(c.cp)) return 1;
      return is_white_space(c.cp) ? 0 : 2;
    };
    size_t i = 0;
    while (i < text.size()) {
      Utf8Char ch = utf8_char(text, i);
      int k = cls(ch);
      size_t j = i + ch.len;
      while (j < text.size()) {
        Utf8Char c2 = utf8_char(text, j);
        if (cls(c2) != k) break;
        j += c2.len;
      }
      if (k != 0) next(Piece{text.substr(i, j - i), p.origin && i == 0, false});
      i = j;
    }
  }
};

class FixedLengthPre : public PreTokenizer {
 public:
  explicit FixedLengthPre(size_t n) : n_(n) {}
  void run(Piece p, const PieceSink& next) const override {
    std::string buf;
    std::string_view text = materialize(p, buf);
    size_t i = 0;
    while (i < text.size()) {
      size_t j = i;
      for (size_t k = 0; k < n_ && j < text.size(); ++k) j += utf8_char(text, j).len;
      next(Piece{text.substr(i, j - i), p.origin && i == 0, false});
      i = j;
    }
  }

 private:
  size_t n_;
};

class MetaspacePre : public PreTokenizer {
 public:
  enum class Prepend { Always, First, Never };
  MetaspacePre(std::string replacement, Prepend scheme, bool split)
      : rep_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void run(Piece p, const PieceSink& next) const override {
    std::string buf, out;
    std::string_view text = materialize(p, buf);
    out.reserve(text.size() + 8);
    bool starts = text.size() >= rep_.size() && text.compare(0, rep_.size(), rep_) == 0;
    if (text[0] == ' ') starts = true;  // the space becomes the replacement below
    if (!starts && (scheme_ == Prepend::Always || (scheme_ == Prepend::First && p.origin)))
      out += rep_;
    for (char c : text) {
      if (c == ' ')
        out += rep_;
      else
        out += c;
    }
    Piece q{out, p.origin, false};
    if (!split_) {
      next(q);
      return;
    }
    // MergedWithNext on single-character matches: every replacement starts a new piece.
    std::string_view t = out;
    size_t start = 0;
    for (size_t i = t.find(rep_, 1); i != std::string_view::npos; i = t.find(rep_, i + 1)) {
      next(Piece{t.substr(start, i - start), p.origin && start == 0, false});
      start = i;
    }
    next(Piece{t.substr(start), p.origin && start == 0, false});
  }

 private:
  std::string rep_;
  Prepend scheme_;
  bool split_;
};

size_t get_size(const json& j, const char* key, size_t def, const Ctx& ctx,
                const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_number_unsigned() || j[key].get<uint64_t>() == 0)
    ctx.fail(where + "." + key + " must be a positive integer, found " + describe(j[key]));
  return j[key].get<size_t>();
}

// One character as a string field (Metaspace.replacement, CharDelimiterSplit.delimiter).
uint32_t get_char(const json& j, const char* key, const Ctx& ctx, const std::string& where,
                  std::string* as_string = nullptr) {
  std::string s = ctx.need_string(j, key, where);
  Utf8Char c = s.empty() ? Utf8Char{0, 0, false} : utf8_char(s, 0);
  if (!c.valid || c.len != s.size())
    ctx.fail(where + "." + key + " must be one character, found " + describe(j[key]));
  if (as_string) *as_string = s;
  return c.cp;
}

}  // namespace

void parse_pre_tokenizer(const json& j, const Ctx& ctx, const std::string& where,
                         std::vector<std::unique_ptr<PreTokenizer>>& stages) {
  if (j.is_null()) return;
  std::string type = j.is_object() ? ctx.get_string(j, "type", "", where) : "";
  if (type == "Sequence") {
    if (!j.contains("pretokenizers") || !j["pretokenizers"].is_array())
      ctx.fail(where + " of type \"Sequence\" has no \"pretokenizers\" array");
    for (size_t i = 0; i < j["pretokenizers"].size(); ++i)
      parse_pre_tokenizer(j["pretokenizers"][i], ctx,
                          where + ".pretokenizers[" + std::to_string(i) + "]", stages);
  } else if (type == "ByteLevel") {
    stages.push_back(std::make_unique<ByteLevelPre>(
        ctx.get_bool(j, "add_prefix_space", false, where),
        ctx.get_bool(j, "use_regex", true, where), ctx));
  } else if (type == "Split") {
    if (!j.contains("behavior"))
      ctx.fail(where + " of type \"Split\" has no \"behavior\"");
    auto re = parse_pattern(j, ctx, where);
    SplitBehavior behavior = parse_behavior(j["behavior"], ctx, where + ".behavior");
    stages.push_back(
        std::make_unique<SplitPre>(std::move(re), behavior, ctx.get_bool(j, "invert", false, where)));
  } else if (type == "Metaspace") {
    std::string rep;
    get_char(j, "replacement", ctx, where, &rep);
    std::string scheme = ctx.get_string(j, "prepend_scheme", "always", where);
    MetaspacePre::Prepend p = MetaspacePre::Prepend::Always;
    if (scheme == "first")
      p = MetaspacePre::Prepend::First;
    else if (scheme == "never")
      p = MetaspacePre::Prepend::Never;
    else if (scheme != "always")
      ctx.fail(where + ".prepend_scheme is " + describe(j["prepend_scheme"]) +
               "; allowed: \"always\", \"first\", \"never\"");
    // The legacy add_prefix_space false means "never" (HF rejects it with another scheme).
    if (j.contains("add_prefix_space") && !ctx.get_bool(j, "add_prefix_space", true, where)) {
      if (p != MetaspacePre::Prepend::Never && j.contains("prepend_scheme"))
        ctx.fail(where + ".add_prefix_space false contradicts prepend_scheme " +
                 describe(j["prepend_scheme"]));
      p = MetaspacePre::Prepend::Never;
    }
    stages.push_back(
        std::make_unique<MetaspacePre>(rep, p, ctx.get_bool(j, "split", true, where)));
  } else if (type == "Digits") {
    bool individual = ctx.get_bool(j, "individual_digits", false, where);
    stages.push_back(char_split([](uint32_t cp) { return is_numeric(cp); },
                                individual ? SplitBehavior::Isolated
                                           : SplitBehavior::Contiguous));
  } else if (type == "Punctuation") {
    SplitBehavior b = j.contains("behavior")
                          ? parse_behavior(j["behavior"], ctx, where + ".behavior")
                          : SplitBehavior::Isolated;
    stages.push_back(char_split([](uint32_t cp) { return is_punctuation(cp); }, b));
  } else if (type == "WhitespaceSplit") {
    stages.push_back(
        char_split([](uint32_t cp) { return is_white_space(cp); }, SplitBehavior::Removed));
  } else if (type == "BertPreTokenizer") {
    stages.push_back(
        char_split([](uint32_t cp) { return is_white_space(cp); }, SplitBehavior::Removed));
    stages.push_back(
        char_split([](uint32_t cp) { return is_punctuation(cp); }, SplitBehavior::Isolated));
  } else if (type == "CharDelimiterSplit") {
    uint32_t d = get_char(j, "delimiter", ctx, where);
    stages.push_back(char_split([d](uint32_t cp) { return cp == d; }, SplitBehavior::Removed));
  } else if (type == "Whitespace") {
    stages.push_back(std::make_unique<WhitespacePre>());
  } else if (type == "FixedLength") {
    stages.push_back(std::make_unique<FixedLengthPre>(get_size(j, "length", 5, ctx, where)));
  } else {
    ctx.fail(where + ".type is " +
             (j.is_object() && j.contains("type") ? describe(j["type"]) : describe(j)) +
             ", which is not supported; supported: ByteLevel, Split, Metaspace, Digits, "
             "Punctuation, Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit, "
             "FixedLength, Sequence");
  }
}

}  // namespace titan::tok
