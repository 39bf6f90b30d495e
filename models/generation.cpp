#include "models/generation.h"

#include <limits>
#include <tuple>

#include "models/kv_cache.h"

namespace titan {

int64_t sample_token(const at::Tensor& logits_row, const SampleOptions& o, at::Generator& gen) {
  at::Tensor l = logits_row.to(at::kCPU, at::kFloat).reshape({-1});  // (V)
  if (o.temperature <= 0) return l.argmax().item<int64_t>();
  l = l / o.temperature;
  if (o.top_k > 0 && o.top_k < l.size(0)) {
    // Everything below the k-th largest logit is out.
    const double kth = std::get<0>(l.topk(o.top_k)).min().item<double>();
    l = l.masked_fill(l < kth, -std::numeric_limits<float>::infinity());
  }
  if (o.top_p < 1.0) {
    // Sorted descending, a token stays while the probability mass before it is below p, so the
    // most likely token always stays.
    auto [sorted, idx] = l.sort(/*dim=*/0, /*descending=*/true);
    const at::Tensor before = sorted.softmax(0).cumsum(0) - sorted.softmax(0);
    const at::Tensor drop_sorted = before >= o.top_p;
    const at::Tensor drop = at::zeros_like(drop_sorted).scatter(0, idx, drop_sorted);
    l = l.masked_fill(drop, -std::numeric_limits<float>::infinity());
  }
  return at::multinomial(l.softmax(0), 1, /*replacement=*/false, gen).item<int64_t>();
}

std::vector<int64_t> generate_tokens(Model& model, const std::vector<int64_t>& prompt,
                                     const GenerateOptions& opts,
                                     const std::function<void(int64_t)>& on_token) {
  TORCH_CHECK(!prompt.empty(), "generate_tokens: an empty prompt");
  const int64_t window = model.info().max_seq_len;
  TORCH_CHECK(static_cast<int64_t>(prompt.size()) + opts.max_new_tokens <= window,
              "generate_tokens: ", prompt.size(), " + ", opts.max_new_tokens,
              " tokens exceed the window of ", window);
  at::NoGradGuard ng;
  const at::Device dev = model.params()[0].value.device();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(opts.sample.seed);
  auto as_tensor = [&](const std::vector<int64_t>& ids) {
    return at::tensor(ids, at::kLong).view({1, -1}).to(dev);  // (1, T)
  };
  std::vector<int64_t> seq = prompt, out;
  KvCache cache(1, static_cast<int64_t>(prompt.size()) + opts.max_new_tokens);
  std::vector<int64_t> feed = prompt;  // what the next forward reads (with the cache)
  for (int64_t i = 0; i < opts.max_new_tokens; ++i) {
    at::Tensor logits;  // (1, T, V)
    if (opts.use_cache) {
      KvCacheScope scope(cache);
      cache.begin(static_cast<int64_t>(feed.size()));
      logits = model.forward(as_tensor(feed));
      cache.end();
    } else {
      logits = model.forward(as_tensor(seq));
    }
    at::Tensor last = logits[0][logits.size(1) - 1];  // (V)
    if (opts.vocab_limit > 0 && opts.vocab_limit < last.size(0))
      last = last.narrow(0, 0, opts.vocab_limit);
    const int64_t next = sample_token(last, opts.sample, gen);
    seq.push_back(next);
    out.push_back(next);
    feed = {next};
    if (on_token) on_token(next);
    if (next == opts.stop_token) break;
  }
  return out;
}

}  // namespace titan
