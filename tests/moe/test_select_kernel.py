"""moe.select_kernel (interpret mode) and routing.select_experts (XLA) against
oracle.select_experts: the kernel's experts equal the oracle's for any fp32 logits (ties, +0
against -0, -inf, magnitudes from 1e-3 to 300, where most exps flush to zero), its weights lie
within oracle.select_experts_error_bound, and a token with undefined softmax or a non-finite hidden
value gets NaN weights; XLA's path within the same bound on bf16-valued logits (a router's
bf16 output). Through ``moe``: the router-logits path on a kernel backend is the kernel's
routing, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_cases import make_case
from test_moe import to_jax

import oracle
from nvfp4_jax.device import pallas_interpret
from nvfp4_jax.moe.api import moe
from nvfp4_jax.moe.routing import select_experts
from nvfp4_jax.moe.select_kernel import select_fits, select_kernel

#: (T, E, k, H): decode (Qwen3's 128 experts, top-8), a tile of several tokens, two programs
#: (T past one tile), many experts with a large k
SHAPES = [(1, 128, 8, 256), (5, 60, 6, 64), (300, 16, 2, 32), (3, 512, 22, 48)]


def _logits(rng, t, e):
    lg = rng.standard_normal((t, e)) * rng.choice([1e-3, 1.0, 30.0, 300.0], (t, 1))
    lg = lg.astype(np.float32)
    for i in range(t):  # ties: some experts share a logit with another
        if rng.random() < 0.5:
            src = rng.integers(e)
            lg[i, rng.choice(e, size=min(e, 3), replace=False)] = lg[i, src]
        if rng.random() < 0.2:  # +0 and -0, equal logits of other bits
            a, b = rng.choice(e, size=2, replace=False)
            lg[i, a], lg[i, b] = 0.0, -0.0
        if rng.random() < 0.2:  # -inf for some experts (masked routing)
            lg[i, rng.choice(e, size=rng.integers(1, e), replace=False)] = -np.inf
    return lg


def _poison(rng, lg, x):
    """Tokens with a NaN or +inf logit, all logits -inf, or a NaN/Inf hidden value."""
    t = lg.shape[0]
    for i in rng.choice(t, size=min(t, 4), replace=False):
        kind = rng.integers(5)
        if kind == 0:
            lg[i, rng.integers(lg.shape[1])] = np.nan
        elif kind == 1:
            lg[i, rng.integers(lg.shape[1])] = np.inf
        elif kind == 2:
            lg[i] = -np.inf
        elif kind == 3:
            x[i, rng.integers(x.shape[1])] = rng.choice([np.nan, np.inf, -np.inf])
    return lg, x


def _check(ids, w, lg, x, k, renormalize):
    oi, ow, bound = oracle.select_experts_error_bound(lg, k, renormalize=renormalize)
    nan_rows = ~np.isfinite(ow).all(axis=1) | ~np.isfinite(x.astype(np.float32)).all(axis=1)
    assert np.isnan(w[nan_rows]).all(), "a token with undefined softmax or a non-finite row"
    ok = ~nan_rows
    np.testing.assert_array_equal(ids[ok], oi[ok])
    err = np.abs(w[ok] - ow[ok])
    assert (err <= bound[ok]).all(), f"largest |err| / bound {np.max(err / bound[ok]):.3g}"
    assert ((ids >= 0) & (ids < lg.shape[1])).all()


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(SHAPES), renormalize=st.booleans(),
       poison=st.booleans())
def test_kernel_matches_the_oracle(seed, shape, renormalize, poison):
    rng = np.random.default_rng(seed)
    t, e, k, h = shape
    lg = _logits(rng, t, e)
    x = rng.standard_normal((t, h)).astype(ml_dtypes.bfloat16)
    if poison:
        lg, x = _poison(rng, lg, x)
    ids, w = select_kernel(jnp.asarray(lg), jnp.asarray(x), k, renormalize=renormalize,
                           interpret=pallas_interpret())
    _check(np.asarray(ids), np.asarray(w), lg, x, k, renormalize)


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), renormalize=st.booleans())
def test_xla_path_within_the_same_bound_on_bf16_logits(seed, renormalize):
    rng = np.random.default_rng(seed)
    t, e, k = 7, 128, 8
    lg = (rng.standard_normal((t, e)) * rng.choice([0.1, 1.0, 8.0], (t, 1)))
    lg = lg.astype(ml_dtypes.bfloat16).astype(np.float32)
    ids, w = select_experts(jnp.asarray(lg), k, renormalize=renormalize)
    _check(np.asarray(ids), np.asarray(w), lg, np.zeros((t, 1), np.float32), k, renormalize)


def test_fits_and_errors_name_arguments():
    assert select_fits(128, 8) and select_fits(4096, 1) and not select_fits(4097, 1)
    assert not select_fits(8, 9)
    lg, x = jnp.zeros((2, 8)), jnp.zeros((2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="router_logits"):
        select_kernel(lg[0], x, 2)
    with pytest.raises(ValueError, match="hidden"):
        select_kernel(lg, x[:1], 2)
    with pytest.raises(ValueError, match="top_k"):
        select_kernel(lg, x, 9)


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_moe_router_logits_on_kernel_backends_is_the_kernels_routing(backend):
    """moe(router_logits=...) on a kernel backend = moe(topk_ids, topk_weights) with the
    select kernel's routing, bit for bit; a non-finite hidden row gives a NaN output row and
    leaves the others finite."""
    rng = np.random.default_rng(5)
    t, h, e, k = 4, 256, 8, 2
    hidden, _, _, fc1, fc2, s1, s2 = to_jax(make_case(rng, t=t, h=h, inter=256, e=e, k=k))
    hidden = hidden.at[2, 7].set(jnp.nan)
    lg = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    kw = {"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2,
          "backend": backend}
    # jitted: a concrete non-finite hidden is refused outright (docs/input-policy.md)
    routed = jax.jit(lambda x, lg: moe(x, router_logits=lg, top_k=k, renormalize=True, **kw))
    given_ids = jax.jit(lambda x, ids, w: moe(x, topk_ids=ids, topk_weights=w, **kw))
    out = np.asarray(routed(hidden, lg), np.float32)
    ids, w = select_kernel(lg, hidden, k, renormalize=True, interpret=pallas_interpret())
    ref = np.asarray(given_ids(hidden, ids, w), np.float32)
    np.testing.assert_array_equal(out, ref)
    assert np.isnan(out[2]).all() and np.isfinite(np.delete(out, 2, axis=0)).all()
