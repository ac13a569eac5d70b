"""The header every result JSON of bench/ starts with (date, commit, GPU, jax, jaxlib), and the
small pieces the probes share: interleaved timing rounds, writing records, patching a module
constant while a case is traced."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess

import jax


def tree_commit() -> str:
    """``NVFP4_COMMIT`` if set, else ``git rev-parse HEAD`` of this checkout.

    The environment comes first: the device machine's copy of the tree carries the .git of the
    session's base commit, not the working tree that was sent (seen 2026-11-29: it reported
    5ebe310 for 41a0c3b).
    """
    commit = os.environ.get("NVFP4_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"],
                check=False,
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
        except OSError:
            commit = ""
    return commit or "unknown (tree without git history)"


def run_metadata() -> dict:
    import jaxlib

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "commit": tree_commit(),
        "gpu": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }


def time_rounds(timers: list, rows: list, rounds: int) -> None:
    """``rounds`` timing rounds interleaved over the cases (``timers[i]()``: one round of case
    i in seconds per call), appended to each row's ``rounds_us``; ``median_us`` their median."""
    import numpy as np

    for _ in range(rounds):
        for tm, r in zip(timers, rows):
            r["rounds_us"].append(tm() * 1e6)
    for r in rows:
        r["median_us"] = float(np.median(r["rounds_us"]))


def dump_records(out_dir: str, name: str, what: str, rows: list) -> None:
    """``out_dir/name``: the run's header, ``what`` was measured and the ``records``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({**run_metadata(), "what": what, "records": rows}, f, indent=1)


@contextlib.contextmanager
def patched(patches: list):
    """Set each (module, attribute, value) for the duration (restored after): a bench-only
    A/B of a choice that is not a config field, applied while the case is traced."""
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, v in patches:
        setattr(m, a, v)
    try:
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)
