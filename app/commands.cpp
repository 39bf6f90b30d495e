#include "app/commands.h"

#include <CLI/CLI.hpp>

#include <string>

#include "core/data.h"
#include "core/errors.h"
#include "core/log.h"
#include "core/safetensors.h"
#include "core/tokenizer.h"
#include "core/trainer.h"
#include "models/hf_interop.h"
#include "models/llama3.h"

namespace titan {
namespace {

// titan-train tokenize: text or JSONL -> a pre-tokenized .tok file for training.dataset_path.
int run_tokenize(int argc, char** argv) {
  CLI::App app{"titan-train tokenize: pre-tokenize a text or JSONL file into a .tok file"};
  std::string tok_path, input, output;
  app.add_option("--tokenizer", tok_path, "tokenizer.json, or \"bytes\"")->required();
  app.add_option("--input", input, "a .txt (blank-line separated documents) or .jsonl file")
      ->required();
  app.add_option("--output", output, "the .tok file to write")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string("tokenize: ") + e.what());
  }
  auto tok = load_tokenizer(tok_path);
  TokenizedDocs docs = load_documents(input, *tok);
  write_token_file(output, docs);
  log_info("tokenize: " + std::to_string(docs.num_docs()) + " documents, " +
           std::to_string(docs.tokens.size()) + " tokens -> " + output);
  return 0;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Our parameters from a flat safetensors file of our names (what save_safetensors writes for
// the model's parameters): every parameter present with its shape and a floating dtype, and
// nothing else, all checked before any parameter changes.
void load_params_file(ParamStore& params, const std::string& path) {
  SafetensorsFile f = SafetensorsFile::open(path);
  for (auto& p : params.all()) {
    if (!f.contains(p.name))
      throw UserError(path + " has no tensor '" + p.name + "' (shape " +
                      shape_text(p.value.sizes().vec()) + ")");
    const SafetensorsEntry& e = f.entry(p.name);
    if (e.shape != p.value.sizes().vec())
      throw UserError(path + ": tensor '" + p.name + "' has shape " + shape_text(e.shape) +
                      "; expected " + shape_text(p.value.sizes().vec()));
    if (!at::isFloatingType(e.dtype))
      throw UserError(path + ": tensor '" + p.name + "' has dtype " +
                      safetensors_dtype_name(e.dtype) +
                      "; expected a floating dtype (F64, F32, F16, BF16)");
  }
  for (auto& e : f.entries()) {
    if (params.index_of(e.name) < 0)
      throw UserError(path + ": tensor '" + e.name +
                      "' is not a parameter of this model; wrong model or flavor?");
  }
  at::NoGradGuard ng;
  for (auto& p : params.all()) p.value.copy_(f.get(p.name));
}

// titan-train convert-hf: Hugging Face folder <-> flat safetensors of our parameter names.
int run_convert_hf(int argc, char** argv) {
  CLI::App app{
      "titan-train convert-hf: convert weights between a Hugging Face folder and a safetensors "
      "file of titan-train parameter names"};
  std::string model = "llama3", flavor, from_hf, to_st, from_st, to_hf, dtype = "float32";
  app.add_option("--model", model, "model family")->check(CLI::IsMember({"llama3"}));
  app.add_option("--flavor", flavor, "model flavor (shapes)")->required();
  auto* o_from_hf = app.add_option("--from-hf", from_hf, "Hugging Face folder to read");
  auto* o_to_st = app.add_option("--to-safetensors", to_st, "safetensors file to write");
  auto* o_from_st = app.add_option("--from-safetensors", from_st, "safetensors file to read");
  auto* o_to_hf = app.add_option("--to-hf", to_hf,
                                 "Hugging Face folder to write (must not exist "
                                 "or be empty)");
  auto* o_dtype = app.add_option("--dtype", dtype,
                                 "dtype of the tensors written to --to-hf: float32, bfloat16, "
                                 "float16 (--to-safetensors always writes float32)");
  o_from_hf->needs(o_to_st)->excludes(o_from_st)->excludes(o_to_hf);
  o_to_st->needs(o_from_hf);
  o_from_st->needs(o_to_hf);
  o_to_hf->needs(o_from_st);
  o_dtype->needs(o_to_hf);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string("convert-hf: ") + e.what());
  }
  if (from_hf.empty() && from_st.empty())
    throw UserError(
        "convert-hf: give --from-hf DIR --to-safetensors FILE, or "
        "--from-safetensors FILE --to-hf DIR");
  const at::ScalarType export_dtype = hf_export_dtype(dtype, "convert-hf --dtype");
  // Parameters are allocated, not initialized: every one is overwritten from the input.
  Llama3 m(llama3_flavor(flavor), at::kCPU);
  if (!from_hf.empty()) {
    import_llama3_hf(m, from_hf);
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (auto& p : m.params().all()) out.emplace_back(p.name, p.value.detach());
    save_safetensors(to_st, out);
    log_info("convert-hf: " + from_hf + " -> " + to_st);
  } else {
    load_params_file(m.params(), from_st);
    HfExportOptions opts;
    opts.dtype = export_dtype;
    export_llama3_hf(m, to_hf, opts);
    log_info("convert-hf: " + from_st + " -> " + to_hf + " (" + dtype + ")");
  }
  return 0;
}

}  // namespace

int run_subcommand(int argc, char** argv) {
  const std::string name = argv[0];
  if (name == "tokenize") return run_tokenize(argc, argv);
  if (name == "convert-hf") return run_convert_hf(argc, argv);
  throw UserError("unknown subcommand '" + name + "'; allowed: tokenize, convert-hf (see --help)");
}

int run_train_command(const JobConfig& cfg, const LaunchEnv& launch) {
  return run_training(cfg, launch);
}

}  // namespace titan
