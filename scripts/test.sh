#!/usr/bin/env bash
# Set up if needed, build, and run every test through ctest. Exits non-zero on any failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
source "$cache/env.sh"
export TITAN_CACHE TITAN_PYTHON
cd "${TITAN_BUILD_DIR:-$root/build}"
ctest --output-on-failure --no-tests=error -j "${TITAN_TEST_JOBS:-2}" "$@"
