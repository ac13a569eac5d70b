"""The header every result JSON of bench/ starts with (date, commit, GPU, driver, versions)."""

from __future__ import annotations

import datetime
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np


def tree_commit() -> str:
    """``NVFP4_COMMIT`` if set, else ``git rev-parse HEAD`` of this checkout.

    The environment comes first: a copied working tree can carry a .git that describes another
    commit than the files that were copied.
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


def gpu_tag(device_kind: str) -> str:
    """A file-name tag for a device kind: "NVIDIA H200" -> "h200", "NVIDIA GeForce RTX 5090"
    -> "rtx-5090", "cpu" -> "cpu"."""
    words = device_kind.lower().replace("nvidia", "").replace("geforce", "").split()
    return "-".join(words) or "unknown"


def _driver() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           check=False, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed: recorded as None
        return None


def run_metadata() -> dict:
    """date, commit, GPU (name, compute capability, driver) and the versions a result depends
    on (jax, jaxlib, the CUDA plugin, ml_dtypes, numpy, pip triton where installed) and
    XLA_FLAGS."""
    import platform

    import jaxlib

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "commit": tree_commit(),
        "gpu": dev.device_kind,
        "compute_capability": getattr(dev, "compute_capability", None),
        "driver": _driver() if dev.platform == "gpu" else None,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_cuda_plugin": _version("jax-cuda13-plugin") or _version("jax-cuda12-plugin"),
        "ml_dtypes": _version("ml_dtypes"),
        "numpy": _version("numpy"),
        "pip_triton": _version("triton"),  # Pallas runs the Triton that jaxlib bundles
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS") or None,
    }


def hbm_copy_tbps(nbytes: int | None = None, passes: int = 20) -> float:
    """Device copy rate in TB/s (bytes read + written per second): ``passes`` in-graph XOR passes
    over an ``nbytes`` uint32 buffer (default 1 GiB on a GPU, 4 MiB elsewhere) in one jitted
    loop, median of 3 calls divided by ``passes``, so dispatch and allocation drop out."""
    if nbytes is None:
        nbytes = (1 << 30) if jax.default_backend() == "gpu" else (1 << 22)
    x = jnp.arange(nbytes // 4, dtype=jnp.uint32)

    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, passes, lambda i, y: y ^ jnp.uint32(1), x)

    run(x).block_until_ready()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        run(x).block_until_ready()
        ts.append((time.perf_counter() - t0) / passes)
    return 2 * x.nbytes / float(np.median(ts)) / 1e12
