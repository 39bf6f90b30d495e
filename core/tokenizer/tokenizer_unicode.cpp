// UTF-8, Unicode properties and normalization for the tokenizer, on utf8proc (Unicode 15.0
// in Debian 12's libutf8proc 2.8, linked statically). HF `tokenizers` 0.23.3 takes its
// normalization tables from the unicode-normalization-alignments crate (older than Unicode
// 12) and its case mappings from Rust's std (Unicode 16); the tables below bridge both gaps
// for the code points where the versions differ (docs/tokenizer.md).
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "core/base/errors.h"
#include "core/tokenizer/tokenizer_hf.h"

namespace titan::tok {

// ---- Errors -----------------------------------------------------------------------------------

void Ctx::fail(const std::string& what) const {
  throw UserError("tokenizer file '" + path + "': " + what);
}

std::string describe(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

bool Ctx::get_bool(const json& j, const char* key, bool def, const std::string& where) const {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_boolean())
    fail(where + "." + key + " must be true or false, found " + describe(j[key]));
  return j[key].get<bool>();
}

std::string Ctx::get_string(const json& j, const char* key, const std::string& def,
                            const std::string& where) const {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_string()) fail(where + "." + key + " must be a string, found " + describe(j[key]));
  return j[key].get<std::string>();
}

std::string Ctx::need_string(const json& j, const char* key, const std::string& where) const {
  if (!j.is_object() || !j.contains(key) || !j[key].is_string())
    fail(where + "." + key + " must be a string, found " +
         (j.is_object() && j.contains(key) ? describe(j[key]) : std::string("nothing")));
  return j[key].get<std::string>();
}

// ---- UTF-8 ------------------------------------------------------------------------------------

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_last_len(std::string_view s) {
  // Walk back over at most 3 continuation bytes, then check that the sequence found is valid
  // and ends exactly at the end of s.
  size_t n = s.size();
  for (size_t k = 1; k <= 4 && k <= n; ++k) {
    auto c = static_cast<uint8_t>(s[n - k]);
    if ((c & 0xC0) != 0x80) {
      Utf8Char ch = utf8_char(s, n - k);
      return ch.valid && ch.len == k ? k : 1;
    }
  }
  return 1;
}

// ---- Properties -------------------------------------------------------------------------------

bool is_white_space(uint32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

namespace {

int category(uint32_t cp) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(cp));
}

bool is_letter_category(int c) {
  return c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO;
}

}  // namespace

bool is_word_char(uint32_t cp) {
  if (cp < 0x80)
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') ||
           cp == '_';
  int c = category(cp);
  if (is_letter_category(c) || c == UTF8PROC_CATEGORY_MN || c == UTF8PROC_CATEGORY_MC ||
      c == UTF8PROC_CATEGORY_ME || c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL ||
      c == UTF8PROC_CATEGORY_PC)
    return true;
  // Join_Control, and the Other_Alphabetic symbols (circled and squared Latin letters) that
  // the categories above miss.
  return cp == 0x200C || cp == 0x200D || (cp >= 0x24B6 && cp <= 0x24E9) ||
         (cp >= 0x1F130 && cp <= 0x1F149) || (cp >= 0x1F150 && cp <= 0x1F169) ||
         (cp >= 0x1F170 && cp <= 0x1F189);
}

bool is_numeric(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  int c = category(cp);
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

bool is_punctuation(uint32_t cp) {
  if (cp < 0x80)
    return (cp >= '!' && cp <= '/') || (cp >= ':' && cp <= '@') || (cp >= '[' && cp <= '`') ||
           (cp >= '{' && cp <= '~');
  int c = category(cp);
  return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

bool is_mark(uint32_t cp) {
  if (cp < 0x80) return false;
  int c = category(cp);
  return c == UTF8PROC_CATEGORY_MN || c == UTF8PROC_CATEGORY_MC || c == UTF8PROC_CATEGORY_ME;
}

// ---- Normalization ----------------------------------------------------------------------------

namespace {

// Code points that utf8proc (Unicode 15) decomposes but HF's tables do not know (assigned in
// Unicode 12 to 15), plus U+11930, which Unicode 13 composes with U+11935. HF leaves all of
// them alone, so we pass them through as barriers. Sorted, inclusive ranges.
constexpr std::pair<uint32_t, uint32_t> kNewerDecompositions[] = {
    {0x32FF, 0x32FF},   {0xA7F2, 0xA7F4},   {0xAB69, 0xAB69},   {0x10781, 0x10785},
    {0x10787, 0x107B0}, {0x107B2, 0x107BA}, {0x11930, 0x11930}, {0x11938, 0x11938},
    {0x1E030, 0x1E06D}, {0x1F16C, 0x1F16C}, {0x1FBF0, 0x1FBF9},
};

bool is_barrier(uint32_t cp) {
  if (cp < 0x32FF) return false;
  for (auto [lo, hi] : kNewerDecompositions)
    if (cp >= lo && cp <= hi) return true;
  return false;
}

// Normalizes a run of valid UTF-8 with no barrier inside.
void normalize_run(std::string_view s, NormForm form, std::string& out) {
  if (s.empty()) return;
  int opts = UTF8PROC_STABLE;
  switch (form) {
    case NormForm::NFC: opts |= UTF8PROC_COMPOSE; break;
    case NormForm::NFD: opts |= UTF8PROC_DECOMPOSE; break;
    case NormForm::NFKC: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormForm::NFKD: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* dst = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &dst,
                                    static_cast<utf8proc_option_t>(opts));
  if (n < 0) {
    // Only allocation can fail here: the run was checked to be valid UTF-8.
    std::free(dst);
    throw std::bad_alloc();
  }
  out.append(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
}

}  // namespace

void normalize_unicode(std::string_view s, NormForm form, std::string& out) {
  // ASCII text is already in every normal form, and no ASCII character combines with one
  // after it, so only each non-ASCII run plus the character before it needs utf8proc.
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    size_t ascii_end = i;
    while (ascii_end < n && static_cast<uint8_t>(s[ascii_end]) < 0x80) ++ascii_end;
    if (ascii_end == n) {
      out.append(s.substr(i));
      return;
    }
    // The run starts one character early: a base letter may compose with a following mark.
    size_t run = ascii_end > i ? ascii_end - 1 : ascii_end;
    out.append(s.substr(i, run - i));
    size_t j = ascii_end;
    while (j < n && static_cast<uint8_t>(s[j]) >= 0x80) {
      Utf8Char ch = utf8_char(s, j);
      if (!ch.valid || is_barrier(ch.cp)) {
        normalize_run(s.substr(run, j - run), form, out);
        out.append(s.substr(j, ch.len));
        j += ch.len;
        run = j;
        continue;
      }
      j += ch.len;
    }
    normalize_run(s.substr(run, j - run), form, out);
    i = j;
  }
}

namespace {

// Rust's std (Unicode 16) lowercases these; utf8proc 2.8 (Unicode 15) does not.
uint32_t lower_unicode16(uint32_t cp) {
  if (cp >= 0x10D50 && cp <= 0x10D65) return cp + 0x20;
  if (cp >= 0x16EA0 && cp <= 0x16EB8) return cp + 0x1B;
  switch (cp) {
    case 0x1C89: case 0xA7CC: case 0xA7CE: case 0xA7D2: case 0xA7D4: case 0xA7DA:
      return cp + 1;
    case 0xA7CB: return 0x264;
    case 0xA7DC: return 0x19B;
    default: return cp;
  }
}

}  // namespace

void lowercase(std::string_view s, std::string& out) {
  out.reserve(out.size() + s.size());
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      out += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
      ++i;
      continue;
    }
    Utf8Char ch = utf8_char(s, i);
    if (!ch.valid) {
      out += s[i];
    } else if (ch.cp == 0x130) {
      out += "i\xCC\x87";  // the one unconditional multi-character lowercase mapping
    } else {
      uint32_t lower = lower_unicode16(ch.cp);
      if (lower == ch.cp)
        lower = static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(ch.cp)));
      utf8_append(out, lower);
    }
    i += ch.len;
  }
}

}  // namespace titan::tok
