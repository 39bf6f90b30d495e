#!/usr/bin/env bash
# Benchmarks one MoE layer's forward + backward with each experts backend side by side (loop,
# grouped_mm, cutlass: whichever run on this machine) and prints throughput ratios against
# the loop (CUDA bf16 when a GPU is present, CPU fp32 otherwise). Sizes come from
# MOE_BENCH_DIM, MOE_BENCH_HIDDEN, MOE_BENCH_EXPERTS, MOE_BENCH_TOPK, MOE_BENCH_TOKENS and
# MOE_BENCH_ITERS; on CUDA they default to one DeepSeek-V3 16B MoE layer at 8k tokens.
# Then, without a GPU, the static expert-parallel exchange against the exact one at EP 2 (two
# gloo ranks, deepseek_v3 debugmodel, MOE_BENCH_EP_STEPS steps, median tokens/s after the
# first step). Figures, not pass/fail. Builds first unless TITAN_SKIP_BUILD=1.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh"
# The layer benchmark is a hidden Catch2 test ([.bench]): ctest never runs it.
"$build/test/titan_tests" "[.bench]"

torchrun="$cache/venv/bin/torchrun"
if [ -x "$torchrun" ] && ! nvidia-smi >/dev/null 2>&1; then
  steps="${MOE_BENCH_EP_STEPS:-12}"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  declare -A tps
  for x in exact static; do
    (cd "$root" && OMP_NUM_THREADS=1 "$torchrun" --standalone --nproc_per_node 2 --no-python \
      "$build/titan-train" --config configs/deepseek_v3_debug.toml --training.seq_len 256 \
      --training.local_batch_size 2 --training.steps "$steps" --metrics.log_freq 1 \
      --validation.enable false --metrics.enable_tensorboard false \
      --parallelism.expert_parallel_degree 2 --moe.ep_exchange "$x" \
      --job.dump_folder "$tmp/$x" >"$tmp/$x.log" 2>&1) || { cat "$tmp/$x.log"; exit 1; }
    tps[$x]=$(python3 - "$tmp/$x/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
v = [r["tps"] for r in rows if "tps" in r and r.get("step", 0) > 1]
print(f"{statistics.median(v):.0f}")
PY
)
    echo "EP 2 on CPU, $x exchange: ${tps[$x]} tokens/s per rank (median of steps 2..$steps)"
  done
  python3 -c "print(f'static / exact throughput ratio at EP 2 on CPU: {${tps[static]} / ${tps[exact]}:.2f}')"
fi
