#!/usr/bin/env python3
"""Train the bundled byte-level BPE tokenizer (GPT-2 / Llama-3 style) with HF tokenizers.

The vocabulary (2048) matches the debug flavors. <|begin_of_text|> and <|end_of_text|>
are added as special tokens, as in Llama-3.
"""
import argparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([args.corpus], trainer)
    tok.save(args.out)
    print(f"[train_tokenizer] vocab {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
