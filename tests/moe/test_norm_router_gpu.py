"""``nn.norm_router`` on a GPU (the compiled Pallas-Triton kernel): h and the logits within
``oracle.norm_rope_interval`` and ``oracle.router_logits_interval`` at Qwen3-30B-A3B's shapes
(H = 2048, 128 experts; and 60) for the decode batches the kernel takes, the stacks read in place at a
traced layer, and ``backend="auto"`` choosing the kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_norm_router import EPS, _case, _check_against_oracle, _residual

from nvfp4_jax import nn

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
    pytest.skip("needs an NVIDIA GPU (the Pallas-Triton kernel compiled for real)",
                allow_module_level=True)


@pytest.mark.parametrize("t, e", [(1, 128), (8, 128), (32, 128), (64, 128), (5, 60), (64, 60)])
@pytest.mark.parametrize("x_scale", [2.0**-20, 1.0, 300.0])
def test_kernel_within_the_oracle_intervals_on_gpu(t, e, x_scale):
    """E = 60 at T = 64: 8 experts a program, the last block half empty (its mask)."""
    x, w, r = _case(10 + t, t, 2048, e, x_scale, 0.05, layers=4)
    run = jax.jit(functools.partial(nn.norm_router, eps=EPS, backend="auto"))
    h, logits = run(x, w, r, layer=jnp.int32(2))
    # H = 2048: the any-order bound (gamma_2047 sum |h r|) spans a bf16 rounding boundary for
    # most logits, so the interval holds two values there, rarely three
    _check_against_oracle(x, w[2], r[2], h, logits)
    h1, l1 = run(x, w[2], r[2])  # the [H], [E, H] form: the same program order, the same bits
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h1, np.float32))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(l1))
    text = str(jax.make_jaxpr(run)(x, w, r, layer=jnp.int32(2)))
    assert "nvfp4_moe_norm_router" in text


@pytest.mark.parametrize("t, e", [(1, 128), (8, 128), (64, 60)])
@pytest.mark.parametrize("kind", ["random", "cancel", "half"])
def test_add_norm_router_on_gpu(t, e, kind):
    """``add_norm_router`` compiled: the sum is the bf16 add of the two arrays bit for bit
    (XLA's, each materialized), h and the logits the kernel's ``norm_router`` of that sum."""
    x, w, r = _case(40 + t, t, 2048, e, 1.0, 0.05, layers=4)
    a = _residual(x, t, kind)
    run = jax.jit(functools.partial(nn.add_norm_router, eps=EPS, backend="auto"))
    s, h, logits = run(x, a, w, r, layer=jnp.int32(1))
    want = jax.jit(jnp.add)(x, a)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(want, np.float32))
    _check_against_oracle(want, w[1], r[1], h, logits)
    h1, l1 = jax.jit(functools.partial(nn.norm_router, eps=EPS, backend="auto"))(
        want, w, r, layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h1, np.float32))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(l1))
    assert "nvfp4_moe_add_norm_router" in str(jax.make_jaxpr(run)(x, a, w, r, layer=jnp.int32(1)))
