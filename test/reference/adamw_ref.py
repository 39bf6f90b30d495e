#!/usr/bin/env python3
"""torch.optim.AdamW as the reference for titan-train's optimizer (core/train/optimizer.cpp).

Input (--inputs, safetensors written by the C++ test): "param.<i>" initial values,
"grad.<i>.<s>" the gradient of parameter i at step s, "lr" (steps,) fp64, "decay" (n,) int64
(1: the parameter is in the weight-decay group); metadata: beta1, beta2, eps, weight_decay,
steps. Output (--out): "param.<i>" after the steps. Two parameter groups as titan-train
makes them; the default (for-each) implementation in fp32.
"""
import argparse

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with safe_open(a.inputs, "pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    steps = int(meta["steps"])
    decay = t["decay"].tolist()
    params = [torch.nn.Parameter(t[f"param.{i}"].clone()) for i in range(len(decay))]
    groups = [
        {"params": [p for p, d in zip(params, decay) if d], "weight_decay": float(meta["weight_decay"])},
        {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1.0, betas=(float(meta["beta1"]), float(meta["beta2"])),
                            eps=float(meta["eps"]))
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = float(t["lr"][s])
        for i, p in enumerate(params):
            p.grad = t[f"grad.{i}.{s}"].clone()
        opt.step()
    save_file({f"param.{i}": p.detach().contiguous() for i, p in enumerate(params)}, a.out)


if __name__ == "__main__":
    main()
