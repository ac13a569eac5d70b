"""The decoder's residual add folded into the MoE: ``moe(..., residual=r)`` is bit for bit XLA's
``r + moe(...)`` on the two bf16 arrays (both widened to fp32, added, rounded to nearest even).

The Mosaic path adds it in its combine launch (``combine.combine(residual=)``, Pallas-Triton in
interpret mode here), the other paths in XLA (``xla.add_residual``). Checked on random data at
several magnitudes of residual against output: much larger, much smaller, comparable, and
cancelling, where the bf16 rounding of the layer output before the add shows in the bits.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from moe_cases import make_case
from test_moe import SMALL, to_jax

from nvfp4_jax.gemm.mosaic import POST_SCALE
from nvfp4_jax.moe import combine as cmb
from nvfp4_jax.moe.api import moe
from nvfp4_jax.moe.mosaic import MosaicMoEConfig
from nvfp4_jax.moe.routing import block_routing
from nvfp4_jax.moe.xla import add_residual


def _bits(x: jax.Array) -> np.ndarray:
    """bf16 array -> its uint16 bit patterns."""
    return np.asarray(x).view(np.uint16)


def _bf16(x: np.ndarray) -> jax.Array:
    return jnp.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))


def _residual(rng, out: jax.Array, kind: str) -> jax.Array:
    """bf16 [T, H] residual for the layer output ``out`` bf16 [T, H]: ``kind`` "larger" (2^12
    times out's magnitude), "smaller" (2^-12), "same" (out's magnitude), "mixed" (per element
    10^[-4, 4] times it) or "cancel" (-out to within a few bf16 ulps: the sum is small and
    carries out's rounding in its low bits)."""
    o = np.asarray(out, np.float32)
    mag = max(float(np.abs(o).max()), 1e-3)
    g = rng.standard_normal(o.shape).astype(np.float32)
    if kind == "larger":
        return _bf16(g * mag * 2.0**12)
    if kind == "smaller":
        return _bf16(g * mag * 2.0**-12)
    if kind == "same":
        return _bf16(g * mag)
    if kind == "mixed":
        return _bf16(g * mag * 10.0 ** rng.uniform(-4, 4, o.shape))
    assert kind == "cancel"
    return _bf16(-o * (1 + g * 2.0**-7))


KINDS = ("larger", "smaller", "same", "mixed", "cancel")


def test_xla_bf16_add_is_fp32_add_rounded_to_bf16():
    """The claim the residual add rests on: XLA's ``r + o`` on bf16 arrays is
    bf16_rne(f32(r) + f32(o)), which is also the correctly rounded exact sum."""
    rng = np.random.default_rng(0)
    n = 1 << 16
    exps = rng.integers(-30, 30, (2, n))
    r, o = (_bf16(rng.standard_normal(n) * 2.0 ** exps[i]) for i in range(2))
    got = _bits(r + o)  # jnp on bf16 arrays, an XLA add
    rf, of = (np.asarray(a).astype(np.float32) for a in (r, o))
    np.testing.assert_array_equal(got, (rf + of).astype(ml_dtypes.bfloat16).view(np.uint16))
    exact = rf.astype(np.float64) + of.astype(np.float64)
    np.testing.assert_array_equal(got, exact.astype(ml_dtypes.bfloat16).view(np.uint16))
    # add_residual: the same bits, also where XLA fuses it with the fp32 sum out comes from
    s = jnp.asarray(rng.standard_normal((4, 64, 256)), jnp.float32)
    rr = _bf16(rng.standard_normal((64, 256)) * 3.0)
    want = rr + s.sum(0).astype(jnp.bfloat16)  # two ops, the bf16 output materialized
    fused = jax.jit(lambda s, r: add_residual(r, s.sum(0).astype(jnp.bfloat16)))(s, rr)
    np.testing.assert_array_equal(_bits(fused), _bits(want))


def _combine_case(rng, *, mode, split, k, prescaled, t=5, e=8, h=256, mt=8):
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    br = block_routing(jnp.asarray(ids, jnp.int32), e, mt)
    em = br.block_expert.shape[0] * mt
    # rows at magnitudes 2^[-6, 6]: outputs over several binades
    rows = 2.0 ** rng.integers(-6, 7, (1, em, 1))
    part = rng.standard_normal((split, em, h + 128)) * rows * 3.0
    if prescaled:
        part = jnp.asarray(part * 2.0**-3, jnp.bfloat16)
    else:
        part = jnp.asarray(part, jnp.float32)
    wts = jnp.asarray(rng.uniform(0.0, 1.0, (t, k)), jnp.float32)
    a2 = jnp.asarray(rng.uniform(0.5, 2.0, e) * 2.0**-9, jnp.float32)
    return part, br.route_pos, jnp.asarray(ids, jnp.int32), wts, a2


@pytest.mark.parametrize("mode,split,k,prescaled,wide", [
    ("trtllm_cutlass", 1, 6, False, False), ("b12x", 3, 4, False, False),
    ("trtllm_cutlass", 1, 3, True, False),  # bf16 products from the GEMM
    ("b12x", 1, 1, False, False),  # one route: its fp32 product is the sum
    ("trtllm_cutlass", 2, 8, False, True),  # wide: 256 columns per program
])
def test_combine_residual_is_xla_add_of_the_combine(mode, split, k, prescaled, wide):
    rng = np.random.default_rng(split * 10 + k)
    h = 256
    part, pos, ids, wts, a2 = _combine_case(rng, mode=mode, split=split, k=k, prescaled=prescaled, h=h)
    f = functools.partial(cmb.combine, part, pos, ids, wts, a2, hidden=h, mode=mode, interpret=True,
                          wide=wide)
    out = f()
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    for kind in KINDS:
        r = _residual(rng, out, kind)
        got = f(residual=r)
        assert got.dtype == jnp.bfloat16 and got.shape == out.shape
        np.testing.assert_array_equal(_bits(got), _bits(r + out), err_msg=kind)


def test_combine_residual_rounds_the_output_first():
    """The data tells the two orders apart: with one route (b12x, unsplit) the route sum is one
    fp32 product, computed here; adding the residual to it unrounded gives other bits in many
    elements, and the kernel gives the bits of the bf16 output plus the residual."""
    rng = np.random.default_rng(7)
    h = 256
    part, pos, ids, wts, a2 = _combine_case(rng, mode="b12x", split=1, k=1, prescaled=False, h=h)
    p, q = np.asarray(part)[0], np.asarray(pos)
    a = np.asarray(a2)[np.asarray(ids)[:, 0]] * np.float32(POST_SCALE)
    raw = (p[q, :h] * a[:, None]).astype(np.float32) * np.asarray(wts)[:, :1]  # fp32, as the kernel
    out = cmb.combine(part, pos, ids, wts, a2, hidden=h, mode="b12x", interpret=True)
    np.testing.assert_array_equal(_bits(out), raw.astype(ml_dtypes.bfloat16).view(np.uint16))
    for kind in ("same", "cancel"):
        r = _residual(rng, out, kind)
        got = _bits(cmb.combine(part, pos, ids, wts, a2, hidden=h, mode="b12x", interpret=True,
                                residual=r))
        np.testing.assert_array_equal(got, _bits(r + out), err_msg=kind)
        unrounded = (np.asarray(r).astype(np.float32) + raw).astype(ml_dtypes.bfloat16).view(np.uint16)
        assert np.mean(got != unrounded) > 0.05, kind


def test_combine_residual_lowers_for_cuda():
    """With a residual the combine is one Triton launch under its name, reading the residual."""
    t, k, e, h, em = 3, 4, 16, 1024, 64
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)

    def f(part, pos, ids, wts, a2, r):
        return cmb.combine(part, pos, ids, wts, a2, hidden=h, mode="trtllm_cutlass", residual=r)

    args = (f32(1, em, h), i32(t * k), i32(t, k), f32(t, k), f32(e),
            jax.ShapeDtypeStruct((t, h), jnp.bfloat16))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_moe_combine" in text
    calls = re.findall(r"(%\d+) = stablehlo.custom_call @__gpu\$xla.gpu.triton\(([^)]*)\)", text)
    assert len(calls) == 1 and calls[0][1].split(", ")[-1] == "%arg5"  # the residual, read
    assert re.search(rf"return {calls[0][0]} : tensor<{t}x{h}xbf16>", text)  # stored as it is
    assert "stablehlo.add" not in text


def test_combine_residual_is_checked():
    rng = np.random.default_rng(1)
    part, pos, ids, wts, a2 = _combine_case(rng, mode="b12x", split=1, k=2, prescaled=False)
    f = functools.partial(cmb.combine, part, pos, ids, wts, a2, hidden=256, mode="b12x", interpret=True)
    with pytest.raises(ValueError, match=r"^residual: expected bfloat16 \[T=5, H=256\]"):
        f(residual=jnp.zeros((5, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"^residual: expected bfloat16"):
        f(residual=jnp.zeros((5, 256), jnp.float32))


# ----------------------------------------------------------------------------- the public moe


def _moe_kw(case):
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    return hidden, {"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2,
                    "topk_ids": ids, "topk_weights": w}


@pytest.mark.parametrize("backend,mode,activation,kw,config", [
    ("xla", "trtllm_cutlass", "relu2", {"t": 9, "h": 64, "inter": 32, "e": 4, "k": 2}, None),
    ("pallas", "b12x", "swiglu", {"t": 7, "h": 64, "inter": 32, "e": 4, "k": 2}, SMALL),
    # Mosaic off the GPU: the grouped GEMMs' XLA emulation, the glue kernels interpreted; FC2
    # on Mosaic (the combine adds the residual), and on Pallas-Triton (I = 96: XLA adds it)
    ("mosaic", "trtllm_cutlass", "swiglu", {"t": 5, "h": 256, "inter": 256, "e": 4, "k": 3}, None),
    ("mosaic", "b12x", "relu2", {"t": 6, "h": 256, "inter": 256, "e": 4, "k": 2},
     MosaicMoEConfig(block_m=8, wide_glue=True, skip_padding=True)),
    ("mosaic", "trtllm_cutlass", "relu2", {"t": 5, "h": 256, "inter": 96, "e": 4, "k": 2}, None),
])
def test_moe_residual_is_xla_add_of_the_layer(backend, mode, activation, kw, config):
    case = make_case(np.random.default_rng(kw["t"] + kw["inter"]), activation=activation, **kw)
    hidden, args = _moe_kw(case)
    args.update(mode=mode, activation=activation, backend=backend, config=config)
    out = moe(hidden, **args)
    rng = np.random.default_rng(3)
    for kind in ("same", "cancel", "mixed"):
        r = _residual(rng, out, kind)
        want = _bits(r + out)
        np.testing.assert_array_equal(_bits(moe(hidden, residual=r, **args)), want, err_msg=kind)
        if kind == "same":  # inside one jit too, where XLA may fuse the add with the layer
            jitted = jax.jit(lambda x, r: moe(x, residual=r, **args))(hidden, r)
            np.testing.assert_array_equal(_bits(jitted), want, err_msg=f"{kind}, jit")


def test_moe_residual_is_checked():
    case = make_case(np.random.default_rng(0), t=3, h=64, inter=32, e=4, k=2)
    hidden, args = _moe_kw(case)
    for bad in (jnp.zeros((3, 32), jnp.bfloat16), jnp.zeros((4, 64), jnp.bfloat16),
                jnp.zeros((3, 64), jnp.float32)):
        for backend in ("xla", "pallas"):
            with pytest.raises(ValueError, match=r"^residual: expected bfloat16 \(3, 64\)"):
                moe(hidden, residual=bad, backend=backend, **args)
