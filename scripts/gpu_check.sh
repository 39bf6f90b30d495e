#!/usr/bin/env bash
# The one prepared check for a GPU machine (the H200 the device tool lends: torch 2.11 in
# /opt/torch/.venv, nvcc 13, no package registry, no Debian -dev packages). docs/gpu.md has
# the why of each choice.
#
#   scripts/gpu_check.sh --pack      here: build (scripts/build.sh) and fill .gpu/ with what the
#                                    GPU machine lacks: the two binaries, the shared libraries
#                                    it may not have, the ctest files, corpus and tokenizer
#   scripts/gpu_check.sh             there, from the repository root, with .gpu carried:
#                                      device run, carry [".gpu"], command
#                                      "bash scripts/gpu_check.sh", timeout_s 540
#   scripts/gpu_check.sh --rehearse  here: --pack, then the same run inside a mount namespace
#                                    that hides the build tree, the set-up venv and every
#                                    header and library the Debian -dev packages installed,
#                                    and puts the venv where the GPU machine has its torch.
#                                    Steps that need a GPU report skipped.
#
# The binaries are built here and carried, not built there (docs/gpu.md: a build there costs
# minutes of the lease and needs every header carried). Every step runs even when one fails.
# It ends with a table (step, status, seconds, figures), writes it as JSON to
# $OUT/gpu_check.json with every step's log in $OUT/logs.tgz, and exits non-zero if any step
# failed, or skipped on a GPU machine.
# Environment: TORCH_VENV (default /opt/torch/.venv), OUT (default /tmp/gpu_check_out),
# GPU_CHECK_STEPS (space-separated step names: run only these), GPU_CHECK_BUDGET (seconds for
# all steps, default 480, inside the device tool's 8 minutes: a step that would pass it is cut
# short or not run).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mode="${1:-run}"

# ---- --pack (here) ------------------------------------------------------------------------
pack() {
  set -e
  local cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
  TITAN_SKIP_SETUP="${TITAN_SKIP_SETUP:-0}" "$root/scripts/build.sh" >/dev/null
  source "$cache/env.sh"
  local build="${TITAN_BUILD_DIR:-$root/build}" g="$root/.gpu" s
  s=$(mktemp -d)
  mkdir -p "$s/build/test" "$s/lib" "$s/lib-fallback" "$s/cache/data"
  cp "$build/titan-train" "$s/build/titan-train"
  cp "$build/test/titan_tests" "$s/build/test/titan_tests"
  strip --strip-unneeded "$s/build/titan-train" "$s/build/test/titan_tests"
  # ctest's files: their absolute paths are rewritten on the GPU machine.
  cp "$build/CTestTestfile.cmake" "$s/build/"
  cp "$build/test/CTestTestfile.cmake" "$build"/test/titan_tests_*.cmake "$s/build/test/"
  # Shared libraries outside the C/C++ runtime, the CUDA runtime and the torch wheel (whose
  # own copies the GPU machine has): the GPU image may lack them (Arrow and Parquet of
  # pyarrow, PCRE2, zstd, zlib). libstdc++ and libgcc go aside, used only if the GPU
  # machine's are older than the build's.
  local torch_lib
  torch_lib="$(cd "$(dirname "$TITAN_TORCH_DIR")/../../lib" && pwd)"
  ldd "$s/build/titan-train" "$s/build/test/titan_tests" | awk '/=> \//{print $1, $3}' | sort -u |
    while read -r name path; do
      case "$path" in
        "$torch_lib"/* | */nvidia/* | */libcudart.so* | */libc.so* | */libm.so* | */libdl.so* | \
          */librt.so* | */libpthread.so* | */libutil.so* | */ld-linux*) ;;
        */libstdc++.so* | */libgcc_s.so*) cp -L "$path" "$s/lib-fallback/$name" ;;
        *) cp -L "$path" "$s/lib/$name" ;;
      esac
    done
  cp "$cache/data/kjv.txt" "$cache/data/tokenizer.json" "$s/cache/data/"
  # One xz archive: Arrow alone is 60 MiB unpacked; the device tool carries 64 MiB in all.
  rm -rf "$g" && mkdir -p "$g"
  tar cf - -C "$s" . | xz -6 -T2 >"$g/payload.tar.xz"
  # torchtitan (scripts/versions.env), the benchmarks' anchor: its py3-none-any wheel alone
  # (0.4 MiB), and torchao's (3.4 MiB, abi3; its float8 training is Python over torch's
  # _scaled_mm) for torchtitan's float8 converter. The GPU machine has torch and reaches no
  # registry; the driver stubs the training-only imports torchtitan's wheel would pull in
  # (tyro, torchdata, datasets, tensorboard), so no other wheel is needed. Kept in the
  # cache: a pack needs no network after the first.
  mkdir -p "$cache/wheels" "$g/wheels"
  local pkg ver
  for pkg in torchtitan torchao; do
    ver="$(grep "^$(echo "$pkg" | tr a-z A-Z)_VERSION=" "$root/scripts/versions.env" | cut -d= -f2)"
    if ! ls "$cache/wheels/$pkg-$ver-"*.whl >/dev/null 2>&1; then
      "$TITAN_PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 "$pkg==$ver" -d "$cache/wheels"
    fi
    cp "$cache/wheels/$pkg-$ver-"*.whl "$g/wheels/"
  done
  {
    echo "BUILT_SOURCE_DIR=$root"
    echo "BUILT_BUILD_DIR=$build"
    echo "BUILT_PYTHON=$TITAN_PYTHON"
    echo "BUILT_AT=$(date -u +%FT%TZ)"
    echo "BUILT_COMMIT=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo +changes)"
  } >"$g/manifest.env"
  echo "[gpu_check] packed $(du -sh "$s" | cut -f1) as $(du -sh "$g/payload.tar.xz" | cut -f1) into $g (commit $(grep COMMIT "$g/manifest.env" | cut -d= -f2)):"
  (cd "$s" && ls -la build/titan-train build/test/titan_tests lib lib-fallback | grep -v '^total')
  ls -la "$g/wheels" | grep -v '^total'
  echo "[gpu_check] .gpu is $(du -sh "$g" | cut -f1) in all"
  rm -rf "$s"
}

# ---- --rehearse (here) --------------------------------------------------------------------
rehearse() {
  pack || { echo "[gpu_check] --pack failed"; exit 1; }
  local cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
  source "$cache/env.sh"
  local build="${TITAN_BUILD_DIR:-$root/build}"
  local copy=/tmp/gpu_check_rehearse_tree
  # The tree as the device tool sends it: tracked and untracked-not-ignored files, and .gpu.
  rm -rf "$copy" && mkdir -p "$copy"
  (git ls-files -co --exclude-standard; find .gpu -type f) | tar cf - -T - | tar xf - -C "$copy"
  # Hidden: the build tree, the cache (venv, ccache, corpus), the source checkout itself, and
  # the Debian -dev packages' headers and libraries (every file they installed under /usr/lib
  # and /usr/include). The venv reappears at /opt/torch/.venv, where the GPU machine has torch.
  local dev_libs
  dev_libs=$(dpkg -L libpcre2-dev libzstd-dev zlib1g-dev libutf8proc-dev libgloo-dev \
    libcli11-dev libtomlplusplus-dev nlohmann-json3-dev catch2 2>/dev/null |
    grep -E '^/usr/lib/.*\.(so|a)$|^/usr/lib/.*\.so\.' | tr '\n' ' ')
  unshare -m --propagation private bash -c '
    set -e
    copy=$1 build=$2 cache=$3 venv=$4 src=$5; shift 5
    mkdir -p /opt/torch/.venv
    mount --bind "$venv" /opt/torch/.venv
    mount -t tmpfs none "$build"
    mount -t tmpfs none /usr/include
    for f in "$@"; do if [ -f "$f" ] && [ ! -L "$f" ]; then mount --bind /dev/null "$f"; fi; done
    mount -t tmpfs none "$cache"
    mount -t tmpfs none "$src"
    cd "$copy"
    GPU_CHECK_REHEARSAL=1 bash scripts/gpu_check.sh
  ' _ "$copy" "$build" "$cache" "$TITAN_VENV" "$root" $dev_libs
}

# ---- the run (on the GPU machine, or rehearsed) --------------------------------------------
run_check() {
  local venv="${TORCH_VENV:-/opt/torch/.venv}" py out work rehearsal="${GPU_CHECK_REHEARSAL:-0}"
  py="$venv/bin/python"
  out="${OUT:-/tmp/gpu_check_out}"
  work="/tmp/gpu_check_work"
  rm -rf "$work" && mkdir -p "$work/logs" "$work/figs" "$out"
  [ -f .gpu/manifest.env ] || { echo "[gpu_check] no .gpu/: run scripts/gpu_check.sh --pack here and carry .gpu"; exit 1; }
  source .gpu/manifest.env
  [ -d .gpu/build ] || xz -dc .gpu/payload.tar.xz | tar xf - -C .gpu
  export PATH="/usr/local/cuda/bin:$venv/bin:$PATH"
  # This machine's torch wheel: its libraries and the nvidia-* ones they load (one CUDA
  # runtime for the binary and LibTorch), then what was carried.
  local torch_lib nv
  torch_lib="$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"
  nv=$(ls -d "$torch_lib"/../../nvidia/*/lib 2>/dev/null | tr '\n' ':')
  export LD_LIBRARY_PATH="$torch_lib:$nv$root/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # The tests find the tree, the binary, Python and the corpus through these (test/test_util.h).
  export TITAN_SOURCE_DIR="$root" TITAN_BINARY="$root/build/titan-train" TITAN_PYTHON="$py"
  export TITAN_CACHE="$root/.gpu/cache" OMP_NUM_THREADS="${OMP_NUM_THREADS:-16}"
  [ -e build ] || ln -s .gpu/build build
  # ctest's files name the build machine's paths: point them here.
  sed -i "s#$BUILT_BUILD_DIR#$root/.gpu/build#g; s#$BUILT_SOURCE_DIR#$root#g; s#$BUILT_PYTHON#$py#g" \
    .gpu/build/CTestTestfile.cmake .gpu/build/test/*.cmake
  # torchtitan, the benchmarks' anchor, from the carried wheel into a temporary folder that
  # only the torchtitan runs put on PYTHONPATH. A pure wheel installs by unpacking (it has no
  # .data folder); pip is not assumed (a uv-made venv may have none).
  export TT_SITE=/tmp/gpu_check_tt_site
  rm -rf "$TT_SITE"
  local w
  for w in .gpu/wheels/*.whl; do
    [ -f "$w" ] && "$py" -m zipfile -e "$w" "$TT_SITE" && echo "[gpu_check] installed $(basename "$w") into $TT_SITE"
  done
  if [ "$rehearsal" = 1 ] && [ -d "$TT_SITE/torchtitan" ]; then
    # No GPU here: the torchtitan driver runs 2 CPU steps of the debugmodel from that folder,
    # with torchtitan's float8 converter (torchao from the same folder, emulated on the CPU).
    PYTHONPATH="$TT_SITE" "$py" test/reference/torchtitan_bench.py --device cpu --dtype fp32 \
      --seq_len 32 --batch 1 --steps 2 --warmup 1 --float8 tensorwise 2>/dev/null | "$py" -c '
import json, sys
lines = sys.stdin.read().strip().splitlines()
o = json.loads(lines[-1]); r = o["runs"][0]
f8 = [l for l in lines if "linears converted" in l]
print("[gpu_check] rehearsal: torchtitan", o["torchtitan"], "from", o["torchtitan_path"] + ":",
      r["mode"], "losses", r["losses"], "error", r["error"], "|", (f8 or ["no float8 line"])[0])
sys.exit(0 if r["error"] is None and len(r["losses"]) == 2 and f8 else 1)' ||
      { echo "[gpu_check] rehearsal: the torchtitan driver failed on the CPU: the pack is incomplete"; exit 1; }
  fi
  export GPU_CHECK_T0=$(date +%s)
  local t_start=$SECONDS budget="${GPU_CHECK_BUDGET:-480}"
  : >"$work/results.tsv"

  # step NAME TIMEOUT FUNCTION: runs FUNCTION with its output in logs/NAME.log. Exit 0 passed,
  # 77 skipped (it says why), else failed. A function writes figures to $FIG (one line).
  step() {
    local name=$1 limit=$2 fn=$3 t0=$SECONDS rc status
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then return; fi
    echo "=== [$((SECONDS - t_start))s] $name"
    FIG="$work/figs/$name"
    : >"$FIG"
    # The whole check keeps inside its budget, so the table is always written.
    local left=$((budget - (SECONDS - t_start) - 15))
    if [ "$left" -lt 20 ]; then
      printf '%s\tfailed\t0\tnot run: the %ss budget is spent\n' "$name" "$budget" >>"$work/results.tsv"
      echo "    not run: budget spent"
      return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    ( export FIG; timeout --kill-after=10 "$limit" bash -c "$(declare -f "$fn" common_fns); common_fns; $fn" ) \
      >"$work/logs/$name.log" 2>&1
    rc=$?
    case $rc in
      0) status=passed ;;
      77) status=skipped ;;
      124 | 137) status=failed; echo "timed out after ${limit}s" >>"$FIG" ;;
      *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$(tr '\n\t' '  ' <"$FIG")" \
      >>"$work/results.tsv"
    echo "    $status in $((SECONDS - t0))s: $(cat "$FIG")"
    [ "$status" = passed ] || tail -15 "$work/logs/$name.log" | sed 's/^/    | /'
  }
  export -f step
  export work py root rehearsal venv budget

  # The short checks that must never be cut by the budget come before the long benchmarks.
  step device 30 step_device
  step preflight 30 step_preflight
  step cpu_smoke 60 step_cpu_smoke
  step gpu_tests 270 step_gpu_tests
  step bf16_learns 60 step_bf16_learns
  step new_paths 120 step_new_paths
  step bench_capture 100 step_bench_capture
  step bench_llama3_1b 160 step_bench_llama3_1b
  step bench_llama3_8b_4l 160 step_bench_llama3_8b_4l
  step bench_float8_8b 220 step_bench_float8
  step bench_deepseek_16b_4l 220 step_bench_deepseek
  summarize "$work" "$out" "$t_start"
}

# Helpers every step function sees (they run in a fresh bash).
common_fns() {
  need_gpu() {
    [ "$rehearsal" = 1 ] && { echo "rehearsal: no GPU here" | tee -a "$FIG"; exit 77; }
    command -v nvidia-smi >/dev/null || { echo "no nvidia-smi" >>"$FIG"; exit 1; }
  }
  fig() { printf '%s ' "$*" >>"$FIG"; }
  # train NAME ARGS...: a run of the binary; prints the log's tail; figures from metrics.jsonl:
  # the median over logged steps after the first two of tokens/s, MFU, peak memory.
  train() {
    local name=$1; shift
    local dump="$work/runs/$name"
    mkdir -p "$dump"
    "$root/build/titan-train" "$@" --job.dump_folder "$dump" --metrics.enable_tensorboard false \
      --validation.enable false --checkpoint.enable false >"$dump.log" 2>&1
    local rc=$?
    grep -E "=> (device|model|experts|activation)|step:" "$dump.log" | tail -8
    [ $rc -eq 0 ] || { echo "exit $rc"; tail -20 "$dump.log"; return $rc; }
    "$py" - "$dump/metrics.jsonl" "$name" >>"$FIG" <<'PY'
import json, math, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
assert rows and all(math.isfinite(r["loss"]) for r in rows), f"{sys.argv[2]}: bad losses"
body = rows[2:] or rows[-1:]
def med(k):
    v = [r[k] for r in body if isinstance(r.get(k), (int, float)) and r[k] >= 0]
    return statistics.median(v) if v else float("nan")
print(f"{sys.argv[2]}: tps {med('tps'):.0f} mfu {med('mfu'):.1f}% "
      f"peak {max(r.get('memory_peak_gib') or 0 for r in rows):.1f}GiB "
      f"fwdbwd/opt {med('time_fwdbwd_ms'):.0f}/{med('time_optimizer_ms'):.0f}ms "
      f"loss {rows[0]['loss']:.2f}->{rows[-1]['loss']:.2f}", end=" ")
PY
  }
  # torchtitan NAME LIMIT ARGS...: torchtitan 0.2.2's own training step (model, AC, per-block
  # compile, AMP, optimizer, loss, MFU: test/reference/torchtitan_bench.py; docs/gpu.md
  # "torchtitan as the anchor") on CUDA with ARGS, eager then compiled (GPU_CHECK_TT_MODES) in
  # one process, for at most LIMIT seconds and never into the last GPU_CHECK_TT_RESERVE
  # seconds of the budget (the steps after it). Its JSON is rewritten after each mode, so a
  # compile cut short keeps the eager figures. Fails when no mode gave a figure.
  torchtitan() {
    local name=$1 limit=$2; shift 2
    local json="$work/runs/$name.json" log="$work/runs/$name.log" rc left
    mkdir -p "$work/runs"
    [ -d "${TT_SITE:-/nonexistent}/torchtitan" ] || { fig "$name: no torchtitan (.gpu/wheels empty: --pack again);"; return 1; }
    left=$((budget - ($(date +%s) - GPU_CHECK_T0) - ${GPU_CHECK_TT_RESERVE:-90}))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 30 ] && { fig "$name: not run, the budget is spent;"; return 1; }
    PYTHONPATH="$TT_SITE" timeout --kill-after=10 "$limit" "$py" "$root/test/reference/torchtitan_bench.py" \
      --device cuda --modes "${GPU_CHECK_TT_MODES:-eager,compile}" --out "$json" "$@" >"$log" 2>&1
    rc=$?
    grep -E "^\[torchtitan_bench\]" "$log" | tail -14
    case $rc in 124 | 137) fig "$name: cut at ${limit}s (exit $rc);" ;; esac
    [ -s "$json" ] || { fig "$name: no figures (exit $rc);"; tail -20 "$log"; return 1; }
    "$py" - "$json" "$name" >>"$FIG" <<'PY'
import json, sys
o, name = json.load(open(sys.argv[1])), sys.argv[2]
for r in o["runs"]:
    if r["error"]:
        print(f"{name} {r['mode']} b{r['batch']}: {r['error'][:100]};", end=" ")
        continue
    print(f"{name} {r['mode']} b{r['batch']}: tps {r['tps_median']:.0f} mfu {r.get('mfu_pct', -1):.1f}% "
          f"peak {r.get('peak_allocated_gib', 0):.1f}GiB first step {r['first_step_s']:.0f}s;", end=" ")
sys.exit(0 if any(not r["error"] for r in o["runs"]) else 1)
PY
  }
  # vs_torchtitan RUN BATCH TT_NAME: titan-train's run RUN (batch BATCH) over torchtitan's runs
  # at the same batch: tokens/s (median after the first two logged steps, as train() reports)
  # and peak allocated memory (titan-train's memory_peak_gib, torchtitan's
  # max_memory_allocated), and each side's MFU by its own FLOPs count. A torchtitan run at
  # another batch (after running out of memory) shows its tokens/s ratio, named as such.
  vs_torchtitan() {
    "$py" - "$work/runs/$1/metrics.jsonl" "$2" "$work/runs/$3.json" >>"$FIG" <<'PY' || fig "vs torchtitan: no figures;"
import json, math, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
batch, tt = int(sys.argv[2]), json.load(open(sys.argv[3]))
body = rows[2:] or rows[-1:]
med = lambda k: statistics.median([r[k] for r in body if isinstance(r.get(k), (int, float)) and r[k] >= 0] or [math.nan])
tps, mfu, peak = med("tps"), med("mfu"), max(r.get("memory_peak_gib") or 0 for r in rows)
parts = []
for r in tt["runs"]:
    if r["error"]:
        if "OutOfMemory" in r["error"] and r["batch"] == batch:
            parts.append(f"torchtitan {r['mode']} out of memory at b{batch} (titan-train peak {peak:.1f}GiB)")
        continue
    at = "" if r["batch"] == batch else f" (torchtitan at b{r['batch']})"
    mem = f" peak x{peak / r['peak_allocated_gib']:.2f}" if r["batch"] == batch and r.get("peak_allocated_gib") else ""
    parts.append(f"{r['mode']}: tps x{tps / r['tps_median']:.2f}{mem}{at}, torchtitan MFU {r.get('mfu_pct', -1):.1f}%")
print(f"titan-train b{batch} / torchtitan: MFU {mfu:.1f}%; " + "; ".join(parts or ["no torchtitan figure"]) + ";", end=" ")
PY
  }
}

step_device() {
  need_gpu
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version,clocks.sm --format=csv
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
  fig "$(nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader | head -1)"
}

step_preflight() {
  grep BUILT .gpu/manifest.env
  local missing
  missing=$(ldd build/titan-train build/test/titan_tests | grep "not found" | sort -u)
  if [ -n "$missing" ]; then echo "unresolved libraries:"; echo "$missing"; fig "missing: $missing"; exit 1; fi
  if ! out=$(build/titan-train --help 2>&1); then
    echo "$out" | tail -5
    if grep -q "GLIBCXX\|CXXABI" <<<"$out"; then fig "needs the build's libstdc++ (.gpu/lib-fallback)"; fi
    exit 1
  fi
  build/test/titan_tests --list-test-names-only | wc -l | xargs -I{} echo "{} test cases"
  fig "binaries load; $(ldd build/titan-train | grep -c '=>') libraries resolved"
}

step_cpu_smoke() {
  train cpu_smoke --config configs/llama3_debug.toml --training.device cpu --training.steps 3 \
    --metrics.log_freq 1 --training.local_batch_size 2 --training.seq_len 128 || exit 1
}

# Every `gpu` test (ctest label), one at a time, cheapest first, each with its own row: the
# rows are appended as each test ends, so a step cut by its limit still reports every test
# that ran, and summarize lists the rest as not run. It passes only if every `gpu` test ran
# and passed (a rehearsal: every one skipped, since the CPU has no GPU).
step_gpu_tests() {
  local list="$work/gpu_tests.list" rows="$work/gpu_tests.tsv" num name t0 status xml
  : >"$rows"
  (cd build && ctest -L gpu -N) | sed -n 's/^ *Test *#\([0-9]*\): /\1\t/p' >"$list.all"
  # Cost order by name: the kernel checks (seconds), the step checks, then the tests that
  # train through the binary (a minute or more each); a test matching no prefix runs last.
  "$py" - "$list.all" >"$list" <<'PY'
import sys
order = ["ops:", "loss:", "loader:", "float8 linear cuda", "moe cutlass:", "moe cuda:",
         "moe float8 cuda", "overlap pair:", "gpu: a non-logging", "compile cuda: replays",
         "gpu: CUDA out of memory", "gpu: NCCL", "gpu: llama3 and llama4", "compile cuda: captured",
         "gpu: captured"]
rows = [l.rstrip("\n").split("\t", 1) for l in open(sys.argv[1]) if l.strip()]
rank = lambda name: next((i for i, p in enumerate(order) if name.startswith(p)), len(order))
for num, name in sorted(rows, key=lambda r: (rank(r[1]), int(r[0]))):
    print(f"{num}\t{name}")
PY
  echo "$(wc -l <"$list") gpu tests, cheapest first"
  while IFS=$'\t' read -r num name; do
    t0=$SECONDS
    xml="$work/gpu_test_$num.xml"
    (cd build && ctest -I "$num,$num" --output-on-failure --timeout 150 --output-junit "$xml")
    status=$("$py" - "$xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    c = next(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except Exception:
    print("failed"); sys.exit()
s = c.get("status", "run")
if c.find("failure") is not None or s == "fail": print("failed")
elif c.find("skipped") is not None or s in ("notrun", "disabled"): print("skipped")
else: print("passed")
PY
)
    printf 'gpu test: %s\t%s\t%s\t\n' "$name" "$status" "$((SECONDS - t0))" >>"$rows"
  done <"$list"
  "$py" - "$rows" "$list" "$rehearsal" >>"$FIG" <<'PY'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
total = sum(1 for l in open(sys.argv[2]) if l.strip())
st = {k: sum(r[1] == k for r in rows) for k in ("passed", "failed", "skipped")}
print(f"{st['passed']} passed, {st['failed']} failed, {st['skipped']} skipped of {total} gpu tests", end=" ")
rehearsal = sys.argv[3] == "1"
if len(rows) < total or st["failed"] or total == 0: sys.exit(1)
if st["skipped"]: sys.exit(77 if rehearsal and st["skipped"] == total else 1)
PY
}

# Batch sizes from `titan-train estimate --gpu h200` (docs/gpu.md): titan-train at a batch
# torchtitan may also fit and at the batch that fills the H200, then torchtitan itself at the
# first (at half of it if it runs out of memory), eager and compiled, and the ratios.
step_bench_llama3_1b() {
  need_gpu
  local m=(--config configs/llama3_debug.toml --model.flavor 1B --training.seq_len 4096
    --training.steps 8 --metrics.log_freq 1)
  train llama3_1b_b8 "${m[@]}" --training.local_batch_size 8 || exit 1
  # Batch 16 needs ~102 GiB (`titan-train estimate --world 1`): H200 only, not an 80 GB H100.
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -ge 120000 ]; then
    train llama3_1b_b16 "${m[@]}" --training.local_batch_size 16 || exit 1
  else
    fig "b16: not run (needs ~102 GiB);"
  fi
  torchtitan llama3_1b_tt 100 --model llama3 --flavor 1B --seq_len 4096 --batch 8 --oom_batch 4 \
    --steps 5 --warmup 2 || fig "torchtitan: failed;"
  vs_torchtitan llama3_1b_b8 8 llama3_1b_tt
}

step_bench_llama3_8b_4l() {
  need_gpu
  local m=(--config configs/llama3_debug.toml --model.flavor 8B --model.n_layers 4 --training.seq_len 8192
    --activation_checkpoint.mode full --training.steps 6 --metrics.log_freq 1)
  train llama3_8b_4l_b8 "${m[@]}" --training.local_batch_size 8 || exit 1
  # Batch 16 is the H200's fill; on an 80 GB H100 it is left out to keep the budget for torchtitan.
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -ge 120000 ]; then
    train llama3_8b_4l_b16 "${m[@]}" --training.local_batch_size 16 || exit 1
  else
    fig "b16: not run on a card under 120 GB;"
  fi
  torchtitan llama3_8b_4l_tt 100 --model llama3 --flavor 8B --n_layers 4 --seq_len 8192 --ac full \
    --batch 8 --oom_batch 4 --steps 5 --warmup 2 || fig "torchtitan: failed;"
  vs_torchtitan llama3_8b_4l_b8 8 llama3_8b_4l_tt
}

# Float8 tensorwise (model.converters = ["float8"], torchao's recipe: every linear but the
# output, its three GEMMs through _scaled_mm) against bf16 compute at Llama-3 8B's width (dim
# 4096, ffn 14336, 32/8 heads, vocab 128256) with 2 layers, batch 2 x 4096, eager: tokens/s and
# peak memory ratios float8 / bf16. Fails when the float8 run fails or ends with a non-finite
# loss, or when a GPU of SM89 or later ran the emulated GEMMs instead of _scaled_mm (the
# start-up line "float8: recipe tensorwise, scaled_mm GEMMs on cuda:0" says which). Then
# torchtitan with its own float8 converter (torchao's Float8Linear, the same recipe and the
# output left out; torchao's wheel is carried beside torchtitan's), eager and compiled, and
# titan-train's float8 run against it (vs_torchtitan).
step_bench_float8() {
  need_gpu
  local m=(--config configs/llama3_debug.toml --model.flavor 8B --model.n_layers 2
    --training.seq_len 4096 --training.local_batch_size 2 --training.steps 8 --metrics.log_freq 1)
  train llama3_8b_2l_bf16 "${m[@]}" || exit 1
  train llama3_8b_2l_float8 "${m[@]}" --model.converters float8 \
    --quantize.linear.float8.recipe_name tensorwise || { fig "float8: failed"; exit 1; }
  local log="$work/runs/llama3_8b_2l_float8.log" cap line
  line=$(grep -m1 -o "float8: recipe [^;]*" "$log") || { fig "float8: no start-up line"; exit 1; }
  echo "$line"
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
  if [ "${cap:-0}" -ge 89 ] && [[ "$line" != *"scaled_mm GEMMs"* ]]; then
    fig "float8 ran EMULATED on sm_$cap: $line"
    exit 1
  fi
  "$py" - "$work/runs" >>"$FIG" <<'PY'
import json, os, statistics, sys
def figs(name):
    rows = [json.loads(l) for l in open(os.path.join(sys.argv[1], name, "metrics.jsonl"))
            if '"loss"' in l]
    return (statistics.median(r["tps"] for r in (rows[2:] or rows)),
            max(r.get("memory_peak_gib") or 0 for r in rows))
(tb, pb), (tf, pf) = figs("llama3_8b_2l_bf16"), figs("llama3_8b_2l_float8")
print(f"float8/bf16: tps x{tf / tb:.2f}, peak x{pf / pb:.2f};", end=" ")
PY
  torchtitan llama3_8b_2l_float8_tt 100 --model llama3 --flavor 8B --n_layers 2 --seq_len 4096 \
    --batch 2 --steps 8 --warmup 2 --float8 tensorwise || fig "torchtitan float8: failed;"
  vs_torchtitan llama3_8b_2l_float8 2 llama3_8b_2l_float8_tt
}

# DeepSeek-V3 16B x 4 layers on the three experts backends, each asked for by name (cutlass
# is allowed from SM80, SM90 included, when asked: moe/experts.cpp). Fails when a run fails or
# ran another backend than asked; prints tokens/s ratios against grouped_mm.
# Batch 16 needs ~92 GiB (`titan-train estimate --world 1`: 49 GiB of activations), which an
# H200 holds and an 80 GB H100 does not: batch 8 (~65 GiB) there.
step_bench_deepseek() {
  need_gpu
  local mib batch=16
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [ "${mib:-0}" -lt 120000 ] && batch=8
  fig "batch $batch x 4096;"
  local m=(--config configs/deepseek_v3_debug.toml --model.flavor 16B --model.n_layers 4
    --training.seq_len 4096 --training.local_batch_size $batch --training.steps 8 --metrics.log_freq 1)
  local b rc=0
  for b in grouped_mm cutlass loop; do
    train "dsv3_16b_4l_$b" "${m[@]}" --moe.experts_backend "$b" || { fig "$b: failed"; rc=1; continue; }
    grep -q "MoE experts backend = $b " "$work/runs/dsv3_16b_4l_$b.log" ||
      { fig "$b: the run did not use $b"; rc=1; }
  done
  "$py" - "$work/runs" >>"$FIG" <<'PY' || rc=1
import json, os, statistics, sys
def tps(b):
    f = os.path.join(sys.argv[1], f"dsv3_16b_4l_{b}", "metrics.jsonl")
    if not os.path.exists(f): return None
    rows = [json.loads(l) for l in open(f) if '"loss"' in l]
    v = [r["tps"] for r in (rows[2:] or rows)]
    return statistics.median(v) if v else None
g = tps("grouped_mm")
for b in ("cutlass", "loop"):
    t = tps(b)
    if g and t: print(f"{b}/grouped_mm tps {t / g:.2f}x", end=" ")
PY
  torchtitan dsv3_16b_4l_tt 120 --model deepseek_v3 --flavor 16B --n_layers 4 --seq_len 4096 \
    --batch $batch --oom_batch $((batch / 2)) --steps 5 --warmup 2 || fig "torchtitan: failed;"
  vs_torchtitan dsv3_16b_4l_grouped_mm $batch dsv3_16b_4l_tt
  exit $rc
}

# The launch-bound case (debugmodel, batch 1 x seq 512), captured against eager, for llama3
# and deepseek_v3. Fails unless the captured run's last metrics row shows one capture and
# steps - 3 replays (3 eager warm-up steps; the capture step replays at once:
# app/compiled_step.h), or when a run fails. Prints captured/eager tokens/s (median over the
# log windows after the first two, so over replayed steps only).
step_bench_capture() {
  need_gpu
  local steps=40 name rc=0
  for name in llama3 deepseek_v3; do
    local common=(--config "configs/${name}_debug.toml" --training.local_batch_size 1
      --training.seq_len 512 --training.steps $steps --metrics.log_freq 10)
    train "${name}_b1_eager" "${common[@]}" || { fig "$name eager: failed"; rc=1; continue; }
    train "${name}_b1_captured" "${common[@]}" --compile.enable true ||
      { fig "$name captured: failed"; rc=1; continue; }
    "$py" - "$work/runs" "$name" "$steps" 3 >>"$FIG" <<'PY' || rc=1
import json, os, statistics, sys
runs, name, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def rows(kind):
    return [json.loads(l) for l in open(os.path.join(runs, f"{name}_b1_{kind}", "metrics.jsonl"))
            if '"loss"' in l]
e, c = rows("eager"), rows("captured")
last = c[-1]
med = lambda rs: statistics.median(r["tps"] for r in (rs[2:] or rs))
print(f"{name} captured/eager tps {med(c) / med(e):.2f}x "
      f"(captures {last.get('compile_captures')}, replays {last.get('compile_replays')}"
      f" of {steps - warmup} expected)", end=" ")
ok = (last.get("step") == steps and last.get("compile_captures") == 1
      and last.get("compile_replays") == steps - warmup
      and not any("compile_replays" in r for r in e))
if not ok: print(f"[{name}: NOT CAPTURED AS EXPECTED]", end=" ")
sys.exit(0 if ok else 1)
PY
  done
  exit $rc
}

# The bug of the first H200 run (bf16 training did not learn: loss flat at 8.13) must never
# come back. The debugmodel in bf16 on CUDA, 200 steps, against the CPU fp32 golden curve
# (test/golden/llama3_debug_cpu_losses.json: the same config, batch 4 x 256, seed 0, the same
# data order). Rule: bf16 compute is on; every golden step is logged; step 1 within 2% of the
# CPU loss (the same initial weights and batch: bf16 rounding only); steps 10-200 within 10%
# of it (bf16 rounding compounds over the steps; the flat curve is 100% off at step 200); and
# the loss at 200 at most 0.6 x that at 1 (the CPU test's rule).
step_bf16_learns() {
  need_gpu
  train bf16_learns --config configs/llama3_debug.toml --training.device cuda \
    --training.mixed_precision_param bfloat16 --training.local_batch_size 4 \
    --training.seq_len 256 --training.steps 200 --metrics.log_freq 10 --debug.seed 0 || exit 1
  grep -q "bf16 compute" "$work/runs/bf16_learns.log" || { fig "not bf16 compute"; exit 1; }
  "$py" - "$work/runs/bf16_learns/metrics.jsonl" test/golden/llama3_debug_cpu_losses.json \
    >>"$FIG" <<'PY'
import json, sys
got = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r}
gold = {int(k): v for k, v in json.load(open(sys.argv[2]))["losses"].items()}
bad, worst = [], (0.0, 0)
for s, g in sorted(gold.items()):
    if s not in got:
        bad.append(f"step {s} not logged"); continue
    rel = abs(got[s] - g) / g
    worst = max(worst, (rel, s))
    if rel > (0.02 if s == 1 else 0.10): bad.append(f"step {s}: {got[s]:.3f} vs CPU {g:.3f}")
if 1 in got and 200 in got and not got[200] <= 0.6 * got[1]:
    bad.append(f"loss {got[1]:.3f} -> {got[200]:.3f} fell less than to 0.6x")
print(f"bf16 loss {got.get(1, float('nan')):.3f}->{got.get(200, float('nan')):.3f} "
      f"(CPU fp32 {gold[1]:.3f}->{gold[200]:.3f}), worst {100 * worst[0]:.1f}% at step {worst[1]}",
      end=" ")
for b in bad: print(f"[{b}]", end=" ")
sys.exit(1 if bad else 0)
PY
}

# What this round added on CUDA, each short: block-causal attention through the varlen flash
# kernel inside the captured step (docs/attention.md), the Qwen3 debug model captured
# (docs/models.md), and Muon's optimizer step against AdamW's on the 1B flavor (its
# time(ms) opt; docs/training.md "Muon").
step_new_paths() {
  need_gpu
  local cap=(--training.device cuda --compile.enable true --training.steps 12 --metrics.log_freq 1)
  train varlen_captured --config configs/llama3_debug.toml "${cap[@]}" \
    --model.attn_mask_type block_causal --training.seq_len 512 --training.local_batch_size 4 || exit 1
  grep -q "captured the train step" "$work/runs/varlen_captured.log" || { fig "varlen: not captured"; exit 1; }
  grep -q "=> attention: block_causal" "$work/runs/varlen_captured.log" || { fig "varlen: no block_causal line"; exit 1; }
  train qwen3_captured --config configs/qwen3_debug.toml "${cap[@]}" --training.seq_len 512 \
    --training.local_batch_size 4 || exit 1
  grep -q "captured the train step" "$work/runs/qwen3_captured.log" || { fig "qwen3: not captured"; exit 1; }
  local m=(--config configs/llama3_debug.toml --model.flavor 1B --training.device cuda
    --training.seq_len 2048 --training.local_batch_size 2 --training.steps 6 --metrics.log_freq 1)
  train opt_adamw_1b "${m[@]}" || exit 1
  train opt_muon_1b "${m[@]}" --optimizer.name Muon || exit 1
  "$py" - "$work/runs/opt_adamw_1b/metrics.jsonl" "$work/runs/opt_muon_1b/metrics.jsonl" >>"$FIG" <<'PY'
import json, statistics, sys
def opt_ms(path):
    rows = [json.loads(l) for l in open(path) if '"loss"' in l][2:]
    return statistics.median(r["time_optimizer_ms"] for r in rows)
a, m = opt_ms(sys.argv[1]), opt_ms(sys.argv[2])
print(f"1B optimizer step: AdamW {a:.1f} ms, Muon {m:.1f} ms ({m / a:.2f}x)", end=" ")
PY
}

summarize() {
  local work=$1 out=$2 t_start=$3
  "${py:-python3}" - "$work/results.tsv" "$out/gpu_check.json" "$((SECONDS - t_start))" "${GPU_CHECK_REHEARSAL:-0}" <<'PY'
import json, sys, textwrap
import os
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
# Each gpu test's own row after the gpu_tests step's, written as it ended; a test the step's
# limit cut off is "failed: not run" (every gpu test must run).
work = os.path.dirname(sys.argv[1])
tests = [l.rstrip("\n").split("\t") for l in open(os.path.join(work, "gpu_tests.tsv"))
         if l.strip()] if os.path.exists(os.path.join(work, "gpu_tests.tsv")) else []
listed = [l.rstrip("\n").split("\t", 1)[1] for l in open(os.path.join(work, "gpu_tests.list"))
          if l.strip()] if os.path.exists(os.path.join(work, "gpu_tests.list")) else []
ran = {t[0] for t in tests}
tests += [["gpu test: " + n, "failed", "0", "not run: the gpu_tests step's limit cut it off"]
          for n in listed if "gpu test: " + n not in ran]
at = next((i + 1 for i, r in enumerate(rows) if r[0] == "gpu_tests"), len(rows))
rows = rows[:at] + [t + [""] * (4 - len(t)) for t in tests] + rows[at:]
steps = [{"step": r[0], "status": r[1], "seconds": int(r[2]), "figures": r[3].strip()} for r in rows]
rehearsal = sys.argv[4] == "1"
bad = [s for s in steps if s["status"] == "failed" or (s["status"] == "skipped" and not rehearsal)]
json.dump({"total_seconds": int(sys.argv[3]), "rehearsal": rehearsal, "ok": not bad, "steps": steps},
          open(sys.argv[2], "w"), indent=1)
print(f"\n{'step':24} {'status':8} {'s':>4}  figures")
for s in steps:
    # Wrapped, not cut: the benchmarks' figures end with their ratios against torchtitan. A
    # gpu test's row is its name (long), then the status on the next line.
    lines = textwrap.wrap(s["figures"], 150) or [""]
    if s["step"].startswith("gpu test: "):
        print(f"  {s['step'][:140]}")
        print(f"{'':24} {s['status']:8} {s['seconds']:4}  {lines[0]}")
        continue
    print(f"{s['step']:24} {s['status']:8} {s['seconds']:4}  {lines[0]}")
    for l in lines[1:]:
        print(" " * 40 + l)
print(f"total {sys.argv[3]}s: " + ("every step passed" if not bad else
      f"{len(bad)} step(s) failed or skipped: " + ", ".join(s["step"] for s in bad)))
sys.exit(1 if bad else 0)
PY
  local rc=$?
  tar czf "$out/logs.tgz" -C "$work" logs runs $(cd "$work" && ls *.xml 2>/dev/null) 2>/dev/null
  cp "$work/results.tsv" "$out/results.tsv"
  exit $rc
}

case "$mode" in
  --pack) pack ;;
  --rehearse) rehearse ;;
  run) run_check ;;
  *) echo "usage: scripts/gpu_check.sh [--pack | --rehearse]" >&2; exit 2 ;;
esac
