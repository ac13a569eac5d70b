"""Oracle-exact without XLA's division flag: ``division.integer_divide`` (what XLA runs for
every fp32 division of the package on a GPU) against numpy's IEEE division, the quantizers
through it against the oracle, the Triton MoE's FC1-input kernel (interpret mode) against the
oracle, and the cuda lowerings free of approximate division."""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfp4_jax as nj
import oracle
from nvfp4_jax import division
from nvfp4_jax.moe.operand import fc1_operand
from nvfp4_jax.moe.routing import block_routing
from oracle.formats import bf16_round, f32

_int_div = jax.jit(division.integer_divide)


def _same_bits(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


def _ieee(a, b):
    with np.errstate(all="ignore"):
        return np.float32(a) / np.float32(b) if np.ndim(a) == 0 else a / b


def _bits(seed: int, n: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "any":  # every bit pattern: NaN, Inf, zeros, subnormals, normals
        return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    if kind == "subnormal":  # subnormal operands
        return (rng.integers(1, 2**23, n, dtype=np.uint32)
                | (rng.integers(0, 2, n, dtype=np.uint32) << 31)).view(np.float32)
    # magnitudes whose quotients land near the subnormal range, overflow and 1
    e = rng.integers(-149, 128, n)
    return (rng.uniform(1, 2, n) * np.exp2(e.astype(np.float64))).astype(np.float32)


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1),
       kinds=st.tuples(*[st.sampled_from(["any", "subnormal", "scaled"])] * 2))
def test_integer_divide_is_ieee_division(seed, kinds):
    a, b = _bits(seed, 8192, kinds[0]), _bits(seed + 1, 8192, kinds[1])
    bad = ~_same_bits(_int_div(a, b), _ieee(a, b))
    assert not bad.any(), (a[bad][:4], b[bad][:4], np.asarray(_int_div(a, b))[bad][:4])


def test_integer_divide_special_values_ties_and_rounding_carries():
    sp = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 2.0**-126, 2.0**-149 * 3,
                   np.finfo(np.float32).max, 1.0, 3.0, 6.0, 2688.0, 448.0, 2.0**-9, 0.75],
                  np.float32)
    a, b = (v.ravel() for v in np.meshgrid(sp, sp))
    assert _same_bits(_int_div(a, b), _ieee(a, b)).all()
    # quotients one ulp either side of a rounding tie, the largest finite / overflow boundary
    # and the smallest subnormal (ties to even at 2^-150)
    m = np.arange(1, 4096, dtype=np.uint32)
    a = ((m << 3) | 0x3F800000).view(np.float32)
    for b in (np.float32(3.0), np.float32(7.0), np.float32(2.0**-140), np.float32(2.0**100)):
        assert _same_bits(_int_div(a, b), _ieee(a, b)).all()
    edge = np.array([[np.finfo(np.float32).max, 0.9999999], [2.0**-149, 2.0], [2.0**-149, 1.5],
                     [3 * 2.0**-149, 2.0], [1.0, 2.0**127]], np.float32)
    assert _same_bits(_int_div(edge[:, 0], edge[:, 1]), _ieee(edge[:, 0], edge[:, 1])).all()


def test_integer_divide_broadcasts_like_numpy():
    a = np.arange(1, 49, dtype=np.float32).reshape(3, 16)
    b = np.array([3.0, 7.0, 11.0], np.float32)[:, None]
    got = _int_div(a, b)
    assert got.shape == (3, 16) and _same_bits(got, a / b).all()


def test_divide_on_cpu_is_ieee():
    a, b = _bits(5, 4096, "scaled"), _bits(6, 4096, "scaled")
    want = _ieee(a, b)
    # XLA:CPU flushes subnormal operands and results to zero, in every fp32 op (not only here)
    normal = (np.abs(want) >= 2.0**-126) & (np.abs(a) >= 2.0**-126) & (np.abs(b) >= 2.0**-126)
    assert _same_bits(np.asarray(jax.jit(division.divide)(a, b))[normal], want[normal]).all()


def _x_with_subnormal_scales(seed: int, m: int, k: int):
    """bf16 values whose 16-value blocks span ~2^-40..2^10 of the global scale: many E4M3 block
    scales subnormal, some underflowing to zero, some saturating."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-40, 10, (m, k // 16, 1))).repeat(16, -1).reshape(m, k)
    x = bf16_round(rng.standard_normal((m, k)) * mag)
    d = float(f32(np.abs(x).max() / 2688 * np.exp2(rng.uniform(-3, 3))))
    return x, d


@pytest.mark.parametrize("recipe", nj.JAX_RECIPES)
@settings(max_examples=6)
@given(seed=st.integers(0, 2**32 - 1), derive=st.booleans())
def test_quantize_through_integer_division_is_the_oracle(recipe, seed, derive):
    """Every ``division.divide`` of ``quantize`` runs the GPU's arithmetic (integer long
    division) here on CPU."""
    x, d = _x_with_subnormal_scales(seed, 16, 256)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(division, "divide", division.integer_divide)
        _check_quantize(x, d, recipe, derive)


def _check_quantize(x, d, recipe, derive):
    if derive:  # the global scale from max|x| (its division too)
        got = nj.quantize(jnp.asarray(x, jnp.float32), recipe)
        want = oracle.quantize(x, recipe)
    else:
        got = nj.quantize(jnp.asarray(x, jnp.float32), recipe, decode_scale=jnp.float32(d))
        want = oracle.quantize(x, recipe, decode_scale=d)
    got = nj.to_oracle(got)
    np.testing.assert_array_equal(got.scales, want.scales)
    np.testing.assert_array_equal(got.codes, want.codes)
    assert float(got.decode_scale) == float(want.decode_scale)


def _f32_divides(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "stablehlo.divide" in line and re.search(r"xf32>|<f32>", line)]


@pytest.mark.parametrize("recipe", nj.JAX_RECIPES)
def test_quantize_lowers_for_the_gpu_without_fp32_division(recipe):
    f = jax.jit(lambda x: nj.quantize(x, recipe))
    text = f.trace(jnp.zeros((4, 64), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert not _f32_divides(text), _f32_divides(text)[:3]
    cpu = f.trace(jnp.zeros((4, 64), jnp.bfloat16)).lower(lowering_platforms=("cpu",)).as_text()
    assert _f32_divides(cpu)  # the test can fail: on CPU XLA's own (IEEE) divide is used


def test_xla_w4a4_matmul_lowers_for_the_gpu_without_fp32_division():
    w = nj.quantize(jnp.ones((32, 64), jnp.float32), "modelopt")
    f = jax.jit(lambda x, s: nj.matmul(x, w, input_scale=s, backend="xla"))
    text = f.trace(jnp.zeros((4, 64), jnp.bfloat16), jnp.float32(0.1)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert not _f32_divides(text), _f32_divides(text)[:3]


def _moe_args(t, h, i, e, k, gated=False):
    def stack(n, kk):
        return nj.NVFP4Array.from_parts(jnp.zeros((e, n, kk // 2), jnp.uint8),
                                        jnp.zeros((e, n, kk // 16), jnp.float8_e4m3fn),
                                        jnp.ones((e,), jnp.float32))
    return (jnp.zeros((t, h), jnp.bfloat16), jnp.zeros((t, k), jnp.int32),
            jnp.zeros((t, k), jnp.float32), stack(2 * i if gated else i, h), stack(h, i),
            jnp.ones((e,), jnp.float32), jnp.ones((e,), jnp.float32))


@pytest.mark.parametrize("mode", ["trtllm_cutlass", "b12x"])
@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_moe_lowers_for_the_gpu_with_ieee_division_only(mode, backend):
    """relu2 layer: the cuda lowering divides only with div.rn.f32 (inline PTX) in its Triton
    kernels (no ``arith.divf``, which Triton compiles to div.full.f32) and has no fp32 XLA
    division; the Triton MoE quantizes its FC1 input in a kernel."""
    pt = importlib.import_module("nvfp4_jax.moe.pallas_triton")
    args = _moe_args(5, 256, 256, 8, 2)
    kw = {"activation": "relu2", "gate_up_order": "up_gate", "mode": mode,
          "activation_scale": "scalar" if mode == "trtllm_cutlass" else "per_expert"}
    if backend == "pallas":
        fn = functools.partial(pt.moe_pallas, **kw)
    else:
        fn = functools.partial(importlib.import_module("nvfp4_jax.moe.xla").moe_xla, **kw)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert not _f32_divides(text), _f32_divides(text)[:3]
    if backend == "pallas":
        assert "nvfp4_moe_fc1_input" in text and "div.rn.f32" in text
        assert "divf" not in text and "div.full" not in text and "div.approx" not in text


def test_the_approximate_division_check_can_fail():
    """swiglu's silu divides with Triton's ``/`` (not a quantization): the check sees it."""
    pt = importlib.import_module("nvfp4_jax.moe.pallas_triton")
    fn = functools.partial(pt.moe_pallas, activation="swiglu", gate_up_order="up_gate",
                           mode="b12x", activation_scale="per_expert")
    text = jax.jit(fn).trace(*_moe_args(5, 256, 256, 8, 2, gated=True)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "divf" in text


@settings(max_examples=12)
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(3, 48, 4, 2), (7, 272, 3, 1),
                                                              (2, 1040, 2, 2), (9, 256, 4, 3)]),
       recipe=st.sampled_from(["trtllm", "b12x"]), per_expert=st.booleans())
def test_fc1_input_kernel_is_the_oracles_quantization(seed, shape, recipe, per_expert):
    """``operand.fc1_operand(permute=False)`` (the Triton MoE's FC1 input) in interpret mode:
    each sorted row is the oracle's quantization of its token with its expert's encode scale
    (or the first's), E4M3-subnormal block scales included; padding rows are zero."""
    t, h, e, k = shape
    x, _ = _x_with_subnormal_scales(seed, t, h)
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    g = f32(2688.0 / np.abs(x).max() * np.exp2(rng.uniform(-2, 2, e)))
    rg = f32(1.0 / g)
    bm = 4
    br = block_routing(jnp.asarray(ids), e, bm)
    got = fc1_operand(jnp.asarray(x, jnp.bfloat16), br.sorted_route, br.block_expert, br.num_blocks,
                      jnp.asarray(g, jnp.float32), jnp.asarray(rg, jnp.float32), top_k=k,
                      block_m=bm, recipe=recipe, per_expert=per_expert, interpret=True,
                      permute=False)
    got = np.asarray(got, np.float64)
    route = np.asarray(br.sorted_route)
    be = np.repeat(np.asarray(br.block_expert), bm)
    for p in range(int(np.asarray(br.num_blocks)[0]) * bm):
        if route[p] >= t * k:
            assert not got[p].any(), f"padding row {p}"
            continue
        gp = g[be[p]] if per_expert else g[0]
        q = oracle.quantize(x[route[p] // k][None], recipe, encode_scale=float(gp))
        want = oracle.dequantize(q, include_decode_scale=False)
        np.testing.assert_array_equal(got[p], want[0], err_msg=f"row {p}")


def test_fc1_input_kernel_refuses_what_it_cannot_do():
    z = jnp.zeros((4,), jnp.int32)
    one = jnp.ones((1,), jnp.float32)
    with pytest.raises(ValueError, match="H % 16 == 0"):
        fc1_operand(jnp.zeros((2, 40), jnp.bfloat16), z, z[:1], z[:1] + 1, one, one, top_k=1,
                    block_m=4, recipe="trtllm", per_expert=False, interpret=True, permute=False)
    with pytest.raises(ValueError, match="prequantized rows are K-permuted"):
        fc1_operand(jnp.zeros((2, 256), jnp.bfloat16), z, z[:1], z[:1] + 1, one, one, top_k=1,
                    block_m=4, recipe="trtllm", per_expert=False, interpret=True, permute=False,
                    prequantized=True)
