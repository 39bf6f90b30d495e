#include "app/commands.h"

#include <CLI/CLI.hpp>

#include <string>

#include "core/data.h"
#include "core/errors.h"
#include "core/log.h"
#include "core/tokenizer.h"
#include "core/trainer.h"

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

}  // namespace

int run_subcommand(int argc, char** argv) {
  const std::string name = argv[0];
  if (name == "tokenize") return run_tokenize(argc, argv);
  throw UserError("unknown subcommand '" + name + "'; allowed: tokenize (see --help)");
}

int run_train_command(const JobConfig& cfg, const LaunchEnv& launch) {
  return run_training(cfg, launch);
}

}  // namespace titan
