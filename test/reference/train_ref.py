#!/usr/bin/env python3
"""Eager PyTorch training of the same architectures, for scripts/bench_cpu.sh (CPU) and
scripts/gpu_check.sh (--device cuda: bf16 autocast over fp32 parameters, as titan-train keeps
fp32 masters; --ac full checkpoints every block with torch.utils.checkpoint).

Llama-3 (and a Llama-4-style MoE) with nn.Parameters, F.scaled_dot_product_attention
(enable_gqa), F.rms_norm, a sparse per-expert MoE loop and fused AdamW: what a careful eager
PyTorch trainer (torchtitan without compile) does on CPU. Random tokens, like the titan side
(test/app/test_train_bench.cpp). Prints one JSON line: per-step tokens/s, the peak RSS before
the first step and at the end (ru_maxrss, KiB).
"""
import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

from llama3_ref import apply_rope, rope_tables  # noqa: E402


def ffn_hidden(dim, multiple_of=256, multiplier=None):
    h = int(2 * 4 * dim / 3)
    if multiplier:
        h = int(multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def lin(i, o):
    return torch.nn.Linear(i, o, bias=False)


class MoE(torch.nn.Module):
    """Llama-4 debugmodel's MoE: sigmoid top-k router with scores applied before the experts,
    one shared expert; tokens sorted by expert, one GEMM chain per expert (host counts)."""

    def __init__(self, dim, hidden, experts, top_k):
        super().__init__()
        self.E, self.K = experts, top_k
        self.gate = lin(dim, experts)
        self.w1 = torch.nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(experts, dim, hidden) * 0.02)
        self.w3 = torch.nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)
        self.s1, self.s2, self.s3 = lin(dim, hidden), lin(hidden, dim), lin(dim, hidden)

    def forward(self, x3):
        B, S, D = x3.shape
        x = x3.reshape(-1, D)
        scores = torch.sigmoid(self.gate(x).float())
        top, idx = scores.topk(self.K, dim=-1)                     # (T, K)
        order = idx.reshape(-1).argsort(stable=True)
        counts = torch.bincount(idx.reshape(-1), minlength=self.E).tolist()  # host sync
        tok = order // self.K
        xs = (x[tok].float() * top.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
        ys = []
        for e, part in enumerate(xs.split(counts)):
            ys.append((F.silu(part @ self.w1[e].T) * (part @ self.w3[e].T)) @ self.w2[e].T)
        out = torch.zeros_like(x).index_add(0, tok, torch.cat(ys))
        out = out + self.s2(F.silu(self.s1(x)) * self.s3(x))
        return out.view(B, S, D)


class Model(torch.nn.Module):
    def __init__(self, dim, n_layers, n_heads, n_kv_heads, vocab, experts=0, top_k=1,
                 max_len=8192, multiple_of=256, ffn_multiplier=None, ac=False):
        super().__init__()
        self.h, self.hkv, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.ac = ac
        ffn = ffn_hidden(dim, multiple_of, ffn_multiplier)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList()
        for i in range(n_layers):
            l = torch.nn.Module()
            l.an = torch.nn.RMSNorm(dim, eps=1e-5)
            l.wq = lin(dim, n_heads * self.hd)
            l.wk = lin(dim, n_kv_heads * self.hd)
            l.wv = lin(dim, n_kv_heads * self.hd)
            l.wo = lin(n_heads * self.hd, dim)
            l.fn = torch.nn.RMSNorm(dim, eps=1e-5)
            if experts and (i + 1) % 2 == 0:
                # Llama-4's expert hidden size: int(8 dim / 3) / (top_k + 1 shared), rounded up.
                hidden = -(-(int(2 * 4 * dim / 3) // (top_k + 1)) // 256) * 256
                l.moe = MoE(dim, hidden, experts, top_k)
            else:
                l.w1, l.w2, l.w3 = lin(dim, ffn), lin(ffn, dim), lin(dim, ffn)
            self.layers.append(l)
        self.norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.out = lin(dim, vocab)
        self.register_buffer("freqs_cis", rope_tables(self.hd, max_len, 5e5, 1.0), persistent=False)

    def block(self, l, h):
        B, T, _ = h.shape
        x = l.an(h)
        q = apply_rope(l.wq(x).view(B, T, self.h, self.hd), self.freqs_cis).transpose(1, 2)
        k = apply_rope(l.wk(x).view(B, T, self.hkv, self.hd), self.freqs_cis).transpose(1, 2)
        v = l.wv(x).view(B, T, self.hkv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.hkv != self.h)
        h = h + l.wo(o.transpose(1, 2).reshape(B, T, -1))
        x = l.fn(h)
        return h + (l.moe(x) if hasattr(l, "moe") else l.w2(F.silu(l.w1(x)) * l.w3(x)))

    def forward(self, tok):
        h = self.emb(tok)
        for l in self.layers:
            if self.ac:
                h = torch.utils.checkpoint.checkpoint(self.block, l, h, use_reentrant=False)
            else:
                h = self.block(l, h)
        return self.out(self.norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--n_layers", type=int, default=6)
    ap.add_argument("--n_heads", type=int, default=16)
    ap.add_argument("--n_kv_heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=0, help="0: dense; else MoE every 2nd layer")
    ap.add_argument("--top_k", type=int, default=1)
    ap.add_argument("--multiple_of", type=int, default=256)
    ap.add_argument("--ffn_dim_multiplier", type=float, default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ac", default="none", choices=["none", "full"])
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = Model(args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab,
                  args.experts, args.top_k, max_len=max(2048, args.seq_len),
                  multiple_of=args.multiple_of, ffn_multiplier=args.ffn_dim_multiplier,
                  ac=args.ac == "full").to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    g = torch.Generator().manual_seed(0)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cuda = dev.type == "cuda"
    tps, first = [], None
    for step in range(args.steps):
        t0 = time.time()
        buf = torch.randint(args.vocab, (args.batch, args.seq_len + 1), generator=g).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(buf[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), buf[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if first is None:
            first = time.time()
        tps.append(args.batch * args.seq_len / (time.time() - t0))
    out = {"first_step_unix_ms": first * 1000, "start_unix_ms": T_START * 1000,
           "tps": tps, "threads": torch.get_num_threads(), "rss_before_kib": rss_before,
           "rss_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    if cuda:
        out["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(out))


if __name__ == "__main__":
    main()
