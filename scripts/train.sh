#!/usr/bin/env bash
# Set up if needed, build, and train the default model (Llama-3 debugmodel) on the bundled
# King James Bible corpus, then print a short sample of what it learned (titan-train
# generate from the final checkpoint). Extra arguments are passed on, e.g. --training.steps 50.
# Only what training needs: the set-up skips the test-only packages (TITAN_SETUP_MODE=train)
# and the build makes the titan-train binary alone; scripts/test.sh adds the rest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TITAN_SETUP_MODE="${TITAN_SETUP_MODE:-train}" TITAN_NINJA_ARGS="${TITAN_NINJA_ARGS:-titan-train}" \
  "$root/scripts/build.sh"
cd "$root"
bin="$root/build/titan-train"
config="${CONFIG:-configs/llama3_debug.toml}"
# The final step is saved (the user's arguments come after, so --checkpoint.enable false wins).
"$bin" --config "$config" --checkpoint.enable true "$@"

# Where that checkpoint is: the effective config's job.dump_folder / checkpoint.folder.
dumped="$("$bin" --config "$config" --checkpoint.enable true "$@" --dump-config)"
key() {  # key SECTION NAME: the string value of [SECTION] NAME in the dumped TOML
  awk -v s="[$1]" -v k="$2" '$0 == s {in_s = 1; next} /^\[/ {in_s = 0}
    in_s && $1 == k {sub(/^[^=]*= *["\047]/, ""); sub(/["\047][^"\047]*$/, ""); print; exit}' \
    <<<"$dumped"
}
[[ "$(awk '$0 == "[checkpoint]" {c = 1; next} /^\[/ {c = 0} c && $1 == "enable" {print $3; exit}' \
  <<<"$dumped")" == "true" ]] || exit 0
folder="$(key checkpoint folder)"
[[ "$folder" = /* ]] || folder="$(key job dump_folder)/$folder"
[[ -d "$folder" ]] || exit 0
echo "--- a sample of the trained model (titan-train generate, temperature 0.8, top-k 40):"
"$bin" generate --config "$config" "$@" --checkpoint "$folder" --prompt "In the beginning" \
  --max-new-tokens 40 --temperature 0.8 --top-k 40
