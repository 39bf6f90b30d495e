#!/usr/bin/env bash
# The pip requirements the Dockerfile installs, with scripts/versions.env's versions filled
# in: one line each, "deps NAME==VERSION" or "nodeps NAME==VERSION" (pip install --no-deps).
# scripts/docker_check.sh builds its local wheelhouse from this list, so a pin added to the
# Dockerfile reaches the wheelhouse by itself; test/app/test_packaging.cpp checks that every
# NAME==$VAR of the Dockerfile is here, without building the image. TITAN_DOCKERFILE reads
# another file (the test's).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/versions.env"
declare -A seen=()
while IFS= read -r line; do
  case "$line" in *"pip install"*) ;; *) continue ;; esac
  kind=deps
  case "$line" in *--no-deps*) kind=nodeps ;; esac
  for word in $line; do
    [[ "$word" =~ ^([A-Za-z0-9_.-]+)==\$\{?([A-Z_][A-Z0-9_]*)\}?$ ]] || continue
    var="${BASH_REMATCH[2]}"
    [ -n "${!var:-}" ] || { echo "docker_wheels.sh: \$$var is not in scripts/versions.env" >&2; exit 2; }
    req="$kind ${BASH_REMATCH[1]}==${!var}"
    [ -n "${seen[$req]:-}" ] || { seen[$req]=1; echo "$req"; }
  done
done <"${TITAN_DOCKERFILE:-$root/Dockerfile}"
