#!/usr/bin/env bash
# Benchmark (not a test): block-causal attention against causal on packed documents
# (docs/attention.md): the llama3 debugmodel (GQA) at seq 2048 (its flavor's RoPE table ends
# there), the qwen3 debugmodel (GQA, q/k norms) and the deepseek_v3 debugmodel (MLA) at 2048
# and 8192 (batch BATCH_2048 / BATCH_8192, default 2 / 1). The data is the bundled
# corpus cut into documents of DOC_LINES lines (default 15: ~300 tokens, a blank line ends
# each). Per model and length it prints the median tokens/s of the steps after the first (each
# mode run BENCH_ROUNDS times, default 1, the best kept), block_causal's ratio to causal, and
# the share of causal attention's (query, key) pairs the mask skips on those very windows
# (from `data-preview --tokens all`: sum over windows of sum over documents L(L+1)/2, against
# T(T+1)/2 per window; a token after an EOS starts a document).
# Usage: scripts/bench_attention.sh [STEPS]   (default 4; TITAN_SKIP_BUILD=1: no build first;
# BENCH_ROWS="config:seq ...": other rows)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
steps=${1:-4}
threads=${OMP_NUM_THREADS:-$(nproc)}
export OMP_NUM_THREADS=$threads
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The documents: every DOC_LINES non-empty corpus lines, then a blank line.
corpus="${TITAN_CACHE:-$HOME/.cache/titan-train}/data/kjv.txt"  # scripts/setup.sh fetches it
awk -v n="${DOC_LINES:-15}" 'NF { print; if (++k % n == 0) print "" }' "$corpus" >"$work/docs.txt"

flags() {  # config seq batch mask
  echo "--config $root/configs/$1 --training.steps $steps --training.seq_len $2" \
    "--training.local_batch_size $3 --model.attn_mask_type $4 --metrics.log_freq 1" \
    "--validation.enable false --metrics.enable_tensorboard false --moe.experts_backend loop" \
    "--training.dataset_path $work/docs.txt"
}

run() {  # config seq batch mask round -> median tokens/s after the first step
  local out="$work/$1-$2-$4-$5"
  # shellcheck disable=SC2046
  "$build/titan-train" $(flags "$1" "$2" "$3" "$4") --job.dump_folder "$out" >"$out.log" 2>&1 ||
    { cat "$out.log"; exit 1; }
  "$TITAN_PYTHON" -c '
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "\"tps\"" in l]
print(statistics.median(r["tps"] for r in (rows[1:] or rows)))' "$out/metrics.jsonl"
}

skipped() {  # config seq batch -> the share of causal pairs block_causal skips, and mean doc
  # shellcheck disable=SC2046
  (cd "$root" && "$build/titan-train" data-preview $(flags "$1" "$2" "$3" block_causal) \
    --steps "$steps" --tokens all 2>/dev/null) >"$work/windows.jsonl"
  local eos
  eos=$(grep -o 'documents end at EOS [0-9]*' "$work"/$1-$2-block_causal-1.log | head -1 | awk '{print $NF}')
  "$TITAN_PYTHON" - "$work/windows.jsonl" "$eos" <<'PY'
import json, sys
eos = int(sys.argv[2])
kept = full = docs = tokens = 0
for line in open(sys.argv[1]):
    if not line.strip():
        continue
    t = json.loads(line)["tokens"][:-1]  # the inputs
    n, run = len(t), 0
    full += n * (n + 1) // 2
    tokens += n
    for i, x in enumerate(t):
        run += 1
        if x == eos or i == n - 1:
            kept += run * (run + 1) // 2
            docs += 1
            run = 0
print(f"{1 - kept / full:.3f} {tokens / docs:.0f}")
PY
}

printf '%-22s %5s %5s %12s %12s %8s %15s %9s\n' model seq batch causal_tok/s block_tok/s ratio pairs_skipped mean_doc
rows=${BENCH_ROWS:-"llama3_debug.toml:2048 qwen3_debug.toml:2048 qwen3_debug.toml:8192
  deepseek_v3_debug.toml:2048 deepseek_v3_debug.toml:8192"}
for row in $rows; do
  config=${row%:*} seq=${row#*:}
  {
    batch=$([ "$seq" = 2048 ] && echo "${BATCH_2048:-2}" || echo "${BATCH_8192:-1}")
    best_c=0 best_b=0
    for round in $(seq "${BENCH_ROUNDS:-1}"); do
      c=$(run "$config" "$seq" "$batch" causal "$round")
      b=$(run "$config" "$seq" "$batch" block_causal "$round")
      best_c=$(python3 -c "print(max($best_c, $c))")
      best_b=$(python3 -c "print(max($best_b, $b))")
    done
    read -r skip mean <<<"$(skipped "$config" "$seq" "$batch")"
    printf '%-22s %5s %5s %12.0f %12.0f %7.2fx %15s %9s\n' "${config%.toml}" "$seq" "$batch" \
      "$best_c" "$best_b" "$(python3 -c "print($best_b / $best_c)")" "$skip" "$mean"
  }
done
echo "($threads threads, $steps steps; ratio = block_causal tokens/s / causal tokens/s)"
