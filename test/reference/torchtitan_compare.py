#!/usr/bin/env python3
"""Trains with torchtitan 0.2.2's own code on CPU in fp32, for the 20-step comparison with
titan-train (test/app/test_torchtitan_compare.cpp): our version of torchtitan's
`loss_compare.py --assert-equal`.

What runs is torchtitan's: the model (llama3 Transformer, DeepSeekV3Model, Qwen3Model or GptOssModel, built from its
flavor table and `update_from_config`), `build_optimizers` / `build_optimizers_with_moe_load_balancing`
(torch.optim.AdamW as torchtitan builds it, plus its aux-loss-free expert-bias pre-hook),
`build_lr_schedulers`, `cross_entropy_loss` and `dist_utils.clip_grad_norm_`. The loop below
is the non-pipelined branch of torchtitan's `Trainer.train_step` / `forward_backward_step`
(one micro-batch per step: loss = sum of token losses / valid tokens).

Inputs: the initial weights are titan-train's seed checkpoint (`model/<name>` and
`buffers/<name>` in its rank-00000.safetensors, torchtitan names); the batches are the
windows `titan-train data-preview --tokens all` prints (one JSON line per window, in step,
micro-batch, row order). Output: one JSON line per step, {"step", "loss", "grad_norm",
"grad_norm_fp64", "lr"}: grad_norm is what torchtitan's clip_grad_norm_ returns (and clips
with), grad_norm_fp64 the norm of the same gradients accumulated in float64.

Block-causal flavors (`*_flex_attn`, `--eos_id`): the masks are torchtitan's own (its
`get_attention_masks` and document / causal mask_mods, which define the semantics), but
flex_attention has no backward on the CPU, so its kernel is replaced by SDPA (math, fp32)
with the dense boolean mask those mask_mods give for every (query, key) pair.

Not numerics, so replaced: training-only imports with empty stand-ins (torchtitan_ref.py's
_StubFinder), and torch.histc on int64 expert ids, which only CUDA implements, by the same
histogram on their float copy (ids and counts are exact in fp32). gpt_oss: its blocks, which
torchtitan casts to bf16, run in fp32 like the rest; flex_attention, which has no CPU
backward, is replaced by a dense softmax over the same BlockMask mask functions, checked
against flex_attention's forward (gpt_oss_ref.py patch_flex_for_cpu); the seed checkpoint's
w1 / w3 (and biases) are interleaved into torchtitan's mlp1 (gpt_oss_ref.py to_torchtitan).
"""
import argparse
import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file

from torchtitan_ref import prepare_torchtitan_import


def job_config(a):
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.model.name, jc.model.flavor = a.model, a.flavor
    jc.training.seq_len = a.seq_len
    jc.training.local_batch_size = a.local_batch_size
    jc.training.steps = a.steps
    jc.training.max_norm = a.max_norm
    jc.optimizer.name = "AdamW"
    jc.optimizer.lr = a.lr
    jc.optimizer.eps = a.eps
    jc.optimizer.weight_decay = a.weight_decay
    jc.optimizer.beta1, jc.optimizer.beta2 = a.beta1, a.beta2
    jc.optimizer.implementation = "fused"  # torchtitan's default; torch has it on CPU too
    jc.lr_scheduler.warmup_steps = a.warmup_steps
    jc.lr_scheduler.decay_ratio = a.decay_ratio if a.decay_ratio >= 0 else None
    jc.lr_scheduler.decay_type = a.decay_type
    jc.lr_scheduler.min_lr_factor = a.min_lr_factor
    return jc


def build_model(a, jc):
    if a.model == "llama3":
        from torchtitan.models.llama3 import llama3_args as flavors
        from torchtitan.models.llama3 import Transformer as Model
    elif a.model == "qwen3":
        from torchtitan.models.qwen3 import qwen3_args as flavors
        from torchtitan.models.qwen3.model.model import Qwen3Model as Model
    elif a.model == "gpt_oss":
        from gpt_oss_ref import patch_flex_for_cpu
        from torchtitan.models.gpt_oss import gptoss_configs as flavors
        from torchtitan.models.gpt_oss.model.model import GptOssModel as Model

        patch_flex_for_cpu()
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_args as flavors
        from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model as Model
    import copy

    ma = copy.deepcopy(flavors[a.flavor])
    ma.update_from_config(jc)
    if ma.__dict__.get("moe_args") is not None and a.model != "llama3":
        # update_from_config picks grouped_mm only on SM90+; the CPU takes the for-loop path.
        ma.moe_args.use_grouped_mm = False
        ma.moe_args.load_balance_coeff = a.load_balance_coeff if a.load_balance_coeff > 0 else None
    with torch.device("cpu"):
        model = Model(ma)
    if a.model == "gpt_oss":
        model = model.float()  # torchtitan builds its blocks in bf16; the comparison is fp32
    with torch.no_grad():  # as torchtitan's Trainer does after to_empty()
        model.init_weights()  # buffers (RoPE tables, expert bias, counters); weights are loaded next
    return model


def load_seed(model, path, model_name):
    st = load_file(path)
    sd = {}
    for k, v in st.items():
        for prefix in ("model/", "buffers/"):
            if k.startswith(prefix):
                sd[k[len(prefix):]] = v
    if model_name == "gpt_oss":
        from gpt_oss_ref import to_torchtitan
        sd = to_torchtitan(sd)
    # titan-train saves its per-step expert counters; torchtitan's are not persistent. A seed
    # holds zeros, as torchtitan's init_weights sets them.
    for k in [k for k in sd if k.endswith("tokens_per_expert")]:
        assert not sd.pop(k).any(), f"{k}: a seed checkpoint's counters are zero"
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, f"titan-train tensors torchtitan does not have: {unexpected}"
    # Only non-persistent or derived buffers may be missing, and a tied output (qwen3's small
    # flavors), which is the embedding.
    tied = getattr(model, "enable_weight_tying", False)
    bad = [k for k in missing if not (k.endswith("tokens_per_expert") or "freqs_cis" in k
                                      or k.endswith("rope_cache")
                                      or (tied and k == "output.weight"))]
    assert not bad, f"torchtitan tensors the seed checkpoint lacks: {bad}"
    return len(sd)


def install_dense_flex_stand_in():
    """flex_attention -> SDPA with the dense mask of torchtitan's mask_mod (CPU has no flex
    backward). create_block_mask(mask_mod, B, H, Q, KV) becomes the (B, 1, Q, KV) boolean
    tensor of mask_mod over broadcast index grids; torchtitan's mask_mods are elementwise."""
    import torch.nn.functional as F
    import torchtitan.models.attention as tta

    from torch.nn.attention.flex_attention import BlockMask

    class DenseMask(BlockMask):  # the model asserts a BlockMask; only .dense is read here
        def __init__(self, dense):
            self.dense = dense

    def dense_mask(mask_mod, B, H, Q, KV, *args, **kwargs):
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        q = torch.arange(Q).view(1, 1, Q, 1)
        kv = torch.arange(KV).view(1, 1, 1, KV)
        return DenseMask(mask_mod(b, h, q, kv).expand(B, 1, Q, KV))

    def sdpa(q, k, v, *, block_mask=None, scale=None, enable_gqa=False, return_lse=False):
        assert not return_lse, "the stand-in returns no lse (CP is not compared)"
        return F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask.dense, scale=scale,
                                              enable_gqa=enable_gqa)

    tta._compiled_create_block_mask = dense_mask
    tta.FlexAttentionWrapper._compiled_flex_attn = staticmethod(sdpa)


def read_batches(path, steps, local_batch_size, seq_len):
    rows = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            w = json.loads(line)
            assert len(w["tokens"]) == seq_len + 1, "data-preview must run with --tokens all"
            rows.setdefault(w["step"], []).append(w["tokens"])
    batches = []
    for s in range(1, steps + 1):
        assert len(rows.get(s, [])) == local_batch_size, f"step {s}: {len(rows.get(s, []))} windows"
        t = torch.tensor(rows[s], dtype=torch.int64)  # (B, T + 1)
        batches.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return batches


def init_single_process_group():
    # ParallelDims builds its (size-1) meshes through torch.distributed.
    if torch.distributed.is_initialized():
        return
    fd, path = tempfile.mkstemp(prefix="tt-compare-store-")
    os.close(fd)
    os.unlink(path)
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + path, rank=0, world_size=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["llama3", "deepseek_v3", "qwen3", "gpt_oss"],
                    required=True)
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--weights", required=True, help="seed checkpoint rank-00000.safetensors")
    ap.add_argument("--batches", required=True, help="data-preview --tokens all output")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq_len", type=int, required=True)
    ap.add_argument("--local_batch_size", type=int, required=True)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight_decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--max_norm", type=float, default=1.0)
    ap.add_argument("--warmup_steps", type=int, default=2)
    ap.add_argument("--decay_ratio", type=float, default=-1.0, help="< 0: unset")
    ap.add_argument("--decay_type", default="linear")
    ap.add_argument("--min_lr_factor", type=float, default=0.0)
    ap.add_argument("--load_balance_coeff", type=float, default=1e-3, help="<= 0: off")
    ap.add_argument("--eos_id", type=int, default=-1,
                    help="the tokenizer's EOS, for flavors whose attention takes masks")
    a = ap.parse_args()
    prepare_torchtitan_import()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_single_process_group()

    import torchtitan
    from torchtitan.components.loss import cross_entropy_loss, IGNORE_INDEX
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import (
        build_optimizers, build_optimizers_with_moe_load_balancing)
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    jc = job_config(a)
    model = build_model(a, jc)
    # Block-causal flavors of the families whose masks come from the EOS (gpt_oss builds its
    # own causal / sliding-window masks, below).
    masked = a.model != "gpt_oss" and getattr(model.model_args, "attn_type", "sdpa") != "sdpa"
    if masked:
        assert a.eos_id >= 0, f"{a.flavor} builds masks from the EOS: pass --eos_id"
        install_dense_flex_stand_in()

    class Tokenizer:  # what get_attention_masks reads of torchtitan's tokenizer
        eos_id = a.eos_id
    n = load_seed(model, a.weights, a.model)
    model.train()
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    # The builders torchtitan's train specs name: build_optimizers for llama3 and qwen3 (whose
    # MoE flavors therefore never move their expert bias), the MoE variant (the same optimizer
    # plus the expert-bias pre-hook) for deepseek_v3 and gpt_oss.
    build = (build_optimizers_with_moe_load_balancing if a.model in ("deepseek_v3", "gpt_oss")
             else build_optimizers)
    optimizers = build([model], jc.optimizer, pd)
    schedulers = build_lr_schedulers(optimizers, jc.lr_scheduler, jc.training.steps)
    batches = read_batches(a.batches, a.steps, a.local_batch_size, a.seq_len)

    out = []
    for step, (inputs, labels) in enumerate(batches, start=1):
        optimizers.zero_grad()
        lr = schedulers.schedulers[0].get_last_lr()[0]
        valid = (labels != IGNORE_INDEX).sum().float()
        if a.model == "gpt_oss":  # its forward takes the flex masks (causal / sliding window)
            pred = model(inputs, model.get_attention_masks(inputs, None))
        else:
            # As torchtitan's Trainer.post_dataloading_process: masks from the inputs' EOS.
            extra = ({"attention_masks": model.get_attention_masks(inputs, Tokenizer())}
                     if masked else {})
            pred = model(inputs, **extra)
        loss = cross_entropy_loss(pred, labels) / valid
        del pred
        loss.backward()
        # The same gradients' norm accumulated in fp64. torch's fp32 vector_norm on the CPU
        # (what clip_grad_norm_ reports) is off by up to ~1.3e-4 relative here, on the
        # output-layer gradient; a sum of squares in fp32 is within ~1e-8.
        exact = torch.stack([p.grad.double().pow(2).sum() for p in model.parameters()
                             if p.grad is not None]).sum().sqrt()
        grad_norm = dist_utils.clip_grad_norm_(
            [p for p in model.parameters()], jc.training.max_norm, foreach=True,
            pp_mesh=None, ep_enabled=False)
        optimizers.step()
        schedulers.step()
        out.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(),
                    "grad_norm_fp64": exact.item(), "lr": lr})
        print(json.dumps(out[-1]), flush=True)
    with open(a.out + ".tmp", "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    os.replace(a.out + ".tmp", a.out)
    print(f"torchtitan {getattr(torchtitan, '__version__', '?')}: {a.model} {a.flavor}, "
          f"{n} tensors loaded, {len(out)} steps", file=sys.stderr)


if __name__ == "__main__":
    main()
