"""The harness both CPU parallel test modules share: their checks run in one subprocess whose
JAX starts with 8 host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be
set before JAX starts its backends; the rest of the suite runs without it). The subprocess runs
the test module as a script (:func:`main`), which prints one JSON object of
``{check name: {"ok": bool, "detail": str}}``; the module's ``results`` fixture
(:func:`run_module`) reads it back, once per session."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bits_equal(a, b) -> tuple[bool, str]:
    """(a and b are the same bits, a description of the first difference)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False, f"shape {a.shape} vs {b.shape}"
    ua = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)
    bad = ua != b.view(ua.dtype)
    if not bad.any():
        return True, f"{a.size} elements bit for bit"
    i = np.unravel_index(int(np.argmax(bad)), a.shape)
    return False, (f"{int(bad.sum())} of {a.size} elements differ; first at {i}: "
                   f"{a[i]!r} vs {b[i]!r}")


def recorder(res: dict):
    """``record(name, fn)``: runs ``fn() -> (ok, detail)`` into ``res``; an exception is a
    failed check with its message."""

    def record(name, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            ok, detail = False, f"{type(e).__name__}: {e}"
        res[name] = {"ok": bool(ok), "detail": detail}

    return record


def expect_value_errors(cases) -> tuple[bool, str]:
    """``cases``: (words the message must hold, a call that must raise ValueError) pairs ->
    (every call raised a ValueError holding its words, what did not)."""
    msgs = []
    for want, fn in cases:
        try:
            fn()
            msgs.append(f"no error for {want!r}")
        except ValueError as e:
            if want not in str(e):
                msgs.append(f"{want!r} not in {e}")
    return not msgs, "; ".join(msgs) or f"{len(cases)} clear ValueErrors"


def run_module(path: str, what: str, tmp_path_factory=None) -> dict:
    """Run the test module ``path`` as a script on 8 host devices; its checks' results.
    ``tmp_path_factory`` (pytest's): the results are shared by the session's xdist workers
    (a file under their common base, written under a lock), so the subprocess runs once per
    module however the module's tests are spread over workers."""
    if tmp_path_factory is not None:
        base = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            base = base.parent  # the session's directory, shared by its workers
        stem = os.path.splitext(os.path.basename(path))[0]
        out = base / f"{stem}-results.json"
        with open(base / f"{stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
            if out.exists():
                return json.loads(out.read_text())
            res = run_module(path, what)
            out.write_text(json.dumps(res))
            return res
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        pytest.fail(f"{what} subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def assert_check(results: dict, name: str) -> None:
    """The parent test of one named check: it ran in the subprocess, and passed."""
    assert name in results, f"{name}: not run by the worker (ran {sorted(results)})"
    assert results[name]["ok"], f"{name}: {results[name]['detail']}"


def main(run_checks, check_names) -> None:
    """The subprocess side: run the checks, flag any named check that did not run, print."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    out = run_checks()
    missing = sorted(set(check_names()) - set(out))
    if missing:
        out["worker"] = {"ok": False, "detail": f"checks not run: {missing}"}
    print(json.dumps(out))
