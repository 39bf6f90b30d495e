#!/usr/bin/env bash
# The `slurm` ctest (docs/launching.md): submits scripts/slurm_example.sbatch, unchanged, to
# the private 2-node cluster of scripts/slurm_cluster.sh (started by the ctest fixture), as
# 2 nodes x 1 task on CPU, changing it only through its documented knobs: sbatch's own
# options on the command line, CONFIG and OMP_NUM_THREADS in the environment, titan-train
# flags after the script's name. It checks that
#   1. the job trains: both ranks log every step with identical loss and grad norm, and the
#      losses match one process with the same global batch (relative 1e-5, the DDP/FSDP
#      layouts' tolerance in test/parallel/test_dist.cpp);
#   2. pre-emption: `scancel --signal=TERM` makes both ranks save one checkpoint at the step
#      they agree on and exit 0; `scontrol requeue` runs the job again, it resumes from that
#      checkpoint, and its losses equal the uninterrupted job's bit for bit.
# Usage: scripts/slurm_check.sh CLUSTER_DIR BUILD_DIR
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$(cd "${1:?usage: slurm_check.sh CLUSTER_DIR BUILD_DIR}" && pwd)"
build="$(cd "${2:?usage: slurm_check.sh CLUSTER_DIR BUILD_DIR}" && pwd)"
if [ -f "$dir/skipped" ]; then echo "TITAN_TEST_SKIPPED: $(cat "$dir/skipped")"; exit 0; fi
[ -f "$dir/slurm.conf" ] || { echo "no cluster in $dir: run scripts/slurm_cluster.sh start $dir" >&2; exit 1; }
export SLURM_CONF="$dir/slurm.conf"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
[ -f "$cache/env.sh" ] && source "$cache/env.sh"
py="${TITAN_PYTHON:-python3}"
say() { echo "[slurm-check] $*"; }

# The script runs build/titan-train and configs/ from the submit folder.
run="$dir/check" && rm -rf "$run" && mkdir -p "$run/submit"
ln -s "$build" "$run/submit/build"
ln -s "$root/configs" "$run/submit/configs"
cd "$run/submit"
export CONFIG=configs/llama3_debug.toml OMP_NUM_THREADS=1
steps=16
flags=(--training.device cpu --training.steps $steps --training.seq_len 64 --training.local_batch_size 2
       --metrics.log_freq 1 --metrics.save_for_all_ranks true --metrics.enable_tensorboard false
       --validation.enable false --debug.seed 3 --checkpoint.enable true --checkpoint.interval 1000)
sb=(sbatch --parsable --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1
    --time=00:10:00 --open-mode=append)

job_field() { scontrol show job "$1" -o | tr ' ' '\n' | sed -n "s/^$2=//p"; }
wait_job() {  # until the job has ended (its run number $2, from 0), at most 300 s
  for _ in $(seq 1500); do
    local st; st="$(job_field "$1" JobState)"
    case "$st" in
      COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)
        [ "$(job_field "$1" Restarts)" -ge "$2" ] && { echo "$st"; return 0; } ;;
    esac
    sleep 0.2
  done
  echo "TIMEOUT_WAITING"; return 1
}
fail() { echo "[slurm-check] FAILED: $*" >&2; for f in "$run"/submit/*.out; do echo "== $f" >&2; tail -40 "$f" >&2; done; exit 1; }

# 1. An uninterrupted job, and the same global batch (2 x 2) in one process.
say "job A: 2 nodes x 1 task, $steps steps"
a="$("${sb[@]}" --output="$run/submit/A.out" "$root/scripts/slurm_example.sbatch" "${flags[@]}" --job.dump_folder "$run/A")"
st="$(wait_job "$a" 0)" || true
[ "$st" = COMPLETED ] || fail "job A ended $st (exit $(job_field "$a" ExitCode))"
say "job A: $st on $(job_field "$a" NodeList)"
"$build/titan-train" --config "$CONFIG" "${flags[@]}" \
  --training.local_batch_size 4 --metrics.save_for_all_ranks false --job.dump_folder "$run/single" \
  >"$run/single.out" 2>&1 || { tail -20 "$run/single.out"; fail "the one-process reference failed"; }

# 2. Pre-emption: SIGTERM to the job's tasks after a few steps, then a requeue.
say "job B: SIGTERM after 3 steps, then requeue"
b="$("${sb[@]}" --output="$run/submit/B.out" "$root/scripts/slurm_example.sbatch" "${flags[@]}" --job.dump_folder "$run/B")"
for _ in $(seq 1500); do
  [ -f "$run/B/metrics.jsonl" ] && [ "$(wc -l <"$run/B/metrics.jsonl")" -ge 3 ] && break
  [ "$(job_field "$b" JobState)" = PENDING ] || [ "$(job_field "$b" JobState)" = RUNNING ] || break
  sleep 0.1
done
scancel --signal=TERM "$b"
st="$(wait_job "$b" 0)" || true
[ "$st" = COMPLETED ] || fail "pre-empted job B ended $st (exit $(job_field "$b" ExitCode)), not 0 after saving"
grep -q "saving and exiting" B.out || fail "job B's log does not say it saved and exited"
saved="$(ls -d "$run/B/checkpoint"/step-* | sed 's/.*step-//')"
[ "$(echo "$saved" | wc -w)" -eq 1 ] || fail "job B left checkpoints '$saved', not one"
[ "$saved" -lt "$steps" ] || fail "job B ran to the end (step $saved) before the signal took effect"
say "job B: stopped after step $saved with one checkpoint; requeueing"
# A requeue right after the job ended can reach a node that still holds the old run's revoked
# credential ("Job credential revoked": the batch script never starts). Wait for both nodes
# to be idle, and requeue again (at most 3 times) when a run did not start.
for attempt in 1 2 3; do
  for _ in $(seq 100); do
    [ "$(sinfo -h -N -o '%T' | grep -c '^idle$')" -eq 2 ] && break
    sleep 0.1
  done
  lines=$(wc -l <B.out)
  scontrol requeue "$b"
  # A requeued job is held back until 2 minutes after it ended (slurmctld's fixed requeue
  # delay); it may start now.
  for _ in $(seq 100); do
    [ "$(job_field "$b" JobState)" = PENDING ] && scontrol update JobId="$b" StartTime=now 2>/dev/null && break
    sleep 0.1
  done
  st="$(wait_job "$b" "$attempt")" || true
  [ "$st" = COMPLETED ] || [ "$(wc -l <B.out)" -gt "$lines" ] && break
  say "the requeued run did not start ($st: $(grep -o 'Killing non-startable.*' "$dir/slurmctld.log" | tail -1)); requeueing again"
done
[ "$st" = COMPLETED ] || fail "requeued job B ended $st (exit $(job_field "$b" ExitCode))"
grep -q "resumed from .*step-$saved at step $saved" B.out || fail "the requeued job did not resume from step-$saved"

"$py" - "$run" "$steps" "$saved" <<'PY'
import json, sys
run, steps, saved = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def metrics(path):
    out = {}
    for line in open(path):
        j = json.loads(line)
        if "loss" in j:
            out[j["step"]] = j
    return out
a0, a1 = metrics(f"{run}/A/metrics.jsonl"), metrics(f"{run}/A/metrics_rank1.jsonl")
single = metrics(f"{run}/single/metrics.jsonl")
b0 = metrics(f"{run}/B/metrics.jsonl")
assert sorted(a0) == list(range(1, steps + 1)), f"job A logged steps {sorted(a0)}"
assert sorted(a1) == sorted(a0), "rank 1 of job A logged other steps than rank 0"
for s in a0:
    for k in ("loss", "grad_norm"):
        assert a0[s][k] == a1[s][k], f"step {s}: {k} rank 0 {a0[s][k]!r} != rank 1 {a1[s][k]!r}"
worst = max(abs(a0[s]["loss"] - single[s]["loss"]) / single[s]["loss"] for s in a0)
assert worst < 1e-5, f"2 ranks vs 1 process: relative loss difference {worst}"
resumed = [s for s in range(saved + 1, steps + 1)]
for s in resumed:
    assert s in b0, f"the requeued job did not log step {s}"
    assert b0[s]["loss"] == a0[s]["loss"], f"step {s}: resumed loss {b0[s]['loss']!r} != uninterrupted {a0[s]['loss']!r}"
print(f"[slurm-check] ranks agree on loss and grad norm at all {steps} steps; vs one process: "
      f"max relative loss difference {worst:.2e} (tolerance 1e-5); resumed steps {saved + 1}..{steps} "
      f"equal the uninterrupted job bit for bit (final loss {a0[steps]['loss']:.6f})")
PY
say "passed"
