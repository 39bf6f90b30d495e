#!/usr/bin/env python3
"""Runs torchtitan's own llama4 / deepseek_v3 model code (torchtitan 0.2.2) on the same
weights and batch as moe_ref.py, with the same output format, for an optional cross-check
of the C++ models against torchtitan itself.

scripts/setup.sh installs torchtitan (TORCHTITAN_VERSION in scripts/versions.env) into the
test venv without its dependencies; TITAN_TORCHTITAN_PATH, when set, points at another copy.
Only its model code runs. Its package imports pull in training-only modules (tyro, datasets,
torchdata, ...); those are replaced by empty stand-ins, and torch.histc is given int64
support on CPU (torchtitan's router calls it on int64 expert ids, which only CUDA accepts).
"""
import abc
import argparse
import copy
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
import torch.nn.functional as F


class _AnyMeta(abc.ABCMeta):
    def __getattr__(cls, n):
        return _Any

    def __getitem__(cls, k):
        return _Any


class _Any(metaclass=_AnyMeta):
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) else _Any()

    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _Any

    def __getitem__(self, k):
        return _Any


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[0].isupper():
            return type(name, (object,), {"__init__": lambda self, *a, **k: None})
        return _Any()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    STUB = ("tyro", "torchdata", "datasets", "tiktoken", "blobfile", "tomli", "fsspec", "wandb")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.STUB:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, m):
        pass


def prepare_torchtitan_import():
    """torchtitan from TITAN_TORCHTITAN_PATH when set, its training-only imports stubbed, and
    torch.histc made to count int64 expert ids (only CUDA implements that) through a float copy."""
    if os.environ.get("TITAN_TORCHTITAN_PATH"):
        sys.path.insert(0, os.environ["TITAN_TORCHTITAN_PATH"])
    sys.meta_path.insert(0, _StubFinder())
    histc = torch.histc
    torch.histc = lambda x, *a, **k: histc(x.float(), *a, **k).to(x.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prepare_torchtitan_import()

    with safe_open(args.batch, "pt") as f:
        a = json.loads(f.metadata()["config"])
    batch = load_file(args.batch)
    m = a["moe"]
    if a["model"] == "llama4":
        from torchtitan.models.llama4 import llama4_args as flavors
        from torchtitan.models.llama4.model.model import Transformer as Model
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_args as flavors
        from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model as Model
    ma = copy.deepcopy(flavors["debugmodel"])
    for k, v in a.items():
        if k != "moe" and hasattr(ma, k):
            setattr(ma, k, v)
    if a["model"] == "llama4":
        ma.n_kv_heads = a["n_kv_heads"]
        if a["rope_factor"] == 1.0:
            ma.rope_scaling_args = None
    else:
        ma.moe_impl = "standard"
    for k in ("num_experts", "num_shared_experts", "top_k", "score_func", "route_norm",
              "route_scale", "score_before_experts"):
        setattr(ma.moe_args, k, m[k])
    ma.moe_args.num_expert_groups = m["num_expert_groups"] or None
    ma.moe_args.num_limited_groups = m["num_limited_groups"] or None
    ma.moe_args.use_grouped_mm = False
    model = Model(ma)
    weights = load_file(args.weights)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith(("expert_bias", "tokens_per_expert")) or "freqs_cis" in k for k in missing), missing
    logits = model(batch["tokens"])
    labels = batch["labels"]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           reduction="sum") / labels.numel()
    loss.backward()
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    for n, t in model.named_parameters():
        out["grad." + n] = t.grad.detach().clone().contiguous()
    save_file(out, args.out)


if __name__ == "__main__":
    main()
