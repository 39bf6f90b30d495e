#!/usr/bin/env python3
"""Runs torchtitan 0.2.2's own gpt_oss model code (GptOssModel, its attention with sinks and
sliding-window masks, its GptOssMoE with the clamped SwiGLU) on titan-train's weights and
tokens, for test/models/test_gpt_oss.cpp.

Usage: gpt_oss_ref.py WEIGHTS TOKENS OUT
WEIGHTS: safetensors of titan-train's parameter names, with the model args as JSON in the
metadata key "config"; TOKENS: safetensors with "tokens" (B, T) int64.
OUT gets: logits (B, T, V), loss (mean next-token cross-entropy, the last position ignored),
grad/<our name> for every parameter, and two controls computed without grad: logits_no_window
(sliding_window_size larger than T) and logits_no_clamp (swiglu_limit 1e9).

Deviations from a training run of torchtitan, all numerical no-ops or test-only:
- the model runs in fp32 (torchtitan casts its blocks to bf16; the test compares fp32);
- flex_attention has no backward on CPU: the attention core is a dense softmax over the
  BlockMask's own mask_mod (torchtitan's causal and sliding-window mask functions), checked
  against flex_attention's forward (output and log-sum-exp, 1e-5) on the first two calls;
  torchtitan's sink rescaling sigmoid(lse - sinks) runs as it is. create_block_mask runs
  eagerly on the CPU (torchtitan compiles it for CUDA);
- the experts run torchtitan's for-loop path (use_grouped_mm False; grouped_mm is CUDA-only);
- titan-train keeps mlp1 as two tensors w1 (torchtitan's even rows, x_glu) and w3 (the odd
  rows, x_linear); they are interleaved into mlp1_weight / mlp1_bias here.
"""
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_ref import prepare_torchtitan_import  # noqa: E402


def interleave(a, b):
    """(E, H, ...) x2 -> (E, 2H, ...): a on the even rows, b on the odd rows."""
    return torch.stack([a, b], dim=2).reshape(a.shape[0], 2 * a.shape[1], *a.shape[2:])


def to_torchtitan(ours):
    out = {}
    for n, t in ours.items():
        if ".moe.experts." in n:
            p = n[: n.index(".moe.experts.") + len(".moe.experts.")]
            leaf = n[len(p):]
            if leaf == "w1":
                out[p + "mlp1_weight"] = interleave(t, ours[p + "w3"])
            elif leaf == "w1_bias":
                out[p + "mlp1_bias"] = interleave(t, ours[p + "w3_bias"])
            elif leaf == "w2":
                out[p + "mlp2_weight"] = t
            elif leaf == "w2_bias":
                out[p + "mlp2_bias"] = t
        else:
            out[n] = t
    return out


def grads_as_ours(model):
    out = {}
    for n, t in model.named_parameters():
        g = t.grad.detach().float()
        if n.endswith("mlp1_weight") or n.endswith("mlp1_bias"):
            p = n[: -len("mlp1_weight" if n.endswith("weight") else "mlp1_bias")]
            sfx = "" if n.endswith("weight") else "_bias"
            out["grad/" + p + "w1" + sfx] = g[:, 0::2].contiguous()
            out["grad/" + p + "w3" + sfx] = g[:, 1::2].contiguous()
        elif n.endswith("mlp2_weight"):
            out["grad/" + n[: -len("mlp2_weight")] + "w2"] = g.contiguous()
        elif n.endswith("mlp2_bias"):
            out["grad/" + n[: -len("mlp2_bias")] + "w2_bias"] = g.contiguous()
        else:
            out["grad/" + n] = g.contiguous()
    return out


def patch_flex_for_cpu():
    """flex_attention has no CPU backward: torchtitan's attention wrapper gets a dense softmax
    over the BlockMask's own mask_mod, checked on its first two calls against flex_attention's
    forward (output and log-sum-exp, 1e-5); create_block_mask runs eagerly on the CPU.
    Call after prepare_torchtitan_import()."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    import torchtitan.models.attention as tt_attention

    def dense_flex(q, k, v, block_mask=None, scale=None, return_lse=False, enable_gqa=False):
        """flex_attention's result over the BlockMask's mask_mod, densely (autograd on CPU)."""
        B, H, T, _ = q.shape
        if enable_gqa:
            k = k.repeat_interleave(H // k.shape[1], 1)
            v = v.repeat_interleave(H // v.shape[1], 1)
        mask = create_mask(block_mask.mask_mod, block_mask.shape[0], None, T, T, device="cpu")
        s = (q @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.softmax(s, -1) @ v
        return (out, torch.logsumexp(s, -1)) if return_lse else out

    checked = []

    def checked_flex(q, k, v, **kw):
        """dense_flex, checked once per mask against flex_attention itself (no grad)."""
        out, lse = dense_flex(q, k, v, **kw)
        if len(checked) < 2:
            with torch.no_grad():
                ref_out, ref_lse = flex_attention(q.detach(), k.detach(), v.detach(), **kw)
            torch.testing.assert_close(out.detach(), ref_out, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lse.detach(), ref_lse, rtol=1e-5, atol=1e-6)
            checked.append(1)
        return out, lse

    tt_attention.FlexAttentionWrapper._compiled_flex_attn = staticmethod(checked_flex)
    tt_attention._compiled_create_block_mask = lambda *a, **k: create_block_mask(
        *a, **{**k, "device": "cpu"})


def main():
    weights_path, tokens_path, out_path = sys.argv[1:4]
    prepare_torchtitan_import()
    patch_flex_for_cpu()
    from torchtitan.models.gpt_oss import gptoss_configs
    from torchtitan.models.gpt_oss.model.model import GptOssModel

    with safe_open(weights_path, "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    ours = load_file(weights_path)
    tokens = load_file(tokens_path)["tokens"]

    def build(**override):
        a = copy.deepcopy(gptoss_configs["debugmodel"])
        for k, v in {**cfg, **override}.items():
            if k in ("num_experts", "top_k"):
                setattr(a.moe_args, k, v)
            else:
                assert hasattr(a, k), k
                setattr(a, k, v)
        a.moe_args.use_grouped_mm = False
        m = GptOssModel(a).float()
        missing, unexpected = m.load_state_dict(to_torchtitan(ours), strict=False)
        assert not unexpected, unexpected
        assert all(k.endswith(("expert_bias", "tokens_per_expert")) for k in missing), missing
        return m

    model = build()
    masks = model.get_attention_masks(tokens, tokenizer=None)
    logits = model(tokens, masks)
    labels = tokens[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    out.update(grads_as_ours(model))
    T = tokens.shape[1]
    with torch.no_grad():
        for name, override in (("logits_no_window", {"sliding_window_size": 4 * T}),
                               ("logits_no_clamp", {"swiglu_limit": 1e9})):
            m = build(**override)
            out[name] = m(tokens, m.get_attention_masks(tokens, tokenizer=None)).contiguous()
    print("torchtitan", __import__("importlib.metadata").metadata.version("torchtitan"))
    save_file(out, out_path)


if __name__ == "__main__":
    main()
