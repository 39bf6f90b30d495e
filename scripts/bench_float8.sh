#!/usr/bin/env bash
# Benchmark (not a test): float8 training on the CPU against fp32 and bf16 compute, for the
# Llama-3 debugmodel (dense) and the DeepSeek-V3 debugmodel (MoE), side by side in one run.
# Modes (titan-train on the bundled corpus, same seed, batch and steps):
#   fp32         training.mixed_precision_param = float32 (a plain CPU run)
#   fp32+check   the same under compile.enable = true: on the CPU that is the capture check,
#                which is the only way a CPU run computes in bf16 (app/trainer.cpp), so this is
#                the baseline the bf16 row's cost of checking is read against
#   bf16         compile.enable = true, mixed_precision_param = bfloat16 (bf16 compute, fp32
#                masters, as the GPU step)
#   float8       model.converters = ["float8"], recipe tensorwise, fp32 high precision: the
#                linears' three GEMMs on ATen's CPU _scaled_mm (oneDNN); MoE experts stay in
#                high precision (they need quantize.grouped_mm.float8, rowwise: emulated here)
#   float8+bf16  float8 tensorwise with bf16 compute (compile.enable), torchtitan's GPU setting
# The modes alternate in rounds (ROUNDS, default 3) so machine noise hits them alike. Per
# model and mode it prints tokens/s (the median of every logged step after the first two of
# every round, pooled: on a shared machine one round's best can be a lucky idle minute), the
# spread of the rounds' medians, the allocator's peak (memory_peak_gib: CPU allocations by titan-train's allocator
# hooks, largest over the steps) and peak RSS (memory_rss_gib), each with its ratio to fp32,
# and the last loss. Float8 is not expected to win on a CPU: oneDNN's float8 GEMM plus the
# amax, scale and cast kernels cost more than an fp32 GEMM at these sizes; the figures say
# by how much.
# Usage: scripts/bench_float8.sh [MODELS...] (default: llama3 deepseek_v3). STEPS (default 8),
# BATCH (2), SEQ (256), ROUNDS (3) override. TITAN_SKIP_BUILD=1 skips the build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(llama3 deepseek_v3)
modes=(fp32 fp32+check bf16 float8 float8+bf16)
steps=${STEPS:-8}
batch=${BATCH:-2}
seq=${SEQ:-256}
rounds=${ROUNDS:-3}
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

flags() {
  local f8="--model.converters float8 --quantize.linear.float8.recipe_name tensorwise"
  case "$1" in
    fp32) echo "--training.mixed_precision_param float32" ;;
    fp32+check) echo "--training.mixed_precision_param float32 --compile.enable true" ;;
    bf16) echo "--training.mixed_precision_param bfloat16 --compile.enable true" ;;
    float8) echo "--training.mixed_precision_param float32 $f8" ;;
    float8+bf16) echo "--training.mixed_precision_param bfloat16 --compile.enable true $f8" ;;
  esac
}

run() {  # MODEL MODE ROUND
  local out="$tmp/$1/$2/$3"
  mkdir -p "$out"
  # shellcheck disable=SC2046
  (cd "$root" && "$build/titan-train" --config "configs/${1}_debug.toml" --training.steps "$steps" \
    --training.local_batch_size "$batch" --training.seq_len "$seq" --metrics.log_freq 1 \
    --validation.enable false --checkpoint.enable false --metrics.enable_tensorboard false \
    --job.dump_folder "$out" $(flags "$2") >"$out.log" 2>&1) ||
    { echo "$1 $2 failed:"; tail -5 "$out.log"; exit 1; }
  case "$2" in float8*) grep -m1 -o "float8: recipe [^;]*" "$out.log" >"$tmp/$1/float8.txt" ;; esac
}

echo "CPU, $OMP_NUM_THREADS threads, batch $batch x seq $seq, $steps steps, $rounds rounds, $(date -u +%FT%TZ)"
for m in "${models[@]}"; do
  for ((r = 1; r <= rounds; r++)); do
    for mode in "${modes[@]}"; do run "$m" "$mode" "$r"; done
  done
  echo "$m: $(cat "$tmp/$m/float8.txt")"
  "$TITAN_PYTHON" - "$tmp/$m" "$rounds" "${modes[@]}" <<'PY'
import glob, json, os, statistics, sys
base, rounds, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def figures(mode):
    tps, per_round, peak, rss, loss = [], [], [], [], None
    for f in sorted(glob.glob(os.path.join(base, mode, "*", "metrics.jsonl"))):
        rows = [json.loads(l) for l in open(f) if '"loss"' in l]
        v = [r["tps"] for r in (rows[2:] or rows)]
        tps += v
        per_round.append(statistics.median(v))
        peak.append(max(r.get("memory_peak_gib", 0) for r in rows))
        rss.append(max(r.get("memory_rss_gib", 0) for r in rows))
        loss = rows[-1]["loss"]
    spread = f"{min(per_round):.0f}-{max(per_round):.0f}"
    return statistics.median(tps), spread, min(peak) * 1024, min(rss) * 1024, loss
f = {m: figures(m) for m in modes}
t0, _, p0, r0, _ = f["fp32"]
print(f"  {'mode':<12} {'tokens/s':>9} {'rounds':>11} {'x fp32':>7} {'peak MiB':>9} {'x fp32':>7} "
      f"{'RSS MiB':>8} {'x fp32':>7} {'last loss':>9}")
for m in modes:
    t, sp, p, r, l = f[m]
    print(f"  {m:<12} {t:9.0f} {sp:>11} {t / t0:7.2f} {p:9.1f} {p / p0:7.2f} {r:8.0f} {r / r0:7.2f} "
          f"{l:9.4f}")
PY
done
