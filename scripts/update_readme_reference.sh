#!/usr/bin/env bash
# Regenerate the configuration reference in README.md from the option registry.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ref="$("$root/build/titan-train" --print-config-reference)"
python3 - "$root/README.md" "$ref" <<'PY'
import sys
path, ref = sys.argv[1], sys.argv[2] + "\n"
text = open(path).read()
b, e = "<!-- config-reference:begin -->\n", "<!-- config-reference:end -->"
i, j = text.index(b) + len(b), text.index(e)
open(path + ".tmp", "w").write(text[:i] + ref + text[j:])
import os; os.replace(path + ".tmp", path)
PY
echo "README.md reference updated"
