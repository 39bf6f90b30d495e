#!/usr/bin/env python3
"""Prints every "section.key" of torchtitan's JobConfig (the installed torchtitan 0.2.2), one
per line, for test/core/config/test_torchtitan_configs.cpp. Nested dataclasses become dotted paths
(quantize.linear.float8.filter_fqns); training-only imports are stubbed as in
torchtitan_ref.py.
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_ref import _StubFinder  # noqa: E402

sys.meta_path.insert(0, _StubFinder())

from torchtitan.config.job_config import JobConfig  # noqa: E402


def walk(cls, prefix):
    for f in dataclasses.fields(cls):
        t = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if t is not None and dataclasses.is_dataclass(t):
            yield from walk(t, prefix + f.name + ".")
        elif not f.name.startswith("_"):
            yield prefix + f.name


for key in walk(JobConfig, ""):
    print(key)
