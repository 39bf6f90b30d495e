#include "core/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "core/errors.h"

namespace titan {

// ---- Byte tokenizer ------------------------------------------------------------------------

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<uint8_t>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size())
      throw std::out_of_range("byte tokenizer: id " + std::to_string(id) +
                              " is outside the vocabulary [0, 258)");
    if (id < 256) out.push_back(static_cast<char>(id));
  }
  return out;
}

std::vector<int32_t> encode_document(const Tokenizer& tok, std::string_view text, bool bos,
                                     bool eos) {
  if ((bos && tok.bos_id() < 0) || (eos && tok.eos_id() < 0))
    throw UserError(std::string("the tokenizer has no ") +
                    (bos && tok.bos_id() < 0 ? "BOS" : "EOS") +
                    " token (looked for <|begin_of_text|>/<|end_of_text|>, <s>/</s> and "
                    "<|endoftext|> among its added tokens)");
  std::vector<int32_t> ids = tok.encode(text);
  if (bos) ids.insert(ids.begin(), tok.bos_id());
  if (eos) ids.push_back(tok.eos_id());
  return ids;
}

// ---- GPT-2 byte <-> unicode ------------------------------------------------------------------

namespace {

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

const std::array<std::string, 256>& byte_level_table() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      t[b] = utf8_of(printable ? b : next++);
    }
    return t;
  }();
  return table;
}

}  // namespace

const std::string& byte_level_char(uint8_t byte) {
  return byte_level_table()[byte];
}

// ---- BPE from tokenizer.json -----------------------------------------------------------------

namespace {

using nlohmann::json;

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A compiled PCRE2 pattern. PCRE2_MATCH_INVALID_UTF lets it run on any bytes: invalid
// sequences simply never match, and split_isolated() turns them into pieces of their own.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE off = 0;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err,
                          &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw UserError(where + ": regex /" + pattern + "/ does not compile at offset " +
                      std::to_string(off) + ": " + reinterpret_cast<char*>(msg));
    }
    // JIT is several times faster; without it (e.g. a PCRE2 built without JIT support) the
    // interpreter gives the same matches.
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  const pcre2_code* code() const { return code_; }

 private:
  pcre2_code* code_ = nullptr;
};

// Scratch space for one encode() call; pcre2_match_data is not safe to share across threads.
class MatchData {
 public:
  MatchData() : md_(pcre2_match_data_create(1, nullptr)) {
    if (!md_) throw std::bad_alloc();
  }
  ~MatchData() { pcre2_match_data_free(md_); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
  pcre2_match_data* get() const { return md_; }

 private:
  pcre2_match_data* md_;
};

// HF's SplitDelimiterBehavior::Isolated: every match is a piece, and so is every gap between
// matches, so the pieces tile the input exactly. Gaps hold what the pattern cannot match,
// which for the usual patterns is only invalid UTF-8.
template <typename Emit>
void split_isolated(const Regex& re, MatchData& md, std::string_view text, const Emit& emit) {
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, search = 0;
  while (search < text.size()) {
    int rc = pcre2_match(re.code(), subject, text.size(), search, 0, md.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw std::runtime_error(std::string("tokenizer: regex match failed: ") +
                               reinterpret_cast<char*>(msg));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    size_t b = ov[0], e = ov[1];
    if (e == b) {
      // HF skips empty matches; step over one character (continuation bytes included).
      search = b + 1;
      while (search < text.size() && (static_cast<uint8_t>(text[search]) & 0xC0) == 0x80) ++search;
      continue;
    }
    if (b > pos) emit(text.substr(pos, b - pos));
    emit(text.substr(b, e - b));
    pos = search = e;
  }
  if (pos < text.size()) emit(text.substr(pos));
}

struct PreTokStage {
  std::unique_ptr<Regex> split;  // a Split stage when set, else the final ByteLevel stage
  bool add_prefix_space = false;
  bool use_regex = false;
};

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool normalized = false;
};

// Leftmost-longest matcher over a set of added tokens, like HF's aho-corasick one.
class AddedTokenMatcher {
 public:
  void add(const AddedToken& t) {
    auto& v = by_first_[static_cast<uint8_t>(t.content[0])];
    v.push_back(&t);
    std::stable_sort(v.begin(), v.end(), [](const AddedToken* a, const AddedToken* b) {
      return a->content.size() > b->content.size();
    });
    empty_ = false;
  }
  bool empty() const { return empty_; }
  // Calls emit(text, -1) for plain text and emit(content, id) for each added token found.
  template <typename Emit>
  void split(std::string_view text, const Emit& emit) const {
    size_t start = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      for (const AddedToken* t : by_first_[static_cast<uint8_t>(text[i])]) {
        if (text.compare(i, t->content.size(), t->content) != 0) continue;
        if (i > start) emit(text.substr(start, i - start), -1);
        emit(text.substr(i, t->content.size()), t->id);
        i += t->content.size() - 1;
        start = i + 1;
        break;
      }
    }
    if (start < text.size()) emit(text.substr(start), -1);
  }

 private:
  std::array<std::vector<const AddedToken*>, 256> by_first_;
  bool empty_ = true;
};

std::string describe(const json& j) {
  std::string s = j.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// The string at j[key], or "" when j is not an object or the field is absent or no string.
std::string str_field(const json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_string()) return "";
  return j[key].get<std::string>();
}

class BpeTokenizer : public Tokenizer {
 public:
  BpeTokenizer(const json& doc, const std::string& path);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }

 private:
  void parse_model(const json& model);
  void parse_pre_tokenizer(const json& pt);
  void parse_added_tokens(const json& added);
  [[noreturn]] void fail(const std::string& what) const {
    throw UserError("tokenizer file '" + path_ + "': " + what);
  }
  bool bool_field(const json& j, const char* key, bool def, const std::string& where) const {
    if (!j.contains(key) || j[key].is_null()) return def;
    if (!j[key].is_boolean())
      fail(where + "." + key + " must be true or false, found " + describe(j[key]));
    return j[key].get<bool>();
  }

  void encode_segment(std::string_view text, MatchData& md, std::vector<int32_t>& out) const;
  void run_stage(size_t stage, std::string_view text, MatchData& md,
                 std::vector<int32_t>& out) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  std::vector<int32_t> merge_word(std::string_view word) const;

  std::string path_;
  std::unordered_map<std::string, int32_t> vocab_;  // byte-level token string -> id
  std::vector<std::string> id_bytes_;               // id -> decoded bytes
  std::vector<uint8_t> id_present_;
  std::vector<const std::string*> id_token_;  // id -> key in vocab_, or null
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (a, b) -> (rank, a+b)
  std::array<int32_t, 256> byte_id_{};
  bool ignore_merges_ = false;
  std::vector<PreTokStage> stages_;
  std::vector<std::unique_ptr<AddedToken>> added_;
  // HF matches added tokens that skip normalization first, then the others in what is left.
  AddedTokenMatcher raw_added_, normalized_added_;
  int64_t vocab_size_ = 0;
  int32_t bos_ = -1, eos_ = -1;

  // Most words repeat, so their BPE result is cached; one lock per word costs far less than
  // the merge loop it saves.
  static constexpr size_t kMaxCachedWord = 64;
  static constexpr size_t kMaxCacheEntries = 1 << 20;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

BpeTokenizer::BpeTokenizer(const json& doc, const std::string& path) : path_(path) {
  if (!doc.is_object()) fail("expected a JSON object at the top level, found " + describe(doc));
  if (!doc.contains("model") || !doc["model"].is_object())
    fail("no \"model\" object; a Hugging Face tokenizer.json has one with type \"BPE\"");
  parse_model(doc["model"]);
  if (doc.contains("normalizer") && !doc["normalizer"].is_null())
    fail("normalizer " + describe(doc["normalizer"]) +
         " is not supported; byte-level BPE tokenizers (GPT-2, Llama-3) use null");
  parse_pre_tokenizer(doc.contains("pre_tokenizer") ? doc["pre_tokenizer"] : json());
  parse_added_tokens(doc.contains("added_tokens") ? doc["added_tokens"] : json::array());
}

void BpeTokenizer::parse_model(const json& model) {
  std::string type = str_field(model, "type");
  if (type != "BPE")
    fail("model.type is " + (model.contains("type") ? describe(model["type"]) : "missing") +
         "; only \"BPE\" is supported");
  auto opt_nonempty = [&](const char* key) {
    return model.contains(key) && !model[key].is_null() &&
           !(model[key].is_string() && model[key].get<std::string>().empty());
  };
  if (opt_nonempty("continuing_subword_prefix") || opt_nonempty("end_of_word_suffix"))
    fail(
        "model.continuing_subword_prefix / end_of_word_suffix are not supported by byte-level "
        "BPE; they must be null");
  if (model.contains("dropout") && model["dropout"].is_number() &&
      model["dropout"].get<double>() != 0)
    fail("model.dropout = " + describe(model["dropout"]) + " is not supported; use null");
  ignore_merges_ = bool_field(model, "ignore_merges", false, "model");

  if (!model.contains("vocab") || !model["vocab"].is_object())
    fail("model.vocab must be an object mapping token strings to ids");
  int64_t max_id = -1;
  std::unordered_map<int32_t, const std::string*> seen;
  for (auto& [tok, idj] : model["vocab"].items()) {
    if (!idj.is_number_integer() || idj.get<int64_t>() < 0 || idj.get<int64_t>() > INT32_MAX)
      fail("model.vocab[" + json(tok).dump() + "] = " + describe(idj) +
           "; ids must be integers in [0, 2^31)");
    auto id = idj.get<int32_t>();
    auto [it, fresh] = vocab_.emplace(tok, id);
    if (!seen.emplace(id, &it->first).second)
      fail("model.vocab gives id " + std::to_string(id) + " to both " + json(*seen[id]).dump() +
           " and " + json(tok).dump() + "; ids must be unique");
    max_id = std::max<int64_t>(max_id, id);
  }
  vocab_size_ = max_id + 1;
  id_bytes_.assign(vocab_size_, {});
  id_present_.assign(vocab_size_, 0);
  id_token_.assign(vocab_size_, nullptr);
  std::unordered_map<std::string, uint8_t> char_byte;
  for (int b = 0; b < 256; ++b) char_byte[byte_level_char(b)] = static_cast<uint8_t>(b);
  for (auto& [tok, id] : vocab_) {
    // Like HF's ByteLevel decoder: a token with a character outside the byte table decodes to
    // its own UTF-8 text.
    std::string bytes;
    bool mapped = true;
    for (size_t i = 0; i < tok.size() && mapped;) {
      size_t n = 1;
      auto lead = static_cast<uint8_t>(tok[i]);
      if (lead >= 0xF0)
        n = 4;
      else if (lead >= 0xE0)
        n = 3;
      else if (lead >= 0xC0)
        n = 2;
      auto it = char_byte.find(tok.substr(i, n));
      if (it == char_byte.end())
        mapped = false;
      else
        bytes.push_back(static_cast<char>(it->second));
      i += n;
    }
    id_bytes_[id] = mapped ? bytes : tok;
    id_present_[id] = 1;
    id_token_[id] = &tok;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(byte_level_char(b));
    if (it == vocab_.end()) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", b);
      fail("model.vocab lacks the byte-level token " + json(byte_level_char(b)).dump() +
           " for byte " + hex + "; byte-level BPE needs all 256 so that every input encodes");
    }
    byte_id_[b] = it->second;
  }

  if (!model.contains("merges") || !model["merges"].is_array())
    fail("model.merges must be an array of \"a b\" strings or [\"a\", \"b\"] pairs");
  const json& merges = model["merges"];
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string a, b;
    std::string where = "model.merges[" + std::to_string(rank) + "] = " + describe(m);
    if (m.is_string()) {
      auto s = m.get<std::string>();
      auto sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos || sp == 0 ||
          sp + 1 == s.size())
        fail(where + ": a string merge must be two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      fail(where + ": a merge must be an \"a b\" string or an [\"a\", \"b\"] pair");
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end()) {
      std::string t = ia == vocab_.end() ? a : ib == vocab_.end() ? b : a + b;
      fail(where + ": token " + json(t).dump() + " is not in model.vocab");
    }
    uint64_t key = (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second);
    // A repeated pair takes its last rank: HF collects the merges into a map the same way.
    merges_.insert_or_assign(key, std::pair{static_cast<int32_t>(rank), iab->second});
  }
}

void BpeTokenizer::parse_pre_tokenizer(const json& pt) {
  const std::string expected =
      "expected type \"ByteLevel\", or \"Sequence\" of \"Split\" stages followed by one "
      "\"ByteLevel\" with use_regex false";
  if (!pt.is_object()) fail("pre_tokenizer is " + describe(pt) + "; " + expected);
  std::vector<const json*> parts;
  std::string type = str_field(pt, "type");
  if (type == "Sequence") {
    if (!pt.contains("pretokenizers") || !pt["pretokenizers"].is_array())
      fail("pre_tokenizer of type \"Sequence\" has no \"pretokenizers\" array");
    for (auto& p : pt["pretokenizers"]) parts.push_back(&p);
  } else {
    parts.push_back(&pt);
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const json& p = *parts[i];
    std::string where =
        "pre_tokenizer" +
        (type == "Sequence" ? ".pretokenizers[" + std::to_string(i) + "]" : std::string());
    std::string t = str_field(p, "type");
    bool last = i + 1 == parts.size();
    PreTokStage stage;
    if (t == "ByteLevel" && last) {
      stage.add_prefix_space = bool_field(p, "add_prefix_space", false, where);
      stage.use_regex = bool_field(p, "use_regex", true, where);
    } else if (t == "Split" && !last) {
      std::string behavior = str_field(p, "behavior");
      if (behavior != "Isolated")
        fail(where + ": Split behavior " + describe(p.value("behavior", json())) +
             " is not supported; only \"Isolated\" is");
      if (bool_field(p, "invert", false, where))
        fail(where + ": Split with invert true is not supported");
      const json pat = p.value("pattern", json());
      bool literal = pat.is_object() && pat.contains("String") && pat["String"].is_string();
      bool regex = pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string();
      if (!literal && !regex)
        fail(where + ": Split pattern " + describe(pat) +
             " must be {\"Regex\": \"...\"} or {\"String\": \"...\"}");
      stage.split = std::make_unique<Regex>(pat[literal ? "String" : "Regex"].get<std::string>(),
                                            literal, "tokenizer file '" + path_ + "': " + where);
    } else {
      fail(where + " has type " + describe(p.is_object() ? p.value("type", json()) : p) + "; " +
           expected);
    }
    stages_.push_back(std::move(stage));
  }
}

void BpeTokenizer::parse_added_tokens(const json& added) {
  if (!added.is_array()) fail("added_tokens must be an array, found " + describe(added));
  std::unordered_map<int32_t, std::string> by_id;
  for (size_t i = 0; i < added.size(); ++i) {
    const json& a = added[i];
    std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
        a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() > INT32_MAX ||
        !a.contains("content") || !a["content"].is_string() ||
        a["content"].get<std::string>().empty())
      fail(where + " = " + describe(a) +
           "; expected an object with an integer \"id\" >= 0 and a non-empty \"content\"");
    for (const char* flag : {"single_word", "lstrip", "rstrip"})
      if (bool_field(a, flag, false, where))
        fail(where + " (" + json(a["content"]).dump() + ") sets " + flag +
             " true, which is not supported; it must be false");
    auto t = std::make_unique<AddedToken>();
    t->content = a["content"].get<std::string>();
    t->id = a["id"].get<int32_t>();
    t->normalized = bool_field(a, "normalized", !bool_field(a, "special", false, where), where);
    auto [it, fresh] = by_id.emplace(t->id, t->content);
    if (!fresh && it->second != t->content)
      fail(where + ": id " + std::to_string(t->id) + " is given to both " +
           json(it->second).dump() + " and " + json(t->content).dump());
    if (t->id < static_cast<int64_t>(id_token_.size()) && id_token_[t->id] &&
        *id_token_[t->id] != t->content)
      fail(where + ": id " + std::to_string(t->id) + " is " + json(t->content).dump() +
           " here but " + json(*id_token_[t->id]).dump() + " in model.vocab");
    if (!fresh) continue;
    if (t->id >= vocab_size_) {
      vocab_size_ = t->id + 1;
      id_bytes_.resize(vocab_size_);
      id_present_.resize(vocab_size_, 0);
    }
    id_bytes_[t->id] = t->content;
    id_present_[t->id] = 1;
    (t->normalized ? normalized_added_ : raw_added_).add(*t);
    added_.push_back(std::move(t));
  }
  auto find = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      for (auto& t : added_)
        if (t->content == n) return t->id;
    return -1;
  };
  // GPT-2 has only <|endoftext|>, which HF uses as both BOS and EOS.
  bos_ = find({"<|begin_of_text|>", "<s>", "<|endoftext|>"});
  eos_ = find({"<|end_of_text|>", "</s>", "<|endoftext|>"});
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  MatchData md;
  auto plain = [&](std::string_view seg, int32_t id) {
    if (id >= 0)
      out.push_back(id);
    else
      encode_segment(seg, md, out);
  };
  if (raw_added_.empty() && normalized_added_.empty()) {
    encode_segment(text, md, out);
  } else {
    raw_added_.split(text, [&](std::string_view seg, int32_t id) {
      if (id >= 0)
        out.push_back(id);
      else
        normalized_added_.split(seg, plain);
    });
  }
  return out;
}

void BpeTokenizer::encode_segment(std::string_view text, MatchData& md,
                                  std::vector<int32_t>& out) const {
  if (!text.empty()) run_stage(0, text, md, out);
}

void BpeTokenizer::run_stage(size_t stage, std::string_view text, MatchData& md,
                             std::vector<int32_t>& out) const {
  const PreTokStage& s = stages_[stage];
  if (s.split) {
    split_isolated(*s.split, md, text,
                   [&](std::string_view piece) { run_stage(stage + 1, piece, md, out); });
    return;
  }
  // ByteLevel prepends its space to every piece it receives, as HF does per split.
  std::string prefixed;
  if (s.add_prefix_space && text[0] != ' ') {
    prefixed.reserve(text.size() + 1);
    prefixed.append(1, ' ').append(text);
    text = prefixed;
  }
  if (s.use_regex) {
    static const Regex gpt2(kGpt2Pattern, false, "GPT-2 pattern");
    split_isolated(gpt2, md, text, [&](std::string_view w) { bpe_word(w, out); });
  } else {
    bpe_word(text, out);
  }
}

void BpeTokenizer::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_id_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (word.size() > kMaxCachedWord) {
    auto ids = merge_word(word);
    out.insert(out.end(), ids.begin(), ids.end());
    return;
  }
  std::string key(word);
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  auto ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::move(key), std::move(ids));
}

// Lowest (rank, position) pair first, with a heap and a linked list as HF's BPE::merge_word
// does, so results match it even for merge tables no trainer would produce.
std::vector<int32_t> BpeTokenizer::merge_word(std::string_view word) const {
  if (ignore_merges_) {
    std::string mapped;
    for (char c : word) mapped += byte_level_char(static_cast<uint8_t>(c));
    auto it = vocab_.find(mapped);
    if (it != vocab_.end()) return {it->second};
  }
  struct Sym {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const auto n = static_cast<int32_t>(word.size());
  std::vector<Sym> sym(n);
  for (int32_t i = 0; i < n; ++i)
    sym[i] = {byte_id_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t pos) {
    int32_t nx = sym[pos].next;
    if (nx < 0) return;
    auto it = merges_.find((static_cast<uint64_t>(sym[pos].id) << 32) |
                           static_cast<uint32_t>(sym[nx].id));
    if (it != merges_.end()) heap.push({it->second.first, pos, it->second.second});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& left = sym[c.pos];
    if (!left.alive || left.next < 0) continue;
    Sym& right = sym[left.next];
    // Stale entry: one side has merged since it was pushed.
    auto it =
        merges_.find((static_cast<uint64_t>(left.id) << 32) | static_cast<uint32_t>(right.id));
    if (it == merges_.end() || it->second.second != c.new_id) continue;
    left.id = c.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = c.pos;
    if (left.prev >= 0) push(left.prev);
    push(c.pos);
  }
  std::vector<int32_t> ids;
  for (int32_t i = 0; i >= 0; i = sym[i].next) ids.push_back(sym[i].id);
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size_ || !id_present_[id])
      throw std::out_of_range("tokenizer '" + path_ + "': id " + std::to_string(id) +
                              " is not in the vocabulary (size " + std::to_string(vocab_size_) +
                              ")");
    out += id_bytes_[id];
  }
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  if (path == "bytes") return std::make_unique<ByteTokenizer>();
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError("tokenizer file '" + path +
                    "': cannot be read (it is a folder); give a tokenizer.json file or \"bytes\"");
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw UserError("tokenizer file '" + path + "': cannot be read (" + std::strerror(errno) +
                    "); give an existing tokenizer.json file or \"bytes\"");
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad())
    throw UserError("tokenizer file '" + path + "': cannot be read (" + std::strerror(errno) + ")");
  json doc;
  try {
    doc = json::parse(ss.str());
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    auto p = what.find("] ");
    if (p != std::string::npos) what = what.substr(p + 2);
    throw UserError("tokenizer file '" + path + "': not valid JSON at byte " +
                    std::to_string(e.byte) + " (" + what + ")");
  }
  return std::make_unique<BpeTokenizer>(doc, path);
}

}  // namespace titan
