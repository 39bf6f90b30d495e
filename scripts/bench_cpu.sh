#!/usr/bin/env bash
# Benchmark (not a test): titan-train's training step against eager PyTorch
# (test/reference/train_ref.py), side by side in one run and alternated (titan, eager, titan,
# eager) so that machine noise hits both alike: same torch wheel, same threads, same model,
# batch and random tokens. Three configurations:
#   debug  the Llama-3 debugmodel, batch 8 x seq 256, vocab 2048
#   long   Llama-3 dim 384, 2 layers, 6 heads, 2 kv heads (GQA), vocab 32768, batch 1 x seq 1024
#   moe    the Llama-4 debugmodel (8 experts, top-1, 1 shared; MoE every 2nd layer), 8 x 256
# The titan side is the product's Model + train_step + fused AdamW driven by a hidden Catch2
# case (test/app/test_train_bench.cpp), because the long shape is no torchtitan flavor.
# Prints per configuration: tokens/s (median over the steps after the first two, best of the
# two runs) and peak RSS (KiB, ru_maxrss; the smaller of the two runs), with ratios titan / eager.
# Usage: scripts/bench_cpu.sh [CONFIGS...] (default: debug long moe). STEPS overrides steps.
# TITAN_SKIP_BUILD=1 skips the build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(debug long moe)

# name -> dim layers heads kv_heads vocab batch seq experts steps
spec() {
  case "$1" in
    debug) echo "256 6 16 16 2048 8 256 0 ${STEPS:-6}" ;;
    long) echo "384 2 6 2 32768 1 1024 0 ${STEPS:-5}" ;;
    moe) echo "256 6 16 16 2048 8 256 8 ${STEPS:-6}" ;;
    *) echo "unknown config $1; allowed: debug long moe" >&2; exit 2 ;;
  esac
}

run_titan() {
  read -r dim layers heads kv vocab batch seq experts steps <<<"$(spec "$1")"
  BENCH_DIM=$dim BENCH_LAYERS=$layers BENCH_HEADS=$heads BENCH_KV_HEADS=$kv BENCH_VOCAB=$vocab \
    BENCH_BATCH=$batch BENCH_SEQ=$seq BENCH_EXPERTS=$experts BENCH_STEPS=$steps \
    "$build/test/titan_tests" "[.trainbench]" 2>/dev/null | grep '^{"tps"'
}
run_ref() {
  read -r dim layers heads kv vocab batch seq experts steps <<<"$(spec "$1")"
  (cd "$root/test/reference" && "$TITAN_PYTHON" train_ref.py --steps "$steps" --batch "$batch" \
    --seq_len "$seq" --dim "$dim" --n_layers "$layers" --n_heads "$heads" --n_kv_heads "$kv" \
    --vocab "$vocab" --experts "$experts")
}

echo "CPU, $OMP_NUM_THREADS threads, $(date -u +%FT%TZ)"
for c in "${configs[@]}"; do
  t1=$(run_titan "$c"); r1=$(run_ref "$c"); t2=$(run_titan "$c"); r2=$(run_ref "$c")
  "$TITAN_PYTHON" - "$c" "$(spec "$c")" "$t1" "$t2" "$r1" "$r2" <<'PY'
import json, statistics, sys
name, spec = sys.argv[1], sys.argv[2].split()
t = [json.loads(x) for x in sys.argv[3:5]]
r = [json.loads(x) for x in sys.argv[5:7]]
tps = lambda runs: max(statistics.median(x["tps"][2:]) for x in runs)
rss = lambda runs: min(x["rss_peak_kib"] for x in runs)
base = lambda runs: min(x["rss_before_kib"] for x in runs)
tt, rt = tps(t), tps(r)
print(f"{name}: dim {spec[0]}, {spec[1]} layers, {spec[2]}/{spec[3]} heads, vocab {spec[4]}, "
      f"batch {spec[5]} x seq {spec[6]}, experts {spec[7]}, {spec[8]} steps")
print(f"  tokens/s        titan {tt:10.0f}   eager {rt:10.0f}   ratio {tt / rt:.2f}x")
print(f"  peak RSS MiB    titan {rss(t) / 1024:10.0f}   eager {rss(r) / 1024:10.0f}   ratio "
      f"{rss(t) / rss(r):.2f}x")
print(f"  RSS before step titan {base(t) / 1024:10.0f}   eager {base(r) / 1024:10.0f}   "
      f"(step growth ratio {(rss(t) - base(t)) / max(1, rss(r) - base(r)):.2f}x)")
PY
done
