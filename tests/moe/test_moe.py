"""nvfp4_jax.moe (XLA path and Pallas-Triton kernels in interpret mode) vs oracle.moe; routing prep."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import check_against_oracle, make_case

import nvfp4_jax
from nvfp4_jax.moe import block_routing, select_experts
from nvfp4_jax.moe.api import moe
from nvfp4_jax.moe.configs import Config, MoEConfig
from nvfp4_jax.moe.pallas_triton import moe_pallas
from nvfp4_jax.moe.routing import max_blocks, sort_keys
from nvfp4_jax.moe.xla import moe_xla

SMALL = MoEConfig(Config(16, 32, 32, decode="bits"), Config(16, 32, 32, decode="bits"))


def to_jax(case):
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    return (jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(ids, jnp.int32), jnp.asarray(wts, jnp.float32),
            nvfp4_jax.from_oracle(fc1), nvfp4_jax.from_oracle(fc2),
            jnp.asarray(s1, jnp.float32), jnp.asarray(s2, jnp.float32))


def run_backend(backend, case, *, mode, activation, gate_up_order="up_gate", activation_scale=None,
                config=SMALL):
    if activation_scale is None:
        activation_scale = "scalar" if mode == "trtllm_cutlass" else "per_expert"
    kw = {"activation": activation, "gate_up_order": gate_up_order, "mode": mode,
              "activation_scale": activation_scale, "return_intermediates": True}
    if backend == "pallas":
        fn = functools.partial(moe_pallas, config=config, interpret=True, **kw)
    else:
        fn = functools.partial(moe_xla, **kw)
    out, inter = jax.jit(fn)(*to_jax(case))
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    return f(out), f(inter["h"])


CASES = [
    # (name, make_case kwargs)
    ("uneven_T_not_multiple", {"t": 21, "h": 64, "inter": 32, "e": 6, "k": 2, "routing": "skewed"}),
    ("T1", {"t": 1, "h": 64, "inter": 64, "e": 4, "k": 3}),
    ("one_expert", {"t": 37, "h": 32, "inter": 32, "e": 4, "k": 1, "routing": "one"}),
    ("subnormal_scales", {"t": 9, "h": 64, "inter": 32, "e": 3, "k": 2, "scale_factor": 2.0**15}),
]


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("mode", ["trtllm_cutlass", "b12x"])
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("name,kw", CASES[:1], ids=[c[0] for c in CASES[:1]])
def test_moe_matches_oracle(backend, mode, activation, name, kw):
    case = make_case(np.random.default_rng(hash((name, activation)) % 2**32), activation=activation, **kw)
    out, h = run_backend(backend, case, mode=mode, activation=activation)
    check_against_oracle(case, out, h, mode=mode, activation=activation)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("name,kw,mode,activation,order", [
    ("T1", CASES[1][1], "b12x", "swiglu", "up_gate"),
    ("one_expert", CASES[2][1], "trtllm_cutlass", "swiglu", "gate_up"),
    ("subnormal_scales", CASES[3][1], "b12x", "relu2", "up_gate"),
    ("subnormal_scales_trtllm", CASES[3][1], "trtllm_cutlass", "swiglu", "up_gate"),
])
def test_moe_edge_cases(backend, name, kw, mode, activation, order):
    case = make_case(np.random.default_rng(5), activation=activation, **kw)
    if name.startswith("subnormal"):
        scales = case[3].scales
        assert np.mean(scales < 0x08) > 0.5  # most block scales are E4M3 subnormals (or zero)
    out, h = run_backend(backend, case, mode=mode, activation=activation, gate_up_order=order)
    check_against_oracle(case, out, h, mode=mode, activation=activation, gate_up_order=order)


def test_moe_b12x_scalar_activation_scale_pallas():
    case = make_case(np.random.default_rng(3), t=6, h=64, inter=32, e=5, k=2, activation="relu2")
    out, h = run_backend("pallas", case, mode="b12x", activation="relu2", activation_scale="scalar")
    check_against_oracle(case, out, h, mode="b12x", activation="relu2", activation_scale="scalar")


def test_experts_without_tokens_cost_nothing():
    ids = jnp.array([[3, 1], [3, 1], [1, 3]], jnp.int32)
    br = block_routing(ids, 64, 16)
    assert int(br.num_blocks[0]) == 2
    assert br.block_expert.shape[0] == max_blocks(6, 64, 16) == 7


@pytest.mark.parametrize("method", ["sort", "dense"])
@pytest.mark.parametrize("t,k,e,bm", [(1, 1, 4, 16), (5, 2, 8, 16), (100, 4, 16, 16), (64, 8, 128, 32),
                                      (3, 3, 3, 16), (64, 22, 512, 8), (40, 8, 256, 16)])
def test_block_routing_invariants(t, k, e, bm, method):
    rng = np.random.default_rng(t * 131 + e)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    ids[: t // 2] = ids[0]  # skew
    br = jax.jit(functools.partial(block_routing, method=method), static_argnums=(1, 2))(
        jnp.asarray(ids), e, bm)
    sr, be = np.asarray(br.sorted_route), np.asarray(br.block_expert)
    nb, pos = int(br.num_blocks[0]), np.asarray(br.route_pos)
    n = t * k
    assert sr.shape[0] == bm * max_blocks(n, e, bm)
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=e)
    assert nb == sum(-(-c // bm) for c in counts)
    valid = sr < n
    assert sorted(sr[valid].tolist()) == list(range(n))  # every route exactly once
    np.testing.assert_array_equal(sr[pos], np.arange(n))  # route_pos inverts sorted_route
    for b in range(nb):
        rows = sr[b * bm:(b + 1) * bm]
        rows = rows[rows < n]
        assert len(rows) > 0 and np.all(flat[rows] == be[b])  # one expert per block
        assert np.all(np.diff(rows) > 0)  # stable: token order within an expert
    assert not valid[nb * bm:].any()


def test_block_routing_methods_agree():
    """The dense (sort-free) routing is the sort routing, array for array."""
    rng = np.random.default_rng(7)
    for t, k, e, bm in [(1, 8, 128, 8), (8, 22, 512, 8), (37, 4, 16, 16), (64, 8, 128, 64)]:
        ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k])
        a, b = (block_routing(ids, e, bm, method=m) for m in ("sort", "dense"))
        for f in ("sorted_route", "block_expert", "num_blocks", "route_pos"):
            np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), err_msg=f)
    with pytest.raises(ValueError, match="method"):
        block_routing(ids, e, bm, method="scan")


@pytest.mark.parametrize("e,key", [(8, "u8"), (256, "u8"), (257, "u16"), (512, "u16"),
                                   (70000, "s32")])
def test_sort_routing_sorts_narrow_keys(e, key):
    """The sort routing (and the XLA MoE's) sort the expert ids as the narrowest unsigned type
    that holds them: one CUB radix pass per key byte on the GPU, and 8-bit keys go to CUB at
    any length (the int32 keys took 4 passes)."""
    ids = jnp.asarray(np.random.default_rng(e).integers(0, e, (64, 4)), jnp.int32)
    hlo = jax.jit(functools.partial(block_routing, method="sort"), static_argnums=(1, 2)).lower(
        ids, e, 16).compiler_ir("hlo").as_hlo_text()
    sorts = [ln for ln in hlo.splitlines() if " sort(" in ln]
    assert len(sorts) == 1 and f"= ({key}[256]{{0}}, s32[256]{{0}}) sort(" in sorts[0], sorts
    np.testing.assert_array_equal(np.asarray(sort_keys(ids.reshape(-1), e)),
                                  np.asarray(ids).reshape(-1))  # same values


def test_select_experts():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((7, 16)), jnp.float32)
    ids, w = select_experts(logits, 4, routing="softmax", renormalize=True)
    np.testing.assert_allclose(np.asarray(w).sum(1), 1.0, rtol=1e-6)
    p = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-p, 1)[:, :4])
    bias = jnp.arange(16, dtype=jnp.float32) * 0.1
    ids, w = select_experts(logits, 4, routing="sigmoid_bias", correction_bias=bias,
                            renormalize=True, routed_scaling_factor=2.5)
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    want = np.argsort(-(s + np.asarray(bias)), 1)[:, :4]
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), np.sort(want, 1))
    ws = np.take_along_axis(s, np.asarray(ids), 1)
    np.testing.assert_allclose(np.asarray(w), 2.5 * ws / ws.sum(1, keepdims=True), rtol=1e-5)


def test_moe_router_logits_path_and_jit_any_t():
    case = make_case(np.random.default_rng(1), t=3, h=32, inter=32, e=4, k=2)
    hidden, _, _, fc1, fc2, s1, s2 = to_jax(case)
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4)), jnp.float32)
    f = jax.jit(lambda x, lg: moe(x, fc1=fc1, fc2=fc2, fc1_input_scale=s1, fc2_input_scale=s2,
                                  router_logits=lg, top_k=2, renormalize=True, backend="xla"))
    out = f(hidden, logits)
    ids, w = select_experts(logits, 2, renormalize=True)
    ref = jax.jit(moe, static_argnames=("backend",))(hidden, fc1=fc1, fc2=fc2, fc1_input_scale=s1, fc2_input_scale=s2, topk_ids=ids,
              topk_weights=w, backend="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_moe_errors_name_arguments():
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(make_case(np.random.default_rng(0), t=2, h=32, inter=32, e=2, k=1))
    base = {"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2, "topk_ids": ids, "topk_weights": w}
    with pytest.raises(TypeError, match="hidden"):
        moe(hidden.astype(jnp.float32), **base)
    with pytest.raises(ValueError, match="mode"):
        moe(hidden, mode="cutlass", **base)
    with pytest.raises(ValueError, match="backend"):
        moe(hidden, backend="cuda", **base)
    with pytest.raises(ValueError, match="activation"):
        moe(hidden, activation="gelu", **base)
    with pytest.raises(ValueError, match="fc2"):
        moe(hidden, activation="swiglu", **base)  # fc1 [2, 32, 32] -> I = 16, fc2 is [2, 32, 32]
    with pytest.raises(ValueError, match="fc1_input_scale"):
        moe(hidden, **{**base, "fc1_input_scale": s1.astype(jnp.bfloat16)})
    with pytest.raises(ValueError, match="topk_weights"):
        moe(hidden, **{**base, "topk_weights": w[:, :0]})
    with pytest.raises(ValueError, match="top_k"):
        moe(hidden, **{k: v for k, v in base.items() if k not in ("topk_ids", "topk_weights")},
            router_logits=jnp.zeros((2, 2)), top_k=5)
    with pytest.raises(ValueError, match="activation_scale"):
        moe(hidden, activation_scale="per_expert", **base)
    with pytest.raises(TypeError, match="fc1"):
        moe(hidden, **{**base, "fc1": "weights"})


@pytest.mark.parametrize("recipe", ["trtllm", "b12x"])
def test_in_kernel_requantization_is_the_recipe(recipe):
    """The FC1 epilogue's requantization (triton_ops.requantize, jnp ops as interpret mode
    runs them) equals oracle.quantize bit for bit, E2M1 ties and subnormal/zero scales included."""
    import oracle
    from nvfp4_jax.triton_ops import requantize
    from oracle.formats import bf16_round

    rng = np.random.default_rng(0)
    x = bf16_round(rng.standard_normal((64, 64)) * np.exp2(rng.integers(-12, 6, (64, 1))))
    x[0] = 0.0
    # values on E2M1 midpoints after scaling: multiples of 0.25 of a power of two
    x[1:9] = bf16_round(rng.integers(-24, 25, (8, 64)) * 0.25)
    for g in (np.float32(2688 / 3.0), np.float32(7.3), np.float32(1e4)):
        want = oracle.dequantize(oracle.quantize(x, recipe, encode_scale=float(g)), include_decode_scale=False)
        rg = jnp.float32(1.0) / jnp.float32(g)
        got = jax.jit(lambda h, g, rg: requantize(h.reshape(64, 4, 16), g, rg, recipe, False))(
            jnp.asarray(x, jnp.float32), jnp.float32(g), rg)
        np.testing.assert_array_equal(np.asarray(got, np.float64).reshape(64, 64), want)


@pytest.mark.parametrize("backend,mode,activation", [("pallas", "trtllm_cutlass", "swiglu"), ("xla", "b12x", "relu2")])
def test_moe_end_to_end_within_public_bound(backend, mode, activation):
    """End to end (no kernel intermediates): nvfp4_jax.testing.assert_moe_close's interval."""
    from nvfp4_jax.testing import assert_moe_close

    case = make_case(np.random.default_rng(21), t=13, h=64, inter=32, e=5, k=2, activation=activation)
    out, _ = run_backend(backend, case, mode=mode, activation=activation)
    assert_moe_close(out, *case, activation=activation, mode=mode, label=f"moe[{backend}]")


def test_moe_pallas_3d_code_loads():
    """The load2d=False variant (codes loaded as [BN, BK/16, 8]) computes the same thing."""
    cfg = MoEConfig(Config(16, 32, 32, decode="bits", load2d=False), Config(16, 32, 64, decode="bits", load2d=False))
    case = make_case(np.random.default_rng(4), t=7, h=64, inter=64, e=3, k=2, activation="relu2")
    out, h = run_backend("pallas", case, mode="trtllm_cutlass", activation="relu2", config=cfg)
    out2, h2 = run_backend("pallas", case, mode="trtllm_cutlass", activation="relu2")
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(h, h2)
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_moe_pallas_default_prefill_tiles(activation):
    """The default large-T tiles (BM 128 relu2 / 64 swiglu) on a many-rows-per-expert problem."""
    from nvfp4_jax.moe.configs import default_config

    case = make_case(np.random.default_rng(6), t=150, h=128, inter=64, e=2, k=2, activation=activation)
    cfg = default_config(300, 2, inter=64, hidden=128, gated=activation == "swiglu").with_decode("bits")
    assert cfg.fc1.block_m == (128 if activation == "relu2" else 64)
    out, h = run_backend("pallas", case, mode="trtllm_cutlass", activation=activation, config=cfg)
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation=activation)
