"""Shared test configuration: hypothesis profiles and NVFP4 test-data generators.

Profiles (select with ``HYPOTHESIS_PROFILE``, default ``ci``):

* ``ci``:   2,500 examples per quantization property (``QUANT_EXAMPLES``), fewer for the
            cheaper structural properties; no deadline; derandomized so CI is reproducible.
* ``deep``: 200,000 examples per quantization property, random seeds (for a nightly run).
* ``dev``:  500 / 30 examples, for a quick local loop.

The generators are plain numpy functions of a seed and a few parameters, so one hypothesis
example (seed + parameters) drives a whole vectorised batch of blocks through a jitted
function of fixed shape (one compile per recipe).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository root (oracle/, nvfp4_jax/) and bench/ (the benchmark tools the tests drive)
for _path in (ROOT, os.path.join(ROOT, "bench")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# ---------------------------------------------------------------------------------------
# One persistent compilation cache per session (CPU hosts)
# ---------------------------------------------------------------------------------------
# Most of the suite's time is XLA:CPU compiling, and many programs are compiled more than
# once: by both xdist workers, by every eager call of a Pallas kernel (``pl.pallas_call``
# builds a new jitted function per call, so its in-memory cache never hits), after a
# ``jax.clear_caches()``, and by the CLI and bench subprocesses, which start empty. JAX's
# persistent cache serves each later compile of the same program (its key: the StableHLO
# without locations, the compile options, backend, XLA flags and jaxlib version) from one
# directory: the executable a compile would produce, so every check sees the same code.
# The environment variables reach the xdist workers and the subprocesses the tests start.
# The directory belongs to the session that creates it (the xdist controller, or a run
# without xdist) and is removed at its end: no run reads another run's executables. A
# directory given in JAX_COMPILATION_CACHE_DIR is used as it is; on a host with NVIDIA
# devices the suite compiles as a user's process does (no cache).
_OWN_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not glob.glob("/dev/nvidia[0-9]*"):
    _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="nvfp4-jax-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE_DIR
    # every program, however quick to compile (eager ops take ~30 ms to compile, ~8 ms to load)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None:
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, suppress_health_check=_SUPPRESS,
    print_blob=True,
)
settings.register_profile(
    "deep", max_examples=4000, deadline=None, suppress_health_check=_SUPPRESS, print_blob=True,
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=_SUPPRESS, print_blob=True,
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

#: examples per quantization property (JAX == oracle, byte for byte)
QUANT_EXAMPLES = {"ci": 2_500, "deep": 200_000, "dev": 500}.get(PROFILE, 2_500)

# ---------------------------------------------------------------------------------------
# Data generators
# ---------------------------------------------------------------------------------------

E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

#: block kinds drawn by :func:`nvfp4_blocks`
KINDS = ("random", "zero", "outlier", "signed_zero", "ties", "tiny")


def to_bf16_values(x: np.ndarray) -> np.ndarray:
    """Round float values to bf16 (ml_dtypes, RNE from float32) and return float32."""
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def nvfp4_blocks(
    seed: int,
    n_blocks: int,
    decode_scale: float,
    *,
    scale_log2_lo: float = -12.0,
    scale_log2_hi: float = 9.5,
    bf16: bool = False,
    kind_weights: tuple[float, ...] = (0.55, 0.06, 0.1, 0.09, 0.12, 0.08),
) -> np.ndarray:
    """Random float32 values [n_blocks * 16] built block by block.

    Each block's ideal E4M3 scale ``vmax / (6 * decode_scale)`` is drawn log-uniformly from
    ``2^[scale_log2_lo, scale_log2_hi]``, i.e. over E4M3's whole range (subnormals below 2^-6,
    the underflow region below 2^-10, saturation above 448). Kinds:

    * ``random``: uniform in [-vmax, vmax] with one element at +-vmax;
    * ``zero``: all +0.0 / -0.0;
    * ``outlier``: one element at +-vmax, the rest 2^-[4, 40] smaller (or exactly zero);
    * ``signed_zero``: random, with several elements replaced by -0.0 and tiny negatives;
    * ``ties``: elements at exact E2M1 midpoints (0.25 ... 5) and grid points times
      ``s * decode_scale`` for a random E4M3 scale ``s``, max element ``6 * s * decode_scale``;
    * ``tiny``: everything far below the block's quantum (codes round to zero).
    """
    rng = np.random.default_rng(seed)
    p = np.asarray(kind_weights, np.float64)
    kinds = rng.choice(len(KINDS), size=n_blocks, p=p / p.sum())
    d = float(decode_scale)
    ideal = np.exp2(rng.uniform(scale_log2_lo, scale_log2_hi, n_blocks))
    vmax = 6.0 * ideal * d
    u = rng.uniform(-1.0, 1.0, (n_blocks, 16))
    x = u * vmax[:, None]
    idx = rng.integers(0, 16, n_blocks)
    sign = np.where(rng.random(n_blocks) < 0.5, -1.0, 1.0)
    x[np.arange(n_blocks), idx] = sign * vmax
    # outlier: the others are 2^-[4, 40] of vmax, some exactly zero
    small = u * vmax[:, None] * np.exp2(-rng.uniform(4, 40, (n_blocks, 16)))
    small = np.where(rng.random((n_blocks, 16)) < 0.2, 0.0, small)
    out = small.copy()
    out[np.arange(n_blocks), idx] = sign * vmax
    x = np.where((kinds == 2)[:, None], out, x)
    # zero blocks (random signs of zero)
    zero = np.where(rng.random((n_blocks, 16)) < 0.5, -0.0, 0.0)
    x = np.where((kinds == 1)[:, None], zero, x)
    # signed zeros and tiny negatives in an otherwise random block
    sz = x.copy()
    m = rng.random((n_blocks, 16)) < 0.3
    tiny_neg = -vmax[:, None] * np.exp2(-rng.uniform(6, 60, (n_blocks, 16)))
    sz = np.where(m, np.where(rng.random((n_blocks, 16)) < 0.5, -0.0, tiny_neg), sz)
    sz[np.arange(n_blocks), idx] = sign * vmax
    x = np.where((kinds == 3)[:, None], sz, x)
    # exact E2M1 ties at a representable E4M3 scale
    s_code = rng.integers(1, 127, n_blocks).astype(np.uint8)
    s_val = _e4m3_value(s_code)
    unit = s_val * d
    mult = np.where(
        rng.random((n_blocks, 16)) < 0.7,
        rng.choice(E2M1_TIES, (n_blocks, 16)),
        rng.choice(E2M1_GRID, (n_blocks, 16)),
    ) * np.where(rng.random((n_blocks, 16)) < 0.5, -1.0, 1.0)
    ties = mult * unit[:, None]
    ties[np.arange(n_blocks), idx] = sign * 6.0 * unit
    x = np.where((kinds == 4)[:, None], ties, x)
    # everything tiny
    tiny = u * vmax[:, None] * 2.0**-60
    x = np.where((kinds == 5)[:, None], tiny, x)
    x = x.astype(np.float32)  # keeps -0.0; underflows to float32 subnormals/zero
    if bf16:
        x = to_bf16_values(x)
    return x.reshape(-1)


def _e4m3_value(code: np.ndarray) -> np.ndarray:
    """E4M3 value of positive codes, from the bit layout (independent of oracle)."""
    c = np.asarray(code, np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8.0) * np.exp2(e - 7.0))


def f32_bits(a) -> np.ndarray:
    """float32 bit patterns (uint32) of an array: compares -0.0 vs 0.0 and NaNs exactly."""
    return np.asarray(a, np.float32).reshape(-1).view(np.uint32)


# ---------------------------------------------------------------------------------------
# The versions this run tests (printed first, also under -q; constraints.txt pins them for CI)
# ---------------------------------------------------------------------------------------

REPORTED_DISTRIBUTIONS = (
    "jax", "jaxlib", "ml_dtypes", "numpy", "hypothesis", "safetensors", "torch",
    "nvidia-modelopt", "torchao", "compressed-tensors", "b12x", "flashinfer-python", "triton",
)


def environment_line() -> str:
    """The Python and package versions of this run, one line."""
    import importlib.metadata
    import platform

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    found = ", ".join(f"{d} {version(d)}" for d in REPORTED_DISTRIBUTIONS)
    return (f"nvfp4-jax test environment: Python {platform.python_version()}; {found}; "
            f"HYPOTHESIS_PROFILE={PROFILE}")


def pytest_sessionstart(session):
    # written through the terminal reporter so that `pytest -q` (the README's command) shows it
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(environment_line())
