#!/usr/bin/env bash
# Idempotent set-up: Debian build packages, LibTorch (torch wheel) in a cached venv,
# the bundled corpus and its tokenizer. A second run takes seconds.
#
# Honours, in this order:
#   LIBTORCH=/path/to/libtorch        a libtorch folder (share/cmake/Torch inside)
#   Torch_DIR=/path/to/share/cmake/Torch
#   TITAN_CACHE (default ~/.cache/titan-train): where the venv and data live.
# Prints KEY=VALUE lines to $TITAN_CACHE/env.sh for the other scripts.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/versions.env"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
venv="$cache/venv"
mkdir -p "$cache"
say() { echo "[setup] $*"; }

# ---- Debian packages -------------------------------------------------------------------
missing=()
for p in $DEBIAN_BUILD_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
else
  say "Debian packages: all present"
fi

# ---- LibTorch --------------------------------------------------------------------------
py="$venv/bin/python"
if [ -n "${LIBTORCH:-}" ]; then
  torch_dir="$LIBTORCH/share/cmake/Torch"
  [ -f "$torch_dir/TorchConfig.cmake" ] || { echo "[setup] LIBTORCH=$LIBTORCH has no share/cmake/Torch/TorchConfig.cmake" >&2; exit 2; }
  say "using LibTorch from LIBTORCH=$LIBTORCH"
elif [ -n "${Torch_DIR:-}" ]; then
  torch_dir="$Torch_DIR"
  [ -f "$torch_dir/TorchConfig.cmake" ] || { echo "[setup] Torch_DIR=$Torch_DIR has no TorchConfig.cmake" >&2; exit 2; }
  say "using LibTorch from Torch_DIR=$Torch_DIR"
else
  torch_dir=""
fi

# The venv is needed even with a user LibTorch: the Python reference tests and the
# tokenizer trainer use it.
want="torch==$TORCH_VERSION tokenizers==$TOKENIZERS_VERSION safetensors==$SAFETENSORS_VERSION numpy==$NUMPY_VERSION tensorboard==$TENSORBOARD_VERSION transformers==$TRANSFORMERS_VERSION pyarrow==$PYARROW_VERSION zstandard==$ZSTANDARD_VERSION"
# Reference code and the CUTLASS headers only: without dependencies, so they never move the
# pinned torch.
want_nodeps="torchtitan==$TORCHTITAN_VERSION megatron-core==$MEGATRON_CORE_VERSION nvidia-cutlass==$CUTLASS_VERSION"
stamp="$venv/.titan-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want $want_nodeps" ]; then
  say "venv $venv: up to date ($want $want_nodeps)"
else
  [ -x "$py" ] || { say "creating venv $venv"; python3 -m venv "$venv"; }
  say "installing into $venv: $want (torch is ~2.7 GB the first time)"
  "$venv/bin/pip" install -q --progress-bar off $want
  say "installing into $venv without dependencies: $want_nodeps"
  "$venv/bin/pip" install -q --progress-bar off --no-deps $want_nodeps
  echo "$want $want_nodeps" >"$stamp"
fi
if [ -z "$torch_dir" ]; then
  torch_dir="$("$py" -c 'import torch,os;print(os.path.join(torch.utils.cmake_prefix_path,"Torch"))')"
  say "using LibTorch from the torch $TORCH_VERSION wheel: $torch_dir"
fi

# ---- Corpus and tokenizer ----------------------------------------------------------------
data="$cache/data"
mkdir -p "$data"
corpus="$data/kjv.txt"
if [ ! -s "$corpus" ]; then
  say "extracting the King James Bible (Debian bible-kjv) to $corpus"
  "$py" "$here/make_corpus.py" --out "$corpus.tmp"
  mv "$corpus.tmp" "$corpus"
else
  say "corpus: $corpus ($(stat -c %s "$corpus") bytes)"
fi
tok="$data/tokenizer.json"
if [ ! -s "$tok" ]; then
  say "training a 2048-token byte-level BPE tokenizer on the corpus"
  "$py" "$here/train_tokenizer.py" --corpus "$corpus" --vocab 2048 --out "$tok.tmp"
  mv "$tok.tmp" "$tok"
else
  say "tokenizer: $tok"
fi

cat >"$cache/env.sh.tmp" <<ENV
TITAN_CACHE="$cache"
TITAN_VENV="$venv"
TITAN_PYTHON="$py"
TITAN_TORCH_DIR="$torch_dir"
TITAN_CORPUS="$corpus"
TITAN_TOKENIZER="$tok"
ENV
mv "$cache/env.sh.tmp" "$cache/env.sh"
say "wrote $cache/env.sh"
