"""The W4A4 activation operand kernel of the Pallas-Triton path (``gemm.operand.w4a4_operand``):
byte-identical to the oracle's ``trtllm`` quantization (interpret mode here; on the GPU with
``div.rn.f32``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
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


def _expected(x, s):
    q = oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s)))
    return oracle.dequantize(q, include_decode_scale=False)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 19), kb=st.integers(1, 40),
       decades=st.floats(0.0, 6.0), headroom=st.sampled_from([1.0, 0.5, 2.0**-6]))
def test_operand_is_the_oracles_quantization(seed, m, kb, decades, headroom):
    k = kb * 16
    x, s = _case(seed, m, k, decades, headroom)
    got = w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.float32(s), interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, k)
    np.testing.assert_array_equal(np.asarray(got, np.float64), _expected(x, s))


def test_fp16_activations_and_a_scalar_of_shape_1():
    x, s = _case(3, 4, 256, 4.0, 1.0)
    got = w4a4_operand(jnp.asarray(x, jnp.float16), jnp.asarray([s], jnp.float32), interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float64), _expected(x, s))


def test_lowers_for_the_gpu_with_ieee_division():
    """The compiled kernel divides with ``div.rn.f32`` (inline PTX), not Triton's approximate
    ``/``: the reason it exists (XLA lowers fp32 division to div.full.f32 on GPUs)."""
    x = jnp.zeros((3, 512), jnp.bfloat16)
    f = jax.jit(lambda x, s: w4a4_operand(x, s))
    text = f.trace(x, jnp.float32(0.1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_w4a4_operand" in text and "div.rn.f32" in text


def test_errors_name_the_argument():
    x = jnp.zeros((3, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="x: K must be a multiple of 16"):
        w4a4_operand(x[:, :40], jnp.float32(1.0), interpret=True)
    with pytest.raises(ValueError, match="x: expected bf16/fp16"):
        w4a4_operand(x.astype(jnp.float32), jnp.float32(1.0), interpret=True)
    with pytest.raises(ValueError, match="input_scale: expected an fp32 scalar"):
        w4a4_operand(x, jnp.ones((2,), jnp.float32), interpret=True)


@pytest.mark.gpu
def test_gpu_operand_is_byte_exact_at_prefill_and_ragged_shapes():
    """The compiled kernel (div.rn.f32) on the GPU: prefill M, K a multiple of 16 only, decode M,
    subnormal block scales and saturation."""
    from nvfp4_jax.device import gpu_compute_capability

    if gpu_compute_capability() is None:
        pytest.skip("needs an NVIDIA GPU")
    for seed, (m, k, headroom) in enumerate([
            (300, 1040, 1.0), (2048, 4096, 0.5), (37, 14336, 1.0), (1, 8192, 2.0**-6), (9, 48, 1.0)]):
        x, s = _case(seed, m, k, 6.0, headroom)
        got = w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.float32(s))
        np.testing.assert_array_equal(np.asarray(got, np.float64), _expected(x, s), err_msg=f"M={m} K={k}")
