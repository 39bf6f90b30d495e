#!/usr/bin/env bash
# Launches titan-train on this machine with torchrun: NPROC processes (default 1), one
# data-parallel rank each, e.g. NPROC=2 scripts/run_train.sh --training.steps 50.
# Extra arguments go to every rank. Build first (scripts/build.sh).
#
# It runs in the caller's working directory, so relative paths in flags and the default
# ./outputs are the caller's. Its exit status is the workers' (README "Errors and exit
# status"): 2 stays 2, a clean pre-emption (SIGTERM, SIGINT, SIGUSR1) is 0; when ranks differ,
# the status of the rank that ended first with a non-zero one. torchrun's own Python traceback
# is not shown; each worker's one-line message is.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
torchrun="${TORCHRUN:-$cache/venv/bin/torchrun}"
binary="${TITAN_BINARY:-$root/build/titan-train}"
[ -x "$torchrun" ] || { echo "run_train.sh: $torchrun not found; run scripts/setup.sh" >&2; exit 2; }
[ -x "$binary" ] || { echo "run_train.sh: $binary not found; run scripts/build.sh" >&2; exit 2; }
# The Python of torchrun's environment runs torchrun's main, so its exceptions (a failed
# worker, a signal) end here without a traceback; the workers' statuses say what happened.
python="$(dirname "$torchrun")/python"
[ -x "$python" ] || python="$(head -1 "$torchrun" | sed 's/^#! *//')"
status_dir="$(mktemp -d "${TMPDIR:-/tmp}/titan-run.XXXXXX")"
trap 'rm -rf "$status_dir"' EXIT
# Each worker is a shell that runs the binary and writes its exit status to
# $status_dir/rank-$RANK. torchrun signals the worker's whole process group, so the binary
# gets SIGTERM/SIGINT itself; the shell's no-op traps keep it alive until the binary is done.
worker='trap : TERM INT USR1; "$0" "$@" & pid=$!
while :; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done
echo "$rc" > "$TITAN_STATUS_DIR/rank-$RANK"; exit "$rc"'
launcher='import sys
from torch.distributed.run import main
sys.argv[0] = "torchrun"
try:
    main()
except BaseException:
    sys.exit(1)'
# --no-python: the worker shell is the program. OMP_NUM_THREADS: torchrun sets it to 1 per
# worker when unset; keep the user's choice when given.
# SIGUSR1 (Slurm's --signal) is not among the signals torchrun passes on unless named.
TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" \
TITAN_STATUS_DIR="$status_dir" "$python" -c "$launcher" --standalone \
  --nproc_per_node "${NPROC:-1}" --no-python bash -c "$worker" "$binary" \
  --config "${CONFIG:-$root/configs/llama3_debug.toml}" "$@" &
launcher_pid=$!
# SIGTERM/SIGUSR1 sent to this script go on to torchrun, which passes them to every worker.
# Ctrl-C reaches torchrun from the terminal directly; this shell only keeps waiting.
trap 'kill -TERM "$launcher_pid" 2>/dev/null || true' TERM
trap 'kill -USR1 "$launcher_pid" 2>/dev/null || true' USR1
trap ':' INT
set +e
while :; do
  wait "$launcher_pid"
  torchrun_rc=$?
  kill -0 "$launcher_pid" 2>/dev/null || break
done
set -e
# The first rank to end with a non-zero status is the cause; the others followed it.
first_failed=""
for f in $(ls -tr "$status_dir"); do
  if [ "$(cat "$status_dir/$f")" != 0 ]; then first_failed="$f"; break; fi
done
if [ -n "$first_failed" ]; then exit "$(cat "$status_dir/$first_failed")"; fi
n="$(ls "$status_dir" | wc -l)"
if [ "$n" -eq "${NPROC:-1}" ]; then exit 0; fi
echo "run_train.sh: torchrun ended with status $torchrun_rc and $n of ${NPROC:-1} workers reported" >&2
exit $((torchrun_rc == 0 ? 1 : torchrun_rc))
