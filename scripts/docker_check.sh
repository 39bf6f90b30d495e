#!/usr/bin/env bash
# Builds the Dockerfile's image and runs it (docs/launching.md "Docker"): titan-train --help,
# 5 CPU training steps with a mounted data folder and dump folder (the checkpoint must appear
# on the host), and --entrypoint torchrun with 2 processes. Prints the image size and build
# time, and checks that the runtime stage holds no compiler and no C headers.
#
# Needs Debian's docker.io and debootstrap, and root. Works without an image registry: when
# the base images the Dockerfile's FROM lines name are absent, it makes them (debootstrap
# --variant=minbase Debian, `docker import`, tagged with those names; the devel one also gets
# this machine's /usr/local/cuda, as the real nvidia/cuda devel image has it). Their pip reads
# a wheelhouse of every wheel the Dockerfile pins (scripts/docker_wheels.sh reads them from
# its pip lines) and their dependencies, which this script downloads once and serves on
# 127.0.0.1. Where the real base images can be pulled,
# the Dockerfile builds unchanged without any of this (TITAN_DOCKER_REAL_BASES=1 skips it).
# Starts its own dockerd (--iptables=false --bridge=none) unless one answers already, and
# stops it at the end. Prints TITAN_TEST_SKIPPED and exits 0 where the tools are missing.
# Environment: TITAN_DOCKER_WORK (default <repo>/build/docker), TITAN_DOCKER_ROOT (dockerd's
# data root, default /var/lib/titan-docker), TITAN_DOCKER_PORT (wheelhouse, default 28123),
# TITAN_DOCKER_CONTEXT (the build context, default the checkout), TITAN_DOCKER_NEW_BASES=1,
# runtime or devel (make those base images again).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/versions.env"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
work="${TITAN_DOCKER_WORK:-$root/build/docker}"
mkdir -p "$work" && work="$(cd "$work" && pwd)"
droot="${TITAN_DOCKER_ROOT:-/var/lib/titan-docker}"
port="${TITAN_DOCKER_PORT:-28123}"
image=titan-train:check
devel="nvidia/cuda:${CUDA_IMAGE_TAG}-cudnn-devel-ubuntu24.04"
runtime="nvidia/cuda:${CUDA_IMAGE_TAG}-cudnn-runtime-ubuntu24.04"
say() { echo "[docker-check] $(date -u +%H:%M:%S) $*"; }
skip() { echo "TITAN_TEST_SKIPPED: $*"; exit 0; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

for c in dockerd docker debootstrap; do
  command -v "$c" >/dev/null || skip "$c not found (apt-get install docker.io debootstrap)"
done
[ "$(id -u)" -eq 0 ] || skip "dockerd and debootstrap need root"
mkdir -p "$droot"
free_gib=$(df -BG --output=avail "$droot" | tail -1 | tr -dc 0-9)
[ "$free_gib" -ge 40 ] || skip "$droot has ${free_gib} GiB free; the images need about 40"
say "disk: $(df -h --output=avail "$droot" | tail -1 | tr -d ' ') free under $droot"

# ---- the daemon ------------------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
  export DOCKER_HOST="unix://$work/docker.sock"
  dockerd --iptables=false --bridge=none --data-root "$droot" --exec-root "$work/exec" \
    --pidfile "$work/dockerd.pid" --host "$DOCKER_HOST" >"$work/dockerd.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 150); do docker info >/dev/null 2>&1 && break; sleep 0.2; done
  docker info >/dev/null 2>&1 || { tail -20 "$work/dockerd.log"; exit 1; }
  say "started dockerd (pid ${pids[0]}, storage $(docker info -f '{{.Driver}}'))"
fi

# ---- base images and wheelhouse ---------------------------------------------------------------
if [ -z "${TITAN_DOCKER_REAL_BASES:-}" ]; then
  wheels="$work/wheels"
  # The Dockerfile's own pip pins (scripts/docker_wheels.sh), so the wheelhouse cannot fall
  # behind it (it once lacked the nvidia-cutlass wheel the Dockerfile had started to install).
  # .done records the list: a changed pin downloads again.
  reqs="$("$root/scripts/docker_wheels.sh")"
  if [ ! -f "$wheels/.done" ] || [ "$(cat "$wheels/.done")" != "$reqs" ]; then
    say "downloading the wheelhouse: $(echo "$reqs" | awk '{print $2}' | tr '\n' ' ')(and dependencies)"
    rm -rf "$wheels" && mkdir -p "$wheels"
    pyv="$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
    deps=($(echo "$reqs" | awk '$1 == "deps" {print $2}'))
    nodeps=($(echo "$reqs" | awk '$1 == "nodeps" {print $2}'))
    get() { python3 -m pip download -q --only-binary=:all: --python-version "$pyv" -d "$wheels" "$@"; }
    ((${#deps[@]} == 0)) || get "${deps[@]}"
    ((${#nodeps[@]} == 0)) || get --no-deps "${nodeps[@]}"
    echo "$reqs" >"$wheels/.done"
  fi
  python3 -m http.server "$port" --bind 127.0.0.1 --directory "$wheels" >/dev/null 2>&1 &
  pids+=($!)
  new="${TITAN_DOCKER_NEW_BASES:-}"
  if [ -n "$new" ] || ! docker image inspect "$devel" >/dev/null 2>&1 ||
     ! docker image inspect "$runtime" >/dev/null 2>&1; then
    rootfs="$work/rootfs"
    if [ ! -f "$rootfs/.done" ]; then
      say "debootstrap --variant=minbase bookworm"
      rm -rf "$rootfs"
      debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
        { tail -20 "$work/debootstrap.log"; exit 1; }
      # The package index is a dated snapshot here: do not refuse it for its age.
      printf 'Acquire::Check-Valid-Until "false";\nAcquire::Check-Date "false";\n' \
        >"$rootfs/etc/apt/apt.conf.d/99titan-check"
      printf '[global]\nno-index = true\nfind-links = http://127.0.0.1:%s/\n' "$port" >"$rootfs/etc/pip.conf"
      rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
      touch "$rootfs/.done"
    fi
    path=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    cuda="$(readlink -f /usr/local/cuda)"
    [ -x "$cuda/bin/nvcc" ] || skip "no CUDA toolkit in /usr/local/cuda for the devel base image"
    # The runtime base holds the CUDA runtime library on the library path, as the real one
    # does (titan-train links libcudart when it was built with nvcc).
    if [ "$new" = 1 ] || [ "$new" = runtime ] || ! docker image inspect "$runtime" >/dev/null 2>&1; then
    say "importing $runtime (with $cuda's libcudart)"
    tar -c -C "$rootfs" --exclude=./.done . -C / usr/local/cuda "${cuda#/}/lib64" \
        $(cd / && echo "${cuda#/}"/lib/libcudart.so*) |
      docker import --change "ENV PATH=$path" --change "ENV LD_LIBRARY_PATH=/usr/local/cuda/lib64" \
        - "$runtime" >/dev/null
    fi
    if [ "$new" = 1 ] || [ "$new" = devel ] || ! docker image inspect "$devel" >/dev/null 2>&1; then
    say "importing $devel (with $cuda)"
    tar -c -C "$rootfs" --exclude=./.done . -C / "${cuda#/}" usr/local/cuda |
      docker import --change "ENV PATH=$path" --change "ENV CUDA_HOME=/usr/local/cuda" - "$devel" >/dev/null
    fi
  fi
fi

# ---- build -----------------------------------------------------------------------------------
say "docker build --network=host -t $image ."
t0=$(date +%s)
docker build --network=host -t "$image" "${TITAN_DOCKER_CONTEXT:-$root}" >"$work/build.log" 2>&1 ||
  { tail -40 "$work/build.log"; exit 1; }
build_s=$(( $(date +%s) - t0 ))
size=$(docker image inspect -f '{{.Size}}' "$image")
base_size=$(docker image inspect -f '{{.Size}}' "$runtime")
say "built in ${build_s}s; image size $((size / 1048576)) MiB (runtime base $((base_size / 1048576)) MiB)"
docker history --format '{{.Size}}\t{{.CreatedBy}}' "$image" | cut -c1-110 | head -12

# The runtime stage: no compiler, no C/C++ headers.
lean="$(docker run --rm --network=none --entrypoint sh "$image" -c \
  'for c in cc gcc g++ c++ clang clang++ nvcc; do command -v $c; done; ls /usr/include/stdio.h /usr/include/c++ 2>/dev/null; true')"
[ -z "$lean" ] || { echo "[docker-check] FAILED: the runtime image has build tools: $lean" >&2; exit 1; }
say "runtime image: no compiler, no headers"

# ---- run -------------------------------------------------------------------------------------
docker run --rm --network=none "$image" --help >"$work/help.txt"
grep -q -- "--config" "$work/help.txt" || { echo "[docker-check] FAILED: titan-train --help printed no --config" >&2; exit 1; }
say "titan-train --help: $(wc -l <"$work/help.txt") lines"
rm -rf "$work/data" "$work/out" && mkdir -p "$work/data" "$work/out"
cp "$cache/data/kjv.txt" "$cache/data/tokenizer.json" "$work/data/"
run_flags=(--config configs/llama3_debug.toml --training.steps 5 --training.seq_len 64
  --training.local_batch_size 2 --metrics.log_freq 1 --validation.enable false
  --metrics.enable_tensorboard false --training.dataset_path /data/kjv.txt
  --model.tokenizer_path /data/tokenizer.json --checkpoint.enable true --checkpoint.interval 5)
docker run --rm --network=none -e TITAN_CACHE=/out/cache -e OMP_NUM_THREADS=1 \
  -v "$work/data:/data:ro" -v "$work/out:/out" "$image" "${run_flags[@]}" --job.dump_folder /out/single \
  >"$work/train.log" 2>&1 || { tail -20 "$work/train.log"; exit 1; }
[ -f "$work/out/single/checkpoint/step-5/metadata.json" ] ||
  { echo "[docker-check] FAILED: no checkpoint step-5 on the host" >&2; exit 1; }
say "5 steps in the container: $(grep -c '"loss"' "$work/out/single/metrics.jsonl") metric lines, checkpoint on the host: $(ls "$work/out/single/checkpoint/step-5" | tr '\n' ' ')"
docker run --rm --network=host -e TITAN_CACHE=/out/cache -e OMP_NUM_THREADS=1 \
  -v "$work/data:/data:ro" -v "$work/out:/out" --entrypoint torchrun "$image" \
  --nproc_per_node 2 --master_port 29731 --no-python titan-train "${run_flags[@]}" \
  --job.dump_folder /out/torchrun >"$work/torchrun.log" 2>&1 || { tail -30 "$work/torchrun.log"; exit 1; }
[ -f "$work/out/torchrun/checkpoint/step-5/rank-00001.safetensors" ] ||
  { echo "[docker-check] FAILED: the 2-process run left no rank-00001 shard" >&2; exit 1; }
say "torchrun --nproc_per_node 2 in the container: checkpoint with $(ls "$work/out/torchrun/checkpoint/step-5" | grep -c safetensors) shards on the host"
say "passed: build ${build_s}s, image $((size / 1048576)) MiB"
