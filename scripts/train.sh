#!/usr/bin/env bash
# Set up if needed, build, and train the default model (Llama-3 debugmodel) on the bundled
# King James Bible corpus. Extra arguments are passed on, e.g. --training.steps 50.
# Only what training needs: the set-up skips the test-only packages (TITAN_SETUP_MODE=train)
# and the build makes the titan-train binary alone; scripts/test.sh adds the rest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TITAN_SETUP_MODE="${TITAN_SETUP_MODE:-train}" TITAN_NINJA_ARGS="${TITAN_NINJA_ARGS:-titan-train}" \
  "$root/scripts/build.sh"
cd "$root"
exec "$root/build/titan-train" --config "${CONFIG:-configs/llama3_debug.toml}" "$@"
