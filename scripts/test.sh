#!/usr/bin/env bash
# Set up if needed, build, and run every test through ctest. Exits non-zero on any failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
source "$cache/env.sh"
export TITAN_CACHE TITAN_PYTHON
# ctest runs two tests at once on these 2-core machines; one intra-op thread each avoids
# OpenMP oversubscription, which otherwise slows the training tests several-fold.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "${TITAN_BUILD_DIR:-$root/build}"
# The `docker` label (scripts/docker_check.sh: images built from scratch, ~GBs of wheels)
# does not fit CI's time; run it with `ctest -L docker` or TITAN_TEST_DOCKER=1.
exclude=()
[ -n "${TITAN_TEST_DOCKER:-}" ] || exclude=(-LE docker)
ctest --output-on-failure --no-tests=error -j "${TITAN_TEST_JOBS:-2}" "${exclude[@]}" "$@"
