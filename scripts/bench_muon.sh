#!/usr/bin/env bash
# Benchmark (not a test): Muon against AdamW on the Llama-3 debugmodel on the CPU (issue 44,
# docs/training.md "Muon").
# 1. Loss. STEPS (300) steps of seq_len 128 x local_batch_size 4 on one process, the same
#    tokens for every run (same seed, same data order); the config's schedule (warmup 20,
#    linear decay over the last 80% to 0.1) and validation (4 batches of 8 x 256 from the
#    held-out file). AdamW at each lr of ADAMW_LRS; then Muon at each muon_lr of MUON_LRS with
#    the parameters AdamW keeps (embedding, head, norms) at AdamW's best lr. Each
#    optimizer's best run (lowest validation loss at the last step) goes in the table.
# 2. Optimizer time. TSTEPS (30) steps at 1 and at 2 ranks (FSDP 2, half the batch each, so
#    the same tokens per step), each optimizer: the median of time_optimizer_ms (the
#    clip + optimizer phase) over the logged steps after the first 5. At 2 ranks Muon's
#    owner plan gives each rank about half the Newton-Schulz work.
# OMP_NUM_THREADS defaults to 1 (one core per rank). Prints two tables with ratios.
# Usage: scripts/bench_muon.sh. STEPS, TSTEPS, ADAMW_LRS ("1e-3 2e-3 4e-3"), MUON_LRS
# ("0.01 0.02 0.04"), SKIP_LOSS=1 (timing only), SKIP_TIME=1 (loss only) override; TITAN_SKIP_BUILD=1 skips the build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
steps=${STEPS:-300}
tsteps=${TSTEPS:-30}
adamw_lrs=${ADAMW_LRS:-"1e-3 2e-3 4e-3"}
muon_lrs=${MUON_LRS:-"0.01 0.02 0.04"}
out="$(mktemp -d "${TMPDIR:-/tmp}/bench-muon.XXXXXX")"
trap 'rm -rf "$out"' EXIT
common=(--config configs/llama3_debug.toml --training.seq_len 128 --training.device cpu
        --metrics.enable_tensorboard false --debug.seed 0)

# run NAME NPROC ARGS...: one training run into $out/NAME; its log beside it.
run() {
  local name=$1 nproc=$2
  shift 2
  local cmd=("$build/titan-train")
  [ "$nproc" = 1 ] || cmd=(env TITAN_BINARY="$build/titan-train" NPROC="$nproc"
                           "$root/scripts/run_train.sh")
  if ! (cd "$root" && env -u RANK -u WORLD_SIZE "${cmd[@]}" "${common[@]}" \
          --job.dump_folder "$out/$name" "$@" >"$out/$name.log" 2>&1); then
    echo "bench_muon.sh: run $name failed:" >&2
    tail -5 "$out/$name.log" >&2
    exit 1
  fi
}

# val NAME: the validation loss at the last step.
val() {
  "$TITAN_PYTHON" - "$out/$1/metrics.jsonl" "$steps" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
v = [r["validation_loss"] for r in rows if "validation_loss" in r and r["step"] == int(sys.argv[2])]
print(f"{v[-1]:.4f}")
EOF
}

# opt_ms NAME: the median optimizer-phase time of the logged steps after the first 5.
opt_ms() {
  "$TITAN_PYTHON" - "$out/$1/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
t = [r["time_optimizer_ms"] for r in rows if "time_optimizer_ms" in r and r["step"] > 5]
print(f"{statistics.median(t):.1f}")
EOF
}

if [ "${SKIP_LOSS:-0}" != 1 ]; then
  loss=(--training.steps "$steps" --training.local_batch_size 4 --metrics.log_freq 50
        --validation.freq "$steps")
  best_a="" best_a_lr=""
  echo "| optimizer | lr | val loss @$steps |"
  echo "|---|---|---|"
  for lr in $adamw_lrs; do
    run "adamw-$lr" 1 "${loss[@]}" --optimizer.lr "$lr"
    v=$(val "adamw-$lr")
    echo "| AdamW | $lr | $v |"
    if [ -z "$best_a" ] || awk "BEGIN{exit !($v < $best_a)}"; then best_a=$v best_a_lr=$lr; fi
  done
  best_m="" best_m_lr=""
  for lr in $muon_lrs; do
    run "muon-$lr" 1 "${loss[@]}" --optimizer.name Muon --optimizer.lr "$best_a_lr" \
      --optimizer.muon_lr "$lr"
    v=$(val "muon-$lr")
    echo "| Muon (AdamW part $best_a_lr) | muon_lr $lr | $v |"
    if [ -z "$best_m" ] || awk "BEGIN{exit !($v < $best_m)}"; then best_m=$v best_m_lr=$lr; fi
  done
  echo
  echo "best: AdamW lr $best_a_lr val loss $best_a; Muon muon_lr $best_m_lr val loss $best_m;" \
    "Muon - AdamW = $(awk "BEGIN{printf \"%.4f\", $best_m - $best_a}") nats"
  echo
fi

[ "${SKIP_TIME:-0}" = 1 ] && exit 0
timing=(--training.steps "$tsteps" --metrics.log_freq 1 --validation.enable false)
echo "| ranks | AdamW opt ms/step | Muon opt ms/step | Muon / AdamW |"
echo "|---|---|---|---|"
declare -A muon_ms
for n in 1 2; do
  b=$((4 / n))
  run "t-adamw-$n" "$n" "${timing[@]}" --training.local_batch_size "$b"
  run "t-muon-$n" "$n" "${timing[@]}" --training.local_batch_size "$b" \
    --optimizer.name Muon --optimizer.muon_lr 0.02
  a=$(opt_ms "t-adamw-$n")
  m=$(opt_ms "t-muon-$n")
  muon_ms[$n]=$m
  echo "| $n | $a | $m | $(awk "BEGIN{printf \"%.1f\", $m / $a}") |"
done
echo
echo "Muon's optimizer time at 2 ranks / 1 rank: $(awk "BEGIN{printf \"%.2f\", ${muon_ms[2]} / ${muon_ms[1]}}")"
grep -h "=> muon:" "$out/t-muon-2.log" | head -1 || true
