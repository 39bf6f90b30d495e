#!/usr/bin/env bash
# The one prepared check for a GPU machine (the H200 lent through the device tool).
# It builds against the torch already installed there, prints the device, runs the tests
# that need CUDA, trains single-device, DDP and FSDP (NCCL, one rank) runs and checks that
# their losses are finite and falling, and runs two benchmarks, all within 8 minutes. Any
# failed step makes it exit non-zero.
#
# How to call it (from a development machine with the device tool):
#   scripts/gpu_carry.sh                  # once: copies header-only deps into .deps/
#   device run, carry [".deps"], command "bash scripts/gpu_check.sh", timeout_s 540
# Environment: TORCH_VENV (default /opt/torch/.venv), JOBS (default nproc).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${TORCH_VENV:-/opt/torch/.venv}"
py="$venv/bin/python"
out="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
start=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - start ))s] $*"; }
# A training run: its whole log in $out/<name>.log (the interesting lines echoed), then its
# metrics.jsonl must hold finite losses that fall from the first to the last logged step.
train() {
  local name=$1; shift
  timeout 150 "$@" --job.dump_folder "$out/$name" >"$out/$name.log" 2>&1 || {
    echo "FAILED: $name exited $? (last lines of $out/$name.log):"; tail -20 "$out/$name.log"; return 1; }
  grep -E "=>|backend|process group|step:" "$out/$name.log" | tail -25
  "$py" - "$out/$name/metrics.jsonl" "$name" <<'PY'
import json, math, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
losses = [s["loss"] for s in steps]
assert losses, f"{sys.argv[2]}: no losses logged"
assert all(math.isfinite(x) for x in losses), f"{sys.argv[2]}: non-finite loss {losses}"
assert losses[-1] < 0.95 * losses[0], f"{sys.argv[2]}: loss did not fall: {losses}"
print(f"{sys.argv[2]}: {len(losses)} logged steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}: finite and falling")
PY
}

step "device"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv
"$py" -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))'

step "configure and build (Release, CUDA arch 9.0)"
deps="$root/.deps"
[ -d "$deps" ] || { echo "missing .deps: run scripts/gpu_carry.sh and carry .deps"; exit 1; }
export LD_LIBRARY_PATH="$deps/lib:${LD_LIBRARY_PATH:-}"
cmake -S . -B build-gpu -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
  -DTITAN_PYTHON="$py" -DCMAKE_PREFIX_PATH="$deps" -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_INCLUDE_PATH="$deps/include" -DCMAKE_LIBRARY_PATH="$deps/lib" \
  >"$out/configure.log" 2>&1 || { tail -40 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j "${JOBS:-$(nproc)}" >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - start ))s"

step "CUDA tests ([cuda]: MoE backends, fused kernels, loader)"
TITAN_PYTHON="$py" ./build-gpu/test/titan_tests "[cuda]" >"$out/cuda_tests.log" 2>&1 || {
  tail -60 "$out/cuda_tests.log"; echo "FAILED: CUDA tests"; exit 1; }
tail -3 "$out/cuda_tests.log"

common=(--training.steps 30 --metrics.log_freq 5 --validation.enable false)
step "llama3 debugmodel, bf16, single device"
train llama3 ./build-gpu/titan-train --config configs/llama3_debug.toml "${common[@]}" \
  --training.local_batch_size 16 --training.seq_len 1024

step "deepseek_v3 debugmodel, bf16, auto expert backend (grouped_mm on SM90)"
train deepseek ./build-gpu/titan-train --config configs/deepseek_v3_debug.toml "${common[@]}" \
  --training.local_batch_size 8 --training.seq_len 512

step "NCCL DDP: a world_size=1 process group through torchrun (store, config hash, broadcast, bucketed all-reduce)"
train nccl_ddp "$venv/bin/torchrun" --standalone --nproc_per_node 1 --no-python ./build-gpu/titan-train \
  --config configs/llama3_debug.toml "${common[@]}" --training.local_batch_size 8 --training.seq_len 512
grep -q "DDP (replicated)" "$out/nccl_ddp.log" || { echo "FAILED: the DDP run did not take the DDP path"; exit 1; }
grep -q "all-reduced during backward" "$out/nccl_ddp.log" || { echo "FAILED: DDP without backward hooks"; exit 1; }

step "NCCL FSDP on one GPU (TITAN_FORCE_FSDP=1: bf16 all-gathers with prefetch on NCCL's stream, reduce-scatter, reshard after forward)"
TITAN_FORCE_FSDP=1 train nccl_fsdp "$venv/bin/torchrun" --standalone --nproc_per_node 1 --no-python \
  ./build-gpu/titan-train --config configs/llama3_debug.toml "${common[@]}" \
  --training.local_batch_size 8 --training.seq_len 512
grep -q "FSDP, dp_replicate 1 x dp_shard 1" "$out/nccl_fsdp.log" || { echo "FAILED: the FSDP run did not shard"; exit 1; }
grep -q "prefetch, backward prefetch" "$out/nccl_fsdp.log" || { echo "FAILED: FSDP without backward prefetch"; exit 1; }

step "NCCL FSDP with prefetch, async reduce-scatters, full activation checkpointing and 2 micro-batches"
TITAN_FORCE_FSDP=1 train nccl_fsdp_overlap "$venv/bin/torchrun" --standalone --nproc_per_node 1 --no-python \
  ./build-gpu/titan-train --config configs/llama3_debug.toml "${common[@]}" \
  --training.local_batch_size 4 --training.global_batch_size 8 --training.seq_len 512 \
  --activation_checkpoint.mode full
grep -q "reduce-scatters waited for before the norm" "$out/nccl_fsdp_overlap.log" ||
  { echo "FAILED: the FSDP run did not defer its reduce-scatters"; exit 1; }
grep -q "comm_wait_ms" "$out/nccl_fsdp_overlap.log" || { echo "FAILED: no comm_wait_ms"; exit 1; }

step "benchmark: one MoE layer, loop vs grouped_mm, forward+backward, bf16"
TITAN_SKIP_BUILD=1 TITAN_BUILD_DIR=build-gpu timeout 90 bash scripts/bench_moe.sh >"$out/bench_moe.log" 2>&1 || {
  tail -20 "$out/bench_moe.log"; echo "FAILED: bench_moe"; exit 1; }
tail -15 "$out/bench_moe.log"

step "benchmark: llama3 debugmodel throughput at seq 2048 (tokens/s, MFU)"
train bench ./build-gpu/titan-train --config configs/llama3_debug.toml --training.steps 30 \
  --training.local_batch_size 8 --training.seq_len 2048 --metrics.log_freq 10 --validation.enable false
echo "total: $(( $(date +%s) - start ))s: every step passed"
