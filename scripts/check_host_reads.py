#!/usr/bin/env python3
"""Fails when the training step's sources read device values on the host outside the named
helpers listed below (docs/training.md, "A capture-ready step").

A non-logging step must not wait for the device: every host read is a synchronization, and a
CUDA graph cannot contain one. The step's code (the model, MoE, the fused ops and loss, the
optimizer, the step itself, the trainer, DDP/FSDP/expert parallelism and the process group)
is scanned, comments and string literals blanked, for
    .item   .cpu()   .to(kCPU   .tolist   data_ptr   _local_scalar_dense      (device to host)
    at::tensor(  torch::tensor(  from_blob(        (a host vector made a tensor: host to device)
    nonzero  argwhere  masked_select  unique  bincount     (output sized by the data: a read)
and each hit must sit inside a function of ALLOWED (file, function) with its reason: the one
read the step may need (counts_to_host: the MoE loop backend's per-layer counts, or the exact
expert-parallel exchange's split sizes) and reads that only logging steps, validation,
start-up or the reference optimizer make. data_ptr
is also allowed in the kernel launchers of KERNEL_FILES, which hand pointers to kernels
running on the tensor's own device and never read device memory on the host.

`--self-test` runs the scanner on a temporary tree with known violations and checks that it
reports exactly those (so this check can fail).
"""
import argparse
import fnmatch
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_function_length import functions, strip_code  # noqa: E402

HOT_PATH = [
    "models/*.cpp", "models/*.h", "models/*.cu",
    "moe/*.cpp", "moe/*.h", "moe/*.cu",
    "core/train/functional.*", "core/kernels/ops*", "core/kernels/float8*", "core/train/float8_linears.*", "core/kernels/fused_loss.*", "core/train/optimizer.*",
    "core/train/recompute.*", "core/train/model.*", "core/train/grad_sync.h", "core/train/expert_exchange.h",
    "app/train_step.*", "app/trainer.*", "app/compiled_step.*", "app/ep_capacity.*",
    "core/train/capture_check.*",
    "parallel/ddp.*", "parallel/fsdp.*", "parallel/flat_grad_allreduce.*",
    "parallel/expert_parallel.*", "parallel/process_group.*",
    "core/train/context_parallel.*", "parallel/context_parallel.*",
    "parallel/tensor_parallel.*", "core/train/tensor_parallel.h",
    "core/kernels/weight_grad_store.*", "parallel/pipeline_runner.*",
]
# In a hot-path folder but outside the step.
NOT_HOT = {
    "models/hf_interop.cpp": "Hugging Face import and export",
    "models/hf_interop.h": "Hugging Face import and export",
    "models/hf_interop_detail.h": "Hugging Face import and export",
    "models/hf_llama3.cpp": "Hugging Face import and export",
    "models/hf_deepseek_v3.cpp": "Hugging Face import and export",
    "models/hf_qwen3.cpp": "Hugging Face import and export",
    "models/hf_gpt_oss.cpp": "Hugging Face import and export",
    "models/generation.cpp": "text generation (titan-train generate), not a training step",
    "models/generation.h": "text generation (titan-train generate), not a training step",
    "models/kv_cache.cpp": "text generation (titan-train generate), not a training step",
    "models/kv_cache.h": "text generation (titan-train generate), not a training step",
    "models/hf_fp8.cpp": "Hugging Face import and export",
    "models/hf_fp8.h": "Hugging Face import and export",
    "models/registry.cpp": "model construction",
    "models/registry.h": "model construction",
}

# (file, function) -> why a host read is allowed there.
ALLOWED = {
    ("app/trainer.cpp", "Trainer::probe_cpu_float8"):
        "start-up only: the ranks' agreed verdict of the float8 CPU _scaled_mm probe",
    ("parallel/expert_parallel.cpp", "take_static_peak_rows"):
        "logging steps only: the static exchange's peak pair load for the metrics",
    ("core/train/expert_exchange.h", "counts_to_host"):
        "the named read: the loop backend's per-expert row counts, or the exact expert-parallel "
        "exchange's split sizes (one per MoE layer and forward, cached across recompute)",
    ("moe/moe_layer.cpp", "moe_load_metrics"):
        "logging steps only: the expert-load metrics of the log line",
    ("core/train/optimizer.cpp", "AdamW::loop_step"):
        "optimizer.implementation = \"for-loop\", the textbook reference (reads the step count)",
    ("app/train_step.cpp", "plant_host_read"):
        "test seam only (debug.plant_error = host_read): the read the capture check must refuse",
    ("app/trainer.cpp", "Trainer::log_step"):
        "logging steps only: the loss, grad norm and metrics of the log line",
    ("app/trainer.cpp", "Trainer::validate"):
        "validation steps only: the validation loss",
    ("app/trainer.cpp", "Trainer::load_hf_init"):
        "start-up only: the most bytes any rank read of the Hugging Face initial weights",
    ("app/ep_capacity.cpp", "EpCapacityControl::settle"):
        "the expert-parallel overflow flag: one 16-byte read per step, between the forward+backward "
        "and the optimizer phases (outside both captured graphs; docs/moe.md, Dropless capture)",
    ("app/ep_capacity.cpp", "grad_storage"):
        "the gradients' addresses, to check the re-run keeps them (data_ptr; no read)",
    ("core/train/context_parallel.cpp", "ContextParallel::cached"):
        "context parallel: the positions, mask and order index tensors, copied to the device "
        "once per (length, device) on the first step and reused after (never read back)",
    ("models/attention.cpp", "tile_first_key"):
        "CPU tensors only, never under the capture check: the document start of each block-causal "
        "query tile, read from host memory (the CUDA path is varlen flash, with no read)",
    ("app/compiled_step.cpp", "step_inputs_key"):
        "the input buffers' addresses as the capture's key (data_ptr of CUDA tensors; no read)",
}
# data_ptr in these files passes pointers to kernels; it is not a host read.
KERNEL_FILES = ["moe/grouped_gemm.cpp", "moe/grouped_gemm_cutlass.cu", "moe/grouped_gemm_kernels.h",
                "core/kernels/ops.cpp", "core/kernels/ops.cu", "core/kernels/ops_cpu_*.cpp", "core/kernels/ops_kernels.h",
                "core/kernels/ops_cpu_kernels.h"]

READS = [
    (re.compile(r"\.\s*item\s*[<(]"), ".item"),
    (re.compile(r"\.\s*cpu\s*\(\s*\)"), ".cpu()"),
    (re.compile(r"\.\s*to\s*\(\s*(?:(?:at|torch|c10)::)?(?:kCPU\b|DeviceType::CPU\b|"
                r"Device\s*\(\s*(?:(?:at|torch|c10)::)?(?:kCPU|DeviceType::CPU)\b)"), ".to(kCPU"),
    (re.compile(r"\.\s*tolist\b"), ".tolist"),
    (re.compile(r"(?<![A-Za-z0-9_])(?:const_|mutable_)?data_ptr\b"), "data_ptr"),
    (re.compile(r"\b_local_scalar_dense\b"), "_local_scalar_dense"),
    # A host vector made a tensor is a host-to-device copy once it moves to the device (a
    # blocking one from pageable memory).
    (re.compile(r"\b(?:at|torch)::(?:tensor|from_blob)\s*\("), "host-vector tensor"),
    # Ops whose output size depends on the data: the host must read a count to size it.
    (re.compile(r"\b(?:nonzero(?:_static)?|argwhere|masked_select|unique(?:_consecutive|_dim)?|"
                r"_unique2?|bincount)\s*\("), "data-sized op"),
]


def matches(rel, patterns):
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


def function_at(spans, line):
    for name, first, last in spans:
        if first <= line <= last:
            return name
    return None


def scan_file(rel, text, allowed, kernel_files):
    """Yields (rel, line, what, function) for each host read outside the allowed helpers."""
    spans = []
    for header, start, n in functions(text):
        name = re.sub(r"\s+", " ", header.split("(")[0]).strip().split(" ")[-1]
        spans.append((name, start, start + n + 1))
    for i, code_line in enumerate(strip_code(text).split("\n"), start=1):
        for rx, what in READS:
            if not rx.search(code_line):
                continue
            fn = function_at(spans, i)
            if (rel, fn) in allowed:
                continue
            if what == "data_ptr" and matches(rel, kernel_files):
                continue
            yield rel, i, what, fn


def scan(root, allowed=None, kernel_files=None):
    allowed = ALLOWED if allowed is None else allowed
    kernel_files = KERNEL_FILES if kernel_files is None else kernel_files
    found, files = [], 0
    for folder in sorted({p.split("/")[0] for p in HOT_PATH}):
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for f in sorted(names):
                rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                if not matches(rel, HOT_PATH) or rel in NOT_HOT:
                    continue
                files += 1
                with open(os.path.join(root, rel), encoding="utf-8") as fh:
                    found.extend(scan_file(rel, fh.read(), allowed, kernel_files))
    return found, files


def report(found, files):
    for rel, line, what, fn in found:
        where = f"in {fn}" if fn else "outside any function"
        print(f"host reads: {rel}:{line}: {what} {where}; allowed: only in the named helpers "
              f"listed in scripts/check_host_reads.py (ALLOWED)")
    if not found:
        print(f"host reads: none outside the {len(ALLOWED)} named helpers in {files} hot-path "
              f"files")
    return 1 if found else 0


SELF_TEST_BAD = """// .item() in a comment is not a read, nor is ".cpu()" in a string.
#include "models/llama3.h"
namespace titan {
at::Tensor Llama3::forward(const at::Tensor& tokens) {
  const char* s = "x.cpu() and y.item<int>()";
  double a = tokens.sum().item<double>();
  at::Tensor h = tokens.cpu();
  at::Tensor c = tokens.to(at::kCPU, at::kLong);
  auto v = h.tolist();
  const int64_t* p = c.data_ptr<int64_t>();
  at::Tensor d = tokens.to(torch::Device(torch::kCPU));
  at::Tensor e = at::tensor(std::vector<int64_t>{1, 2}).to(tokens.device());
  at::Tensor f = at::nonzero(tokens);
  at::Tensor g = tokens.masked_select(tokens > 0);
  at::Tensor u = std::get<0>(at::_unique(tokens));
  at::Tensor b = at::bincount(tokens);
  return tokens;
}
}  // namespace titan
"""
# The trainer and the process-group code are scanned too.
SELF_TEST_TRAINER = """namespace titan {
void Trainer::train_step() { auto n = at::tensor(sizes_).to(dev_); auto k = mask_.nonzero(); }
}  // namespace titan
"""
SELF_TEST_ALLOWED = """namespace titan {
std::vector<int64_t> counts_to_host(const at::Tensor& counts) {
  at::Tensor c = counts.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}
void set_storage(at::Tensor& t) { t.unsafeGetTensorImpl()->set_data_ptr_noswap({}); }
}  // namespace titan
"""


def self_test():
    with tempfile.TemporaryDirectory() as root:
        for rel, text in (("models/llama3.cpp", SELF_TEST_BAD),
                          ("moe/experts.cpp", SELF_TEST_ALLOWED),
                          ("app/trainer.cpp", SELF_TEST_TRAINER),
                          ("parallel/process_group.cpp", SELF_TEST_TRAINER),
                          ("models/hf_interop.cpp", SELF_TEST_BAD),  # not hot: not scanned
                          ("core/tokenizer/tokenizer.cpp", SELF_TEST_BAD)):    # not hot: not scanned
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w", encoding="utf-8") as fh:
                fh.write(text)
        found, files = scan(root, {("moe/experts.cpp", "counts_to_host"): "test"}, [])
        got = [(rel, line, what) for rel, line, what, _ in found]
        want = [("models/llama3.cpp", 6, ".item"), ("models/llama3.cpp", 7, ".cpu()"),
                ("models/llama3.cpp", 8, ".to(kCPU"), ("models/llama3.cpp", 9, ".tolist"),
                ("models/llama3.cpp", 10, "data_ptr"), ("models/llama3.cpp", 11, ".to(kCPU"),
                ("models/llama3.cpp", 12, "host-vector tensor"),
                ("models/llama3.cpp", 13, "data-sized op"), ("models/llama3.cpp", 14, "data-sized op"),
                ("models/llama3.cpp", 15, "data-sized op"), ("models/llama3.cpp", 16, "data-sized op")]
        for rel in ("app/trainer.cpp", "parallel/process_group.cpp"):
            want += [(rel, 2, "host-vector tensor"), (rel, 2, "data-sized op")]
        got.sort()
        want.sort()
        ok = got == want and files == 4 and all(
            fn in ("Llama3::forward", "Trainer::train_step") for *_, fn in found)
        # The same helper outside the allowed list is reported.
        found2, _ = scan(root, {}, [])
        ok = ok and sum(1 for f in found2 if f[0] == "moe/experts.cpp") == 2
    if ok:
        print(f"host reads self-test: the {len(want)} planted reads (device-to-host reads, "
              "host-vector tensors, data-sized ops; in the step, the trainer and the process "
              "group) are reported, comments, strings, allowed helpers and files outside the "
              "step are not")
        return 0
    print(f"host reads self-test FAILED: got {got} (files {files}), want {want}")
    return 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    return report(*scan(os.path.abspath(a.root)))


if __name__ == "__main__":
    sys.exit(main())
