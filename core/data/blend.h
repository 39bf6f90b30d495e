// Weighted blends of token sources and the order in which their windows are drawn.
//
// A window is seq_len + 1 consecutive tokens of a source's stream; window w covers tokens
// [w * (seq_len + 1), (w + 1) * (seq_len + 1)) of the source's training range. Global sample
// g = 0, 1, 2, ... picks its source by Megatron's greedy rule (the source s maximising
// weight_s * (g + 1) - drawn_s, lowest s on ties); the k-th draw from s reads window
// P_{seed,s,e}(k mod W_s) of epoch e = k / W_s, where P is a keyed Feistel permutation of the
// W_s windows. The position is (g, drawn_s): O(sources), independent of the world size.
// docs/data.md "Blends" has the rule with a worked example.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/data/token_source.h"

namespace titan {

struct SourceSpec {
  std::string path;    // a path spec (TokenSource::open)
  double weight = -1;  // < 0: not given; then every source weighs its training tokens
};

// Sources from the config: each entry of `paths` is a path spec or a comma-separated list of
// them; `weights` is empty or holds one weight per source. Throws UserError naming the key for
// an empty list, a wrong weight count, a negative or non-finite weight, or all-zero weights.
std::vector<SourceSpec> parse_dataset_spec(
    const std::vector<std::string>& paths, const std::vector<double>& weights,
    const std::string& paths_key = "training.dataset_path",
    const std::string& weights_key = "training.dataset_weights");
// Weights from text (a list of entries, each a number or a comma-separated list).
std::vector<double> parse_weight_list(const std::vector<std::string>& texts,
                                      const std::string& key = "training.dataset_weights");

struct BlendOptions {
  int64_t vocab = 0;            // > 0: token ids must be below it
  double holdout_fraction = 0;  // the last fraction of each source's documents is held out
  // Raw text (.txt, .jsonl, ...) -> the path of its cached .tok v2 (the tokenize cache);
  // empty: raw text is a UserError.
  std::function<std::string(const std::string&)> resolve_raw;
};

struct TokenRange {
  int64_t begin = 0, end = 0;  // stream positions [begin, end)
  int64_t size() const { return end - begin; }
};

class Blend {
 public:
  // Opens every source (headers only) and normalises the weights.
  Blend(const std::vector<SourceSpec>& specs, const BlendOptions& opts = {});

  size_t size() const { return sources_.size(); }
  const TokenSource& source(size_t i) const { return *sources_[i]; }
  const std::vector<double>& weights() const { return weights_; }  // sum to 1
  // Training and held-out token ranges of source i. Holdout: the last floor(fraction * D)
  // documents (at least one when the fraction is > 0 and D >= 2); by tokens for llm.c data,
  // whose document count is unknown.
  TokenRange train_range(size_t i) const { return train_[i]; }
  TokenRange holdout_range(size_t i) const { return holdout_[i]; }
  // Whole windows of seq_len + 1 tokens in each source's training range.
  std::vector<int64_t> train_windows(int64_t seq_len) const;

  // The start-up table: one row per source, and how many epochs of it a run of `steps`
  // steps x `global_batch` windows will consume (expected draws / windows).
  struct Row {
    std::string path, format;
    int64_t documents = -1;  // -1: unknown (llm.c)
    int64_t tokens = 0;      // training tokens
    int64_t windows = 0;
    double weight = 0, epochs = 0;
  };
  std::vector<Row> rows(int64_t seq_len, int64_t steps, int64_t global_batch) const;
  std::string describe(int64_t seq_len, int64_t steps, int64_t global_batch) const;
  // One line per source the run will read more than once; empty when none repeats.
  std::string repeat_warning(int64_t seq_len, int64_t steps, int64_t global_batch) const;
  // How often `token` occurs in the first min(max_tokens, size) tokens of source i's training
  // range: {tokens read, occurrences}. The start-up check that block-causal data has document
  // boundaries (docs/attention.md) reads a prefix, not the corpus.
  std::pair<int64_t, int64_t> count_in_prefix(size_t i, int64_t token, int64_t max_tokens) const;

 private:
  std::vector<std::shared_ptr<const TokenSource>> sources_;
  std::vector<double> weights_;
  std::vector<TokenRange> train_, holdout_;
};

// A keyed pseudo-random bijection of [0, n) in O(1) memory: a balanced Feistel network over
// the smallest even number of bits covering n, cycle-walking until the value is below n
// (fewer than 4 rounds of walking on average, since the domain is < 4n).
class FeistelPermutation {
 public:
  FeistelPermutation(uint64_t n, uint64_t key);
  uint64_t operator()(uint64_t i) const;
  uint64_t size() const { return n_; }

 private:
  uint64_t encrypt(uint64_t x) const;
  uint64_t n_;
  int half_bits_ = 0;
  uint64_t half_mask_ = 0;
  uint64_t round_keys_[6] = {};
};

// The blend's position: global samples drawn and draws per source.
struct BlendState {
  int64_t g = 0;
  std::vector<int64_t> drawn;
};

struct Draw {
  int64_t source = 0;
  int64_t epoch = 0;   // k / W_s
  int64_t window = 0;  // window index within the source's training range
};

class BlendSampler {
 public:
  // weights: normalised; windows: W_s > 0 for every source.
  BlendSampler(std::vector<double> weights, std::vector<int64_t> windows, uint64_t seed);
  size_t num_sources() const { return weights_.size(); }
  const std::vector<int64_t>& windows() const { return windows_; }
  BlendState initial_state() const;
  // The source of sample st.g (greedy rule).
  int64_t pick(const BlendState& st) const;
  // Draws sample st.g and advances st.
  Draw draw(BlendState& st) const;
  // The k-th draw from source s.
  Draw kth(int64_t s, int64_t k) const;

 private:
  std::vector<double> weights_;
  std::vector<int64_t> windows_;
  uint64_t seed_;
};

}  // namespace titan
