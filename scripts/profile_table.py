#!/usr/bin/env python3
"""Where a profiled step's time goes: reads a Chrome trace written by titan-train's
profiler (profiling.enable_profiling) and prints the ops with the most self time (their
duration minus their direct children's, per thread) as a Markdown table, with the share of
the profiled steps' wall time (the ProfilerStep#N spans) and the call counts.

  python3 scripts/profile_table.py outputs/profile_traces/iteration_10/rank0_trace.json [--top 15]
"""
import argparse
import collections
import json
import sys


def self_times(events):
    """(name, category) -> [self_us, calls] over complete ("X") events, nesting per thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = collections.defaultdict(lambda: [0.0, 0])
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, children_us]
        def close(item):
            e, child = item
            rec = out[(e["name"], e.get("cat", ""))]
            rec[0] += max(0.0, e["dur"] - child)
            rec[1] += 1
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                close(stack.pop())
            if stack:
                stack[-1][1] += e["dur"]
            stack.append([e, 0.0])
        while stack:
            close(stack.pop())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(
        "ProfilerStep#")]
    step_us = sum(e["dur"] for e in steps)
    if step_us <= 0:
        print("no ProfilerStep# span in the trace", file=sys.stderr)
        return 1
    table = self_times(events)
    ops = [(k[0], v) for k, v in table.items() if k[1] == "cpu_op"]
    ops.sort(key=lambda kv: -kv[1][0])
    total_ops = sum(v[0] for _, v in ops)
    print(f"{len(steps)} profiled step(s), {step_us / 1e3 / len(steps):.1f} ms each; "
          f"ATen/autograd ops' self time {100 * total_ops / step_us:.1f}% of it\n")
    print("| op | self time per step (ms) | self % of step | calls per step |")
    print("|---|---:|---:|---:|")
    for name, (us, calls) in ops[:a.top]:
        print(f"| `{name}` | {us / 1e3 / len(steps):.2f} | {100 * us / step_us:.1f} | "
              f"{calls / len(steps):g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
