"""``nvfp4_jax.nn.norm_router`` and its kernel ``nvfp4_jax.moe.norm_router``: a MoE layer's
input RMSNorm and router logits in one launch; ``nn.add_norm_router``: the same of the residual
stream ``x + a``, the add in that launch.

References: ``oracle.norm_rope_interval`` (the bf16 values an fp32 RMSNorm with the decoders'
rounding points may give: almost everywhere the one correctly rounded value) for h, and
``oracle.router_logits_interval`` (the bf16 rounding of an fp32 sum of the exact products in
any order) for the logits, taken of the kernel's own h; the XLA composition
(``nn.rms_norm`` then ``nn.router_logits``) lies in the same intervals. Random data at several
magnitudes: x from 2^-20 (its mean square near eps) to 300, routers from 2^-12 to 4.

Faults the tests catch (each tried once by breaking the kernel): the sum of squares divided
by E instead of H (h leaves its interval; the decoder's logits change), the logits left
unrounded to bf16 (they leave theirs), the stacks read at row 0 instead of ``layer`` (the
in-place and the decoder tests); with the add, its sum left unrounded to bf16 (the sum and h
differ from XLA's add bit for bit) and x stored instead of the sum (the sum test). Interpreted, a store past the logits' row is dropped, so the
expert block's mask is left to the GPU test (E = 60 in blocks of 8 experts: a store past a
token's row lands in the next token's logits).
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxpr_calls import pallas_calls

import oracle
from nvfp4_jax import nn
from nvfp4_jax.device import pallas_interpret
from nvfp4_jax.moe import norm_router as nr

EPS = 1e-6


def _case(seed: int, t: int, hd: int, e: int, x_scale: float, r_scale: float, layers: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, hd)) * x_scale, jnp.bfloat16)
    wshape, rshape = ((layers, hd), (layers, e, hd)) if layers else ((hd,), (e, hd))
    w = jnp.asarray(rng.uniform(0.25, 2.0, wshape), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal(rshape) * r_scale, jnp.bfloat16)
    return x, w, r


def _f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _check_against_oracle(x, w, r, h, logits) -> float:
    """h and logits within their oracle intervals; returns the share of logits whose interval
    holds one value (the test's power: an interval of many ulps would pass anything)."""
    h64, lg = _f64(h), np.asarray(logits, np.float64)
    assert h.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    assert np.isfinite(h64).all() and np.isfinite(lg).all()
    lo, hi = oracle.norm_rope_interval(_f64(x), _f64(w), EPS, None, None)
    assert ((lo <= h64) & (h64 <= hi)).all(), np.abs(h64 - np.clip(h64, lo, hi)).max()
    llo, lhi = oracle.router_logits_interval(h64, _f64(r))
    assert (oracle.bf16_round(lg) == lg).all()  # bf16 values
    bad = ~((llo <= lg) & (lg <= lhi))
    assert not bad.any(), (lg[bad][:4], llo[bad][:4], lhi[bad][:4])
    return float(np.mean(llo == lhi))


def test_router_logits_interval_holds_fp32_sums_in_several_orders():
    """The oracle's interval against numpy fp32 sums (sequential, reversed, pairwise) of the
    exact products, rounded to bf16 by ml_dtypes; one value for most logits."""
    x, _, r = _case(0, 4, 512, 16, 1.0, 1.0)
    h, rr = _f64(x), _f64(r)
    lo, hi = oracle.router_logits_interval(h, rr)
    prod = (h[:, None, :] * rr[None, :, :]).astype(np.float32)  # exact: bf16 products
    sums = [np.cumsum(prod, axis=-1, dtype=np.float32)[..., -1],
            np.cumsum(prod[..., ::-1], axis=-1, dtype=np.float32)[..., -1],
            prod.sum(axis=-1, dtype=np.float32)]
    for s in sums:
        v = s.astype(ml_dtypes.bfloat16).astype(np.float64)
        assert ((lo <= v) & (v <= hi)).all()
    # random signs: the worst-case bound (gamma_H sum |h r|) is ~ 1/3 of an ulp of the logit
    assert np.mean(lo == hi) > 0.5
    with pytest.raises(ValueError, match="h, router"):
        oracle.router_logits_interval(h, rr[:, :-1])


@pytest.mark.parametrize("seed, t, hd, e, x_scale, r_scale", [
    (1, 1, 128, 8, 1.0, 1.0),          # one program a token
    (2, 5, 256, 128, 300.0, 0.02),     # Qwen3's 128 experts, large x
    (3, 64, 32, 10, 2.0**-20, 4.0),    # 4 experts a program, the last block masked; x^2 ~ eps
    (4, 8, 64, 60, 3e-3, 2.0**-12),    # small routers
])
def test_kernel_within_the_oracle_intervals(seed, t, hd, e, x_scale, r_scale):
    x, w, r = _case(seed, t, hd, e, x_scale, r_scale)
    h, logits = nr.norm_router_kernel(x, w, r, EPS, interpret=pallas_interpret())
    assert h.shape == (t, hd) and logits.shape == (t, e)
    assert _check_against_oracle(x, w, r, h, logits) > 0.5
    # the XLA composition the kernel replaces: in the same intervals
    h2, lg2 = nn.norm_router(x, w, r, EPS, backend="xla")
    _check_against_oracle(x, w, r, h2, lg2)


def test_stacks_read_in_place_at_layer():
    """[L, H] and [L, E, H] stacks with a traced ``layer``: bit for bit the call on that row's
    weights, under jit (rows that differ catch reading another)."""
    x, w, r = _case(5, 3, 64, 12, 1.0, 1.0, layers=3)
    run = jax.jit(functools.partial(nn.norm_router, eps=EPS, backend="pallas"))
    got = run(x, w, r, layer=jnp.int32(1))
    want = run(x, w[1], r[1])
    other = run(x, w[0], r[0])
    for a, b, c in zip(got, want, other):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert not np.array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
    _check_against_oracle(x, w[1], r[1], *got)


def _residual(x, seed: int, kind: str):
    """a for ``x + a``: random at x's scale, near -x (cancellation: the sum's exponent far
    below x's), or odd multiples of half x's bf16 ulp (sums at and near rounding ties)."""
    rng = np.random.default_rng(seed)
    xf = np.asarray(x, np.float32)
    a = {"random": rng.standard_normal(xf.shape) * np.abs(xf).mean(),
         "cancel": -xf * (1 + rng.uniform(-2.0**-6, 2.0**-6, xf.shape)),
         "half": np.exp2(np.floor(np.log2(np.abs(xf))) - 8) * rng.choice([-3, -1, 1, 3], xf.shape)
         * rng.choice([1, 1 + 2.0**-6], xf.shape),
         }[kind]
    return jnp.asarray(a, jnp.bfloat16)


@pytest.mark.parametrize("seed, t, hd, e, x_scale, kind", [
    (11, 1, 128, 8, 1.0, "random"),
    (12, 5, 256, 128, 300.0, "cancel"),     # Qwen3's 128 experts
    (13, 64, 32, 10, 2.0**-20, "random"),   # 4 experts a program; x^2 ~ eps
    (14, 8, 64, 60, 3e-3, "half"),
])
def test_add_kernel_is_xlas_add_then_the_norm_router(seed, t, hd, e, x_scale, kind):
    """``add_norm_router`` on the kernel: s is XLA's bf16 add bit for bit (every row, from
    every expert block's program of the first block), h and the logits within the oracle's
    intervals of s, and the same bits as ``norm_router`` on XLA's sum."""
    x, w, r = _case(seed, t, hd, e, x_scale, 0.05)
    a = _residual(x, seed, kind)
    s, h, logits = nn.add_norm_router(x, a, w, r, EPS, backend="pallas")
    want = jax.jit(jnp.add)(x, a)
    assert s.dtype == jnp.bfloat16 and s.shape == x.shape
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(want, np.float32))
    if kind != "random":  # the case reaches what it is for: sums x alone would not give
        assert not np.array_equal(np.asarray(want, np.float32), np.asarray(x, np.float32))
    assert _check_against_oracle(want, w, r, h, logits) > 0.5
    h2, lg2 = nn.norm_router(want, w, r, EPS, backend="pallas")
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h2, np.float32))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(lg2))


def test_add_norm_router_off_the_kernel_and_on_stacks():
    """XLA (``backend="xla"``): ``x + a`` then ``norm_router`` bit for bit; on the kernel
    with [L, H] / [L, E, H] stacks and a traced layer: the call on that row's weights; bad
    ``a`` raises naming it."""
    x, w, r = _case(15, 3, 64, 12, 1.0, 1.0, layers=3)
    a = _residual(x, 15, "random")
    s, h, lg = nn.add_norm_router(x, a, w, r, EPS, layer=jnp.int32(2), backend="xla")
    h2, lg2 = nn.norm_router(x + a, w, r, EPS, layer=jnp.int32(2), backend="xla")
    for u, v in ((s, x + a), (h, h2), (lg, lg2)):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    run = jax.jit(functools.partial(nn.add_norm_router, eps=EPS, backend="pallas"))
    got = run(x, a, w, r, layer=jnp.int32(1))
    want = run(x, a, w[1], r[1])
    for u, v in zip(got, want):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
    with pytest.raises(ValueError, match=r"a: expected bfloat16 \[3, 64\]"):
        nn.add_norm_router(x, a[:2], w, r, layer=1)
    with pytest.raises(ValueError, match="residual: expected bf16"):
        nr.norm_router_kernel(x, w[0], r[0], EPS, residual=a.astype(jnp.float32),
                              interpret=pallas_interpret())


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_leading_axes(backend):
    """x [B, T, H]: h [B, T, H] and logits [B, T, E]; on the kernel the [B * T, H] call's bits,
    in XLA the norm on x's own shape (what a decoder layer not on this path computes)."""
    x, w, r = _case(8, 6, 64, 8, 1.0, 1.0)
    x3 = x.reshape(2, 3, 64)
    h, lg = nn.norm_router(x3, w, r, EPS, backend=backend)
    assert h.shape == (2, 3, 64) and lg.shape == (2, 3, 8)
    if backend == "pallas":
        h2, lg2 = nn.norm_router(x, w, r, EPS, backend=backend)
    else:
        h2 = nn.rms_norm(x3, w, EPS)
        lg2 = nn.router_logits(nn.MoEBF16(r, None, None, 2), h2.reshape(6, 64))
    np.testing.assert_array_equal(np.asarray(h, np.float32).reshape(6, 64),
                                  np.asarray(h2, np.float32).reshape(6, 64))
    np.testing.assert_array_equal(np.asarray(lg).reshape(6, 8), np.asarray(lg2).reshape(6, 8))


@pytest.mark.parametrize("why", ["fp32 router", "65 tokens", "hidden 96", "xla"])
def test_off_the_kernel_the_composition(why, monkeypatch, caplog):
    """Where the kernel does not take the layer (``norm_router_fits``) or the backend is XLA,
    ``nn.norm_router`` is ``nn.rms_norm`` then ``nn.router_logits`` bit for bit, the stacks
    sliced at ``layer``; the kernel is not called, and the log says why."""
    t, hd = (65 if why == "65 tokens" else 4), (96 if why == "hidden 96" else 64)
    x, w, r = _case(6, t, hd, 8, 1.0, 1.0, layers=2)
    if why == "fp32 router":
        r = r.astype(jnp.float32)

    def boom(*a, **k):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(nn, "norm_router_kernel", boom)
    with caplog.at_level("INFO", logger="nvfp4_jax.nn"):
        h, lg = nn.norm_router(x, w, r, EPS, layer=jnp.int32(1),
                               backend="xla" if why == "xla" else "pallas")
    said = {"fp32 router": "float32 router", "65 tokens": "65 tokens",
            "hidden 96": "hidden size 96"}
    if why in said:  # a kernel backend asked for: the log says why XLA runs instead
        assert said[why] in caplog.text, caplog.text
    else:
        assert "norm_router" not in caplog.text
    h_ref = nn.rms_norm(x, w[1], EPS)
    moe = nn.MoEBF16(r[1], None, None, 2)
    lg_ref = nn.router_logits(moe, h_ref)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(lg), np.asarray(lg_ref))


def test_rejects_bad_arguments():
    x, w, r = _case(7, 2, 64, 8, 1.0, 1.0)
    with pytest.raises(ValueError, match="backend"):
        nn.norm_router(x, w, r, backend="cuda")
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., H\]"):
        nn.norm_router(x[0, 0], w, r)
    with pytest.raises(ValueError, match="router, norm_weight: expected H = 32"):
        nn.norm_router(x[:, :32], w, r)
    with pytest.raises(ValueError, match=r"router: expected \[L, E, H\] with layer given"):
        nn.norm_router(x, w[None], r, layer=0)
    with pytest.raises(ValueError, match=r"norm_weight: expected \[H\]"):
        nn.norm_router(x, w[None], r)
    with pytest.raises(ValueError, match="layer"):
        nn.norm_router(x, w[None], r[None], layer=3, backend="pallas")
    with pytest.raises(ValueError, match=r"logits: expected the router logits \[T=2, E=8\]"):
        nn.moe_block(nn.MoE(r, None, None, None, None), x, logits=jnp.zeros((2, 7)))
    interp = pallas_interpret()
    with pytest.raises(ValueError, match="x: expected bf16"):
        nr.norm_router_kernel(x.astype(jnp.float32), w, r, EPS, interpret=interp)
    with pytest.raises(ValueError, match="router: expected bf16 .E, H. with H = 64"):
        nr.norm_router_kernel(x, w, r[:, :32], EPS, interpret=interp)
    with pytest.raises(ValueError, match="norm_weight: expected bf16"):
        nr.norm_router_kernel(x, w[:32], r, EPS, interpret=interp)
    with pytest.raises(ValueError, match="x: the norm-router kernel does not take 65 tokens"):
        nr.norm_router_kernel(jnp.zeros((65, 64), jnp.bfloat16), w, r, EPS, interpret=interp)


def _tiny_qwen3():
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
    import e2e_bench

    cfg = e2e_bench.config_of({**e2e_bench.TINY["qwen3-30b-a3b"], "num_layers": 3})
    return cfg, e2e_bench.build_model(cfg, "nvfp4")


def test_decode_step_runs_the_norm_router_kernel_on_the_stacks():
    """The decoders' one-token step on the kernel path: one add-norm-router launch in the
    layer loop (the residual add in it), its norm weight and router the group's [L, H] and
    [L, E, H] stacks (a [H] or [E, H] operand would be a per-layer slice, one copy a step)."""
    from nvfp4_jax import models

    cfg, model = _tiny_qwen3()
    cache = models.init_cache(cfg, 1, 8)
    step = functools.partial(models.decode_step, backend="pallas")
    jaxpr = jax.make_jaxpr(step)(model, jnp.zeros((1,), jnp.int32), cache)

    (call,) = pallas_calls(jaxpr.jaxpr, "nvfp4_moe_add_norm_router")
    hd, e = cfg.hidden_size, cfg.num_experts
    # (layer, x, a, norm stack, router stack)
    assert [tuple(v.aval.shape) for v in call.invars[1:5]] == [(1, hd), (1, hd), (3, hd),
                                                               (3, e, hd)]
    assert not list(pallas_calls(jaxpr.jaxpr, "nvfp4_moe_norm_router"))


def test_decoder_through_the_kernel_gives_the_compositions_logits(monkeypatch):
    """A tiny Qwen3-MoE's prefill and decode step with every MoE layer's norm and router on
    the kernel (interpreted) against the XLA composition on the same [B * T, H] rows: the same
    logits bit for bit (the residual add in the kernel too). On the CPU the interpreted kernel's sums are XLA:CPU reductions that
    round like the composition's here (jax 0.10.2); a layer's norm or router read at another
    row, or h and the logits not the ones handed on to the experts, changes them."""
    from nvfp4_jax import models

    cfg, model = _tiny_qwen3()
    ids = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    real = nn.add_norm_router
    outs = []
    for force in ("pallas", "xla"):
        used = []

        def spy(x, res, *a, force=force, used=used, **k):
            used.append(k["backend"])
            # the [B * T, H] rows, as the kernel sees them (XLA:CPU's sum of squares over
            # [B, T, H] may round otherwise)
            hd = x.shape[-1]
            s, h, lg = real(x.reshape(-1, hd), res.reshape(-1, hd), *a,
                            **{**k, "backend": force})
            return s.reshape(x.shape), h.reshape(x.shape), lg.reshape(x.shape[:-1] + (-1,))

        monkeypatch.setattr(nn, "add_norm_router", spy)
        jax.clear_caches()
        cache = models.init_cache(cfg, 1, 8)
        logits, cache = models.prefill(model, ids, cache, backend="xla")
        step, cache = models.decode_step(model, jnp.argmax(logits, -1), cache, backend="xla")
        assert used and set(used) == {"xla"}  # the decoder's own choice, overridden
        outs.append([np.asarray(a, np.float32) for a in (logits, step)])
    jax.clear_caches()
    for a, b in zip(*outs):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
