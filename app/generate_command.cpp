#include "app/generate_command.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "app/checkpointer.h"
#include "app/commands.h"
#include "app/data_setup.h"
#include "core/base/errors.h"
#include "core/telemetry/cuda_info.h"
#include "core/tokenizer/tokenizer.h"
#include "models/generation.h"
#include "models/hf_interop.h"
#include "models/registry.h"

namespace titan {

namespace fs = std::filesystem;

namespace {

struct GenerateArgs {
  JobConfig cfg;
  std::string checkpoint, from_hf, prompt;
  GenerateOptions gen;
};

GenerateArgs parse_generate_args(int argc, char** argv) {
  CLI::App app{
      "titan-train generate: continue a prompt with a trained model (a checkpoint of this "
      "program, or a Hugging Face folder)"};
  GenerateArgs a;
  std::string config_file;
  int64_t seed = 0;
  app.add_option("--config", config_file, "the job config (TOML) the model was trained with")
      ->required();
  auto* ck = app.add_option("--checkpoint", a.checkpoint,
                            "a checkpoint step folder (step-N), or a checkpoint folder (its "
                            "latest complete step)");
  auto* hf = app.add_option("--from-hf", a.from_hf,
                            "a Hugging Face folder of the config's model family and flavor "
                            "(its tokenizer.json is used when the config names none)");
  ck->excludes(hf);
  app.add_option("--prompt", a.prompt, "the text to continue")->required();
  app.add_option("--max-new-tokens", a.gen.max_new_tokens, "tokens to generate (default 32)")
      ->check(CLI::PositiveNumber);
  app.add_option("--temperature", a.gen.sample.temperature,
                 "sampling temperature; 0: greedy (default 1.0)")
      ->check(CLI::NonNegativeNumber);
  a.gen.sample.temperature = 1.0;
  app.add_option("--top-k", a.gen.sample.top_k, "sample among the k most likely; 0: all")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", a.gen.sample.top_p, "nucleus sampling mass in (0, 1] (default 1)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", seed, "the sampling stream (default 0)")->check(CLI::NonNegativeNumber);
  bool no_cache = false;
  app.add_flag("--no-kv-cache", no_cache,
               "a full forward of the whole sequence per new token (the reference, for timing)");
  app.footer(
      "Any training override works too, e.g. --model.flavor debugmodel_moe or "
      "--training.seq_len 2048 (the window: the longest prompt plus continuation).");
  app.allow_extras();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string("generate: ") + e.what());
  }
  if (a.checkpoint.empty() && a.from_hf.empty())
    throw UserError("generate: no weights; give --checkpoint DIR or --from-hf DIR");
  if (!(a.gen.sample.top_p > 0))
    throw UserError("generate: --top-p " + std::to_string(a.gen.sample.top_p) +
                    "; allowed: (0, 1]");
  a.gen.sample.seed = static_cast<uint64_t>(seed);
  a.gen.use_cache = !no_cache;
  std::vector<std::string> args = {"titan-train", "--config", config_file};
  for (const std::string& x : app.remaining()) args.push_back(x);
  std::vector<const char*> argv2;
  for (const std::string& x : args) argv2.push_back(x.c_str());
  a.cfg = parse_command_line(static_cast<int>(argv2.size()), argv2.data()).cfg;
  validate_config(a.cfg);
  return a;
}

// --checkpoint DIR: a step folder as it is, or a checkpoint folder's latest complete step.
std::string resolve_step_folder(const std::string& dir) {
  if (!fs::is_directory(dir))
    throw UserError("generate --checkpoint '" + dir +
                    "': no such folder; allowed: a checkpoint step folder (step-N) or a "
                    "checkpoint folder holding them");
  const std::vector<int64_t> steps = Checkpointer::complete_steps(dir);
  if (!steps.empty()) return (fs::path(dir) / ("step-" + std::to_string(steps.back()))).string();
  return dir;
}

void load_weights(const GenerateArgs& a, Model& model) {
  if (!a.from_hf.empty()) {
    require_hf_supported(model, "generate --from-hf");
    import_model_hf(model, a.from_hf);
    return;
  }
  JobConfig cfg = a.cfg;
  cfg.checkpoint.enable = false;
  cfg.checkpoint.initial_load_path = resolve_step_folder(a.checkpoint);
  cfg.checkpoint.initial_load_model_only = true;
  Checkpointer ck(cfg, 0, 1);
  TrainingState st;
  st.model = &model;
  std::fprintf(stderr, "generate: %s\n", ck.load(st).c_str());
}

std::string tokenizer_path(const GenerateArgs& a) {
  const ModelSection& m = a.cfg.model;
  const std::string hf_tok = a.from_hf + "/tokenizer.json";
  if (m.tokenizer_path.empty() && m.hf_assets_path.empty() && !a.from_hf.empty() &&
      fs::exists(hf_tok))
    return hf_tok;
  return resolve_tokenizer_path(m);
}

}  // namespace

int run_generate_command(int argc, char** argv) {
  GenerateArgs a = parse_generate_args(argc, argv);
  const bool cuda = a.cfg.training.device != "cpu" && cuda_device_count() > 0;
  if (cuda) cuda_set_device(0);
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  std::unique_ptr<Model> model = build_model(a.cfg, device);
  if (cuda && a.cfg.training.mixed_precision_param == "bfloat16")
    model->set_compute_dtype(at::kBFloat16);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(tokenizer_path(a));
  if (tok->vocab_size() > model->info().vocab_size)
    throw UserError("generate: the tokenizer " + tokenizer_path(a) + " has " +
                    std::to_string(tok->vocab_size()) + " tokens; allowed: at most the model's " +
                    std::to_string(model->info().vocab_size) + " (model.flavor)");
  a.gen.vocab_limit = tok->vocab_size();  // rows past the tokenizer's ids are never sampled

  // The prompt as training saw documents: BOS first when the tokenizer has one.
  std::vector<int64_t> prompt;
  if (tok->bos_id() >= 0) prompt.push_back(tok->bos_id());
  for (int32_t id : tok->encode(a.prompt)) prompt.push_back(id);
  const int64_t window = model->info().max_seq_len;
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (n >= window)
    throw UserError("generate --prompt: " + std::to_string(n) +
                    " tokens; allowed: fewer than the model's window of " + std::to_string(window) +
                    " tokens (llama3: the flavor's; the others: the run's sequence length, "
                    "training.seq_len or validation.seq_len when validating with longer ones)");
  if (n + a.gen.max_new_tokens > window) {
    std::fprintf(stderr,
                 "generate: --max-new-tokens %lld cut to %lld: the window is %lld tokens "
                 "(raise training.seq_len for more)\n",
                 static_cast<long long>(a.gen.max_new_tokens), static_cast<long long>(window - n),
                 static_cast<long long>(window));
    a.gen.max_new_tokens = window - n;
  }
  a.gen.stop_token = tok->eos_id();
  load_weights(a, *model);  // after the checks of the input, which need no weights

  std::fputs(a.prompt.c_str(), stdout);
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> out = generate_tokens(*model, prompt, a.gen, [&](int64_t id) {
    if (id == tok->eos_id()) return;
    std::fputs(tok->decode({static_cast<int32_t>(id)}).c_str(), stdout);
    std::fflush(stdout);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fputs("\n", stdout);
  std::fprintf(stderr, "generate: %zu tokens in %.2f s, %.1f tokens/s (%s, %s)\n", out.size(), s,
               static_cast<double>(out.size()) / std::max(s, 1e-9), cuda ? "CUDA" : "CPU",
               a.gen.use_cache ? "KV cache" : "no cache: a full forward per token");
  return 0;
}

}  // namespace titan
