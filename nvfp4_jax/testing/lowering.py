"""Lower the Mosaic GPU kernels as for another GPU family, on the GPU at hand.

Mosaic GPU's Python lowering reads the compute capability once per kernel and gates its
choices on it (fences, upcasts, sm_100 paths); its C++ then compiles the module for the GPU it
runs on, the target taken from the driver. So with the capability reported as 12.0 (RTX 50xx)
or 12.1 (DGX Spark), a kernel is lowered with every choice SM 12.x would get and still runs,
and can be checked, on an sm_90 GPU; ``MOSAIC_GPU_DUMP_TO`` keeps the PTX for ``ptxas
-arch=sm_120a``. The hook is JAX-internal: ``_infer_arch`` of
``jax.experimental.mosaic.gpu.utils`` (JAX 0.11.2) or of ``...gpu.core`` (JAX 0.10.2, 0.11.0).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def mosaic_lowered_as(arch: tuple[int, int]):
    """Inside the context, Mosaic GPU lowers every kernel as for compute capability ``arch``
    (``(major, minor)``, e.g. ``(12, 0)``); the previous hook comes back on exit."""
    from jax.experimental.mosaic.gpu import core, utils

    owner = utils if hasattr(utils, "_infer_arch") else core
    previous = owner._infer_arch  # noqa: SLF001 - the hook this helper exists for
    owner._infer_arch = lambda: (int(arch[0]), int(arch[1]))  # noqa: SLF001
    try:
        yield
    finally:
        owner._infer_arch = previous  # noqa: SLF001
