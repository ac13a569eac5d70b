"""The W4A4 activation operand kernel (``gemm.operand.w4a4_operand``): byte-identical to the
oracle's ``trtllm`` quantization (interpret mode here; on the GPU with ``div.rn.f32``), in the
Mosaic kernel's K order and token tile when asked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from nvfp4_jax.gemm import mosaic
from nvfp4_jax.gemm.operand import w4a4_operand
from oracle.formats import bf16_round, f32


def _case(seed: int, m: int, k: int, decades: float, headroom: float):
    """bf16 x whose 16-value blocks span ``decades`` (so that block scales reach E4M3
    subnormals) and input_scale = headroom * amax / 2688 (headroom < 1: saturation)."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-decades, 0, (m, k // 16)).repeat(16, 1)
    x = bf16_round(rng.standard_normal((m, k)) * mag * 10.0 ** rng.uniform(-3, 3))
    s = float(f32(np.abs(x).max() / 2688.0 * headroom))
    return x, s


def _expected(x, s, rows, permute):
    q = oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s)))
    v = oracle.dequantize(q, include_decode_scale=False)
    if permute:
        v = np.asarray(mosaic.permute_k_order(jnp.asarray(v)))
    out = np.zeros((rows, x.shape[1]))
    out[: x.shape[0]] = v
    return out


@settings(max_examples=40)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 19), kb=st.integers(1, 40),
       decades=st.floats(0.0, 6.0), headroom=st.sampled_from([1.0, 0.5, 2.0**-6]),
       permute=st.booleans(), pad=st.integers(0, 9))
def test_operand_is_the_oracles_quantization(seed, m, kb, decades, headroom, permute, pad):
    k = kb * (128 if permute else 16)
    x, s = _case(seed, m, k, decades, headroom)
    got = w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.float32(s), rows=m + pad, permute=permute,
                       interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == (m + pad, k)
    np.testing.assert_array_equal(np.asarray(got, np.float64), _expected(x, s, m + pad, permute))


def test_fp16_activations_and_a_scalar_of_shape_1():
    x, s = _case(3, 4, 256, 4.0, 1.0)
    got = w4a4_operand(jnp.asarray(x, jnp.float16), jnp.asarray([s], jnp.float32), interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float64), _expected(x, s, 4, False))


def test_lowers_for_the_gpu_with_ieee_division():
    """The compiled kernel divides with ``div.rn.f32`` (inline PTX), not Triton's approximate
    ``/``: the reason it exists (XLA lowers fp32 division to div.full.f32 on GPUs)."""
    x = jnp.zeros((3, 512), jnp.bfloat16)
    f = jax.jit(lambda x, s: w4a4_operand(x, s, rows=8, permute=True))
    text = f.trace(x, jnp.float32(0.1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_w4a4_operand" in text and "div.rn.f32" in text


def test_mosaic_takes_the_prepared_operand():
    """``matmul_mosaic(..., rows=M)``: x is the [token_tile(M), K] permuted operand; no
    permutation or padding in XLA before the kernel (lowered for sm_90 on CPU)."""
    m, n, k = 3, 256, 512
    xp = jnp.zeros((mosaic.token_tile(m), k), jnp.bfloat16)
    codes = jnp.zeros((n, k // 2), jnp.uint8)
    scales = jnp.zeros((n, k // 16), jnp.uint8)
    f = jax.jit(lambda xp, c, s: mosaic.matmul_mosaic(xp, c, s, 1.0, rows=m))
    lowered = f.trace(xp, codes, scales).lower(lowering_platforms=("cuda",))
    assert lowered.out_info.shape == (m, n)
    hlo = lowered.as_text()
    assert "transpose" not in hlo.split("mosaic_gpu")[0]  # no K permutation of x before the kernel


@pytest.mark.parametrize("kwargs, message", [
    ({"rows": 2}, "rows: expected >= M = 3"),
    ({"permute": True}, "K must be a multiple of 128"),
])
def test_errors_name_the_argument(kwargs, message):
    x = jnp.zeros((3, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        w4a4_operand(x, jnp.float32(1.0), interpret=True, **kwargs)
    with pytest.raises(ValueError, match="x: expected bf16/fp16"):
        w4a4_operand(x.astype(jnp.float32), jnp.float32(1.0), interpret=True)
    with pytest.raises(ValueError, match="input_scale: expected an fp32 scalar"):
        w4a4_operand(x, jnp.ones((2,), jnp.float32), interpret=True)


def test_mosaic_refuses_a_prepared_operand_of_the_wrong_tile():
    with pytest.raises(ValueError, match=r"rows: a prepared x of 3 rows has token_tile\(3\) rows"):
        mosaic.matmul_mosaic(jnp.zeros((16, 512), jnp.bfloat16), jnp.zeros((256, 256), jnp.uint8),
                             jnp.zeros((256, 32), jnp.uint8), 1.0, rows=3)


@pytest.mark.gpu
def test_gpu_operand_is_byte_exact_at_prefill_and_ragged_shapes():
    """The compiled kernel (div.rn.f32) on the GPU: prefill M, K a multiple of 16 only, the
    Mosaic token tiles with the permutation, subnormal block scales and saturation."""
    from nvfp4_jax.device import gpu_compute_capability

    if gpu_compute_capability() is None:
        pytest.skip("needs an NVIDIA GPU")
    for seed, (m, k, rows, permute, headroom) in enumerate([
            (300, 1040, None, False, 1.0), (2048, 4096, None, False, 0.5), (37, 14336, 64, True, 1.0),
            (1, 8192, 8, True, 2.0**-6), (9, 48, 12, False, 1.0)]):
        x, s = _case(seed, m, k, 6.0, headroom)
        got = w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.float32(s), rows=rows, permute=permute)
        np.testing.assert_array_equal(np.asarray(got, np.float64), _expected(x, s, rows or m, permute),
                                      err_msg=f"M={m} K={k} rows={rows} permute={permute}")
