#!/usr/bin/env bash
# Benchmark (not a test): the fused CPU ops (core/kernels/ops.h, core/kernels/fused_loss.h) against the unfused
# ATen code that models/layers.cpp and core/trainer.cpp run today, side by side in one run, at
# the Llama-3 debugmodel shapes and a longer one (T=2048, D=1024, vocab 32768), fp32 and bf16.
# Prints each op's median forward + backward time, the ratio unfused / fused, and the loss's
# peak CPU memory. OPS_BENCH_ITERS sets the iterations (default 10); OMP_NUM_THREADS the
# threads (default: all cores). Builds first unless TITAN_SKIP_BUILD=1.
# An optional argument picks another hidden bench case: "[.projbench]" times separate against
# fused QKV and w1/w3 GEMMs (test/models/test_fused_proj_bench.cpp, docs/performance.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" TITAN_NINJA_ARGS="${TITAN_NINJA_ARGS:-titan_tests}" \
  "$root/scripts/build.sh" >/dev/null
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
# The benchmark is a hidden Catch2 test ([.opsbench]): ctest never runs it.
exec "$build/test/titan_tests" "${1:-[.opsbench]}"
