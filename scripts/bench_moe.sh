#!/usr/bin/env bash
# Benchmarks one MoE layer's forward + backward with each experts backend side by side (loop,
# grouped_mm, cutlass: whichever run on this machine) and prints throughput ratios against
# the loop (CUDA bf16 when a GPU is present, CPU fp32 otherwise). Sizes come from
# MOE_BENCH_DIM, MOE_BENCH_HIDDEN, MOE_BENCH_EXPERTS, MOE_BENCH_TOPK, MOE_BENCH_TOKENS and
# MOE_BENCH_ITERS; on CUDA they default to one DeepSeek-V3 16B MoE layer at 8k tokens.
# Then, without a GPU, the static expert-parallel exchange (at the default capacity factor and
# at the worst case) against the exact one at EP 2 (two gloo ranks, deepseek_v3 debugmodel,
# MOE_BENCH_EP_STEPS steps): median tokens/s after the first step, peak RSS of rank 0, the
# receive buffer, overflows and the peak pair load. Figures, not pass/fail. Builds first unless TITAN_SKIP_BUILD=1.
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
  declare -A tps rss
  # exact; static at the default capacity factor; static at the worst case (inf).
  for run in exact static worst; do
    case $run in
      exact) flags="--moe.ep_exchange exact" ;;
      static) flags="--moe.ep_exchange static" ;;
      worst) flags="--moe.ep_exchange static --moe.ep_capacity_factor inf" ;;
    esac
    # shellcheck disable=SC2086
    (cd "$root" && OMP_NUM_THREADS=1 "$torchrun" --standalone --nproc_per_node 2 --no-python \
      "$build/titan-train" --config configs/deepseek_v3_debug.toml --training.seq_len 256 \
      --training.local_batch_size 2 --training.steps "$steps" --metrics.log_freq 1 \
      --validation.enable false --metrics.enable_tensorboard false \
      --parallelism.expert_parallel_degree 2 $flags \
      --job.dump_folder "$tmp/$run" >"$tmp/$run.log" 2>&1) || { cat "$tmp/$run.log"; exit 1; }
    read -r tps[$run] rss[$run] < <(python3 - "$tmp/$run/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
v = [r["tps"] for r in rows if "tps" in r and r.get("step", 0) > 1]
over = sum(r.get("moe_ep_overflows", 0) for r in rows)
buf = max(r.get("moe_ep_buffer_bytes", 0) for r in rows)
peak = max(r.get("moe_ep_peak_pair_load", 0) for r in rows)
rss = max(r.get("memory_rss_gib", 0) for r in rows)
print(f"{statistics.median(v):.0f} {rss:.3f}")
print(f"overflows {over:.0f}, buffer {buf / 2**20:.2f} MiB per MoE layer and forward, "
      f"peak pair load {peak:.2f} x balanced", file=sys.stderr)
PY
)
    echo "EP 2 on CPU, $run: ${tps[$run]} tokens/s per rank (median of steps 2..$steps), peak RSS ${rss[$run]} GiB (rank 0)"
    grep -m1 "MoE expert-parallel exchange" "$tmp/$run.log" | sed 's/^.*=> /  /' || true
  done
  python3 -c "print(f'static (default factor) / exact at EP 2 on CPU: throughput {${tps[static]} / ${tps[exact]}:.2f}x, peak RSS {${rss[static]} / ${rss[exact]}:.3f}x; worst case / exact: throughput {${tps[worst]} / ${tps[exact]}:.2f}x, peak RSS {${rss[worst]} / ${rss[exact]}:.3f}x')"
fi
