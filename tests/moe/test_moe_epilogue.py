"""The Mosaic MoE path's Pallas-Triton glue kernels (moe/epilogue.py) in interpret mode, each
against an independent reference: the XLA functions the path used before (``xla.py``:
``sorted_rows``, ``activate``, ``quantized_values``, all bit-exact with the oracle) with the
K permutation applied as a gather by ``gemm.mosaic.PERM``; bit-exact, on
random partials at several magnitudes (E4M3-subnormal block scales included), uneven routing,
both modes and activations, split-K 1 and 3. The combine's fp32 top-k sum may run in any
order: it is checked against the exact sum of the exact per-route terms within the fp32
summation bound, then the bf16 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax import triton_ops as tops
from nvfp4_jax.gemm.mosaic import PERM, POST_SCALE
from nvfp4_jax.moe import combine as cmb
from nvfp4_jax.moe import epilogue as ep
from nvfp4_jax.moe import operand as opd
from nvfp4_jax.moe import routing_kernel as rtk
from nvfp4_jax.moe import scales as msc
from nvfp4_jax.moe.routing import block_routing
from nvfp4_jax.moe.xla import (
    activate,
    bf16_round,
    moe_scales,
    quantized_values,
    recipe_of,
    sorted_rows,
)
from nvfp4_jax.quantize import ieee_div


def _permuted(x):
    """[S, K] -> K permuted as the grouped kernel reads it: column p of each 128-group holds
    element PERM[p] (a gather: independent of the kernels' reshape-and-transpose)."""
    k = x.shape[1]
    return x[:, (np.arange(k) // 128 * 128) + np.tile(PERM, k // 128)]


def _routing(rng, t, k, e, bm, skew):
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    if skew:
        ids[: t // 2] = ids[0]
    br = block_routing(jnp.asarray(ids, jnp.int32), e, bm)
    return ids, br, int(br.num_blocks[0])


def _scales(rng, e, mode, act_scale, in_mag=1.0):
    """(g1, g2, a1, a2) as moe_scales makes them; in_mag scales the input scales (the encode
    scales G = 1/input_scale shrink with it: E4M3-subnormal block scales for large in_mag)."""
    ws2 = jnp.asarray(rng.uniform(0.5, 2.0, e), jnp.float32)
    s_in = jnp.asarray(rng.uniform(0.5, 2.0, e) * in_mag, jnp.float32)
    return moe_scales(ws2, ws2 * 0.7, s_in, s_in * 1.3, mode, act_scale)


@pytest.mark.parametrize("mode,act_scale,in_mag,skew,wide", [
    ("trtllm_cutlass", "scalar", 1.0, False, False),
    ("b12x", "per_expert", 1.0, True, False),
    ("b12x", "scalar", 2.0**6, False, False),          # small G: most block scales E4M3 subnormals
    ("trtllm_cutlass", "scalar", 2.0**6, True, False),
    ("trtllm_cutlass", "scalar", 2.0**-6, False, False),  # large G: block scales saturate at 448
    ("b12x", "per_expert", 2.0**6, True, True),  # wide: 8 sorted rows per program, one gather
    ("trtllm_cutlass", "scalar", 1.0, False, True),
])
def test_fc1_operand_is_the_xla_operand(mode, act_scale, in_mag, skew, wide):
    rng = np.random.default_rng(int(in_mag * 7) + skew)
    t, k, e, bm, h = 9, 3, 8, 8, 512
    assert opd.operand_rows(bm, h, wide) == (8 if wide else 1)
    _, br, nb = _routing(rng, t, k, e, bm, skew)
    hidden = jnp.asarray(rng.standard_normal((t, h)) * rng.choice([1e-3, 1.0, 50.0], (t, 1)), jnp.bfloat16)
    g1, _, _, _ = _scales(rng, e, mode, act_scale, in_mag)
    recipe = recipe_of(mode)
    sf = np.abs(np.asarray(hidden, np.float32)).reshape(t, h // 16, 16).max(-1) * float(np.max(g1)) / 6
    if in_mag > 1:
        assert np.mean(sf < 2.0**-6) > 0.5  # the case drives the block scales into subnormals
    got = opd.fc1_operand(hidden, br.sorted_route, br.block_expert, br.num_blocks, g1, ieee_div(1.0, g1),
                         top_k=k, block_m=bm, recipe=recipe, per_expert=act_scale == "per_expert",
                         interpret=True, wide=wide)
    wts = jnp.ones((t, k), jnp.float32)
    xv, _, _ = sorted_rows(hidden, wts, g1, br.sorted_route, br.block_expert, top_k=k, block_m=bm,
                           recipe=recipe, activation_scale=act_scale)
    want = _permuted(xv)
    rows = nb * bm
    assert np.count_nonzero(np.asarray(want[:rows], np.float32)) > t * k * h // 4  # not all zeros
    np.testing.assert_array_equal(np.asarray(got[:rows], np.float32), np.asarray(want[:rows], np.float32))


@pytest.mark.parametrize("mode,in_mag,t,bm,wide,skip", [
    ("trtllm_cutlass", 1.0, 9, 8, False, False),
    ("trtllm_cutlass", 2.0**6, 11, 16, True, True),   # subnormal block scales; T not a multiple of 8
    ("b12x", 2.0**-6, 16, 8, True, False),            # b12x with a scalar activation scale
])
def test_token_operand_then_gather_is_the_fc1_operand(mode, in_mag, t, bm, wide, skip):
    """token_quant's two kernels (each token quantized once, then the routed rows gathered)
    give the one-kernel FC1 operand bit for bit on every routed row (routes of one token
    share its row), with zeros (or, with skip_padding, nothing) on padding rows."""
    rng = np.random.default_rng(t + bm)
    k, e, h = 3, 8, 512
    _, br, nb = _routing(rng, t, k, e, bm, skew=True)
    hidden = jnp.asarray(rng.standard_normal((t, h)) * rng.choice([1e-3, 1.0, 50.0], (t, 1)), jnp.bfloat16)
    g1, _, _, _ = _scales(rng, e, mode, "scalar", in_mag)
    kw = {"top_k": k, "block_m": bm, "recipe": recipe_of(mode), "per_expert": False,
          "interpret": True, "wide": wide, "skip_padding": skip}
    args = (br.sorted_route, br.block_expert, br.num_blocks, g1, ieee_div(1.0, g1))
    want = np.asarray(opd.fc1_operand(hidden, *args, **kw), np.float32)
    xq = opd.token_operand(hidden, g1, ieee_div(1.0, g1), recipe=recipe_of(mode), interpret=True, wide=wide)
    assert xq.shape == (-(-t // opd.TOKEN_BLOCK) * opd.TOKEN_BLOCK, h)
    assert not np.any(np.asarray(xq, np.float32)[t:])  # rows past T: zeros
    got = np.asarray(opd.fc1_operand(xq, *args, **kw, prequantized=True, num_tokens=t), np.float32)
    rows = np.arange(nb * bm)
    routed = np.asarray(br.sorted_route)[rows] < t * k
    assert np.count_nonzero(want[rows][routed]) > t * k * h // 4
    np.testing.assert_array_equal(got[rows][routed], want[rows][routed])
    if not skip:
        np.testing.assert_array_equal(got[rows][~routed], want[rows][~routed])
    with pytest.raises(ValueError, match="^per_expert: prequantized"):
        opd.fc1_operand(xq, *args, **{**kw, "per_expert": True}, prequantized=True, num_tokens=t)
    with pytest.raises(ValueError, match="^num_tokens"):
        opd.fc1_operand(xq, *args, **kw, prequantized=True, num_tokens=xq.shape[0] + 1)


def test_wide_fc1_operand_skip_padding_writes_only_routed_rows():
    """Wide programs (4 rows at bm 16: a block spans several programs) with skip_padding: the
    routed rows are the narrow kernel's, bit for bit; padding rows are not written (interpret
    mode fills outputs with NaN, so an unmasked store of a padding row's zeros would show)."""
    rng = np.random.default_rng(3)
    t, k, e, bm, h = 11, 3, 8, 16, 1024
    assert opd.operand_rows(bm, h, True) == 8
    _, br, nb = _routing(rng, t, k, e, bm, skew=True)
    hidden = jnp.asarray(rng.standard_normal((t, h)) * 3.0, jnp.bfloat16)
    g1, _, _, _ = _scales(rng, e, "trtllm_cutlass", "scalar")
    kw = {"top_k": k, "block_m": bm, "recipe": "trtllm", "per_expert": False, "interpret": True}
    args = (hidden, br.sorted_route, br.block_expert, br.num_blocks, g1, ieee_div(1.0, g1))
    narrow = np.asarray(opd.fc1_operand(*args, **kw), np.float32)
    wide = np.asarray(opd.fc1_operand(*args, **kw, skip_padding=True, wide=True), np.float32)
    routed = np.asarray(br.sorted_route) < t * k
    assert routed.sum() == t * k and (~routed[: nb * bm]).sum() > 0  # both kinds of rows
    np.testing.assert_array_equal(wide[routed], narrow[routed])
    assert np.count_nonzero(narrow[routed]) > t * k * h // 4
    assert np.all(np.isnan(wide[: nb * bm][~routed[: nb * bm]]))


@pytest.mark.parametrize("activation,order,mode,split,mag,bm,inter,per,chunk", [  # mag: size of the partials
    ("relu2", "up_gate", "trtllm_cutlass", 1, 1.0, 16, 256, 2, 16),  # per: column tiles per program
    ("swiglu", "gate_up", "b12x", 3, 1.0, 16, 256, 1, 16),
    ("swiglu", "up_gate", "trtllm_cutlass", 1, 2.0**-9, 8, 384, 1, 8),  # small h: subnormal block scales
    ("relu2", "up_gate", "b12x", 3, 2.0**6, 8, 384, 3, 8),
    # blocks split into programs of fewer rows (chunk: rows per program)
    ("swiglu", "up_gate", "trtllm_cutlass", 1, 1.0, 64, 256, 1, 32),
    ("relu2", "up_gate", "b12x", 2, 1.0, 128, 256, 1, 64),
])
def test_fc1_epilogue_is_the_xla_epilogue(activation, order, mode, split, mag, bm, inter, per, chunk):
    rng = np.random.default_rng(split * 11 + len(activation))
    t, k, e = 7, 4, 6
    halves = 2 if activation == "swiglu" else 1
    assert ep.epilogue_row_chunk(bm, halves) == chunk
    assert ep.tiles_per_program(inter // ep.TILE, chunk, halves) == per
    r = 2 * inter if activation == "swiglu" else inter
    r_pad = r + 128  # the kernel's output rows are padded to its block_n
    _, br, nb = _routing(rng, t, k, e, bm, skew=True)
    nbk = br.block_expert.shape[0]
    part = jnp.asarray(rng.standard_normal((split, nbk * bm, r_pad)) * mag, jnp.float32)
    _, g2, a1, _ = _scales(rng, e, mode, "scalar" if mode == "trtllm_cutlass" else "per_expert")
    hv, hb = ep.fc1_epilogue(part, br.block_expert, br.num_blocks, a1, g2, ieee_div(1.0, g2), inter=inter,
                             activation=activation, gate_up_order=order, mode=mode,
                             recipe=recipe_of(mode), return_h=True, interpret=True)
    # reference: the XLA epilogue (moe_mosaic before the kernels), from the same partials
    acc = part.sum(axis=0)[:, :r]  # token-major: row b*bm + m is row m of block b
    row_expert = jnp.repeat(br.block_expert, bm)
    u = acc * (a1[row_expert] * jnp.float32(POST_SCALE))[:, None]
    if mode == "trtllm_cutlass":
        u = bf16_round(u)
    hf = bf16_round(activate(u, activation, order))
    want_hv = _permuted(quantized_values(hf, g2[row_expert], recipe_of(mode)))
    rows = nb * bm
    f = lambda a: np.asarray(a[:rows], np.float32)
    if mag < 1:  # the requantization's block scales fall into E4M3 subnormals
        sf = np.abs(f(hf)).reshape(rows, inter // 16, 16).max(-1) * np.asarray(g2[row_expert])[:rows, None] / 6
        assert np.mean((sf > 2.0**-10) & (sf < 2.0**-6)) > 0.3
    assert np.count_nonzero(f(want_hv)) > t * k * inter // 8  # not all zeros
    np.testing.assert_array_equal(f(hb), f(hf.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(f(hv), f(want_hv))


def _bf16_neighbours(v):
    """Largest bf16 <= v and smallest bf16 >= v (float64 in, float64 out; finite v)."""
    import ml_dtypes

    b = np.asarray(v, np.float64).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    step = np.abs(b) * 2.0**-7 + 2.0**-133
    lo = np.where(b <= v, b, b - step)
    hi = np.where(b >= v, b, b + step)
    lo = lo.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)  # snap to bf16
    hi = hi.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.minimum(lo, b), np.maximum(hi, b)


@pytest.mark.parametrize("mode,split,mt,k,wide", [
    ("trtllm_cutlass", 1, 8, 6, False), ("b12x", 3, 16, 6, False), ("trtllm_cutlass", 2, 64, 6, False),
    ("trtllm_cutlass", 1, 8, 22, False), ("b12x", 1, 8, 1, False),
    ("trtllm_cutlass", 1, 64, 22, True), ("b12x", 3, 8, 6, True),  # wide: 256 columns per program
])
def test_combine_is_a_bounded_fp32_sum_of_the_mode_terms(mode, split, mt, k, wide):
    """Each route's term is exact (split-K sum of the partials in order, times alpha2 * 2^7,
    bf16-rounded in trtllm_cutlass, times the router weight: fp32 products); their fp32 sum
    (any order, possibly with fused multiply-adds) lies within gamma_(k-1) * sum |term| of the
    exact sum, and the output is bf16 of that: between the bf16 neighbours of the interval."""
    rng = np.random.default_rng(split + mt + k)
    t, e, h = 5, 32, 256
    ids, br, _ = _routing(rng, t, k, e, mt, skew=True)
    nbk = br.block_expert.shape[0]
    part = jnp.asarray(rng.standard_normal((split, nbk * mt, h + 128)) * 3.0, jnp.float32)
    wts = jnp.asarray(rng.uniform(0.0, 1.0, (t, k)), jnp.float32)
    a2 = jnp.asarray(rng.uniform(0.5, 2.0, e) * 2.0**-9, jnp.float32)
    assert cmb.combine_width(h, tops.pow2(k), wide) == (256 if wide else cmb.COMBINE_WIDTH)
    got = np.asarray(cmb.combine(part, br.route_pos, jnp.asarray(ids), wts, a2, hidden=h, mode=mode,
                                interpret=True, wide=wide), np.float64)
    p32, pos, w = np.asarray(part), np.asarray(br.route_pos), np.asarray(wts)
    a2n = np.asarray(a2)
    terms = np.zeros((t, k, h), np.float64)
    for ti in range(t):
        for j in range(k):
            q = pos[ti * k + j]
            d = p32[0, q, :h]
            for s in range(1, split):
                d = d + p32[s, q, :h]  # fp32, split order
            d = d * np.float32(a2n[ids[ti, j]] * POST_SCALE)
            if mode == "trtllm_cutlass":
                d = np.asarray(jnp.asarray(d).astype(jnp.bfloat16), np.float32)
            terms[ti, j] = d.astype(np.float64) * np.float64(w[ti, j])  # exact; fp32-rounded below
    prod = terms.astype(np.float32).astype(np.float64)
    exact = prod.sum(axis=1)
    u = 2.0**-24
    slack = (k - 1) * u / (1 - (k - 1) * u) * np.abs(terms).sum(axis=1) + np.abs(terms - prod).sum(axis=1)
    lo, _ = _bf16_neighbours(exact - slack)
    _, hi = _bf16_neighbours(exact + slack)
    assert np.all(np.isfinite(got))
    assert np.all((got >= lo) & (got <= hi)), np.max(np.abs(got - exact))
    # sharp: nearly every output is the bf16 rounding of the exact sum
    near = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
    assert np.mean(got == near) > 0.97


def test_glue_kernels_lower_for_cuda():
    """The three kernels lower to Triton for CUDA (no GPU needed) under their names."""
    e, t, k, bm, h, inter = 16, 3, 4, 8, 1024, 2688
    br = jax.eval_shape(lambda i: block_routing(i, e, bm), jax.ShapeDtypeStruct((t, k), jnp.int32))
    nb = br.block_expert.shape[0]
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)

    def f(hidden, sr, be, nbk, pos, ids, wts, part1, part2, g, a):
        xp = opd.fc1_operand(hidden, sr, be, nbk, g, g, top_k=k, block_m=bm, recipe="trtllm", per_expert=False)
        xw = opd.fc1_operand(hidden, sr, be, nbk, g, g, top_k=k, block_m=bm, recipe="trtllm", per_expert=False,
                            skip_padding=True, wide=True)
        hv, _ = ep.fc1_epilogue(part1, be, nbk, a, g, g, inter=inter, activation="relu2",
                                gate_up_order="up_gate", mode="trtllm_cutlass", recipe="trtllm")
        return (xp, xw, hv, cmb.combine(part2, pos, ids, wts, a, hidden=h, mode="trtllm_cutlass"),
                cmb.combine(part2, pos, ids, wts, a, hidden=h, mode="trtllm_cutlass", wide=True))

    args = (jax.ShapeDtypeStruct((t, h), jnp.bfloat16), i32(nb * bm), i32(nb), i32(1), i32(t * k),
            i32(t, k), f32(t, k), f32(1, nb * bm, inter), f32(1, nb * bm, h), f32(e), f32(e))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("nvfp4_moe_fc1_operand", "nvfp4_moe_fc1_epilogue", "nvfp4_moe_combine"):
        assert name in text


def test_glue_kernels_name_the_bad_argument():
    z = jnp.zeros
    with pytest.raises(ValueError, match="hidden: expected"):
        opd.fc1_operand(z((2, 320), jnp.bfloat16), z(8, jnp.int32), z(1, jnp.int32), z(1, jnp.int32),
                       z(4), z(4), top_k=2, block_m=8, recipe="trtllm", per_expert=False, interpret=True)
    with pytest.raises(ValueError, match="part: expected"):  # I not a multiple of 128
        ep.fc1_epilogue(z((1, 16, 256)), z(2, jnp.int32), z(1, jnp.int32), z(4), z(4), z(4), inter=192,
                        activation="relu2", gate_up_order="up_gate", mode="b12x", recipe="b12x",
                        interpret=True)
    with pytest.raises(ValueError, match="part: expected"):  # swiglu needs 2I rows of partials
        ep.fc1_epilogue(z((1, 16, 256)), z(2, jnp.int32), z(1, jnp.int32), z(4), z(4), z(4), inter=256,
                        activation="swiglu", gate_up_order="up_gate", mode="b12x", recipe="b12x",
                        interpret=True)
    with pytest.raises(ValueError, match="part: expected"):  # H_pad < H
        cmb.combine(z((1, 16, 128)), z(4, jnp.int32), z((2, 2), jnp.int32), z((2, 2)), z(4),
                   hidden=256, mode="b12x", interpret=True)


def _numpy_block_routing(ids, e, bm):
    """Independent reference: stable sort of the routes by expert, each expert's group padded
    to a multiple of bm (sentinel n), one expert per block (the last real one past the end)."""
    flat = ids.reshape(-1)
    n = flat.size
    nb = min(e, n) + -(-n // bm)
    srt = np.full(nb * bm, n, np.int32)
    pos = np.zeros(n, np.int32)
    be = np.full(nb, e - 1, np.int32)
    row = 0
    for ex in range(e):
        routes = np.nonzero(flat == ex)[0]  # token order
        if routes.size == 0:
            continue
        srt[row:row + routes.size] = routes
        pos[routes] = row + np.arange(routes.size)
        blocks = -(-routes.size // bm)
        be[row // bm: row // bm + blocks] = ex
        row += blocks * bm
    be[row // bm:] = e - 1
    return srt, be, np.int32([row // bm]), pos


@pytest.mark.parametrize("t,k,e,bm,kind", [
    (1, 8, 128, 8, "random"), (8, 8, 128, 8, "random"), (1, 22, 512, 8, "random"),
    (5, 3, 7, 16, "random"), (9, 4, 16, 8, "skewed"), (6, 2, 5, 8, "one_expert"),
    (2, 22, 512, 16, "random"), (8, 22, 512, 8, "random"), (8, 22, 512, 8, "skewed"),
    (23, 22, 512, 8, "one_expert"), (37, 3, 128, 16, "skewed"), (6, 4, 16, 8, "repeats"),
])
@pytest.mark.parametrize("method", ["experts", "routes", "tokens"])
def test_routing_kernel_is_the_block_routing(t, k, e, bm, kind, method):
    """The one-launch routing kernel (interpret mode), every method where it fits, gives
    exactly the numpy grouping and exactly what the XLA ``block_routing`` gives: uneven groups,
    experts without tokens, all tokens on one expert (506 routes on three experts), E not a
    power of two, nemotron T = 8 (176 routes over 512 experts: not the experts method), a
    token routed twice to one expert ("one_expert", "repeats": the tokens method counts them
    per token)."""
    if method not in rtk.routing_methods(t * k, e, bm, top_k=k, explicit=True):
        pytest.skip(f"{method} does not take {t * k} routes over {e} experts")
    rng = np.random.default_rng(t * 100 + k)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    if kind == "skewed":
        ids[: t // 2] = ids[0]
    if kind == "one_expert":
        ids[:, 0] = 3  # every token's first route on expert 3, the others on experts 0 and 1
        ids[:, 1:] = ids[:, 1:] % 2
    if kind == "repeats":
        ids[:, 1] = ids[:, 0]  # every token twice on its first expert, token 2 always on 5
        ids[2] = 5
    got = rtk.routing_kernel(jnp.asarray(ids), e, bm, interpret=True, method=method)
    want = _numpy_block_routing(ids, e, bm)
    xla = block_routing(jnp.asarray(ids), e, bm)
    for name, w in zip(("sorted_route", "block_expert", "num_blocks", "route_pos"), want):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), w, err_msg=name)
        np.testing.assert_array_equal(np.asarray(getattr(xla, name)), w, err_msg=name)


@pytest.mark.parametrize("mode,act_scale", [("trtllm_cutlass", "scalar"), ("b12x", "per_expert")])
def test_routing_kernel_with_scales(mode, act_scale):
    """The routing kernel computing the scales in the same launch: the routing unchanged, the
    six scale vectors bit for bit moe_scales_kernel's (itself checked against the oracle)."""
    rng = np.random.default_rng(7)
    t, k, e, bm = 3, 6, 24, 8
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    vecs = [(np.exp2(rng.uniform(lo, hi, e)) * rng.uniform(1, 2, e)).astype(np.float32)
            for lo, hi in ((-24, 4), (-24, 4), (-12, 8), (-12, 8))]
    br, sv = rtk.routing_kernel(jnp.asarray(ids), e, bm, scales=(*vecs, mode, act_scale), interpret=True)
    want = _numpy_block_routing(ids, e, bm)
    for name, w in zip(("sorted_route", "block_expert", "num_blocks", "route_pos"), want):
        np.testing.assert_array_equal(np.asarray(getattr(br, name)), w, err_msg=name)
    alone = msc.moe_scales_kernel(*vecs, num_experts=e, mode=mode, activation_scale=act_scale, interpret=True)
    assert len(sv) == 6
    for got, w in zip(sv, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(w).view(np.uint32))


def test_routing_kernel_lowers_and_refuses_large_routings(monkeypatch):
    for t, method in ((1, "routes"), (8, "routes"), (8, "tokens"), (23, "tokens")):  # nemotron
        f = jax.jit(lambda ids, m=method: rtk.routing_kernel(ids, 512, 8, method=m))
        text = f.trace(jax.ShapeDtypeStruct((t, 22), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "nvfp4_moe_routing" in text
    # the layer picks the routes method by itself up to ROUTES_AUTO_MAX routes (nemotron T = 1,
    # where it measured faster than the XLA routing; at T = 8 it was slower), an explicit
    # request up to ROUTING_ROUTES_MAX
    assert rtk.routing_methods(22, 512, 8) == ("routes",) and rtk.routing_kernel_fits(22, 512, 8)
    assert rtk.routing_methods(8 * 22, 512, 8, explicit=True) == ("routes",)
    assert rtk.routing_methods(8 * 22, 512, 8) == () and not rtk.routing_kernel_fits(8 * 22, 512, 8)
    # qwen3 T = 8: routes first (it measures faster there); experts above ROUTES_AUTO_MAX
    # routes (T = 16); explicit routes after experts
    assert rtk.routing_methods(8 * 8, 128, 8) == ("routes", "experts")
    assert rtk.routing_methods(16 * 8, 128, 8) == ("experts",)
    assert rtk.routing_methods(16 * 8, 128, 8, explicit=True) == ("experts", "routes")
    # the tokens method: for a [T, k] routing only (not the fused launch, top_k None); its
    # [T, E] table fits up to T = 64 at 512 experts, its [N, k] compare tile up to 1024 routes
    assert rtk.routing_methods(8 * 22, 512, 8, top_k=22, explicit=True) == ("routes", "tokens")
    assert rtk.routing_methods(8 * 22, 512, 8, top_k=22) == ("tokens",)
    assert rtk.routing_methods(22, 512, 8, top_k=22) == ("routes", "tokens")
    assert not rtk.routing_kernel_fits(8 * 22, 512, 8)  # no top_k: not the tokens method
    assert rtk.routing_kernel_fits(46 * 22, 512, 8, top_k=22)
    assert not rtk.routing_kernel_fits(47 * 22, 512, 8, top_k=22)  # 1034 routes
    monkeypatch.setattr(rtk, "ROUTES_AUTO_MAX", 512)
    assert rtk.routing_methods(8 * 22, 512, 8) == ("routes",) and rtk.routing_kernel_fits(8 * 22, 512, 8)
    assert not rtk.routing_kernel_fits(64 * 22, 512, 8)  # nemotron T = 64: XLA routing
    with pytest.raises(ValueError, match="^topk_ids: 1408 routes over 512 experts"):
        rtk.routing_kernel(jnp.zeros((64, 22), jnp.int32), 512, 8, interpret=True)
    with pytest.raises(ValueError, match="^topk_ids: 176 routes over 512 experts .*experts method"):
        rtk.routing_kernel(jnp.zeros((8, 22), jnp.int32), 512, 8, interpret=True, method="experts")


@pytest.mark.parametrize("mode,act_scale,x_mag,t,k,e,h,method", [
    ("trtllm_cutlass", "scalar", 1.0, 3, 6, 24, 256, None),
    ("b12x", "per_expert", 2.0**-8, 2, 8, 128, 512, None),
    ("trtllm_cutlass", "scalar", 2.0**8, 1, 8, 128, 4096, None),  # two K tiles of 2048
    ("b12x", "scalar", 2.0**-3, 5, 3, 7, 256, None),              # E not a power of two
    ("b12x", "per_expert", 1.0, 3, 6, 24, 256, "routes"),
    ("trtllm_cutlass", "scalar", 2.0**8, 2, 22, 512, 1024, "routes"),  # nemotron
])
def test_routing_operand_kernel_is_the_two_kernels(mode, act_scale, x_mag, t, k, e, h, method):
    """routing="fused": routing, scales and the FC1 operand from one launch are bit for bit
    the routing kernel's (and numpy's grouping), the scales kernel's, and ``fc1_operand``'s
    routed rows with skip_padding (each checked against an independent reference above);
    input scales across 2^-12..2^8 put block scales into E4M3 subnormals and saturation."""
    rng = np.random.default_rng(t * 1000 + h)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    vecs = [(np.exp2(rng.uniform(lo, hi, e)) * rng.uniform(1, 2, e)).astype(np.float32)
            for lo, hi in ((-24, 4), (-24, 4), (-12, 8), (-12, 8))]
    hidden = jnp.asarray(rng.standard_normal((t, h)) * x_mag, jnp.bfloat16)
    bm, recipe = 8, recipe_of(mode)
    br, sv, xp = rtk.routing_operand_kernel(jnp.asarray(ids), hidden, e, bm, (*vecs, mode, act_scale),
                                           recipe=recipe, interpret=True, method=method)
    for name, w in zip(("sorted_route", "block_expert", "num_blocks", "route_pos"),
                       _numpy_block_routing(ids, e, bm)):
        np.testing.assert_array_equal(np.asarray(getattr(br, name)), w, err_msg=name)
    alone = msc.moe_scales_kernel(*vecs, num_experts=e, mode=mode, activation_scale=act_scale, interpret=True)
    for got, w in zip(sv, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(w).view(np.uint32))
    want = opd.fc1_operand(hidden, br.sorted_route, br.block_expert, br.num_blocks, alone[0], alone[1],
                          top_k=k, block_m=bm, recipe=recipe, per_expert=act_scale == "per_expert",
                          skip_padding=True, interpret=True)
    live = np.asarray(br.route_pos)  # the routed rows
    got, w = np.asarray(xp, np.float32)[live], np.asarray(want, np.float32)[live]
    # not all zeros (small G with a small x flushes most of them: E4M3-subnormal block scales)
    assert np.all(np.isfinite(got)) and np.count_nonzero(got) > got.size // 20
    np.testing.assert_array_equal(got.view(np.uint32), w.view(np.uint32))


def test_routing_operand_kernel_lowers_and_checks_operands():
    vecs = (jnp.ones(128), jnp.ones(128), jnp.ones(128), jnp.ones(128), "b12x", "per_expert")
    f = jax.jit(lambda ids, x: rtk.routing_operand_kernel(ids, x, 128, 8, vecs, recipe="b12x"))
    text = f.trace(jax.ShapeDtypeStruct((8, 8), jnp.int32),
                   jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_moe_routing_operand" in text
    with pytest.raises(ValueError, match="^hidden: expected"):
        rtk.routing_operand_kernel(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 320), jnp.bfloat16), 128, 8,
                                  vecs, recipe="b12x", interpret=True)
    with pytest.raises(ValueError, match="^topk_ids: expected"):
        rtk.routing_operand_kernel(jnp.zeros((2, 8), jnp.int32), jnp.zeros((1, 256), jnp.bfloat16), 128, 8,
                                  vecs, recipe="b12x", interpret=True)
    with pytest.raises(ValueError, match="^topk_ids: 1408 routes"):  # nemotron T = 64
        rtk.routing_operand_kernel(jnp.zeros((64, 22), jnp.int32), jnp.zeros((64, 1024), jnp.bfloat16), 512, 8,
                                  vecs[:4] + ("trtllm_cutlass", "scalar"), recipe="trtllm", interpret=True)
    # nemotron T = 8 (the routes method) lowers
    v512 = (jnp.ones(512),) * 4 + ("trtllm_cutlass", "scalar")
    f = jax.jit(lambda ids, x: rtk.routing_operand_kernel(ids, x, 512, 8, v512, recipe="trtllm", method="routes"))
    text = f.trace(jax.ShapeDtypeStruct((8, 22), jnp.int32),
                   jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_moe_routing_operand" in text


def test_route_tiles_per_program():
    """The FC1 epilogue by route splits each route's columns until the grid has
    EPILOGUE_MIN_PROGRAMS programs where it can: nemotron (21 tiles) T = 1 / 8 / 64, qwen3
    (6 tiles, swiglu) T = 1 / 8 / 64."""
    assert ep.EPILOGUE_MIN_PROGRAMS == 264
    got = [ep.route_tiles_per_program(21, n, 1) for n in (22, 176, 1408)]
    got += [ep.route_tiles_per_program(6, n, 2) for n in (8, 64, 512)]
    assert got == [1, 7, 21, 1, 1, 6]


@pytest.mark.parametrize("activation,split", [("relu2", 1), ("swiglu", 2)])
def test_skip_padding_rows_keeps_the_routed_rows(activation, split, monkeypatch):
    """skip_padding (operand) and sorted_route (epilogue), or the epilogue one program per
    route (route_pos; one and two column tiles per program): the routed rows are bit for bit
    the full kernels' rows; the padding rows are not written (the partials' padding rows hold
    NaN here, as garbage would on the GPU, and no NaN reaches a routed row)."""
    rng = np.random.default_rng(5 + split)
    t, k, e, bm, h, inter = 6, 3, 8, 8, 256, 256
    ids, br, nb = _routing(rng, t, k, e, bm, skew=True)
    hidden = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    g1, g2, a1, _ = _scales(rng, e, "trtllm_cutlass", "scalar")
    kw = {"top_k": k, "block_m": bm, "recipe": "trtllm", "per_expert": False, "interpret": True}
    full = opd.fc1_operand(hidden, br.sorted_route, br.block_expert, br.num_blocks, g1, ieee_div(1.0, g1), **kw)
    skip = opd.fc1_operand(hidden, br.sorted_route, br.block_expert, br.num_blocks, g1, ieee_div(1.0, g1),
                          skip_padding=True, **kw)
    live = np.asarray(br.sorted_route) < t * k
    live[nb * bm:] = False
    assert 0 < live.sum() < nb * bm  # some padding rows inside the valid blocks
    np.testing.assert_array_equal(np.asarray(skip, np.float32)[live], np.asarray(full, np.float32)[live])
    r = 2 * inter if activation == "swiglu" else inter
    part = rng.standard_normal((split, live.size, r + 128)).astype(np.float32)
    part[:, ~live] = np.nan  # what unwritten operand rows would give
    part = jnp.asarray(part)
    ekw = {"inter": inter, "activation": activation, "gate_up_order": "up_gate", "mode": "trtllm_cutlass",
           "recipe": "trtllm", "return_h": True, "interpret": True}
    hv_f, hb_f = ep.fc1_epilogue(jnp.nan_to_num(part), br.block_expert, br.num_blocks, a1, g2,
                                 ieee_div(1.0, g2), **ekw)
    hv_s, hb_s = ep.fc1_epilogue(part, br.block_expert, br.num_blocks, a1, g2, ieee_div(1.0, g2),
                                 sorted_route=br.sorted_route, n_routes=t * k, **ekw)
    with monkeypatch.context() as m:  # each block in programs of 4 rows, padding rows masked
        m.setattr(ep, "epilogue_row_chunk", lambda block_m, halves: 4)
        hv_c, hb_c = ep.fc1_epilogue(part, br.block_expert, br.num_blocks, a1, g2, ieee_div(1.0, g2),
                                     sorted_route=br.sorted_route, n_routes=t * k, **ekw)
    by_route = {"route_pos": br.route_pos, "route_expert": jnp.asarray(ids.reshape(-1), jnp.int32)}
    assert ep.route_tiles_per_program(inter // ep.TILE, t * k, 2 if activation == "swiglu" else 1) == 1
    hv_r, hb_r = ep.fc1_epilogue(part, br.block_expert, br.num_blocks, a1, g2, ieee_div(1.0, g2), **by_route, **ekw)
    monkeypatch.setattr(ep, "EPILOGUE_MIN_PROGRAMS", 1)
    assert ep.route_tiles_per_program(inter // ep.TILE, t * k, 2 if activation == "swiglu" else 1) == 2
    hv_2, hb_2 = ep.fc1_epilogue(part, br.block_expert, br.num_blocks, a1, g2, ieee_div(1.0, g2), **by_route, **ekw)
    for got, want in ((hv_s, hv_f), (hb_s, hb_f), (hv_c, hv_f), (hb_c, hb_f), (hv_r, hv_f), (hb_r, hb_f),
                      (hv_2, hv_f), (hb_2, hb_f)):
        g, w = np.asarray(got, np.float32)[live], np.asarray(want, np.float32)[live]
        assert np.all(np.isfinite(g)) and np.count_nonzero(w) > w.size // 4
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="^sorted_route and n_routes"):
        ep.fc1_epilogue(part, br.block_expert, br.num_blocks, a1, g2, g2, sorted_route=br.sorted_route, **ekw)
    with pytest.raises(ValueError, match="^route_pos and route_expert"):
        ep.fc1_epilogue(part, br.block_expert, br.num_blocks, a1, g2, g2, route_pos=br.route_pos, **ekw)


@pytest.mark.parametrize("e", [5, 128, 512])
@pytest.mark.parametrize("mode,act_scale", [("trtllm_cutlass", "scalar"), ("b12x", "per_expert"),
                                            ("b12x", "scalar")])
def test_scales_kernel_matches_oracle(e, mode, act_scale):
    """moe_scales_kernel (one program, E padded to a power of two) gives the oracle's encode
    scales and alphas bit for bit, and the reciprocals the glue kernels take: weight_scale_2
    from 2^-24 (ModelOpt's folded ~2e-5 and below) to 2^4, input scales over 2^-12..2^8, with
    [E] and scalar operands."""
    rng = np.random.default_rng(e)
    mag = lambda lo, hi: (np.exp2(rng.uniform(lo, hi, e)) * rng.uniform(1, 2, e)).astype(np.float32)
    s2 = np.float32(mag(-12, 8)[0])  # one input scale for every expert
    assert_scales_kernel_is_oracle(mag(-24, 4), mag(-24, 4), mag(-12, 8), s2, e=e, mode=mode,
                                   activation_scale=act_scale)


def assert_scales_kernel_is_oracle(w1, w2, s1, s2, *, e: int, mode: str, activation_scale: str):
    """moe_scales_kernel (interpret mode) == oracle.moe_scales and its reciprocals, bit for
    bit: (g1, 1/g1, alpha1, g2, 1/g2, alpha2), each fp32 [E] and finite."""
    import types

    import oracle
    from oracle.formats import f32_rcp

    stack = lambda w: types.SimpleNamespace(codes=np.zeros((e, 1, 1), np.uint8), decode_scale=w)
    g1, g2, a1, a2 = oracle.moe_scales(stack(w1), stack(w2), s1, s2, mode, activation_scale)
    got = msc.moe_scales_kernel(w1, w2, s1, s2, num_experts=e, mode=mode,
                               activation_scale=activation_scale, interpret=True)
    want = (g1, f32_rcp(g1), a1, g2, f32_rcp(g2), a2)
    for name, gv, wv in zip(("g1", "1/g1", "alpha1", "g2", "1/g2", "alpha2"), got, want, strict=True):
        gv = np.asarray(gv)
        assert gv.shape == (e,) and np.isfinite(gv).all(), name
        np.testing.assert_array_equal(gv.view(np.uint32), np.asarray(wv, np.float32).view(np.uint32), err_msg=name)


def test_scales_kernel_validates_operands():
    with pytest.raises(ValueError, match=r"^fc2_input_scale: expected a scalar or shape \(8,\)"):
        msc.moe_scales_kernel(np.ones(8, np.float32), np.ones(8, np.float32), np.ones(8, np.float32),
                             np.ones(3, np.float32), num_experts=8, mode="b12x",
                             activation_scale="per_expert", interpret=True)


def _layer_stacks(rng, n_layers: int, e: int):
    """Four scale stacks fp32 [L, E] whose layers sit at magnitudes apart (weight_scale_2 from
    2^-24, ModelOpt's folded ~2e-5 and below, to 2^4; input scales over 2^-12..2^8): a read at
    another layer's row changes every value. The fc2 input scale stack is [L], one value per
    layer for every expert."""
    out = []
    for lo, hi in ((-24, 4), (-24, 4), (-12, 8), (-12, 8)):
        base = np.linspace(lo, hi, n_layers)[:, None]  # each layer its own binade band
        out.append((np.exp2(base + rng.uniform(0, 1, (n_layers, e)))
                    * rng.uniform(1, 2, (n_layers, e))).astype(np.float32))
    out[3] = out[3][:, 0].copy()
    return out


@pytest.mark.parametrize("mode,act_scale", [("trtllm_cutlass", "scalar"), ("b12x", "per_expert")])
def test_scale_stacks_read_in_place_at_the_layer(mode, act_scale):
    """With ``layer`` the three scale launches (scales kernel, routing kernel, routing-operand
    kernel) read the four [L, E] / [L] stacks at the layer's row: their six vectors are bit for
    bit those of the layer's slices packed (the form checked against the oracle above), at the
    first, an inner and the last layer, the layer traced too; the routing and the FC1 operand
    are unchanged."""
    rng = np.random.default_rng(11)
    n_layers, t, k, e, h, bm = 5, 2, 6, 24, 256, 8
    stacks = _layer_stacks(rng, n_layers, e)
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32))
    hidden = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    recipe = recipe_of(mode)

    def bits(vs):
        return [np.asarray(v).view(np.uint32) for v in vs]

    for layer in (0, 2, n_layers - 1):
        want = bits(msc.moe_scales_kernel(*(s[layer] for s in stacks), num_experts=e, mode=mode,
                                          activation_scale=act_scale, interpret=True))
        got = msc.moe_scales_kernel(*stacks, num_experts=e, mode=mode, activation_scale=act_scale,
                                    interpret=True, layer=layer)
        traced = jax.jit(lambda lay: msc.moe_scales_kernel(
            *stacks, num_experts=e, mode=mode, activation_scale=act_scale, interpret=True,
            layer=lay))(jnp.int32(layer))
        br, got_r = rtk.routing_kernel(ids, e, bm, scales=(*stacks, mode, act_scale),
                                       interpret=True, layer=jnp.int32(layer))
        br_f, got_f, xp = rtk.routing_operand_kernel(
            ids, hidden, e, bm, (*stacks, mode, act_scale), recipe=recipe, interpret=True,
            layer=jnp.int32(layer))
        br_p, _, xp_p = rtk.routing_operand_kernel(
            ids, hidden, e, bm, (*(s[layer] for s in stacks), mode, act_scale), recipe=recipe,
            interpret=True)
        for name, vs in (("scales", got), ("traced", traced), ("routing", got_r),
                         ("routing_operand", got_f)):
            for i, (g, w) in enumerate(zip(bits(vs), want, strict=True)):
                np.testing.assert_array_equal(g, w, err_msg=f"{name} vector {i} at layer {layer}")
        for name in ("sorted_route", "block_expert", "num_blocks", "route_pos"):
            np.testing.assert_array_equal(np.asarray(getattr(br, name)),
                                          np.asarray(getattr(br_p, name)), err_msg=name)
            np.testing.assert_array_equal(np.asarray(getattr(br_f, name)),
                                          np.asarray(getattr(br_p, name)), err_msg=name)
        live = np.asarray(br_p.route_pos)
        np.testing.assert_array_equal(np.asarray(xp, np.float32)[live].view(np.uint32),
                                      np.asarray(xp_p, np.float32)[live].view(np.uint32))


def test_scale_stacks_are_checked():
    """Stacks that do not fit the experts or one another, and a concrete layer past the
    stacks, are refused naming the argument."""
    e = 8
    st = [np.ones((3, e), np.float32)] * 4
    kw = {"num_experts": e, "mode": "b12x", "activation_scale": "per_expert", "interpret": True}
    with pytest.raises(ValueError, match=r"^fc2_input_scale: expected a stack \[L, 8\] or \[L\]"):
        msc.moe_scales_kernel(*st[:3], np.ones((3, 5), np.float32), layer=0, **kw)
    with pytest.raises(ValueError, match=r"^fc1_input_scale: expected 3 layers"):
        msc.moe_scales_kernel(*st[:2], np.ones((4, e), np.float32), st[3], layer=0, **kw)
    with pytest.raises(ValueError, match=r"^layer: expected 0 <= layer < L = 3, got 3"):
        msc.moe_scales_kernel(*st, layer=3, **kw)
    with pytest.raises(ValueError, match=r"^layer: expected an integer scalar"):
        msc.moe_scales_kernel(*st, layer=jnp.zeros(2, jnp.int32), **kw)
