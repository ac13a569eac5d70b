"""W4A4 NVFP4 GEMM on FP4 tensor cores from Pallas-Triton: Triton's ``tt.dot_scaled``.

Pallas-Triton has no scaled dot, but the Triton dialect that jaxlib ships
(``jax._src.lib.triton.dialect``, jaxlib 0.10.2 and 0.11.2) has ``DotScaledOp``. This module
adds one primitive, :data:`dot_scaled_p`, with a Pallas-Triton lowering rule that emits

    tt.dot_scaled %w scale %w_scale, %xT scale %x_scale, %acc lhs = e2m1 rhs = e2m1

with ``e2m1`` operands packed two per byte along K (element 2j in the low nibble, the NVFP4
codes layout) and ``f8E4M3FN`` scales, one per 16 K-elements: NVFP4's ``ue4m3`` block scale.
Triton picks the scale group (16) from the scale type. What Triton makes of it depends on the
target (docs/sm12x-fp4-mma.md has the evidence):

* sm_120a (RTX 50xx / RTX PRO): ``mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale
  .scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3``, SASS ``OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X``;
* sm_121a (GB10) native since triton-lang/triton PR #10010; elsewhere (sm_90) decomposed to a
  bf16 ``tt.dot`` since PR #9772 (NVFP4 scales) - a Triton without them fails to compile.

Numerics (the oracle's ``gemm_w4a4``): ``out = alpha * sum_k (e2m1_x * e4m3_x) (e2m1_w *
e4m3_w)`` with fp32 accumulation. The block scales stay in the MMA (never folded into alpha),
``alpha = x.decode_scale * w.decode_scale`` (fp32) multiplies the fp32 accumulator once, then
one cast to ``out_dtype``. Each product is exact in fp32 (<= 12 significant bits), so with
fp32 (or truncating fp32) additions in any order the result is within
``oracle.gemm_error_bound``; the decomposed path (bf16 ``e2m1 * e4m3``, exact, into a bf16 MMA)
is, and the native SM12x MMA's adder is assumed to be (not yet measured on SM12x hardware).

Kernel: grid over (token tile, feature tile); the weight tile ``[BN, BK/2]`` is the MMA's
M operand and the token tile ``[BM, BK/2]`` (transposed) its N operand (swap-AB: a decode
batch fills the 8-wide N slot, the accumulator is ``[BN, BM]``). K loop with masked loads
(zero codes and zero scales past K). Outside a Pallas-Triton kernel (Pallas interpret mode on
CPU, or plain XLA) the primitive evaluates an exact decode + fp32 dot, so the same source runs
in CPU tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.extend.core import Primitive
from jax.interpreters import mlir

from ..device import is_sm12x
from ..formats import E2M1_VALUES
from ..quantize import NVFP4Array

BLOCK = 16
#: The tensor-core instruction a Pallas-Triton W4A4 kernel multiplies with (``matmul(mma=)``
#: and ``moe.configs.MoEConfig.mma``, one vocabulary): "bf16" (the activation's exact ``e2m1 *
#: e4m3`` bf16 values against the weights decoded in registers, bf16 MMA) or "fp4" (both
#: operands NVFP4 into ``tt.dot_scaled``: the block-scaled FP4 MMA on SM12x, decomposed to bf16
#: MMAs by Triton elsewhere). Both meet the oracle's bound (exact products, fp32 accumulation).
MMAS = ("bf16", "fp4")


def default_mma() -> str:
    """The MMA W4A4 runs on by default here: "fp4" on an SM 12.x GPU (8x the bf16 MMA rate
    there, bench/sm12x_model.py), "bf16" everywhere else (on sm_90 Triton decomposes the FP4
    dot into bf16 MMAs, with the dequantization in the K loop)."""
    return "fp4" if is_sm12x() else "bf16"


# ---------------------------------------------------------------------------------------------
# the primitive: acc[M, N] + (e2m1 a * e4m3 sa)[M, K] @ (e2m1 b * e4m3 sb)[N, K]^T
# ---------------------------------------------------------------------------------------------

dot_scaled_p = Primitive("nvfp4_dot_scaled")


def dot_scaled(acc, a_codes, a_scales, b_codes, b_scales) -> jax.Array:
    """``acc + A @ B^T`` with A, B NVFP4 tiles; inside a Pallas-Triton kernel one ``tt.dot_scaled``.

    acc: f32 [M, N]. a_codes: uint8 [M, K/2] (two e2m1 codes per byte, element 2j low nibble).
    a_scales: uint8 [M, K/16] (E4M3 bytes). b_codes: uint8 [N, K/2]. b_scales: uint8 [N, K/16].
    Returns f32 [M, N].
    """
    return dot_scaled_p.bind(acc, a_codes, a_scales, b_codes, b_scales)


def _check_avals(acc, a, sa, b, sb):
    m, n = acc.shape
    k2 = a.shape[-1]
    want = {
        "acc": (acc, (m, n), jnp.float32),
        "a_codes": (a, (m, k2), jnp.uint8),
        "a_scales": (sa, (m, 2 * k2 // BLOCK), jnp.uint8),
        "b_codes": (b, (n, k2), jnp.uint8),
        "b_scales": (sb, (n, 2 * k2 // BLOCK), jnp.uint8),
    }
    if (2 * k2) % BLOCK:
        raise ValueError(f"a_codes: K = {2 * k2} is not a multiple of {BLOCK}")
    for name, (v, shape, dtype) in want.items():
        if tuple(v.shape) != shape or v.dtype != dtype:
            raise ValueError(f"{name}: expected {jnp.dtype(dtype).name}{list(shape)}, "
                             f"got {v.dtype}{list(v.shape)}")


def _abstract_eval(acc, a, sa, b, sb):
    _check_avals(acc, a, sa, b, sb)
    return jax.core.ShapedArray(acc.shape, jnp.float32)


def decode_tile(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """uint8 codes [R, K/2] + E4M3 bytes [R, K/16] -> f32 ``e2m1 * e4m3`` [R, K] (exact)."""
    r, k2 = codes.shape
    table = jnp.asarray(E2M1_VALUES)
    vals = jnp.stack([table[codes & 0xF], table[codes >> 4]], axis=-1).reshape(r, 2 * k2)
    s = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
    return (vals.reshape(r, -1, BLOCK) * s[..., None]).reshape(r, 2 * k2)


def _reference(acc, a, sa, b, sb):
    """Exact operands, fp32 accumulation (HIGHEST: no bf16/tf32 passes on a GPU)."""
    prod = lax.dot_general(
        decode_tile(a, sa), decode_tile(b, sb), (((1,), (1,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return acc + prod


dot_scaled_p.def_abstract_eval(_abstract_eval)
dot_scaled_p.def_impl(_reference)
mlir.register_lowering(dot_scaled_p, mlir.lower_fun(_reference, multiple_results=False))


def _triton_lowering(ctx, acc, a, sa, b, sb):
    """``tt.dot_scaled`` (lhs = a [M, K/2], rhs = trans(b) [K/2, N], ue4m3 scales per 16)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt

    def f8(v):
        shape = ir.RankedTensorType(v.type).shape
        return tt.bitcast(ir.RankedTensorType.get(shape, ir.Float8E4M3FNType.get()), v)

    e2m1 = tt.ScaleDotElemType.E2M1
    return tt.dot_scaled(
        acc.type, a, tt.trans(b, (1, 0)), acc, e2m1, e2m1, False,
        a_scale=f8(sa), b_scale=f8(sb), lhs_k_pack=True, rhs_k_pack=True,
    )


def _register_triton_lowering() -> None:
    from jax._src.pallas.triton import lowering as triton_lowering

    triton_lowering.register_lowering(dot_scaled_p)(_triton_lowering)


_register_triton_lowering()


# ---------------------------------------------------------------------------------------------
# the GEMM kernel
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fp4MmaConfig:
    """Tile configuration (sizes and num_warps powers of two).

    block_m: tokens per tile (MMA N slot, >= 8). block_n: output features per tile (MMA M
    slot, >= 16). block_k: K per step (>= 64, the m16n8k64 instruction's K).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Fp4MmaConfig.{name}: expected a power of two, got {v}")
        if self.num_stages < 1:
            raise ValueError(f"Fp4MmaConfig.num_stages: expected >= 1, got {self.num_stages}")
        if self.block_m < 8 or self.block_n < 16 or self.block_k < 64:
            raise ValueError(
                f"Fp4MmaConfig: need block_m >= 8, block_n >= 16, block_k >= 64, got {self}"
            )


def default_config(m: int) -> Fp4MmaConfig:
    """Tile for M tokens (untuned: no SM12x GPU has run it). Shared memory of each on sm_120a
    with XLA's Triton at N = K = 4096: 22.3 KiB (M <= 16), 26.5 KiB (M <= 64), 36 KiB (larger),
    all within SM12x's 99 KiB per block."""
    if m <= 16:
        return Fp4MmaConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3)
    if m <= 64:
        return Fp4MmaConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
    return Fp4MmaConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


def _kernel(xc_ref, xs_ref, wc_ref, ws_ref, alpha_ref, *refs, cfg: Fp4MmaConfig,
            M: int, N: int, K: int):
    o_ref = refs[-1]
    # a stack's layer (refs = (row0_ref, o_ref)): W's rows start at row0 of the flattened
    # [L * N, ...] codes and scales
    w0 = refs[0][0] if len(refs) == 2 else 0
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    BK2, BKS = BK // 2, BK // BLOCK
    K2, KS = K // 2, K // BLOCK
    m0 = pl.program_id(0) * BM
    n0 = pl.program_id(1) * BN
    m_mask = (m0 + jnp.arange(BM)) < M
    n_mask = (n0 + jnp.arange(BN)) < N

    def body(i, carry):
        acc, nan_rows = carry
        k2_live = (i * BK2 + jnp.arange(BK2)) < K2
        ks_live = (i * BKS + jnp.arange(BKS)) < KS
        wc = plgpu.load(wc_ref.at[pl.ds(w0 + n0, BN), pl.ds(i * BK2, BK2)],
                        mask=n_mask[:, None] & k2_live[None, :], other=0)
        ws = plgpu.load(ws_ref.at[pl.ds(w0 + n0, BN), pl.ds(i * BKS, BKS)],
                        mask=n_mask[:, None] & ks_live[None, :], other=0)
        xc = plgpu.load(xc_ref.at[pl.ds(m0, BM), pl.ds(i * BK2, BK2)],
                        mask=m_mask[:, None] & k2_live[None, :], other=0)
        xs = plgpu.load(xs_ref.at[pl.ds(m0, BM), pl.ds(i * BKS, BKS)],
                        mask=m_mask[:, None] & ks_live[None, :], other=0)
        # an activation block scale byte 0x7F/0xFF (NaN: a block that held NaN/Inf) makes its
        # row NaN whatever the tensor core makes of it (ue4m3 has no NaN): the loop keeps the
        # elementwise max of the bytes' low 7 bits (no reduction per step), 0x7F iff a NaN
        nan_rows = jnp.maximum(nan_rows, xs.astype(jnp.int32) & 0x7F)
        return dot_scaled(acc, wc, ws, xc, xs), nan_rows

    acc, smax = lax.fori_loop(0, pl.cdiv(K, BK), body, (jnp.zeros((BN, BM), jnp.float32),
                                                        jnp.zeros((BM, BKS), jnp.int32)))
    nan_rows = jnp.max(smax, axis=1) == 0x7F
    acc = jnp.where(nan_rows[None, :], jnp.nan, acc * alpha_ref[0])
    out = acc.astype(o_ref.dtype)
    plgpu.store(o_ref.at[pl.ds(m0, BM), pl.ds(n0, BN)], out.T,
                mask=m_mask[:, None] & n_mask[None, :])


def _as_bytes(scales: jax.Array, name: str) -> jax.Array:
    if scales.dtype == jnp.float8_e4m3fn:
        return lax.bitcast_convert_type(scales, jnp.uint8)
    if scales.dtype != jnp.uint8:
        raise ValueError(f"{name}: expected float8_e4m3fn (or its uint8 bytes), got {scales.dtype}")
    return scales


def gemm_fp4mma(
    x_codes: jax.Array,
    x_scales: jax.Array,
    w_codes: jax.Array,
    w_scales: jax.Array,
    alpha: jax.Array | float,
    *,
    out_dtype=jnp.bfloat16,
    config: Fp4MmaConfig | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """``alpha * A @ W^T`` on FP4 tensor cores, A and W NVFP4 with linear-layout scales.

    x_codes: uint8 [M, K/2]; x_scales: E4M3 [M, K/16] (float8_e4m3fn or its uint8 bytes);
    w_codes: uint8 [N, K/2]; w_scales: E4M3 [N, K/16] (or, with ``layer``, an int32 scalar,
    stacks [L, N, K/2] and [L, N, K/16] of which the kernel reads layer ``layer`` in place:
    no per-layer slice to copy in a scan); alpha: fp32 scalar (x.decode_scale *
    w.decode_scale). K: a multiple of 16. Returns out_dtype (bf16, fp16 or fp32) [M, N]; a row
    of x with a NaN scale byte (0x7F/0xFF: a block that held NaN/Inf) gives a NaN output row.
    config: tile (default :func:`default_config` of M). interpret: Pallas interpret mode (CPU
    tests; the MMA is then the exact reference dot).
    """
    x_codes, w_codes = jnp.asarray(x_codes), jnp.asarray(w_codes)
    if x_codes.ndim != 2 or x_codes.dtype != jnp.uint8:
        raise ValueError(f"x_codes: expected uint8 [M, K/2], got {x_codes.dtype}"
                         f"{list(x_codes.shape)}")
    stacked = layer is not None
    if w_codes.ndim != 2 + stacked or w_codes.dtype != jnp.uint8:
        raise ValueError(f"w_codes: expected uint8 {'[L, N, K/2]' if stacked else '[N, K/2]'}"
                         f", got {w_codes.dtype}{list(w_codes.shape)}")
    (M, K2), (N, wk2) = x_codes.shape, w_codes.shape[-2:]
    K = 2 * K2
    if wk2 != K2:
        raise ValueError(f"w_codes: K mismatch, x has K={K}, w has K={2 * wk2}")
    if K % BLOCK or K == 0:
        raise ValueError(f"x_codes: K must be a positive multiple of {BLOCK}, got {K}")
    xs = _as_bytes(jnp.asarray(x_scales), "x_scales")
    ws = _as_bytes(jnp.asarray(w_scales), "w_scales")
    if xs.shape != (M, K // BLOCK):
        raise ValueError(f"x_scales: expected shape {(M, K // BLOCK)}, got {xs.shape}")
    if ws.shape != w_codes.shape[:-2] + (N, K // BLOCK):
        raise ValueError(f"w_scales: expected shape {w_codes.shape[:-2] + (N, K // BLOCK)}, "
                         f"got {ws.shape}")
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    alpha_arr = jnp.asarray(alpha, jnp.float32).reshape(-1)
    if alpha_arr.shape != (1,):
        raise ValueError(f"alpha: expected an fp32 scalar, got shape {jnp.shape(alpha)}")
    cfg = default_config(M) if config is None else config
    if not isinstance(cfg, Fp4MmaConfig):
        raise ValueError(  # noqa: TRY004 - the house style: bad input is a ValueError
            f"config: expected an Fp4MmaConfig or None, got {type(cfg).__name__}")
    kernel = functools.partial(_kernel, cfg=cfg, M=M, N=N, K=K)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        grid=(pl.cdiv(M, cfg.block_m), pl.cdiv(N, cfg.block_n)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nvfp4_gemm_fp4mma",
    )(x_codes, xs, w_codes.reshape(-1, K2), ws.reshape(-1, K // BLOCK), alpha_arr,
      *([(jnp.asarray(layer, jnp.int32) * N).reshape(1)] if stacked else []))


def matmul_fp4mma(
    x: NVFP4Array,
    w: NVFP4Array,
    *,
    out_dtype=jnp.bfloat16,
    config: Fp4MmaConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W4A4 ``x @ w^T`` (oracle ``gemm_w4a4``): x NVFP4Array [M, K], w NVFP4Array [N, K], both
    with scalar decode scales; alpha = x.decode_scale * w.decode_scale (fp32). Swizzled scales
    are converted to linear. Returns out_dtype [M, N]."""
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, NVFP4Array):
            raise ValueError(  # noqa: TRY004 - the house style: bad input is a ValueError
                f"{name}: expected an NVFP4Array, got {type(t).__name__}")
        if len(t.shape) != 2:
            raise ValueError(f"{name}: expected a 2-D NVFP4Array, got shape {t.shape}")
        if jnp.ndim(t.decode_scale) != 0:
            raise ValueError(f"{name}.decode_scale: expected a scalar, got shape "
                             f"{jnp.shape(t.decode_scale)}")
    alpha = jnp.asarray(x.decode_scale, jnp.float32) * jnp.asarray(w.decode_scale, jnp.float32)
    return gemm_fp4mma(x.codes, x.linear_scales(), w.codes, w.linear_scales(), alpha,
                       out_dtype=out_dtype, config=config, interpret=interpret)
