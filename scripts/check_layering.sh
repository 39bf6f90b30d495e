#!/usr/bin/env bash
# The layers point one way (docs/design.md): app -> models, parallel -> moe -> core, and inside
# core/ its concept folders point one way too. Fails, naming the file and the include, when a
# product source includes a folder it may not see.
#
#   scripts/check_layering.sh [ROOT]      check the tree at ROOT (default: this checkout)
#   scripts/check_layering.sh --self-test plant an upward include in a copy of the tree, once
#                                         between layers and once between core's folders, and
#                                         check that each is caught
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [ "${1:-}" = "--self-test" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$here/.." && tar cf - app core models moe parallel) | tar xf - -C "$tmp"
  bash "$here/check_layering.sh" "$tmp" >/dev/null || { echo "self-test: the clean tree fails"; exit 1; }
  fail=0
  plant() {  # file, include: the check must fail and name both
    cp "$tmp/$1" "$tmp/$1.orig"
    printf '#include "%s"\n' "$2" >>"$tmp/$1"
    if out=$(bash "$here/check_layering.sh" "$tmp"); then
      echo "self-test: planted $2 in $1 was not caught"; fail=1
    elif ! grep -q "$1 includes \"$2\"" <<<"$out"; then
      echo "self-test: planted $2 in $1 caught without naming it: $out"; fail=1
    else
      echo "self-test: caught: $(head -1 <<<"$out")"
    fi
    mv "$tmp/$1.orig" "$tmp/$1"
  }
  plant core/base/log.h core/train/model.h          # base may include nothing of core
  plant core/kernels/ops.h core/data/loader.h        # sideways between core's folders
  plant core/train/model.h moe/router.h              # core below moe
  plant moe/router.h parallel/process_group.h        # moe below parallel
  exit $fail
fi

root="${1:-$here/..}"
cd "$root"
# folder: the folders its sources may include from
declare -A allowed=(
  [core]="core"
  [moe]="core moe"
  [models]="core moe models"
  [parallel]="core moe parallel"
  [app]="core moe models parallel app"
)
# core's concept folders: base <- config, tokenizer, checkpoint, kernels <- telemetry, data
# <- train. A folder may include itself and the folders listed.
declare -A core_allowed=(
  [base]="base"
  [config]="base config"
  [tokenizer]="base tokenizer"
  [checkpoint]="base checkpoint"
  [kernels]="base kernels"
  [telemetry]="base config telemetry"
  [data]="base config tokenizer data"
  [train]="base config kernels telemetry train"
)
bad=0
includes() {  # folder -> "file:include" lines for every quoted include with a folder
  grep -rHE '^\s*#\s*include\s+"[a-z_]+/' "$1" --include='*.h' --include='*.cpp' \
    --include='*.cu' --include='*.cuh' | sed -E 's/^([^:]+):.*#\s*include\s+"([^"]+)".*/\1:\2/' || true
}
for layer in "${!allowed[@]}"; do
  [ -d "$layer" ] || continue
  while IFS=: read -r file inc; do
    [ -n "$file" ] || continue
    top=${inc%%/*}
    case " ${allowed[$layer]} " in
      *" $top "*) ;;
      *) echo "layering: $file includes \"$inc\": $layer/ may include only: ${allowed[$layer]}"
         bad=1 ;;
    esac
  done < <(includes "$layer")
done
for f in core/*; do
  [ -f "$f" ] || continue
  case $f in core/pch.h) ;; *) echo "layering: $f sits at core/'s top: put it in a concept folder"; bad=1 ;; esac
done
for dir in core/*/; do
  sub=$(basename "$dir")
  if [ -z "${core_allowed[$sub]+x}" ]; then
    echo "layering: core/$sub/ is not in scripts/check_layering.sh's core order"; bad=1; continue
  fi
  while IFS=: read -r file inc; do
    [ -n "$file" ] || continue
    [ "${inc%%/*}" = core ] || continue
    rest=${inc#core/}
    target=${rest%%/*}
    case " ${core_allowed[$sub]} " in
      *" $target "*) ;;
      *) echo "layering: $file includes \"$inc\": core/$sub/ may include only core/{${core_allowed[$sub]// /,}}"
         bad=1 ;;
    esac
  done < <(includes "$dir")
done
[ $bad -eq 0 ] && echo "layering: app -> models, parallel -> moe -> core holds, and inside core" \
  "base <- config, tokenizer, checkpoint, kernels <- telemetry, data <- train"
exit $bad
