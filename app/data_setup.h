// The config's data, resolved the same way for training, validation and data-preview: the
// bundled corpus or the given files, folders, globs and lists; raw text through the token
// cache; the blend with its start-up table (docs/data.md).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/data/blend.h"
#include "core/config/config.h"
#include "core/tokenizer/tokenizer.h"

namespace titan {

// Where the bundled corpus and tokenizer live ($TITAN_CACHE, else ~/.cache/titan-train).
std::string titan_cache_dir();
// model.tokenizer_path, else model.hf_assets_path/tokenizer.json, else the bundled one.
std::string resolve_tokenizer_path(const ModelSection& m);

// What raw text needs: the tokenizer (and its file, part of the cache key), and how the ranks
// share building the cache (the node's local rank 0 builds; every rank calls `barrier` once).
struct RawTextContext {
  const Tokenizer* tokenizer = nullptr;
  std::string tokenizer_path;
  bool builder = true;
  std::function<void()> barrier;  // empty in a single process
  std::function<void(const std::string&)> log;
};

// The sources of `paths` (each a path spec or a comma-separated list) with `weights`; no
// paths means the named dataset (`dataset_key` = "kjv" is the bundled corpus).
std::vector<SourceSpec> dataset_specs(const std::string& dataset, const std::vector<std::string>& paths,
                                      const std::vector<double>& weights,
                                      const std::string& section);
// Opens the blend: pre-tokenized sources are mapped, raw text is tokenized once into the
// cache (or reused), token ids are checked against `vocab`.
std::unique_ptr<Blend> open_blend(const std::vector<SourceSpec>& specs, int64_t vocab,
                                  double holdout_fraction, const RawTextContext& raw);

}  // namespace titan
