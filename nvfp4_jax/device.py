"""What the default JAX device can run: the one place that probes the hardware.

Every choice of implementation (``matmul``'s and ``moe``'s ``backend="auto"``, Pallas interpret
mode on CPU, the CLI's crosscheck) asks these functions instead of looking at ``jax.devices()``
itself, so that one device reads the same way everywhere.
"""

from __future__ import annotations

import os

import jax

#: the XLA flag that makes fp32 division IEEE on NVIDIA GPUs (div.rn.f32 instead of div.full.f32)
IEEE_DIV_FLAG = "--xla_backend_extra_options=-nvptx-prec-divf32=2"


def gpu_compute_capability() -> int | None:
    """Compute capability of the default device as an int (90 for 9.0, 120 for 12.0), None if
    it is not an NVIDIA (CUDA) GPU."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform != "gpu":
        return None
    cc = getattr(dev, "compute_capability", None)
    if cc is None or "cuda" not in str(getattr(dev.client, "platform_version", "")).lower():
        return None
    major, _, minor = str(cc).partition(".")
    return int(major) * 10 + int(minor or 0)


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (of any vendor)."""
    return jax.default_backend() == "gpu"


def pallas_interpret() -> bool:
    """Whether Pallas kernels run in interpret mode here: everywhere but on a GPU."""
    return not on_gpu()


def is_sm90() -> bool:
    """Whether the default device is an sm_90 GPU (Hopper: the Mosaic GPU kernels' target)."""
    return gpu_compute_capability() == 90


def is_sm12x() -> bool:
    """Whether the default device is an SM 12.x GPU (GeForce RTX 50xx, DGX Spark)."""
    return sm12x(gpu_compute_capability())


def sm12x(cc: int | None) -> bool:
    """Whether compute capability ``cc`` (as ``gpu_compute_capability`` gives it) is SM 12.x."""
    return cc is not None and 120 <= cc < 130


def xla_divides_ieee() -> bool:
    """Whether XLA's fp32 division is IEEE here: on CPU always; on a GPU only with
    ``IEEE_DIV_FLAG`` in ``XLA_FLAGS`` (else div.full.f32, within 2 ulp)."""
    return not on_gpu() or "-nvptx-prec-divf32=2" in os.environ.get("XLA_FLAGS", "")
