#!/usr/bin/env bash
# Copies the header-only dependencies (and PCRE2) into .deps/ so they can travel to a GPU
# machine that reaches no package registry: run here, then carry ".deps" (see gpu_check.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
d="$root/.deps"
rm -rf "$d"
mkdir -p "$d/include" "$d/lib/cmake" "$d/share/cmake" "$d/lib"
cp -r /usr/include/CLI /usr/include/toml++ /usr/include/nlohmann /usr/include/catch2 "$d/include/"
cp /usr/include/pcre2.h "$d/include/"
cp -r /usr/lib/cmake/Catch2 "$d/lib/cmake/"
cp -r /usr/share/cmake/nlohmann_json "$d/share/cmake/"
cp -L /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0 "$d/lib/"
ln -sf libpcre2-8.so.0 "$d/lib/libpcre2-8.so"
echo "[gpu_carry] $(du -sh "$d" | cut -f1) in $d"
