#!/usr/bin/env python3
"""Reference side of test/core/data/test_tokenize.cpp and the tokenize part of scripts/bench_data.sh.

Independent of titan-train's C++: documents are parsed with Python's json module, encoded
with Hugging Face `tokenizers`, token files read with numpy, Megatron files written and read
by megatron-core, compressed and columnar inputs written by gzip, zstandard and pyarrow.

  inputs JSONL OUTDIR
      OUTDIR/in.jsonl.gz (two gzip members), in.jsonl.zst (two zstd frames), in.parquet
      (the "text" column plus an "id" column, 3 row groups), nofield.parquet (a "body"
      column only) and dict.parquet (Arrow dictionary-typed "text"), all holding JSONL's
      documents.
  check-tok TOKENIZER DOCS BOS EOS TOK...
      DOCS is a .txt (blank-line separated) or .jsonl ("text"); BOS/EOS are ids or -1. Checks
      the .tok v2 layout of each TOK (header, offsets, zero padding, 4096-aligned tokens, max
      id, exact size) and that their documents, in order, equal BOS + encode_batch(texts,
      add_special_tokens=False) + EOS. Prints "ok DOCS TOKENS".
  megatron-compare TOK PREFIX VOCAB [TOK PREFIX VOCAB ...]
      Rebuilds TOK's documents (its .tok v2 layout checked as above) with megatron-core's
      IndexedDatasetBuilder (dtype by its optimal_dtype(VOCAB)) and compares PREFIX.bin/.idx
      byte for byte; then reads PREFIX with IndexedDataset and compares every document.
      Prints "ok DOCS" per triple.
  hf-bench TOKENIZER JSONL
      Seconds of encode_batch over JSONL's texts (threads: RAYON_NUM_THREADS), after loading
      them. Prints "hf_seconds S bytes B docs D".
"""
import gzip
import json
import os
import sys
import tempfile
import time

import numpy as np


def read_docs(path, field="text"):
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".jsonl"):
        docs = []
        for line in raw.decode("utf-8").split("\n"):
            if line.strip(" \t\r") == "":
                continue
            docs.append(json.loads(line)[field])
        return docs
    # .txt: runs of non-blank lines ("blank" = only spaces, tabs, CR) joined by "\n".
    docs, cur = [], []
    for line in raw.decode("utf-8").split("\n"):
        if line.strip(" \t\r") == "":
            if cur:
                docs.append("\n".join(cur))
                cur = []
        else:
            cur.append(line)
    if cur:
        docs.append("\n".join(cur))
    return docs


def cmd_inputs(jsonl, outdir):
    docs = read_docs(jsonl)
    data = open(jsonl, "rb").read()
    half = data.index(b"\n", len(data) // 2) + 1
    with open(os.path.join(outdir, "in.jsonl.gz"), "wb") as f:
        f.write(gzip.compress(data[:half]))
        f.write(gzip.compress(data[half:]))
    import zstandard

    c = zstandard.ZstdCompressor(level=3)
    with open(os.path.join(outdir, "in.jsonl.zst"), "wb") as f:
        f.write(c.compress(data[:half]))
        f.write(c.compress(data[half:]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, os.path.join(outdir, "in.parquet"),
                   row_group_size=max(1, (len(docs) + 2) // 3))
    pq.write_table(pa.table({"body": docs}), os.path.join(outdir, "nofield.parquet"))
    dict_type = pa.dictionary(pa.int32(), pa.string())
    pq.write_table(pa.table({"text": pa.array(docs).dictionary_encode().cast(dict_type)}),
                   os.path.join(outdir, "dict.parquet"))


def read_tok_v2(path):
    """(docs as a list of int arrays) after checking every layout rule of docs/data.md."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    assert bytes(raw[:8]) == b"TITANTOK", path
    version, width = np.frombuffer(raw[8:16], dtype="<u4")
    d, n, vocab, max_id, off_start, tok_start = np.frombuffer(raw[16:64], dtype="<u8")
    assert version == 2 and width in (2, 4), (path, version, width)
    assert width == (2 if vocab <= 65536 else 4), (path, width, vocab)
    assert off_start == 64 and tok_start % 4096 == 0, (path, off_start, tok_start)
    assert tok_start >= 64 + 8 * (d + 1), path
    assert len(raw) == tok_start + n * width, (path, len(raw), tok_start, n, width)
    offsets = np.frombuffer(raw[64:64 + 8 * (d + 1)], dtype="<u8")
    assert offsets[0] == 0 and offsets[-1] == n and np.all(np.diff(offsets.astype(np.int64)) >= 0)
    assert not raw[64 + 8 * (d + 1):tok_start].any(), "padding must be zero"
    toks = np.frombuffer(raw[tok_start:], dtype="<u2" if width == 2 else "<u4")
    assert (int(toks.max()) if n else 0) == max_id, (path, max_id)
    assert n == 0 or max_id < vocab
    return [toks[offsets[i]:offsets[i + 1]] for i in range(d)], int(vocab)


def cmd_check_tok(tok_path, docs_path, bos, eos, toks):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    texts = read_docs(docs_path)
    enc = tok.encode_batch(texts, add_special_tokens=False)
    got = []
    for t in toks:
        got += read_tok_v2(t)[0]
    if len(got) != len(texts):
        sys.exit(f"document count {len(got)} != reference {len(texts)}")
    total = 0
    for i, (g, e) in enumerate(zip(got, enc)):
        ref = ([bos] if bos >= 0 else []) + e.ids + ([eos] if eos >= 0 else [])
        if g.tolist() != ref:
            sys.exit(f"document {i} differs: got {g.tolist()[:20]} ref {ref[:20]}")
        total += len(ref)
    print(f"ok {len(got)} {total}")


def megatron_compare(docs, vocab, prefix):
    import torch
    from megatron.core.datasets.indexed_dataset import (DType, IndexedDataset,
                                                        IndexedDatasetBuilder)

    dtype = DType.optimal_dtype(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        ref = os.path.join(tmp, "ref")
        b = IndexedDatasetBuilder(ref + ".bin", dtype=dtype)
        for d in docs:
            b.add_document(torch.tensor(np.asarray(d, dtype=np.int64)), [len(d)])
        b.finalize(ref + ".idx")
        for ext in (".bin", ".idx"):
            a, r = open(prefix + ext, "rb").read(), open(ref + ext, "rb").read()
            if a != r:
                first = next((i for i in range(min(len(a), len(r))) if a[i] != r[i]), None)
                sys.exit(f"{ext} differs from megatron-core's: sizes {len(a)} vs {len(r)}, "
                         f"first difference at byte {first}")
    ds = IndexedDataset(prefix)
    if len(ds) != len(docs):
        sys.exit(f"IndexedDataset has {len(ds)} sequences, expected {len(docs)}")
    for i, d in enumerate(docs):
        if ds[i].tolist() != list(d):
            sys.exit(f"IndexedDataset sequence {i} differs")
    if ds.document_indices.tolist() != list(range(len(docs) + 1)):
        sys.exit("document_indices differ")
    print(f"ok {len(docs)}")


def cmd_hf_bench(tok_path, jsonl):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    texts = read_docs(jsonl)
    t0 = time.perf_counter()
    tok.encode_batch(texts, add_special_tokens=False)
    dt = time.perf_counter() - t0
    print(f"hf_seconds {dt:.4f} bytes {os.path.getsize(jsonl)} docs {len(texts)}")


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "inputs":
        cmd_inputs(*args)
    elif cmd == "check-tok":
        cmd_check_tok(args[0], args[1], int(args[2]), int(args[3]), args[4:])
    elif cmd == "megatron-compare":
        for i in range(0, len(args), 3):
            docs, _ = read_tok_v2(args[i])
            megatron_compare([d.tolist() for d in docs], int(args[i + 2]), args[i + 1])
    elif cmd == "hf-bench":
        cmd_hf_bench(*args)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
