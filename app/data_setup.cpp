#include "app/data_setup.h"

#include <cstdlib>

#include "core/base/errors.h"
#include "core/data/token_cache.h"

namespace titan {

std::string titan_cache_dir() {
  const char* e = std::getenv("TITAN_CACHE");
  if (e && *e) return e;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/titan-train";
}

std::string resolve_tokenizer_path(const ModelSection& m) {
  if (!m.tokenizer_path.empty()) return m.tokenizer_path;
  if (!m.hf_assets_path.empty()) return m.hf_assets_path + "/tokenizer.json";
  return titan_cache_dir() + "/data/tokenizer.json";
}

std::vector<SourceSpec> dataset_specs(const std::string& dataset,
                                      const std::vector<std::string>& paths,
                                      const std::vector<double>& weights,
                                      const std::string& section) {
  const std::string paths_key = section + ".dataset_path";
  const std::string weights_key = section + ".dataset_weights";
  if (!paths.empty()) return parse_dataset_spec(paths, weights, paths_key, weights_key);
  if (dataset == "kjv")
    return parse_dataset_spec({titan_cache_dir() + "/data/kjv.txt"}, weights, paths_key,
                              weights_key);
  throw UserError(section + ".dataset = \"" + dataset +
                  "\" is not a bundled dataset; allowed: kjv, or give files with " + paths_key);
}

std::unique_ptr<Blend> open_blend(const std::vector<SourceSpec>& specs, int64_t vocab,
                                  double holdout_fraction, const RawTextContext& raw) {
  BlendOptions o;
  o.vocab = vocab;
  o.holdout_fraction = holdout_fraction;
  o.resolve_raw = [&raw](const std::string& path) {
    TokenCacheOptions co;
    co.builder = raw.builder;
    co.barrier = raw.barrier;
    TokenCacheResult r = ensure_token_cache(path, *raw.tokenizer, raw.tokenizer_path, co);
    if (raw.log) raw.log(r.log_line);
    return r.path;
  };
  return std::make_unique<Blend>(specs, o);
}

}  // namespace titan
