"""``nvfp4_jax.attention.decode_qkv_attention``: a decode step's attention from the fused q/k/v
projection (q/k RMSNorm, RoPE, the cache writes and the attention in two launches).

References: ``oracle.decode_qkv_attention_error_bound`` (float64: the new k row among the
bf16 values an fp32 kernel with the RMSNorm and RoPE rounding points may give, almost
everywhere the one correctly rounded value; the output within the decode attention bound
plus what the rare one-ulp freedom of q and k moves the softmax), and the decoders' XLA ops for
the same step (``nn.rms_norm``, ``models.apply_rope`` on ``models.rope_tables``,
``lax.dynamic_update_slice`` into the caches): every cache slot but the new k row bit for bit
(v's new row is a copy), and interpreted (CPU) the new k row too.

Faults the tests catch (each tried once by breaking the kernel): the rotate-half partner
column off by one head half (the written k leaves the reference), the start position not
clamped like ``dynamic_update_slice`` (a traced start past the cache writes another
sequence's slot), the new token's slot and those past it holding NaN (a kernel attending
one answers NaN; the kernel takes the new k and v from the projection, not from the slot it
writes: reading the slot back instead fails), every other layer of the stack holding other
data (a write or read of the wrong layer).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxpr_calls import pallas_calls

import oracle
from nvfp4_jax import attention, nn
from nvfp4_jax.device import pallas_interpret
from nvfp4_jax.gemm.operand import mosaic_w4a4_operand
from nvfp4_jax.models import decoder


def _case(seed, n_layers, b, s, kvh, g, d, scale, start):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((b, (kvh * g + 2 * kvh) * d)) * scale
    k = rng.standard_normal((n_layers, b, s, kvh, d))
    v = rng.standard_normal((n_layers, b, s, kvh, d)) * 10.0 ** rng.uniform(-3, 3)
    # never read: NaN shows a read past the new token, or of its slot (its k and v come from
    # the projection)
    k[:, :, start:] = np.nan
    v[:, :, start:] = np.nan
    norms = rng.uniform(0.25, 2.0, (2, d))
    return (jnp.asarray(qkv, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
            jnp.asarray(v, jnp.bfloat16), jnp.asarray(norms, jnp.bfloat16))


def _xla_step(qkv, k_cache, v_cache, layer, start, nh, norms, rope, eps=1e-6):
    """The decoders' XLA ops for the same step: (q bf16 [B, NH, D], k_cache, v_cache)."""
    b, (kvh, d) = qkv.shape[0], k_cache.shape[3:]
    q, k, v = jnp.split(qkv[:, None], [nh * d, (nh + kvh) * d], axis=-1)
    q, k, v = q.reshape(b, 1, nh, d), k.reshape(b, 1, kvh, d), v.reshape(b, 1, kvh, d)
    if norms is not None:
        q, k = nn.rms_norm(q, norms[0], eps), nn.rms_norm(k, norms[1], eps)
    if rope is not None:
        q, k = decoder.apply_rope(q, rope), decoder.apply_rope(k, rope)
    at = (jnp.int32(layer), 0, jnp.int32(start), 0, 0)
    return (q[:, 0], jax.lax.dynamic_update_slice(k_cache, k[None], at),
            jax.lax.dynamic_update_slice(v_cache, v[None], at))


def _rope(b, d, start, theta=1e4):
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    return decoder.rope_tables(jnp.full((b, 1), start, jnp.int32), jnp.asarray(inv, jnp.float32))


def _run(qkv, k, v, layer, start, nh, norms, rope, jit=False):
    f = functools.partial(
        attention.decode_qkv_attention, num_heads=nh,
        q_norm=None if norms is None else norms[0], k_norm=None if norms is None else norms[1],
        rope=None if rope is None else (rope[0][:, 0], rope[1][:, 0]),
        interpret=pallas_interpret())
    return (jax.jit(f) if jit else f)(qkv, k, v, layer, start)


def _same(a, b):
    return np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.gpu
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 3), s=st.integers(1, 200),
       kvh=st.sampled_from([1, 2, 4]), g=st.sampled_from([1, 4, 8, 16]),
       d=st.sampled_from([16, 64, 128]), scale=st.sampled_from([0.01, 1.0, 30.0]),
       qk_norm=st.booleans(), with_rope=st.booleans(), data=st.data())
def test_decode_qkv_attention_against_the_xla_step(seed, b, s, kvh, g, d, scale, qk_norm,
                                                   with_rope, data):
    n_layers = 3
    layer = data.draw(st.integers(0, n_layers - 1))
    start = data.draw(st.sampled_from(sorted({0, s - 1, min(s - 1, 63), min(s - 1, 64)})))
    qkv, k, v, norms = _case(seed, n_layers, b, s, kvh, g, d, scale, start)
    norms = norms if qk_norm else None
    rope = _rope(b, d, start) if with_rope else None
    o, kc, vc = _run(qkv, k, v, jnp.int32(layer), jnp.int32(start), kvh * g, norms, rope)
    _, k_ref, v_ref = _xla_step(qkv, k, v, layer, start, kvh * g, norms, rope)
    assert _same(vc, v_ref), "v cache differs from the XLA step's"
    rest = np.ones(k.shape, bool)
    rest[layer, :, start] = False
    assert _same(np.asarray(kc)[rest], np.asarray(k_ref)[rest]), "a k slot not the new row moved"
    if pallas_interpret():
        assert _same(kc, k_ref), "k cache differs from the XLA step's"
    f64 = functools.partial(np.asarray, dtype=np.float64)
    want = oracle.decode_qkv_attention_error_bound(
        f64(qkv), f64(k[layer]), f64(v[layer]), start, kvh * g,
        None if norms is None else f64(norms[0]), None if norms is None else f64(norms[1]),
        1e-6, *((None, None) if rope is None else (f64(t[:, 0]) for t in rope)))
    new = f64(kc[layer, :, start])
    assert ((want["k_lo"] <= new) & (new <= want["k_hi"])).all(), "new k row off the oracle"
    got = f64(o)
    assert np.isfinite(got).all(), "NaN/inf in the output: a read past the new token"
    excess = np.abs(got - want["out"]) - want["out_bound"]
    assert (excess <= 0).all(), f"max |err| - bound = {excess.max():.3g}"


@pytest.mark.gpu
def test_decode_qkv_attention_traced_start_past_the_cache_clamps_like_update_slice():
    """A traced start past the cache writes its last slot, as ``dynamic_update_slice`` (v: a
    copy, bit for bit anywhere; without norms and RoPE, k too)."""
    qkv, k, v, _ = _case(3, 2, 2, 8, 2, 4, 32, 1.0, 7)
    _, kc, vc = _run(qkv, k, v, jnp.int32(1), jnp.int32(12), 8, None, None, jit=True)
    _, k_ref, v_ref = _xla_step(qkv, k, v, 1, 12, 8, None, None)
    assert _same(kc, k_ref) and _same(vc, v_ref)


def test_norm_stacks_read_in_place_at_norm_layer():
    """q_norm, k_norm as [L', D] stacks with a traced ``norm_layer``: bit for bit the call
    with that row's [D] weights (caches and output), under jit; rows that differ catch
    reading another one, and a norm_layer past the stack clamps to its last row."""
    qkv, k, v, _ = _case(5, 2, 2, 40, 2, 4, 32, 1.0, 9)
    rng = np.random.default_rng(6)
    qs, ks = (jnp.asarray(rng.uniform(0.25, 2.0, (3, 32)), jnp.bfloat16) for _ in range(2))
    rope = _rope(2, 32, 9)
    cs = (rope[0][:, 0], rope[1][:, 0])
    step = jax.jit(functools.partial(attention.decode_qkv_attention, num_heads=8, rope=cs,
                                     interpret=pallas_interpret()))
    for row, want_row in ((1, 1), (7, 2)):
        got = step(qkv, k, v, jnp.int32(1), jnp.int32(9), q_norm=qs, k_norm=ks,
                   norm_layer=jnp.int32(row))
        want = step(qkv, k, v, jnp.int32(1), jnp.int32(9), q_norm=qs[want_row],
                    k_norm=ks[want_row])
        assert all(_same(a, b) for a, b in zip(got, want)), row
    other = step(qkv, k, v, jnp.int32(1), jnp.int32(9), q_norm=qs[0], k_norm=ks[0])
    assert not _same(got[1], other[1]) and not _same(got[0], other[0])
    with pytest.raises(ValueError, match=r"k_norm: expected the \[L', D=32\] stack"):
        attention.decode_qkv_attention(qkv, k, v, 0, 3, num_heads=8, q_norm=qs, k_norm=ks[:2],
                                       norm_layer=0)
    with pytest.raises(ValueError, match=r"q_norm: expected \[D=32\]"):
        attention.decode_qkv_attention(qkv, k, v, 0, 3, num_heads=8, q_norm=qs, k_norm=ks)


@pytest.mark.parametrize("seed, b, kvh, g, d, rows, layer", [
    (20, 1, 4, 8, 128, 8, 0),    # Qwen3-30B-A3B's heads, batch 1 in the 8-token tile
    (21, 3, 2, 4, 64, 16, 1),    # heads of 64: two heads share a 128-group of the permutation
    (22, 2, 1, 16, 32, 2, 2),    # no padding rows
    (23, 5, 8, 4, 128, 8, 5),    # Llama-3-8B's heads; a layer past the stack clamps
])
def test_w4a4_operand_is_the_operand_kernels(seed, b, kvh, g, d, rows, layer):
    """``w4a4_operand``: the combine's output is ``gemm.operand.mosaic_w4a4_operand`` of the
    attention output bit for bit (that kernel is the oracle's quantization, padded and
    permuted: tests/gemm/test_gemm_operand.py), the caches those of the plain call; input
    scales that put the block scales among E4M3 subnormals (layer 0), in the normal range and
    saturated, read at ``layer`` from the stack (clamped), and the scalar form."""
    s = 40
    qkv, k, v, norms = _case(seed, 3, b, s, kvh, g, d, 1.0, 30)
    rope = _rope(b, d, 30)
    kw = dict(num_heads=kvh * g, q_norm=norms[0], k_norm=norms[1],
              rope=(rope[0][:, 0], rope[1][:, 0]), interpret=pallas_interpret())
    o, kc, vc = attention.decode_qkv_attention(qkv, k, v, 1, 30, **kw)
    amax = float(jnp.max(jnp.abs(o.astype(jnp.float32))))
    # block scale sf = amax_block / (6 * input_scale): < 2^-6 (subnormal), ~1, > 448 (saturates)
    stack = jnp.asarray([amax * 40.0, amax / 6.0, amax / 6000.0], jnp.float32)
    xp, kc2, vc2 = attention.decode_qkv_attention(qkv, k, v, 1, 30, **kw,
                                                  w4a4_operand=(stack, jnp.int32(layer), rows))
    at = min(layer, 2)
    want = mosaic_w4a4_operand(o.reshape(b, -1), stack, rows, layer=jnp.int32(at),
                               interpret=pallas_interpret())
    assert xp.shape == (rows, kvh * g * d) and xp.dtype == jnp.bfloat16
    assert _same(xp, want), "the operand differs from the operand kernel's"
    assert _same(kc2, kc) and _same(vc2, vc)
    assert np.isfinite(np.asarray(xp, np.float32)).all()
    assert not np.asarray(xp[b:], np.float32).any(), "padding rows not zero"
    if at == 0:  # the case reaches E4M3 subnormal block scales
        blocks = np.abs(np.asarray(o, np.float32)).reshape(b, -1, 16).max(-1)
        assert (blocks / (6.0 * float(stack[0])) < 2.0**-6).any()
    one, _, _ = attention.decode_qkv_attention(qkv, k, v, 1, 30, **kw,
                                               w4a4_operand=(stack[at], None, rows))
    assert _same(one, xp), "the scalar input scale differs from its row of the stack"
    other = mosaic_w4a4_operand(o.reshape(b, -1), stack, rows, layer=jnp.int32((at + 1) % 3),
                                interpret=pallas_interpret())
    assert not _same(xp, other)


def test_w4a4_operand_rejects_bad_arguments():
    qkv, k, v, _ = _case(0, 2, 2, 8, 2, 4, 32, 1.0, 3)
    sc = jnp.ones((3,), jnp.float32)
    for bad, match in (((sc, None, 8), "w4a4_operand: input_scale: expected an fp32 scalar"),
                       ((sc[0], None, 1), "rows an int in 2..64"),
                       ((sc[0], None, 65), "rows an int in 2..64"),
                       ((sc[:, None], jnp.int32(0), 8),
                        r"w4a4_operand: input_scale: expected the fp32 \[L\] stack"),
                       ((sc, jnp.zeros((2,), jnp.int32), 8),
                        "w4a4_operand: layer: expected an int32 scalar"),
                       ((sc, None), "expected \\(input_scale, layer, rows\\)")):
        with pytest.raises(ValueError, match=match):
            attention.decode_qkv_attention(qkv, k, v, 0, 3, num_heads=8, w4a4_operand=bad)
    qkv1, k1, v1, _ = _case(0, 2, 1, 8, 1, 1, 32, 1.0, 3)  # NH * D = 32
    with pytest.raises(ValueError, match="NH \\* D % 128"):
        attention.decode_qkv_attention(qkv1, k1, v1, 0, 3, num_heads=1,
                                       w4a4_operand=(sc[0], None, 8))


def test_decode_qkv_attention_rejects_bad_arguments():
    qkv, k, v, norms = _case(0, 2, 1, 8, 2, 4, 32, 1.0, 3)
    with pytest.raises(ValueError, match="qkv: expected bf16"):
        attention.decode_qkv_attention(qkv[:, :-1], k, v, 0, 3, num_heads=8)
    with pytest.raises(ValueError, match="qkv: expected bf16"):
        attention.decode_qkv_attention(qkv.astype(jnp.float32), k, v, 0, 3, num_heads=8)
    with pytest.raises(ValueError, match="v_cache"):
        attention.decode_qkv_attention(qkv, k, v[:, :, :4], 0, 3, num_heads=8)
    with pytest.raises(ValueError, match="q_norm, k_norm"):
        attention.decode_qkv_attention(qkv, k, v, 0, 3, num_heads=8, q_norm=norms[0])
    with pytest.raises(ValueError, match="k_norm: expected"):
        attention.decode_qkv_attention(qkv, k, v, 0, 3, num_heads=8, q_norm=norms[0],
                                       k_norm=norms[1, :16])
    with pytest.raises(ValueError, match="rope cos"):
        attention.decode_qkv_attention(qkv, k, v, 0, 3, num_heads=8,
                                       rope=(jnp.zeros((1, 16)), jnp.zeros((1, 32))))
    with pytest.raises(ValueError, match="layer"):
        attention.decode_qkv_attention(qkv, k, v, 2, 3, num_heads=8)


def test_decode_step_runs_the_qkv_kernel_not_xla_cache_updates():
    """The decoders' one-token step on the kernel path: the q/k/v attention kernel and its
    combine, two launches a layer, no XLA update of the caches (the launches they replace)."""
    from nvfp4_jax import models

    cfg = models.DecoderConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=16, intermediate_size=64, qk_norm=True)
    key = jax.random.key(0)
    h, d = 64, 16

    def w(*shape):
        return jax.random.normal(key, shape, jnp.bfloat16) * 0.1

    layer = {"input_layernorm": jnp.ones((h,), jnp.bfloat16),
             "post_attention_layernorm": jnp.ones((h,), jnp.bfloat16),
             "self_attn": {"qkv_proj": w(8 * d, h), "o_proj": w(h, 4 * d),
                           "q_norm": jnp.ones((d,), jnp.bfloat16),
                           "k_norm": jnp.ones((d,), jnp.bfloat16)},
             "mlp": {"gate_up_proj": w(128, h), "down_proj": w(h, 64)}}
    model = models.Model.build(cfg, w(64, h), [layer] * 3, jnp.ones((h,), jnp.bfloat16),
                               w(64, h))
    cache = models.init_cache(cfg, 1, 8)
    step = functools.partial(models.decode_step, backend="pallas")
    jaxpr = jax.make_jaxpr(step)(model, jnp.zeros((1,), jnp.int32), cache)
    text = str(jaxpr)
    # one scan body: the chunks' kernel from the projection, then the combine
    assert re.findall(r"name=(nvfp4_decode\w*)", text) == ["nvfp4_decode_qkv_attention",
                                                           "nvfp4_decode_attention_combine"]
    assert "dynamic_update_slice" not in text

    (call,) = pallas_calls(jaxpr.jaxpr, "nvfp4_decode_qkv_attention")
    # the q and k norm weights: the scanned group's [3, D] stacks, read in place (a [2, D]
    # operand would be the two scanned slices packed, one copy a step)
    assert [tuple(v.aval.shape) for v in call.invars[1:3]] == [(3, d), (3, d)]


def test_decode_step_makes_o_projs_operand_in_the_attention_launch(monkeypatch):
    """Where o_proj is a W4A4 Mosaic GEMM (``nn.w4a4_operand_rows``; on the CPU said so by
    the test), the decoders' one-token step asks the attention's last launch for o_proj's
    operand, with the scanned group's input-scale stack read in place at the layer, and hands
    it to ``nn.linear_on_operand`` (a stub here: the GEMM runs on GPUs; the GPU decoder tests
    hold the logits)."""
    import pathlib
    import sys

    from nvfp4_jax import models
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
    import e2e_bench

    cfg = e2e_bench.config_of({**e2e_bench.TINY["qwen3-30b-a3b"], "num_layers": 3})
    model = e2e_bench.build_model(cfg, "nvfp4")
    seen = []

    def rows(p, m, **kw):
        return 8 if isinstance(p, nn.Linear) and p.input_scale is not None else None

    def gemm(p, xp, m, *, layer=None, input_scales=None):
        seen.append((xp.shape, input_scales.shape, layer is not None))
        return jnp.zeros((m, p.shape[0]), jnp.bfloat16)

    monkeypatch.setattr(nn, "w4a4_operand_rows", rows)
    monkeypatch.setattr(nn, "linear_on_operand", gemm)
    cache = models.init_cache(cfg, 1, 8)
    step = functools.partial(models.decode_step, backend="pallas")
    jaxpr = jax.make_jaxpr(step)(model, jnp.zeros((1,), jnp.int32), cache)
    (call,) = pallas_calls(jaxpr.jaxpr, "nvfp4_decode_attention_combine_operand")
    nhd = cfg.num_heads * cfg.head_dim
    assert tuple(call.outvars[0].aval.shape) == (8, nhd)
    assert tuple(call.invars[-1].aval.shape) == (3,)  # the [L] input-scale stack, in place
    assert seen == [((8, nhd), (3,), True)]
