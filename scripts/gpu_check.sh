#!/usr/bin/env bash
# The one prepared check for a GPU machine (the H200 lent through the device tool).
# It builds against the torch already installed there, prints the device, runs the tests
# that need CUDA, makes a short training run and a benchmark, all within 8 minutes.
#
# How to call it (from a development machine with the device tool):
#   scripts/gpu_carry.sh                  # once: copies header-only deps into .deps/
#   device run, carry [".deps"], command "bash scripts/gpu_check.sh", timeout_s 540
# Environment: TORCH_VENV (default /opt/torch/.venv), JOBS (default nproc).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${TORCH_VENV:-/opt/torch/.venv}"
py="$venv/bin/python"
out="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
start=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - start ))s] $*"; }

step "device"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv || true
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

step "CUDA tests ([cuda])"
TITAN_PYTHON="$py" ./build-gpu/test/titan_tests "[cuda]" 2>&1 | tail -40 | tee "$out/cuda_tests.log"

step "short training run: llama3 debugmodel, bf16, 50 steps"
timeout 120 ./build-gpu/titan-train --config configs/llama3_debug.toml --training.steps 50 \
  --training.local_batch_size 16 --training.seq_len 1024 --metrics.log_freq 10 \
  --validation.enable false --job.dump_folder "$out/run" 2>&1 | grep -E "=>|step:|error" | tee "$out/train.log"

step "short training run: deepseek_v3 debugmodel, bf16, auto expert backend (grouped_mm on SM90)"
timeout 120 ./build-gpu/titan-train --config configs/deepseek_v3_debug.toml --training.steps 30 \
  --training.local_batch_size 8 --training.seq_len 512 --metrics.log_freq 10 \
  --validation.enable false --job.dump_folder "$out/ds" 2>&1 | grep -E "=>|backend|step:|error" | tee "$out/ds.log"

step "NCCL: a world_size=1 process group through torchrun (the data-parallel path: store, config hash, broadcast, bucketed all-reduce over NCCL)"
timeout 120 "$venv/bin/torchrun" --standalone --nproc_per_node 1 --no-python ./build-gpu/titan-train \
  --config configs/llama3_debug.toml --training.steps 20 --training.local_batch_size 8 \
  --training.seq_len 512 --metrics.log_freq 5 --validation.enable false \
  --job.dump_folder "$out/nccl1" 2>&1 | grep -E "process group|world_size|memory:|step:|error" | tee "$out/nccl1.log"

step "benchmark: one MoE layer, loop vs grouped_mm, forward+backward, bf16"
TITAN_SKIP_BUILD=1 TITAN_BUILD_DIR=build-gpu timeout 90 bash scripts/bench_moe.sh 2>&1 | tail -15 | tee "$out/bench_moe.log"

step "benchmark: llama3 debugmodel throughput at seq 2048 (tokens/s, MFU)"
timeout 90 ./build-gpu/titan-train --config configs/llama3_debug.toml --training.steps 30 \
  --training.local_batch_size 8 --training.seq_len 2048 --metrics.log_freq 10 \
  --validation.enable false --job.dump_folder "$out/bench" 2>&1 | grep -E "step:" | tee "$out/bench.log"
echo "total: $(( $(date +%s) - start ))s"
