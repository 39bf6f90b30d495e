"""Independent reference for the token-data readers (test/core/data/test_token_source.cpp).

  data_ref.py make DIR       write fixtures of every format into DIR and DIR/manifest.json:
                             per path spec, what numpy's memmap reads (token count, document
                             starts, every window of SEQ_LEN + 1 tokens) and, for Megatron data,
                             the documents megatron-core's IndexedDataset returns
  data_ref.py read-tok FILE  read a .tok v2 with numpy memmap; print header, offsets, tokens

.tok v2 files are written here from the published layout (docs/data.md) with numpy, Megatron
files by megatron-core's own IndexedDatasetBuilder, llm.c shards as llm.c writes them (a
256 x int32 header, then uint16 tokens).
"""
import glob
import json
import os
import struct
import sys
import warnings

import numpy as np

SEQ_LEN = 63  # windows of 64 tokens
TOK_ALIGN = 4096


def write_tok_v2(path, docs, vocab):
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.uint64)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    width = np.dtype(dtype).itemsize
    tok_at = (64 + 8 * len(offsets) + TOK_ALIGN - 1) // TOK_ALIGN * TOK_ALIGN
    max_id = int(tokens.max()) if len(tokens) else 0
    header = b"TITANTOK" + struct.pack("<IIQQQQQQ", 2, width, len(docs), len(tokens), vocab,
                                       max_id, 64, tok_at)
    with open(path, "wb") as f:
        f.write(header)
        f.write(offsets.tobytes())
        f.write(b"\0" * (tok_at - 64 - 8 * len(offsets)))
        f.write(tokens.astype(dtype).tobytes())


def read_tok_v2(path):
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    assert bytes(raw[:8]) == b"TITANTOK", path
    version, width, docs, ntok, vocab, max_id, off_at, tok_at = struct.unpack(
        "<IIQQQQQQ", bytes(raw[8:64]))
    offsets = np.memmap(path, dtype=np.uint64, mode="r", offset=off_at, shape=(docs + 1,))
    dtype = np.uint16 if width == 2 else np.uint32
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=tok_at, shape=(ntok,)) if ntok else \
        np.zeros(0, dtype)
    header = dict(version=version, width=width, docs=docs, tokens=ntok, vocab=vocab,
                  max_id=max_id, offsets_at=off_at, tokens_at=tok_at, size=len(raw))
    return header, offsets.astype(np.int64), tokens.astype(np.int64)


MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def read_megatron(prefix):
    """(stream, document start positions) read with numpy memmap from the published layout."""
    idx = np.memmap(prefix + ".idx", dtype=np.uint8, mode="r")
    assert bytes(idx[:9]) == b"MMIDIDX\x00\x00"
    (code,) = struct.unpack("<B", bytes(idx[17:18]))
    seqs, ndoc = struct.unpack("<QQ", bytes(idx[18:34]))
    dtype = MEGATRON_DTYPES[code]
    pointers = np.memmap(prefix + ".idx", dtype=np.int64, mode="r", offset=34 + 4 * seqs,
                         shape=(seqs,))
    doc_idx = np.memmap(prefix + ".idx", dtype=np.int64, mode="r", offset=34 + 12 * seqs,
                        shape=(ndoc,))
    stream = np.memmap(prefix + ".bin", dtype=dtype, mode="r").astype(np.int64)
    itemsize = np.dtype(dtype).itemsize
    starts = [int(pointers[s]) // itemsize if s < seqs else len(stream) for s in doc_idx]
    return stream, starts


def read_llmc(path):
    header = np.memmap(path, dtype=np.int32, mode="r", shape=(256,))
    assert header[0] == 20240520 and header[1] == 1
    return np.memmap(path, dtype=np.uint16, mode="r", offset=1024,
                     shape=(int(header[2]),)).astype(np.int64)


def write_llmc(path, tokens):
    header = np.zeros(256, np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, np.uint16).tobytes())


def random_docs(rng, n, vocab, lo=20, hi=300):
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))) for _ in range(n)]


def write_megatron(prefix, docs, dtype, split_some=False):
    import torch  # megatron-core's builder takes tensors
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, d in enumerate(docs):
        if split_some and i % 2 == 1 and len(d) > 10:  # a document of several sequences
            cut = len(d) // 3
            builder.add_document(torch.tensor(d), [cut, len(d) - cut])
        else:
            builder.add_item(torch.tensor(d))
            builder.end_document()
    builder.finalize(prefix + ".idx")


def megatron_documents(prefix):
    """Every document as megatron-core's own reader returns it."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(prefix, mmap=True)
    out = []
    doc_idx = ds.document_indices
    for d in range(len(doc_idx) - 1):
        parts = [np.asarray(ds[s]) for s in range(doc_idx[d], doc_idx[d + 1])]
        out.append(np.concatenate(parts).astype(np.int64).tolist() if parts else [])
    return out


def entry(spec, fmt, stream, starts, megatron_prefixes=None):
    n = len(stream)
    w = SEQ_LEN + 1
    e = dict(spec=spec, format=fmt, tokens=n, docs=len(starts) - 1 if starts is not None else -1,
             doc_starts=starts if starts is not None else [],
             windows=[stream[i * w:(i + 1) * w].tolist() for i in range(n // w)],
             max_id=int(stream.max()))
    if megatron_prefixes:
        e["megatron_docs"] = sum((megatron_documents(p) for p in megatron_prefixes), [])
    return e


def concat(parts):
    """Streams and document starts of shards taken back to back."""
    stream, starts, base = [], [0], 0
    for s, st in parts:
        stream.append(s)
        starts.extend(base + x for x in st[1:])
        base += len(s)
    return np.concatenate(stream), starts


def make(root):
    warnings.filterwarnings("ignore")
    rng = np.random.default_rng(0)
    out = []
    sub = lambda *p: os.path.join(root, *p)
    for d in ("tokdir", "megdir", "llmc"):
        os.makedirs(sub(d), exist_ok=True)

    # .tok v2: one u16 file, one u32 file, a folder / glob of three shards.
    write_tok_v2(sub("a.tok"), random_docs(rng, 7, 2048), 2048)
    write_tok_v2(sub("wide.tok"), random_docs(rng, 5, 70000), 70000)
    for i in range(3):
        write_tok_v2(sub("tokdir", f"shard_{i:03d}.tok"), random_docs(rng, 4 + i, 2048), 2048)
    with open(sub("tokdir", "README.txt"), "w") as f:
        f.write("not a shard; a folder's other files are ignored\n")
    for spec in ("a.tok", "wide.tok"):
        _, offs, toks = read_tok_v2(sub(spec))
        out.append(entry(sub(spec), "tok v2", toks, offs.tolist()))
    shards = sorted(glob.glob(sub("tokdir", "shard_*.tok")))
    parts = [(read_tok_v2(p)[2], read_tok_v2(p)[1].tolist()) for p in shards]
    stream, starts = concat(parts)
    out.append(entry(sub("tokdir"), "tok v2", stream, starts))
    out.append(entry(sub("tokdir", "shard_*.tok"), "tok v2", stream, starts))

    # Megatron: uint16 and int32 (megatron-core's dtype rule), documents of one or two
    # sequences; named as .bin, .idx and prefix; a folder of two pairs.
    write_megatron(sub("m16"), random_docs(rng, 9, 2048), np.uint16, split_some=True)
    write_megatron(sub("m32"), random_docs(rng, 6, 70000), np.int32, split_some=True)
    for i in range(2):
        write_megatron(sub("megdir", f"part_{i}"), random_docs(rng, 5, 2048), np.uint16)
    s16, st16 = read_megatron(sub("m16"))
    for spec in (sub("m16.bin"), sub("m16.idx"), sub("m16")):
        out.append(entry(spec, "megatron", s16, st16, [sub("m16")]))
    s32, st32 = read_megatron(sub("m32"))
    out.append(entry(sub("m32"), "megatron", s32, st32, [sub("m32")]))
    prefixes = [sub("megdir", f"part_{i}") for i in range(2)]
    stream, starts = concat([read_megatron(p) for p in prefixes])
    out.append(entry(sub("megdir"), "megatron", stream, starts, prefixes))

    # llm.c: two training shards and a validation shard the glob must not pick up.
    for name in ("fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"):
        write_llmc(sub("llmc", name), rng.integers(0, 2048, size=int(rng.integers(500, 900))))
    train = sorted(glob.glob(sub("llmc", "fineweb_train_*.bin")))
    out.append(entry(train[0], "llm.c", read_llmc(train[0]), None))
    out.append(entry(sub("llmc", "fineweb_train_*.bin"), "llm.c",
                     np.concatenate([read_llmc(p) for p in train]), None))
    with open(sub("manifest.json"), "w") as f:
        json.dump(dict(seq_len=SEQ_LEN, sources=out), f)


def main():
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "read-tok":
        header, offsets, tokens = read_tok_v2(sys.argv[2])
        print(json.dumps(dict(header=header, offsets=offsets.tolist(), tokens=tokens.tolist())))
    else:
        sys.exit("usage: data_ref.py make DIR | read-tok FILE")


if __name__ == "__main__":
    main()
