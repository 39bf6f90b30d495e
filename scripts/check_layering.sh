#!/usr/bin/env bash
# The layers point one way: app -> models, parallel -> moe -> core (docs/design.md). Fails,
# naming the file and the include, when a product source includes a layer it may not see.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# folder: the folders its sources may include from
declare -A allowed=(
  [core]="core"
  [moe]="core moe"
  [models]="core moe models"
  [parallel]="core parallel"
  [app]="core moe models parallel app"
)
bad=0
for layer in "${!allowed[@]}"; do
  [ -d "$layer" ] || continue
  while IFS= read -r hit; do
    file=${hit%%:*}
    inc=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<<"${hit#*:}")
    top=${inc%%/*}
    [ "$top" = "$inc" ] && continue  # same-folder or system-style include without a folder
    case " ${allowed[$layer]} " in
      *" $top "*) ;;
      *) echo "layering: $file includes \"$inc\": $layer/ may include only: ${allowed[$layer]}"
         bad=1 ;;
    esac
  done < <(grep -rHE '^\s*#\s*include\s+"[a-z_]+/' "$layer" --include='*.h' --include='*.cpp' --include='*.cu' --include='*.cuh' || true)
done
[ $bad -eq 0 ] && echo "layering: app -> models, parallel -> moe -> core holds for every include"
exit $bad
