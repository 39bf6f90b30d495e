#!/usr/bin/env python3
"""torchao 0.18's Float8Linear on fixed inputs: the reference of titan-train's float8 linear
(core/kernels/float8_linear.*, test/core/kernels/test_float8_linear.cpp).

torchao is installed test-only and without its dependencies (scripts/setup.sh); only its
torchao.float8 training code runs, on the CPU.

Inputs (--inputs, safetensors written by the C++ test): for each dtype tag D in --dtypes,
  "x.D" (B, T, K), "w.D" (N, K) and "go.D" (B, T, N): the input, the weight and the gradient
  of the output, in that dtype.
Cases (--cases): "recipe:mode" with recipe tensorwise | rowwise | rowwise_with_gw_hp and mode
  "scaled_mm" (torchao's emulate = False: torch._scaled_mm, on the CPU per-tensor scales only)
  or "emulated" (emulate = True: dequantize and matmul in fp32).
Output (--out, safetensors): for each dtype D and case R:M, "D.R.M.out", "D.R.M.grad_x",
  "D.R.M.grad_w": Float8Linear(x) (no bias), then backward of (out * go).sum().
Exits 3, printing why, when torchao 0.18 cannot be imported.
"""
import argparse
import dataclasses

import torch
from safetensors.torch import load_file, save_file
from torchao_version import require_torchao


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--cases", required=True)
    a = ap.parse_args()
    require_torchao()
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    t = load_file(a.inputs)
    out = {}
    for tag in a.dtypes.split(","):
        dt = dtypes[tag]
        x0, w0, go = t[f"x.{tag}"], t[f"w.{tag}"], t[f"go.{tag}"]
        assert x0.dtype == dt and w0.dtype == dt and go.dtype == dt
        for case in a.cases.split(","):
            recipe, mode = case.split(":")
            assert mode in ("scaled_mm", "emulated"), mode
            cfg = Float8LinearConfig.from_recipe_name(recipe)
            cfg = dataclasses.replace(cfg, emulate=(mode == "emulated"))
            lin = torch.nn.Linear(w0.shape[1], w0.shape[0], bias=False, dtype=dt)
            with torch.no_grad():
                lin.weight.copy_(w0)
            f8 = Float8Linear.from_float(lin, config=cfg)
            x = x0.clone().requires_grad_(True)
            y = f8(x)
            y.backward(go)
            key = f"{tag}.{recipe}.{mode}"
            out[f"{key}.out"] = y.detach().contiguous()
            out[f"{key}.grad_x"] = x.grad.contiguous()
            out[f"{key}.grad_w"] = f8.weight.grad.contiguous()
    save_file(out, a.out)


if __name__ == "__main__":
    main()
