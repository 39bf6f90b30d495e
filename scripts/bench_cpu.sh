#!/usr/bin/env bash
# Benchmark (not a test): titan-train against eager PyTorch (test/reference/train_ref.py) on
# the Llama-3 debugmodel, side by side in one run: same torch wheel, same threads, same batch.
# Prints training tokens/s of each (median over steps after the first two), their ratio, and
# the time from exec to the first finished step. Usage: scripts/bench_cpu.sh [STEPS] [BATCH] [SEQ]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
steps=${1:-20} batch=${2:-8} seq=${3:-256}
threads=${OMP_NUM_THREADS:-$(nproc)}
export OMP_NUM_THREADS=$threads
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
now_ms() { date +%s%3N; }

run_titan() {
  local t0; t0=$(now_ms)
  "$root/build/titan-train" --config "$root/configs/llama3_debug.toml" --training.steps "$steps" \
    --training.local_batch_size "$batch" --training.seq_len "$seq" --metrics.log_freq 1 \
    --validation.enable false --metrics.enable_tensorboard false \
    --job.dump_folder "$work/titan" >"$work/titan.log" 2>&1
  local first; first=$(grep -o 'unix_ms [0-9]*' "$work/titan.log" | awk '{print $2}')
  "$TITAN_PYTHON" - "$work/titan/metrics.jsonl" "$t0" "$first" <<'PY'
import json, statistics, sys
tps = [json.loads(l)["tps"] for l in open(sys.argv[1]) if '"tps"' in l]
print(json.dumps({"tps": statistics.median(tps[2:]), "first_ms": int(sys.argv[3]) - int(sys.argv[2])}))
PY
}
run_ref() {
  local t0; t0=$(now_ms)
  (cd "$root/test/reference" && "$TITAN_PYTHON" train_ref.py --steps "$steps" --batch "$batch" \
    --seq_len "$seq") >"$work/ref.json"
  "$TITAN_PYTHON" - "$work/ref.json" "$t0" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"tps": statistics.median(r["tps"][2:]), "first_ms": int(r["first_step_unix_ms"] - int(sys.argv[2]))}))
PY
}
# Alternate the two so that machine noise hits both alike.
t1=$(run_titan); r1=$(run_ref); t2=$(run_titan); r2=$(run_ref)
"$TITAN_PYTHON" - "$t1" "$t2" "$r1" "$r2" "$threads" "$steps" "$batch" "$seq" <<'PY'
import json, sys
t = [json.loads(sys.argv[1]), json.loads(sys.argv[2])]
r = [json.loads(sys.argv[3]), json.loads(sys.argv[4])]
tt = max(x["tps"] for x in t); rt = max(x["tps"] for x in r)
tf = min(x["first_ms"] for x in t); rf = min(x["first_ms"] for x in r)
print(f"llama3 debugmodel, CPU, {sys.argv[5]} threads, {sys.argv[6]} steps, batch {sys.argv[7]} x seq {sys.argv[8]}")
print(f"  train tokens/s   titan-train {tt:10.0f}   eager PyTorch {rt:10.0f}   ratio {tt / rt:.2f}x")
print(f"  exec->first step titan-train {tf:8d} ms   eager PyTorch {rf:8d} ms   ratio {rf / tf:.2f}x faster")
PY
