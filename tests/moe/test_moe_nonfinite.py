"""A token whose hidden row holds NaN/Inf comes out as a NaN row on every backend, whatever a
kernel's arithmetic makes of the non-finite values (docs/input-policy.md): ``moe`` gives that
token NaN router weights, and every backend multiplies each route's FC2 output by its weight.

A GPU ``max`` may return the non-NaN operand, so a kernel can turn a NaN into a finite value
(relu2's ``max(u, 0)``, an amax); the test stands in such a kernel for the XLA backend and
checks that the row stays NaN and the other rows are untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
from nvfp4_jax.moe import api
from nvfp4_jax.triton_ops import fc1_activation


def _layer(rng, t=6, h=64, i=32, e=4, k=2):
    fc1 = nj.quantize_experts(jnp.asarray(rng.standard_normal((e, i, h)) / 16, jnp.float32))
    fc2 = nj.quantize_experts(jnp.asarray(rng.standard_normal((e, h, i)) / 16, jnp.float32))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    wts = jnp.full((t, k), 0.5, jnp.float32)
    s = jnp.full((e,), 0.002, jnp.float32)
    return fc1, fc2, jnp.asarray(ids), wts, s


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_token_is_a_nan_row_even_if_the_kernel_launders_it(monkeypatch, bad):
    real = api.moe_xla

    def laundering(hidden, *args, **kw):  # a kernel whose arithmetic drops NaN/Inf
        return real(jnp.nan_to_num(hidden, nan=0.0, posinf=1.0, neginf=-1.0), *args, **kw)

    monkeypatch.setattr(api, "moe_xla", laundering)
    rng = np.random.default_rng(0)
    fc1, fc2, ids, wts, s = _layer(rng)
    f = jax.jit(lambda hid: nj.moe(hid, fc1=fc1, fc2=fc2, fc1_input_scale=s, fc2_input_scale=s,
                                   topk_ids=ids, topk_weights=wts, backend="xla"))
    hid = rng.standard_normal((6, 64)).astype(np.float32)
    clean = np.asarray(f(jnp.asarray(hid, jnp.bfloat16)).astype(jnp.float32))
    hid[2, 7] = bad
    out = np.asarray(f(jnp.asarray(hid, jnp.bfloat16)).astype(jnp.float32))
    assert np.isnan(out[2]).all()
    np.testing.assert_array_equal(np.delete(out, 2, 0), np.delete(clean, 2, 0))


def test_relu2_epilogue_keeps_nan():
    acc = jnp.asarray([[np.nan, -1.0, 2.0, -0.0]], jnp.float32)
    h = np.asarray(fc1_activation(acc, None, None, activation="relu2", gate_up_order="up_gate",
                                  mode="b12x", exact_asm=False).astype(jnp.float32))
    assert np.isnan(h[0, 0]) and h[0, 1] == 0.0 and h[0, 2] == 4.0 and h[0, 3] == 0.0
