"""nvfp4-jax: NVFP4 for JAX (E2M1 values, E4M3 scales per 16 values, fp32 per-tensor scale).

Public API:

* :class:`NVFP4Array` (a pytree), :func:`quantize`, :func:`quantize_experts`, :func:`dequantize`,
  :func:`from_oracle`, :func:`to_oracle`;
* :func:`checked`, :func:`checkified` (the library's value checks under ``jit``, via
  ``checkify``; unchecked code carries none; see docs/input-policy.md and
  :mod:`nvfp4_jax.validate`);
* :func:`matmul` (NVFP4 GEMM, W4A16 / W4A4; Pallas-Triton on NVIDIA GPUs, XLA elsewhere);
* :func:`moe` (routed NVFP4 mixture of experts).
"""

__version__ = "0.1.0"  # the same as pyproject.toml (tests/tools/test_cli_errors.py checks)

from .versions import check_jax

check_jax()  # an unsupported JAX fails here, saying why and which versions work (versions.py)

from . import moe  # noqa: E402  (the subpackage is callable: nvfp4_jax.moe(...))
from .gemm.api import matmul  # noqa: E402
from .quantize import (  # noqa: E402
    JAX_RECIPES,
    NVFP4Array,
    dequantize,
    from_oracle,
    quantize,
    quantize_experts,
    to_oracle,
)
from .validate import checked, checkified  # noqa: E402

__all__ = ["JAX_RECIPES", "NVFP4Array", "checked", "checkified", "dequantize", "from_oracle", "matmul", "moe",
           "quantize", "quantize_experts", "to_oracle"]
