#!/usr/bin/env bash
# Benchmark (not a test): our tokenizer's encode against Hugging Face tokenizers' encode_batch
# on the bundled corpus (documents split at blank lines), side by side in one run with the
# same number of threads. Prints MB/s of each and their ratio, for 1 thread and for
# THREADS (default: nproc). Usage: scripts/bench_tokenizer.sh [TOKENIZER.json]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
export TITAN_BENCH_TOKENIZER="${1:-}"
for threads in 1 "${THREADS:-$(nproc)}"; do
  TITAN_BENCH_THREADS=$threads "$root/build/test/titan_tests" "[bench_tokenizer]" |
    grep '^tokenizer bench:'
done
