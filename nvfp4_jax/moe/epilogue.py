"""Pallas-Triton glue kernels of the Mosaic MoE path: the FC1 operand, the FC1 epilogue, the combine.

The Mosaic grouped GEMM (``mosaic.grouped_matmul``) reads a K-permuted bf16 operand
``[NB*mt, K]`` and writes fp32 partials ``[split, NB*mt, N_pad]``, one row per routed row
(token-major: the kernel transposes its swap-AB accumulator on the way out). Done in XLA, the
steps around it took ~20 small fusions per layer (gathers, 16-wide reductions, the K
permutation, the transposes of the partials): 28-41 us of a 44-75 us decode layer, 160 us of
650 at nemotron T = 64 (bench/NOTES-moe.md, profile of 2026-11-30). Here each step is one
launch that touches only the blocks below ``num_blocks``:

* :func:`fc1_operand`: one program per (sorted row, K tile): gather the row's token from
  ``hidden``, quantize it with the mode's recipe (per-expert or scalar encode scale), store
  ``q * sf`` bf16 in the kernel's K order (``gemm.mosaic.permute_k_order``); zeros on padding rows.
* :func:`fc1_epilogue`: one program per (row block, ``tiles_per_program`` x 128 columns of I;
  every tile's loads issued before any arithmetic): sum the split-K
  partials, ``* alpha1[e]`` (bf16 in trtllm_cutlass), activation (``pallas_triton.fc1_activation``,
  both halves' tiles for swiglu) -> ``h`` bf16, requantization with ``G2[e]``
  (``pallas_triton._requantize``, the recipes' op order with IEEE division) -> the FC2 operand,
  K-permuted.
  With ``wide`` (``MosaicMoEConfig.wide_glue``, prefill): ``operand_rows`` rows per program.
* :func:`combine`: one program per (token, 64 columns of H; ``combine_width`` with ``wide``): the token's k route rows as one
  [kp, 64] gather (positions, experts and router weights loaded, then a CTA barrier, then the
  rows: one round trip each), ``* alpha2[e]`` (bf16 in trtllm_cutlass) ``* router weight``,
  summed over the routes in fp32 (a tree order) -> bf16.
* :func:`routing_kernel` (``MosaicMoEConfig.routing="kernel"``, ``AUTO_SM90`` for qwen3 at
  T <= 8): the block routing of small routings in one launch instead of ~5 XLA fusions
  (H200: -2.2..-3.5 us on qwen3, +7 us on nemotron T = 1).
* ``skip_padding`` (``MosaicMoEConfig.skip_padding``, ``AUTO_SM90`` at T <= 8): the operand and
  epilogue kernels leave the blocks' padding rows unread and unwritten (H200: 0-0.8 us).
* :func:`moe_scales_kernel` (opt-in, ``MosaicMoEConfig.scales="kernel"``): the encode scales
  and alphas in one launch (or inside the routing kernel's), IEEE divisions; passes the
  oracle tests on the H200 (session 10).
* :func:`routing_operand_kernel` (opt-in, ``MosaicMoEConfig.routing="fused"``): routing,
  scales and the FC1 operand's routed rows in one launch; ptxas (pip Triton 3.6, sm_90, 8
  warps): qwen3 T = 1 40 registers, T = 8 128, no spills, only ``div.rn.f32`` divisions.
  Not yet run on a GPU.

The arithmetic is the XLA epilogue's (``mosaic.moe_mosaic`` before; ``xla.py``), op for op;
only the fp32 summation order of the split-K partials is fixed here (index order) where XLA's
reduction order is unspecified; the top-k sum's order is Triton's (the tests bound it). ``interpret=True`` runs them through
Pallas' interpreter (CPU tests; divisions then use ``quantize._div``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..gemm.mosaic import POST_SCALE, permute_k_order
from .pallas_triton import _div_rn, _requantize, bf16_rne, fc1_activation

TILE = 128  # columns per program (I and H are multiples of 128 wherever these kernels run)


def _call(kernel, out_shape, grid, *, num_warps: int, name: str, interpret: bool):
    """``pl.pallas_call`` of one glue kernel (single-stage: no K loop to pipeline)."""
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))


def _pow2(v: int) -> int:
    """Smallest power of two >= v (>= 1): Triton block shapes are powers of two."""
    return 1 << max(0, (v - 1).bit_length())


def _row_tile(h: int) -> int:
    """Largest power of two <= 2048 dividing h: Triton blocks are powers of two (the MoE glue
    has h % 256 == 0; ``gemm.operand`` calls it with K % 16 == 0)."""
    t = 2048
    while h % t:
        t //= 2
    return t


# ----------------------------------------------------------------------------- FC1 operand


def _operand_kernel(route_ref, be_ref, nb_ref, x_ref, g_ref, rg_ref, o_ref, *, mt: int, top_k: int,
                    n_routes: int, bk: int, recipe: str, per_expert: bool, exact_asm: bool,
                    skip_padding: bool, rows: int = 1, prequantized: bool = False,
                    permute: bool = True):
    p, kt = pl.program_id(0), pl.program_id(1)
    b = p * rows // mt  # rows divides mt: a program's rows lie in one block

    @pl.when(b < nb_ref[0])
    def _():
        if rows == 1:
            route = route_ref[p]
        else:  # the program's routes first, then their token rows as one [rows, bk] gather
            route = plgpu.load(route_ref.at[pl.ds(p * rows, rows)])
        e = be_ref[b] if per_expert else 0  # issued before the first use of route
        valid = route < n_routes

        def row():
            tok = jnp.where(valid, route, 0) // top_k
            if rows == 1:
                x = plgpu.load(x_ref.at[tok, pl.ds(kt * bk, bk)])
            else:
                cols = kt * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
                x = plgpu.load(x_ref.at[tok[:, None], cols])
            live = valid if rows == 1 else valid[:, None]
            if prequantized:  # the token's row is already quantized and K-permuted
                q = jnp.where(live, x.reshape(rows, bk), 0.0).astype(jnp.bfloat16)
            else:
                x = x.astype(jnp.float32).reshape(rows * bk // 16, 16)
                q = _requantize(x, g_ref[e], rg_ref[e], recipe, exact_asm).reshape(rows, bk)
                q = jnp.where(live, q, 0.0)
                q = (permute_k_order(q) if permute else q).astype(jnp.bfloat16)
            if rows == 1:
                plgpu.store(o_ref.at[p, pl.ds(kt * bk, bk)], q.reshape(bk))
            else:  # skip_padding: the padding rows' stores masked off
                plgpu.store(o_ref.at[pl.ds(p * rows, rows), pl.ds(kt * bk, bk)], q,
                            mask=valid[:, None] if skip_padding else None)

        if skip_padding and rows == 1:  # padding rows stay unwritten: their GEMM rows are never read
            pl.when(valid)(row)
        else:
            row()


#: Wide glue (``MosaicMoEConfig.wide_glue``): sorted rows per FC1-operand program, and the
#: most elements an FC1-operand or combine thread holds (8 warps).
WIDE_OPERAND_ROWS = 8
WIDE_THREAD_ELEMS = 32


def operand_rows(block_m: int, h: int, wide: bool) -> int:
    """Sorted rows per ``fc1_operand`` program: 1, or with ``wide`` the largest power of two
    <= WIDE_OPERAND_ROWS dividing ``block_m`` whose [rows, H tile] fits 8 warps of
    WIDE_THREAD_ELEMS elements."""
    if not wide:
        return 1
    r = WIDE_OPERAND_ROWS
    while r > 1 and (block_m % r or r * _row_tile(h) > 8 * 32 * WIDE_THREAD_ELEMS):
        r //= 2
    return r


def fc1_operand(hidden: jax.Array, sorted_route: jax.Array, block_expert: jax.Array,
                num_blocks: jax.Array, g1: jax.Array, rg1: jax.Array, *, top_k: int, block_m: int,
                recipe: str, per_expert: bool, skip_padding: bool = False,
                interpret: bool = False, wide: bool = False,
                prequantized: bool = False, num_tokens: int | None = None,
                kernel_name: str | None = None, permute: bool = True) -> jax.Array:
    """The FC1 operand of the grouped kernel, K-permuted: bf16 [EM, H].

    hidden bf16 [T, H] (H % 256 == 0); sorted_route int32 [EM] (sentinel T*k on padding rows);
    block_expert int32 [EM/block_m]; num_blocks int32 [1]; g1 fp32 [E] encode scales and rg1 =
    IEEE 1/g1 (the trtllm recipe's); ``per_expert`` False: every row uses g1[0]. Row ``p``
    holds the quantized ``hidden[sorted_route[p] // top_k]`` as ``q * sf`` (exact in bf16),
    zeros on padding rows (``skip_padding``: padding rows are not written either; nothing
    downstream reads their results); rows of blocks past ``num_blocks`` are not written.
    ``wide``: ``operand_rows`` sorted rows per program (their routes loaded first, then the
    rows as one gather) instead of one: the same values, fewer programs.
    ``prequantized``: ``hidden`` is ``token_operand``'s output (every token's row already
    quantized with the one encode scale and K-permuted, rows padded past T): the kernel only
    gathers rows; per_expert must be False. ``num_tokens``: T when ``hidden`` has more rows.
    ``kernel_name``: the launch's name in profiles (default nvfp4_moe_fc1_operand, or
    nvfp4_moe_fc1_gather when prequantized). ``permute`` False: K in its natural order and
    H % 16 == 0 (the Pallas-Triton grouped kernels' operand, ``pallas_triton.moe_pallas``).
    """
    t, h = hidden.shape
    if h % (256 if permute else 16):
        raise ValueError(f"hidden: expected [T, H] with H % {256 if permute else 16} == 0 (the grouped "
                         f"kernel's K), got {hidden.shape}")
    if prequantized and not permute:
        raise ValueError("permute: prequantized rows are K-permuted already")
    if num_tokens is not None:
        if not 1 <= num_tokens <= t:
            raise ValueError(f"num_tokens: expected 1..{t} (the rows of hidden), got {num_tokens}")
        t = num_tokens
    if prequantized and per_expert:
        raise ValueError("per_expert: prequantized token rows share one encode scale; "
                         "per-expert scales quantize each route with its expert's")
    em = sorted_route.shape[0]
    bk = _row_tile(h)
    rows = operand_rows(block_m, h, wide)
    kern = functools.partial(_operand_kernel, mt=block_m, top_k=top_k, n_routes=t * top_k, bk=bk,
                             recipe=recipe, per_expert=per_expert, exact_asm=not interpret,
                             skip_padding=skip_padding, rows=rows, prequantized=prequantized,
                             permute=permute)
    nw = 4 if rows == 1 else max(4, min(8, rows * bk // (32 * WIDE_THREAD_ELEMS)))
    name = kernel_name or ("nvfp4_moe_fc1_gather" if prequantized else "nvfp4_moe_fc1_operand")
    return _call(kern, jax.ShapeDtypeStruct((em, h), jnp.bfloat16), (em // rows, h // bk), num_warps=nw,
                 name=name, interpret=interpret)(
        sorted_route, block_expert, num_blocks, hidden, g1, rg1)


#: Token rows per ``token_operand`` program block (its output has T rounded up to this).
TOKEN_BLOCK = 8


def token_operand(hidden: jax.Array, g1: jax.Array, rg1: jax.Array, *, recipe: str,
                  interpret: bool = False, wide: bool = False) -> jax.Array:
    """Every token's FC1 input quantized once with the shared encode scale ``g1[0]`` (and
    ``rg1[0]`` = IEEE 1/g1[0]) and K-permuted: bf16 [T rounded up to TOKEN_BLOCK, H], rows past
    T zero. ``fc1_operand(..., prequantized=True, num_tokens=T)`` then gathers the routed rows
    from it: with one encode scale for all experts (``trtllm_cutlass``, or a scalar activation
    scale) a token's k routes quantize to the same row, so this does the quantization T times
    instead of T * k. The same values as ``fc1_operand`` on ``hidden``, bit for bit."""
    t = hidden.shape[0]
    tp = -(-t // TOKEN_BLOCK) * TOKEN_BLOCK
    route = jnp.arange(tp, dtype=jnp.int32)  # rows past T: the sentinel (route >= T routes)
    nb = tp // TOKEN_BLOCK
    return fc1_operand(hidden, route, jnp.zeros((nb,), jnp.int32), jnp.full((1,), nb, jnp.int32),
                       g1, rg1, top_k=1, block_m=TOKEN_BLOCK, recipe=recipe, per_expert=False,
                       interpret=interpret, wide=wide, kernel_name="nvfp4_moe_token_operand")


def _check_prescaled(part: jax.Array, mode: str) -> bool:
    """Whether GEMM partials are the bf16 products bf16(alpha * acc) (True) or fp32 split-K
    partials (False); raises ValueError naming ``part`` for anything else."""
    if part.dtype == jnp.float32:
        return False
    if part.dtype != jnp.bfloat16:
        raise ValueError(f"part: expected float32 partials or bfloat16 products, got {part.dtype}")
    if part.shape[0] != 1:
        raise ValueError(f"part: bf16 products come unsplit ([1, EM, N]), got shape {part.shape}")
    if mode != "trtllm_cutlass":
        raise ValueError(f"part: bf16 products are TensorRT-LLM CUTLASS's rounding point; mode "
                         f"{mode!r} needs fp32 partials")
    return True


# ----------------------------------------------------------------------------- FC1 epilogue

#: fp32 accumulator elements one FC1-epilogue program holds (loaded up front, both halves for
#: swiglu): 4096 over 128 threads is 32 registers.
EPILOGUE_ELEMS = 4096


#: Most partial elements (rows x 128 columns x halves) one FC1-epilogue block program loads:
#: larger blocks are split into programs of fewer rows (``epilogue_row_chunk``). On the H200
#: the relu2 epilogue at 64-row blocks (8192 elements per program) ran at ~3.4 TB/s (nemotron
#: T = 4096, session 13: 1.14 GB in 339 us), the swiglu one at 64-row blocks (16384: 64
#: fp32 values per thread per half at 4 warps) at ~2.5 TB/s (qwen3 T = 4096, session 14: ~170
#: MB in 69 us).
EPILOGUE_LOADED_ELEMS = 8192


def epilogue_row_chunk(block_m: int, halves: int) -> int:
    """Rows per FC1-epilogue block program: ``block_m`` halved (a divisor, >= 8) until a
    program loads at most ``EPILOGUE_LOADED_ELEMS`` partials (one 128-column tile per half).
    Only the row split changes; every row's values are the same."""
    rows = block_m
    while rows > 8 and rows % 2 == 0 and rows * TILE * halves > EPILOGUE_LOADED_ELEMS:
        rows //= 2
    return rows


def tiles_per_program(n_tiles: int, rows: int, halves: int) -> int:
    """Largest divisor d of ``n_tiles`` with ``d * rows * TILE * halves <= EPILOGUE_ELEMS`` (>= 1):
    one program covers d column tiles of its block, so that the per-program latency (the
    scalar loads of num_blocks, the block's expert and its scales) is paid once per d tiles
    and all d tiles' loads are in flight together."""
    best = 1
    for d in range(1, n_tiles + 1):
        if n_tiles % d == 0 and d * rows * TILE * halves <= EPILOGUE_ELEMS:
            best = d
    return best


#: Programs the FC1 epilogue by route aims for (two per SM on the H200's 132): with one row
#: per program, ``tiles_per_program`` alone gave nemotron T = 1 22 programs of all 21 column
#: tiles each (vs ~154 block programs), and the layer ran 4.6 us slower (session 12).
EPILOGUE_MIN_PROGRAMS = 264


def route_tiles_per_program(n_tiles: int, routes: int, halves: int) -> int:
    """Column tiles per program of the FC1 epilogue by route: the largest divisor d of
    ``n_tiles`` that ``tiles_per_program`` allows (one row) and that still makes
    ``routes * n_tiles / d >= EPILOGUE_MIN_PROGRAMS`` programs (1 if none does)."""
    cap = tiles_per_program(n_tiles, 1, halves)
    ok = [d for d in range(1, cap + 1)
          if n_tiles % d == 0 and routes * (n_tiles // d) >= EPILOGUE_MIN_PROGRAMS]
    return max(ok, default=1)


def _fc1_epilogue_kernel(route_ref, be_ref, nb_ref, part_ref, a1_ref, g2_ref, rg2_ref, hv_ref, *h_ref,
                         mt: int, split: int, inter: int, per: int, activation: str,
                         gate_up_order: str, mode: str, recipe: str, exact_asm: bool,
                         n_routes: int | None, prescaled: bool, by_route: bool, chunk: int):
    n_groups = inter // (TILE * per)
    chunks = mt // chunk  # by_route: mt = chunk = 1
    pid = pl.program_id(0)
    bc, c0 = pid // n_groups, pid % n_groups * (TILE * per)
    b, ci = bc // chunks, bc % chunks

    # by_route: program b is route b (route_ref: route_pos, be_ref: the routes' experts), its
    # one row at its sorted position; else rows [ci * chunk, (ci + 1) * chunk) of block b
    # (blocks past num_blocks: nothing)
    def body():
        rows = pl.ds(route_ref[b], 1) if by_route else pl.ds(b * mt + ci * chunk, chunk)
        load_kw, store_kw = {}, {}  # n_routes given: only the block's routed rows are read and written
        if n_routes is not None:  # (never with by_route: fc1_epilogue refuses the pair)
            live = (plgpu.load(route_ref.at[rows]) < n_routes)[:, None]
            load_kw, store_kw = {"mask": live, "other": 0.0}, {"mask": live}

        def acc(col0):  # [mt, TILE] fp32, split-K partials summed in index order
            # (prescaled: bf16(alpha * acc) from the GEMM's store, unsplit, widened here)
            a = plgpu.load(part_ref.at[jnp.int32(0), rows, pl.ds(col0, TILE)], **load_kw)
            a = a.astype(jnp.float32)
            for s in range(1, split):
                a = a + plgpu.load(part_ref.at[jnp.int32(s), rows, pl.ds(col0, TILE)], **load_kw)
            return a

        # loads in issue order (a GPU stalls at the first use of a pending load): the block's
        # expert, every tile's partials (no store in between), then the expert's scales
        e = be_ref[b]
        firsts = [acc(c0 + j * TILE) for j in range(per)]
        seconds = [acc(inter + c0 + j * TILE) if activation == "swiglu" else None for j in range(per)]
        alpha = None if prescaled else a1_ref[e] * POST_SCALE
        g, rg = g2_ref[e], rg2_ref[e]
        for j in range(per):
            cols = pl.ds(c0 + j * TILE, TILE)
            h = fc1_activation(firsts[j], seconds[j], alpha, activation=activation,
                               gate_up_order=gate_up_order, mode=mode, exact_asm=exact_asm)  # bf16 [mt, TILE]
            if h_ref:
                plgpu.store(h_ref[0].at[rows, cols], h, **store_kw)
            q = _requantize(h.astype(jnp.float32).reshape(chunk, TILE // 16, 16), g, rg, recipe, exact_asm)
            plgpu.store(hv_ref.at[rows, cols], permute_k_order(q.reshape(chunk, TILE)).astype(jnp.bfloat16),
                        **store_kw)

    if by_route:
        body()
    else:
        pl.when(b < nb_ref[0])(body)


def fc1_epilogue(part: jax.Array, block_expert: jax.Array, num_blocks: jax.Array, a1: jax.Array,
                 g2: jax.Array, rg2: jax.Array, *, inter: int, activation: str, gate_up_order: str,
                 mode: str, recipe: str, return_h: bool = False, interpret: bool = False,
                 sorted_route: jax.Array | None = None, n_routes: int | None = None,
                 route_pos: jax.Array | None = None, route_expert: jax.Array | None = None):
    """FC1 partials -> the FC2 operand (K-permuted ``q * sf`` bf16 [EM, I]) and, with
    ``return_h``, ``h`` bf16 [EM, I] (natural order).

    ``sorted_route`` int32 [EM] with ``n_routes`` (= T*k, the padding sentinel): padding rows
    are neither read (masked loads: no memory traffic) nor written; without them every row
    of the valid blocks is processed. ``route_pos`` and ``route_expert`` int32 [T*k] (each
    route's sorted row and expert) instead: one program per route and column group, each
    loading only its route's row (``MosaicMoEConfig.epilogue="routes"``); the same values, and
    padding rows are not written either.

    part fp32 [split, EM, R_pad] (``mosaic.grouped_matmul``'s output, token-major, times 2^-7;
    R = I or 2I for swiglu, R_pad >= R; EM = NB * block_m), or bf16 [1, EM, R_pad]: the
    products bf16(alpha1 * acc) that ``grouped_matmul(alpha=a1)`` stores (trtllm_cutlass only:
    its GEMM1 output is bf16; a1 is then unread); block_expert int32 [NB];
    num_blocks int32 [1]; a1, g2, rg2 fp32 [E] (FC1 alpha, FC2 encode scale, IEEE 1/g2).
    I % 128 == 0. Rows of blocks past ``num_blocks`` are not written.
    """
    if part.ndim != 3:
        raise ValueError(f"part: expected fp32 [split, EM, R_pad], got shape {part.shape}")
    split, em, r_pad = part.shape
    prescaled = _check_prescaled(part, mode)
    nb = block_expert.shape[0]
    if inter % TILE or r_pad < (2 * inter if activation == "swiglu" else inter) or em % max(nb, 1):
        raise ValueError(f"part: expected [split, EM = NB*block_m, R_pad >= R] with I % {TILE} == 0 "
                         f"and NB = {nb} blocks, got {part.shape} for I={inter}, {activation}")
    if (sorted_route is None) != (n_routes is None):
        raise ValueError("sorted_route and n_routes: give both (skip padding rows) or neither")
    by_route = route_pos is not None
    if by_route != (route_expert is not None) or (by_route and sorted_route is not None):
        raise ValueError("route_pos and route_expert: give both (one program per route), and "
                         "then not sorted_route")
    mt = 1 if by_route else em // nb
    halves = 2 if activation == "swiglu" else 1
    chunk = 1 if by_route else epilogue_row_chunk(mt, halves)
    per = (route_tiles_per_program(inter // TILE, route_pos.shape[0], halves) if by_route
           else tiles_per_program(inter // TILE, chunk, halves))
    out = [jax.ShapeDtypeStruct((em, inter), jnp.bfloat16)] * (2 if return_h else 1)
    kern = functools.partial(_fc1_epilogue_kernel, mt=mt, split=split, inter=inter, per=per,
                             activation=activation, gate_up_order=gate_up_order, mode=mode,
                             recipe=recipe, exact_asm=not interpret, n_routes=n_routes,
                             prescaled=prescaled, by_route=by_route, chunk=chunk)
    if by_route:
        route, who, programs = route_pos.astype(jnp.int32), route_expert.astype(jnp.int32), route_pos.shape[0]
    else:
        route = sorted_route if sorted_route is not None else jnp.zeros((1,), jnp.int32)  # unread
        who, programs = block_expert, nb * (mt // chunk)
    res = _call(kern, tuple(out), (programs * (inter // (TILE * per)),), num_warps=4,
                name="nvfp4_moe_fc1_epilogue", interpret=interpret)(
        route, who, num_blocks, part, a1, g2, rg2)
    return (res[0], res[1]) if return_h else (res[0], None)


# ----------------------------------------------------------------------------- combine

COMBINE_WIDTH = 64  # columns per combine program
COMBINE_ELEMS = 8  # route-row elements each thread holds: num_warps = kp * width / (32 * 8)


def _combine_kernel(pos_ref, ids_ref, w_ref, part_ref, a2_ref, o_ref, *, split: int, top_k: int,
                    kp: int, mode: str, width: int, interpret: bool, prescaled: bool):
    """One token's ``width`` output columns from its ``top_k`` route rows, as one 2-D gather.

    The k route rows are read as a single [kp, width] tile (kp: k rounded up to a power of two,
    rows past k masked), so every row load is in flight at once. A version that loaded the k
    rows one by one (scalar positions hoisted) compiled to load/use pairs: ptxas kept ~2 rows
    in flight at 40 registers, and nemotron's T = 8 combine took 11.5 us for 0.7 MB
    (Nsight Compute: 87 % of the cycles stalled on global loads).
    """
    t, c0 = pl.program_id(0), pl.program_id(1) * width
    j = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    valid = j < top_k
    r = t * top_k + jnp.minimum(j, top_k - 1)  # gathers, not slices: no read past T*k
    pos = plgpu.load(pos_ref.at[r], mask=valid, other=0)
    ids = plgpu.load(ids_ref.at[r], mask=valid, other=0)
    wts = plgpu.load(w_ref.at[r], mask=valid, other=0.0)
    if not prescaled:
        a2 = plgpu.load(a2_ref.at[ids], mask=valid, other=0.0) * POST_SCALE
    if not interpret:
        # every position (and alpha) has arrived before the first row load: ptxas otherwise
        # chains position -> row -> use per route, a few routes at a time
        plgpu.debug_barrier()
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, width), 1)
    rows = pos[:, None]
    m2 = valid[:, None] & (cols >= 0)
    # prescaled: bf16(alpha2 * acc) from the GEMM's store (TRT-LLM's bf16 GEMM2 output), widened
    d = plgpu.load(part_ref.at[jnp.int32(0), rows, cols], mask=m2, other=0.0).astype(jnp.float32)
    if not prescaled:
        for s in range(1, split):
            d = d + plgpu.load(part_ref.at[jnp.int32(s), rows, cols], mask=m2, other=0.0)
        d = d * a2[:, None]
        if mode == "trtllm_cutlass":  # GEMM2 output is bf16 in TRT-LLM CUTLASS
            d = bf16_rne(d, exact_asm=not interpret)
    out = jnp.sum(d * wts[:, None], axis=0)  # fp32; masked rows add 0
    plgpu.store(o_ref.at[t, pl.ds(c0, width)], out.astype(jnp.bfloat16))


def combine_width(hidden: int, kp: int, wide: bool) -> int:
    """Output columns per combine program: COMBINE_WIDTH (TILE where H is not a multiple of
    it), or with ``wide`` the widest of 128 / 256 / 512 dividing H whose [kp, width] tile fits
    8 warps of WIDE_THREAD_ELEMS elements."""
    width = COMBINE_WIDTH if hidden % COMBINE_WIDTH == 0 else TILE
    if wide:
        for w in (128, 256, 512):
            if hidden % w == 0 and kp * w <= 8 * 32 * WIDE_THREAD_ELEMS:
                width = max(width, w)
    return width


def combine(part: jax.Array, route_pos: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
            a2: jax.Array, *, hidden: int, mode: str, interpret: bool = False,
            wide: bool = False) -> jax.Array:
    """FC2 partials -> the layer output bf16 [T, H].

    part fp32 [split, EM, H_pad] (``mosaic.grouped_matmul``'s output, token-major, times 2^-7),
    or bf16 [1, EM, H_pad]: bf16(alpha2 * acc) as ``grouped_matmul(alpha=a2)`` stores it
    (trtllm_cutlass only; a2 is then unread); route_pos int32 [T*k] (each route's sorted
    row); topk_ids int [T, k] and topk_weights [T, k]; a2 fp32 [E]. ``out[t] = sum_j w[t, j] * (alpha2[e] * acc[route_pos[t*k + j]])``
    (the product bf16-rounded first in trtllm_cutlass), summed over j in fp32 (a tree order:
    the oracle's sum is exact, and the tests bound this one). ``wide``: ``combine_width``
    columns per program instead of COMBINE_WIDTH: fewer programs, the same products, but
    not always the same bits on a GPU: Triton's sum over the k routes follows the tile's
    register layout, so another width may associate it differently (nemotron T = 4096 on
    the H200, width 512 vs 256: up to 3.5e-3 of max |out|, session 16); every order stays
    within the tests' bound.
    """
    t, k = topk_weights.shape
    if part.ndim != 3 or hidden % TILE or part.shape[2] < hidden:
        raise ValueError(f"part: expected fp32 [split, EM, H_pad >= H] with H % {TILE} == 0, got "
                         f"{part.shape} for H={hidden}")
    split = part.shape[0]
    prescaled = _check_prescaled(part, mode)
    kp = _pow2(k)
    width = combine_width(hidden, kp, wide)
    nw = max(1, min(8, kp * width // (32 * COMBINE_ELEMS)))
    kern = functools.partial(_combine_kernel, split=split, top_k=k, kp=kp, mode=mode, width=width,
                             interpret=interpret, prescaled=prescaled)
    return _call(kern, jax.ShapeDtypeStruct((t, hidden), jnp.bfloat16), (t, hidden // width),
                 num_warps=nw, name="nvfp4_moe_combine", interpret=interpret)(
        route_pos, topk_ids.reshape(-1).astype(jnp.int32),
        topk_weights.reshape(-1).astype(jnp.float32), part, a2)


# ----------------------------------------------------------------------------- routing

#: The routing kernels' two methods. "experts" (``_route_positions``): per-expert counts, a
#: cumsum over experts and ranks from one [E, N] one-hot tile, the block experts from an
#: [NB, E] tile; for routings whose tiles (powers of two) have at most
#: ROUTING_KERNEL_MAX_ELEMS elements and at most ROUTING_EXPERTS_MAX experts (qwen3's 128;
#: with nemotron's 512 one such program took ~7 us more than the XLA routing at T = 1,
#: session 8). "routes" (``_route_counts``): no expert dimension at all, every quantity from
#: route-by-route compares in [N, ROUTE_CHUNK] tiles (O(N^2)), the block experts read back
#: from the sorted order; for up to ROUTING_ROUTES_MAX routes (nemotron T = 8: 176).
#: "tokens" (``_route_tokens``): token-major, for top-k routings (the layer's [T, k]): a
#: [T, E] table of how many of each token's routes go to each expert, scattered into a
#: scratch output, then counts, padded starts and each cell's first row from cumsums over
#: that table, written back and gathered per route (a token's duplicate experts, if any, by
#: a [N, k] compare); no O(N^2) term. For tables and [N, k] tiles (powers of two) of at most
#: ROUTING_KERNEL_MAX_ELEMS elements (nemotron up to T = 46), above ROUTES_AUTO_MAX routes.
ROUTING_KERNEL_MAX_ELEMS = 1 << 15
ROUTING_EXPERTS_MAX = 128
ROUTING_ROUTES_MAX = 512
ROUTE_CHUNK = 32
#: Up to how many routes the layer picks the "routes" method by itself (an ``explicit``
#: request takes it up to ROUTING_ROUTES_MAX). It passed its GPU tests in session 12 (H200,
#: nemotron T = 1 / 8 / 23 against ``block_routing``; the layer against the oracle), and in
#: the layer at nemotron T = 1 (22 routes) it saved 5-6 us against the XLA routing (47.5 vs
#: 52.4 us; fused with the FC1 operand 46.4), but at T = 8 (176 routes) it cost 39 us more
#: (220.4 vs 181.7): the routing alone took ~53 us there whatever the warp count, 120 us at
#: 352 routes (bench/routing_probe.py; bench/results/run-h200-session12.log). Its quadratic
#: compares run in 2 x N / 32 dependent chunks, each ending in cross-warp reductions.
ROUTES_AUTO_MAX = 64
#: Whether the layer may pick the "tokens" method by itself (above ROUTING_EXPERTS_MAX experts
#: and ROUTES_AUTO_MAX routes). Written in session 12 after the routes method measured slow at
#: 176 routes; on the H200 it passed its GPU tests (nemotron T = 1 / 8 / 23 / 46 against
#: ``block_routing``, repeats included; the layer against the oracle) and, with the scales in
#: the same launch, took nemotron T = 8 from 182.0 to 180.0 us (median of 3 rounds,
#: 177.1-181.1; bench/results/moe-mosaic-probe-round16-h200.json), output bit for bit the XLA
#: routing's.
TOKENS_METHOD = True
#: Whether the "routes" method goes before "experts" where both take a routing (up to
#: ROUTES_AUTO_MAX routes and ROUTING_EXPERTS_MAX experts: qwen3 up to T = 8). Session 14
#: (H200, bench/moe_mosaic_probe.py --prefer-routes, median of 3 rounds, the layer with the
#: fused routing launch): qwen3 T = 8 69.4 -> 67.3 us (swizzled scales; linear 73.5 -> 71.2),
#: T = 1 26.7 -> 26.2 (26.9 -> 26.5). ptxas sm_90 for the fused launch at T = 8: 64 registers
#: and ~1.4K SASS instructions against 128 and ~3.0K for "experts" (its [E, N] one-hot tiles
#: span all 128 experts; "routes" compares 64 routes pairwise).
PREFER_ROUTES = True


def _route_positions(ids_ref, *, n: int, num_experts: int, block_m: int):
    """The routing's values in registers: (j, valid, pos, padded, pad_end, ep) with pos [np] each
    route's row in the expert-sorted, block-padded order (lanes past n invalid)."""
    np_, ep = _pow2(n), _pow2(num_experts)
    j = lax.broadcasted_iota(jnp.int32, (np_,), 0)
    valid = j < n
    jc = jnp.minimum(j, n - 1)
    ids = jnp.where(valid, plgpu.load(ids_ref.at[jc]), -1)  # -1 matches no expert
    e = lax.broadcasted_iota(jnp.int32, (ep, 1), 0)
    onehot = (e == ids[None, :]).astype(jnp.int32)  # [ep, np]
    counts = jnp.sum(onehot, axis=1)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = jnp.cumsum(padded, axis=0)  # inclusive
    pad_start = pad_end - padded
    earlier = jnp.cumsum(onehot, axis=1) - onehot  # routes of the same expert before j
    rank = jnp.sum(onehot * earlier, axis=0)
    pos = jnp.sum(onehot * pad_start[:, None], axis=0) + rank  # [np]
    return j, valid, pos, padded, pad_end, ep


def _lane_ids(ids_ref, start: int, size: int, n: int, fill: int):
    """(lanes start..start+size-1, their routes' experts; ``fill`` past the n routes)."""
    jj = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
    return jj, jnp.where(jj < n, plgpu.load(ids_ref.at[jnp.minimum(jj, n - 1)]), fill)


def _route_counts(ids_ref, *, n: int):
    """The "routes" method's first pass: (j, valid, ids, rank, count) [np] with each route's
    expert, its rank among the earlier routes of that expert and that expert's route count,
    from [np, ROUTE_CHUNK] compares of every route with each chunk of routes (lanes past n:
    invalid, id -1, count 0)."""
    np_ = _pow2(n)
    c = min(np_, ROUTE_CHUNK)
    j, ids = _lane_ids(ids_ref, 0, np_, n, -1)
    valid = j < n
    rank = jnp.zeros((np_,), jnp.int32)
    count = jnp.zeros((np_,), jnp.int32)
    for c0 in range(0, np_, c):  # static: np_ / c <= 16 chunks
        jj, idc = _lane_ids(ids_ref, c0, c, n, -2)  # -2 matches no lane, valid (-1) or not
        same = ids[:, None] == idc[None, :]  # [np, c]
        count = count + jnp.sum(same.astype(jnp.int32), axis=1)
        rank = rank + jnp.sum((same & (jj[None, :] < j[:, None])).astype(jnp.int32), axis=1)
    return j, valid, ids, rank, count


def _first_padded(valid, rank, count, block_m: int):
    """Each expert's padded row count on its first route's lane, 0 elsewhere: summed over the
    lanes of experts below x, the start of expert x's rows."""
    return jnp.where(valid & (rank == 0), (count + block_m - 1) // block_m * block_m, 0)


def _route_rows(ids_ref, ids, fp, rank, *, n: int, block_m: int):
    """The "routes" method's second pass: every route's sorted row [np], its expert's start
    (sum of ``fp`` over the lanes of lower experts) plus its rank. A lane's ``fp`` cannot be
    sliced out of registers, so each chunk's is recomputed from its routes' compares."""
    np_ = _pow2(n)
    c = min(np_, ROUTE_CHUNK)
    j = lax.broadcasted_iota(jnp.int32, (np_,), 0)
    start = jnp.zeros((np_,), jnp.int32)
    for c0 in range(0, np_, c):
        jj, idc = _lane_ids(ids_ref, c0, c, n, -2)
        vv = jj < n
        same = idc[:, None] == ids[None, :]  # [c, np]
        cnt = jnp.sum(same.astype(jnp.int32), axis=1)
        rk = jnp.sum((same & (j[None, :] < jj[:, None])).astype(jnp.int32), axis=1)
        fpc = _first_padded(vv, rk, cnt, block_m)
        start = start + jnp.sum(jnp.where(idc[None, :] < ids[:, None], fpc[None, :], 0), axis=1)
    return start + rank


def _store_sorted(j, valid, pos, sorted_ref, pos_ref, *, n: int, em: int, interpret: bool):
    """Stores each route's row (``route_pos``) and the inverse permutation (``sorted_route``,
    the sentinel n in padding rows)."""
    emp = _pow2(em)
    # masked lanes index out of range (not clamped): interpret mode drops them, and a clamped
    # duplicate index would race with the valid lane's store
    plgpu.store(pos_ref.at[j], pos, mask=valid)
    pi = lax.broadcasted_iota(jnp.int32, (emp,), 0)
    plgpu.store(sorted_ref.at[pi], jnp.full((emp,), n, jnp.int32), mask=pi < em)  # sentinel n
    if not interpret:
        plgpu.debug_barrier()  # every sentinel is written before any route's row
    plgpu.store(sorted_ref.at[jnp.where(valid, pos, em + j)], j, mask=valid)


def _route_tokens(ids_ref, m_ref, *, n: int, top_k: int, num_experts: int, block_m: int,
                  interpret: bool):
    """The "tokens" method: (j, valid, pos, total blocks) with pos [np] each route's row. ``m_ref``:
    an int32 scratch output of [pow2(T) * pow2(E)] cells (token t, expert x at t * pow2(E) + x)."""
    np_, kp = _pow2(n), _pow2(top_k)
    tp, ep = _pow2(n // top_k), _pow2(num_experts)
    j, ids = _lane_ids(ids_ref, 0, np_, n, -1)
    valid = j < n
    tok = j // top_k
    # each route's token's routes: how many share its expert, how many of those come earlier
    c = lax.broadcasted_iota(jnp.int32, (1, kp), 1)
    jj = tok[:, None] * top_k + c  # [np, kp]
    inrow = (c < top_k) & valid[:, None]
    idt = jnp.where(inrow, plgpu.load(ids_ref.at[jnp.where(inrow, jj, 0)]), -2)
    same = idt == ids[:, None]
    mult = jnp.sum(same.astype(jnp.int32), axis=1)
    dup = jnp.sum((same & (jj < j[:, None])).astype(jnp.int32), axis=1)
    cell = lax.broadcasted_iota(jnp.int32, (tp, 1), 0) * ep + lax.broadcasted_iota(jnp.int32, (1, ep), 1)
    plgpu.store(m_ref.at[cell], jnp.zeros((tp, ep), jnp.int32))
    if not interpret:
        plgpu.debug_barrier()  # the table is zero before any route's count lands
    first = valid & (dup == 0)  # one store per (token, expert); masked lanes index past the end
    mine = tok * ep + ids  # the route's (token, expert) cell
    plgpu.store(m_ref.at[jnp.where(first, mine, tp * ep + j)], mult, mask=first)
    if not interpret:
        plgpu.debug_barrier()
    m = plgpu.load(m_ref.at[cell])  # [tp, ep] routes of token t on expert x
    padded = (jnp.sum(m, axis=0) + block_m - 1) // block_m * block_m
    start = jnp.cumsum(padded, axis=0) - padded
    base = start[None, :] + jnp.cumsum(m, axis=0) - m  # the first row of (t, x)'s routes
    if not interpret:
        plgpu.debug_barrier()  # every thread has read the table before it is overwritten
    plgpu.store(m_ref.at[cell], base)
    if not interpret:
        plgpu.debug_barrier()
    pos = plgpu.load(m_ref.at[jnp.where(valid, mine, 0)]) + dup
    return j, valid, pos, jnp.sum(padded) // block_m


def _store_block_experts(total, ids_ref, sorted_ref, be_ref, nb_ref, *, n: int, num_experts: int,
                         block_m: int, nb: int, interpret: bool):
    """After a CTA barrier, each block's expert read back as the expert of the block's first
    row (always a route: a block starts within its expert's routes), E - 1 past the last block
    (as ``block_routing``), and the block count ``total``."""
    if not interpret:
        plgpu.debug_barrier()  # the sorted order is in memory before it is read back
    nbp = _pow2(nb)
    bi = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    live = bi < total
    row = plgpu.load(sorted_ref.at[jnp.where(live, bi * block_m, 0)])
    bexp = jnp.where(live, plgpu.load(ids_ref.at[jnp.clip(row, 0, n - 1)]), num_experts - 1)
    plgpu.store(be_ref.at[bi], bexp, mask=bi < nb)
    plgpu.store(nb_ref.at[lax.broadcasted_iota(jnp.int32, (1,), 0)], jnp.full((1,), total, jnp.int32))


def _store_routing_routes(j, valid, ids, rank, fp, ids_ref, sorted_ref, be_ref, nb_ref, pos_ref, *,
                          n: int, num_experts: int, block_m: int, nb: int, em: int, interpret: bool):
    """The "routes" method from its first pass's values (``_route_counts``, ``_first_padded``):
    every route's row (``_route_rows``), the rows and the sorted order (``_store_sorted``),
    the block experts and count (``_store_block_experts``)."""
    pos = _route_rows(ids_ref, ids, fp, rank, n=n, block_m=block_m)
    _store_sorted(j, valid, pos, sorted_ref, pos_ref, n=n, em=em, interpret=interpret)
    _store_block_experts(jnp.sum(fp) // block_m, ids_ref, sorted_ref, be_ref, nb_ref, n=n,
                         num_experts=num_experts, block_m=block_m, nb=nb, interpret=interpret)


def _store_routing(route, sorted_ref, be_ref, nb_ref, pos_ref, *, n: int, num_experts: int,
                   block_m: int, nb: int, em: int, interpret: bool):
    """Stores the routing ``route`` (``_route_positions``'s values) as ``BlockRouting``'s arrays."""
    j, valid, pos, padded, pad_end, ep = route
    nbp = _pow2(nb)
    _store_sorted(j, valid, pos, sorted_ref, pos_ref, n=n, em=em, interpret=interpret)
    b = lax.broadcasted_iota(jnp.int32, (nbp, 1), 0) * block_m
    real = lax.broadcasted_iota(jnp.int32, (1, ep), 1) < num_experts
    bexp = jnp.minimum(jnp.sum(((pad_end[None, :] <= b) & real).astype(jnp.int32), axis=1),
                       num_experts - 1)
    bi = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    plgpu.store(be_ref.at[bi], bexp, mask=bi < nb)
    total = jnp.sum(padded) // block_m
    plgpu.store(nb_ref.at[lax.broadcasted_iota(jnp.int32, (1,), 0)], jnp.full((1,), total, jnp.int32))


def _routing_kernel(ids_ref, sorted_ref, be_ref, nb_ref, pos_ref, *scratch, n: int, num_experts: int,
                    block_m: int, nb: int, em: int, interpret: bool, method: str, top_k: int = 0):
    if method == "tokens":
        j, valid, pos, total = _route_tokens(ids_ref, scratch[0], n=n, top_k=top_k,
                                             num_experts=num_experts, block_m=block_m,
                                             interpret=interpret)
        _store_sorted(j, valid, pos, sorted_ref, pos_ref, n=n, em=em, interpret=interpret)
        _store_block_experts(total, ids_ref, sorted_ref, be_ref, nb_ref, n=n,
                             num_experts=num_experts, block_m=block_m, nb=nb, interpret=interpret)
        return
    if method == "routes":
        j, valid, ids, rank, count = _route_counts(ids_ref, n=n)
        _store_routing_routes(j, valid, ids, rank, _first_padded(valid, rank, count, block_m),
                              ids_ref, sorted_ref, be_ref, nb_ref, pos_ref, n=n,
                              num_experts=num_experts, block_m=block_m, nb=nb, em=em,
                              interpret=interpret)
        return
    route = _route_positions(ids_ref, n=n, num_experts=num_experts, block_m=block_m)
    _store_routing(route, sorted_ref, be_ref, nb_ref, pos_ref, n=n, num_experts=num_experts,
                   block_m=block_m, nb=nb, em=em, interpret=interpret)


def _routing_plan(topk_ids: jax.Array, num_experts: int, block_m: int, interpret: bool,
                  method: str | None = None, tokens: bool = True):
    """(flat int32 routes, the routing kernels' static arguments, their int32 outputs' shapes:
    BlockRouting's four, then the "tokens" method's scratch table) for a routing
    ``routing_kernel_fits`` takes; ValueError naming topk_ids if not. ``method``: one of
    ``routing_methods`` (it must fit), None: its first; ``tokens``: whether "tokens" may be."""
    from .routing import max_blocks

    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [T, k] expert ids, got shape {topk_ids.shape}")
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    n, top_k = flat.shape[0], topk_ids.shape[1]
    fits = routing_methods(n, num_experts, block_m, top_k=top_k if tokens else None,
                           explicit=method is not None)
    if not fits or (method is not None and method not in fits):
        raise ValueError(f"topk_ids: {n} routes over {num_experts} experts are too many for the "
                         f"one-program routing kernel ({method or 'any'} method, "
                         f"routing_kernel_fits); use block_routing")
    nb = max_blocks(n, num_experts, block_m)
    em = nb * block_m
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    kw = {"n": n, "num_experts": num_experts, "block_m": block_m, "nb": nb, "em": em,
          "interpret": interpret, "method": method or fits[0]}
    outs = (i32(em), i32(nb), i32(1), i32(n))
    if kw["method"] == "tokens":
        kw["top_k"] = top_k
        outs += (i32(_pow2(n // top_k) * _pow2(num_experts)),)
    return flat, kw, outs


def _scales_plan(scales: tuple, num_experts: int, interpret: bool):
    """``(fc1_weight_scale_2, fc2_weight_scale_2, fc1_input_scale, fc2_input_scale, mode,
    activation_scale)`` -> (the four validated operands, ``_scale_values``' static arguments,
    the six fp32 [E] outputs' shapes)."""
    *vecs, mode, activation_scale = scales
    kw = {"e": num_experts, "activation_scale": activation_scale, "mode": mode,
          "exact_asm": not interpret}
    f32 = jax.ShapeDtypeStruct((num_experts,), jnp.float32)
    return _scale_operands(vecs, num_experts), kw, (f32,) * 6


def routing_methods(n_routes: int, num_experts: int, block_m: int, *, top_k: int | None = None,
                    explicit: bool = False) -> tuple[str, ...]:
    """The routing kernels' methods that take this routing, the default first: "routes" up to
    ROUTES_AUTO_MAX routes (ROUTING_ROUTES_MAX for an ``explicit`` request; after "experts"
    above ROUTES_AUTO_MAX or with PREFER_ROUTES off), "experts" up to ROUTING_EXPERTS_MAX
    experts when its tiles fit, "tokens" for a [T, top_k] routing (None: not offered, e.g. for
    the fused launch) when its tiles fit and TOKENS_METHOD is on (or the request is
    ``explicit``)."""
    from .routing import max_blocks

    nb = max_blocks(n_routes, num_experts, block_m)
    out = []
    if (num_experts <= ROUTING_EXPERTS_MAX
            and _pow2(num_experts) * max(_pow2(n_routes), _pow2(nb)) <= ROUTING_KERNEL_MAX_ELEMS):
        out.append("experts")
    if n_routes <= (ROUTING_ROUTES_MAX if explicit else min(ROUTES_AUTO_MAX, ROUTING_ROUTES_MAX)):
        if PREFER_ROUTES and n_routes <= ROUTES_AUTO_MAX:
            out.insert(0, "routes")
        else:
            out.append("routes")
    if (top_k is not None and (TOKENS_METHOD or explicit) and n_routes % top_k == 0
            and _pow2(n_routes // top_k) * _pow2(num_experts) <= ROUTING_KERNEL_MAX_ELEMS
            and _pow2(n_routes) * _pow2(top_k) <= ROUTING_KERNEL_MAX_ELEMS):
        out.append("tokens")
    return tuple(out)


#: Warps of the one-program routing kernel per (method, routes padded to a power of two); a
#: dict so bench/routing_probe.py can time others. The routes method's [N, 32] tiles: 8 warps
#: from 128 routes (ptxas sm_90 at nemotron T = 8, 176 routes: 248 registers with 4 warps).
ROUTING_WARPS: dict = {}


def routing_warps(method: str, n_routes: int) -> int:
    """The routing kernel's num_warps (``ROUTING_WARPS`` overrides the default; the tokens
    method: ~64 elements of its [N, 32] compare tile per thread, 4 to 16 warps)."""
    np_ = _pow2(n_routes)
    default = {"routes": 8 if np_ >= 128 else 4, "tokens": max(4, min(16, np_ // 64))}.get(method, 4)
    return ROUTING_WARPS.get((method, np_), default)


def routing_kernel_fits(n_routes: int, num_experts: int, block_m: int, *,
                        top_k: int | None = None) -> bool:
    """Whether ``routing_kernel`` takes this routing (one of its methods fits one program;
    ``top_k``: as ``routing_methods``)."""
    return bool(routing_methods(n_routes, num_experts, block_m, top_k=top_k))


def routing_kernel(topk_ids: jax.Array, num_experts: int, block_m: int, *,
                   scales: tuple | None = None, interpret: bool = False, method: str | None = None):
    """``routing.block_routing`` as one Pallas-Triton launch (one program) instead of ~5 XLA
    fusions: counts, padded cumsum and each route's rank among its expert's routes from an
    [E, N] one-hot tile, the block experts from an [NB, E] compare tile, the inverse
    permutation as sentinel stores, a CTA barrier, then one scatter. Same outputs, bit for bit
    (integers). For small routings only (``routing_kernel_fits``). ``method``: "experts",
    "routes" or "tokens" (ROUTING_EXPERTS_MAX's comment), None: the first of ``routing_methods``.

    scales: None, or ``(fc1_weight_scale_2, fc2_weight_scale_2, fc1_input_scale,
    fc2_input_scale, mode, activation_scale)``: the same program also computes
    ``moe_scales_kernel``'s six vectors (one launch for both), returned after the routing:
    ``(BlockRouting, (g1, 1/g1, alpha1, g2, 1/g2, alpha2))``."""
    from .routing import BlockRouting

    flat, rkw, outs = _routing_plan(topk_ids, num_experts, block_m, interpret, method)
    kern = functools.partial(_routing_kernel, **rkw)
    nw = routing_warps(rkw["method"], rkw["n"])
    nr = len(outs)  # BlockRouting's four arrays, then any scratch
    if scales is None:
        res = _call(kern, outs, (1,), num_warps=nw, name="nvfp4_moe_routing", interpret=interpret)(flat)
        return BlockRouting(*res[:4])
    ops, skw, souts = _scales_plan(scales, num_experts, interpret)

    def both(ids_ref, w1_ref, w2_ref, s1_ref, s2_ref, *refs):
        _scales_kernel(w1_ref, w2_ref, s1_ref, s2_ref, *refs[nr:], **skw)
        kern(ids_ref, *refs[:nr])

    res = _call(both, (*outs, *souts), (1,), num_warps=nw, name="nvfp4_moe_routing_scales",
                interpret=interpret)(flat, *ops)
    return BlockRouting(*res[:4]), tuple(res[nr:])


def _routing_operand_kernel(ids_ref, w1_ref, w2_ref, s1_ref, s2_ref, x_ref, srt_ref, be_ref, nb_ref,
                            pos_ref, *rest, routing_kw: dict, scales_kw: dict, top_k: int, bk: int,
                            recipe: str, per_expert: bool, exact_asm: bool):
    scale_refs, xp_ref = rest[:6], rest[6]
    r, kt = pl.program_id(0), pl.program_id(1)
    # every program computes the routing and the scales (a few thousand register ops; no
    # second launch, no wait for another program's stores); program (0, 0) also stores them
    kw = {k: v for k, v in routing_kw.items() if k != "method"}
    n, bm = kw["n"], kw["block_m"]
    je, evalid, vals = _scale_values(w1_ref, w2_ref, s1_ref, s2_ref, **scales_kw)
    if routing_kw["method"] == "routes":  # this route's row from the first pass alone
        j, valid, ids, rank, count = _route_counts(ids_ref, n=n)
        fp = _first_padded(valid, rank, count, bm)
        mine = j == r
        row = (jnp.sum(jnp.where(ids < jnp.sum(jnp.where(mine, ids, 0)), fp, 0))
               + jnp.sum(jnp.where(mine, rank, 0)))

        @pl.when((r == 0) & (kt == 0))
        def _():
            _store_routing_routes(j, valid, ids, rank, fp, ids_ref, srt_ref, be_ref, nb_ref, pos_ref,
                                  **kw)
            _store_scales(je, evalid, vals, scale_refs)
    else:
        route = _route_positions(ids_ref, n=n, num_experts=kw["num_experts"], block_m=bm)

        @pl.when((r == 0) & (kt == 0))
        def _():
            _store_routing(route, srt_ref, be_ref, nb_ref, pos_ref, **kw)
            _store_scales(je, evalid, vals, scale_refs)

        j, pos = route[0], route[2]
        row = jnp.sum(jnp.where(j == r, pos, 0))  # this program's route's sorted row
    ex = plgpu.load(ids_ref.at[r]) if per_expert else 0
    g, rg = (jnp.sum(jnp.where(je == ex, v, 0.0)) for v in vals[:2])  # one lane each: exact
    x = plgpu.load(x_ref.at[r // top_k, pl.ds(kt * bk, bk)]).astype(jnp.float32)
    q = _requantize(x.reshape(bk // 16, 16), g, rg, recipe, exact_asm)
    plgpu.store(xp_ref.at[row, pl.ds(kt * bk, bk)], permute_k_order(q.reshape(bk)).astype(jnp.bfloat16))


def routing_operand_kernel(topk_ids: jax.Array, hidden: jax.Array, num_experts: int, block_m: int,
                           scales: tuple, *, recipe: str, interpret: bool = False,
                           method: str | None = None):
    """``routing_kernel(scales=...)`` and ``fc1_operand(skip_padding=True)`` as one launch
    (``MosaicMoEConfig.routing="fused"``): one program per (route, K tile of ``hidden``) stores
    its route's quantized row at the route's sorted position; program (0, 0) also stores the
    routing and the six scale vectors. Each program recomputes the routing positions and the
    scales in registers (small routings only, ``routing_kernel_fits``), so nothing waits for
    another program. Bit for bit the two kernels' outputs; padding rows are not written.

    topk_ids int [T, k]; hidden bf16 [T, H] (H % 256 == 0); scales: ``(fc1_weight_scale_2,
    fc2_weight_scale_2, fc1_input_scale, fc2_input_scale, mode, activation_scale)``; recipe:
    the FC1 operand's quantization recipe. Returns ``(BlockRouting, (g1, 1/g1, alpha1, g2,
    1/g2, alpha2), xp bf16 [EM, H])``. ``method``: as ``routing_kernel``'s (with "routes" each
    program needs only the first pass; program (0, 0) makes the second)."""
    from .routing import BlockRouting

    t, h = hidden.shape
    if h % 256:
        raise ValueError(f"hidden: expected [T, H] with H % 256 == 0 (the grouped kernel's K), got {hidden.shape}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected [T, k] with T = {t} (hidden's rows), got {topk_ids.shape}")
    flat, rkw, outs = _routing_plan(topk_ids, num_experts, block_m, interpret, method,
                                    tokens=False)  # each program needs its row alone
    ops, skw, souts = _scales_plan(scales, num_experts, interpret)
    bk = _row_tile(h)
    kern = functools.partial(
        _routing_operand_kernel, routing_kw=rkw, scales_kw=skw, top_k=topk_ids.shape[1], bk=bk,
        recipe=recipe, per_expert=scales[-1] == "per_expert", exact_asm=not interpret)
    srt, be, nbk, pos, *sv, xp = _call(
        kern, (*outs, *souts, jax.ShapeDtypeStruct((rkw["em"], h), jnp.bfloat16)),
        (rkw["n"], h // bk), num_warps=8, name="nvfp4_moe_routing_operand", interpret=interpret)(
        flat, *ops, hidden)
    return BlockRouting(srt, be, nbk, pos), tuple(sv), xp


# ----------------------------------------------------------------------------- scales


def _scale_values(w1_ref, w2_ref, s1_ref, s2_ref, *, e: int, activation_scale: str, mode: str,
                  exact_asm: bool):
    """(j, valid, [g1, 1/g1, alpha1, g2, 1/g2, alpha2]): the six [E] scale vectors in registers
    (lanes past E invalid)."""
    ep = _pow2(e)
    j = lax.broadcasted_iota(jnp.int32, (ep,), 0)
    valid = j < e
    jc = jnp.minimum(j, e - 1)

    def vec(ref):  # an [E] operand, or a [1] one broadcast to every expert
        return plgpu.load(ref.at[jc if ref.shape[0] == e else jnp.zeros_like(j)])

    one = jnp.ones((ep,), jnp.float32)
    vals = []
    for w_ref, s_ref in ((w1_ref, s1_ref), (w2_ref, s2_ref)):
        ws2, s_in = vec(w_ref), vec(s_ref)
        if activation_scale == "scalar":  # one encode scale: 1 / max over the experts' input scales
            m = jnp.max(jnp.where(valid, s_in, -jnp.inf))
            g = _div_rn(one, jnp.full((ep,), m, jnp.float32), exact_asm)
        else:
            g = _div_rn(one, s_in, exact_asm)
        if mode == "trtllm_cutlass":
            alpha = _div_rn(one, g * _div_rn(one, ws2, exact_asm), exact_asm)
        else:
            alpha = _div_rn(ws2, g, exact_asm)
        vals += [g, _div_rn(one, g, exact_asm), alpha]
    return j, valid, vals


def _store_scales(j, valid, vals, out_refs) -> None:
    """Stores ``_scale_values``' six vectors."""
    for ref, v in zip(out_refs, vals, strict=True):
        # masked lanes index past E (not clamped: a duplicate index would race with the valid
        # lane's store; interpret mode drops them)
        plgpu.store(ref.at[j], v, mask=valid)


def _scales_kernel(w1_ref, w2_ref, s1_ref, s2_ref, *out_refs, e: int, activation_scale: str,
                   mode: str, exact_asm: bool):
    _store_scales(*_scale_values(w1_ref, w2_ref, s1_ref, s2_ref, e=e, activation_scale=activation_scale,
                                 mode=mode, exact_asm=exact_asm), out_refs)


def moe_scales_kernel(fc1_weight_scale_2: jax.Array, fc2_weight_scale_2: jax.Array,
                      fc1_input_scale: jax.Array, fc2_input_scale: jax.Array, *, num_experts: int,
                      mode: str, activation_scale: str, interpret: bool = False):
    """``xla.moe_scales`` plus the two reciprocals the glue kernels take, as one Pallas-Triton
    launch (one program) instead of ~8 small XLA fusions, each division ``div.rn.f32`` (IEEE,
    whatever XLA's division flags). Operands: fp32 [E] or scalars (one value for every
    expert). Returns fp32 [E] each: ``(g1, 1/g1, alpha1, g2, 1/g2, alpha2)``, bit for bit the
    expressions of ``oracle.moe_scales``."""
    ops, kw, outs = _scales_plan((fc1_weight_scale_2, fc2_weight_scale_2, fc1_input_scale,
                                  fc2_input_scale, mode, activation_scale), num_experts, interpret)
    return _call(functools.partial(_scales_kernel, **kw), outs, (1,), num_warps=4,
                 name="nvfp4_moe_scales", interpret=interpret)(*ops)


def _scale_operands(vecs, e: int) -> list:
    """The four scale operands as fp32 [E] or [1] (one value for every expert), validated."""
    ops = []
    names = ("fc1_weight_scale_2", "fc2_weight_scale_2", "fc1_input_scale", "fc2_input_scale")
    for name, v in zip(names, vecs, strict=True):
        v = jnp.asarray(v, jnp.float32)
        if v.shape not in ((), (1,), (e,)):
            raise ValueError(f"{name}: expected a scalar or shape ({e},), got {v.shape}")
        ops.append(v.reshape(-1))
    return ops
