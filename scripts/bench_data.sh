#!/usr/bin/env bash
# Data benchmarks, printed side by side in one run. Builds first unless TITAN_SKIP_BUILD=1.
#   loader: tokens/s of the training loader (B = 8, seq 256 and 2048) with its prefetch thread
#           and with direct reads on the caller's thread (DATA_BENCH_SECONDS per figure, 2 s),
#           and the data time left to a consumer that is away 2 ms per batch (a GPU step).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh"

# ---- loader (core/loader.h) --------------------------------------------------------------------
bench_loader() {
  # A hidden Catch2 case ([.bench_data]): ctest never runs it.
  OMP_NUM_THREADS=1 "$build/test/titan_tests" "[.bench_data]" | grep -E '^loader '
}

bench_loader
