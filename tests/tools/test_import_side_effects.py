"""Importing the package (and the bench tools that spawn processes) starts no JAX backend.

A backend on a GPU takes 75 % of the device memory for its allocator at start. A process that
merely imports nvfp4_jax must not: ``bench/e2e_bench.py``'s parent process, which only spawns
one child per model, held that memory and its Qwen3-30B-A3B bf16 child ran out of it; a user
who sets ``XLA_PYTHON_CLIENT_MEM_FRACTION`` after importing us would see it ignored.
``JAX_PLATFORMS`` naming no real platform makes any backend start raise, so the import succeeds
only if nothing starts one.
"""

from __future__ import annotations

import os
import subprocess
import sys

from bench_modules import ROOT

CODE = """
import sys
sys.path.insert(0, "bench")
import nvfp4_jax, nvfp4_jax.models, nvfp4_jax.cli, nvfp4_jax.attention, nvfp4_jax.moe
import e2e_bench
print("imported")
"""


def test_import_starts_no_backend():
    env = dict(os.environ, JAX_PLATFORMS="no_such_platform",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-3000:]
    # the probe works: starting a backend under this JAX_PLATFORMS fails
    r = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1)"], env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode != 0
