// `titan-train tokenize`: raw text (many files, folders or globs; .txt, .jsonl, .jsonl.gz,
// .jsonl.zst, .parquet) -> .tok v2 or Megatron shards; also converts a version-1 .tok.
#pragma once

namespace titan {

// argv[0] is "tokenize". Returns the exit status; UserError for bad flags or input.
int run_tokenize_command(int argc, char** argv);

}  // namespace titan
