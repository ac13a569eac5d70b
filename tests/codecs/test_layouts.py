"""Scale layouts: linear, swizzled 128x4 and 8x4 (oracle and JAX), against the TRT-LLM
offset formulas written out independently here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from nvfp4_jax import layouts as JL


def _ceil(a, b):
    return -(-a // b) * b


def _offset_128x4(m, k, kv):
    # TRT-LLM get_sf_out_offset_128x4 (nvfp4-semantics.md 2.3)
    return (m // 128) * (_ceil(kv, 4) // 4 * 512) + (k // 4) * 512 + (m % 32) * 16 \
        + ((m % 128) // 32) * 4 + (k % 4)


def _offset_8x4(m, k, kv):
    # TRT-LLM get_sf_out_offset_8x4
    return (m // 8) * (_ceil(kv, 4) // 4 * 32) + (k // 4) * 32 + (m % 8) * 4 + (k % 4)


OFFSET = {"swizzled_128x4": (_offset_128x4, 128), "swizzled_8x4": (_offset_8x4, 8)}


@pytest.mark.parametrize("layout", ["swizzled_128x4", "swizzled_8x4"])
@pytest.mark.parametrize("rows,kv", [(1, 1), (7, 3), (33, 5), (128, 4), (129, 9), (300, 2)])
def test_swizzle_matches_offset_formula(layout, rows, kv):
    rng = np.random.default_rng(rows * 100 + kv)
    s = rng.integers(1, 255, (rows, kv), dtype=np.uint8)
    buf = oracle.swizzle(s, layout)
    off, tile = OFFSET[layout]
    assert buf.shape == (_ceil(rows, tile) * _ceil(kv, 4),)
    want = np.zeros_like(buf)
    for m in range(rows):
        for k in range(kv):
            want[off(m, k, kv)] = s[m, k]
    np.testing.assert_array_equal(buf, want)  # padding bytes are zero
    assert oracle.padded_shape(rows, kv, layout) == (_ceil(rows, tile), _ceil(kv, 4))
    np.testing.assert_array_equal(oracle.unswizzle(buf, rows, kv, layout), s)
    jb = np.asarray(JL.swizzle(jnp.asarray(s), layout))
    np.testing.assert_array_equal(jb, buf)
    np.testing.assert_array_equal(np.asarray(JL.unswizzle(jnp.asarray(buf), rows, kv, layout)), s)
    from oracle.layouts import offset_8x4, offset_128x4
    lead = offset_128x4 if layout == "swizzled_128x4" else offset_8x4
    assert all(lead(m, k, kv) == off(m, k, kv) for m in range(rows) for k in range(kv))


_jsw = jax.jit(JL.swizzle, static_argnums=1)
_junsw = jax.jit(JL.unswizzle, static_argnums=(1, 2, 3))


@settings(max_examples=150)
@given(
    batch=st.sampled_from([(), (2,), (3, 1)]),
    rows=st.integers(1, 200),
    kv=st.integers(1, 12),
    layout=st.sampled_from(oracle.LAYOUTS),
    seed=st.integers(0, 2**31),
)
def test_layout_round_trip(batch, rows, kv, layout, seed):
    """Property: unswizzle(swizzle(s)) == s for every layout, stacked batches and odd row
    counts, oracle and JAX; JAX bytes == oracle bytes; padding is zero and each byte of s
    appears exactly once."""
    rng = np.random.default_rng(seed)
    s = rng.integers(1, 256, batch + (rows, kv), dtype=np.uint8)
    buf = oracle.swizzle(s, layout)
    np.testing.assert_array_equal(oracle.unswizzle(buf, rows, kv, layout), s)
    jb = np.asarray(_jsw(jnp.asarray(s), layout))
    np.testing.assert_array_equal(jb, buf)
    np.testing.assert_array_equal(np.asarray(_junsw(jnp.asarray(buf), rows, kv, layout)), s)
    if layout != "linear":
        mp, kp = oracle.padded_shape(rows, kv, layout)
        assert buf.shape == batch + (mp * kp,)
        assert np.count_nonzero(buf) == np.count_nonzero(s) == s.size  # pads are zero
        # per matrix, the multiset of bytes is preserved
        np.testing.assert_array_equal(
            np.sort(buf.reshape(-1, mp * kp), axis=-1)[:, -rows * kv:],
            np.sort(s.reshape(-1, rows * kv), axis=-1),
        )


def test_layout_errors():
    with pytest.raises(ValueError, match="layout"):
        oracle.padded_shape(4, 4, "swizzled_4x4")
    with pytest.raises(ValueError, match="expected last dimension"):
        oracle.unswizzle(np.zeros(100, np.uint8), 4, 4, "swizzled_128x4")
    with pytest.raises(ValueError, match="expected last dimension"):
        JL.unswizzle(jnp.zeros(100, jnp.uint8), 4, 4, "swizzled_8x4")


def test_128x4_is_the_5d_permutation():
    """Equivalent form: [Mp/128, 4, 32, Kp/4, 4] -> [Mp/128, Kp/4, 32, 4, 4]."""
    rows, kv = 256, 8
    s = (np.arange(rows * kv) % 251 + 1).astype(np.uint8).reshape(rows, kv)
    v = s.reshape(2, 4, 32, 2, 4).transpose(0, 3, 2, 1, 4).reshape(-1)
    np.testing.assert_array_equal(oracle.swizzle(s, "swizzled_128x4"), v)
