#!/usr/bin/env bash
# Set up if needed, build, and train the default model (Llama-3 debugmodel) on the bundled
# King James Bible corpus. Extra arguments are passed on, e.g. --training.steps 50.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
cd "$root"
exec "$root/build/titan-train" --config "${CONFIG:-configs/llama3_debug.toml}" "$@"
