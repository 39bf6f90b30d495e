#!/usr/bin/env bash
# Benchmark (not a test): context parallelism on 2 CPU ranks (gloo), side by side in one run,
# on the llama3 debugmodel at a long sequence (issue 31's benchmark).
#  1. Attention time per rank with CP 2 and the head-tail balancer against CP 2 with
#     contiguous chunks (context_parallel_load_balancer = "none"): the self time of the SDPA
#     ops, forward and backward, in one profiled step's trace of each rank (host time; the
#     CPU kernels are synchronous). The imbalance is max / min over the ranks; the balancer's
#     promise is 1.00. The scores each rank computes (cp_computed_pairs) are printed beside.
#  2. The bytes CP exchanges per step against `titan-train estimate`'s "context parallel per
#     step": measured as the all-gather + reduce-scatter traffic of the CP 2 run minus that
#     of an FSDP 2 run of the same model (both shard the parameters over the same 2 ranks, so
#     the difference is the K/V gathers and their gradients' reduce-scatters), times
#     (C-1)/C to turn whole buffers into bytes sent, as the estimate counts them. Everything
#     runs in fp32 (training.mixed_precision_param = float32): a CPU run without
#     compile.enable computes in fp32, and the estimate then sizes the exchange in fp32 too.
# Layouts run in rotation CP_BENCH_ROUNDS times (default 2); per rank the smallest attention
# time of the rounds is kept, so machine noise hits both alike.
# Usage: scripts/bench_cp.sh [SEQ] [BATCH]   (TITAN_SKIP_BUILD=1: no build first)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
seq=${1:-2048} batch=${2:-2}
steps=3
export OMP_NUM_THREADS=1  # 2 ranks on a 2-core machine
torchrun="$(dirname "$TITAN_PYTHON")/torchrun"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

common="--config $root/configs/llama3_debug.toml --training.steps $steps --training.seq_len $seq
  --training.local_batch_size $batch --training.device cpu --metrics.log_freq 1
  --training.mixed_precision_param float32
  --validation.enable false --metrics.enable_tensorboard false
  --profiling.enable_profiling true --profiling.profile_freq $steps
  --profiling.profiler_warmup 1 --profiling.profiler_active 1"
cp="--parallelism.context_parallel_degree 2"
declare -A layouts=(
  [headtail]="$cp --parallelism.context_parallel_load_balancer headtail"
  [none]="$cp --parallelism.context_parallel_load_balancer none"
  [fsdp2]="--parallelism.data_parallel_shard_degree 2"
)

run() {  # layout round -> the run's folder
  local out="$work/$1-$2"
  # shellcheck disable=SC2086
  "$torchrun" --standalone --nproc_per_node 2 --no-python "$build/titan-train" $common \
    --job.dump_folder "$out" ${layouts[$1]} >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
  echo "$out"
}

for round in $(seq "${CP_BENCH_ROUNDS:-2}"); do
  for l in headtail none fsdp2; do run "$l" "$round" >/dev/null; done
done
# shellcheck disable=SC2086
"$build/titan-train" estimate $common $cp --parallelism.context_parallel_load_balancer headtail \
  --world 2 >"$work/estimate.txt" 2>&1 || { cat "$work/estimate.txt"; exit 1; }

"$TITAN_PYTHON" - "$work" "$seq" "${CP_BENCH_ROUNDS:-2}" <<'PY'
import glob, json, re, sys
work, T, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def attention_ms(trace):
    """Self-contained SDPA time: the outermost scaled-dot-product events of each thread."""
    events = json.load(open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_thread = {}
    for e in events:
        if e.get("ph") == "X" and "scaled_dot_product" in e.get("name", ""):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    total = 0.0
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        end = -1.0
        for e in evs:
            if e["ts"] >= end:  # not inside the previous outermost one
                total += e["dur"]
                end = e["ts"] + e["dur"]
    return total / 1000.0

def collective_bytes(log):
    """all-gather + reduce-scatter bytes per step on this rank, from the run's log."""
    line = next(l for l in open(log) if "collectives per step on this rank" in l)
    out = 0.0
    for kind, calls, kib in re.findall(r"(all-gather|reduce-scatter) ([\d.]+) x ([\d.]+) KiB", line):
        out += float(calls) * float(kib) * 1024.0
    return out

def pairs(T, C, r, headtail):
    chunks = 2 * C if headtail else C
    c = T // chunks
    ks = [r, 2 * C - 1 - r] if headtail else [r]
    return sum(c * (k * c + c) for k in ks)

best = {}
for l in ("headtail", "none"):
    for rnd in range(1, rounds + 1):
        for rank in (0, 1):
            [trace] = glob.glob(f"{work}/{l}-{rnd}/profile_traces/iteration_*/rank{rank}_trace.json")
            ms = attention_ms(trace)
            best[(l, rank)] = min(best.get((l, rank), ms), ms)
print(f"CP 2, llama3 debugmodel, seq {T}, one profiled step, SDPA forward + backward self time per rank (ms):")
for l in ("headtail", "none"):
    a, b = best[(l, 0)], best[(l, 1)]
    p0, p1 = pairs(T, 2, 0, l == "headtail"), pairs(T, 2, 1, l == "headtail")
    print(f"  {l:9s} rank 0 {a:8.1f}  rank 1 {b:8.1f}  max/min {max(a, b) / min(a, b):.2f}"
          f"   scores computed {p0} / {p1} (ratio {max(p0, p1) / min(p0, p1):.2f})")
slow = lambda l: max(best[(l, 0)], best[(l, 1)])
print(f"  slowest rank, none / headtail: {slow('none') / slow('headtail'):.2f}x")

logs = lambda l: f"{work}/{l}-1.log"
# The log line is rank 0's; both ranks of a layout send the same.
cp_buffers = collective_bytes(logs("headtail")) - collective_bytes(logs("fsdp2"))
measured = cp_buffers * (2 - 1) / 2
est = float(re.search(r"context parallel per step: ([\d.e+]+) bytes sent",
                      open(f"{work}/estimate.txt").read()).group(1))
print(f"CP bytes sent per step per rank: measured {measured / 2**20:.2f} MiB, "
      f"estimate {est / 2**20:.2f} MiB, measured / estimate {measured / est:.3f}")
PY
