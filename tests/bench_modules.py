"""The benchmark tools under bench/, loaded for tests."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def fresh(name: str):
    """A new instance of the module bench/<name>.py, executed anew: a test may change its
    globals (e.g. ``moe_bench.NROT``) without reaching another test's copy."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
