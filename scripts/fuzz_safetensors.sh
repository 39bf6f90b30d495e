#!/usr/bin/env bash
# Builds test/fuzz/fuzz_safetensors.cpp with clang++ and libFuzzer + AddressSanitizer against the
# torch wheel's LibTorch, seeds a corpus with files written by the Python safetensors package,
# and fuzzes the reader for FUZZ_SECONDS (default 30). Exits non-zero when the fuzzer finds a
# crash; the input that caused it is left as <build>/fuzz/crash-*.
#
# Needs clang++ with libFuzzer (Debian: clang, libclang-rt-14-dev). Environment:
#   FUZZ_SECONDS   run time in seconds (default 30)
#   FUZZ_JOBS      parallel fuzzing processes (default 1)
#   CXX_FUZZ       the compiler (default: clang++)
#   TITAN_BUILD_DIR  where build/fuzz goes (default <repo>/build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${TITAN_CACHE:-$HOME/.cache/titan-train}"
[ -f "$cache/env.sh" ] && source "$cache/env.sh"
py="${TITAN_PYTHON:?TITAN_PYTHON is not set: run scripts/setup.sh}"
cxx="${CXX_FUZZ:-clang++}"
command -v "$cxx" >/dev/null || { echo "[fuzz] $cxx not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 2; }
out="${TITAN_BUILD_DIR:-$root/build}/fuzz"
mkdir -p "$out/corpus" "$out/seeds"

torch_root="$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
abi="$("$py" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"

bin="$out/fuzz_safetensors"
srcs=("$root/test/fuzz/fuzz_safetensors.cpp" "$root/core/checkpoint/safetensors.cpp" "$root/core/base/durable_io.cpp")
if [ ! -x "$bin" ] || [ -n "$(find "${srcs[@]}" "$root/core/checkpoint/safetensors.h" "$root/core/base/durable_io.h" -newer "$bin")" ]; then
  echo "[fuzz] building $bin"
  # -lstdc++ comes before LibTorch: the wheel exports copies of some libstdc++ symbols (see
  # CMakeLists.txt). Only our own files are instrumented; LibTorch is not.
  "$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address \
    -DTITAN_FUZZ_TARGET -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -I"$root" -isystem "$torch_root/include" \
    "${srcs[@]}" -o "$bin" \
    -Wl,--no-as-needed -lstdc++ -L"$torch_root/lib" -Wl,-rpath,"$torch_root/lib" -lc10 -ltorch_cpu
fi

# Seeds: valid files of every dtype from the Python package, plus a few hand-made edge cases.
"$py" - "$out/seeds" <<'PY'
import os, struct, sys, torch
from safetensors.torch import save_file
d = sys.argv[1]
save_file({'w': torch.randn(2, 3), 'b': torch.zeros(3, dtype=torch.bfloat16),
           'i': torch.arange(4), 'm': torch.tensor([True, False])}, f'{d}/mixed.safetensors',
          metadata={'format': 'pt'})
for dt in [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]:
    save_file({'t': torch.ones(2, 2, dtype=dt), 's': torch.tensor(1, dtype=dt),
               'e': torch.ones(0, 3, dtype=dt)}, f'{d}/{str(dt)[6:]}.safetensors')
def raw(name, header, data=b''):
    h = header.encode()
    open(f'{d}/{name}', 'wb').write(struct.pack('<Q', len(h)) + h + data)
raw('empty.safetensors', '{}')
raw('meta_null.safetensors', '{"__metadata__": null}')
raw('padded.safetensors', '{"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}    ', b'xyz')
PY
cat >"$out/safetensors.dict" <<'DICT'
"\"dtype\""
"\"shape\""
"\"data_offsets\""
"\"__metadata__\""
"\"F64\""
"\"F32\""
"\"F16\""
"\"BF16\""
"\"I64\""
"\"I32\""
"\"I16\""
"\"I8\""
"\"U8\""
"\"BOOL\""
"9223372036854775807"
"18446744073709551615"
"4294967296"
"-1"
"null"
"{}"
"[]"
DICT

echo "[fuzz] fuzzing for ${FUZZ_SECONDS:-30}s"
cd "$out"
jobs=()
# One process by default: its exit status is the fuzzer's (non-zero on a crash).
[ "${FUZZ_JOBS:-1}" -gt 1 ] && jobs=(-jobs="$FUZZ_JOBS" -workers="$FUZZ_JOBS")
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" "$bin" -max_total_time="${FUZZ_SECONDS:-30}" \
  "${jobs[@]}" -rss_limit_mb=4096 -max_len=65536 \
  -dict="$out/safetensors.dict" -artifact_prefix="$out/" -print_final_stats=1 \
  "$out/corpus" "$out/seeds"
