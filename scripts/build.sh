#!/usr/bin/env bash
# Configure (once) and build titan-train and the tests into build/ with Ninja and ccache.
# Runs scripts/setup.sh first unless TITAN_SKIP_SETUP=1.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
[ "${TITAN_SKIP_SETUP:-0}" = 1 ] || "$root/scripts/setup.sh"
source "$cache/env.sh"
build="${TITAN_BUILD_DIR:-$root/build}"
export CCACHE_DIR="${CCACHE_DIR:-$cache/ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# The PCH makes ccache's default sloppiness miss; these are the documented settings for it.
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
# Paths under the checkout are hashed relative to it, so clones and worktrees share hits.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$root}"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DTITAN_PYTHON="$TITAN_PYTHON" -DTorch_DIR="$TITAN_TORCH_DIR" \
    ${TITAN_CMAKE_ARGS:-} >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
  mv "$build.configure.log" "$build/configure.log"
fi
start=$(date +%s)
cmake --build "$build" -- ${TITAN_NINJA_ARGS:-}
echo "[build] done in $(( $(date +%s) - start ))s: $build/titan-train"
