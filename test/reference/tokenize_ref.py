#!/usr/bin/env python3
"""Reference side of test/core/tokenizer/test_tokenizer.cpp, using Hugging Face `tokenizers`.

  encode TOKENIZER IN.json OUT.json   IN is a JSON list of strings; OUT gets {"ids": [[...]],
                                      "decoded": [...]} from encode(s, add_special_tokens=False)
                                      and decode(ids, skip_special_tokens=False)
  make-split CORPUS OUT.json          trains a small BPE with the Llama-3 pre-tokenizer
                                      (Sequence[Split(regex, Isolated), ByteLevel(use_regex=False)]),
                                      adds a special token after the model vocab as Llama-3 does,
                                      and stores merges as "a b" strings with ignore_merges true
  prefix-space IN.json OUT.json       copy of IN with the ByteLevel add_prefix_space set to true
  merges-form TOKENIZER               prints "pairs" or "strings"
  bench TOKENIZER CORPUS              encode_batch speed on the corpus documents (threads:
                                      RAYON_NUM_THREADS), for scripts/bench_tokenizer.sh
  make-all CORPUS BYTELEVEL.json TEXTS.json OUTDIR
                                      writes one folder per tokenizer family under OUTDIR (see
                                      families()) and OUTDIR/expected.json: for each family the
                                      ids and decodes of TEXTS, the largest id + 1, the ids of
                                      the usual BOS/EOS names, and for a family with a
                                      tokenizer_config.json BOS and EOS as torchtitan's
                                      HuggingFaceTokenizer gives them
"""
import copy
import importlib.util
import json
import os
import sys
import types

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, trainers

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def merges_form(doc: dict) -> str:
    forms = {"strings" if isinstance(m, str) else "pairs" for m in doc["model"]["merges"]}
    if len(forms) != 1:
        raise SystemExit(f"mixed or empty merges: {forms}")
    return forms.pop()


def encode_all(tok: Tokenizer, texts: list) -> dict:
    encs = tok.encode_batch(texts, add_special_tokens=False)
    ids = [e.ids for e in encs]
    return {"ids": ids, "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids]}


def encode(tok_path: str, in_path: str, out_path: str) -> None:
    tok = Tokenizer.from_file(tok_path)
    with open(in_path, encoding="utf-8") as f:
        texts = json.load(f)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(encode_all(tok, texts), f)


def corpus_docs(corpus: str, size: int) -> list:
    with open(corpus, encoding="utf-8") as f:
        return f.read()[:size].split("\n\n")


def make_split(corpus: str, out_path: str) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_docs(corpus, 600_000), trainer)
    # Llama-3 keeps its special tokens after the model vocabulary, outside model.vocab.
    tok.add_special_tokens(["<|eot_id|>"])
    doc = json.loads(tok.to_str())
    if merges_form(doc) != "pairs":
        raise SystemExit("expected tokenizers to save merges as pairs")
    doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
    doc["model"]["ignore_merges"] = True
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    Tokenizer.from_file(out_path)  # still loadable by HF in the rewritten form


def prefix_space(in_path: str, out_path: str) -> None:
    with open(in_path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc["pre_tokenizer"]["type"] != "ByteLevel":
        raise SystemExit("expected a ByteLevel pre-tokenizer")
    doc["pre_tokenizer"]["add_prefix_space"] = True
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)


# ---- Tokenizer families for make-all ------------------------------------------------------------

def added(content, special=True, normalized=None, single_word=False, lstrip=False, rstrip=False):
    return {
        "id": 0,  # HF assigns ids itself and only warns about these
        "content": content,
        "single_word": single_word,
        "lstrip": lstrip,
        "rstrip": rstrip,
        "normalized": (not special) if normalized is None else normalized,
        "special": special,
    }


def replace(pattern, content, regex=False):
    return {"type": "Replace", "pattern": {"Regex" if regex else "String": pattern},
            "content": content}


SP_DECODER = {"type": "Sequence", "decoders": [
    replace("▁", " "), {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def train_sentencepiece(corpus: str) -> dict:
    """A SentencePiece-style BPE (Llama-2 / Mistral layout): <unk> <s> </s>, then the 256
    <0xNN> byte tokens, then merges learned on Metaspace words; a few non-ASCII characters in
    the alphabet, everything else reaches the model through byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
        initial_alphabet=list("éèçàü日本語中文한국ß") + ["▁"],
        limit_alphabet=120,
        show_progress=False,
    )
    tok.train_from_iterator(corpus_docs(corpus, 400_000), trainer)
    doc = json.loads(tok.to_str())
    # The byte tokens are plain vocabulary entries in Llama-2, not added tokens.
    doc["added_tokens"] = [a for a in doc["added_tokens"] if a["content"] not in byte_tokens]
    doc["decoder"] = SP_DECODER
    return doc


def train_with_affix(corpus: str, prefix=None, suffix=None) -> dict:
    kwargs = {}
    if prefix:
        kwargs["continuing_subword_prefix"] = prefix
    if suffix:
        kwargs["end_of_word_suffix"] = suffix
    tok = Tokenizer(models.BPE(unk_token="<unk>", **kwargs))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.normalizer = normalizers.Lowercase()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], show_progress=False,
                                  **kwargs)
    tok.train_from_iterator(corpus_docs(corpus, 200_000), trainer)
    if suffix:
        tok.decoder = decoders.BPEDecoder(suffix=suffix)
    return json.loads(tok.to_str())


def torchtitan_like(byte_level: dict) -> tuple:
    """The shape of torchtitan's tests/assets/tokenizer (BSD-3, torchtitan 0.2.2): 2,002
    tokens, bytes stored raw (0x00-0x7F as themselves, 0x80-0xFF as the four characters
    "\\xNN") instead of GPT-2's byte symbols, no merges, a ByteLevel pre-tokenizer, and a
    tokenizer_config.json whose BOS/EOS are not in the vocabulary. Characters the vocabulary
    lacks are dropped by HF (no unk token), which makes this family's ids lossy."""
    vocab = {}
    for b in range(256):
        vocab[chr(b) if b < 128 else f"\\x{b:02x}"] = b
    words = sorted((t for t in byte_level["model"]["vocab"] if len(t) > 1 and "<|" not in t),
                   key=lambda t: byte_level["model"]["vocab"][t])
    for w in words:
        if len(vocab) == 1998:
            break
        vocab.setdefault(w.replace("Ġ", " ").replace("Ċ", "\n"), len(vocab))
    for t in ["<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|pad|>"]:
        vocab[t] = len(vocab)
    byte_level_cfg = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": True}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": byte_level_cfg,
        "post_processor": dict(byte_level_cfg, add_prefix_space=True),
        "decoder": dict(byte_level_cfg, add_prefix_space=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    special = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
               "special": True}
    config = {
        "added_tokens_decoder": {
            "128000": dict(special, content="<|begin_of_text|>"),
            "128001": dict(special, content="<|end_of_text|>"),
            "1998": dict(special, content="<|image|>"),
            "1999": dict(special, content="<|begin_of_image|>"),
            "2000": dict(special, content="<|end_of_image|>"),
            "2001": dict(special, content="<|pad|>"),
        },
        "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|end_of_text|>",
        "img_token": "<|image|>",
        "boi_token": "<|begin_of_image|>",
        "eoi_token": "<|end_of_image|>",
        "pad_token": "<|pad|>",
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return doc, config


def torchtitan_tokenizer_class():
    """torchtitan's own HuggingFaceTokenizer (components/tokenizer.py), loaded without the
    training-side packages its module imports (tyro etc.)."""
    # find_spec locates the package without running its __init__ (which imports tyro).
    root = importlib.util.find_spec("torchtitan").submodule_search_locations[0]
    path = os.path.join(root, "components", "tokenizer.py")
    stubs = {"torchtitan.config": types.ModuleType("torchtitan.config"),
             "torchtitan.tools.logging": types.ModuleType("torchtitan.tools.logging")}
    stubs["torchtitan.config"].JobConfig = object

    class _Quiet:
        def __getattr__(self, name):
            return lambda *a, **k: None

    stubs["torchtitan.tools.logging"].logger = _Quiet()
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("tt_tokenizer", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod.HuggingFaceTokenizer


def families(corpus: str, byte_level: dict) -> dict:
    """name -> (tokenizer.json dict, tokenizer_config.json dict or None, round_trip) where
    round_trip says that every byte string, valid UTF-8 or not, comes back from
    decode(encode(bytes)) (our contract for byte-level and byte-fallback tokenizers without a
    normalizer that changes text; the C++ test checks it, HF cannot take invalid UTF-8)."""
    out = {}
    bl = byte_level
    out["bytelevel"] = (bl, None, True)

    d = copy.deepcopy(bl)
    d["normalizer"] = {"type": "NFC"}
    out["bytelevel_nfc"] = (d, None, False)

    d = copy.deepcopy(bl)
    d["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Lowercase"}, replace(r"\d", "#", regex=True),
        {"type": "Prepend", "prepend": "> "}]}
    d["added_tokens"] += [added("Amen", special=False, normalized=True),
                          added("<SEP>", special=True),
                          added("LORD", special=False, normalized=False, single_word=True)]
    out["bytelevel_norm_added"] = (d, None, False)

    d = copy.deepcopy(bl)
    d["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "NFD"}, {"type": "StripAccents"}, {"type": "NFKD"},
        {"type": "Strip", "strip_left": True, "strip_right": True}]}
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "Punctuation", "behavior": "Isolated"},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
         "use_regex": True}]}
    out["bytelevel_nfd_digits"] = (d, None, False)

    d = copy.deepcopy(bl)
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithNext",
         "invert": False},
        {"type": "Split", "pattern": {"Regex": r"\p{N}+"}, "behavior": "Contiguous",
         "invert": False},
        {"type": "Split", "pattern": {"Regex": r"[,.;:]"}, "behavior": "MergedWithPrevious",
         "invert": False},
        {"type": "Split", "pattern": {"Regex": r"\S+|\s+"}, "behavior": "Removed",
         "invert": True},
        {"type": "Split", "pattern": {"Regex": "e*"}, "behavior": "Isolated", "invert": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    d["added_tokens"] += [added("<L>", special=True, lstrip=True),
                          added("<R>", special=True, rstrip=True),
                          added("<LR>", special=True, lstrip=True, rstrip=True),
                          added(" God", special=False, normalized=False, single_word=True)]
    out["bytelevel_split_behaviors"] = (d, None, False)

    d = copy.deepcopy(bl)
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Whitespace"}, {"type": "Digits", "individual_digits": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    out["bytelevel_whitespace"] = (d, None, False)

    d = copy.deepcopy(bl)
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"}, {"type": "CharDelimiterSplit", "delimiter": "e"},
        {"type": "FixedLength", "length": 4},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    out["bytelevel_whitespacesplit"] = (d, None, False)

    # Byte-level symbols missing from the vocabulary: HF drops those characters.
    d = copy.deepcopy(bl)
    for sym in ["Ġ", "Ċ", "ĉ", "Ã", "Ĳ"]:
        d["model"]["vocab"].pop(sym, None)
    d["model"]["merges"] = [m for m in d["model"]["merges"]
                            if all(s in d["model"]["vocab"] for s in m)
                            and "".join(m) in d["model"]["vocab"]]
    out["bytelevel_missing_symbols"] = (d, None, False)

    # Added tokens whose file ids disagree with the ids HF assigns, one inside the model
    # vocabulary, and a gap after it.
    d = copy.deepcopy(bl)
    d["added_tokens"] += [dict(added("<|gap|>"), id=5000), dict(added("the"), id=7),
                          dict(added("<|next|>"), id=4000)]
    out["bytelevel_added_ids"] = (d, None, True)

    sp = train_sentencepiece(corpus)
    d = copy.deepcopy(sp)
    d["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, replace(" ", "▁")]}
    d["pre_tokenizer"] = None
    out["llama2_legacy"] = (d, None, True)

    out["sp_metaspace_first"] = (copy.deepcopy(sp), None, False)

    # A token with "▁" after another character: merges may then cross word starts.
    d = copy.deepcopy(out["llama2_legacy"][0])
    d["model"]["vocab"]["e▁"] = len(d["model"]["vocab"])
    d["model"]["merges"].insert(0, ["e", "▁"])
    out["sp_merge_across_words"] = (d, None, True)

    d = copy.deepcopy(sp)
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                          "split": False}
    out["mistral_nosplit"] = (d, None, False)

    d = copy.deepcopy(sp)
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                          "split": True}
    d["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                    "split": True}
    d["added_tokens"] += [added("[INST]"), added("[/INST]")]
    out["sp_metaspace_always"] = (d, None, False)

    d = copy.deepcopy(sp)
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never",
                          "split": True}
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁",
                                   "prepend_scheme": "never", "split": True},
        {"type": "Fuse"}]}
    out["sp_metaspace_never"] = (d, None, True)

    # Gemma: <pad> <eos> <bos> <unk> first, spaces replaced by the normalizer, no prefix.
    d = copy.deepcopy(sp)
    vocab = d["model"]["vocab"]
    for name, new in [("<unk>", "<pad>"), ("<s>", "<eos>"), ("</s>", "<bos>")]:
        vocab[new] = vocab.pop(name)
    vocab["<unk>"] = len(vocab)
    d["model"]["unk_token"] = "<unk>"
    d["added_tokens"] = [dict(added(t), id=vocab[t]) for t in ["<pad>", "<eos>", "<bos>",
                                                                "<unk>"]]
    d["added_tokens"] += [added("<start_of_turn>"), added("<end_of_turn>")]
    d["normalizer"] = replace(" ", "▁")
    d["pre_tokenizer"] = None
    d["decoder"] = {"type": "Sequence", "decoders": [
        replace("▁", " "), {"type": "ByteFallback"}, {"type": "Fuse"}]}
    out["gemma"] = (d, None, True)

    for fuse in (True, False):
        d = copy.deepcopy(sp)
        d["model"]["byte_fallback"] = False
        d["model"]["fuse_unk"] = fuse
        out["sp_unk_fuse" if fuse else "sp_unk_nofuse"] = (d, None, False)

    d = copy.deepcopy(sp)
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "BertPreTokenizer"},
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}]}
    d["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Nmt"}, {"type": "NFKC"}]}
    d["decoder"] = None
    out["sp_bert_nmt"] = (d, None, False)

    out["suffix_eow"] = (train_with_affix(corpus, suffix="</w>"), None, False)
    out["prefix_cont"] = (train_with_affix(corpus, prefix="##"), None, False)

    tt, tt_config = torchtitan_like(bl)
    out["torchtitan_test"] = (tt, tt_config, False)
    return out


def make_all(corpus: str, byte_level_path: str, texts_path: str, outdir: str) -> None:
    with open(byte_level_path, encoding="utf-8") as f:
        byte_level = json.load(f)
    with open(texts_path, encoding="utf-8") as f:
        texts = json.load(f)
    expected = {}
    tt_class = None
    for name, (doc, config, round_trip) in families(corpus, byte_level).items():
        folder = os.path.join(outdir, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)
        if config is not None:
            with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, ensure_ascii=False, indent=2)
            tt_class = tt_class or torchtitan_tokenizer_class()
            wrapper = tt_class(folder)
            tok, bos, eos = wrapper.tokenizer, wrapper.bos_id, wrapper.eos_id
        else:
            tok = Tokenizer.from_file(path)
            bos = eos = None
        e = encode_all(tok, texts)
        names = ["<s>", "</s>", "<bos>", "<eos>", "<|begin_of_text|>", "<|end_of_text|>"]
        e.update(max_id_plus_one=max(tok.get_vocab(with_added_tokens=True).values()) + 1,
                 round_trip=round_trip, bos=bos, eos=eos,
                 ids_of={n: tok.token_to_id(n) for n in names})
        expected[name] = e
    with open(os.path.join(outdir, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f)


def bench(tok_path: str, corpus: str) -> None:
    """encode_batch over the corpus documents (blank-line separated), best of 3; threads as
    RAYON_NUM_THREADS says. Prints {"mb_per_s": ..., "ids": ...}."""
    import time

    tok = Tokenizer.from_file(tok_path)
    with open(corpus, encoding="utf-8") as f:
        text = f.read()
    docs = text.split("\n\n")
    best, n_ids = float("inf"), 0
    for _ in range(3):
        t0 = time.perf_counter()
        encs = tok.encode_batch(docs, add_special_tokens=False)
        best = min(best, time.perf_counter() - t0)
        n_ids = sum(len(e.ids) for e in encs)
    print(json.dumps({"mb_per_s": len(text.encode()) / 1e6 / best, "ids": n_ids}))


def main() -> None:
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "encode":
        encode(*args)
    elif cmd == "make-split":
        make_split(*args)
    elif cmd == "prefix-space":
        prefix_space(*args)
    elif cmd == "merges-form":
        with open(args[0], encoding="utf-8") as f:
            print(merges_form(json.load(f)))
    elif cmd == "make-all":
        make_all(*args)
    elif cmd == "bench":
        bench(*args)
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
