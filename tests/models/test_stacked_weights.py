"""Scans over stacked layers also hand the kernels the whole weight stacks
(``nn.weight_stacks`` / ``nn.join_stacks``, ``matmul(..., stack=, layer=)``,
``moe(..., stacks=, layer=)``): the Pallas-Triton kernels read the layer in place, since XLA
copies a per-layer slice whole into such a kernel on every step. The stack form must compute
exactly what the layer alone computes, bit for bit: the GEMM kernels
reading rows ``layer * N ..`` of the flattened stack (bf16-MMA and FP4-MMA kernels, split-K,
both code loads), the MoE kernels the weights of expert ``layer * E + e`` while routing,
scales and alphas stay the layer's; on the Pallas-Triton path (interpreted here) and the XLA
path (which slices)."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
from nvfp4_jax import nn
from nvfp4_jax.gemm.pallas_triton import Config

N_LAYERS, E, H, I = 3, 4, 64, 32


def _layers(routing: str, activation: str, H=H, I=I) -> list[nn.MoE]:  # noqa: N803
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
    """t = 2 and 5: fewer and more routes than experts (4 and 10 against E = 4)."""
    layers = _layers(routing, activation)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((t, H)) * 2, jnp.bfloat16)
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    experts = nn.weight_stacks(stacked)
    assert len(experts) == 1 and experts[0][0] is stacked.fc1 and experts[0][1] is stacked.fc2

    @jax.jit
    def scanned(x):
        def body(c, xs_r):
            p, r = xs_r
            return c, nn.moe_block(nn.join_stacks(p, experts, r), x, backend=backend)
        return jax.lax.scan(body, 0, (stacked, jnp.arange(N_LAYERS, dtype=jnp.int32)))[1]

    got = np.asarray(scanned(x), np.float32)
    alone = jax.jit(nn.moe_block, static_argnames="backend")
    for r, p in enumerate(layers):
        want = np.asarray(alone(p, x, backend=backend), np.float32)
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        np.testing.assert_array_equal(got[r], want, err_msg=f"layer {r}")
    # the layers differ, so equal outputs cannot come from one layer's experts serving all
    assert not np.array_equal(got[0], got[1]) and not np.array_equal(got[1], got[2])


def test_join_stacks_hands_back_the_stacks_in_order():
    layers = _layers("softmax", "swiglu")
    tree = {"a": {"moe": jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)},
            "b": {"moe": jax.tree_util.tree_map(lambda *a: jnp.stack(a[::-1]), *layers)}}
    stacks = nn.weight_stacks(tree)
    back = nn.join_stacks(tree, stacks, jnp.int32(1))
    for key in "ab":
        m = back[key]["moe"]
        assert m.stacks[0] is tree[key]["moe"].fc1 and m.stacks[1] is tree[key]["moe"].fc2
        assert int(m.layer) == 1 and m.fc1 is tree[key]["moe"].fc1


def test_the_pallas_kernels_read_the_stack_and_the_others_the_slice():
    """Probe with an inconsistent pair (w is layer 0, ``layer`` says 1): the Pallas-Triton
    GEMM and MoE compute layer 1 (they read the stack), XLA layer 0 (it reads the slice).
    The GEMM's layers share one decode scale (alpha comes from w)."""
    ws, stack = _linear_stack(same_amax=True)
    assert len({float(w.decode_scale) for w in ws}) == 1
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 96)), jnp.bfloat16)
    for backend, want in (("pallas", 1), ("xla", 0)):
        got = nj.matmul(x, ws[0], stack=stack, layer=jnp.int32(1), backend=backend)
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(nj.matmul(x, ws[want], backend=backend),
                                                 np.float32), err_msg=backend)
    layers = _layers("softmax", "swiglu")
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    xm = jnp.asarray(np.random.default_rng(9).standard_normal((2, H)), jnp.bfloat16)
    for backend, want in (("pallas", 1), ("xla", 0)):
        probe = dataclasses.replace(layers[0], stacks=(stacked.fc1, stacked.fc2),
                                    layer=jnp.int32(1))
        got = nn.moe_block(probe, xm, backend=backend)
        ref = nn.moe_block(dataclasses.replace(layers[want], router=layers[0].router,
                                               fc1_input_scale=layers[0].fc1_input_scale,
                                               fc2_input_scale=layers[0].fc2_input_scale),
                           xm, backend=backend)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                                      err_msg=backend)


def _linear_stack(n_layers=3, n=48, k=96, same_amax=False):
    rng = np.random.default_rng(5)
    raw = [rng.standard_normal((n, k)) * (0.1 + r) for r in range(n_layers)]
    if same_amax:
        raw = [a * (3.0 / np.abs(a).max()) for a in raw]
    ws = [nj.quantize(jnp.asarray(a, jnp.float32), "modelopt") for a in raw]
    return ws, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ws)


@pytest.mark.parametrize("backend, mma, config", [
    ("pallas", "bf16", None),
    ("pallas", "bf16", Config(16, 32, 32, split_k=2, decode="bits", load2d=True)),
    ("pallas", "bf16", Config(16, 16, 32, decode="bits", load2d=False)),
    ("pallas", "fp4", None),
    ("xla", None, None)])
@pytest.mark.parametrize("w4a4", [False, True])
def test_matmul_on_a_stack_equals_the_layer_alone(backend, mma, config, w4a4):
    ws, stack = _linear_stack()
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, 96)) * 3, jnp.bfloat16)
    if mma == "fp4" and not w4a4:
        pytest.skip("the FP4 MMA multiplies W4A4 only")
    s_in = jnp.float32(4.0 / 2688) if w4a4 else None
    f = jax.jit(lambda x, w, stack, layer: nj.matmul(
        x, w, input_scale=s_in, backend=backend, mma=mma, config=config, stack=stack,
        layer=layer))
    outs = []
    for r, w in enumerate(ws):
        got = np.asarray(f(x, w, stack, jnp.int32(r)), np.float32)
        want = np.asarray(f(x, w, None, None), np.float32)
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want, err_msg=f"layer {r}")
        outs.append(got)
    assert not np.array_equal(outs[0], outs[1])


def test_linear_in_a_scan_reads_its_layer_of_the_stack():
    ws, stack = _linear_stack()
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 96)), jnp.bfloat16)
    s = jnp.asarray([1.0, 2.0, 3.0], jnp.float32) / 2688
    tree = {"proj": nn.Linear(stack, s)}
    stacks = nn.weight_stacks(tree)
    assert len(stacks) == 1 and stacks[0] is stack

    @jax.jit
    def scanned(x):
        def body(c, xs_r):
            p, r = xs_r
            p = nn.join_stacks(p, stacks, r)
            return c, nn.linear(p["proj"], x, backend="pallas")
        return jax.lax.scan(body, 0, (tree, jnp.arange(3, dtype=jnp.int32)))[1]

    got = np.asarray(scanned(x), np.float32)
    for r, w in enumerate(ws):
        want = np.asarray(nn.linear(nn.Linear(w, s[r]), x, backend="pallas"), np.float32)
        np.testing.assert_array_equal(got[r], want, err_msg=f"layer {r}")


@pytest.mark.parametrize("bad, what", [
    (dict(layer=jnp.int32(0)), "stack, layer: pass both"),
    (dict(stack="ws0", layer=jnp.int32(0)), "stack: expected an NVFP4Array [L, 48, 96]"),
    (dict(stack="stack", layer=jnp.zeros((2,), jnp.int32)), "layer: expected an integer scalar"),
    (dict(stack="stack", layer=jnp.float32(1)), "layer: expected an integer scalar")])
def test_matmul_stack_rejects_what_is_not_a_stack_and_an_index(bad, what):
    ws, stack = _linear_stack()
    kw = {k: {"ws0": ws[0], "stack": stack}.get(v, v) if isinstance(v, str) else v
          for k, v in bad.items()}
    with pytest.raises(ValueError, match=re.escape(what)):
        nj.matmul(jnp.ones((1, 96), jnp.bfloat16), ws[0], backend="xla", **kw)


@pytest.mark.parametrize("bad, what", [
    (lambda st, one: dict(layer=jnp.int32(0)), "stacks, layer: pass both"),
    (lambda st, one: dict(stacks=(one.fc1, one.fc2), layer=jnp.int32(0)),
     "stacks: expected the fc1 stack, an NVFP4Array [L, 4, 64, 64]"),
    (lambda st, one: dict(stacks=(st.fc1,), layer=jnp.int32(0)),
     "stacks: expected (fc1 stack, fc2 stack)"),
    (lambda st, one: dict(stacks=(st.fc1, st.fc2), layer=jnp.zeros((1,), jnp.int32)),
     "layer: expected an integer scalar")])
def test_moe_stacks_reject_what_is_not_a_stack_and_an_index(bad, what):
    layers = _layers("softmax", "swiglu")
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    one = layers[0]
    with pytest.raises(ValueError, match=re.escape(what)):
        nj.moe(jnp.ones((2, H), jnp.bfloat16), fc1=one.fc1, fc2=one.fc2,
               fc1_input_scale=one.fc1_input_scale, fc2_input_scale=one.fc2_input_scale,
               topk_ids=jnp.zeros((2, 2), jnp.int32), topk_weights=jnp.ones((2, 2), jnp.float32),
               activation="swiglu", gate_up_order="up_gate", backend="xla",
               **bad(stacked, one))


@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
def test_the_scale_launch_reads_the_scale_stacks(backend):
    """Probe with an inconsistent layer (the slices are layer 0's, ``layer`` says 1, the
    stacks carry the input scales too): the launch computing the scales reads all four scale
    vectors at row 1 of the stacks on both kernel paths. The Pallas-Triton MoE reads the
    experts there too (all of layer 1 but the router); the Mosaic one keeps layer 0's experts
    (its kernels take the slices) with layer 1's scales. Mosaic: its XLA emulation off the GPU,
    the scale launch interpreted."""
    h, i = (H, I) if backend == "pallas" else (256, 256)  # the Mosaic MoE takes H % 256 == 0
    layers = _layers("softmax", "swiglu", H=h, I=i)
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    xm = jnp.asarray(np.random.default_rng(9).standard_normal((2, h)), jnp.bfloat16)
    probe = dataclasses.replace(layers[0], stacks=nn.moe_stacks(stacked), layer=jnp.int32(1))
    got = nn.moe_block(probe, xm, backend=backend)
    one = layers[1]
    if backend == "mosaic":
        zero = layers[0]
        one = dataclasses.replace(
            zero, fc1=dataclasses.replace(zero.fc1, decode_scale=one.fc1.decode_scale),
            fc2=dataclasses.replace(zero.fc2, decode_scale=one.fc2.decode_scale),
            fc1_input_scale=one.fc1_input_scale, fc2_input_scale=one.fc2_input_scale)
    want = nn.moe_block(dataclasses.replace(one, router=layers[0].router), xm, backend=backend)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # every scale differs between layers 0 and 1, so layer 0's scales give another output
    fc1, fc2, s1, s2 = nn.moe_stacks(stacked)
    for st in (fc1.decode_scale, fc2.decode_scale, s1, s2):
        assert not np.any(np.asarray(st[0]) == np.asarray(st[1]))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "llama-3-8b"])
def test_decoder_scan_on_the_stacks_equals_the_scan_on_slices(name, monkeypatch):
    """``backend="pallas"`` (``nn.stacks_read_in_place``): the decoder's scan closes over the
    weight stacks; with the stacks left in the scanned tree (the layout the Mosaic path keeps)
    the same model gives the same logits and caches bit for bit (tiny shapes, 3 layers,
    interpreted kernels)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
    import e2e_bench

    from nvfp4_jax import models

    cfg = e2e_bench.config_of({**e2e_bench.TINY[name], "num_layers": 3})
    model = e2e_bench.build_model(cfg, "nvfp4")
    ids = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    outs = []
    # (linears, MoE) read in place: all (Pallas-Triton), none (the Mosaic path's layout), and
    # the SM 12.x mix (Mosaic linears on scanned slices, the Triton MoE on the stacks)
    for in_place in ((True, True), (False, False), (False, True)):
        monkeypatch.setattr(nn, "stacks_read_in_place",
                            lambda backend, kind, v=in_place: v[kind == "moe"])
        jax.clear_caches()
        cache = models.init_cache(cfg, 1, 8)
        logits, cache = models.prefill(model, ids, cache, backend="pallas", all_logits=True)
        step, cache = models.decode_step(model, ids[:, 0], cache, backend="pallas")
        outs.append([np.asarray(a, np.float32) for a in (logits, step, cache.k, cache.v)])
    for a, *others in zip(*outs):
        assert np.isfinite(a).all()
        for b in others:
            np.testing.assert_array_equal(a, b)


def test_which_stacks_are_read_in_place(monkeypatch):
    """``nn.stacks_read_in_place`` by device and kind: Pallas-Triton kernels read the stacks in
    place; sm_90 and SM 12.x with ``plgpu.mma`` (decode on the Mosaic kernels) keep scanned
    slices for both; without it, both in place."""
    assert nn.stacks_read_in_place("pallas", "linear") and nn.stacks_read_in_place("pallas", "moe")
    assert not nn.stacks_read_in_place("xla", "moe")
    assert not nn.stacks_read_in_place("auto", "linear")  # the CPU: XLA's dots
    from nvfp4_jax.gemm import mosaic

    monkeypatch.setattr(nn, "on_gpu", lambda: True)
    for cc, mma, want in ((90, True, (False, False)), (120, True, (False, False)),
                          (120, False, (True, True)), (89, False, (True, True))):
        monkeypatch.setattr(nn, "is_sm90", lambda v=cc == 90: v)
        monkeypatch.setattr(nn, "gpu_compute_capability", lambda v=cc: v)
        monkeypatch.setattr(mosaic, "has_mma_sync", lambda v=mma: v)
        assert (nn.stacks_read_in_place("auto", "linear"), nn.stacks_read_in_place("auto", "moe")) == want
    with pytest.raises(ValueError, match="^kind"):
        nn.stacks_read_in_place("auto", "dense")


def test_norm_linear_off_the_mosaic_path_is_the_composition_at_the_layer():
    """``nn.norm_linear`` with stacks (here, off the Mosaic decode path: the composition)
    computes ``linear(p, rms_norm(x, norm_stack[layer]))`` bit for bit, under jit with a
    traced layer; norm weights that differ by layer catch reading another one."""
    rng = np.random.default_rng(9)
    k, n = 256, 64
    w = nj.quantize(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), "modelopt")
    norms = jnp.asarray(rng.uniform(0.5, 2.0, (N_LAYERS, k)), jnp.bfloat16)
    scales = jnp.asarray([0.01, 0.002, 0.03], jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 1, k)), jnp.bfloat16)
    p = nn.Linear(w, scales[1])
    got = jax.jit(lambda x, i: nn.norm_linear(p, x, norms, 1e-6, layer=i, input_scales=scales))(
        x, jnp.int32(1))
    want = nn.linear(p, nn.rms_norm(x, norms[1], 1e-6))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(want, np.float32),
                              np.asarray(nn.linear(p, nn.rms_norm(x, norms[0], 1e-6)), np.float32))
    np.testing.assert_array_equal(np.asarray(nn.norm_linear(p, x), np.float32),
                                  np.asarray(nn.linear(p, x), np.float32))
    with pytest.raises(ValueError, match=r"norm_weight: expected the bf16 \[L, K\] stack"):
        nn.norm_linear(p, x, norms[0], layer=jnp.int32(0), input_scales=scales)


def test_decoder_hands_the_moe_its_scale_stacks_on_the_mosaic_path():
    """The Mosaic path keeps the MoE's weights as the layer loop's slices, yet its scale launch
    reads the four scale vectors from the group's stacks at the layer: the launch's operands
    are the layer and four fp32 [L * E] stacks, not [E] slices (a copy each, or a packing
    fusion, every layer)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
    import e2e_bench
    from jaxpr_calls import pallas_calls

    from nvfp4_jax import models

    # the Mosaic MoE takes H % 256 == 0
    cfg = e2e_bench.config_of({**e2e_bench.TINY["qwen3-30b-a3b"], "num_layers": 3,
                               "hidden_size": 256, "moe_intermediate_size": 128})
    model = e2e_bench.build_model(cfg, "nvfp4")
    cache = models.init_cache(cfg, 1, 8)
    jaxpr = jax.make_jaxpr(lambda m, t, c: models.decode_step(m, t, c, backend="mosaic"))(
        model, jnp.zeros((1,), jnp.int32), cache)
    calls = [c for name in ("nvfp4_moe_routing_operand", "nvfp4_moe_routing_scales",
                            "nvfp4_moe_scales") for c in pallas_calls(jaxpr.jaxpr, name)]
    assert len(calls) == 1  # one launch in the loop body computes the scales
    le = 3 * cfg.num_experts
    ops = [(tuple(v.aval.shape), str(v.aval.dtype)) for v in calls[0].invars]
    assert ((1,), "int32") in ops and ops.count(((le,), "float32")) == 4, ops
    assert ((cfg.num_experts,), "float32") not in ops and ((4 * cfg.num_experts,), "float32") not in ops
