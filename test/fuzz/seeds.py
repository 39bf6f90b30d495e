"""Writes the seed inputs of the libFuzzer targets (test/fuzz/fuzz_*.cpp): valid files of
every format each reader takes, made by the reference writers where one exists (Python
safetensors, tokenizers, pyarrow, zstandard), plus hand-made edge cases. Usage:
    seeds.py OUT_DIR        -> OUT_DIR/<target>/<seed files>
The checkpoint_meta target writes its own seed (a metadata.json from CheckpointWriter)."""
import gzip
import io
import json
import os
import struct
import sys

out = sys.argv[1]
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors_seeds():
    import torch
    from safetensors.torch import save

    put("safetensors", "mixed", save({"w": torch.randn(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16),
                                      "i": torch.arange(4), "m": torch.tensor([True, False])},
                                     metadata={"format": "pt"}))
    for dt in [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool]:
        put("safetensors", str(dt)[6:], save({"t": torch.ones(2, 2, dtype=dt), "s": torch.tensor(1, dtype=dt),
                                              "e": torch.ones(0, 3, dtype=dt)}))

    def raw(name, header, data=b""):
        h = header.encode()
        put("safetensors", name, struct.pack("<Q", len(h)) + h + data)
    raw("empty", "{}")
    raw("meta_null", '{"__metadata__": null}')
    raw("padded", '{"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}    ', b"xyz")


def tokenizer_seeds():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    text = ["In the beginning God created the heaven and the earth.",
            "And the earth was without form, and void; caf\u00e9 \u20ac 123 456 7890"] * 20
    bl = Tokenizer(models.BPE())
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    bl.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    put("tokenizer", "byte_level.json", bl.to_str())
    sp = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] +
                                                     [f"<0x{b:02X}>" for b in range(256)]))
    put("tokenizer", "sentencepiece_style.json", sp.to_str())
    put("tokenizer", "not_bpe.json", json.dumps({"model": {"type": "WordPiece", "vocab": {"a": 0}}}))
    put("tokenizer", "bytes", "bytes")
    # An id near 2^31 once sized a 16 GiB id table (libFuzzer: out-of-memory); kept as a seed.
    huge = json.loads(bl.to_str())
    huge["model"]["vocab"]["zzzq"] = 2147483000
    put("tokenizer", "huge_id.json", json.dumps(huge))


def config_seeds():
    for name in sorted(os.listdir(os.path.join(root, "configs"))):
        with open(os.path.join(root, "configs", name), "rb") as f:
            put("config", name, b"\0" + f.read())
    put("config", "small.toml", b'\0[training]\nsteps = 5\nseq_len = 64\n[model]\nflavor = "debugmodel"\n')
    # toml++ 3.3's undefined behaviour on non-ASCII where it looks for whitespace (a finding
    # of this target, now refused first: core/config/config_toml.cpp NonAsciiGuard).
    put("config", "nonascii_bare_key", b'\0[t\xc6\xa0iaset = t:a\n')
    put("config", "nonascii_after_backslash", b'\0[job]\ndescription = """a\\\n  \xc6\xa0"""\n')
    put("config", "argv_basic", b"\1--training.steps=5\n--training.seq_len=64\n--model.name=llama3")
    put("config", "argv_lists", b"\1--checkpoint.exclude_from_loading=a,b\n--training.steps\n7\n--dump-config")
    put("config", "argv_float", b"\1--optimizer.lr=3e-4\n--lr_scheduler.warmup_steps=2\n--help")


def tok_v2(tokens, offsets, vocab, width=2):
    n, d = len(tokens), len(offsets) - 1
    head = b"TITANTOK" + struct.pack("<IIQQQQQQ", 2, width, d, n, vocab, max(tokens, default=0), 64, 4096)
    body = struct.pack(f"<{d + 1}Q", *offsets)
    pad = b"\0" * (4096 - len(head) - len(body))
    return head + body + pad + struct.pack(f"<{n}{'H' if width == 2 else 'I'}", *tokens)


def megatron(docs, code=8):
    fmt = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 8: "H"}[code]
    item = struct.calcsize(fmt)
    sizes = [len(x) for x in docs]
    pointers, p = [], 0
    for s in sizes:
        pointers.append(p)
        p += s * item
    idx = (b"MMIDIDX\0\0" + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1) +
           struct.pack(f"<{len(docs)}i", *sizes) + struct.pack(f"<{len(docs)}q", *pointers) +
           struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))
    bin_ = b"".join(struct.pack(f"<{len(x)}{fmt}", *x) for x in docs)
    return idx, bin_


def token_source_seeds():
    # First byte: format in the low 2 bits, vocabulary index (see the target) above them.
    toks = [1, 2, 3, 255, 0, 7, 9, 299]
    put("token_source", "tok_u16", bytes([0 | 2 << 2]) + tok_v2(toks, [0, 3, 8], 300))
    put("token_source", "tok_u32", bytes([0 | 5 << 2]) + tok_v2([70000, 5], [0, 1, 2], 128256, width=4))
    put("token_source", "tok_empty", bytes([0 | 1 << 2]) + tok_v2([], [0], 256))
    llmc = struct.pack("<256i", *([20240520, 1, 6] + [0] * 253)) + struct.pack("<6H", 50256, 1, 2, 3, 4, 50256)
    put("token_source", "llmc", bytes([1 | 3 << 2]) + llmc)
    for code in (1, 3, 4, 8):
        idx, bin_ = megatron([[1, 2, 3], [4, 5], [6]], code)
        put("token_source", f"megatron_{code}", bytes([2 | 2 << 2]) + struct.pack("<H", len(idx)) + idx + bin_)


def text_reader_seeds():
    # First byte: format in the low 2 bits (txt, jsonl, jsonl.gz, jsonl.zst), batch size above.
    import zstandard
    txt = b"first document\nstill first\n\n\nsecond doc caf\xc3\xa9\n\n  \nthird"
    jsonl = (b'{"text": "one \\u00e9 \\ud83d\\ude00", "id": 1}\n{"id": 2, "text": "two\\nlines"}\n'
             b'\n{"text": ""}\r\n{"text": "tab\\t", "meta": {"a": [1, 2]}}')
    for fmt, data in ((0, txt), (1, jsonl), (2, gzip.compress(jsonl)),
                      (3, zstandard.ZstdCompressor().compress(jsonl))):
        for shift in (0, 3, 10):
            put("text_reader", f"f{fmt}_b{shift}", bytes([fmt | shift << 4]) + data)
    multi = gzip.compress(b'{"text": "a"}\n') + gzip.compress(b'{"text": "b"}\n')
    put("text_reader", "gz_members", bytes([2 | 2 << 4]) + multi)


def parquet_seeds():
    import pyarrow as pa
    import pyarrow.parquet as pq
    t = pa.table({"text": ["alpha", "beta caf\u00e9", "", "gamma " * 10], "id": [1, 2, 3, 4]})
    for comp in ("NONE", "SNAPPY", "ZSTD"):
        b = io.BytesIO()
        pq.write_table(t, b, compression=comp, row_group_size=2)
        put("parquet", f"text_{comp.lower()}", b.getvalue())
    b = io.BytesIO()
    pq.write_table(pa.table({"text": pa.array(["x", None], pa.large_string())}), b)
    put("parquet", "large_string_null", b.getvalue())
    b = io.BytesIO()
    pq.write_table(pa.table({"text": [1, 2]}), b)
    put("parquet", "int_column", b.getvalue())


for f in (safetensors_seeds, tokenizer_seeds, config_seeds, token_source_seeds, text_reader_seeds,
          parquet_seeds):
    f()
