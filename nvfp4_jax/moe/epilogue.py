"""The FC1 epilogue of the Mosaic MoE path: one Pallas-Triton launch from FC1's partials to FC2's
operand.

One program per (row block, ``tiles_per_program`` x 128 columns of I; every tile's loads issued
before any arithmetic), or with ``by_route`` one per (route, column group): sum the split-K
partials in index order, ``* alpha1[e]`` (bf16 in trtllm_cutlass), activation
(``triton_ops.fc1_activation``, both halves' tiles for swiglu) -> ``h`` bf16, requantization
with ``G2[e]`` (``triton_ops.requantize``, the recipes' op order with IEEE division) -> the FC2
operand, K-permuted. The arithmetic is ``xla.py``'s op for op; only the fp32 summation order of
the split-K partials is fixed here (index order) where XLA's is unspecified. ``interpret=True``
runs it through Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..gemm.mosaic import POST_SCALE, permute_k_order
from ..triton_ops import call, fc1_activation, requantize

TILE = 128  # columns per program (I and H are multiples of 128 wherever these kernels run)


def check_prescaled(part: jax.Array, mode: str) -> bool:
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


#: fp32 accumulator elements one FC1-epilogue program holds (loaded up front, both halves for
#: swiglu): 4096 over 128 threads is 32 registers.
EPILOGUE_ELEMS = 4096


#: Most partial elements (rows x 128 columns x halves) one FC1-epilogue block program loads:
#: larger blocks are split into programs of fewer rows (``epilogue_row_chunk``). On the H200
#: the relu2 epilogue at 64-row blocks (8192 elements per program) runs at ~3.4 TB/s (nemotron
#: T = 4096: 1.14 GB in 339 us), the swiglu one at 64-row blocks unsplit (16384: 64 fp32
#: values per thread per half at 4 warps) at ~2.5 TB/s (qwen3 T = 4096: ~170 MB in 69 us).
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
#: per program, ``tiles_per_program`` alone gives nemotron T = 1 22 programs of all 21 column
#: tiles each (vs ~154 block programs), and the layer runs 4.6 us slower.
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
            q = requantize(h.astype(jnp.float32).reshape(chunk, TILE // 16, 16), g, rg, recipe, exact_asm)
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
    prescaled = check_prescaled(part, mode)
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
    res = call(kern, tuple(out), (programs * (inter // (TILE * per)),), num_warps=4,
                name="nvfp4_moe_fc1_epilogue", interpret=interpret)(
        route, who, num_blocks, part, a1, g2, rg2)
    return (res[0], res[1]) if return_h else (res[0], None)
