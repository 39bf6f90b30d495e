#!/usr/bin/env python3
"""Prints torchtitan 0.2.2's model flavors (llama3, llama4, deepseek_v3, qwen3,
gpt_oss) as JSON, in the
field names of titan-train's Args structs, for test/models/test_flavors.cpp.

torchtitan's own flavor tables are read from the installed package (the test venv pins
torchtitan==0.2.2); training-only imports are stubbed as in torchtitan_ref.py.
Output: {"torchtitan": version, "flavors": {"llama3/8B": {field: value}, ...}}.
Conventions shared with the C++ side: no RoPE scaling is {"rope_factor": 1.0} alone;
n_kv_heads None means n_heads; ffn_dim_multiplier None is 0; expert groups None are 0.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_ref import _StubFinder  # noqa: E402

sys.meta_path.insert(0, _StubFinder())

from importlib.metadata import version  # noqa: E402

from torchtitan.models.deepseek_v3 import deepseekv3_args  # noqa: E402
from torchtitan.models.gpt_oss import gptoss_configs  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402
from torchtitan.models.llama4 import llama4_args  # noqa: E402
from torchtitan.models.qwen3 import qwen3_args  # noqa: E402


def rope(scaling):
    if scaling is None:
        return {"rope_factor": 1.0}
    return {
        "rope_factor": float(scaling.scaling_factor),
        "rope_low_freq_factor": float(scaling.low_freq_factor),
        "rope_high_freq_factor": float(scaling.high_freq_factor),
        "rope_original_max_seq_len": int(scaling.original_max_position_embeddings),
    }


def attention(a):
    out = {"attn_type": a.attn_type, "attn_mask_type": a.attn_mask_type}
    if getattr(a, "every_n_layers_nope", None) is not None:
        out["every_n_layers_nope"] = a.every_n_layers_nope
        out["fixed_attn_block_size"] = a.fixed_attn_block_size
    return out


def llama(a):
    return {
        "dim": a.dim,
        "n_layers": a.n_layers,
        "n_heads": a.n_heads,
        "n_kv_heads": a.n_kv_heads if a.n_kv_heads is not None else a.n_heads,
        "vocab_size": a.vocab_size,
        "multiple_of": a.multiple_of,
        "ffn_dim_multiplier": float(a.ffn_dim_multiplier or 0.0),
        "norm_eps": float(a.norm_eps),
        "rope_theta": float(a.rope_theta),
        **rope(a.rope_scaling_args),
        "depth_init": a.depth_init,
    }


def moe(m):
    return {
        "num_experts": m.num_experts,
        "num_shared_experts": m.num_shared_experts,
        "top_k": m.top_k,
        "score_func": m.score_func,
        "route_norm": m.route_norm,
        "route_scale": float(m.route_scale),
        "gate_bias": m.gate_bias,
        "score_before_experts": m.score_before_experts,
        "num_expert_groups": m.num_expert_groups or 0,
        "num_limited_groups": m.num_limited_groups or 0,
        "load_balance_coeff": float(m.load_balance_coeff or 0.0),
    }


def llama3(a):
    # torchtitan's llama3 has no tied embeddings. max_seq_len is the longest allowed run.
    return {**llama(a), "tie_embeddings": False, "max_seq_len": a.max_seq_len}


def llama4(a):
    out = llama(a)
    out.update(interleave_moe_layer_step=a.interleave_moe_layer_step,
               auto_scale_hidden_dim=a.auto_scale_hidden_dim, **moe(a.moe_args))
    return out


def deepseek_v3(a):
    fields = ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_dense_layers",
              "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "original_seq_len")
    out = {f: getattr(a, f) for f in fields}
    for f in ("norm_eps", "rope_theta", "rope_factor", "beta_fast", "beta_slow", "mscale"):
        out[f] = float(getattr(a, f))
    out.update(moe(a.moe_args))
    return out


def qwen3(a):
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "head_dim", "hidden_dim",
              "qk_norm", "max_seq_len", "depth_init", "moe_enabled", "moe_inter_dim")
    out = {f: getattr(a, f) for f in fields}
    out["norm_eps"] = float(a.norm_eps)
    out["rope_theta"] = float(a.rope_theta)
    out["tie_embeddings"] = a.enable_weight_tying
    if a.moe_enabled:  # a dense flavor's MoEArgs are unused defaults
        out.update(moe(a.moe_args))
    return out


def gpt_oss(a):
    # dtype and max_batch_size are run settings there (titan-train's training.*), not shapes.
    fields = ("max_seq_len", "vocab_size", "dim", "moe_inter_dim", "n_layers", "head_dim",
              "n_heads", "n_kv_heads", "sliding_window_size", "original_seq_len")
    out = {f: getattr(a, f) for f in fields}
    for f in ("norm_eps", "swiglu_limit", "rope_theta", "rope_factor", "ntk_alpha", "ntk_beta"):
        out[f] = float(getattr(a, f))
    out.update(moe(a.moe_args))
    return out


def main():
    flavors = {}
    for family, table, fn in (("llama3", llama3_args, llama3), ("llama4", llama4_args, llama4),
                              ("deepseek_v3", deepseekv3_args, deepseek_v3),
                              ("qwen3", qwen3_args, qwen3),
                              ("gpt_oss", gptoss_configs, gpt_oss)):
        for name, a in table.items():
            flavors[f"{family}/{name}"] = {**fn(a), **attention(a)}
    json.dump({"torchtitan": version("torchtitan"), "flavors": flavors}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
