// The decoders of a Hugging Face tokenizer.json, as HF `tokenizers` 0.23 runs them
// (decoders/*.rs): ids' strings back to text.
#include <algorithm>
#include <stdexcept>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_hf.h"

namespace titan::tok {

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

}  // namespace titan::tok
