// A Hugging Face tokenizer.json as one Tokenizer: added tokens, normalizer, pre-tokenizers,
// BPE model and decoder wired as HF `tokenizers` 0.23 wires them
// (tokenizer/added_vocabulary.rs, tokenizer/mod.rs, decoders/*.rs).
#include <algorithm>
#include <stdexcept>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_hf.h"

namespace titan::tok {

// ---- Added vocabulary -------------------------------------------------------------------------

void AddedVocab::Trie::insert(std::string_view s, int32_t id) {
  if (s.empty()) return;
  first[static_cast<uint8_t>(s[0])] = true;
  int32_t node = 0;
  for (char ch : s) {
    auto c = static_cast<uint8_t>(ch);
    auto& nx = nodes[node].next;
    auto it = std::lower_bound(nx.begin(), nx.end(), std::make_pair(c, INT32_MIN));
    if (it != nx.end() && it->first == c) {
      node = it->second;
    } else {
      auto child = static_cast<int32_t>(nodes.size());
      nx.insert(it, {c, child});
      nodes.emplace_back();  // invalidates nx, which is not used again
      node = child;
    }
  }
  nodes[node].id = id;
}

size_t AddedVocab::Trie::longest(std::string_view text, size_t i, int32_t& id) const {
  size_t best = 0;
  int32_t node = 0;
  for (size_t j = i; j < text.size(); ++j) {
    auto c = static_cast<uint8_t>(text[j]);
    const auto& nx = nodes[node].next;
    auto it = std::lower_bound(nx.begin(), nx.end(), std::make_pair(c, INT32_MIN));
    if (it == nx.end() || it->first != c) break;
    node = it->second;
    if (nodes[node].id >= 0) {
      best = j + 1 - i;
      id = nodes[node].id;
    }
  }
  return best;
}

void AddedVocab::add(const std::vector<AddedToken>& tokens, const BpeModel& model,
                     const Normalizer* normalizer) {
  int64_t model_size = model.size();
  int64_t next_id = model_size;
  if (!by_id_.empty()) {
    int64_t max_added = -1;
    for (auto& [id, t] : by_id_) max_added = std::max<int64_t>(max_added, id);
    next_id = (max_added >= model_size || model_size == 0) ? max_added + 1 : model_size;
  }
  for (const AddedToken& t : tokens) {
    if (t.content.empty()) continue;
    int32_t id = find(t.content);
    if (id >= 0 && by_id_.at(id) == t) continue;
    if (id < 0) id = model.token_to_id(t.content);
    if (id < 0) id = static_cast<int32_t>(next_id++);
    if (t.normalized && normalizer) {
      std::string normed;
      normalizer->apply(t.content, normed);
      if (normed != t.content) normalized_content_[id] = normed;
    }
    by_content_[t.content] = id;
    by_id_[id] = t;
  }
  rebuild();
}

void AddedVocab::rebuild() {
  raw_ = Trie{};
  norm_ = Trie{};
  has_raw_ = has_norm_ = false;
  // Sorted by id so that two tokens with one pattern resolve the same way on every run.
  std::vector<int32_t> ids;
  for (auto& [id, t] : by_id_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (int32_t id : ids) {
    const AddedToken& t = by_id_.at(id);
    if (t.normalized) {
      auto it = normalized_content_.find(id);
      const std::string& pattern = it != normalized_content_.end() ? it->second : t.content;
      norm_.insert(pattern, id);
      has_norm_ = has_norm_ || !pattern.empty();
    } else {
      raw_.insert(t.content, id);
      has_raw_ = true;
    }
  }
}

int32_t AddedVocab::find(std::string_view content) const {
  auto it = by_content_.find(std::string(content));
  return it == by_content_.end() ? -1 : it->second;
}

const std::string* AddedVocab::decode_string(int32_t id) const {
  auto n = normalized_content_.find(id);
  if (n != normalized_content_.end() && by_id_.count(id)) return &n->second;
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &it->second.content;
}

int64_t AddedVocab::max_id_plus_one() const {
  int64_t m = 0;
  for (auto& [id, t] : by_id_) m = std::max<int64_t>(m, int64_t{id} + 1);
  return m;
}

namespace {

// Rust regex \w$ / ^\w and the \s runs HF strips for lstrip / rstrip.
bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t n = utf8_last_len(s);
  Utf8Char c = utf8_char(s, s.size() - n);
  return c.valid && c.len == n && is_word_char(c.cp);
}
bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  Utf8Char c = utf8_char(s, 0);
  return c.valid && is_word_char(c.cp);
}
size_t trailing_space_start(std::string_view s) {
  size_t e = s.size();
  while (e > 0) {
    size_t n = utf8_last_len(s.substr(0, e));
    Utf8Char c = utf8_char(s, e - n);
    if (!c.valid || c.len != n || !is_white_space(c.cp)) break;
    e -= n;
  }
  return e;
}
size_t leading_space_len(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    Utf8Char c = utf8_char(s, i);
    if (!c.valid || !is_white_space(c.cp)) break;
    i += c.len;
  }
  return i;
}

}  // namespace

// HF's AddedVocabulary::find_matches: the trie's leftmost-longest matches in order; a
// single_word token must not touch word characters; lstrip / rstrip widen the match over the
// whitespace beside it.
void AddedVocab::split(std::string_view text, bool normalized_set,
                       const FnRef<void(std::string_view, int32_t, size_t)>& emit) const {
  const Trie& trie = normalized_set ? norm_ : raw_;
  size_t start_offset = 0;
  size_t pos = 0;
  const size_t n = text.size();
  while (pos < n) {
    size_t start = pos, len = 0;
    int32_t id = -1;
    for (; start < n; ++start) {
      if (!trie.first[static_cast<uint8_t>(text[start])]) continue;
      len = trie.longest(text, start, id);
      if (len) break;
    }
    if (!len) break;
    size_t stop = start + len;
    pos = stop;
    const AddedToken& t = by_id_.at(id);
    if (t.single_word) {
      bool start_space = start == 0 || !ends_with_word(text.substr(0, start));
      bool stop_space = stop == n || !starts_with_word(text.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
    if (t.rstrip) stop += leading_space_len(text.substr(stop));
    if (start_offset < start) emit(text.substr(start_offset, start - start_offset), -1, start_offset);
    emit(text.substr(start, stop - start), id, start);
    start_offset = stop;
  }
  if (start_offset < n) emit(text.substr(start_offset), -1, start_offset);
}

// ---- Decoders ---------------------------------------------------------------------------------

namespace {

class ByteLevelDecoder : public Decoder {
 public:
  ByteLevelDecoder() {
    byte_of_.fill(-1);
    const auto& table = byte_level_table();
    for (int b = 0; b < 256; ++b) byte_of_[utf8_char(table[b], 0).cp] = b;
  }
  void chain(std::vector<std::string>& tokens) const override {
    std::string out;
    for (const std::string& t : tokens) {
      std::string bytes;
      bool all = true;
      for (size_t i = 0; i < t.size() && all;) {
        Utf8Char c = utf8_char(t, i);
        all = c.valid && c.cp < byte_of_.size() && byte_of_[c.cp] >= 0;
        if (all) bytes += static_cast<char>(byte_of_[c.cp]);
        i += c.len;
      }
      out += all ? bytes : t;
    }
    tokens.assign(1, std::move(out));
  }

 private:
  std::array<int16_t, 0x144> byte_of_{};  // the table's characters end at U+0143
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string rep, bool strip_first) : rep_(std::move(rep)), strip_(strip_first) {}
  void chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      for (size_t k = 0; k < t.size();) {
        if (t.compare(k, rep_.size(), rep_) == 0) {
          // HF drops every replacement character of the first token, not only a leading one.
          if (!(i == 0 && strip_)) out += ' ';
          k += rep_.size();
        } else {
          out += t[k++];
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string rep_;
  bool strip_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Regex> re, std::string content)
      : re_(std::move(re)), content_(std::move(content)) {}
  void chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::string out;
      size_t prev = 0;
      re_->find_iter(t, [&](size_t b, size_t e) {
        out.append(t, prev, b - prev);
        out += content_;
        prev = e;
      });
      out.append(t, prev, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

// <0xNN> tokens become their bytes. A run that is not valid UTF-8 stays as raw bytes, one
// token per byte where HF puts one U+FFFD per byte.
class ByteFallbackDecoder : public Decoder {
 public:
  void chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string run;
    auto flush = [&] {
      if (run.empty()) return;
      bool valid = true;
      for (size_t i = 0; i < run.size() && valid;) {
        Utf8Char c = utf8_char(run, i);
        valid = c.valid;
        i += c.len;
      }
      if (valid)
        out.push_back(run);
      else
        for (char b : run) out.emplace_back(1, b);
      run.clear();
    };
    for (std::string& t : tokens) {
      int byte = parse_byte(t);
      if (byte >= 0) {
        run += static_cast<char>(byte);
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }

 private:
  static int parse_byte(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    auto hex = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    int hi = hex(t[3]), lo = hex(t[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  }
};

class FuseDecoder : public Decoder {
 public:
  void chain(std::vector<std::string>& tokens) const override {
    std::string out;
    for (const std::string& t : tokens) out += t;
    tokens.assign(1, std::move(out));
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, size_t start, size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void chain(std::vector<std::string>& tokens) const override {
    const size_t k = content_.size();
    for (std::string& t : tokens) {
      size_t b = 0, e = t.size();
      for (size_t i = 0; i < start_ && b + k <= e && t.compare(b, k, content_) == 0; ++i) b += k;
      for (size_t i = 0; i < stop_ && e >= b + k && t.compare(e - k, k, content_) == 0; ++i) e -= k;
      t = t.substr(b, e - b);
    }
  }

 private:
  std::string content_;
  size_t start_, stop_;
};

class BpeSuffixDecoder : public Decoder {
 public:
  explicit BpeSuffixDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void chain(std::vector<std::string>& tokens) const override {
    if (suffix_.empty()) return;
    for (size_t i = 0; i < tokens.size(); ++i) {
      const char* with = i + 1 == tokens.size() ? "" : " ";
      std::string out;
      const std::string& t = tokens[i];
      for (size_t k = 0; k < t.size();) {
        if (t.compare(k, suffix_.size(), suffix_) == 0) {
          out += with;
          k += suffix_.size();
        } else {
          out += t[k++];
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  void chain(std::vector<std::string>& tokens) const override {
    for (const auto& d : parts_) d->chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

size_t get_count(const json& j, const char* key, const Ctx& ctx, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return 0;
  if (!j[key].is_number_unsigned())
    ctx.fail(where + "." + key + " must be an integer >= 0, found " + describe(j[key]));
  return j[key].get<size_t>();
}

}  // namespace

std::unique_ptr<Decoder> parse_decoder(const json& j, const Ctx& ctx, const std::string& where) {
  if (j.is_null()) return nullptr;
  std::string type = j.is_object() ? ctx.get_string(j, "type", "", where) : "";
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    std::string rep = ctx.need_string(j, "replacement", where);
    std::string scheme = ctx.get_string(j, "prepend_scheme", "always", where);
    bool never = scheme == "never" || !ctx.get_bool(j, "add_prefix_space", true, where);
    return std::make_unique<MetaspaceDecoder>(rep, !never);
  }
  if (type == "Replace") {
    const json pat = j.contains("pattern") ? j["pattern"] : json();
    bool literal = pat.is_object() && pat.contains("String") && pat["String"].is_string();
    bool regex = pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string();
    if (!literal && !regex)
      ctx.fail(where + ".pattern is " + describe(pat) +
               "; expected {\"String\": \"...\"} or {\"Regex\": \"...\"}");
    auto re = std::make_unique<Regex>(pat[literal ? "String" : "Regex"].get<std::string>(),
                                      literal, ctx, where + ".pattern");
    return std::make_unique<ReplaceDecoder>(std::move(re), ctx.need_string(j, "content", where));
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip")
    return std::make_unique<StripDecoder>(ctx.need_string(j, "content", where),
                                          get_count(j, "start", ctx, where),
                                          get_count(j, "stop", ctx, where));
  if (type == "BPEDecoder")
    return std::make_unique<BpeSuffixDecoder>(ctx.get_string(j, "suffix", "</w>", where));
  if (type == "Sequence") {
    if (!j.contains("decoders") || !j["decoders"].is_array())
      ctx.fail(where + " of type \"Sequence\" has no \"decoders\" array");
    std::vector<std::unique_ptr<Decoder>> parts;
    for (size_t i = 0; i < j["decoders"].size(); ++i) {
      auto d = parse_decoder(j["decoders"][i], ctx, where + ".decoders[" + std::to_string(i) + "]");
      if (d) parts.push_back(std::move(d));
    }
    return std::make_unique<SequenceDecoder>(std::move(parts));
  }
  ctx.fail(where + ".type is " +
           (j.is_object() && j.contains("type") ? describe(j["type"]) : describe(j)) +
           ", which is not supported; supported: ByteLevel, Metaspace, Replace, ByteFallback, "
           "Fuse, Strip, BPEDecoder, Sequence");
}

// ---- The tokenizer ----------------------------------------------------------------------------

namespace {

class HfTokenizer : public Tokenizer {
 public:
  HfTokenizer(const json& doc, const std::string& path, const nlohmann::ordered_json* config,
              const std::string& config_path);
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override {
    return std::max(model_->max_id_plus_one(), added_.max_id_plus_one());
  }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }

 private:
  void parse_added_tokens(const json& added);
  void apply_config(const nlohmann::ordered_json& config, const std::string& config_path);
  int32_t token_to_id(const std::string& s) const {
    int32_t id = added_.find(s);
    return id >= 0 ? id : model_->token_to_id(s);
  }
  int32_t find_any(std::initializer_list<const char*> names) const;
  void encode_plain(std::string_view text, bool origin, std::vector<int32_t>& out) const;
  void run_stage(size_t stage, const Piece& p, std::vector<int32_t>& out) const;

  Ctx ctx_;  // first member: the model keeps a pointer to it
  std::unique_ptr<Normalizer> normalizer_;
  std::vector<std::unique_ptr<PreTokenizer>> stages_;
  std::unique_ptr<BpeModel> model_;
  AddedVocab added_;
  std::unique_ptr<Decoder> decoder_;
  int32_t bos_ = -1, eos_ = -1;
};

HfTokenizer::HfTokenizer(const json& doc, const std::string& path,
                         const nlohmann::ordered_json* config, const std::string& config_path)
    : ctx_{path} {
  if (!doc.is_object())
    ctx_.fail("expected a JSON object at the top level, found " + describe(doc));
  if (!doc.contains("model") || !doc["model"].is_object())
    ctx_.fail("no \"model\" object; a Hugging Face tokenizer.json has one with type \"BPE\"");
  const json& model = doc["model"];
  std::string type = model.contains("type") ? ctx_.get_string(model, "type", "", "model") : "";
  // HF reads a model without "type" that has vocab and merges as BPE (older files).
  if (type != "BPE" && !(type.empty() && model.contains("merges")))
    ctx_.fail("model.type is " + (model.contains("type") ? describe(model["type"]) : "missing") +
              "; only \"BPE\" is supported (WordPiece, Unigram and WordLevel are not)");
  model_ = std::make_unique<BpeModel>(model, ctx_);
  auto field = [&](const char* key) { return doc.contains(key) ? doc[key] : json(); };
  normalizer_ = parse_normalizer(field("normalizer"), ctx_, "normalizer");
  parse_pre_tokenizer(field("pre_tokenizer"), ctx_, "pre_tokenizer", stages_);
  decoder_ = parse_decoder(field("decoder"), ctx_, "decoder");
  parse_added_tokens(doc.contains("added_tokens") ? doc["added_tokens"] : json::array());
  if (config) apply_config(*config, config_path);
  // Without a tokenizer_config.json naming them, the usual names of each family: Llama-3,
  // Llama-2 / Mistral, Gemma, GPT-2 (whose <|endoftext|> is both).
  if (!config || !config->contains("bos_token"))
    bos_ = find_any({"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"});
  if (!config || !config->contains("eos_token"))
    eos_ = find_any({"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"});
}

int32_t HfTokenizer::find_any(std::initializer_list<const char*> names) const {
  for (const char* n : names)
    if (added_.find(n) >= 0) return added_.find(n);
  for (const char* n : names)
    if (model_->token_to_id(n) >= 0) return model_->token_to_id(n);
  return -1;
}

void HfTokenizer::parse_added_tokens(const json& added) {
  if (!added.is_array()) ctx_.fail("added_tokens must be an array, found " + describe(added));
  std::vector<AddedToken> tokens;
  for (size_t i = 0; i < added.size(); ++i) {
    const json& a = added[i];
    std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!a.is_object() || !a.contains("content") || !a["content"].is_string())
      ctx_.fail(where + " = " + describe(a) + "; expected an object with a string \"content\"");
    if (a.contains("id") && !(a["id"].is_number_integer() && a["id"].get<int64_t>() >= 0 &&
                              a["id"].get<int64_t>() <= INT32_MAX))
      ctx_.fail(where + ".id = " + describe(a["id"]) + "; ids must be integers in [0, 2^31)");
    AddedToken t;
    t.content = a["content"].get<std::string>();
    t.special = ctx_.get_bool(a, "special", false, where);
    t.single_word = ctx_.get_bool(a, "single_word", false, where);
    t.lstrip = ctx_.get_bool(a, "lstrip", false, where);
    t.rstrip = ctx_.get_bool(a, "rstrip", false, where);
    t.normalized = ctx_.get_bool(a, "normalized", !t.special, where);
    tokens.push_back(std::move(t));
  }
  // HF assigns the ids itself (the "id" fields only warn when they differ): a content the
  // model knows keeps the model's id, others follow the model vocabulary in file order.
  added_.add(tokens, *model_, normalizer_.get());
}

// torchtitan's HuggingFaceTokenizer._infer_special_tokens: the config's bos/eos/pad/unk/
// sep/cls/mask tokens and its added_tokens_decoder entries are added as special tokens.
void HfTokenizer::apply_config(const nlohmann::ordered_json& config,
                               const std::string& config_path) {
  auto bad = [&](const std::string& what) {
    Ctx{config_path}.fail(what);
  };
  if (!config.is_object()) bad("expected a JSON object at the top level");
  auto content_of = [&](const nlohmann::ordered_json& v, const std::string& key) {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string())
      return v["content"].get<std::string>();
    bad(key + " must be a string or an object with a string \"content\", found " +
        v.dump().substr(0, 60));
    return std::string();
  };
  auto token_of = [&](const nlohmann::ordered_json& v, const std::string& key) {
    AddedToken t;
    t.content = content_of(v, key);
    t.special = true;
    t.normalized = false;
    if (v.is_object()) {
      auto flag = [&](const char* k, bool def) {
        return v.contains(k) && v[k].is_boolean() ? v[k].get<bool>() : def;
      };
      t.single_word = flag("single_word", false);
      t.lstrip = flag("lstrip", false);
      t.rstrip = flag("rstrip", false);
      t.normalized = flag("normalized", true);
    }
    return t;
  };
  std::vector<AddedToken> tokens;
  for (const char* key : {"bos_token", "eos_token", "pad_token", "unk_token", "sep_token",
                          "cls_token", "mask_token"})
    if (config.contains(key) && !config[key].is_null()) tokens.push_back(token_of(config[key], key));
  if (config.contains("added_tokens_decoder") && config["added_tokens_decoder"].is_object())
    for (auto& [id, v] : config["added_tokens_decoder"].items())
      if (v.is_object() && v.contains("content"))
        tokens.push_back(token_of(v, "added_tokens_decoder[" + id + "]"));
  if (!tokens.empty()) added_.add(tokens, *model_, normalizer_.get());
  auto special = [&](const char* key) {
    if (!config.contains(key) || config[key].is_null()) return -1;
    return token_to_id(content_of(config[key], key));
  };
  bos_ = special("bos_token");
  eos_ = special("eos_token");
}

// HF's pipeline: split on the added tokens that skip normalization, normalize each plain
// piece, split it on the normalized added tokens, pre-tokenize, and run the model.
std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  auto raw_piece = [&](std::string_view seg, int32_t id, size_t offset) {
    if (id >= 0) {
      out.push_back(id);
      return;
    }
    std::string norm;
    std::string_view s = seg;
    if (normalizer_) {
      normalizer_->apply(seg, norm);
      s = norm;
    }
    if (!added_.has_normalized()) {
      encode_plain(s, offset == 0, out);
      return;
    }
    added_.split(s, true, [&](std::string_view s2, int32_t id2, size_t off2) {
      if (id2 >= 0)
        out.push_back(id2);
      else
        encode_plain(s2, offset == 0 && off2 == 0, out);
    });
  };
  if (added_.has_raw())
    added_.split(text, false, raw_piece);
  else if (!text.empty())
    raw_piece(text, -1, 0);
  return out;
}

void HfTokenizer::encode_plain(std::string_view text, bool origin,
                               std::vector<int32_t>& out) const {
  if (!text.empty()) run_stage(0, Piece{text, origin, false}, out);
}

void HfTokenizer::run_stage(size_t stage, const Piece& p, std::vector<int32_t>& out) const {
  if (stage == stages_.size()) {
    model_->tokenize(p, out);
    return;
  }
  stages_[stage]->run(p, [&](Piece q) {
    if (!q.text.empty()) run_stage(stage + 1, q, out);
  });
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* s = added_.decode_string(id);
    if (!s) s = model_->id_to_token(id);
    if (!s)
      throw std::out_of_range("tokenizer '" + ctx_.path + "': id " + std::to_string(id) +
                              " is not in the vocabulary (size " + std::to_string(vocab_size()) +
                              ")");
    tokens.push_back(*s);
  }
  std::string out;
  if (decoder_) {
    decoder_->chain(tokens);
    for (const std::string& t : tokens) out += t;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
  }
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const json& doc, const std::string& path,
                                             const nlohmann::ordered_json* config,
                                             const std::string& config_path) {
  return std::make_unique<HfTokenizer>(doc, path, config, config_path);
}

}  // namespace titan::tok
