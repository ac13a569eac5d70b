"""The combine of the Mosaic MoE path: FC2's partials -> the layer output in one Pallas-Triton
launch.

One program per (token, ``combine_width`` columns of H): the token's k route rows as one
[kp, width] gather (positions, experts and router weights loaded, then a CTA barrier, then the
rows: one round trip each), ``* alpha2[e]`` (bf16 in trtllm_cutlass) ``* router weight``, summed
over the routes in fp32 (a tree order; the tests bound it) -> bf16; with a residual, that bf16
sum widened, plus the residual's bf16 value in fp32, -> bf16 (the bits of XLA's ``residual +
out`` on bf16 arrays), so a decoder's residual add needs no launch of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..gemm.mosaic import POST_SCALE
from ..triton_ops import bf16_rne, call, pow2
from .epilogue import TILE, check_prescaled
from .operand import WIDE_THREAD_ELEMS

COMBINE_WIDTH = 64  # columns per combine program
COMBINE_ELEMS = 8  # route-row elements each thread holds: num_warps = kp * width / (32 * 8)


def _combine_kernel(pos_ref, ids_ref, w_ref, part_ref, a2_ref, *refs, split: int, top_k: int,
                    kp: int, mode: str, width: int, interpret: bool, prescaled: bool,
                    has_residual: bool):
    """One token's ``width`` output columns from its ``top_k`` route rows, as one 2-D gather.

    ``refs``: (residual bf16 [T, H], output bf16 [T, H]) with ``has_residual``, else (output,).
    With a residual the route sum is rounded to bf16 (the store without one), widened, added
    to the residual's [width] slice in fp32 and rounded to bf16 (round to nearest even), as XLA
    adds two bf16 arrays.

    The k route rows are read as a single [kp, width] tile (kp: k rounded up to a power of two,
    rows past k masked), so every row load is in flight at once. A version that loaded the k
    rows one by one (scalar positions hoisted) compiled to load/use pairs: ptxas kept ~2 rows
    in flight at 40 registers, and nemotron's T = 8 combine took 11.5 us for 0.7 MB
    (Nsight Compute: 87 % of the cycles stalled on global loads).
    """
    t, c0 = pl.program_id(0), pl.program_id(1) * width
    if has_residual:  # first: no load after the route sum's barriers waits for them
        res_ref, o_ref = refs
        res = plgpu.load(res_ref.at[t, pl.ds(c0, width)]).astype(jnp.float32)
    else:
        (o_ref,) = refs
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
    if has_residual:
        # bf16(f32(residual) + f32(bf16(out))): the layer output's bf16 value, then XLA's bf16 add
        out = res + bf16_rne(out, exact_asm=not interpret)
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
            wide: bool = False, residual: jax.Array | None = None) -> jax.Array:
    """FC2 partials -> the layer output bf16 [T, H] (plus ``residual``, in the same launch).

    part fp32 [split, EM, H_pad] (``mosaic.grouped_matmul``'s output, token-major, times 2^-7),
    or bf16 [1, EM, H_pad]: bf16(alpha2 * acc) as ``grouped_matmul(alpha=a2)`` stores it
    (trtllm_cutlass only; a2 is then unread); route_pos int32 [T*k] (each route's sorted
    row); topk_ids int [T, k] and topk_weights [T, k]; a2 fp32 [E]. ``out[t] = sum_j w[t, j] * (alpha2[e] * acc[route_pos[t*k + j]])``
    (the product bf16-rounded first in trtllm_cutlass), summed over j in fp32 (a tree order:
    the oracle's sum is exact, and the tests bound this one). ``wide``: ``combine_width``
    columns per program instead of COMBINE_WIDTH: fewer programs, the same products, but
    not always the same bits on a GPU: Triton's sum over the k routes follows the tile's
    register layout, so another width may associate it differently (nemotron T = 4096 on
    the H200, width 512 vs 256: up to 3.5e-3 of max |out|); every order stays
    within the tests' bound. ``residual``: None, or bf16 [T, H]: returns ``bf16(f32(residual)
    + f32(out))`` with ``out`` the bf16 layer output, bit for bit XLA's ``residual + out`` on
    the two bf16 arrays (a decoder's residual add, without a launch of its own).
    """
    t, k = topk_weights.shape
    if part.ndim != 3 or hidden % TILE or part.shape[2] < hidden:
        raise ValueError(f"part: expected fp32 [split, EM, H_pad >= H] with H % {TILE} == 0, got "
                         f"{part.shape} for H={hidden}")
    if residual is not None and (residual.shape != (t, hidden) or residual.dtype != jnp.bfloat16):
        raise ValueError(f"residual: expected bfloat16 [T={t}, H={hidden}], got {residual.dtype} "
                         f"{residual.shape}")
    split = part.shape[0]
    prescaled = check_prescaled(part, mode)
    kp = pow2(k)
    width = combine_width(hidden, kp, wide)
    nw = max(1, min(8, kp * width // (32 * COMBINE_ELEMS)))
    kern = functools.partial(_combine_kernel, split=split, top_k=k, kp=kp, mode=mode, width=width,
                             interpret=interpret, prescaled=prescaled,
                             has_residual=residual is not None)
    operands = (route_pos, topk_ids.reshape(-1).astype(jnp.int32),
                topk_weights.reshape(-1).astype(jnp.float32), part, a2)
    if residual is not None:
        operands += (residual,)
    return call(kern, jax.ShapeDtypeStruct((t, hidden), jnp.bfloat16), (t, hidden // width),
                 num_warps=nw, name="nvfp4_moe_combine", interpret=interpret)(*operands)
