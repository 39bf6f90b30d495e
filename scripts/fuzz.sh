#!/usr/bin/env bash
# The libFuzzer targets of test/fuzz (one per reader of user files; docs/fuzzing.md).
#   scripts/fuzz.sh build            configure and build every target with clang++ (libFuzzer,
#                                    ASan, UBSan) into <build>/fuzz, and write their seeds
#   scripts/fuzz.sh run NAME [SECS]  fuzz test/fuzz/fuzz_NAME.cpp for SECS seconds (default
#                                    $FUZZ_SECONDS, else 15) from its seeds
#   scripts/fuzz.sh list             the target names
# A crash, sanitizer report, uncaught exception other than titan::UserError, hang (an input
# over 10 s) or leak fails `run` (exit 1) and leaves the input as
# <build>/fuzz/artifacts/NAME/{crash,leak,timeout,oom}-*; replay it with
#   <build>/fuzz/fuzz_NAME <that file>      (TITAN_FUZZ_PRINT=1 prints each input's outcome)
# Without clang++ or libFuzzer's runtime both commands print TITAN_TEST_SKIPPED and exit 0.
# Environment: TITAN_BUILD_DIR (default <repo>/build), CXX_FUZZ (default clang++),
# FUZZ_JOBS (parallel fuzzing processes, default 1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
[ -f "$cache/env.sh" ] && source "$cache/env.sh"
out="${TITAN_BUILD_DIR:-$root/build}/fuzz"
cxx="${CXX_FUZZ:-clang++}"
cmd="${1:-}"

skip_reason() {
  command -v "$cxx" >/dev/null || { echo "$cxx not found (apt-get install clang libclang-rt-14-dev)"; return; }
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    "$cxx" -x c++ -fsanitize=fuzzer,address,undefined - -o /dev/null 2>/dev/null ||
    echo "$cxx cannot link -fsanitize=fuzzer,address,undefined (apt-get install libclang-rt-14-dev)"
}

case "$cmd" in
  list)
    for f in "$root"/test/fuzz/fuzz_*.cpp; do f="${f##*/fuzz_}"; echo "${f%.cpp}"; done ;;
  build)
    why="$(skip_reason)"
    if [ -n "$why" ]; then echo "TITAN_TEST_SKIPPED: $why"; exit 0; fi
    py="${TITAN_PYTHON:?TITAN_PYTHON is not set: run scripts/setup.sh}"
    mkdir -p "$out"
    if [ ! -f "$out/build.ninja" ]; then
      cmake -S "$root/test/fuzz" -B "$out" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
        -DCMAKE_BUILD_TYPE=None -DTITAN_PYTHON="$py" >"$out/configure.log" ||
        { cat "$out/configure.log"; exit 1; }
    fi
    grep -h 'Parquet input' "$out/configure.log" || true
    cmake --build "$out" -- ${TITAN_NINJA_ARGS:-}
    rm -rf "$out/seeds" && mkdir -p "$out/seeds/checkpoint_meta"
    "$py" "$root/test/fuzz/seeds.py" "$out/seeds"
    TITAN_FUZZ_WRITE_SEEDS="$out/seeds/checkpoint_meta" "$out/fuzz_checkpoint_meta" -runs=0 \
      -artifact_prefix="$out/" >"$out/seed_checkpoint.log" 2>&1 || { cat "$out/seed_checkpoint.log"; exit 1; }
    for d in "$out"/seeds/*; do echo "[fuzz] seeds: ${d##*/}: $(ls "$d" | wc -l) files"; done ;;
  run)
    name="${2:?usage: scripts/fuzz.sh run NAME [SECONDS]}"
    secs="${3:-${FUZZ_SECONDS:-15}}"
    why="$(skip_reason)"
    if [ -n "$why" ]; then echo "TITAN_TEST_SKIPPED: $why"; exit 0; fi
    bin="$out/fuzz_$name"
    [ -x "$bin" ] || { echo "[fuzz] $bin is missing: run scripts/fuzz.sh build" >&2; exit 1; }
    if [ "$name" = parquet ] && ! grep -q ON "$out/parquet.txt"; then
      echo "TITAN_TEST_SKIPPED: this build has no Parquet support (see $out/configure.log)"; exit 0
    fi
    mkdir -p "$out/corpus/$name" "$out/artifacts/$name"
    extra=()
    [ -f "$root/test/fuzz/$name.dict" ] && extra+=(-dict="$root/test/fuzz/$name.dict")
    [ "${FUZZ_JOBS:-1}" -gt 1 ] && extra+=(-jobs="$FUZZ_JOBS" -workers="$FUZZ_JOBS")
    echo "[fuzz] $name for ${secs}s"
    cd "$out/artifacts/$name"
    # One process by default: its exit status is the fuzzer's (non-zero on a finding).
    ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" \
    UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
      "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
      -artifact_prefix="$out/artifacts/$name/" -print_final_stats=1 "${extra[@]}" \
      "$out/corpus/$name" "$out/seeds/$name" ;;
  *)
    echo "usage: scripts/fuzz.sh build | run NAME [SECONDS] | list" >&2; exit 2 ;;
esac
