// The added vocabulary of a Hugging Face tokenizer.json, as HF `tokenizers` 0.23 keeps it
// (tokenizer/added_vocabulary.rs): a trie of the added tokens, and the split of a text on them
// with HF's single_word / lstrip / rstrip rules.
#include <algorithm>
#include <stdexcept>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_hf.h"

namespace titan::tok {

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

}  // namespace titan::tok
