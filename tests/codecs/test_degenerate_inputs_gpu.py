"""The input policy (docs/input-policy.md) on the GPU kernels: all-zero weights give zeros,
non-finite activations give NaN rows, out-of-range expert ids give NaN rows. Skipped without
a CUDA GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
from nvfp4_jax.device import on_gpu

pytestmark = pytest.mark.gpu


if not on_gpu():  # the package's one device probe
    pytest.skip("needs an NVIDIA GPU (jax has no gpu device here)", allow_module_level=True)

M, N, K = 8, 256, 512


@pytest.mark.parametrize("backend", ["pallas", "mosaic", "xla"])
def test_gpu_matmul_zero_weight_and_nonfinite_rows(backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    for recipe in nj.JAX_RECIPES:
        w0 = nj.quantize(jnp.zeros((N, K), jnp.float32), recipe)
        for kw in ({}, {"input_scale": 0.002}):
            out = nj.matmul(jnp.asarray(x, jnp.bfloat16), w0, backend=backend, **kw)
            assert (np.asarray(out.astype(jnp.float32)) == 0).all(), (recipe, kw)
    w = nj.quantize(jnp.asarray(rng.standard_normal((N, K)), jnp.float32), "modelopt")
    x[3, 100] = np.inf
    f = jax.jit(lambda v: nj.matmul(v, w, input_scale=0.002, backend=backend))
    out = np.asarray(f(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    assert np.isnan(out[3]).all(), f"row 3: {int(np.isfinite(out[3]).sum())} finite"
    assert np.isfinite(np.delete(out, 3, 0)).all(), "another row is not finite"
    x[3, 100] = np.nan
    out = np.asarray(f(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    assert np.isnan(out[3]).all(), f"row 3: {int(np.isfinite(out[3]).sum())} finite"
    assert np.isfinite(np.delete(out, 3, 0)).all(), "another row is not finite"


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_gpu_moe_nonfinite_hidden_and_bad_ids(backend):
    rng = np.random.default_rng(1)
    t, h, i, e, k = 6, 512, 256, 8, 2
    fc1 = nj.quantize_experts(jnp.asarray(rng.standard_normal((e, i, h)) / 16, jnp.float32))
    fc2 = nj.quantize_experts(jnp.asarray(rng.standard_normal((e, h, i)) / 16, jnp.float32))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    wts = np.full((t, k), 0.5, np.float32)
    s = jnp.full((e,), 0.002, jnp.float32)
    f = jax.jit(lambda hid, ids: nj.moe(hid, fc1=fc1, fc2=fc2, fc1_input_scale=s,
                                        fc2_input_scale=s, topk_ids=ids,
                                        topk_weights=jnp.asarray(wts), backend=backend))
    hid = rng.standard_normal((t, h)).astype(np.float32)
    for bad in (np.inf, np.nan):
        hid[2, 7] = bad
        out = np.asarray(f(jnp.asarray(hid, jnp.bfloat16), jnp.asarray(ids)).astype(jnp.float32))
        assert np.isnan(out[2]).all(), f"row 2: {int(np.isfinite(out[2]).sum())} finite"
        assert np.isfinite(np.delete(out, 2, 0)).all(), "another row is not finite"
    hid[2, 7] = 0.0
    ids[4, 1] = e + 3
    out = np.asarray(f(jnp.asarray(hid, jnp.bfloat16), jnp.asarray(ids)).astype(jnp.float32))
    assert np.isnan(out[4]).all(), f"row 4: {int(np.isfinite(out[4]).sum())} finite"
    assert np.isfinite(np.delete(out, 4, 0)).all(), "another row is not finite"


@pytest.mark.parametrize("backend", ["pallas", "mosaic", "auto"])
def test_gpu_jitted_callers_carry_no_effects(backend):
    """On the GPU too (the Mosaic kernels trace only here), a jitted caller of matmul and moe
    holds no effect: each call keeps jit's C++ dispatch (docs/input-policy.md)."""
    rng = np.random.default_rng(2)
    t, h, i, e, k = 4, 512, 256, 8, 2
    w = nj.quantize(jnp.asarray(rng.standard_normal((N, K)), jnp.float32), "modelopt")
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    for kw in ({}, {"input_scale": 0.002}):
        f = jax.jit(lambda v, kw=kw: nj.matmul(v, w, backend=backend, **kw))
        assert jax.make_jaxpr(f)(x).effects == set(), kw
    fc1 = nj.quantize_experts(jnp.asarray(rng.standard_normal((e, 2 * i, h)) / 16, jnp.float32))
    fc2 = nj.quantize_experts(jnp.asarray(rng.standard_normal((e, h, i)) / 16, jnp.float32))
    s = jnp.full((e,), 0.002, jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32))
    g = jax.jit(lambda hid: nj.moe(hid, fc1=fc1, fc2=fc2, fc1_input_scale=s, fc2_input_scale=s,
                                   topk_ids=ids, topk_weights=jnp.full((t, k), 0.5),
                                   activation="swiglu", backend=backend))
    assert jax.make_jaxpr(g)(jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)).effects == set()
