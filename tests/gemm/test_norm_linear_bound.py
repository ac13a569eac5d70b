"""``testing.norm_linear_bound``: a W4A4 linear of an RMSNorm'd activation (``nn.norm_linear``)
held to the norm's rounding interval carried through the quantizer and the GEMM. Here the
composition XLA runs on the CPU lies inside it, and three faults (another layer's norm weight,
no bf16 rounding between the norm and its weight, an input scale off by 1.5x) fall out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfp4_jax as nj
import oracle
from nvfp4_jax import nn
from nvfp4_jax.testing import assert_norm_linear_close, norm_linear_bound
from nvfp4_jax.testing.assertions import interval_violations
from oracle.formats import bf16_round, f32


def _case(seed: int, m: int, n: int, k: int, x_mag: float, headroom: float):
    """bf16 x [m, k] at x_mag, two layers' bf16 norm weights spread over 2^-10..2^4 (so the
    activation's block scales reach E4M3 subnormals at small input scales), a modelopt weight
    [n, k], and layer 1's input scale: headroom x the normed amax / 2688."""
    rng = np.random.default_rng(seed)
    x = bf16_round(rng.standard_normal((m, k)) * x_mag)
    norms = bf16_round(np.exp2(rng.uniform(-10, 4, (2, k))) * rng.choice([-1, 1], (2, k)))
    w = nj.from_oracle(oracle.quantize(f32(rng.standard_normal((n, k)) * 0.05), "modelopt"))
    xn, _ = oracle.norm_rope_interval(x, norms[1], 1e-6, None, None)
    s = float(f32(np.abs(xn).max() / 2688.0 * headroom))
    return x, norms, w, s


@jax.jit
def _norm_linear(p, x, nw):
    return nn.norm_linear(p, x, nw, 1e-6)


def _run(x, norms, w, s, norm_of=lambda norms, layer: norms[layer]):
    return np.asarray(_norm_linear(nn.Linear(w, jnp.float32(s)), jnp.asarray(x, jnp.bfloat16),
                                   jnp.asarray(norm_of(norms, 1), jnp.bfloat16)), np.float64)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), m=st.sampled_from([1, 9]), k=st.sampled_from([128, 2048]),
       x_mag=st.sampled_from([1e-3, 1.0, 300.0]), headroom=st.sampled_from([1.0, 2.0**-6]))
def test_the_composition_lies_in_the_bound(seed, m, k, x_mag, headroom):
    x, norms, w, s = _case(seed, m, 48, k, x_mag, headroom)
    out = _run(x, norms, w, s)
    b = assert_norm_linear_close(out, x, nj.to_oracle(w), s, norms[1])
    assert np.all(np.isfinite(b.ref)) and np.any(b.ref != 0)


def test_the_plain_linear_lies_in_the_bound():
    x, _, w, s = _case(3, 5, 40, 512, 1.0, 1.0)
    s = float(f32(np.abs(x).max() / 2688.0))
    out = np.asarray(nn.linear(nn.Linear(w, jnp.float32(s)), jnp.asarray(x, jnp.bfloat16)),
                     np.float64)
    assert_norm_linear_close(out, x, nj.to_oracle(w), s)


@pytest.mark.parametrize("fault", ["other_layer", "no_middle_rounding", "input_scale_off"])
def test_faults_fall_outside(fault):
    x, norms, w, s = _case(7, 4, 48, 512, 1.0, 2.0**-6)
    if fault == "other_layer":
        out = _run(x, norms, w, s, norm_of=lambda n, layer: n[0])
    elif fault == "input_scale_off":  # not a power of two: the scale bytes absorb those
        out = _run(x, norms, w, float(f32(s * 1.5)))
    else:
        xf = jnp.asarray(x, jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
        xn = (jnp.asarray(norms[1], jnp.float32) * y).astype(jnp.bfloat16)  # one rounding only
        out = np.asarray(nn.linear(nn.Linear(w, jnp.float32(s)), xn), np.float64)
    with pytest.raises(AssertionError, match="outside the derived interval"):
        assert_norm_linear_close(out, x, nj.to_oracle(w), s, norms[1])


def test_nan_never_passes_and_the_bound_is_narrow():
    x, norms, w, s = _case(11, 3, 32, 256, 1.0, 1.0)
    b = norm_linear_bound(x, nj.to_oracle(w), s, norms[1])
    out = _run(x, norms, w, s)
    out[1, 5] = np.nan
    assert interval_violations(out, b)[1, 5] == np.inf
    # the interval is a few bf16 ulps, not a tolerance: most outputs have one value
    assert np.mean(b.lo == b.hi) > 0.5


def test_bad_arguments_name_themselves():
    x, norms, w, s = _case(2, 2, 16, 128, 1.0, 1.0)
    wo = nj.to_oracle(w)
    with pytest.raises(ValueError, match=r"^x: expected \[M, K\]"):
        norm_linear_bound(x[0], wo, s, norms[1])
    with pytest.raises(ValueError, match=r"^w: expected an NVFP4 \[N, K=256\]"):
        norm_linear_bound(np.concatenate([x, x], 1), wo, s)
    with pytest.raises(ValueError, match=r"^norm_weight: expected \[K=128\]"):
        norm_linear_bound(x, wo, s, norms)
    for bad in (0.0, -s, float("nan"), [s, s]):
        with pytest.raises(ValueError, match="^input_scale: expected a positive finite scalar"):
            norm_linear_bound(x, wo, bad, norms[1])
