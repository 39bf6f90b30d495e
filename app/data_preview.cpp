#include "app/data_preview.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/data_setup.h"
#include "core/data/blend.h"
#include "core/config/config.h"
#include "core/base/errors.h"
#include "core/data/loader.h"
#include "models/registry.h"

namespace titan {
namespace {

const char* kUsage =
    "titan-train data-preview: the windows the first steps of a training run read\n"
    "usage: titan-train data-preview [training flags: --config FILE, --section.key=value ...]\n"
    "                                [--steps N] [--rank R] [--world W] [--tokens N|all]\n"
    "  --steps N   steps to list (default 1)\n"
    "  --rank R    data-parallel rank (default 0)\n"
    "  --world W   data-parallel degree (default 1)\n"
    "  --tokens N  ids to print per window (default 8); all: the whole window, seq_len + 1\n"
    "Prints one JSON line per window, in step, micro-batch, row order: {\"step\", \"rank\",\n"
    "\"micro\", \"row\", \"source\", \"path\", \"offset\", \"tokens\"} (path: the shard holding\n"
    "the window's first token; offset: that token's offset in the shard; tokens: its first\n"
    "ids; inputs are tokens[0, seq_len), labels tokens[1, seq_len]). The blend table goes to\n"
    "stderr.\n";

int64_t int_flag(const std::string& name, const std::string& text, int64_t min) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < min)
    throw UserError("data-preview: " + name + " '" + text + "'; allowed: an integer >= " +
                    std::to_string(min));
  return v;
}

}  // namespace

int run_data_preview(int argc, char** argv) {
  int64_t steps = 1, rank = 0, world = 1, ntokens = 8;
  std::vector<const char*> rest = {"titan-train"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    bool mine = false;
    for (const char* flag : {"--steps", "--rank", "--world", "--tokens"}) {
      std::string value;
      if (a == flag) {
        if (i + 1 >= argc) throw UserError(std::string("data-preview: ") + flag + " needs a value");
        value = argv[++i];
      } else if (a.rfind(std::string(flag) + "=", 0) == 0) {
        value = a.substr(std::strlen(flag) + 1);
      } else {
        continue;
      }
      mine = true;
      if (a.rfind("--steps", 0) == 0) steps = int_flag("--steps", value, 0);
      if (a.rfind("--rank", 0) == 0) rank = int_flag("--rank", value, 0);
      if (a.rfind("--world", 0) == 0) world = int_flag("--world", value, 1);
      if (a.rfind("--tokens", 0) == 0)
        ntokens = value == "all" ? -1 : int_flag("--tokens", value, 1);
    }
    if (!mine) rest.push_back(argv[i]);
  }
  CliResult cli = parse_command_line(static_cast<int>(rest.size()), rest.data());
  const JobConfig& cfg = cli.cfg;
  for (auto& w : cli.warnings) std::fprintf(stderr, "titan-train: warning: %s\n", w.c_str());
  validate_for_world(cfg, world);
  const DerivedConfig d = derive_config(cfg, world);
  if (rank >= d.dp_degree)
    throw UserError("data-preview: --rank " + std::to_string(rank) + "; allowed: 0.." +
                    std::to_string(d.dp_degree - 1) + " (the data-parallel degree is " +
                    std::to_string(d.dp_degree) + ")");
  // Raw text is tokenized into the cache as training would (one process: it builds).
  std::unique_ptr<Tokenizer> tok;
  RawTextContext raw;
  raw.tokenizer_path = resolve_tokenizer_path(cfg.model);
  raw.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  auto specs = dataset_specs(cfg.training.dataset, cfg.training.dataset_path,
                             cfg.training.dataset_weights, "training");
  for (auto& sp : specs)
    if (is_raw_text_path(sp.path) && !tok) tok = load_tokenizer(raw.tokenizer_path);
  raw.tokenizer = tok.get();
  auto blend_ptr =
      open_blend(specs, model_vocab_size(cfg), cfg.training.holdout_fraction, raw);
  const Blend& blend = *blend_ptr;
  std::fprintf(stderr, "%s\n",
               blend.describe(cfg.training.seq_len, cfg.training.steps, d.global_batch).c_str());
  const std::string repeats =
      blend.repeat_warning(cfg.training.seq_len, cfg.training.steps, d.global_batch);
  if (!repeats.empty()) std::fprintf(stderr, "titan-train: warning: %s\n", repeats.c_str());
  LoaderLayout layout{cfg.training.seq_len, cfg.training.local_batch_size, rank, d.dp_degree,
                      d.grad_accum_steps};
  for (const WindowPreview& w :
       preview_windows(blend, layout, static_cast<uint64_t>(cfg.debug.seed), steps,
                       ntokens < 0 ? cfg.training.seq_len + 1 : ntokens)) {
    nlohmann::ordered_json j;
    j["step"] = w.step;
    j["rank"] = w.rank;
    j["micro"] = w.micro;
    j["row"] = w.row;
    j["source"] = w.source;
    j["path"] = w.path;
    j["offset"] = w.offset;
    j["tokens"] = w.tokens;
    std::printf("%s\n", j.dump().c_str());
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace titan
