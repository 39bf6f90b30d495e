#!/usr/bin/env python3
"""Training throughput of torchtitan 0.2.2 itself, the anchor titan-train's GPU benchmarks are
measured against (scripts/gpu_check.sh, docs/gpu.md "torchtitan as the anchor").

What runs is torchtitan's own code, as its Trainer runs it on one GPU:
- the model: its classes (llama3 Transformer, DeepSeekV3Model) from its flavor table, with
  `update_from_config`, built on the meta device under `training.dtype` (fp32), then
  `to_empty` and `init_weights`;
- its parallelize function (`parallelize_llama`, `parallelize_deepseekv3`): on one GPU that is
  activation checkpointing (`apply_ac`, mode full) and per-block `torch.compile`
  (`apply_compile`, fullgraph, inductor) when `compile.enable`; no FSDP (dp_shard is 1);
- mixed precision from `dist_utils.maybe_enable_amp`: without FSDP torchtitan trains fp32
  parameters under `torch.autocast(bfloat16)`, which is titan-train's CUDA default too (fp32
  master weights, bf16 compute). --dtype fp32 drops the autocast;
- its loss builder (`build_cross_entropy_loss`, compiled when compile is on: the default
  `compile.components` is model and loss), its optimizer builder (`build_optimizers`, or the
  MoE variant with the expert-bias hook for deepseek_v3: AdamW, `implementation = "fused"`),
  `build_lr_schedulers`, and `Trainer.train_step` / `forward_backward_step` /
  `batch_generator` themselves (clip_grad_norm_, optimizer and scheduler steps included),
  called on a Trainer whose __init__ is replaced by the lines above;
- MFU as its MetricsProcessor computes it: `model_args.get_nparams_and_flops` and
  `utils.get_peak_flops(device name)`, 100 * flops/token * tokens/s / peak.

Not torchtitan's, and why:
- the data: random tokens on the CPU, moved to the device by train_step, as titan-train's
  benchmarks draw them; torchtitan's dataloader needs HF datasets and torchdata;
- training-only imports (tyro, torchdata, datasets, tensorboard, ...) are empty stand-ins
  (torchtitan_ref.py's _StubFinder): the GPU machine lacks them and nothing here uses them;
- on the CPU only (the rehearsal), torch.histc of int64 expert ids, which only CUDA
  implements, counts their float copy (torchtitan_ref.py does the same);
- the config: torchtitan's JobConfig dataclass is filled directly, not parsed by tyro;
- llama3 1B: torchtitan 0.2.2 has no 1B flavor and no tied embeddings. The 1B flavor here is
  titan-train's (Llama-3.2 1B sizes, in torchtitan's TransformerModelArgs), and with --tie 1
  (the default for 1B, as titan-train's 1B) the output projection and the embedding share one
  Parameter after init_weights (the output's init, as titan-train). FLOPs per token are taken
  from the untied model: the output GEMM runs either way;
- deepseek_v3 16B: torchtitan's flavor uses FlexAttention with document masking; titan-train
  runs causal SDPA, so --attn sdpa (the default) sets attn_type "sdpa", mask "causal";
- the timer: the device is synchronized around each step; tokens/s is batch * seq_len over
  that wall time, the median over the steps after --warmup (compile time falls in the first
  step and is reported apart).

One JSON line at the end, per mode (eager, compile): tokens/s per step, the median, the first
step's time, peak CUDA memory (max allocated and reserved, GiB), MFU, losses, grad norms, and
the error if the mode failed (torch.compile of the MoE fails on some setups: that is a figure,
not a crash; the next mode still runs).

The GPU machine's package set is rehearsed by torchtitan_bench_test.sh (a ctest).
"""
import importlib.machinery
import os
import sys
import time

T_START = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_ref import _StubFinder  # noqa: E402


class _BenchStubs(_StubFinder):
    """_StubFinder, plus torch.utils.tensorboard: torchtitan's metrics module imports its
    SummaryWriter at import time, and torch's module refuses a stand-in tensorboard."""

    def find_spec(self, name, path, target=None):
        if name == "torch.utils.tensorboard" or name.startswith("torch.utils.tensorboard."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return super().find_spec(name, path, target)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="llama3", choices=["llama3", "deepseek_v3"])
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--n_layers", type=int, default=0, help="0: the flavor's")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="local batch size")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--ac", default="none", choices=["none", "full"])
    ap.add_argument("--compile", type=int, default=None, choices=[0, 1],
                    help="one mode: 0 eager, 1 compile (overrides --modes)")
    ap.add_argument("--modes", default="eager", help="comma list of eager, compile; one process")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="bf16: fp32 parameters under bf16 autocast (torchtitan on one GPU)")
    ap.add_argument("--tie", type=int, default=-1, choices=[-1, 0, 1],
                    help="llama3: share the embedding and output weight; -1: as titan-train's flavor")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "flavor"],
                    help="sdpa: causal SDPA (titan-train's attention); flavor: the flavor's own")
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--warmup_steps", type=int, default=2, help="lr warm-up steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oom_batch", type=int, default=0,
                    help="a mode out of memory at --batch runs again at this batch (0: not)")
    ap.add_argument("--out", default="", help="also write the JSON here, after every mode")
    ap.add_argument("--float8", default="none", choices=["none", "tensorwise", "rowwise"],
                    help="torchtitan's float8 linear converter (torchao) with this recipe, every "
                         "linear but the output (titan-train's --model.converters float8)")
    a = ap.parse_args(argv)
    if a.compile is not None:
        a.modes = "compile" if a.compile else "eager"
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        if m not in ("eager", "compile"):
            ap.error(f"--modes: '{m}' is not one of eager, compile")
    if a.steps <= a.warmup:
        ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    return a


def job_config(a, compile_on):
    """torchtitan's JobConfig, filled as its TOML/CLI would fill it for this run."""
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.job.dump_folder = tempfile.gettempdir()
    jc.model.name, jc.model.flavor = a.model, a.flavor
    jc.training.seq_len = a.seq_len
    jc.training.local_batch_size = a.batch
    jc.training.steps = a.steps
    jc.training.max_norm = 1.0
    jc.training.dtype = "float32"
    jc.training.mixed_precision_param = "bfloat16" if a.dtype == "bf16" else "float32"
    jc.activation_checkpoint.mode = a.ac
    jc.compile.enable = compile_on
    jc.optimizer.name = "AdamW"
    jc.optimizer.lr = a.lr
    jc.optimizer.implementation = "fused"
    jc.lr_scheduler.warmup_steps = a.warmup_steps
    jc.metrics.log_freq = 1
    if a.float8 != "none":
        # torchtitan's own converter (quantize.linear.float8), as its float8 configs set it;
        # emulated on the CPU (the rehearsal), as its converter allows in eager mode.
        jc.model.converters = ["quantize.linear.float8"]
        jc.quantize.linear.float8.recipe_name = a.float8
        jc.quantize.linear.float8.filter_fqns = ["output"]
        jc.quantize.linear.float8.emulate = a.device == "cpu"
    return jc


def llama3_1b_args():
    """titan-train's llama3 1B (Llama-3.2 1B sizes) in torchtitan's args class: 0.2.2 has none."""
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    return TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                                vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.5,
                                rope_theta=500000,
                                rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0))


def model_args(a, jc, device):
    if a.model == "llama3":
        from torchtitan.models.llama3 import llama3_args as flavors
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_args as flavors
    if a.model == "llama3" and a.flavor == "1B" and "1B" not in flavors:
        ma = llama3_1b_args()
    elif a.flavor in flavors:
        ma = copy.deepcopy(flavors[a.flavor])
    else:
        raise SystemExit(f"--flavor: '{a.flavor}' is not a torchtitan {a.model} flavor "
                         f"(allowed: {', '.join(sorted(flavors))}{', 1B' if a.model == 'llama3' else ''})")
    if a.n_layers:
        ma.n_layers = a.n_layers
    if a.attn == "sdpa":
        ma.attn_type, ma.attn_mask_type = "sdpa", "causal"
    ma.update_from_config(jc)
    if a.model == "deepseek_v3" and device.type == "cpu":
        # update_from_config keeps grouped_mm only on SM90+; on the CPU it is the for-loop.
        ma.moe_args.use_grouped_mm = False
    return ma


def build_model(a, jc, ma, parallel_dims, device):
    """As Trainer.__init__: meta init under training.dtype, the parallelize function (AC,
    compile), to_empty, init_weights. Returns (model, n_params, flops per token)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils

    if a.model == "llama3":
        from torchtitan.models.llama3 import Transformer as Model, parallelize_llama as parallelize
    else:
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model as Model
        from torchtitan.models.deepseek_v3 import parallelize_deepseekv3 as parallelize
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[jc.training.dtype]):
        model = Model(ma)
    # On the untied model: the output GEMM runs whether or not its weight is shared.
    n_params, flops_per_token = ma.get_nparams_and_flops(model, jc.training.seq_len)
    if jc.model.converters:  # before parallelize, as Trainer.__init__
        import torchtitan.components.quantization  # noqa: F401  (registers the converters)
        from torchtitan.protocols.model_converter import build_model_converters

        build_model_converters(jc, parallel_dims).convert(model)
        n8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        print(f"[torchtitan_bench] float8: {n8} linears converted, recipe "
              f"{jc.quantize.linear.float8.recipe_name}"
              f"{' (emulated)' if jc.quantize.linear.float8.emulate else ''}", flush=True)
    model = parallelize(model, parallel_dims, jc)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    tie = a.tie if a.tie >= 0 else int(a.model == "llama3" and a.flavor in ("1B", "3B"))
    if tie:
        assert a.model == "llama3", "--tie: llama3 only"
        model.tok_embeddings.weight = model.output.weight  # the output's init, as titan-train
        n_params -= model.output.weight.numel()
    model.train()
    return model, n_params, flops_per_token, bool(tie)


class _Recorder:
    """Stands where Trainer has its MetricsProcessor: the fields train_step and
    batch_generator touch, and log() keeps the loss and grad norm instead of printing them."""

    def __init__(self):
        self.ntokens_since_last_log = 0
        self.data_loading_times = []
        self.losses, self.grad_norms = [], []

    def should_log(self, step):
        return True  # log_freq 1: every step reads its loss, as a logging step does

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.losses.append(float(global_avg_loss))
        self.grad_norms.append(float(grad_norm))


def random_batches(a, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        t = torch.randint(vocab, (a.batch, a.seq_len + 1), generator=g)
        yield {"input": t[:, :-1].contiguous()}, t[:, 1:].contiguous()


def make_trainer(a, jc, ma, model, parallel_dims, device):
    """A torchtitan Trainer carrying what train_step needs, built without its __init__ (which
    also builds the dataloader, tokenizer, checkpointer and metrics: not available or not
    wanted here). Every call below is the one Trainer.__init__ makes."""
    from torchtitan.components.optimizer import (
        build_optimizers, build_optimizers_with_moe_load_balancing)
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.train import Trainer

    tr = Trainer.__new__(Trainer)
    tr.job_config, tr.parallel_dims, tr.model_args = jc, parallel_dims, ma
    tr.device, tr.model_parts = device, [model]
    tr.tokenizer = types.SimpleNamespace(eos_id=0)  # only flex/varlen masks read it
    tr.loss_fn = build_cross_entropy_loss(jc, parallel_dims=parallel_dims)
    tr.gradient_accumulation_steps = 1
    build = build_optimizers if a.model == "llama3" else build_optimizers_with_moe_load_balancing
    tr.optimizers = build(tr.model_parts, jc.optimizer, parallel_dims)
    tr.lr_schedulers = build_lr_schedulers(tr.optimizers, jc.lr_scheduler, jc.training.steps)
    tr.train_context = dist_utils.get_train_context(False)
    if a.dtype == "bf16":
        tr.maybe_enable_amp = dist_utils.maybe_enable_amp(
            parallel_dims, jc.training.mixed_precision_param, device.type)
    else:
        tr.maybe_enable_amp = contextlib.nullcontext()
    tr.checkpointer = types.SimpleNamespace(maybe_wait_for_staging=lambda: None)
    tr.metrics_processor = _Recorder()
    tr.step, tr.ntokens_seen = 0, 0
    return tr


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(a, mode, device, parallel_dims, peak_flops):
    """One fresh model, optimizer and Trainer; a.steps steps. Returns the mode's figures."""
    from torchtitan.tools import utils

    r = {"mode": mode, "compile": mode == "compile", "batch": a.batch, "tps": [], "step_s": [],
         "losses": [], "grad_norms": [], "error": None}
    t0 = time.time()
    try:
        torch.manual_seed(a.seed)
        jc = job_config(a, mode == "compile")
        ma = model_args(a, jc, device)
        model, n_params, fpt, tied = build_model(a, jc, ma, parallel_dims, device)
        r.update(n_params=n_params, flops_per_token=fpt, tied_embeddings=tied,
                 attn_type=ma.attn_type, n_layers=ma.n_layers,
                 grouped_mm=getattr(getattr(ma, "moe_args", None), "use_grouped_mm", None))
        tr = make_trainer(a, jc, ma, model, parallel_dims, device)
        gc_handler = utils.GarbageCollection(gc_freq=jc.training.gc_freq)
        r["setup_s"] = round(time.time() - t0, 3)
        data = tr.batch_generator(random_batches(a, ma.vocab_size, a.seed))
        for step in range(1, a.steps + 1):
            sync(device)
            ts = time.perf_counter()
            tr.step = step
            gc_handler.run(step)
            tr.train_step(data)
            sync(device)
            dt = time.perf_counter() - ts
            r["step_s"].append(round(dt, 4))
            r["tps"].append(round(a.batch * a.seq_len / dt, 1))
            print(f"[torchtitan_bench] {mode} step {step}: loss {tr.metrics_processor.losses[-1]:.4f} "
                  f"{dt * 1e3:.0f} ms", file=sys.stderr, flush=True)
        r["losses"], r["grad_norms"] = tr.metrics_processor.losses, tr.metrics_processor.grad_norms
    except Exception as e:  # a failed mode is a figure; the next mode still runs
        msg = f"{type(e).__name__}: {e}".strip().splitlines()
        r["error"] = " | ".join(msg[:3])[:600]
        traceback.print_exc(file=sys.stderr)
        print(f"[torchtitan_bench] {mode} failed: {r['error']}", file=sys.stderr, flush=True)
        r["losses"] = getattr(locals().get("tr"), "metrics_processor", _Recorder()).losses
    body = r["tps"][a.warmup:]
    r["tps_median"] = round(statistics.median(body), 1) if body else None
    if r["step_s"]:
        r["first_step_s"] = r["step_s"][0]
        later = r["step_s"][a.warmup:] or r["step_s"][1:]
        # The first step's excess over a steady step: torch.compile's compile time, mostly.
        r["first_step_excess_s"] = round(r["step_s"][0] - statistics.median(later), 3) if later else None
    if device.type == "cuda":
        r["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        r["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    if r["tps_median"] and peak_flops and r.get("flops_per_token"):
        r["mfu_pct"] = round(100 * r["flops_per_token"] * r["tps_median"] / peak_flops, 2)
    r["seconds"] = round(time.time() - t0, 2)
    return r


def release(device):
    """Frees the previous mode's model, optimizer and compiled graphs before the next."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def init_single_process_group(device):
    # ParallelDims builds its (size-1) meshes through torch.distributed, as torchtitan's
    # init_distributed does (NCCL on CUDA; gloo beside it for CPU tensors).
    if torch.distributed.is_initialized():
        return
    fd, path = tempfile.mkstemp(prefix="tt-bench-store-")
    os.close(fd)
    os.unlink(path)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method="file://" + path, rank=0,
                                         world_size=1)


def main(argv=None):
    a = parse_args(argv)
    sys.meta_path.insert(0, _BenchStubs())
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("LOCAL_RANK", "0")  # as torchrun sets it for Trainer
    else:
        # No LOCAL_RANK: the size-1 mesh then sets no device (torchtitan's device_type is
        # "cuda" even on a machine without one).
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # torchtitan's router counts int64 expert ids with torch.histc, which only CUDA
        # implements: on the CPU the same histogram of their float copy (exact in fp32).
        histc = torch.histc
        torch.histc = lambda x, *a, **k: histc(x.float(), *a, **k).to(x.dtype)
    init_single_process_group(device)

    import torchtitan
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.tools import utils

    # As Trainer.init_distributed on one device: every degree 1 (dp_shard -1 resolves to 1).
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                 world_size=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = utils.get_peak_flops(name) if device.type == "cuda" else None
    out = {"torchtitan": getattr(torchtitan, "__version__", "?"),
           "torchtitan_path": os.path.dirname(torchtitan.__file__), "torch": torch.__version__,
           "device": name, "peak_flops": peak, "model": a.model, "flavor": a.flavor,
           "n_layers": a.n_layers, "seq_len": a.seq_len, "batch": a.batch, "steps": a.steps,
           "warmup": a.warmup, "ac": a.ac, "dtype": a.dtype, "attn": a.attn,
           "import_s": round(time.time() - T_START, 2), "runs": []}
    for mode in a.modes:
        release(device)
        r = run_mode(a, mode, device, parallel_dims, peak)
        if r["error"] and "OutOfMemoryError" in r["error"] and 0 < a.oom_batch < a.batch:
            # Out of memory is a figure; a smaller batch still gives a throughput.
            out["runs"].append(r)
            release(device)
            r = run_mode(argparse.Namespace(**{**vars(a), "batch": a.oom_batch}), mode, device,
                         parallel_dims, peak)
        out["runs"].append(r)
        out["seconds"] = round(time.time() - T_START, 2)
        if a.out:  # after every mode: a run cut short by a timeout keeps what it measured
            with open(a.out + ".tmp", "w") as f:
                f.write(json.dumps(out) + "\n")
            os.replace(a.out + ".tmp", a.out)
    print(json.dumps(out), flush=True)
    torch.distributed.destroy_process_group()
    return 0 if any(r["error"] is None for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
