#!/usr/bin/env python3
"""Prints torchtitan 0.2.2's pipeline stage splits and PyTorch's pipeline schedule orders as
JSON, for test/parallel/test_pipeline_schedule.cpp.

Stage splits run torchtitan's own pipeline_llm (its stage count and checks,
generate_llm_fqn_per_model_part, pipeline_module_split's loop and V placement) on a stand-in
model of identity modules named as torchtitan's (tok_embeddings, layers.<i>, norm, output),
once per pipeline rank, with PipelineStage and the schedule builder replaced by recorders: no
process group, no real stage. Training-only imports are stubbed as in torchtitan_ref.py.

Schedule orders call PyTorch 2.11's per-rank generators (_calculate_single_rank_operations,
GPipe's _get_pipeline_order) on schedule objects made without stages, and drop the idle
slots and REDUCE_GRAD actions. 1F1B is left out: its _get_pipeline_order (a drawing aid)
skips micro-batch 0 on the last rank; titan-train follows its _step_microbatches instead.

Output: {"torchtitan": version, "torch": version,
         "splits": [{"case": {...}, "fqns": [[...]], "ranks": [[stage, ...]]} or {"case", "error"}],
         "schedules": [{"name", "p", "v", "m", "ranks": [["0F0", ...], ...]}]}
"""
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_ref import _StubFinder  # noqa: E402

sys.meta_path.insert(0, _StubFinder())

from importlib.metadata import version  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.distributed.pipelining.schedules as sch  # noqa: E402
import torchtitan.distributed.pipeline_parallel as ttpp  # noqa: E402


class _Stage:
    def __init__(self, submod, stage_index, num_stages, device, group=None):
        self.submod = submod
        self.stage_index = stage_index
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1


class _Mesh:
    def __init__(self, rank, size):
        self.rank, self.n = rank, size

    def get_local_rank(self):
        return self.rank

    def size(self):
        return self.n

    def get_group(self, name):
        return None


_seen_fqns = []
_split = ttpp.pipeline_module_split


def _recording_split(model, mesh, schedule, device, names):
    _seen_fqns.append(names)
    return _split(model, mesh, schedule, device, names)


ttpp.PipelineStage = _Stage
# pipeline_module_split deep-copies the whole model per stage; a fresh stand-in is the same
# thing here and much faster. Its per-stage log lines are silenced.
ttpp.copy = types.SimpleNamespace(deepcopy=lambda m: model_of(len(m.layers)))
ttpp.logger.disabled = True
ttpp.pipeline_module_split = _recording_split
ttpp.build_pipeline_schedule = lambda job_config, stages, loss_fn: None


def model_of(n_layers):
    m = nn.Module()
    m.tok_embeddings = _identity
    m.layers = nn.ModuleDict({str(i): _identity for i in range(n_layers)})
    m.norm = _identity
    m.output = _identity
    return m


_identity = nn.Identity()


def split(case):
    par = types.SimpleNamespace(
        pipeline_parallel_schedule=case["schedule"],
        pipeline_parallel_layers_per_stage=case.get("lps"),
        pipeline_parallel_first_stage_less_layers=case.get("first", 1),
        pipeline_parallel_last_stage_less_layers=case.get("last", 1),
        module_fqns_per_model_part=case.get("fqns"),
    )
    job = types.SimpleNamespace(parallelism=par)
    model = model_of(case["layers"])
    ranks = []
    for r in range(case["pp"]):
        dims = types.SimpleNamespace(pp=case["pp"], get_mesh=lambda name, r=r: _Mesh(r, case["pp"]))
        _seen_fqns.clear()
        try:
            _, parts, _, _ = ttpp.pipeline_llm(
                model, dims, job, torch.device("cpu"),
                types.SimpleNamespace(n_layers=case["layers"]), lambda m, d, j: m, None)
        except (ValueError, AssertionError) as e:
            return {"case": case, "error": str(e)}
        ranks.append([int(s) for s in _stage_indices(parts)])
    return {"case": case, "fqns": _seen_fqns[0], "ranks": ranks}


def _stage_indices(parts):
    # pipeline_llm hands back the chunks; their stages were recorded in order of creation.
    return [p._titan_stage for p in parts]


_orig_stage_init = _Stage.__init__


def _stage_init(self, submod, stage_index, num_stages, device, group=None):
    _orig_stage_init(self, submod, stage_index, num_stages, device, group)
    submod._titan_stage = stage_index


_Stage.__init__ = _stage_init


def split_cases():
    cases = []
    single = ["1F1B", "GPipe"]
    multi = ["Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS", "ZBVZeroBubble", "DualPipeV"]
    for layers in (2, 3, 6, 8, 16, 27, 32, 48, 61, 126):
        for pp in (1, 2, 3, 4, 8):
            for s in single + multi:
                cases.append({"layers": layers, "pp": pp, "schedule": s})
    for layers, pp, lps in ((6, 2, 1), (6, 2, 2), (8, 2, 2), (16, 4, 3), (32, 4, 4), (32, 4, 9),
                            (48, 4, 5), (61, 8, 2), (7, 3, 3), (10, 2, 6), (30, 4, 8)):
        for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
            cases.append({"layers": layers, "pp": pp, "schedule": s, "lps": lps})
    for first, last in ((0, 0), (2, 1), (1, 2), (3, 3), (5, 1)):
        for layers, pp in ((6, 2), (16, 4), (8, 4)):
            cases.append({"layers": layers, "pp": pp, "schedule": "1F1B",
                          "first": first, "last": last})
            cases.append({"layers": layers, "pp": pp, "schedule": "Interleaved1F1B",
                          "first": first, "last": last})
    cases.append({"layers": 4, "pp": 2, "schedule": "1F1B",
                  "fqns": [["tok_embeddings", "layers.0", "layers.1"],
                           ["layers.2", "layers.3", "norm", "output"]]})
    cases.append({"layers": 4, "pp": 2, "schedule": "ZBVZeroBubble",
                  "fqns": [["tok_embeddings"], ["layers.0", "layers.1"], ["layers.2"],
                           ["layers.3", "norm", "output"]]})
    return cases


def order(rows):
    """Per rank, the actions as strings; DualPipeV's overlapped pair is its two sub-actions."""
    out = []
    for r in sorted(rows):
        ops = []
        for a in rows[r]:
            if a is None or a.computation_type == sch.REDUCE_GRAD:
                continue
            if a.computation_type == sch.OVERLAP_F_B:
                ops += [str(x) for x in a.sub_actions]
            else:
                ops.append(str(a))
        out.append(ops)
    return out


def schedule_order(name, p, v, m):
    if name == "GPipe":
        s = object.__new__(sch.ScheduleGPipe)
        s._num_stages, s._n_microbatches = p, m
        return order(s._get_pipeline_order())
    if name == "DualPipeV":
        s = object.__new__(sch.ScheduleDualPipeV)
        s.pp_group_size, s._n_microbatches = p, m
        return order({r: s._calculate_single_rank_operations(r) for r in range(p)})
    cls = {"Interleaved1F1B": sch.ScheduleInterleaved1F1B,
           "InterleavedZeroBubble": sch.ScheduleInterleavedZeroBubble,
           "LoopedBFS": sch.ScheduleLoopedBFS,
           "ZBVZeroBubble": sch.ScheduleZBVZeroBubble}[name]
    s = object.__new__(cls)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = p, v, m
    s._stages = [None] * v
    s.num_stages = p * v
    s.number_of_rounds = max(1, m // p)
    s.microbatches_per_round = m // s.number_of_rounds
    return order({r: s._calculate_single_rank_operations(r) for r in range(p)})


def schedule_cases():
    out = []
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 5, 6, 8, 12, 16):
            out.append(("GPipe", p, 1, m))
            out.append(("LoopedBFS", p, 2, m))
            out.append(("ZBVZeroBubble", p, 2, m))
            if m >= 2 * p:
                out.append(("DualPipeV", p, 2, m))
            rounds = max(1, m // p)
            if m % rounds == 0:
                for v in (2, 3):
                    out.append(("Interleaved1F1B", p, v, m))
                    out.append(("InterleavedZeroBubble", p, v, m))
    return out


def main():
    splits = [split(c) for c in split_cases()]
    schedules = [{"name": n, "p": p, "v": v, "m": m, "ranks": schedule_order(n, p, v, m)}
                 for n, p, v, m in schedule_cases()]
    print(json.dumps({"torchtitan": version("torchtitan"), "torch": torch.__version__,
                      "splits": splits, "schedules": schedules}))


if __name__ == "__main__":
    main()
