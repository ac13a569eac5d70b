"""Reusable test tooling for NVFP4 implementations (public; usable from other projects' CI).

* :mod:`nvfp4_jax.testing.strategies`: hypothesis strategies for NVFP4 tensors with controlled
  block maxima and global scales (E4M3 underflow, subnormal and overflow regimes, zero and
  single-outlier blocks), checkpoint-like ModelOpt-quantized weights, routings and whole MoE
  problems.
* :mod:`nvfp4_jax.testing.assertions`: :func:`assert_gemm_close` (``oracle.gemm_error_bound``)
  and :func:`assert_moe_close` (an interval bound propagated through the MoE's rounding points),
  both naming the worst element and its inputs when they fail; :func:`assert_norm_linear_close`
  (a W4A4 linear of an RMSNorm'd activation, the norm's rounding interval carried through); :func:`assert_quantize_consistent`
  (every code is a nearest E2M1 value of ``x * G / s`` for its stored scale byte ``s``).
* :mod:`nvfp4_jax.testing.lowering`: :func:`mosaic_lowered_as` (the Mosaic kernels lowered as
  for another compute capability, e.g. SM 12.x's, and run on the GPU at hand).

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
    assert_norm_linear_close,
    assert_quantize_consistent,
    gemm_reference,
    moe_bound,
    norm_linear_bound,
    quantize_interval,
    quantize_violations,
)
from .lowering import mosaic_lowered_as

__all__ = ["assert_gemm_close", "assert_moe_close", "assert_norm_linear_close",
           "assert_quantize_consistent", "gemm_reference", "moe_bound", "mosaic_lowered_as",
           "norm_linear_bound", "quantize_interval", "quantize_violations",
           "strategies"]


def __getattr__(name: str):
    # the strategies need hypothesis (the ``test`` extra); the assertions do not
    if name == "strategies":
        import importlib

        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
