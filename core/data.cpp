#include "core/data.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/errors.h"

namespace titan {
namespace {

std::string read_whole_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw UserError("data file '" + path +
                    "': does not exist; allowed: a .txt, .jsonl or .tok file");
  if (std::filesystem::is_directory(path, ec))
    throw UserError("data file '" + path + "': is a folder; allowed: a .txt, .jsonl or .tok file");
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw UserError("data file '" + path + "': cannot be read (" + std::strerror(errno) + ")");
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  if (s.empty()) throw UserError("data file '" + path + "': is empty; allowed: a file with text");
  return s;
}

// Offset of the first invalid UTF-8 sequence, or npos.
size_t invalid_utf8_at(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = p[i];
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xE  ? 3
                 : (c >> 3) == 0x1E ? 4
                                    : 0;
    if (len == 0 || i + len > n) return i;
    for (size_t k = 1; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return i;
    if (len == 2 && c < 0xC2) return i;                       // overlong
    if (len == 3 && c == 0xE0 && p[i + 1] < 0xA0) return i;   // overlong
    if (len == 3 && c == 0xED && p[i + 1] >= 0xA0) return i;  // surrogate
    if (len == 4 && (c > 0xF4 || (c == 0xF0 && p[i + 1] < 0x90) || (c == 0xF4 && p[i + 1] >= 0x90)))
      return i;
    i += len;
  }
  return std::string::npos;
}

void require_utf8(const std::string& path, const std::string& s) {
  size_t bad = invalid_utf8_at(s);
  if (bad != std::string::npos)
    throw UserError("data file '" + path + "': not valid UTF-8 at byte offset " +
                    std::to_string(bad) + "; allowed: UTF-8 text");
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

template <class T>
void put(std::ostream& o, T v) {
  o.write(reinterpret_cast<const char*>(&v), sizeof v);
}

}  // namespace

std::vector<std::string> read_text_documents(const std::string& path) {
  std::string s = read_whole_file(path);
  require_utf8(path, s);
  std::vector<std::string> docs;
  if (ends_with(path, ".jsonl")) {
    std::stringstream ss(s);
    int64_t line_no = 0;
    for (std::string line; std::getline(ss, line);) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("text") || !j["text"].is_string())
        throw UserError("data file '" + path + "' line " + std::to_string(line_no) +
                        ": expected a JSON object with a string \"text\" field");
      docs.push_back(j["text"].get<std::string>());
    }
  } else {
    // Plain text: documents are separated by one or more blank lines.
    size_t pos = 0;
    std::string cur;
    std::stringstream ss(s);
    for (std::string line; std::getline(ss, line);) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) {
        if (!cur.empty()) docs.push_back(cur), cur.clear();
        continue;
      }
      cur += cur.empty() ? line : "\n" + line;
    }
    if (!cur.empty()) docs.push_back(cur);
    (void)pos;
  }
  if (docs.empty()) throw UserError("data file '" + path + "': holds no documents");
  return docs;
}

TokenizedDocs load_documents(const std::string& path, const Tokenizer& tok) {
  if (ends_with(path, ".tok")) {
    TokenizedDocs d = read_token_file(path);
    if (d.vocab_size > tok.vocab_size())
      throw UserError("data file '" + path + "': made with a vocabulary of " +
                      std::to_string(d.vocab_size) + " tokens, but the tokenizer has " +
                      std::to_string(tok.vocab_size()));
    return d;
  }
  TokenizedDocs d;
  d.vocab_size = tok.vocab_size();
  for (auto& doc : read_text_documents(path)) {
    auto ids = tok.encode(doc);
    d.tokens.insert(d.tokens.end(), ids.begin(), ids.end());
    d.offsets.push_back(static_cast<int64_t>(d.tokens.size()));
  }
  return d;
}

void write_token_file(const std::string& path, const TokenizedDocs& d) {
  const uint32_t width = d.vocab_size <= 65536 ? 2 : 4;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream o(tmp, std::ios::binary | std::ios::trunc);
    if (!o)
      throw UserError("output file '" + path + "': cannot be written (" + std::strerror(errno) +
                      ")");
    o.write("TITANTOK", 8);
    put<uint32_t>(o, 1);
    put<uint32_t>(o, width);
    put<uint64_t>(o, static_cast<uint64_t>(d.num_docs()));
    put<uint64_t>(o, d.tokens.size());
    put<uint64_t>(o, static_cast<uint64_t>(d.vocab_size));
    for (int64_t off : d.offsets) put<uint64_t>(o, static_cast<uint64_t>(off));
    for (int32_t t : d.tokens) {
      if (width == 2)
        put<uint16_t>(o, static_cast<uint16_t>(t));
      else
        put<uint32_t>(o, static_cast<uint32_t>(t));
    }
    o.flush();
    if (!o) throw UserError("output file '" + path + "': write failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);
}

TokenizedDocs read_token_file(const std::string& path) {
  std::string s = read_whole_file(path);
  auto bad = [&](const std::string& why) {
    return UserError("token file '" + path + "': " + why +
                     "; allowed: a file made by `titan-train tokenize`");
  };
  if (s.size() < 40 || s.compare(0, 8, "TITANTOK") != 0) throw bad("missing the TITANTOK header");
  auto rd = [&](size_t off, auto v) {
    std::memcpy(&v, s.data() + off, sizeof v);
    return v;
  };
  uint32_t version = rd(8, uint32_t{}), width = rd(12, uint32_t{});
  uint64_t docs = rd(16, uint64_t{}), ntok = rd(24, uint64_t{}), vocab = rd(32, uint64_t{});
  if (version != 1) throw bad("version " + std::to_string(version));
  if (width != 2 && width != 4) throw bad("token width " + std::to_string(width));
  if (docs > s.size() || ntok > s.size()) throw bad("counts larger than the file");
  const size_t need = 40 + 8 * (docs + 1) + width * ntok;
  if (s.size() != need)
    throw bad("size " + std::to_string(s.size()) + " bytes, header implies " +
              std::to_string(need));
  TokenizedDocs d;
  d.vocab_size = static_cast<int64_t>(vocab);
  d.offsets.resize(docs + 1);
  for (uint64_t i = 0; i <= docs; ++i)
    d.offsets[i] = static_cast<int64_t>(rd(40 + 8 * i, uint64_t{}));
  if (d.offsets.front() != 0 || d.offsets.back() != static_cast<int64_t>(ntok) ||
      !std::is_sorted(d.offsets.begin(), d.offsets.end()))
    throw bad("document offsets out of order");
  d.tokens.resize(ntok);
  const size_t base = 40 + 8 * (docs + 1);
  for (uint64_t i = 0; i < ntok; ++i) {
    uint32_t t = width == 2 ? rd(base + 2 * i, uint16_t{}) : rd(base + 4 * i, uint32_t{});
    if (t >= vocab)
      throw bad("token " + std::to_string(t) + " outside the vocabulary of " +
                std::to_string(vocab));
    d.tokens[i] = static_cast<int32_t>(t);
  }
  return d;
}

Splits split_and_pack(const TokenizedDocs& docs, double holdout_fraction, int32_t bos,
                      int32_t eos) {
  const int64_t n = docs.num_docs();
  int64_t held = static_cast<int64_t>(holdout_fraction * static_cast<double>(n));
  if (holdout_fraction > 0 && held == 0 && n >= 2) held = 1;
  Splits s;
  for (int64_t d = 0; d < n; ++d) {
    auto& out = d < n - held ? s.train : s.heldout;
    if (bos >= 0) out.push_back(bos);
    out.insert(out.end(), docs.tokens.begin() + docs.offsets[d],
               docs.tokens.begin() + docs.offsets[d + 1]);
    if (eos >= 0) out.push_back(eos);
  }
  return s;
}

PackedLoader::PackedLoader(const std::vector<int32_t>* stream, int64_t seq_len, int64_t batch_size,
                           int64_t dp_rank, int64_t dp_size, uint64_t seed, bool shuffle)
    : stream_(stream),
      seq_len_(seq_len),
      batch_(batch_size),
      rank_(dp_rank),
      dp_(dp_size),
      seed_(seed),
      shuffle_(shuffle) {
  n_windows_ = static_cast<int64_t>(stream_->size()) / (seq_len_ + 1);
  per_rank_ = n_windows_ / dp_;
  if (per_rank_ < batch_)
    throw UserError("the data holds " + std::to_string(n_windows_) + " windows of seq_len + 1 = " +
                    std::to_string(seq_len_ + 1) + " tokens, fewer than local_batch_size (" +
                    std::to_string(batch_) + ") x data-parallel ranks (" + std::to_string(dp_) +
                    "); use more data or a shorter training.seq_len");
  build_order();
}

void PackedLoader::build_order() {
  std::vector<int64_t> all(static_cast<size_t>(n_windows_));
  std::iota(all.begin(), all.end(), 0);
  if (shuffle_) {
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(st_.epoch) + 1);
    for (size_t i = all.size(); i > 1; --i) {  // Fisher-Yates with our own draws: portable
      size_t j = static_cast<size_t>(rng() % i);
      std::swap(all[i - 1], all[j]);
    }
  }
  order_.clear();
  for (int64_t i = 0; i < per_rank_; ++i)
    order_.push_back(all[static_cast<size_t>(i * dp_ + rank_)]);
}

void PackedLoader::load_state(const State& s) {
  st_ = s;
  build_order();
}

Batch PackedLoader::next() {
  if (st_.cursor + batch_ >
      per_rank_) {  // start a new epoch; the tail that does not fill a batch is skipped
    ++st_.epoch;
    st_.cursor = 0;
    build_order();
  }
  at::Tensor buf = at::empty({batch_, seq_len_ + 1}, at::kLong);
  auto* out = buf.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t start = order_[static_cast<size_t>(st_.cursor + b)] * (seq_len_ + 1);
    for (int64_t t = 0; t <= seq_len_; ++t)
      out[b * (seq_len_ + 1) + t] = (*stream_)[static_cast<size_t>(start + t)];
  }
  st_.cursor += batch_;
  return {buf.slice(1, 0, seq_len_).contiguous(), buf.slice(1, 1, seq_len_ + 1).contiguous()};
}

}  // namespace titan
