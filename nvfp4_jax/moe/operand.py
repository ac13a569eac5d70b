"""The FC1 operand of the Mosaic MoE path: one Pallas-Triton launch that gathers, quantizes and
K-permutes the routed rows.

The Mosaic grouped GEMM (``mosaic.grouped_matmul``) reads a K-permuted bf16 operand
``[NB*mt, K]``, one row per routed row (sorted by expert, blocks of ``mt`` rows). In XLA the
steps that build it are ~20 small fusions per layer (gathers, 16-wide reductions, the K
permutation); here:

* :func:`fc1_operand`: one program per (sorted row, K tile): gather the row's token from
  ``hidden``, quantize it with the mode's recipe (per-expert or scalar encode scale), store
  ``q * sf`` bf16 in the kernel's K order (``gemm.mosaic.permute_k_order``); zeros on padding
  rows. ``wide`` (``MosaicMoEConfig.wide_glue``, prefill): ``operand_rows`` rows per program.
* :func:`token_operand` (``MosaicMoEConfig.token_quant``): with one encode scale for all
  experts, every token quantized once, then ``fc1_operand`` only gathers the routed rows.

The arithmetic is ``xla.quantized_values``' op for op (``triton_ops.requantize``, IEEE
division). ``interpret=True`` runs the kernels through Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..gemm.mosaic import permute_k_order
from ..triton_ops import call, quantize_codes, requantize, row_tile


def _operand_kernel(route_ref, be_ref, nb_ref, x_ref, g_ref, rg_ref, o_ref, *so_ref, mt: int,
                    top_k: int, n_routes: int, bk: int, recipe: str, per_expert: bool,
                    exact_asm: bool, skip_padding: bool, rows: int = 1, prequantized: bool = False,
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
            if so_ref:  # NVFP4 codes [bk/2] + E4M3 scale bytes [bk/16] (zeros on padding rows)
                c, sb = quantize_codes(x.astype(jnp.float32).reshape(1, bk // 16, 16), g_ref[e],
                                       rg_ref[e], recipe, exact_asm)
                plgpu.store(o_ref.at[p, pl.ds(kt * (bk // 2), bk // 2)],
                            jnp.where(live, c.reshape(bk // 2), 0).astype(jnp.uint8))
                plgpu.store(so_ref[0].at[p, pl.ds(kt * (bk // 16), bk // 16)],
                            jnp.where(live, sb.reshape(bk // 16), 0).astype(jnp.uint8))
                return
            if prequantized:  # the token's row is already quantized and K-permuted
                q = jnp.where(live, x.reshape(rows, bk), 0.0).astype(jnp.bfloat16)
            else:
                x = x.astype(jnp.float32).reshape(rows * bk // 16, 16)
                q = requantize(x, g_ref[e], rg_ref[e], recipe, exact_asm).reshape(rows, bk)
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
    while r > 1 and (block_m % r or r * row_tile(h) > 8 * 32 * WIDE_THREAD_ELEMS):
        r //= 2
    return r


def fc1_operand(hidden: jax.Array, sorted_route: jax.Array, block_expert: jax.Array,
                num_blocks: jax.Array, g1: jax.Array, rg1: jax.Array, *, top_k: int, block_m: int,
                recipe: str, per_expert: bool, skip_padding: bool = False,
                interpret: bool = False, wide: bool = False,
                prequantized: bool = False, num_tokens: int | None = None,
                kernel_name: str | None = None, permute: bool = True,
                codes: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
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
    ``codes`` (with ``permute`` False, one row per program, not prequantized): the NVFP4 operand
    of the FP4-MMA kernels instead, (codes uint8 [EM, H/2], element 2j in the low nibble; E4M3
    scale bytes uint8 [EM, H/16]), zeros on padding rows (``triton_ops.quantize_codes``: the
    same quantization, the oracle's bytes).
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
    if codes and (permute or prequantized or wide):
        raise ValueError("codes: the NVFP4 operand is written in natural K order (permute=False), "
                         "one row per program (wide=False), quantized here (prequantized=False)")
    em = sorted_route.shape[0]
    bk = row_tile(h)
    rows = operand_rows(block_m, h, wide)
    kern = functools.partial(_operand_kernel, mt=block_m, top_k=top_k, n_routes=t * top_k, bk=bk,
                             recipe=recipe, per_expert=per_expert, exact_asm=not interpret,
                             skip_padding=skip_padding, rows=rows, prequantized=prequantized,
                             permute=permute)
    nw = 4 if rows == 1 else max(4, min(8, rows * bk // (32 * WIDE_THREAD_ELEMS)))
    name = kernel_name or ("nvfp4_moe_fc1_gather" if prequantized else "nvfp4_moe_fc1_operand")
    out = jax.ShapeDtypeStruct((em, h), jnp.bfloat16)
    if codes:
        out = (jax.ShapeDtypeStruct((em, h // 2), jnp.uint8),
               jax.ShapeDtypeStruct((em, h // 16), jnp.uint8))
    return call(kern, out, (em // rows, h // bk), num_warps=nw,
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
