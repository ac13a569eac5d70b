"""Reusable test tooling for NVFP4 implementations (public; usable from other projects' CI).

* :mod:`nvfp4_jax.testing.strategies`: hypothesis strategies for NVFP4 tensors with controlled
  block maxima and global scales (E4M3 underflow, subnormal and overflow regimes, zero and
  single-outlier blocks), checkpoint-like ModelOpt-quantized weights, routings and whole MoE
  problems.
* :mod:`nvfp4_jax.testing.assertions`: :func:`assert_gemm_close` (``oracle.gemm_error_bound``)
  and :func:`assert_moe_close` (an interval bound propagated through the MoE's rounding points),
  both naming the worst element and its inputs when they fail.

Example::

    from hypothesis import given
    from nvfp4_jax.testing import assert_moe_close, strategies as nst

    @given(nst.moe_problems())
    def test_kernel(p):
        assert_moe_close(my_moe(*p.args(), **p.kwargs()), *p.args(), **p.kwargs())
"""

from .assertions import (
           assert_gemm_close,
           assert_moe_close,
           gemm_reference,
           moe_bound,
           quantize_interval,
)

__all__ = ["assert_gemm_close", "assert_moe_close", "gemm_reference", "moe_bound",
           "quantize_interval", "strategies"]


def __getattr__(name: str):
    """``strategies`` is imported on first use: it needs hypothesis, the assertions do not
    (``nvfp4 selftest`` uses them without it)."""
    if name == "strategies":
        import importlib

        return importlib.import_module(f"{__name__}.strategies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
