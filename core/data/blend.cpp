#include "core/data/blend.h"

#include "core/base/hash.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/base/errors.h"

namespace titan {
namespace {

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

std::vector<std::string> split_commas(const std::vector<std::string>& texts) {
  std::vector<std::string> out;
  for (auto& t : texts) {
    std::stringstream ss(t);
    for (std::string part; std::getline(ss, part, ',');)
      if (!trim(part).empty()) out.push_back(trim(part));
  }
  return out;
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// 1234567 -> "1,234,567"
std::string grouped(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0 && s[i - 1] != '-') out += ',';
    out += s[i];
  }
  return out;
}

}  // namespace

std::vector<double> parse_weight_list(const std::vector<std::string>& texts,
                                      const std::string& key) {
  std::vector<double> out;
  for (auto& t : split_commas(texts)) {
    char* end = nullptr;
    const double v = std::strtod(t.c_str(), &end);
    if (end == t.c_str() || *end != '\0')
      throw UserError(key + ": '" + t + "' is not a number; allowed: non-negative numbers");
    out.push_back(v);
  }
  return out;
}

std::vector<SourceSpec> parse_dataset_spec(const std::vector<std::string>& paths,
                                           const std::vector<double>& weights,
                                           const std::string& paths_key,
                                           const std::string& weights_key) {
  std::vector<SourceSpec> out;
  for (auto& p : split_commas(paths)) out.push_back({p, -1});
  if (out.empty()) throw UserError(paths_key + " is empty; allowed: one or more data paths");
  if (weights.empty()) return out;
  if (weights.size() != out.size())
    throw UserError(weights_key + " has " + std::to_string(weights.size()) + " weight" +
                    (weights.size() == 1 ? "" : "s") + " but " + paths_key + " names " +
                    std::to_string(out.size()) + " source" + (out.size() == 1 ? "" : "s") +
                    "; allowed: one weight per source");
  double sum = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!std::isfinite(weights[i]) || weights[i] < 0)
      throw UserError(weights_key + "[" + std::to_string(i) + "] = " + fmt("%g", weights[i]) +
                      "; allowed: a finite weight >= 0");
    out[i].weight = weights[i];
    sum += weights[i];
  }
  if (sum <= 0) throw UserError(weights_key + " are all zero; allowed: at least one weight > 0");
  return out;
}

// ---- Blend ------------------------------------------------------------------------------------

Blend::Blend(const std::vector<SourceSpec>& specs, const BlendOptions& opts) {
  TORCH_CHECK(!specs.empty(), "Blend: no sources");
  const bool given = specs[0].weight >= 0;
  double sum = 0;
  for (const SourceSpec& sp : specs) {
    TORCH_CHECK((sp.weight >= 0) == given, "Blend: weights must be given for all sources or none");
    std::string path = sp.path, origin;
    if (opts.resolve_raw && is_raw_text_path(path)) origin = path, path = opts.resolve_raw(path);
    auto src = TokenSource::open(path, opts.vocab, origin);
    const int64_t n = src->num_tokens(), d = src->num_docs();
    int64_t boundary = n;
    if (opts.holdout_fraction > 0) {
      if (d >= 0) {  // whole documents: the last floor(fraction * D), at least one of two or more
        int64_t held = static_cast<int64_t>(opts.holdout_fraction * static_cast<double>(d));
        if (held == 0 && d >= 2) held = 1;
        boundary = src->doc_start(d - held);
      } else {
        boundary = n - static_cast<int64_t>(opts.holdout_fraction * static_cast<double>(n));
      }
    }
    train_.push_back({0, boundary});
    holdout_.push_back({boundary, n});
    const double w = given ? sp.weight : static_cast<double>(boundary);
    weights_.push_back(w);
    sum += w;
    sources_.push_back(std::move(src));
  }
  if (sum <= 0)
    throw UserError(
        "the data sources hold no training tokens (weights all zero); allowed: "
        "at least one source with a weight > 0");
  for (double& w : weights_) w /= sum;
}

std::vector<int64_t> Blend::train_windows(int64_t seq_len) const {
  TORCH_CHECK(seq_len > 0, "train_windows: seq_len ", seq_len);
  std::vector<int64_t> w;
  for (auto& r : train_) w.push_back(r.size() / (seq_len + 1));
  return w;
}

std::pair<int64_t, int64_t> Blend::count_in_prefix(size_t i, int64_t token,
                                                   int64_t max_tokens) const {
  const int64_t n = std::min(max_tokens, train_[i].size());
  std::vector<int64_t> buf(static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 16)));
  int64_t hits = 0;
  for (int64_t done = 0; done < n;) {
    const int64_t k = std::min<int64_t>(n - done, static_cast<int64_t>(buf.size()));
    sources_[i]->read(train_[i].begin + done, k, buf.data());
    hits += std::count(buf.begin(), buf.begin() + k, token);
    done += k;
  }
  return {n, hits};
}

std::vector<Blend::Row> Blend::rows(int64_t seq_len, int64_t steps, int64_t global_batch) const {
  std::vector<Row> out;
  const auto windows = train_windows(seq_len);
  const double draws = static_cast<double>(steps) * static_cast<double>(global_batch);
  for (size_t i = 0; i < size(); ++i) {
    Row r;
    r.path = sources_[i]->spec();
    r.format = token_format_name(sources_[i]->format());
    if (sources_[i]->num_shards() > 1) r.format += " x" + std::to_string(sources_[i]->num_shards());
    r.documents = sources_[i]->num_docs();
    r.tokens = train_[i].size();
    r.windows = windows[i];
    r.weight = weights_[i];
    r.epochs = windows[i] > 0 ? weights_[i] * draws / static_cast<double>(windows[i])
                              : (weights_[i] > 0 ? INFINITY : 0.0);
    out.push_back(r);
  }
  return out;
}

std::string Blend::describe(int64_t seq_len, int64_t steps, int64_t global_batch) const {
  std::ostringstream os;
  os << "data: " << size() << " source" << (size() == 1 ? "" : "s")
     << ", windows of seq_len + 1 = " << seq_len + 1 << " tokens, " << steps << " steps x "
     << global_batch << " windows\n";
  char line[512];
  std::snprintf(line, sizeof line, "  %-3s %-12s %14s %16s %12s %7s %8s  %s\n", "#", "format",
                "documents", "tokens", "windows", "weight", "epochs", "path");
  os << line;
  const auto rs = rows(seq_len, steps, global_batch);
  for (size_t i = 0; i < rs.size(); ++i) {
    const Row& r = rs[i];
    std::snprintf(line, sizeof line, "  %-3zu %-12s %14s %16s %12s %7.4f %8.3f  %s\n", i,
                  r.format.c_str(), r.documents < 0 ? "n/a" : grouped(r.documents).c_str(),
                  grouped(r.tokens).c_str(), grouped(r.windows).c_str(), r.weight, r.epochs,
                  r.path.c_str());
    os << line;
  }
  std::string s = os.str();
  s.pop_back();
  return s;
}

std::string Blend::repeat_warning(int64_t seq_len, int64_t steps, int64_t global_batch) const {
  std::string out;
  const auto rs = rows(seq_len, steps, global_batch);
  for (size_t i = 0; i < rs.size(); ++i) {
    if (rs[i].epochs <= 1.0) continue;
    if (!out.empty()) out += "\n";
    out += "data source " + std::to_string(i) + " ('" + rs[i].path + "') will be read " +
           fmt("%.2f", rs[i].epochs) + " times in this run: its windows repeat (each epoch in " +
           "a new order)";
  }
  return out;
}

// ---- Feistel permutation ----------------------------------------------------------------------

FeistelPermutation::FeistelPermutation(uint64_t n, uint64_t key) : n_(n) {
  TORCH_CHECK(n > 0, "FeistelPermutation: empty domain");
  int bits = 0;
  while (bits < 64 && (uint64_t{1} << bits) < n) ++bits;
  half_bits_ = (bits + 1) / 2;
  half_mask_ = half_bits_ == 0 ? 0 : (uint64_t{1} << half_bits_) - 1;
  for (int r = 0; r < 6; ++r)
    round_keys_[r] = splitmix64(key ^ splitmix64(static_cast<uint64_t>(r) + 1));
}

uint64_t FeistelPermutation::encrypt(uint64_t x) const {
  uint64_t left = x >> half_bits_, right = x & half_mask_;
  for (uint64_t k : round_keys_) {
    const uint64_t f = splitmix64(right ^ k) & half_mask_;
    const uint64_t next = left ^ f;
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

uint64_t FeistelPermutation::operator()(uint64_t i) const {
  TORCH_CHECK(i < n_, "FeistelPermutation: ", i, " outside [0, ", n_, ")");
  if (n_ == 1) return 0;
  // Cycle-walking: the network permutes [0, 4^h); following the cycle from i until it
  // re-enters [0, n) gives a bijection of [0, n).
  uint64_t x = i;
  do x = encrypt(x);
  while (x >= n_);
  return x;
}

// ---- sampler ----------------------------------------------------------------------------------

BlendSampler::BlendSampler(std::vector<double> weights, std::vector<int64_t> windows, uint64_t seed)
    : weights_(std::move(weights)), windows_(std::move(windows)), seed_(seed) {
  TORCH_CHECK(!weights_.empty() && weights_.size() == windows_.size(), "BlendSampler: sizes");
}

BlendState BlendSampler::initial_state() const {
  BlendState st;
  st.drawn.assign(weights_.size(), 0);
  return st;
}

int64_t BlendSampler::pick(const BlendState& st) const {
  const double next = static_cast<double>(st.g + 1);
  int64_t best = 0;
  double best_err = -INFINITY;
  for (size_t s = 0; s < weights_.size(); ++s) {
    const double err = weights_[s] * next - static_cast<double>(st.drawn[s]);
    if (err > best_err) best = static_cast<int64_t>(s), best_err = err;
  }
  return best;
}

Draw BlendSampler::kth(int64_t s, int64_t k) const {
  const int64_t W = windows_[static_cast<size_t>(s)];
  Draw d;
  d.source = s;
  d.epoch = k / W;
  const uint64_t key = splitmix64(seed_ ^ splitmix64(static_cast<uint64_t>(s) * 0x100000001B3ull +
                                                     splitmix64(static_cast<uint64_t>(d.epoch))));
  d.window = static_cast<int64_t>(
      FeistelPermutation(static_cast<uint64_t>(W), key)(static_cast<uint64_t>(k % W)));
  return d;
}

Draw BlendSampler::draw(BlendState& st) const {
  const int64_t s = pick(st);
  const int64_t k = st.drawn[static_cast<size_t>(s)]++;
  ++st.g;
  return kth(s, k);
}

}  // namespace titan
