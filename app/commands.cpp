#include "app/commands.h"
#include "app/data_preview.h"
#include "app/estimate.h"
#include "app/generate_command.h"
#include "app/tokenize_command.h"

#include <CLI/CLI.hpp>

#include <memory>
#include <set>
#include <string>

#include "app/trainer.h"
#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/checkpoint/safetensors.h"
#include "core/tokenizer/tokenizer.h"
#include "models/deepseek_v3.h"
#include "models/hf_interop.h"
#include "models/llama3.h"
#include "models/gpt_oss.h"
#include "models/qwen3.h"

namespace titan {

bool parse_subcommand(CLI::App& app, int argc, char** argv, const char* name) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return false;
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string(name) + ": " + e.what());
  }
  return true;
}

namespace {

// The model's HF tensors (hf_tensors: its parameters, plus deepseek_v3's expert biases) from a
// flat safetensors file of our names, the file --to-safetensors writes: every tensor present
// with its shape and a floating dtype, and nothing else, all checked before any tensor changes.
void load_tensors_file(const NamedTensors& tensors, const std::string& path) {
  SafetensorsFile f = SafetensorsFile::open(path);
  std::set<std::string> names;
  for (auto& [name, t] : tensors) {
    names.insert(name);
    if (!f.contains(name))
      throw UserError(path + " has no tensor '" + name + "' (shape " + shape_str(t.sizes().vec()) +
                      ")");
    const SafetensorsEntry& e = f.entry(name);
    if (e.shape != t.sizes().vec())
      throw UserError(path + ": tensor '" + name + "' has shape " + shape_str(e.shape) +
                      "; expected " + shape_str(t.sizes().vec()));
    if (!at::isFloatingType(e.dtype))
      throw UserError(path + ": tensor '" + name + "' has dtype " +
                      safetensors_dtype_name(e.dtype) +
                      "; expected a floating dtype (F64, F32, F16, BF16)");
  }
  for (auto& e : f.entries()) {
    if (!names.count(e.name))
      throw UserError(path + ": tensor '" + e.name +
                      "' is not a tensor of this model; wrong model or flavor?");
  }
  at::NoGradGuard ng;
  for (auto& [name, t] : tensors) {
    at::Tensor dst = t;
    dst.copy_(f.get(name));
  }
}

// The model to convert through, allocated but not initialized: every tensor is overwritten
// from the input. seq_len only matters for deepseek_v3's config.json (YaRN above 4096).
std::unique_ptr<Model> convert_model(const std::string& name, const std::string& flavor,
                                     int64_t seq_len) {
  if (name == "llama3") return std::make_unique<Llama3>(llama3_flavor(flavor), at::kCPU);
  if (name == "qwen3") return std::make_unique<Qwen3>(qwen3_flavor(flavor), at::kCPU);
  if (name == "gpt_oss") return std::make_unique<GptOss>(gpt_oss_flavor(flavor), at::kCPU);
  DeepSeekV3Args a = deepseek_v3_flavor(flavor);
  a.max_seq_len = seq_len;
  return std::make_unique<DeepSeekV3>(a, at::kCPU);
}

// titan-train convert-hf: Hugging Face folder <-> flat safetensors of our parameter names.
int run_convert_hf(int argc, char** argv) {
  CLI::App app{
      "titan-train convert-hf: convert weights between a Hugging Face folder and a safetensors "
      "file of titan-train parameter names"};
  std::string model = "llama3", flavor, from_hf, to_st, from_st, to_hf, dtype = "float32";
  int64_t seq_len = 2048;
  app.add_option("--model", model,
                 "model family: llama3, deepseek_v3, qwen3 or gpt_oss (default llama3)")
      ->check(CLI::IsMember(hf_supported_models()));
  app.add_option("--flavor", flavor,
                 "model flavor (shapes); hf: the --from-hf folder's config.json (llama3)")
      ->required();
  auto* o_from_hf = app.add_option("--from-hf", from_hf, "Hugging Face folder to read");
  auto* o_to_st = app.add_option("--to-safetensors", to_st, "safetensors file to write");
  auto* o_from_st = app.add_option("--from-safetensors", from_st, "safetensors file to read");
  auto* o_to_hf = app.add_option("--to-hf", to_hf,
                                 "Hugging Face folder to write (must not exist "
                                 "or be empty)");
  auto* o_dtype = app.add_option("--dtype", dtype,
                                 "dtype of the tensors written to --to-hf: float32, bfloat16, "
                                 "float16 (--to-safetensors always writes float32)");
  auto* o_seq_len =
      app.add_option("--seq-len", seq_len,
                     "deepseek_v3 only: the training sequence length, for config.json's RoPE "
                     "(YaRN when above 4096; default 2048)")
          ->check(CLI::PositiveNumber);
  o_from_hf->needs(o_to_st)->excludes(o_from_st)->excludes(o_to_hf);
  o_to_st->needs(o_from_hf);
  o_from_st->needs(o_to_hf);
  o_to_hf->needs(o_from_st);
  o_dtype->needs(o_to_hf);
  if (!parse_subcommand(app, argc, argv, "convert-hf")) return 0;
  if (from_hf.empty() && from_st.empty())
    throw UserError(
        "convert-hf: give --from-hf DIR --to-safetensors FILE, or "
        "--from-safetensors FILE --to-hf DIR");
  const at::ScalarType export_dtype = hf_export_dtype(dtype, "convert-hf --dtype");
  if (o_seq_len->count() > 0 && model != "deepseek_v3")
    throw UserError("convert-hf: --seq-len is for --model deepseek_v3 only; found --model " +
                    model);
  // --flavor hf: the dimensions of the --from-hf folder's config.json (any Llama-3-architecture
  // model, not only the built-in flavors); printed, with the built-in flavor they match.
  if (flavor == "hf") {
    if (model != "llama3" || from_hf.empty())
      throw UserError(
          "convert-hf --flavor hf: reads the --from-hf folder's config.json, for "
          "--model llama3; allowed: --model llama3 --from-hf DIR, or a flavor name");
    flavor = "hf:" + from_hf;
    const Llama3Args a = llama3_flavor(flavor);
    const std::string match = llama3_matching_flavor(a);
    log_info("convert-hf: " + from_hf + "/config.json: " + describe_llama3_args(a) + " (" +
             (match.empty() ? "a custom flavor; train it with --model.flavor " + flavor
                            : "the built-in flavor " + match) +
             ")");
  }
  std::unique_ptr<Model> m = convert_model(model, flavor, seq_len);
  if (!from_hf.empty()) {
    import_model_hf(*m, from_hf);
    NamedTensors out;
    for (auto& [name, t] : hf_tensors(*m)) out.emplace_back(name, t.detach());
    save_safetensors(to_st, out);
    log_info("convert-hf: " + from_hf + " -> " + to_st);
  } else {
    load_tensors_file(hf_tensors(*m), from_st);
    HfExportOptions opts;
    opts.dtype = export_dtype;
    export_model_hf(*m, to_hf, opts);
    log_info("convert-hf: " + from_st + " -> " + to_hf + " (" + dtype + ")");
  }
  return 0;
}

}  // namespace

int run_subcommand(int argc, char** argv) {
  const std::string name = argv[0];
  if (name == "tokenize") return run_tokenize_command(argc, argv);
  if (name == "convert-hf") return run_convert_hf(argc, argv);
  if (name == "data-preview") return run_data_preview(argc, argv);
  if (name == "estimate") return run_estimate_command(argc, argv);
  if (name == "generate") return run_generate_command(argc, argv);
  throw UserError(
      "unknown subcommand '" + name +
      "'; allowed: tokenize, convert-hf, data-preview, estimate, generate (see --help)");
}

int run_train_command(const JobConfig& cfg, const LaunchEnv& launch) {
  return Trainer(cfg, launch).run();
}

}  // namespace titan
