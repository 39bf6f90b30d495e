#!/usr/bin/env bash
# Idempotent set-up: Debian build packages, LibTorch (torch wheel) in a cached venv,
# the bundled corpus and its tokenizer. A second run takes seconds.
#
# Honours, in this order:
#   LIBTORCH=/path/to/libtorch        a libtorch folder (share/cmake/Torch inside)
#   Torch_DIR=/path/to/share/cmake/Torch
#   TITAN_CACHE (default ~/.cache/titan-train): where the venv and data live.
#   TITAN_SETUP_MODE=train: only what building and training need (scripts/train.sh); the
#     default, all, adds the test-only Debian packages and Python references (scripts/test.sh).
#   TITAN_SETUP_DRY_RUN=1: print what each mode would install and change nothing.
# Prints KEY=VALUE lines to $TITAN_CACHE/env.sh for the other scripts.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/versions.env"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
venv="$cache/venv"
mkdir -p "$cache"
say() { echo "[setup] $*"; }

mode="${TITAN_SETUP_MODE:-all}"
case "$mode" in train | all) ;; *) echo "[setup] TITAN_SETUP_MODE=$mode; allowed: train, all" >&2; exit 2 ;; esac
debian="$DEBIAN_BUILD_PACKAGES"
# Training needs LibTorch (torch), the tokenizer trainer (tokenizers), the Arrow/Parquet C++
# libraries the build links (pyarrow) and the CUTLASS headers of the CUDA build; the rest is
# for the reference tests.
want="torch==$TORCH_VERSION tokenizers==$TOKENIZERS_VERSION pyarrow==$PYARROW_VERSION"
want_nodeps="nvidia-cutlass==$CUTLASS_VERSION"
if [ "$mode" = all ]; then
  debian="$debian ${DEBIAN_TEST_PACKAGES:-}"
  want="$want safetensors==$SAFETENSORS_VERSION numpy==$NUMPY_VERSION tensorboard==$TENSORBOARD_VERSION transformers==$TRANSFORMERS_VERSION zstandard==$ZSTANDARD_VERSION"
  # Reference code, without dependencies so they never move the pinned torch.
  want_nodeps="$want_nodeps torchtitan==$TORCHTITAN_VERSION megatron-core==$MEGATRON_CORE_VERSION torchao==$TORCHAO_VERSION"
fi
if [ -n "${TITAN_SETUP_DRY_RUN:-}" ]; then
  echo "mode: $mode"
  echo "debian: $debian"
  echo "pip: $want"
  echo "pip --no-deps: $want_nodeps"
  exit 0
fi

# ---- Debian packages -------------------------------------------------------------------
missing=()
for p in $debian; do
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
# The stamp lists what is installed; a train set-up is also satisfied by a full one.
stamp="$venv/.titan-stamp"
have=" $(cat "$stamp" 2>/dev/null || true) "
satisfied=1
for w in $want $want_nodeps; do [[ "$have" == *" $w "* ]] || satisfied=0; done
if [ "$satisfied" = 1 ]; then
  say "venv $venv: up to date ($want $want_nodeps)"
else
  [ -x "$py" ] || { say "creating venv $venv"; python3 -m venv "$venv"; }
  say "installing into $venv: $want (torch is ~2.7 GB the first time)"
  "$venv/bin/pip" install -q --progress-bar off $want
  say "installing into $venv without dependencies: $want_nodeps"
  "$venv/bin/pip" install -q --progress-bar off --no-deps $want_nodeps
  # What was there and what was added: a full set-up after a train one keeps both listed.
  echo "$(echo $have $want $want_nodeps | tr ' ' '\n' | sort -u | tr '\n' ' ')" >"$stamp"
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
