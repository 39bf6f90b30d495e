#include "app/tokenize_command.h"

#include <unistd.h>

#include <CLI/CLI.hpp>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "core/log.h"
#include "core/text_reader.h"
#include "core/tokenize_pipeline.h"
#include "core/tokenizer.h"

namespace titan {
namespace {

constexpr const char* kFooter =
    "Output naming: with one shard, OUT itself (OUT.tok; with --format megatron OUT.bin and\n"
    "OUT.idx; a trailing .tok, .bin or .idx on OUT is dropped first). With several shards, OUT_000000.tok,\n"
    "OUT_000001.tok, ... (Megatron: OUT_000000.bin + OUT_000000.idx, ...). Each shard holds at\n"
    "most --shard-tokens tokens of whole documents. Files are written under temporary names and\n"
    "renamed only when every shard is complete; a failure leaves nothing behind.\n"
    "Documents are stored framed: BOS + text + EOS (--no-bos, --no-eos).\n"
    "A version-1 .tok as the only input is rewritten as version 2 (BOS/EOS from --tokenizer).";

std::atomic<bool> g_interrupted{false};
void on_interrupt(int) {
  g_interrupted = true;
}

// SIGINT/SIGTERM stop the run cleanly (temporaries removed) instead of killing it.
class InterruptGuard {
 public:
  InterruptGuard() {
    g_interrupted = false;
    old_int_ = std::signal(SIGINT, on_interrupt);
    old_term_ = std::signal(SIGTERM, on_interrupt);
  }
  ~InterruptGuard() {
    std::signal(SIGINT, old_int_);
    std::signal(SIGTERM, old_term_);
  }

 private:
  void (*old_int_)(int);
  void (*old_term_)(int);
};

bool accept_input(const std::string& p) {
  TextFormat f;
  return text_format_of(p, &f) || (p.size() > 4 && p.compare(p.size() - 4, 4, ".tok") == 0);
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), r;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0 && s[i - 1] != '-') r += ',';
    r += s[i];
  }
  return r;
}

}  // namespace

int run_tokenize_command(int argc, char** argv) {
  CLI::App app{
      "titan-train tokenize: tokenize text (files, folders or globs of .txt, .jsonl, .jsonl.gz, "
      ".jsonl.zst, .parquet) into .tok v2 or Megatron shards"};
  app.footer(kFooter);
  std::string tok_path, output, format = "tok", field = "text";
  std::vector<std::string> inputs, flag_inputs;
  int64_t shard_tokens = 1000000000;
  int threads = 0;
  size_t batch_bytes = 1 << 20;
  bool no_bos = false, no_eos = false;
  app.add_option("--tokenizer", tok_path, "tokenizer.json, or \"bytes\"")->required();
  app.add_option("--output,-o", output, "output path OUT (see naming below)")->required();
  app.add_option("--format", format, "tok (default) or megatron (.bin + .idx)")
      ->check(CLI::IsMember({"tok", "megatron"}));
  app.add_option("--shard-tokens", shard_tokens,
                 "tokens per output shard (default 1000000000; 0: one shard)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads, "encoding threads (default 0: one per CPU)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--field", field, "JSON key or Parquet column holding the text (default text)");
  app.add_flag("--no-bos", no_bos, "do not put BOS before each document");
  app.add_flag("--no-eos", no_eos, "do not put EOS after each document");
  app.add_option("--batch-bytes", batch_bytes, "text per work item (tests)")
      ->check(CLI::PositiveNumber)
      ->group("");
  app.add_option("--input", flag_inputs, "an input (same as a positional INPUT; repeatable)");
  app.add_option("inputs", inputs, "INPUT...: files, folders or globs");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string("tokenize: ") + e.what());
  }
  inputs.insert(inputs.begin(), flag_inputs.begin(), flag_inputs.end());
  if (inputs.empty())
    throw UserError("tokenize: no input; give INPUT... (files, folders or globs; allowed: " +
                    text_formats_allowed() + ")");
  const std::vector<std::string> files =
      expand_input_specs(inputs, accept_input, text_formats_allowed() + " (or a version-1 .tok)");
  auto tok = load_tokenizer(tok_path);

  TokenizeOptions o;
  o.format = format == "megatron" ? TokenFileFormat::kMegatron : TokenFileFormat::kTok;
  o.shard_tokens = shard_tokens;
  o.threads = threads;
  o.field = field;
  o.batch_bytes = batch_bytes;
  o.bos = !no_bos;
  o.eos = !no_eos;
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  if (tty)
    o.progress = [](const TokenizeProgress& p) {
      std::fprintf(stderr, "\rtokenize: %s\033[K", format_progress(p).c_str());
      std::fflush(stderr);
    };
  InterruptGuard guard;
  o.cancelled = [] { return g_interrupted.load(); };

  std::vector<std::string> tok_inputs;
  for (auto& f : files)
    if (!f.empty() && f.size() > 4 && f.compare(f.size() - 4, 4, ".tok") == 0) tok_inputs.push_back(f);
  TokenizeResult r;
  try {
    if (!tok_inputs.empty()) {
      if (files.size() != 1)
        throw UserError("tokenize: '" + tok_inputs[0] +
                        "' is a .tok file; convert one .tok at a time, without other inputs");
      if (tok_file_version(files[0]) == 0)
        throw UserError("token file '" + files[0] +
                        "': missing the TITANTOK header; allowed: a .tok file made by "
                        "`titan-train tokenize`");
      r = convert_tok_v1(files[0], *tok, output, o);
    } else {
      r = tokenize_files(files, *tok, output, o);
    }
  } catch (...) {
    if (tty) std::fprintf(stderr, "\r\033[K");
    throw;
  }
  if (tty) std::fprintf(stderr, "\r\033[K");
  char rate[96];
  std::snprintf(rate, sizeof rate, "%.1f MB/s, %.1f s, %d thread(s)",
                r.seconds > 0 ? r.input_bytes / 1e6 / r.seconds : 0.0, r.seconds,
                threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency()));
  log_info("tokenize: " + with_commas(r.docs) + " documents, " + with_commas(r.tokens) +
           " tokens, " + std::to_string(r.outputs.size()) + " shard(s) -> " +
           (r.outputs.size() == 1 ? r.outputs[0] : r.outputs[0] + " ... " + r.outputs.back()) +
           "; " + with_commas(static_cast<int64_t>(r.input_bytes)) + " input bytes, " + rate);
  return 0;
}

}  // namespace titan
