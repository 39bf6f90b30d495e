#!/usr/bin/env python3
"""Reads a Hugging Face folder written by titan-train with the Python packages, for
test/models/test_hf_interop.cpp.

  list DIR OUT.json
      Opens every shard named by DIR/model.safetensors.index.json with the `safetensors`
      package and writes {"tensors": {name: {"shape": [...], "dtype": "...", "file": "..."}},
      "total_size": <index metadata>, "weight_map": <index weight_map>}.

  logits DIR TOKENS.safetensors OUT.safetensors
      Loads DIR with the transformers class its config.json names (fp32, eager attention) and
      writes the logits of the "tokens" tensor as "logits". Exits 3 when transformers cannot
      be imported, 1 when loading reports missing, unexpected or mismatched weights.
      LlamaForCausalLM also writes "logits_unpermuted": the logits after undoing the q/k RoPE
      permutation in every layer, which must differ, so the test shows it can tell the two
      layouts apart.
      DeepseekV3ForCausalLM also writes
        "logits_eps_aligned": with the epsilons of three RMSNorms set to titan-train's
            (torchtitan's): kv_a_layernorm and q_a_layernorm use rms_norm_eps (transformers
            hard-codes 1e-6 for them) and the final norm fp32's machine epsilon (torchtitan
            gives it no eps; transformers uses rms_norm_eps). config.json cannot say either.
        "logits_rope_half": eps aligned, and rope_interleave switched off, which must differ:
            the weights are in the interleaved layout and nothing is permuted;
        "logits_no_bias": eps aligned, with every e_score_correction_bias zeroed, which must
            differ when the test gave the experts a bias: the bias was loaded and is used.

      Qwen3ForCausalLM and Qwen3MoeForCausalLM also write
        "loss": transformers' own causal-LM loss (labels = the tokens, shifted inside);
        "grad/<parameter name>": that loss's gradient of every parameter (transformers' names;
            its fused experts have no per-expert name);
        "logits_interleaved": with q_proj / k_proj rows permuted per head to the adjacent-pairs
            RoPE layout, which must differ: the weights need no permutation;
        "logits_no_qk_norm": with q_norm and k_norm replaced by identities, which must differ.

  generate DIR PROMPT.safetensors N OUT.safetensors
      Loads DIR like `logits` and writes transformers' greedy generate() continuation of the
      "tokens" prompt (1, T), N new tokens, as "tokens" (1, T + N).

  resave DIR OUT_DIR
      Loads DIR like `logits` and writes it again with transformers' save_pretrained (fp32), so
      the test can import a folder transformers wrote. Exits 3 without transformers.
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


def load_model(transformers, cls, d):
    # `dtype` replaced `torch_dtype` in transformers 5; older versions only know the latter.
    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}
    model, info = cls.from_pretrained(d, attn_implementation="eager", output_loading_info=True,
                                      **kw)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys",
                                                   "mismatched_keys") and v}
    if bad:
        print(f"loading {d} with {cls.__name__}: {bad}")
        sys.exit(1)
    model.eval()
    return model


def llama_logits(transformers, d, tokens):
    model = load_model(transformers, transformers.LlamaForCausalLM, d)
    result = {}
    result["logits"] = model(tokens).logits.float().contiguous()
    cfg = model.config
    for layer in model.model.layers:
        a = layer.self_attn
        a.q_proj.weight.copy_(unpermute(a.q_proj.weight, cfg.num_attention_heads))
        a.k_proj.weight.copy_(unpermute(a.k_proj.weight, cfg.num_key_value_heads))
    result["logits_unpermuted"] = model(tokens).logits.float().contiguous()
    return result


def deepseek_v3_logits(transformers, d, tokens):
    model = load_model(transformers, transformers.DeepseekV3ForCausalLM, d)
    cfg = model.config
    result = {"logits": model(tokens).logits.float().contiguous()}
    for layer in model.model.layers:
        a = layer.self_attn
        a.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
        if a.q_a_layernorm is not None:
            a.q_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    model.model.norm.variance_epsilon = torch.finfo(torch.float32).eps
    result["logits_eps_aligned"] = model(tokens).logits.float().contiguous()
    cfg.rope_interleave = False  # every attention layer reads the shared config
    result["logits_rope_half"] = model(tokens).logits.float().contiguous()
    cfg.rope_interleave = True
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.zero_()
    result["logits_no_bias"] = model(tokens).logits.float().contiguous()
    return result


def interleave(w, heads):
    # HF (rotate-half) rows to Meta (adjacent pairs) rows, per head: a wrong layout.
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def qwen3_logits(transformers, d, tokens, cls):
    model = load_model(transformers, cls, d)
    cfg = model.config
    out = model(tokens, labels=tokens)
    result = {"logits": out.logits.float().contiguous(), "loss": out.loss.float().reshape(1)}
    with torch.enable_grad():
        model.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                result["grad/" + name] = p.grad.float().contiguous()
    saved = []
    for layer in model.model.layers:
        a = layer.self_attn
        saved.append((a.q_proj.weight.clone(), a.k_proj.weight.clone()))
        a.q_proj.weight.copy_(interleave(a.q_proj.weight, cfg.num_attention_heads))
        a.k_proj.weight.copy_(interleave(a.k_proj.weight, cfg.num_key_value_heads))
    result["logits_interleaved"] = model(tokens).logits.float().contiguous()
    for layer, (q, k) in zip(model.model.layers, saved):
        layer.self_attn.q_proj.weight.copy_(q)
        layer.self_attn.k_proj.weight.copy_(k)
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()
    result["logits_no_qk_norm"] = model(tokens).logits.float().contiguous()
    return result


def gpt_oss_logits(transformers, d, tokens):
    model = load_model(transformers, transformers.GptOssForCausalLM, d)
    out = model(tokens, labels=tokens)
    result = {"logits": out.logits.float().contiguous(), "loss": out.loss.float().reshape(1)}
    with torch.enable_grad():
        model.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                result["grad/" + name] = p.grad.float().contiguous()
    return result


def generate(d, prompt_path, n, out):
    try:
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"transformers unavailable: {e!r}")
        sys.exit(3)
    print(f"transformers {transformers.__version__}")
    with open(os.path.join(d, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    model = load_model(transformers, getattr(transformers, arch), d)
    prompt = load_file(prompt_path)["tokens"]
    with torch.no_grad():
        # No eos: exactly n new tokens. Greedy, with the model's KV cache.
        toks = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    save_file({"tokens": toks.contiguous()}, out)


def logits(d, tokens_path, out):
    try:
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"transformers unavailable: {e!r}")
        sys.exit(3)
    print(f"transformers {transformers.__version__}")
    with open(os.path.join(d, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    tokens = load_file(tokens_path)["tokens"]
    with torch.no_grad():
        if model_type == "llama":
            result = llama_logits(transformers, d, tokens)
        elif model_type == "deepseek_v3":
            result = deepseek_v3_logits(transformers, d, tokens)
        elif model_type == "qwen3":
            result = qwen3_logits(transformers, d, tokens, transformers.Qwen3ForCausalLM)
        elif model_type == "qwen3_moe":
            result = qwen3_logits(transformers, d, tokens, transformers.Qwen3MoeForCausalLM)
        elif model_type == "gpt_oss":
            result = gpt_oss_logits(transformers, d, tokens)
        else:
            raise SystemExit(f"{d}/config.json: model_type {model_type!r}; "
                             "allowed: llama, deepseek_v3, qwen3, qwen3_moe, gpt_oss")
    save_file(result, out)


def resave(d, out):
    try:
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"transformers unavailable: {e!r}")
        sys.exit(3)
    with open(os.path.join(d, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    load_model(transformers, getattr(transformers, arch), d).save_pretrained(out)


def main():
    if sys.argv[1] == "list":
        list_folder(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "generate":
        generate(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "resave":
        resave(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]}")


if __name__ == "__main__":
    main()
