#include "app/tokenize_command.h"

#include <unistd.h>

#include <CLI/CLI.hpp>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "app/commands.h"
#include "core/base/errors.h"
#include "core/base/log.h"
#include "core/data/text_reader.h"
#include "core/data/tokenize_pipeline.h"
#include "core/tokenizer/tokenizer.h"

namespace titan {
namespace {

constexpr const char* kFooter =
    "Output naming: with one shard, OUT itself (OUT.tok; with --format megatron OUT.bin and\n"
    "OUT.idx; a trailing .tok, .bin or .idx on OUT is dropped first). With several shards, "
    "OUT_000000.tok,\n"
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

bool accept_text(const std::string& p) {
  TextFormat f;
  return text_format_of(p, &f);
}

bool is_tok(const std::string& p) {
  return p.size() > 4 && p.compare(p.size() - 4, 4, ".tok") == 0;
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), r;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0 && s[i - 1] != '-') r += ',';
    r += s[i];
  }
  return r;
}

struct TokenizeArgs {
  std::string tok_path, output, format = "tok", field = "text";
  std::vector<std::string> inputs;
  int64_t shard_tokens = 1000000000;
  int threads = 0;
  size_t batch_bytes = 1 << 20;
  bool no_bos = false, no_eos = false;
};

// False after printing --help.
bool parse_args(int argc, char** argv, TokenizeArgs& a) {
  CLI::App app{
      "titan-train tokenize: tokenize text (files, folders or globs of .txt, .jsonl, .jsonl.gz, "
      ".jsonl.zst, .parquet) into .tok v2 or Megatron shards"};
  app.footer(kFooter);
  std::vector<std::string> flag_inputs;
  app.add_option("--tokenizer", a.tok_path, "tokenizer.json, or \"bytes\"")->required();
  app.add_option("--output,-o", a.output, "output path OUT (see naming below)")->required();
  app.add_option("--format", a.format, "tok (default) or megatron (.bin + .idx)")
      ->check(CLI::IsMember({"tok", "megatron"}));
  app.add_option("--shard-tokens", a.shard_tokens,
                 "tokens per output shard (default 1000000000; 0: one shard)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", a.threads, "encoding threads (default 0: one per CPU)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--field", a.field, "JSON key or Parquet column holding the text (default text)");
  app.add_flag("--no-bos", a.no_bos, "do not put BOS before each document");
  app.add_flag("--no-eos", a.no_eos, "do not put EOS after each document");
  app.add_option("--batch-bytes", a.batch_bytes, "text per work item (tests)")
      ->check(CLI::PositiveNumber)
      ->group("");
  app.add_option("--input", flag_inputs, "an input (same as a positional INPUT; repeatable)");
  app.add_option("inputs", a.inputs, "INPUT...: files, folders or globs");
  if (!parse_subcommand(app, argc, argv, "tokenize")) return false;
  a.inputs.insert(a.inputs.begin(), flag_inputs.begin(), flag_inputs.end());
  if (a.inputs.empty())
    throw UserError("tokenize: no input; give INPUT... (files, folders or globs; allowed: " +
                    text_formats_allowed() + ")");
  return true;
}

// A .tok named on its own is converted; anything else is text, expanded and tokenized.
TokenizeResult run(const TokenizeArgs& a, const Tokenizer& tok, const TokenizeOptions& o) {
  if (a.inputs.size() == 1 && is_tok(a.inputs[0])) {
    const std::string& in = a.inputs[0];
    std::error_code ec;
    if (!std::filesystem::is_regular_file(in, ec))
      throw UserError("token file '" + in + "': does not exist; allowed: a version-1 .tok file");
    if (tok_file_version(in) == 0)
      throw UserError("token file '" + in +
                      "': missing the TITANTOK header; allowed: a .tok file made by "
                      "`titan-train tokenize`");
    return convert_tok_v1(in, tok, a.output, o);
  }
  const std::vector<std::string> files = expand_input_specs(
      a.inputs, accept_text, text_formats_allowed() + " (a version-1 .tok only on its own)");
  return tokenize_files(files, tok, a.output, o);
}

}  // namespace

int run_tokenize_command(int argc, char** argv) {
  TokenizeArgs a;
  if (!parse_args(argc, argv, a)) return 0;
  auto tok = load_tokenizer(a.tok_path);
  TokenizeOptions o;
  o.format = a.format == "megatron" ? TokenFileFormat::kMegatron : TokenFileFormat::kTok;
  o.shard_tokens = a.shard_tokens;
  o.threads = a.threads;
  o.field = a.field;
  o.batch_bytes = a.batch_bytes;
  o.bos = !a.no_bos;
  o.eos = !a.no_eos;
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  if (tty)
    o.progress = [](const TokenizeProgress& p) {
      std::fprintf(stderr, "\rtokenize: %s\033[K", format_progress(p).c_str());
      std::fflush(stderr);
    };
  InterruptGuard guard;
  o.cancelled = [] { return g_interrupted.load(); };
  TokenizeResult r;
  try {
    r = run(a, *tok, o);
  } catch (...) {
    if (tty) std::fprintf(stderr, "\r\033[K");
    throw;
  }
  if (tty) std::fprintf(stderr, "\r\033[K");
  char rate[96];
  std::snprintf(rate, sizeof rate, "%.1f MB/s, %.1f s",
                r.seconds > 0 ? r.input_bytes / 1e6 / r.seconds : 0.0, r.seconds);
  log_info("tokenize: " + with_commas(r.docs) + " documents, " + with_commas(r.tokens) +
           " tokens, " + std::to_string(r.outputs.size()) + " shard(s) -> " +
           (r.outputs.size() == 1 ? r.outputs[0] : r.outputs[0] + " ... " + r.outputs.back()) +
           "; " + with_commas(static_cast<int64_t>(r.input_bytes)) + " input bytes, " + rate +
           (r.threads > 0 ? ", " + std::to_string(r.threads) + " thread(s)" : ""));
  return 0;
}

}  // namespace titan
