// Text generation from a model of any family: a prompt's tokens in, new tokens out, greedy or
// sampled (temperature, top-k, top-p), with a KV cache (models/kv_cache.h) or, as the
// reference, by a full forward of the whole sequence for every new token.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "core/train/model.h"

namespace titan {

struct SampleOptions {
  double temperature = 0;  // 0: greedy (argmax); otherwise logits / temperature
  int64_t top_k = 0;       // 0: every token; otherwise only the k most likely
  double top_p = 1.0;      // nucleus: the smallest set of tokens whose probability reaches p
  uint64_t seed = 0;       // the sampling stream
};

// One token from a row of logits (V) by `opts`; `gen` is the sampling stream (CPU).
int64_t sample_token(const at::Tensor& logits, const SampleOptions& opts, at::Generator& gen);

struct GenerateOptions {
  SampleOptions sample;
  int64_t max_new_tokens = 32;
  int64_t stop_token = -1;  // stop after generating it (EOS); -1: never
  bool use_cache = true;    // false: a full forward per new token (the reference)
  // > 0: sample only ids below it (the tokenizer's vocabulary, when the model's table is
  // larger, as gpt_oss's 201088 rows against a small tokenizer); 0: every id.
  int64_t vocab_limit = 0;
};

// The continuation of `prompt` (its token ids): up to max_new_tokens new ids (fewer when
// stop_token comes, which is included). Runs under NoGradGuard; prompt.size() +
// max_new_tokens must fit model.info().max_seq_len (TORCH_CHECK: the caller checks the user's
// input). `on_token`, if set, sees each new id as it is generated.
std::vector<int64_t> generate_tokens(Model& model, const std::vector<int64_t>& prompt,
                                     const GenerateOptions& opts,
                                     const std::function<void(int64_t)>& on_token = {});

}  // namespace titan
