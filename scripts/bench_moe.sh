#!/usr/bin/env bash
# Benchmarks one MoE layer's forward + backward with the loop and grouped_mm expert backends
# side by side and prints the throughput ratio (CUDA bf16 when a GPU is present, CPU fp32
# otherwise). Sizes come from MOE_BENCH_DIM, MOE_BENCH_HIDDEN, MOE_BENCH_EXPERTS,
# MOE_BENCH_TOPK, MOE_BENCH_TOKENS and MOE_BENCH_ITERS. Builds first unless TITAN_SKIP_BUILD=1.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh"
# The benchmark is a hidden Catch2 test ([.bench]): ctest never runs it.
exec "$build/test/titan_tests" "[.bench]"
