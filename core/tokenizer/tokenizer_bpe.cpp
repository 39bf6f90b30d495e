// The BPE model of a tokenizer.json, as HF `tokenizers` 0.23 runs it (models/bpe/model.rs,
// word.rs): per-character vocabulary lookups with byte fallback and unknown-token fusing,
// then merges lowest (rank, position) first, and a per-thread cache of whole words.
#include <atomic>
#include <cstring>
#include <queue>

#include "core/base/errors.h"
#include "core/tokenizer/tokenizer_hf.h"

namespace titan::tok {

namespace {

uint64_t hash_bytes(std::string_view s, uint64_t seed) {
  const char* p = s.data();
  size_t n = s.size();
  uint64_t h = seed ^ (n * 0x9E3779B97F4A7C15ull);
  while (n >= 8) {
    uint64_t k;
    std::memcpy(&k, p, 8);
    h = (h ^ k) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t k = 0;
    std::memcpy(&k, p, n);
    h = (h ^ k) * 0x94D049BB133111EBull;
    h ^= h >> 29;
  }
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

// Pre-token -> ids, owned by one thread, so encode() needs no lock. Open addressing over
// 2^16 slots, at most half of them used; when full it starts over (words repeat, so the
// cache refills with the frequent ones).
class WordCache {
 public:
  static constexpr size_t kMaxKey = 128;  // bytes; longer pre-tokens are not cached

  bool find(uint64_t h, std::string_view key, bool mapped, std::vector<int32_t>& out) const {
    for (size_t i = h & kMask;; i = (i + 1) & kMask) {
      const Slot& s = slots_[i];
      if (s.hash == 0) return false;
      if (s.hash == h && s.mapped == mapped && s.key_len == key.size() &&
          std::memcmp(keys_.data() + s.key_off, key.data(), key.size()) == 0) {
        out.insert(out.end(), vals_.begin() + s.val_off, vals_.begin() + s.val_off + s.val_len);
        return true;
      }
    }
  }

  void insert(uint64_t h, std::string_view key, bool mapped, const int32_t* ids, size_t n) {
    if (n > UINT16_MAX) return;
    if (used_ >= kSlots / 2) clear();
    size_t i = h & kMask;
    while (slots_[i].hash != 0) i = (i + 1) & kMask;
    slots_[i] = Slot{h,
                     static_cast<uint32_t>(keys_.size()),
                     static_cast<uint32_t>(vals_.size()),
                     static_cast<uint16_t>(key.size()),
                     static_cast<uint16_t>(n),
                     mapped};
    keys_.append(key);
    vals_.insert(vals_.end(), ids, ids + n);
    ++used_;
  }

 private:
  static constexpr size_t kSlots = 1 << 16;
  static constexpr size_t kMask = kSlots - 1;
  struct Slot {
    uint64_t hash = 0;  // 0 marks an empty slot
    uint32_t key_off = 0, val_off = 0;
    uint16_t key_len = 0, val_len = 0;
    bool mapped = false;
  };
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    vals_.clear();
    used_ = 0;
  }
  std::vector<Slot> slots_ = std::vector<Slot>(kSlots);
  std::string keys_;
  std::vector<int32_t> vals_;
  size_t used_ = 0;
};

// Each thread keeps the caches of the last few tokenizers it used, keyed by a process-wide
// instance number (never reused, so a destroyed tokenizer's entries are never read).
WordCache& thread_cache(uint64_t instance) {
  struct Entry {
    uint64_t owner = 0;
    uint64_t last_use = 0;
    std::unique_ptr<WordCache> cache;
  };
  thread_local std::array<Entry, 3> entries;
  thread_local uint64_t clock = 0;
  ++clock;
  Entry* victim = &entries[0];
  for (Entry& e : entries) {
    if (e.owner == instance) {
      e.last_use = clock;
      return *e.cache;
    }
    if (e.last_use < victim->last_use) victim = &e;
  }
  victim->owner = instance;
  victim->last_use = clock;
  victim->cache = std::make_unique<WordCache>();
  return *victim->cache;
}

std::atomic<uint64_t> next_instance{1};

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

}  // namespace

BpeModel::BpeModel(const json& model, const Ctx& ctx) : ctx_(&ctx) {
  instance_ = next_instance.fetch_add(1);
  const std::string where = "model";
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    if (!model["dropout"].is_number())
      ctx.fail("model.dropout must be null or a number, found " + describe(model["dropout"]));
    if (model["dropout"].get<double>() != 0.0)
      ctx.fail("model.dropout = " + describe(model["dropout"]) +
               " is not supported (it makes encoding random); use null");
  }
  unk_token_ = ctx.get_string(model, "unk_token", "", where);
  has_unk_ = model.contains("unk_token") && model["unk_token"].is_string();
  prefix_ = ctx.get_string(model, "continuing_subword_prefix", "", where);
  suffix_ = ctx.get_string(model, "end_of_word_suffix", "", where);
  simple_chars_ = prefix_.empty() && suffix_.empty();
  fuse_unk_ = ctx.get_bool(model, "fuse_unk", false, where);
  byte_fallback_ = ctx.get_bool(model, "byte_fallback", false, where);
  ignore_merges_ = ctx.get_bool(model, "ignore_merges", false, where);
  if (!model.contains("vocab") || !model["vocab"].is_object())
    ctx.fail("model.vocab must be an object mapping token strings to ids, found " +
             (model.contains("vocab") ? describe(model["vocab"]) : std::string("nothing")));
  parse_vocab(model["vocab"], ctx);
  if (!model.contains("merges") || !model["merges"].is_array())
    ctx.fail("model.merges must be an array of \"a b\" strings or [\"a\", \"b\"] pairs, found " +
             (model.contains("merges") ? describe(model["merges"]) : std::string("nothing")));
  parse_merges(model["merges"], ctx);
  if (has_unk_) {
    int32_t id = token_to_id(unk_token_);
    unk_id_ = id >= 0 ? id : -2;
  }
}

void BpeModel::parse_vocab(const json& vocab, const Ctx& ctx) {
  int64_t max_id = -1;
  vocab_.reserve(vocab.size());
  for (auto& [tok, idj] : vocab.items()) {
    if (!valid_token_id(idj))
      ctx.fail("model.vocab[" + json(tok).dump() + "] = " + describe(idj) + "; " + kTokenIdRule);
    vocab_.emplace(tok, idj.get<int32_t>());
    max_id = std::max<int64_t>(max_id, idj.get<int64_t>());
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), nullptr);
  // Two tokens with one id load in HF too; decode then shows the first in key order here.
  for (auto& [tok, id] : vocab_)
    if (!id_to_token_[id] || tok < *id_to_token_[id]) id_to_token_[id] = &tok;
  const auto& table = byte_level_table();
  for (int b = 0; b < 256; ++b) {
    byte_level_id_[b] = token_to_id(table[b]);
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    fallback_id_[b] = token_to_id(hex);
    if (b < 128) ascii_id_[b] = token_to_id(std::string(1, static_cast<char>(b)));
  }
  for (auto& [tok, id] : vocab_) {
    Utf8Char c = tok.empty() ? Utf8Char{0, 0, false} : utf8_char(tok, 0);
    if (c.valid && c.len == tok.size() && c.cp >= 0x80) char_id_.emplace(c.cp, id);
  }
  split_at_metaspace_ = simple_chars_ && !ignore_merges_ && char_id_.count(0x2581);
  for (auto it = vocab_.begin(); split_at_metaspace_ && it != vocab_.end(); ++it) {
    const std::string& tok = it->first;
    for (size_t i = tok.find(kMetaspace, 1); i != std::string::npos && split_at_metaspace_;
         i = tok.find(kMetaspace, i + 3))
      split_at_metaspace_ = i >= 3 && tok.compare(i - 3, 3, kMetaspace) == 0;
  }
}

void BpeModel::parse_merges(const json& merges, const Ctx& ctx) {
  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  merge_keys_.assign(cap, UINT64_MAX);
  merge_vals_.assign(cap, Merge{0, 0});
  merge_mask_ = cap - 1;
  int32_t rank = 0;
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    std::string a, b;
    std::string where = "model.merges[" + std::to_string(i) + "] = " + describe(m);
    if (m.is_string()) {
      auto s = m.get<std::string>();
      if (s.rfind("#version", 0) == 0) continue;  // merges.txt header, skipped as HF does
      auto sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        ctx.fail(where + ": a string merge must be two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      ctx.fail(where + ": a merge must be an \"a b\" string or an [\"a\", \"b\"] pair");
    }
    // With a continuing_subword_prefix, b carries the prefix and a + b drops it.
    std::string ab = a + b.substr(std::min(prefix_.size(), b.size()));
    int32_t ia = token_to_id(a), ib = token_to_id(b), iab = token_to_id(ab);
    if (ia < 0 || ib < 0 || iab < 0) {
      std::string t = ia < 0 ? a : ib < 0 ? b : ab;
      ctx.fail(where + ": token " + json(t).dump() + " is not in model.vocab");
    }
    uint64_t key = (static_cast<uint64_t>(ia) << 32) | static_cast<uint32_t>(ib);
    size_t slot = (key * 0x9E3779B97F4A7C15ull >> 20) & merge_mask_;
    while (merge_keys_[slot] != UINT64_MAX && merge_keys_[slot] != key)
      slot = (slot + 1) & merge_mask_;
    // A repeated pair takes its last rank, as HF's map of merges does.
    merge_keys_[slot] = key;
    merge_vals_[slot] = Merge{rank++, iab};
  }
}

const BpeModel::Merge* BpeModel::find_merge(int32_t a, int32_t b) const {
  uint64_t key = (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b);
  for (size_t slot = (key * 0x9E3779B97F4A7C15ull >> 20) & merge_mask_;;
       slot = (slot + 1) & merge_mask_) {
    if (merge_keys_[slot] == key) return &merge_vals_[slot];
    if (merge_keys_[slot] == UINT64_MAX) return nullptr;
  }
}

int32_t BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? -1 : it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < id_to_token_.size() ? id_to_token_[id] : nullptr;
}

void BpeModel::tokenize(const Piece& p, std::vector<int32_t>& out) const {
  if (!split_at_metaspace_ || p.mapped) {
    tokenize_word(p, out);
    return;
  }
  // Cut before every "▁" that follows another character (see split_at_metaspace_).
  const std::string_view t = p.text;
  size_t start = 0;
  for (size_t i = t.find(kMetaspace, 1); i != std::string_view::npos;
       i = t.find(kMetaspace, i + 3)) {
    if (i >= 3 && t.compare(i - 3, 3, kMetaspace) == 0) continue;
    tokenize_word(Piece{t.substr(start, i - start), false, false}, out);
    start = i;
  }
  tokenize_word(Piece{t.substr(start), false, false}, out);
}

void BpeModel::tokenize_word(const Piece& p, std::vector<int32_t>& out) const {
  if (p.text.empty()) return;
  if (p.text.size() > WordCache::kMaxKey) {
    tokenize_uncached(p, out);
    return;
  }
  WordCache& cache = thread_cache(instance_);
  uint64_t h = hash_bytes(p.text, p.mapped ? 0x51ED27 : 0x7F4A7C15);
  h += h == 0;
  if (cache.find(h, p.text, p.mapped, out)) return;
  size_t start = out.size();
  tokenize_uncached(p, out);
  cache.insert(h, p.text, p.mapped, out.data() + start, out.size() - start);
}

void BpeModel::tokenize_uncached(const Piece& p, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    std::string buf;
    int32_t id = token_to_id(materialize(p, buf));
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  std::vector<int32_t> syms;
  syms.reserve(p.text.size());
  initial_symbols(p, syms);
  merge_all(syms);
  out.insert(out.end(), syms.begin(), syms.end());
}

// One character (already mapped for byte-level pieces) that is not a plain vocabulary hit:
// HF's merge_word with the prefix/suffix, byte fallback and unknown-token rules. An unknown
// character waits in pending_unk so that fuse_unk can join it with the next one.
void BpeModel::add_char(std::string_view ch, bool first, bool last, std::vector<int32_t>& syms,
                        int32_t& pending_unk) const {
  std::string s;
  if (!first) s += prefix_;
  s.append(ch);
  if (last) s += suffix_;
  int32_t id = token_to_id(s);
  if (id >= 0) {
    if (pending_unk >= 0) syms.push_back(pending_unk);
    pending_unk = -1;
    syms.push_back(id);
    return;
  }
  if (byte_fallback_) {
    bool all = true;
    for (char c : s) all = all && fallback_id_[static_cast<uint8_t>(c)] >= 0;
    if (all) {
      // HF leaves a pending unknown token waiting here, after these bytes.
      for (char c : s) syms.push_back(fallback_id_[static_cast<uint8_t>(c)]);
      return;
    }
  }
  if (!has_unk_) return;  // no unk token: HF drops the character
  if (unk_id_ < 0)
    ctx_->fail("model.unk_token " + json(unk_token_).dump() +
               " is not in model.vocab, and the text has a character the vocabulary lacks");
  if (pending_unk >= 0 && !fuse_unk_) syms.push_back(pending_unk);
  pending_unk = unk_id_;
}

void BpeModel::initial_symbols(const Piece& p, std::vector<int32_t>& syms) const {
  int32_t pending_unk = -1;
  const std::string_view t = p.text;
  const auto& table = byte_level_table();
  auto push = [&](int32_t id) {
    if (pending_unk >= 0) syms.push_back(pending_unk);
    pending_unk = -1;
    syms.push_back(id);
  };
  if (p.mapped) {
    for (size_t i = 0; i < t.size(); ++i) {
      auto b = static_cast<uint8_t>(t[i]);
      if (simple_chars_ && byte_level_id_[b] >= 0)
        push(byte_level_id_[b]);
      else
        add_char(table[b], i == 0, i + 1 == t.size(), syms, pending_unk);
    }
  } else {
    for (size_t i = 0; i < t.size();) {
      Utf8Char c = utf8_char(t, i);
      int32_t id = -1;
      if (simple_chars_ && c.valid) {
        if (c.cp < 0x80) {
          id = ascii_id_[c.cp];
        } else {
          auto it = char_id_.find(c.cp);
          if (it != char_id_.end()) id = it->second;
        }
      }
      if (id >= 0)
        push(id);
      else
        add_char(t.substr(i, c.len), i == 0, i + c.len == t.size(), syms, pending_unk);
      i += c.len;
    }
  }
  if (pending_unk >= 0) syms.push_back(pending_unk);
}

// HF's Word::merge_all without dropout: a min-heap of candidate merges by (rank, position),
// symbols in a linked list, stale candidates skipped when the pair no longer yields new_id.
void BpeModel::merge_all(std::vector<int32_t>& syms) const {
  const auto n = static_cast<int32_t>(syms.size());
  if (n < 2) return;
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  std::vector<Cand> storage;
  storage.reserve(n);
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap(std::greater<Cand>(),
                                                                        std::move(storage));
  auto push = [&](int32_t pos) {
    int32_t nx = next[pos];
    if (nx < 0) return;
    if (const Merge* m = find_merge(syms[pos], syms[nx])) heap.push({m->rank, pos, m->new_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    int32_t right = next[c.pos];
    const Merge* m = find_merge(syms[c.pos], syms[right]);
    if (!m || m->new_id != c.new_id) continue;
    syms[c.pos] = c.new_id;
    alive[right] = 0;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.pos;
    if (prev[c.pos] >= 0) push(prev[c.pos]);
    push(c.pos);
  }
  int32_t k = 0;
  for (int32_t i = 0; i < n; ++i)
    if (alive[i]) syms[k++] = syms[i];
  syms.resize(k);
}

}  // namespace titan::tok
