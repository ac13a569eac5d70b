"""Scans over stacked MoE layers hand the kernels the whole expert stack (``nn.MoE.layer``,
``nn.split_experts`` / ``nn.join_experts``) instead of a per-layer slice, which XLA copies
whole into a Pallas-Triton kernel on every step. The stack form must compute exactly what the
layer alone computes: same experts (ids offset by ``layer * E``), same input scales (tiled,
so the per-layer max of the TensorRT-LLM CUTLASS arithmetic stays that layer's), bit for bit,
on the Pallas-Triton path (interpreted here) and the XLA path (which slices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
from nvfp4_jax import nn

N_LAYERS, E, H, I = 3, 4, 64, 32


def _layers(routing: str, activation: str) -> list[nn.MoE]:
    """Three MoE layers with different experts, routers and input scales (the scales differ
    by layer, so a max taken across layers would change the result)."""
    rng = np.random.default_rng(3)
    out = []
    for r in range(N_LAYERS):
        rows = 2 * I if activation == "swiglu" else I
        fc1 = nj.quantize_experts(jnp.asarray(rng.standard_normal((E, rows, H)) * 0.3,
                                              jnp.float32), "modelopt")
        fc2 = nj.quantize_experts(jnp.asarray(rng.standard_normal((E, H, I)) * 0.3,
                                              jnp.float32), "modelopt")
        s1 = jnp.asarray((1.0 + r + rng.random(E)) * 4 / 2688, jnp.float32)
        s2 = jnp.asarray((2.0 + r + rng.random(E)) * 8 / 2688, jnp.float32)
        bias = (jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32)
                if routing == "sigmoid_bias" else None)
        out.append(nn.MoE(jnp.asarray(rng.standard_normal((E, H)), jnp.bfloat16), fc1, fc2, s1,
                          s2, correction_bias=bias, top_k=2, routing=routing,
                          renormalize=True, activation=activation,
                          routed_scaling_factor=2.5 if routing == "sigmoid_bias" else 1.0))
    return out


@pytest.mark.parametrize("backend, t", [("pallas", 2), ("pallas", 5), ("xla", 2)])
@pytest.mark.parametrize("routing, activation", [("softmax", "swiglu"),
                                                 ("sigmoid_bias", "relu2")])
def test_moe_on_the_expert_stack_equals_the_layer_alone(backend, t, routing, activation):
    """t = 2: 4 routes <= E, the kernels run on the stack; t = 5: 10 routes > E, on the
    layer's slice (as on the XLA path)."""
    layers = _layers(routing, activation)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((t, H)) * 2, jnp.bfloat16)
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    xs, experts = nn.split_experts(stacked)
    assert len(experts) == 1 and xs.fc1 is None and xs.fc2 is None

    @jax.jit
    def scanned(x):
        def body(c, xs_r):
            p, r = xs_r
            return c, nn.moe_block(nn.join_experts(p, experts, r), x, backend=backend)
        return jax.lax.scan(body, 0, (xs, jnp.arange(N_LAYERS, dtype=jnp.int32)))[1]

    got = np.asarray(scanned(x), np.float32)
    alone = jax.jit(nn.moe_block, static_argnames="backend")
    for r, p in enumerate(layers):
        want = np.asarray(alone(p, x, backend=backend), np.float32)
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        np.testing.assert_array_equal(got[r], want, err_msg=f"layer {r}")
    # the layers differ, so equal outputs cannot come from one layer's experts serving all
    assert not np.array_equal(got[0], got[1]) and not np.array_equal(got[1], got[2])


def test_join_experts_hands_back_the_stacks_in_order():
    layers = _layers("softmax", "swiglu")
    tree = {"a": {"moe": jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)},
            "b": {"moe": jax.tree_util.tree_map(lambda *a: jnp.stack(a[::-1]), *layers)}}
    xs, experts = nn.split_experts(tree)
    back = nn.join_experts(xs, experts, jnp.int32(1))
    for key in "ab":
        m = back[key]["moe"]
        assert m.fc1 is tree[key]["moe"].fc1 and m.fc2 is tree[key]["moe"].fc2
        assert int(m.layer) == 1 and m.router is xs[key]["moe"].router
