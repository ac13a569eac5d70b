"""The JAX versions nvfp4-jax runs on, as data, and the import-time check.

Why a range: the GPU kernels are Pallas-Triton (``jax.experimental.pallas.triton``; the SM12x
and generic-GPU path) and Pallas Mosaic GPU (Hopper). What the range rests on (jax-ml/jax,
``docs/pallas/CHANGELOG.md`` and ``jax/_src/pallas/``):

* 0.10.2: the oldest release tested (the whole CPU suite, interpret mode and the cuda
  lowerings); ``jax.experimental.pallas.triton.CompilerParams`` and ``dot`` there.
* 0.11.0 (July 2026): "The Triton backend is deprecated and will be removed in a future
  version of JAX" (every Pallas-Triton lowering emits a DeprecationWarning; the backend is
  still complete in 0.11.x). ``jax._src.pallas.triton.gpu_info`` appears, without GeForce
  RTX 50xx (``gemm.api.register_sm12x_device_kinds`` adds it). 0.11.2 runs the GPU tests on
  the H200.
* after 0.11 (unreleased when this was written): ``pallas_call`` no longer supports
  ``checkify``; the Triton backend may go in any release, so 0.12 and later are refused until
  the GPU tests have passed there (then ``JAX_BELOW`` moves).

``NVFP4_JAX_ALLOW_UNTESTED_JAX=1`` turns the refusal into a warning (to try a newer JAX).
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

#: oldest supported JAX (inclusive)
JAX_MIN = (0, 10, 2)
#: first unsupported JAX (exclusive upper bound)
JAX_BELOW = (0, 12, 0)
#: the range as a pip specifier
SUPPORTED_JAX = ">=0.10.2,<0.12"
#: where each version was tested
TESTED_JAX = {"0.10.2": "CPU: full test suite (interpret mode, cuda lowerings)",
              "0.11.2": "NVIDIA H200: GPU tests"}
#: environment variable that turns an unsupported-version error into a warning
ALLOW_UNTESTED_ENV = "NVFP4_JAX_ALLOW_UNTESTED_JAX"


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.11.2"``, ``"0.12.0.dev20260801"``, ``"0.10"`` -> (major, minor, patch)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"version: expected 'MAJOR.MINOR[.PATCH...]', got {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def unsupported_reason(version: str) -> str | None:
    """Why JAX ``version`` is not supported, or None when it is."""
    v = parse_version(version)
    tested = ", ".join(f"{k} ({w})" for k, w in TESTED_JAX.items())
    if v < JAX_MIN:
        return (f"nvfp4-jax needs jax {SUPPORTED_JAX}, found jax {version}: older releases lack "
                f"the Pallas APIs the kernels use (tested: {tested}). "
                f"pip install 'jax{SUPPORTED_JAX}'")
    if v >= JAX_BELOW:
        return (f"nvfp4-jax needs jax {SUPPORTED_JAX}, found jax {version}: the GPU kernels are "
                "Pallas-Triton, deprecated since jax 0.11.0 and due to be removed, and they have "
                f"not been tested on this release (tested: {tested}). Install "
                f"'jax{SUPPORTED_JAX}', or set {ALLOW_UNTESTED_ENV}=1 to try it anyway")
    return None


def check_jax(version: str | None = None) -> None:
    """Raise ImportError when JAX ``version`` (default: the installed one) is outside
    ``SUPPORTED_JAX``; a warning instead with ``NVFP4_JAX_ALLOW_UNTESTED_JAX=1``."""
    if version is None:
        import jax

        version = jax.__version__
    why = unsupported_reason(version)
    if why is None:
        return
    if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        log.warning("%s (%s is set: continuing)", why, ALLOW_UNTESTED_ENV)
        return
    raise ImportError(why)
