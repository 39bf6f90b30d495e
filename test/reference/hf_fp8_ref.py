#!/usr/bin/env python3
"""Writes a Hugging Face folder in DeepSeek-V3's published float8 layout, for
test/models/test_hf_interop.cpp.

  quantize SRC_DIR DST_DIR BLOCK_ROWS BLOCK_COLS REF.safetensors
      Reads the folder SRC_DIR (float32, as titan-train exports it) and writes DST_DIR with the
      same shards and names, where every 2-D linear weight (all but the embedding, lm_head,
      the norms and the router gate, which DeepSeek-V3 keeps in bfloat16) is float8 e4m3fn with
      a float32 "<name>_scale_inv" of shape [ceil(rows/BR), ceil(cols/BC)], quantized per
      BR x BC block as DeepSeek's weight_quant does (scale = amax / 448, q = (w / scale) cast to
      e4m3fn). The other tensors are cast to bfloat16 (the expert bias stays float32).
      config.json gains quantization_config {"quant_method": "fp8", "fmt": "e4m3",
      "activation_scheme": "dynamic", "weight_block_size": [BR, BC]}.
      REF.safetensors gets every DST tensor (scales aside) as the float32 the importer must
      produce, computed here independently: the weight padded to whole blocks, viewed as
      (rows/BR, BR, cols/BC, BC), multiplied by scale_inv[:, None, :, None] in float32, then
      cropped.
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def keeps_high_precision(name, t):
    return (t.dim() != 2 or "embed_tokens" in name or name.startswith("lm_head")
            or "norm" in name or name.endswith("mlp.gate.weight"))


def blocks_of(w, br, bc):
    """w (rows, cols) zero-padded to whole blocks, viewed as (rows/BR, BR, cols/BC, BC)."""
    rows, cols = w.shape
    rb, cb = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(rb * br, cb * bc, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    return padded.view(rb, br, cb, bc)


def quantize_blocks(w, br, bc):
    rows, cols = w.shape
    blk = blocks_of(w, br, bc)
    scale = blk.abs().amax(dim=(1, 3)) / 448.0  # (rows/BR, cols/BC), float32
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blk / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(blk.shape[0] * br, -1)[:rows, :cols].contiguous(), scale


def dequantize_blocks(q, scale, br, bc):
    rows, cols = q.shape
    rb, cb = scale.shape
    out = (blocks_of(q, br, bc) * scale.float()[:, None, :, None]).view(rb * br, cb * bc)
    return out[:rows, :cols].contiguous()


def quantize(src, dst, br, bc, ref_path):
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    os.makedirs(dst)
    weight_map, ref = {}, {}
    n_fp8 = 0
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.endswith("e_score_correction_bias"):
                    out[name] = t
                elif keeps_high_precision(name, t):
                    out[name] = t.to(torch.bfloat16)
                else:
                    q, s = quantize_blocks(t, br, bc)
                    out[name], out[name + "_scale_inv"] = q, s
                    n_fp8 += 1
        for name, t in out.items():
            weight_map[name] = shard
            if name.endswith("_scale_inv"):
                continue
            base = name
            if t.dtype == torch.float8_e4m3fn:
                ref[base] = dequantize_blocks(t, out[name + "_scale_inv"], br, bc)
            else:
                ref[base] = t.float()
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                  "quant_method": "fp8", "weight_block_size": [br, bc]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(ref, ref_path)
    print(f"float8 tensors: {n_fp8}, block [{br}, {bc}], torch {torch.__version__}")


def main():
    if len(sys.argv) == 7 and sys.argv[1] == "quantize":
        quantize(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
        return
    print(__doc__)
    sys.exit(2)


if __name__ == "__main__":
    main()
