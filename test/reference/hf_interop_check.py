#!/usr/bin/env python3
"""Reads a Hugging Face folder written by titan-train with the Python packages, for
test/models/test_hf_interop.cpp.

  list DIR OUT.json
      Opens every shard named by DIR/model.safetensors.index.json with the `safetensors`
      package and writes {"tensors": {name: {"shape": [...], "dtype": "...", "file": "..."}},
      "total_size": <index metadata>, "weight_map": <index weight_map>}.

  logits DIR TOKENS.safetensors OUT.safetensors
      Loads DIR with transformers.LlamaForCausalLM (fp32, eager attention) and writes the logits
      of the "tokens" tensor as "logits". Also writes "logits_unpermuted": the logits after
      undoing the q/k RoPE permutation in every layer, which must differ, so the test shows it
      can tell the two layouts apart. Exits 3 when transformers cannot be imported.
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def list_folder(d, out):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(d, shard), "pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise SystemExit(f"{name} in {tensors[name]['file']} and {shard}")
                t = f.get_tensor(name)
                tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype), "file": shard}
    with open(out, "w") as f:
        json.dump({"tensors": tensors, "total_size": index["metadata"]["total_size"],
                   "weight_map": index["weight_map"]}, f)


def unpermute(w, heads):
    # HF (rotate-half) rows back to Meta (adjacent pairs) rows: the inverse of the export.
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def logits(d, tokens_path, out):
    try:
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"transformers unavailable: {e!r}")
        sys.exit(3)
    print(f"transformers {transformers.__version__}")
    # `dtype` replaced `torch_dtype` in transformers 5; older versions only know the latter.
    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}
    model = transformers.LlamaForCausalLM.from_pretrained(d, attn_implementation="eager", **kw)
    model.eval()
    tokens = load_file(tokens_path)["tokens"]
    result = {}
    with torch.no_grad():
        result["logits"] = model(tokens).logits.float().contiguous()
        cfg = model.config
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.weight.copy_(unpermute(a.q_proj.weight, cfg.num_attention_heads))
            a.k_proj.weight.copy_(unpermute(a.k_proj.weight, cfg.num_key_value_heads))
        result["logits_unpermuted"] = model(tokens).logits.float().contiguous()
    save_file(result, out)


def main():
    if sys.argv[1] == "list":
        list_folder(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]}")


if __name__ == "__main__":
    main()
