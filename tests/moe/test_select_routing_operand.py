"""moe.routing_kernel.select_routing_operand_kernel (interpret mode): the softmax top-k pick,
the routing, the scales and the FC1 operand in one launch are bit for bit ``select_kernel``'s
picks and weights and ``routing_operand_kernel``'s outputs for those picks; the picks and
weights also against ``oracle.select_experts`` (its error bound), NaN weights for a token whose
softmax is undefined or whose hidden row holds a NaN or Inf. Through ``moe(backend="mosaic")``
(the XLA emulation of the Mosaic kernels on the CPU) the router-logits path takes this launch
and its output is the two-launch path's, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from moe_cases import make_case
from test_moe import to_jax
from test_select_kernel import _check, _logits, _poison

from nvfp4_jax.moe import mosaic as mmo
from nvfp4_jax.moe import routing_kernel as rtk
from nvfp4_jax.moe.api import moe
from nvfp4_jax.moe.select_kernel import select_kernel
from nvfp4_jax.moe.xla import recipe_of


def _u32(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("mode,act_scale,t,k,e,h,renormalize,poison,method", [
    ("trtllm_cutlass", "scalar", 1, 8, 128, 2048, True, False, None),   # Qwen3 decode
    ("b12x", "per_expert", 8, 8, 128, 512, False, True, None),
    ("trtllm_cutlass", "scalar", 3, 6, 24, 4096, True, True, None),   # two K tiles of 2048
    ("b12x", "scalar", 5, 3, 7, 256, False, False, None),            # E not a power of two
    ("b12x", "per_expert", 3, 6, 24, 256, True, True, "routes"),
    ("trtllm_cutlass", "scalar", 2, 22, 512, 1024, False, True, "routes"),  # nemotron
])
def test_one_launch_is_the_two_kernels(mode, act_scale, t, k, e, h, renormalize, poison, method):
    rng = np.random.default_rng(t * 1000 + h + e)
    lg = _logits(rng, t, e)
    x = (rng.standard_normal((t, h)) * np.exp2(rng.uniform(0, 10, (t, 1)))).astype(ml_dtypes.bfloat16)
    if poison:
        lg, x = _poison(rng, lg, x)
        x[t - 1, h // 2] = np.inf  # the last token's hidden row: NaN weights
    vecs = [(np.exp2(rng.uniform(lo, hi, e)) * rng.uniform(1, 2, e)).astype(np.float32)
            for lo, hi in ((-24, 4), (-24, 4), (-12, 8), (-12, 8))]
    scales, bm, recipe = (*vecs, mode, act_scale), 8, recipe_of(mode)
    hidden = jnp.asarray(x)
    ids, w, br, sv, xp = rtk.select_routing_operand_kernel(
        jnp.asarray(lg), hidden, k, e, bm, scales, renormalize=renormalize, recipe=recipe,
        interpret=True, method=method)
    want_ids, want_w = select_kernel(jnp.asarray(lg), hidden, k, renormalize=renormalize,
                                     interpret=True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(_u32(w), _u32(want_w))
    _check(np.asarray(ids), np.asarray(w), lg, x, k, renormalize)
    wbr, wsv, wxp = rtk.routing_operand_kernel(want_ids, hidden, e, bm, scales, recipe=recipe,
                                               interpret=True, method=method)
    for name in ("sorted_route", "block_expert", "num_blocks", "route_pos"):
        np.testing.assert_array_equal(np.asarray(getattr(br, name)), np.asarray(getattr(wbr, name)),
                                      err_msg=name)
    for got, want in zip(sv, wsv, strict=True):
        np.testing.assert_array_equal(_u32(got), _u32(want))
    live = np.asarray(br.route_pos)  # the routed rows (padding rows are not written)
    got, want = np.asarray(xp, np.float32)[live], np.asarray(wxp, np.float32)[live]
    finite = np.isfinite(x.astype(np.float32)).all(axis=1).repeat(k)  # a poisoned row is NaN
    assert np.count_nonzero(got[finite]) > got[finite].size // 20
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_one_launch_lowers_and_checks_operands():
    vecs = (jnp.ones(128), jnp.ones(128), jnp.ones(128), jnp.ones(128), "b12x", "per_expert")
    f = jax.jit(lambda lg, x: rtk.select_routing_operand_kernel(lg, x, 8, 128, 8, vecs,
                                                                renormalize=True, recipe="b12x"))
    text = f.trace(jax.ShapeDtypeStruct((8, 128), jnp.float32),
                   jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_moe_select_routing_operand" in text
    lg, x = jnp.zeros((2, 128), jnp.float32), jnp.zeros((2, 256), jnp.bfloat16)
    kw = {"renormalize": False, "recipe": "b12x", "interpret": True}
    with pytest.raises(ValueError, match="^hidden: expected"):
        rtk.select_routing_operand_kernel(lg, jnp.zeros((2, 320), jnp.bfloat16), 8, 128, 8, vecs, **kw)
    with pytest.raises(ValueError, match="^router_logits: expected"):
        rtk.select_routing_operand_kernel(lg[:1], x, 8, 128, 8, vecs, **kw)
    with pytest.raises(ValueError, match="^top_k: expected"):
        rtk.select_routing_operand_kernel(lg, x, 129, 128, 8, vecs, **kw)
    with pytest.raises(ValueError, match="^router_logits: 1408 routes"):  # nemotron T = 64
        rtk.select_routing_operand_kernel(
            jnp.zeros((64, 512), jnp.float32), jnp.zeros((64, 1024), jnp.bfloat16), 22, 512, 8,
            (jnp.ones(512),) * 4 + ("trtllm_cutlass", "scalar"), **kw)


@pytest.mark.parametrize("t,routing", [(1, "fused"), (5, "fused"), (5, "kernel")])
def test_moe_router_logits_take_the_one_launch(t, routing, monkeypatch):
    """moe(router_logits=...) on the Mosaic backend (its XLA emulation on the CPU) picks the
    experts in the routing launch where the routing is "fused" (else ``select_kernel`` runs
    first) and returns the two-launch path's output, bit for bit; a token with a NaN in its
    hidden row gets a NaN output row, the others stay finite."""
    rng = np.random.default_rng(t)
    e, k = 16, 4
    hidden, _, _, fc1, fc2, s1, s2 = to_jax(make_case(rng, t=t, h=256, inter=256, e=e, k=k,
                                                      activation="swiglu"))
    hidden = hidden.at[t - 1, 9].set(jnp.nan)
    lg = jnp.asarray(_logits(rng, t, e))
    calls = []
    real = rtk.select_routing_operand_kernel
    monkeypatch.setattr(mmo, "select_routing_operand_kernel",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kw = {"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2,
          "activation": "swiglu", "backend": "mosaic",
          "config": mmo.MosaicMoEConfig(block_m=8, routing=routing, skip_padding=True)}
    # jitted: a concrete non-finite hidden is refused outright (docs/input-policy.md)
    routed = jax.jit(lambda x, lg: moe(x, router_logits=lg, top_k=k, renormalize=True, **kw))
    given_ids = jax.jit(lambda x, ids, w: moe(x, topk_ids=ids, topk_weights=w, **kw))
    got = np.asarray(routed(hidden, lg), np.float32)
    assert bool(calls) == (routing == "fused")
    ids, w = select_kernel(lg, hidden, k, renormalize=True, interpret=True)
    want = np.asarray(given_ids(hidden, ids, w), np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isnan(got[t - 1]).all() and np.isfinite(got[:t - 1]).all()
