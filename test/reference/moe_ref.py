#!/usr/bin/env python3
"""Independent PyTorch reference for titan-train's MoE models (llama4, deepseek_v3), written
from the published math (torchtitan's parameter names and conventions; DeepSeek-V2/V3
papers for MLA, YaRN and routing), for numerical parity tests.

The MoE layer here is computed densely: every expert runs on every token and a (T, E) gate
matrix selects and weights the results. That shares no code path (sorting, permutation,
padding, grouped GEMMs) with the C++ implementation it checks.

Inputs (safetensors, written by the C++ test):
  --weights  every parameter under its torchtitan name (and optionally layers.<l>.moe.expert_bias)
  --batch    "tokens" and "labels" (B, T) int64; metadata "config" holds the model args as JSON
Output (--out, safetensors):
  "logits", "loss", "grad.<name>" for every parameter, "aux_loss" when seq_aux_loss_coeff > 0
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file


# ---- RoPE ------------------------------------------------------------------------------------
def llama_rope(head_dim, max_len, theta, factor, low, high, orig):
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
    return torch.polar(torch.ones(max_len, head_dim // 2), torch.outer(t, freqs))


def yarn_rope(a):
    # DeepSeek's precompute_freqs_cis (YaRN when max_seq_len > original_seq_len).
    dim, base, factor = a["qk_rope_head_dim"], a["rope_theta"], a["rope_factor"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if a["max_seq_len"] > a["original_seq_len"]:
        def corr(rot):
            return dim * math.log(a["original_seq_len"] / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(a["beta_fast"])), 0)
        high = min(math.ceil(corr(a["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    t = torch.arange(a["max_seq_len"])
    return torch.polar(torch.ones(a["max_seq_len"], dim // 2), torch.outer(t, freqs).float())


def apply_rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    fc = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(xc * fc).flatten(3).type_as(x)


def attention(q, k, v, scale):
    # Explicit causal softmax attention; q, k: (B, T, H, Dqk), v: (B, T, H, Dv).
    B, T, H, _ = q.shape
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, -1)


def swiglu(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


# ---- MoE, computed densely ---------------------------------------------------------------------
def moe(p, pre, x3, m):
    B, S, D = x3.shape
    x = x3.reshape(-1, D)
    E, K = m["num_experts"], m["top_k"]
    logits = x @ p[pre + "router.gate.weight"].T
    if pre + "router.gate.bias" in p:
        logits = logits + p[pre + "router.gate.bias"]
    scores = torch.sigmoid(logits.float()) if m["score_func"] == "sigmoid" else logits.float().softmax(-1)
    choice = scores.detach().clone()
    if pre + "expert_bias" in p:
        choice = choice + p[pre + "expert_bias"]
    G = m["num_expert_groups"]
    if G:
        grouped = choice.view(-1, G, E // G)
        gscore = grouped.topk(2, dim=-1).values.sum(-1)
        keep = gscore.topk(m["num_limited_groups"], dim=-1).indices
        mask = torch.ones_like(gscore, dtype=torch.bool).scatter(1, keep, False)
        choice = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(-1, E)
    idx = choice.topk(K, dim=-1).indices                      # (T, K)
    top = scores.gather(1, idx)
    if m["route_norm"]:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    top = top * m["route_scale"]
    chosen = torch.zeros(x.shape[0], E, dtype=torch.bool).scatter(1, idx, True)   # (T, E)
    gate = torch.zeros(x.shape[0], E).scatter(1, idx, top)                          # (T, E)
    w1, w2, w3 = (p[pre + "experts." + n] for n in ("w1", "w2", "w3"))
    out = torch.zeros_like(x)
    for e in range(E):
        if m["score_before_experts"]:
            y = swiglu(x * gate[:, e : e + 1], w1[e], w2[e], w3[e])
            out = out + torch.where(chosen[:, e : e + 1], y, torch.zeros_like(y))
        else:
            out = out + gate[:, e : e + 1] * swiglu(x, w1[e], w2[e], w3[e])
    if pre + "shared_experts.w1.weight" in p:
        out = out + swiglu(x, *(p[pre + "shared_experts." + n + ".weight"] for n in ("w1", "w2", "w3")))
    aux = None
    if m.get("seq_aux_loss_coeff", 0) > 0:
        s = scores.view(B, S, E)
        P = (s / s.sum(-1, keepdim=True)).mean(1)                                   # (B, E)
        f = chosen.view(B, S, E).float().sum(1) * E / (K * S)                        # (B, E)
        aux = m["seq_aux_loss_coeff"] * (f * P).sum(-1).mean()
    return out.view(B, S, D), aux


# ---- models ------------------------------------------------------------------------------------
def llama4(p, a, tokens):
    B, T = tokens.shape
    H, Hkv, D = a["n_heads"], a["n_kv_heads"], a["dim"]
    hd = D // H
    fc = llama_rope(hd, a["max_seq_len"], a["rope_theta"], a["rope_factor"], a["rope_low_freq_factor"],
                    a["rope_high_freq_factor"], a["rope_original_max_seq_len"])
    h = F.embedding(tokens, p["tok_embeddings.weight"])
    auxes = []
    for l in range(a["n_layers"]):
        pre = f"layers.{l}."
        x = F.rms_norm(h, (D,), p[pre + "attention_norm.weight"], a["norm_eps"])
        q = (x @ p[pre + "attention.wq.weight"].T).view(B, T, H, hd)
        k = (x @ p[pre + "attention.wk.weight"].T).view(B, T, Hkv, hd)
        v = (x @ p[pre + "attention.wv.weight"].T).view(B, T, Hkv, hd)
        q, k = apply_rope(q, fc), apply_rope(k, fc)
        k, v = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
        h = h + attention(q, k, v, 1 / math.sqrt(hd)) @ p[pre + "attention.wo.weight"].T
        x = F.rms_norm(h, (D,), p[pre + "ffn_norm.weight"], a["norm_eps"])
        if (l + 1) % a["interleave_moe_layer_step"] == 0:
            y, aux = moe(p, pre + "moe.", x, a["moe"])
            auxes.append(aux)
            h = h + y
        else:
            h = h + swiglu(x, *(p[pre + "feed_forward." + n + ".weight"] for n in ("w1", "w2", "w3")))
    h = F.rms_norm(h, (D,), p["norm.weight"], a["norm_eps"])
    return h @ p["output.weight"].T, auxes


def deepseek_v3(p, a, tokens):
    B, T = tokens.shape
    H, D = a["n_heads"], a["dim"]
    nope, rope, vd = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
    fc = yarn_rope(a)
    scale = (nope + rope) ** -0.5
    if a["max_seq_len"] > a["original_seq_len"]:
        ms = 0.1 * a["mscale"] * math.log(a["rope_factor"]) + 1.0
        scale = scale * ms * ms
    h = F.embedding(tokens, p["tok_embeddings.weight"])
    auxes = []
    for l in range(a["n_layers"]):
        pre = f"layers.{l}."
        at = pre + "attention."
        x = F.rms_norm(h, (D,), p[pre + "attention_norm.weight"], a["norm_eps"])
        if a["q_lora_rank"] == 0:
            q = x @ p[at + "wq.weight"].T
        else:
            qa = F.rms_norm(x @ p[at + "wq_a.weight"].T, (a["q_lora_rank"],), p[at + "q_norm.weight"],
                            a["norm_eps"])
            q = qa @ p[at + "wq_b.weight"].T
        q = q.view(B, T, H, nope + rope)
        q = torch.cat([q[..., :nope], apply_rope(q[..., nope:], fc)], -1)
        kv = x @ p[at + "wkv_a.weight"].T
        c, k_pe = kv[..., : a["kv_lora_rank"]], kv[..., a["kv_lora_rank"]:]
        k_pe = apply_rope(k_pe.unsqueeze(2), fc)
        kv = (F.rms_norm(c, (a["kv_lora_rank"],), p[at + "kv_norm.weight"], a["norm_eps"])
              @ p[at + "wkv_b.weight"].T).view(B, T, H, nope + vd)
        k = torch.cat([kv[..., :nope], k_pe.expand(B, T, H, rope)], -1)
        v = kv[..., nope:]
        h = h + attention(q, k, v, scale) @ p[at + "wo.weight"].T
        x = F.rms_norm(h, (D,), p[pre + "ffn_norm.weight"], a["norm_eps"])
        if l >= a["n_dense_layers"]:
            y, aux = moe(p, pre + "moe.", x, a["moe"])
            auxes.append(aux)
            h = h + y
        else:
            h = h + swiglu(x, *(p[pre + "feed_forward." + n + ".weight"] for n in ("w1", "w2", "w3")))
    h = F.rms_norm(h, (D,), p["norm.weight"], torch.finfo(torch.float32).eps)
    return h @ p["output.weight"].T, auxes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with safe_open(args.batch, "pt") as f:
        a = json.loads(f.metadata()["config"])
    batch = load_file(args.batch)
    p = {k: v.clone().requires_grad_(not k.endswith("expert_bias")) for k, v in load_file(args.weights).items()}
    fn = llama4 if a["model"] == "llama4" else deepseek_v3
    logits, auxes = fn(p, a, batch["tokens"])
    labels = batch["labels"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           reduction="sum") / labels.numel()
    auxes = [x for x in auxes if x is not None]
    objective = loss + sum(auxes) if auxes else loss
    objective.backward()
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    if auxes:
        out["aux_loss"] = sum(auxes).detach().reshape(1)
    for n, t in p.items():
        if t.requires_grad:
            out["grad." + n] = t.grad.detach().clone().contiguous()
    save_file(out, args.out)


if __name__ == "__main__":
    main()
