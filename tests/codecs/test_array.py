"""NVFP4Array: validation, pytree behaviour under jit/vmap, layouts, oracle round trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
import oracle
from nvfp4_jax import formats as F
from nvfp4_jax.quantize import NVFP4Array

# jitted once per static configuration (eager op-by-op dispatch compiles every op)
_quantize = jax.jit(nj.quantize, static_argnames=("recipe", "layout"))
_dequantize = jax.jit(nj.dequantize, static_argnames=("dtype", "include_decode_scale"))


def _parts(rows=5, k=64, lead=()):
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, 256, lead + (rows, k // 2), dtype=np.uint8))
    sbytes = rng.integers(0, 0x7F, lead + (rows, k // 16), dtype=np.uint8)
    scales = jax.lax.bitcast_convert_type(jnp.asarray(sbytes), jnp.float8_e4m3fn)
    return codes, scales, jnp.float32(0.25), sbytes


def test_from_parts_ok():
    codes, scales, d, _ = _parts()
    a = NVFP4Array.from_parts(codes, scales, d)
    assert a.shape == (5, 64) and a.layout == "linear" and a.ndim == 2


def test_uint8_scales_rejected_with_bitcast_hint():
    codes, _, d, sbytes = _parts()
    with pytest.raises(TypeError, match="bitcast_convert_type") as e:
        NVFP4Array.from_parts(codes, jnp.asarray(sbytes), d)
    assert "scales" in str(e.value) and "uint8" in str(e.value)


@pytest.mark.parametrize("bad_dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e5m2])
def test_wrong_scale_dtype_rejected(bad_dtype):
    codes, scales, d, _ = _parts()
    with pytest.raises(TypeError, match="scales: expected float8_e4m3fn"):
        NVFP4Array.from_parts(codes, scales.astype(bad_dtype), d)


def test_wrong_codes_dtype_rejected():
    codes, scales, d, _ = _parts()
    with pytest.raises(TypeError, match="codes: expected uint8"):
        NVFP4Array.from_parts(codes.astype(jnp.int8), scales, d)


def test_wrong_shapes_rejected():
    codes, scales, d, _ = _parts()
    with pytest.raises(ValueError, match="codes: expected shape"):
        NVFP4Array.from_parts(codes, scales, d, shape=(5, 48))
    with pytest.raises(ValueError, match="scales: expected shape"):
        NVFP4Array.from_parts(codes, scales[:, :3], d)
    with pytest.raises(ValueError, match="scales: expected shape"):
        NVFP4Array.from_parts(codes, scales[:4], d)


def test_k_not_multiple_of_16_rejected():
    rng = np.random.default_rng(1)
    codes = jnp.asarray(rng.integers(0, 256, (4, 12), dtype=np.uint8))  # K = 24
    scales = jnp.zeros((4, 1), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Array.from_parts(codes, scales, jnp.float32(1))


def test_wrong_layout_rejected():
    codes, scales, d, _ = _parts()
    with pytest.raises(ValueError, match="layout"):
        NVFP4Array.from_parts(codes, scales, d, layout="swizzled_4x4")
    # linear-shaped scales declared as swizzled
    with pytest.raises(ValueError, match="scales: expected shape"):
        NVFP4Array.from_parts(codes, scales, d, layout="swizzled_128x4")
    # 1-D tensor cannot be swizzled
    with pytest.raises(ValueError, match="rank"):
        NVFP4Array.from_parts(codes[0], jnp.zeros((128 * 4,), jnp.float8_e4m3fn), d,
                              layout="swizzled_128x4")


def test_decode_scale_checks():
    codes, scales, _, _ = _parts(lead=(3,))
    NVFP4Array.from_parts(codes, scales, jnp.ones((3,), jnp.float32))  # per matrix: ok
    with pytest.raises(ValueError, match="decode_scale: expected shape"):
        NVFP4Array.from_parts(codes, scales, jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match="decode_scale: expected shape"):
        NVFP4Array.from_parts(codes, scales, jnp.ones((3, 5), jnp.float32))
    with pytest.raises(TypeError, match="decode_scale: expected float32"):
        NVFP4Array.from_parts(codes, scales, jnp.ones((3,), jnp.bfloat16))


def _x(shape=(37, 64), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape[:-1] + (1,)))).astype(
        np.float32)


def test_pytree_round_trip_under_jit():
    a = _quantize(jnp.asarray(_x()), recipe="trtllm", decode_scale=np.float32(0.01))
    leaves, tree = jax.tree_util.tree_flatten(a)
    assert len(leaves) == 3
    b = jax.tree_util.tree_unflatten(tree, leaves)
    assert b.shape == a.shape and b.layout == a.layout

    @jax.jit
    def ident(t):
        return t

    c = ident(a)
    assert isinstance(c, NVFP4Array) and c.shape == a.shape
    np.testing.assert_array_equal(np.asarray(c.codes), np.asarray(a.codes))
    np.testing.assert_array_equal(np.asarray(F.e4m3_bytes(c.scales)),
                                  np.asarray(F.e4m3_bytes(a.scales)))
    d = jax.jit(lambda t: nj.dequantize(t))(a)
    np.testing.assert_array_equal(np.asarray(d), np.asarray(_dequantize(a)))


def test_quantize_under_vmap_equals_per_matrix():
    x = np.stack([_x((8, 32), s) for s in range(3)])
    ds = np.array([0.01, 0.002, 0.5], np.float32)
    f = jax.vmap(lambda xi, di: nj.quantize(xi, "trtllm", decode_scale=di))
    a = f(jnp.asarray(x), jnp.asarray(ds))
    assert np.asarray(a.codes).shape == (3, 8, 16)
    for i in range(3):
        ref = oracle.quantize(x[i].astype(np.float64), "trtllm", decode_scale=float(ds[i]))
        np.testing.assert_array_equal(np.asarray(a.codes)[i], ref.codes)
        np.testing.assert_array_equal(np.asarray(F.e4m3_bytes(a.scales))[i], ref.scales)


def test_vmap_over_nvfp4array():
    x = np.stack([_x((8, 32), s) for s in range(2)])
    a = _quantize(jnp.asarray(x), recipe="trtllm", decode_scale=np.float32(0.01))
    d = jax.vmap(lambda t: nj.dequantize(t))(
        NVFP4Array(a.codes, a.scales, jnp.full((2,), 0.01, jnp.float32), (8, 32), "linear"))
    np.testing.assert_array_equal(np.asarray(d), np.asarray(_dequantize(a)))


@pytest.mark.parametrize("rows", [1, 37, 130])
def test_with_layout_round_trip(rows):
    a = _quantize(jnp.asarray(_x((rows, 48))), recipe="modelopt", decode_scale=np.float32(0.004))
    lin = np.asarray(F.e4m3_bytes(a.scales))
    for layout in ("swizzled_128x4", "swizzled_8x4", "linear"):
        b = a.with_layout(layout)
        assert b.layout == layout
        np.testing.assert_array_equal(np.asarray(F.e4m3_bytes(b.scales)),
                                      oracle.swizzle(lin, layout))
        c = b.with_layout("linear")
        np.testing.assert_array_equal(np.asarray(F.e4m3_bytes(c.scales)), lin)
        np.testing.assert_array_equal(np.asarray(_dequantize(b)), np.asarray(_dequantize(a)))
        b2 = b.with_layout("swizzled_8x4" if layout != "swizzled_8x4" else "swizzled_128x4")
        np.testing.assert_array_equal(np.asarray(F.e4m3_bytes(b2.linear_scales())), lin)


def test_oracle_round_trip_and_dequantize():
    x = _x((9, 64), 4)
    ref = oracle.quantize(x.astype(np.float64), "trtllm", decode_scale=float(np.float32(0.003)))
    for layout in oracle.LAYOUTS:
        a = nj.from_oracle(ref, layout)
        back = nj.to_oracle(a)
        np.testing.assert_array_equal(back.codes, ref.codes)
        np.testing.assert_array_equal(back.scales, ref.scales)
        assert back.decode_scale == ref.decode_scale
        # values without the decode scale are exact in fp32: equal to the oracle's float64
        got = np.asarray(_dequantize(a, include_decode_scale=False)).astype(np.float64)
        np.testing.assert_array_equal(got, oracle.dequantize(ref, include_decode_scale=False))


@pytest.mark.parametrize("fn", [nj.dequantize, nj.to_oracle])
@pytest.mark.parametrize("a", [np.ones((4, 16)), jnp.ones((4, 8), jnp.uint8), None])
def test_dequantize_and_to_oracle_name_a_non_nvfp4_argument(fn, a):
    with pytest.raises(ValueError, match="^a: expected an NVFP4Array"):
        fn(a)
