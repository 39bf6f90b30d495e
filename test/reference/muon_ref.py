#!/usr/bin/env python3
"""torch.optim.Muon + torch.optim.AdamW as the reference for titan-train's Muon step
(core/train/muon.cpp, core/train/optimizer.cpp's Optimizer).

Input (--inputs, safetensors written by the C++ test): "param.<i>" initial values,
"grad.<i>.<s>" the gradient of parameter i at step s, "lr" (steps,) fp64 the schedule's lr
(AdamW's), "muon" (n,) int64 (1: Muon optimizes parameter i), "decay" (n,) int64 (AdamW's
weight-decay group); metadata: beta1, beta2, eps, weight_decay (AdamW), peak_lr, muon_lr,
muon_weight_decay, momentum, nesterov (0/1), a, b, c, ns_steps, muon_eps, adjust_lr_fn, steps.
Output (--out): "param.<i>" after the steps.

torch.optim.Muon takes 2-D parameters only: a 3-D parameter (E, A, B) is given to it as E
separate 2-D parameters (views of one leaf would share a grad; they are separate leaves here
and stacked back at the end), which is what titan-train's per-expert treatment means.
Muon's lr each step is muon_lr * (lr / peak_lr), the schedule's factor applied to its peak.
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
    muon = t["muon"].tolist()
    decay = t["decay"].tolist()
    n = len(muon)
    # Each parameter as a list of leaves: one, or E for a 3-D Muon parameter.
    leaves = []
    for i in range(n):
        p = t[f"param.{i}"].clone()
        if muon[i] and p.dim() == 3:
            leaves.append([torch.nn.Parameter(p[e].clone()) for e in range(p.shape[0])])
        else:
            leaves.append([torch.nn.Parameter(p)])
    muon_params = [q for i in range(n) if muon[i] for q in leaves[i]]
    adamw_groups = [
        {"params": [leaves[i][0] for i in range(n) if not muon[i] and decay[i]],
         "weight_decay": float(meta["weight_decay"])},
        {"params": [leaves[i][0] for i in range(n) if not muon[i] and not decay[i]],
         "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(adamw_groups, lr=1.0,
                              betas=(float(meta["beta1"]), float(meta["beta2"])),
                              eps=float(meta["eps"]))
    muon_opt = torch.optim.Muon(
        muon_params, lr=1.0, weight_decay=float(meta["muon_weight_decay"]),
        momentum=float(meta["momentum"]), nesterov=meta["nesterov"] == "1",
        ns_coefficients=(float(meta["a"]), float(meta["b"]), float(meta["c"])),
        eps=float(meta["muon_eps"]), ns_steps=int(meta["ns_steps"]),
        adjust_lr_fn=meta["adjust_lr_fn"])
    peak, muon_lr = float(meta["peak_lr"]), float(meta["muon_lr"])
    for s in range(steps):
        lr = float(t["lr"][s])
        for g in adamw.param_groups:
            g["lr"] = lr
        for g in muon_opt.param_groups:
            g["lr"] = muon_lr * (lr / peak)
        for i in range(n):
            grad = t[f"grad.{i}.{s}"]
            if len(leaves[i]) == 1:
                leaves[i][0].grad = grad.clone()
            else:
                for e, q in enumerate(leaves[i]):
                    q.grad = grad[e].clone()
        adamw.step()
        muon_opt.step()
    out = {}
    for i in range(n):
        qs = [q.detach() for q in leaves[i]]
        out[f"param.{i}"] = (torch.stack(qs) if len(qs) > 1 else qs[0]).contiguous()
    save_file(out, a.out)


if __name__ == "__main__":
    main()
