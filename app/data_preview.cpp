#include "app/data_preview.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/blend.h"
#include "core/config.h"
#include "core/errors.h"
#include "core/loader.h"
#include "models/deepseek_v3.h"
#include "models/llama3.h"
#include "models/llama4.h"

namespace titan {
namespace {

const char* kUsage =
    "titan-train data-preview: the windows the first steps of a training run read\n"
    "usage: titan-train data-preview [training flags: --config FILE, --section.key=value ...]\n"
    "                                [--steps N] [--rank R] [--world W]\n"
    "  --steps N   steps to list (default 1)\n"
    "  --rank R    data-parallel rank (default 0)\n"
    "  --world W   data-parallel degree (default 1)\n"
    "Prints one JSON line per window: {\"step\", \"rank\", \"source\", \"path\", \"offset\",\n"
    "\"tokens\"} (path: the shard holding the window's first token; offset: that token's\n"
    "offset in the shard; tokens: the first 8 ids). The blend table goes to stderr.\n";

int64_t int_flag(const std::string& name, const std::string& text, int64_t min) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < min)
    throw UserError("data-preview: " + name + " '" + text + "'; allowed: an integer >= " +
                    std::to_string(min));
  return v;
}

// The vocabulary of the configured model flavor, without building the model.
int64_t model_vocab(const JobConfig& cfg) {
  if (cfg.model.name == "llama3") return llama3_flavor(cfg.model.flavor).vocab_size;
  if (cfg.model.name == "llama4") return llama4_flavor(cfg.model.flavor).vocab_size;
  if (cfg.model.name == "deepseek_v3") return deepseek_v3_flavor(cfg.model.flavor).vocab_size;
  return 0;
}

// The training sources from the config. Today training.dataset_path is one string, which
// may hold a comma-separated list; the lead feeds the list keys here once they exist.
std::vector<SourceSpec> training_sources(const JobConfig& cfg) {
  if (cfg.training.dataset_path.empty())
    throw UserError("data-preview: training.dataset_path is empty; allowed: pre-tokenized data "
                    "(.tok v2, Megatron, llm.c; a file, folder, glob or comma-separated list)");
  return parse_dataset_spec({cfg.training.dataset_path}, {});
}

}  // namespace

int run_data_preview(int argc, char** argv) {
  int64_t steps = 1, rank = 0, world = 1;
  std::vector<const char*> rest = {"titan-train"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    bool mine = false;
    for (const char* flag : {"--steps", "--rank", "--world"}) {
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
    }
    if (!mine) rest.push_back(argv[i]);
  }
  CliResult cli = parse_command_line(static_cast<int>(rest.size()), rest.data());
  const JobConfig& cfg = cli.cfg;
  for (auto& w : cli.warnings) std::fprintf(stderr, "titan-train: warning: %s\n", w.c_str());
  validate_config(cfg, world);
  const DerivedConfig d = derive_config(cfg, world);
  if (rank >= d.dp_degree)
    throw UserError("data-preview: --rank " + std::to_string(rank) + "; allowed: 0.." +
                    std::to_string(d.dp_degree - 1) + " (the data-parallel degree is " +
                    std::to_string(d.dp_degree) + ")");
  BlendOptions opts;
  opts.vocab = model_vocab(cfg);
  opts.holdout_fraction = cfg.training.holdout_fraction;
  Blend blend(training_sources(cfg), opts);
  std::fprintf(stderr, "%s\n",
               blend.describe(cfg.training.seq_len, cfg.training.steps, d.global_batch).c_str());
  const std::string repeats =
      blend.repeat_warning(cfg.training.seq_len, cfg.training.steps, d.global_batch);
  if (!repeats.empty()) std::fprintf(stderr, "titan-train: warning: %s\n", repeats.c_str());
  LoaderLayout layout{cfg.training.seq_len, cfg.training.local_batch_size, rank, d.dp_degree,
                      d.grad_accum_steps};
  for (const WindowPreview& w :
       preview_windows(blend, layout, static_cast<uint64_t>(cfg.debug.seed), steps)) {
    nlohmann::ordered_json j;
    j["step"] = w.step;
    j["rank"] = w.rank;
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
