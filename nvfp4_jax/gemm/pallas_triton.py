"""NVFP4-weight GEMM as a Pallas kernel with the Triton lowering (H200 now, SM12x later).

``out[M, N] = alpha * x[M, K] @ W[N, K]^T`` with ``W = e2m1 * e4m3`` (NVFP4 codes + 16-wide
E4M3 block scales) and ``x`` bf16. W4A4 uses the same kernel: a dequantized NVFP4 activation is
exact in bf16 (see api.py).

Kernel (``_gemm_kernel``), one screen:

* grid ``(cdiv(M, BM) * cdiv(N, BN), split_k)``; the first axis is walked in groups of
  ``group_m`` M-tiles (Triton's L2 swizzle) so that concurrently running programs share W tiles;
* swap-AB: the accumulator is ``[BN, BM]`` (weights in the MMA's M slot, tokens in N), so
  M = 1..16 pads to a 16-wide MMA instead of 64;
* K loop (``lax.fori_loop`` -> ``scf.for``, software-pipelined with ``num_stages``) over BK:
  load codes uint8 ``[BN, BK/16, 8]`` and scales ``[BN, BK/16]``, decode to two bf16 tiles
  (even and odd K elements, decode.py), and do two bf16 MMAs against ``x_even``/``x_odd``
  ``[BM, BK/2]`` (x split into even/odd columns in XLA, so no nibble interleave in the kernel);
* split-K: each ``split_k`` program owns a contiguous range of K tiles and writes fp32 partials
  ``[split_k, M, N]`` that XLA sums; with ``split_k == 1`` the kernel applies alpha and casts.
* ragged edges: every load and store is masked (M, N, and K multiple of 16 but not of BK).

``dequantize_pallas`` is the same decode writing bf16 ``W[N, K]`` once, for the large-M path
(dequantize once, then cuBLAS).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .decode import check_tile_config, decode_block, post_scale


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile configuration of one kernel launch (all sizes powers of two).

    block_m: tokens per tile (MMA N slot, >= 16). block_n: output features per tile (MMA M slot).
    block_k: K elements per loop step (>= 32). split_k: K ranges run by separate programs.
    algo: "fused" (this kernel) or "dequant_dot" (dequantize W to bf16 once, then jnp.dot).
    measured: provenance of a tuning-table entry (``configs.TUNED``); ignored by ``==``.
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    decode: str = "asm"
    algo: str = "fused"
    load2d: bool = False  # load codes as a 2-D [BN, BK/2] tile (wider vector loads), then reshape
    measured: str = dataclasses.field(default="", compare=False)  # a tuning entry's provenance

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_m", "block_n", "block_k", "split_k", "num_warps", "group_m"))
        if self.algo not in ("fused", "dequant_dot"):
            raise ValueError(f"Config.algo: expected 'fused' or 'dequant_dot', got {self.algo!r}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gemm_kernel(
    xe_ref,
    xo_ref,
    c_ref,
    s_ref,
    alpha_ref,
    *refs,
    cfg: Config,
    M: int,
    N: int,
    K: int,
    tiles_per_split: int,
    partial: bool,
    stacked: bool,
):
    o_ref = refs[-1]  # refs = ([row0_ref,] [poisoned_out_alias,] o_ref)
    # a stack's layer: W's rows start at row0 of the flattened [L * N, ...] codes and scales
    w0 = refs[0][0] if stacked else 0
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    BKB, BK2 = BK // 16, BK // 2
    KB, K2 = K // 16, K // 2
    num_m, num_n = _cdiv(M, BM), _cdiv(N, BN)

    # L2-friendly walk: group_m consecutive M tiles share each W tile.
    pid = pl.program_id(0)
    pid_k = pl.program_id(1)
    group = min(cfg.group_m, num_m)
    in_group = group * num_n
    first_m = (pid // in_group) * group
    gsz = jnp.minimum(num_m - first_m, group)
    pid_m = first_m + (pid % in_group) % gsz
    pid_n = (pid % in_group) // gsz

    m0 = pid_m * BM
    n0 = pid_n * BN
    m_mask = (m0 + jnp.arange(BM)) < M
    n_mask = (n0 + jnp.arange(BN)) < N

    def body(i, acc):
        kb0 = (pid_k * tiles_per_split + i) * BKB
        kb_mask = (kb0 + jnp.arange(BKB)) < KB
        w_mask = n_mask[:, None] & kb_mask[None, :]
        k2_mask = n_mask[:, None] & ((kb0 * 8 + jnp.arange(BK2)) < K2)[None, :]
        if cfg.load2d:
            codes = plgpu.load(
                c_ref.at[pl.ds(w0 + n0, BN), pl.ds(kb0 * 8, BK2)], mask=k2_mask, other=0
            ).reshape(BN, BKB, 8)
        else:
            codes = plgpu.load(
                c_ref.at[pl.ds(w0 + n0, BN), pl.ds(kb0, BKB), :], mask=w_mask[:, :, None],
                other=0)
        scales = plgpu.load(s_ref.at[pl.ds(w0 + n0, BN), pl.ds(kb0, BKB)], mask=w_mask,
                            other=0)
        w_even, w_odd, _ = decode_block(codes, scales, cfg.decode, xe_ref.dtype)
        x_mask = m_mask[:, None] & ((kb0 * 8 + jnp.arange(BK2)) < K2)[None, :]
        xe = plgpu.load(xe_ref.at[pl.ds(m0, BM), pl.ds(kb0 * 8, BK2)], mask=x_mask, other=0)
        xo = plgpu.load(xo_ref.at[pl.ds(m0, BM), pl.ds(kb0 * 8, BK2)], mask=x_mask, other=0)
        dims = (((1,), (1,)), ((), ()))
        acc = acc + lax.dot_general(
            w_even.reshape(BN, BK2), xe, dims, preferred_element_type=jnp.float32
        )
        acc = acc + lax.dot_general(
            w_odd.reshape(BN, BK2), xo, dims, preferred_element_type=jnp.float32
        )
        return acc

    acc = lax.fori_loop(0, tiles_per_split, body, jnp.zeros((BN, BM), jnp.float32))
    out_mask = m_mask[:, None] & n_mask[None, :]
    if partial:
        plgpu.store(o_ref.at[pid_k, pl.ds(m0, BM), pl.ds(n0, BN)], acc.T, mask=out_mask)
    else:
        out = (acc * alpha_ref[0]).astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(m0, BM), pl.ds(n0, BN)], out.T, mask=out_mask)


def split_even_odd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x[M, K] -> (x[:, 0::2], x[:, 1::2]), the operands the kernel pairs with low/high nibbles."""
    return x[:, 0::2], x[:, 1::2]


def matmul_pallas(
    x: jax.Array,
    w_codes: jax.Array,
    w_scales: jax.Array,
    alpha: jax.Array | float,
    *,
    out_dtype=jnp.bfloat16,
    config: Config = Config(),
    interpret: bool = False,
    x_even_odd: tuple[jax.Array, jax.Array] | None = None,
    poison: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """``alpha * x @ W^T`` with fp32 accumulation.

    x: bf16 [M, K] (or pass ``x_even_odd`` = (x[:, 0::2], x[:, 1::2]) bf16 [M, K/2] and x=None).
    w_codes: uint8 [N, K/2] (element 2j in the low nibble). w_scales: E4M3 [N, K/16], as
    float8_e4m3fn or raw uint8 bytes, linear layout. Or, with ``layer`` (an int32 scalar), a
    stack of L such weights, [L, N, K/2] and [L, N, K/16], of which the kernel reads layer
    ``layer`` in place (a scan's loop-invariant stack: no per-layer slice to copy).
    alpha: fp32 scalar (weight_scale_2, or input_scale * weight_scale_2 for W4A4). Returns
    out_dtype [M, N].
    poison: tests only: the kernel writes into a NaN-filled buffer (input_output_aliases), so
    any tile it fails to write shows up as NaN.
    """
    if x_even_odd is None:
        xe, xo = split_even_odd(x)
    else:
        xe, xo = x_even_odd
    M, K2 = xe.shape
    N = w_codes.shape[-2]
    K = 2 * K2
    lead = w_codes.shape[:-2]
    if (len(lead) != (layer is not None) or w_codes.shape != lead + (N, K2)
            or w_scales.shape != lead + (N, K // 16)):
        raise ValueError(f"w: codes {w_codes.shape} / scales {w_scales.shape} do not match K={K}"
                         + (" and a stack [L, N, ...] with layer" if layer is not None else ""))
    if w_scales.dtype != jnp.uint8:
        w_scales = lax.bitcast_convert_type(w_scales, jnp.uint8)
    cfg = config
    if layer is not None and cfg.algo == "dequant_dot":  # large M: the slice costs little
        w_codes, w_scales, layer = w_codes[layer], w_scales[layer], None
    if layer is not None:  # flatten the stack; the kernel starts at row layer * N
        w_codes, w_scales = w_codes.reshape(-1, K2), w_scales.reshape(-1, K // 16)
    codes3 = w_codes if cfg.load2d else w_codes.reshape(-1, K // 16, 8)
    op_dtype = jnp.float16 if (x if x is not None else xe).dtype == jnp.float16 else jnp.bfloat16
    # the decode may hand the MMA e2m1*e4m3 / 2^j (decode.py); fold 2^j into alpha (exact)
    alpha_arr = (jnp.asarray(alpha, jnp.float32) * post_scale(cfg.decode, op_dtype)).reshape(1)
    if cfg.algo == "dequant_dot":
        x_full = x if x is not None else jnp.stack([xe, xo], -1).reshape(M, K)
        alpha_arr = jnp.asarray(alpha, jnp.float32).reshape(1)
        w = dequantize_pallas(w_codes, w_scales, config=cfg, interpret=interpret, dtype=op_dtype)
        acc = jnp.dot(x_full.astype(op_dtype), w.T, preferred_element_type=jnp.float32)
        return (acc * alpha_arr[0]).astype(out_dtype)

    num_tiles = _cdiv(K, cfg.block_k)
    tiles_per_split = _cdiv(num_tiles, cfg.split_k)
    split = _cdiv(num_tiles, tiles_per_split)
    partial = split > 1
    out_shape = (
        jax.ShapeDtypeStruct((split, M, N), jnp.float32)
        if partial
        else jax.ShapeDtypeStruct((M, N), out_dtype)
    )
    kernel = functools.partial(
        _gemm_kernel, cfg=cfg, M=M, N=N, K=K, tiles_per_split=tiles_per_split, partial=partial,
        stacked=layer is not None)
    grid = (_cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n), split)
    args = [xe.astype(op_dtype), xo.astype(op_dtype), codes3, w_scales, alpha_arr]
    if layer is not None:
        args.append((jnp.asarray(layer, jnp.int32) * N).reshape(1))
    aliases = {}
    if poison:
        args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        aliases = {len(args) - 1: 0}
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nvfp4_gemm",
    )(*args)
    if partial:
        out = (out.sum(axis=0) * alpha_arr[0]).astype(out_dtype)
    return out


def _dequant_kernel(c_ref, s_ref, o_ref, *, N: int, K: int, bn: int, bk: int, decode: str):
    BKB = bk // 16
    n0 = pl.program_id(0) * bn
    kb0 = pl.program_id(1) * BKB
    mask = ((n0 + jnp.arange(bn)) < N)[:, None] & ((kb0 + jnp.arange(BKB)) < K // 16)[None, :]
    codes = plgpu.load(c_ref.at[pl.ds(n0, bn), pl.ds(kb0, BKB), :], mask=mask[:, :, None], other=0)
    scales = plgpu.load(s_ref.at[pl.ds(n0, bn), pl.ds(kb0, BKB)], mask=mask, other=0)
    even, odd, post = decode_block(codes, scales, decode, o_ref.dtype)
    if post != 1.0:  # exact power-of-two rescale back to e2m1 * e4m3
        even = (even.astype(jnp.float32) * post).astype(o_ref.dtype)
        odd = (odd.astype(jnp.float32) * post).astype(o_ref.dtype)
    w = jnp.stack([even, odd], axis=-1).reshape(bn, bk)  # tt.join: element 2j, 2j+1
    out_mask = ((n0 + jnp.arange(bn)) < N)[:, None] & ((kb0 * 16 + jnp.arange(bk)) < K)[None, :]
    plgpu.store(o_ref.at[pl.ds(n0, bn), pl.ds(kb0 * 16, bk)], w, mask=out_mask)


def dequantize_pallas(
    w_codes: jax.Array,
    w_scales: jax.Array,
    *,
    config: Config = Config(),
    interpret: bool = False,
    block_n: int = 64,
    block_k: int = 256,
    dtype=jnp.bfloat16,
) -> jax.Array:
    """NVFP4 [N, K] -> ``e2m1 * e4m3`` [N, K] in bf16/fp16 (exact; decode scale not applied)."""
    N, K2 = w_codes.shape
    K = 2 * K2
    if w_scales.dtype != jnp.uint8:
        w_scales = lax.bitcast_convert_type(w_scales, jnp.uint8)
    kernel = functools.partial(
        _dequant_kernel, N=N, K=K, bn=block_n, bk=block_k, decode=config.decode
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((N, K), dtype),
        grid=(_cdiv(N, block_n), _cdiv(K, block_k)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="nvfp4_dequant",
    )(w_codes.reshape(N, K // 16, 8), w_scales)
