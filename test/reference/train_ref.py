#!/usr/bin/env python3
"""Eager PyTorch training of the same Llama-3 architecture, for scripts/bench_cpu.sh.

Same model as llama3_ref.py but with nn.Parameters, F.scaled_dot_product_attention and
fused AdamW: what a careful eager PyTorch trainer (torchtitan without compile) does on CPU.
Prints one JSON line: first_step_unix_ms and per-step tokens/s.
"""
import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llama3_ref import apply_rope, rope_tables  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self, dim=256, n_layers=6, n_heads=16, vocab=2048, ffn=768, max_len=2048):
        super().__init__()
        self.h, self.hd = n_heads, dim // n_heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList()
        for _ in range(n_layers):
            l = torch.nn.Module()
            l.an = torch.nn.RMSNorm(dim, eps=1e-5)
            l.wq = torch.nn.Linear(dim, dim, bias=False)
            l.wk = torch.nn.Linear(dim, dim, bias=False)
            l.wv = torch.nn.Linear(dim, dim, bias=False)
            l.wo = torch.nn.Linear(dim, dim, bias=False)
            l.fn = torch.nn.RMSNorm(dim, eps=1e-5)
            l.w1 = torch.nn.Linear(dim, ffn, bias=False)
            l.w2 = torch.nn.Linear(ffn, dim, bias=False)
            l.w3 = torch.nn.Linear(dim, ffn, bias=False)
            self.layers.append(l)
        self.norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", rope_tables(self.hd, max_len, 5e5, 1.0), persistent=False)

    def forward(self, tok):
        B, T = tok.shape
        h = self.emb(tok)
        for l in self.layers:
            x = l.an(h)
            q = apply_rope(l.wq(x).view(B, T, self.h, self.hd), self.freqs_cis).transpose(1, 2)
            k = apply_rope(l.wk(x).view(B, T, self.h, self.hd), self.freqs_cis).transpose(1, 2)
            v = l.wv(x).view(B, T, self.h, self.hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + l.wo(o.transpose(1, 2).reshape(B, T, -1))
            x = l.fn(h)
            h = h + l.w2(F.silu(l.w1(x)) * l.w3(x))
        return self.out(self.norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    g = torch.Generator().manual_seed(0)
    tps, first = [], None
    for step in range(args.steps):
        t0 = time.time()
        buf = torch.randint(2048, (args.batch, args.seq_len + 1), generator=g)
        logits = model(buf[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 2048).float(), buf[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if first is None:
            first = time.time()
        tps.append(args.batch * args.seq_len / (time.time() - t0))
    print(json.dumps({"first_step_unix_ms": first * 1000, "start_unix_ms": T_START * 1000,
                      "tps": tps, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
