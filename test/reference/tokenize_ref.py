#!/usr/bin/env python3
"""Reference side of test/core/test_tokenizer.cpp, using Hugging Face `tokenizers`.

  encode TOKENIZER IN.json OUT.json   IN is a JSON list of strings; OUT gets
                                      {"ids": [[...], ...]} from encode(s, add_special_tokens=False)
  make-split CORPUS OUT.json          trains a small BPE with the Llama-3 pre-tokenizer
                                      (Sequence[Split(regex, Isolated), ByteLevel(use_regex=False)]),
                                      adds a special token after the model vocab as Llama-3 does,
                                      and stores merges as "a b" strings with ignore_merges true
  prefix-space IN.json OUT.json       copy of IN with the ByteLevel add_prefix_space set to true
  merges-form TOKENIZER               prints "pairs" or "strings"
"""
import json
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def merges_form(doc: dict) -> str:
    forms = {"strings" if isinstance(m, str) else "pairs" for m in doc["model"]["merges"]}
    if len(forms) != 1:
        raise SystemExit(f"mixed or empty merges: {forms}")
    return forms.pop()


def encode(tok_path: str, in_path: str, out_path: str) -> None:
    tok = Tokenizer.from_file(tok_path)
    with open(in_path, encoding="utf-8") as f:
        texts = json.load(f)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"ids": [e.ids for e in encs]}, f)


def make_split(corpus: str, out_path: str) -> None:
    with open(corpus, encoding="utf-8") as f:
        text = f.read()
    docs = text[: 600_000].split("\n\n")
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
    tok.train_from_iterator(docs, trainer)
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
    else:
        raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
