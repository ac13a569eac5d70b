"""nvfp4-jax: NVFP4 for JAX (E2M1 values, E4M3 scales per 16 values, fp32 per-tensor scale).

Public API:

* :class:`NVFP4Array` (a pytree), :func:`quantize`, :func:`quantize_experts`, :func:`dequantize`,
  :func:`from_oracle`, :func:`to_oracle`;
* :func:`checked` (the library's value checks under ``jit``, via ``checkify``; see
  docs/input-policy.md and :mod:`nvfp4_jax.validate`);
* :func:`matmul` (NVFP4 GEMM, W4A16 / W4A4; Pallas-Triton on NVIDIA GPUs, XLA elsewhere);
* :func:`moe` (routed NVFP4 mixture of experts).
"""

from .quantize import (
    JAX_RECIPES,
    NVFP4Array,
    dequantize,
    from_oracle,
    quantize,
    quantize_experts,
    to_oracle,
)
from .validate import checked

__all__ = ["JAX_RECIPES", "NVFP4Array", "checked", "dequantize", "from_oracle", "quantize",
           "quantize_experts", "to_oracle"]

try:  # the GEMM and MoE modules are optional until they land
    from .gemm.api import matmul  # noqa: F401

    __all__.append("matmul")
except ImportError:  # pragma: no cover
    pass
try:
    from . import moe  # noqa: F401  (the subpackage is callable: nvfp4_jax.moe(...))

    __all__.append("moe")
except ImportError:  # pragma: no cover
    pass
