#!/usr/bin/env python3
"""Independent PyTorch reference for titan-train's Llama-3, written from the published
architecture (torchtitan's llama3 layout and parameter names), for numerical parity tests.

Inputs (safetensors, written by the C++ test):
  --weights  every parameter under its torchtitan name
  --batch    "tokens_<i>" and "labels_<i>" (B, T) int64 for optimizer steps i = 0..steps-1;
             metadata holds the model and optimizer hyper-parameters as strings
Output (--out, safetensors):
  "logits"            logits of batch 0 before any update
  "loss"              per-step losses, (steps,)
  "grad.<name>"       gradients of batch 0's loss before any update (pre-clipping)
  "grad_norm"         per-step global gradient norms before clipping
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def rope_tables(head_dim, max_len, theta, factor, low=1.0, high=4.0, orig=8192):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    if factor != 1.0:
        low_wl, high_wl = orig / low, orig / high
        out = []
        for f in freqs.double().tolist():
            wl = 2 * math.pi / f
            if wl < high_wl:
                out.append(f)
            elif wl > low_wl:
                out.append(f / factor)
            else:
                s = (orig / wl - low) / (high - low)
                out.append((1 - s) * f / factor + s * f)
        freqs = torch.tensor(out, dtype=torch.float64).float()
    t = torch.arange(max_len, dtype=torch.float32)
    return torch.polar(torch.ones(max_len, head_dim // 2), torch.outer(t, freqs))  # complex64


def apply_rope(x, freqs_cis):
    # x: (B, T, H, D); adjacent pairs are complex numbers.
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    fc = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(xc * fc).flatten(3).type_as(x)


class Llama3Ref(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        hd = a["dim"] // a["n_heads"]
        self.register_buffer("freqs_cis", rope_tables(
            hd, a["max_seq_len"], a["rope_theta"], a["rope_factor"], a["rope_low_freq_factor"],
            a["rope_high_freq_factor"], a["rope_original_max_seq_len"]), persistent=False)

    def forward(self, p, tokens):
        a = self.a
        B, T = tokens.shape
        H, Hkv, D = a["n_heads"], a["n_kv_heads"], a["dim"]
        hd = D // H
        h = F.embedding(tokens, p["tok_embeddings.weight"])
        for l in range(a["n_layers"]):
            pre = f"layers.{l}."
            x = F.rms_norm(h, (D,), p[pre + "attention_norm.weight"], a["norm_eps"])
            q = (x @ p[pre + "attention.wq.weight"].T).view(B, T, H, hd)
            k = (x @ p[pre + "attention.wk.weight"].T).view(B, T, Hkv, hd)
            v = (x @ p[pre + "attention.wv.weight"].T).view(B, T, Hkv, hd)
            q, k = apply_rope(q, self.freqs_cis), apply_rope(k, self.freqs_cis)
            k = k.repeat_interleave(H // Hkv, dim=2)
            v = v.repeat_interleave(H // Hkv, dim=2)
            # Explicit softmax attention, not SDPA, to stay independent of the C++ path.
            s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
            s = s.masked_fill(mask, float("-inf"))
            o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, H * hd)
            h = h + o @ p[pre + "attention.wo.weight"].T
            x = F.rms_norm(h, (D,), p[pre + "ffn_norm.weight"], a["norm_eps"])
            ff = F.silu(x @ p[pre + "feed_forward.w1.weight"].T) * (x @ p[pre + "feed_forward.w3.weight"].T)
            h = h + ff @ p[pre + "feed_forward.w2.weight"].T
        h = F.rms_norm(h, (D,), p["norm.weight"], a["norm_eps"])
        out = p.get("output.weight", p["tok_embeddings.weight"])
        return h @ out.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    with safe_open(args.batch, "pt") as f:
        meta = json.loads(f.metadata()["config"])
    batch = load_file(args.batch)
    params = {k: v.clone().requires_grad_(True) for k, v in load_file(args.weights).items()}
    model = Llama3Ref(meta)
    decay = [p for n, p in params.items() if p.dim() == 2 and n != "tok_embeddings.weight"]
    no_decay = [p for n, p in params.items() if not (p.dim() == 2 and n != "tok_embeddings.weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": meta["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=meta["lr"], betas=(meta["beta1"], meta["beta2"]), eps=meta["eps"], foreach=False)
    out = {}
    losses, norms = [], []
    for step in range(meta["steps"]):
        tokens, labels = batch[f"tokens_{step}"], batch[f"labels_{step}"]
        logits = model(params, tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               reduction="sum") / labels.numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().contiguous()
            for n, p in params.items():
                out["grad." + n] = p.grad.detach().clone().contiguous()
        norms.append(torch.nn.utils.clip_grad_norm_(list(params.values()), meta["max_norm"]).item())
        losses.append(loss.item())
        opt.step()
    out["loss"] = torch.tensor(losses, dtype=torch.float64)
    out["grad_norm"] = torch.tensor(norms, dtype=torch.float64)
    save_file(out, args.out)


if __name__ == "__main__":
    main()
