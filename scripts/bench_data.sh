#!/usr/bin/env bash
# Data benchmarks, printed side by side in one run. Builds first unless TITAN_SKIP_BUILD=1.
#   loader: tokens/s of the training loader (B = 8, seq 256 and 2048) with its prefetch thread
#           and with direct reads on the caller's thread (DATA_BENCH_SECONDS per figure, 2 s),
#           and the data time left to a consumer that is away 2 ms per batch (a GPU step).
#           Then the loader's tokens/s against the debugmodel training step's, same B and seq.
#   tokenize: titan-train tokenize MB/s at 1 and 2 threads on the same file, and against
#             Hugging Face `tokenizers` encode_batch of the same documents with the same
#             threads (TOKENIZE_MB of JSONL, default 20).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh"

# ---- loader (core/data/loader.h) --------------------------------------------------------------------
bench_loader() {
  # A hidden Catch2 case ([.bench_data]): ctest never runs it.
  OMP_NUM_THREADS=1 "$build/test/titan_tests" "[.bench_data]" | grep -E '^loader '
}

# The loader against what the training step consumes, in the same run: the debugmodel's
# training tokens/s at the same batch and seq (median of steps 3..STEPS).
bench_loader_vs_step() {
  source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
  local work; work=$(mktemp -d)
  trap "rm -rf '$work'" RETURN
  local loader; loader=$(bench_loader | tee /dev/stderr | awk '/seq 256:/ {print $6}')
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} "$build/titan-train" \
    --config "$root/configs/llama3_debug.toml" --training.steps "${STEP_BENCH_STEPS:-8}" \
    --training.local_batch_size 8 --training.seq_len 256 --metrics.log_freq 1 \
    --validation.enable false --metrics.enable_tensorboard false \
    --job.dump_folder "$work/run" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  local step; step=$("$TITAN_PYTHON" - "$work/run/metrics.jsonl" <<'PY'
import json, statistics, sys
tps = [json.loads(l)["tps"] for l in open(sys.argv[1]) if '"tps"' in l]
print(statistics.median(tps[2:] or tps))
PY
)
  awk -v l="$loader" -v s="$step" 'BEGIN {
    printf "loader vs step (debugmodel, B=8, seq 256): loader %.0f tokens/s, training step consumes %.0f tokens/s, ratio %.0fx (goal >= 50x)\n", l, s, l / s }'
}

bench_loader_vs_step 2>&1
# ---- tokenize ------------------------------------------------------------------------------
# Our time is the command's own pipeline time from its summary line: reading, JSON parsing,
# encoding and writing the shards, not process start-up or loading the tokenizer. HF's is
# encode_batch alone, on texts already parsed into memory, so the ratio is conservative.
bench_tokenize() {
  source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
  local work; work=$(mktemp -d)
  trap "rm -rf '$work'" RETURN
  local mb=${TOKENIZE_MB:-20} jsonl="$work/tokenize.jsonl"
  # The bundled corpus as JSONL (one chapter per line), repeated with every copy numbered.
  "$TITAN_PYTHON" - "$TITAN_CORPUS" "$jsonl" "$mb" <<'PY'
import json, sys
chapters = [c for c in open(sys.argv[1], encoding="utf-8").read().split("\n\n") if c.strip()]
limit, size, copy = int(sys.argv[3]) * 10**6, 0, 0
with open(sys.argv[2], "w", encoding="utf-8") as f:
    while size < limit:
        for c in chapters:
            line = json.dumps({"text": f"Copy {copy}. {c}"}) + "\n"
            f.write(line)
            size += len(line.encode())
        copy += 1
PY
  local bytes; bytes=$(stat -c %s "$jsonl")
  echo "tokenize: $(( bytes / 1000000 )) MB of JSONL, tokenizer $TITAN_TOKENIZER;" \
    "$(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
  declare -A ours hf
  for threads in 1 2; do
    local line
    line=$("$build/titan-train" tokenize --tokenizer "$TITAN_TOKENIZER" --threads "$threads" \
      --output "$work/t$threads" "$jsonl" | grep 'tokenize:')
    ours[$threads]=$(sed -E 's/.* ([0-9.]+) MB\/s, ([0-9.]+) s,.*/\2/' <<<"$line")
    hf[$threads]=$(RAYON_NUM_THREADS=$threads "$TITAN_PYTHON" \
      "$root/test/reference/tokenize_big_ref.py" hf-bench "$TITAN_TOKENIZER" "$jsonl" |
      awk '/hf_seconds/ {print $2}')
    cmp -s "$work/t1.tok" "$work/t$threads.tok" || { echo "outputs differ"; exit 1; }
    awk -v b="$bytes" -v o="${ours[$threads]}" -v h="${hf[$threads]}" -v t="$threads" 'BEGIN {
      printf "  threads %d: titan-train %.2f MB/s (%.2f s), HF tokenizers %.2f MB/s (%.2f s), ratio %.2fx\n",
        t, b / 1e6 / o, o, b / 1e6 / h, h, h / o }'
  done
  awk -v a="${ours[1]}" -v b="${ours[2]}" -v c="${hf[1]}" -v d="${hf[2]}" 'BEGIN {
    printf "  scaling 1 -> 2 threads: titan-train %.2fx, HF tokenizers %.2fx\n", a / b, c / d }'
}

bench_tokenize
