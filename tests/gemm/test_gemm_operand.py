"""The W4A4 activation operand kernels (``gemm.operand.w4a4_operand`` of the Pallas-Triton path,
``mosaic_w4a4_operand`` of the Mosaic GEMM): byte-identical to the oracle's ``trtllm``
quantization (interpret mode here; on the GPU with ``div.rn.f32``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from nvfp4_jax.gemm.operand import mosaic_w4a4_operand, w4a4_operand
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


def _wgmma_order(v: np.ndarray) -> np.ndarray:
    """[M, K] -> the Mosaic kernel's K order, from its definition (docs: position
    32w + 8j + 2c + l of each 128-group holds element 32c + 8w + 4l + j), by a loop."""
    out = np.empty_like(v)
    for g in range(v.shape[1] // 128):
        for c, w, l, j in np.ndindex(4, 4, 2, 4):
            dst, src = 128 * g + 32 * w + 8 * j + 2 * c + l, 128 * g + 32 * c + 8 * w + 4 * l + j
            out[:, dst] = v[:, src]
    return out


@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 64), kb=st.sampled_from([1, 2, 3, 16, 32]),
       decades=st.floats(0.0, 6.0), headroom=st.sampled_from([1.0, 0.5, 2.0**-6]))
def test_mosaic_operand_is_the_oracles_quantization_padded_and_permuted(
        seed, m, kb, decades, headroom):
    from nvfp4_jax.gemm.mosaic import token_tile

    k = kb * 128
    x, s = _case(seed, m, k, decades, headroom)
    rows = token_tile(m)
    got = mosaic_w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.float32(s), rows, interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, k)
    want = np.zeros((rows, k))
    want[:m] = _wgmma_order(_expected(x, s))
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def test_mosaic_operand_errors_name_the_argument():
    x = jnp.zeros((3, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="x: K must be a positive multiple of 128"):
        mosaic_w4a4_operand(x[:, :144], jnp.float32(1.0), 8, interpret=True)
    with pytest.raises(ValueError, match="rows: expected at least M = 3 rows"):
        mosaic_w4a4_operand(x, jnp.float32(1.0), 2, interpret=True)
    with pytest.raises(ValueError, match="input_scale: expected an fp32 scalar"):
        mosaic_w4a4_operand(x, jnp.ones((2,), jnp.float32), 8, interpret=True)


def test_matmul_on_a_made_operand_errors_name_the_argument():
    """``gemm.matmul_w4a4_operand`` and ``nn.linear_on_operand``: bad m, operand shapes and
    dtypes, a bf16 weight and a missing scale stack name the argument; off the Mosaic kernel
    (here: no GPU) the GEMM says it does not run rather than computing something else."""
    from nvfp4_jax import nn
    from nvfp4_jax.gemm import matmul_w4a4_operand
    from nvfp4_jax.quantize import quantize

    w = quantize(jnp.ones((64, 256), jnp.bfloat16), "trtllm")
    xp = jnp.zeros((8, 256), jnp.bfloat16)
    s = jnp.float32(0.01)
    for m, op, match in ((0, xp, "m: expected an int in 1..64"),
                         (65, xp, "m: expected an int in 1..64"),
                         (3, xp[:, :128], r"xp: expected bf16 \[8, K=256\] for m=3"),
                         (3, xp.astype(jnp.float32), r"xp: expected bf16 \[8, K=256\]"),
                         (9, xp, r"xp: expected bf16 \[16, K=256\] for m=9"),
                         (3, xp, "xp: the Mosaic W4A4 GEMM does not run M=3 N=64 K=256 here")):
        with pytest.raises(ValueError, match=match):
            matmul_w4a4_operand(op, m, w, s)
    with pytest.raises(ValueError, match="p: expected a W4A4 Linear"):
        nn.linear_on_operand(nn.Linear(w), xp, 3)
    with pytest.raises(ValueError, match=r"input_scales: expected the fp32 \[L\] stack"):
        nn.linear_on_operand(nn.Linear(w, s), xp, 3, layer=jnp.int32(0))
    assert nn.w4a4_operand_rows(nn.Linear(w, s), 3) is None  # no GPU: no Mosaic GEMM
    assert nn.w4a4_operand_rows(nn.Linear(w), 3) is None  # W4A16


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


@pytest.mark.gpu
def test_gpu_mosaic_operand_is_byte_exact():
    """The compiled Mosaic operand kernel (div.rn.f32): decode M, padded rows, the permutation,
    subnormal block scales and saturation."""
    from nvfp4_jax.device import gpu_compute_capability
    from nvfp4_jax.gemm.mosaic import token_tile

    if gpu_compute_capability() is None:
        pytest.skip("needs an NVIDIA GPU")
    for seed, (m, k, headroom) in enumerate([(1, 2048, 1.0), (5, 4096, 0.5), (64, 14336, 1.0),
                                             (33, 384, 2.0**-6)]):
        x, s = _case(seed, m, k, 6.0, headroom)
        rows = token_tile(m)
        got = mosaic_w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.float32(s), rows)
        want = np.zeros((rows, k))
        want[:m] = _wgmma_order(_expected(x, s))
        np.testing.assert_array_equal(np.asarray(got, np.float64), want, err_msg=f"M={m} K={k}")


def _check_normed(got: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float, s: float):
    """Each 16-value block of ``got`` [M, K] (rows past M zero) is the oracle's quantization
    of an RMSNorm'd block that the norm's rounding interval allows
    (``oracle.norm_rope_interval``: one value per element almost everywhere, two an ulp
    apart where the fp32 rsqrt can cross a bf16 rounding boundary)."""
    m, k = x.shape
    assert not np.any(got[m:]), "rows past M must be zero"
    lo, hi = oracle.norm_rope_interval(x, w, eps, None, None)
    inv = np.empty(k, np.int64)  # got back in x's K order
    inv[_wgmma_order(np.arange(k)[None])[0].astype(np.int64)] = np.arange(k)
    nat = got[:m][:, inv].reshape(m, k // 16, 16)
    want = _expected(lo, s).reshape(m, k // 16, 16)
    for r, b in zip(*np.nonzero(np.any(nat != want, axis=-1))):
        blo, bhi = lo[r, 16 * b:16 * b + 16], hi[r, 16 * b:16 * b + 16]
        amb = np.nonzero(blo != bhi)[0]
        assert 0 < len(amb) <= 6, f"row {r} block {b}: {nat[r, b]} against {want[r, b]}"
        ok = False
        for bits in range(1 << len(amb)):
            h = blo.copy()
            for i, j in enumerate(amb):
                if bits >> i & 1:
                    h[j] = bhi[j]
            ok |= np.array_equal(_expected(h[None], s)[0], nat[r, b])
        assert ok, f"row {r} block {b}: no value in the norm's interval quantizes to {nat[r, b]}"


@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 9), k=st.sampled_from([128, 256, 2048]),
       x_mag=st.sampled_from([1e-3, 1.0, 300.0]), headroom=st.sampled_from([1.0, 2.0**-6]))
def test_mosaic_operand_normed_from_the_stacks_at_the_layer(seed, m, k, x_mag, headroom):
    """RMSNorm + quantize from stacks: layer 1 of 3 layers whose norm weights and input
    scales differ, so reading another layer's fails; weights spread over 2^-10..2^4 (block
    scales into E4M3 subnormals with the small input scales)."""
    from nvfp4_jax.gemm.mosaic import token_tile

    rng = np.random.default_rng(seed)
    x = bf16_round(rng.standard_normal((m, k)) * x_mag)
    ws = bf16_round(np.exp2(rng.uniform(-10, 4, (3, k))) * rng.choice([-1, 1], (3, k)))
    lo, _ = oracle.norm_rope_interval(x, ws[1], 1e-6, None, None)
    scales = np.array([f32(np.abs(lo).max() / 2688.0 * h) for h in (0.25, headroom, 4.0)],
                      np.float32)
    rows = token_tile(m)
    got = mosaic_w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.asarray(scales), rows,
                              layer=jnp.int32(1), norm_weight=jnp.asarray(ws, jnp.bfloat16),
                              eps=1e-6, interpret=True)
    assert got.shape == (rows, k)
    _check_normed(np.asarray(got, np.float64), x, ws[1], 1e-6, float(scales[1]))


def test_mosaic_operand_reads_the_scale_stack_at_the_layer():
    x, s = _case(11, 3, 512, 4.0, 1.0)
    scales = jnp.asarray([4 * s, s, s / 4], jnp.float32)
    got = mosaic_w4a4_operand(jnp.asarray(x, jnp.bfloat16), scales, 8, layer=jnp.int32(1),
                              interpret=True)
    want = np.zeros((8, 512))
    want[:3] = _wgmma_order(_expected(x, s))
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def test_mosaic_operand_norm_errors_name_the_argument():
    x = jnp.zeros((2, 384), jnp.bfloat16)
    with pytest.raises(ValueError, match="K a power of two"):
        mosaic_w4a4_operand(x, jnp.float32(1.0), 8, norm_weight=jnp.ones(384, jnp.bfloat16),
                            interpret=True)
    with pytest.raises(ValueError, match=r"norm_weight: expected bf16 \[3, 256\]"):
        mosaic_w4a4_operand(x[:, :256], jnp.ones(3, jnp.float32), 8, layer=0,
                            norm_weight=jnp.ones(256, jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match=r"input_scale: expected the fp32 \[L\] stack"):
        mosaic_w4a4_operand(x, jnp.float32(1.0), 8, layer=0, interpret=True)


@pytest.mark.gpu
def test_gpu_mosaic_operand_normed_from_the_stacks():
    """The compiled kernel's RMSNorm (Triton's rsqrt) and quantization (div.rn.f32) within
    the norm's rounding interval, at Qwen3's and Llama's hidden sizes and M = 1, 8, 33."""
    from nvfp4_jax.device import gpu_compute_capability
    from nvfp4_jax.gemm.mosaic import token_tile

    if gpu_compute_capability() is None:
        pytest.skip("needs an NVIDIA GPU")
    for seed, (m, k) in enumerate([(1, 2048), (8, 4096), (33, 2048), (2, 8192)]):
        rng = np.random.default_rng(seed)
        x = bf16_round(rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3))
        ws = bf16_round(np.exp2(rng.uniform(-10, 4, (2, k))) * rng.choice([-1, 1], (2, k)))
        lo, _ = oracle.norm_rope_interval(x, ws[1], 1e-6, None, None)
        s = float(f32(np.abs(lo).max() / 2688.0 / 64))
        got = mosaic_w4a4_operand(jnp.asarray(x, jnp.bfloat16), jnp.asarray([1.0, s], jnp.float32),
                                  token_tile(m), layer=jnp.int32(1),
                                  norm_weight=jnp.asarray(ws, jnp.bfloat16), eps=1e-6)
        _check_normed(np.asarray(got, np.float64), x, ws[1], 1e-6, s)
