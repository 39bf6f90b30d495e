#!/usr/bin/env bash
# Launches titan-train on this machine with torchrun: NPROC processes (default 1), one
# data-parallel rank each, e.g. NPROC=2 scripts/run_train.sh --training.steps 50.
# Extra arguments go to every rank. Build first (scripts/build.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
torchrun="${TORCHRUN:-$cache/venv/bin/torchrun}"
binary="${TITAN_BINARY:-$root/build/titan-train}"
[ -x "$torchrun" ] || { echo "run_train.sh: $torchrun not found; run scripts/setup.sh" >&2; exit 2; }
[ -x "$binary" ] || { echo "run_train.sh: $binary not found; run scripts/build.sh" >&2; exit 2; }
cd "$root"
# --no-python: the binary is the worker. OMP_NUM_THREADS: torchrun sets it to 1 per worker
# when unset; keep the user's choice when given.
exec "$torchrun" --standalone --nproc_per_node "${NPROC:-1}" --no-python "$binary" \
  --config "${CONFIG:-configs/llama3_debug.toml}" "$@"
