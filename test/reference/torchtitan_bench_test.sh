#!/usr/bin/env bash
# ctest torchtitan_bench_cpu: test/reference/torchtitan_bench.py (the GPU check's torchtitan
# anchor) runs torchtitan 0.2.2's training step on the CPU with only the packages the GPU
# machine has, so the driver cannot rot between the rare GPU sessions.
#
# The GPU machine has torch 2.11 with its dependencies, triton, numpy, safetensors, tokenizers,
# einops and pyarrow, and no tyro, torchdata, datasets or tensorboard. Python runs here with -S
# (no site-packages) on a folder of links to exactly those packages plus torchtitan, so an
# import the GPU machine could not satisfy fails here too.
#
# Three tiny runs, eager (compile takes ~2 minutes of inductor C++ builds on this CPU):
#   llama3 debugmodel with --tie 1, 3 steps: loss falls, finite grad norms, the parameter
#     count drops by the shared 2048 x 256 table, and FLOPs/token equal the formula below;
#   deepseek_v3 debugmodel, 2 layers (1 dense, 1 MoE), full activation checkpointing, 3 steps;
#   llama3 debugmodel with torchtitan's float8 converter (torchao, which gpu_check packs
#     beside torchtitan; emulated on the CPU): the 42 block linears converted, the output not.
# Skips (TITAN_TEST_SKIPPED) where TITAN_PYTHON lacks torch or torchtitan 0.2.2.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${TITAN_PYTHON:-python3}"
want="$(grep '^TORCHTITAN_VERSION=' "$here/../../scripts/versions.env" | cut -d= -f2)"

have=$("$py" -c 'import importlib.metadata as m; print(m.version("torchtitan"))' 2>/dev/null)
if [ "$have" != "$want" ]; then
  echo "TITAN_TEST_SKIPPED: $py has torchtitan '${have:-none}', the anchor is $want (scripts/setup.sh installs it)"
  exit 0
fi
site=$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))') || {
  echo "TITAN_TEST_SKIPPED: $py has no torch"; exit 0; }
tt=$("$py" -c 'import importlib.util as u; print(u.find_spec("torchtitan").submodule_search_locations[0])')

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/site"
# The GPU machine's packages (top-level names, and their dist-info for importlib.metadata).
for n in torch torchgen functorch triton nvidia cuda numpy numpy.libs safetensors tokenizers \
  einops pyarrow pyarrow.libs filelock typing_extensions.py sympy mpmath networkx jinja2 markupsafe \
  fsspec setuptools pkg_resources _distutils_hack; do
  [ -e "$site/$n" ] && ln -s "$site/$n" "$tmp/site/$n"
done
for d in "$site"/*.dist-info; do
  case "$(basename "$d" | tr 'A-Z' 'a-z')" in
    torch-* | triton-* | numpy-* | safetensors-* | tokenizers-* | einops-* | pyarrow-* | \
      filelock-* | typing_extensions-* | sympy-* | mpmath-* | networkx-* | jinja2-* | \
      markupsafe-* | fsspec-* | setuptools-* | torchtitan-*) ln -s "$d" "$tmp/site/" ;;
  esac
done
ln -s "$tt" "$tmp/site/torchtitan"
ao=$("$py" -c 'import importlib.util as u; print(u.find_spec("torchao").submodule_search_locations[0])' 2>/dev/null) || {
  echo "TITAN_TEST_SKIPPED: $py has no torchao (scripts/setup.sh installs it)"; exit 0; }
ln -s "$ao" "$tmp/site/torchao"
for d in "$site"/torchao-*.dist-info; do [ -e "$d" ] && ln -s "$d" "$tmp/site/"; done

run() {
  local name=$1; shift
  PYTHONPATH="$tmp/site" CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 "$py" -S \
    "$here/torchtitan_bench.py" --device cpu --dtype fp32 --steps 3 --warmup 1 "$@" \
    >"$tmp/$name.json" 2>"$tmp/$name.err"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAIL: $name exited $rc"; tail -25 "$tmp/$name.err"; exit 1
  fi
}
run llama3 --model llama3 --flavor debugmodel --seq_len 64 --batch 2 --tie 1 --lr 3e-3
run dsv3 --model deepseek_v3 --flavor debugmodel --n_layers 2 --seq_len 64 --batch 2 --ac full
run llama3_f8 --model llama3 --flavor debugmodel --seq_len 64 --batch 2 --float8 tensorwise

"$py" - "$tmp" "$tmp/site/torchtitan" <<'PY'
import json, math, os, sys
tmp, tt_dir = sys.argv[1], sys.argv[2]
bad = []
def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        bad.append(what)
for name in ("llama3", "dsv3", "llama3_f8"):
    out = json.loads(open(f"{tmp}/{name}.json").read().strip().splitlines()[-1])
    (r,) = out["runs"]
    check(out["torchtitan"] == "0.2.2" and out["torchtitan_path"] == tt_dir,
          f"{name}: torchtitan {out['torchtitan']} imported from the restricted site ({out['torchtitan_path']})")
    check(r["error"] is None, f"{name}: no error ({r['error']})")
    check(len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"] + r["grad_norms"]),
          f"{name}: 3 finite losses and grad norms {r['losses']} {r['grad_norms']}")
    check(len(r["tps"]) == 3 and r["tps_median"] and r["tps_median"] > 0,
          f"{name}: tokens/s per step {r['tps']}, median of the last 2 {r['tps_median']}")
    if name == "llama3_f8":
        lines = open(f"{tmp}/{name}.json").read()
        check("float8: 42 linears converted, recipe tensorwise (emulated)" in lines,
              "llama3_f8: torchtitan's float8 converter swapped the 42 block linears (not the output)")
    elif name == "llama3":
        # torchtitan's dense formula, from the debugmodel's sizes: dim 256, 6 layers, 16 heads,
        # vocab 2048, SwiGLU hidden 768 (8 * 256 / 3 = 682, rounded up to 256).
        dim, L, H, V, F, T = 256, 6, 16, 2048, 768, 64
        per_layer = 4 * dim * dim + 3 * dim * F + 2 * dim
        untied = V * dim + L * per_layer + dim + V * dim
        fpt = 6 * (untied - V * dim) + 6 * L * H * 2 * (dim // H) * T
        check(r["tied_embeddings"] and r["n_params"] == untied - V * dim,
              f"llama3: tied, {r['n_params']} parameters = {untied} - the shared {V} x {dim} table")
        check(r["flops_per_token"] == fpt, f"llama3: FLOPs/token {r['flops_per_token']} = {fpt}")
        check(r["losses"][-1] < r["losses"][0], f"llama3: loss falls {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    else:
        check(r["n_layers"] == 2 and r["grouped_mm"] is False and r["attn_type"] == "sdpa",
              f"dsv3: 2 layers, the CPU's for-loop experts, causal SDPA")
sys.exit(1 if bad else 0)
PY
