"""Arithmetic shared by the Pallas-Triton kernels of gemm/ and moe/, written once.

Inside a Pallas-Triton kernel the NVFP4 recipes need what Triton does not give as is: IEEE
fp32 division (Triton lowers ``/`` to the approximate ``div.full.f32``, which flips FP4 codes at
E2M1 midpoints, so :func:`div_rn` emits ``div.rn.f32`` as inline PTX), E4M3 and E2M1 rounding
from integer and float ops (no f32 -> f8 cast with a known rounding), bf16 rounding that XLA's
interpret mode cannot fold away, the MoE activations, and the power-of-two tiles Triton blocks
need. Every function takes ``exact_asm``: True on the GPU (inline PTX), False in interpret mode
(CPU tests), where the same values come from XLA ops that keep IEEE division.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .quantize import ieee_div

FLT_MAX = 3.4028234663852886e38


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(v: int) -> int:
    """Smallest power of two >= v (>= 1): Triton block shapes are powers of two."""
    return 1 << max(0, (v - 1).bit_length())


def row_tile(h: int) -> int:
    """Largest power of two <= 2048 dividing h: the column tile of a kernel that walks a row of
    h elements in power-of-two blocks (the MoE glue has h % 256 == 0; ``gemm.operand`` calls
    it with K % 16 == 0)."""
    t = 2048
    while h % t:
        t //= 2
    return t


def call(kernel, out_shape, grid, *, num_warps: int, name: str, interpret: bool):
    """``pl.pallas_call`` of a single-stage kernel (no K loop to pipeline)."""
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))


def div_rn(a, b, exact_asm: bool):
    """IEEE round-to-nearest fp32 division (Triton's ``/`` is approximate on NVIDIA GPUs)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    if not exact_asm:  # interpret mode: XLA would turn a division by a broadcast into a * (1/b)
        return ieee_div(a, b)
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def e4m3_round(v):
    """fp32 v >= 0 -> nearest E4M3 value (RNE, subnormals down to 2^-9), saturating at 448.

    Integer/float arithmetic only (Pallas-Triton has no int->f8 cast and the f32->f8 cast's
    rounding is the backend's): the quantum at v's exponent (clamped to E4M3's minimum normal
    exponent -6) is 2^(e-3); y = v / quantum < 16 is exact and is rounded to an integer, ties
    to even, with integer ops (an ``(y + 2^23) - 2^23`` trick would be folded away by XLA in
    interpret mode).
    """
    v = jnp.minimum(v, 448.0)
    e = ((lax.bitcast_convert_type(v, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32) - 127
    q = jnp.maximum(e, -6) - 3
    quantum = lax.bitcast_convert_type(((q + 127) << 23).astype(jnp.uint32), jnp.float32)
    inv = lax.bitcast_convert_type(((127 - q) << 23).astype(jnp.uint32), jnp.float32)
    y = v * inv
    n = y.astype(jnp.int32)  # truncation; y >= 0
    frac = y - n.astype(jnp.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))
    return (n + up.astype(jnp.int32)).astype(jnp.float32) * quantum


def e2m1_magnitude(a):
    """|y| -> nearest E2M1 magnitude, ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4), saturating."""
    f = lambda c: c.astype(jnp.float32)
    half = f(a > 0.25) + f(a >= 0.75) + f(a > 1.25) + f(a >= 1.75)
    return 0.5 * half + f(a > 2.5) + f(a >= 3.5) + 2.0 * f(a > 5.0)


def e2m1_code(a):
    """|y| -> E2M1 magnitude code 0..7 (int32) of :func:`e2m1_magnitude`'s value: the number
    of its rounding thresholds that |y| passes."""
    f = lambda c: c.astype(jnp.int32)
    return (f(a > 0.25) + f(a >= 0.75) + f(a > 1.25) + f(a >= 1.75) + f(a > 2.5) + f(a >= 3.5)
            + f(a > 5.0))


def e4m3_byte(s):
    """fp32 s, an E4M3 value in [0, 448] (``e4m3_round``'s output) or NaN -> its E4M3 byte
    (int32; NaN -> 0x7F). Exact: integer ops on the fp32 bits."""
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    e = ((bits >> 23) & 0xFF).astype(jnp.int32)
    normal = ((e - 120) << 3) | ((bits >> 20) & 7).astype(jnp.int32)
    sub = (s * 512.0).astype(jnp.int32)  # m * 2^-9, m in 0..7
    return jnp.where(jnp.isnan(s), 0x7F, jnp.where(e >= 121, normal, sub))


def _quantize_blocks(hb, g, rg, recipe: str, exact_asm: bool):
    """The recipes' arithmetic: (y, block scale s as its E4M3 value, NaN where the block is
    not finite) for :func:`requantize` and :func:`quantize_codes`."""
    vmax = jnp.max(jnp.abs(hb), axis=-1)
    if recipe == "trtllm":
        sf = jnp.where(vmax == 0, 0.0, vmax * (g * jnp.float32(1.0 / 6.0)))
        s = e4m3_round(sf)
        out_scale = jnp.minimum(div_rn(1.0, s * rg, exact_asm), FLT_MAX)
        y = hb * out_scale[..., None]
    else:
        s = e4m3_round(jnp.minimum(div_rn(vmax * g, 6.0, exact_asm), 448.0))
        den = jnp.maximum(div_rn(s, g, exact_asm), 1e-30)
        y = div_rn(hb, jnp.broadcast_to(den[..., None], hb.shape), exact_asm)
    # a block holding NaN/Inf dequantizes to NaN (docs/input-policy.md); the flag is reduced
    # from 0/1 values because a GPU max reduction may drop NaN
    nonfinite = jnp.max(jnp.where(jnp.abs(hb) <= FLT_MAX, 0.0, 1.0), axis=-1)
    return y, jnp.where(nonfinite > 0, jnp.nan, s)


def requantize(hb, g, rg, recipe: str, exact_asm: bool):
    """hb fp32 [BM, nb, 16] (bf16 values), encode scale g, rg = IEEE 1/g -> q*sf fp32
    [BM, nb, 16].

    The recipes' fp32 op order (oracle.quantize): trtllm ``sf = vmax*(G*fp32(1/6))``,
    ``y = x * min(1/(sf8*(1/G)), FLT_MAX)``; b12x ``sf = (vmax*G)/6``,
    ``y = x / max(sf8/G, 1e-30)``.
    """
    y, s = _quantize_blocks(hb, g, rg, recipe, exact_asm)
    mag = e2m1_magnitude(jnp.abs(y))
    return jnp.where(y < 0, -mag, mag) * s[..., None]


def quantize_codes(hb, g, rg, recipe: str, exact_asm: bool):
    """:func:`requantize`'s quantization as the NVFP4 operand itself: hb fp32 [BM, nb, 16] ->
    (codes uint8 [BM, nb, 8], element 2j in the low nibble; E4M3 scale bytes uint8 [BM, nb]).

    The sign bit as ``oracle.quantize``: trtllm from the fp32 sign of y (hardware cvt: -0.0
    and negatives rounding to 0 give code 8), b12x only on non-zero codes. A block holding
    NaN/Inf gets scale byte 0x7F (NaN)."""
    y, s = _quantize_blocks(hb, g, rg, recipe, exact_asm)
    code = e2m1_code(jnp.abs(y))
    if recipe == "trtllm":
        neg = (lax.bitcast_convert_type(y, jnp.uint32) >> 31).astype(jnp.int32)
    else:
        neg = ((y < 0) & (code != 0)).astype(jnp.int32)
    code = code | (neg << 3)
    bm, nb = code.shape[:2]
    lo, hi = jnp.split(code.reshape(bm, nb * 8, 2), 2, axis=-1)  # rank 3, as Triton reshapes
    packed = (lo | (hi << 4)).reshape(bm, nb, 8)
    return packed.astype(jnp.uint8), e4m3_byte(s).astype(jnp.uint8)


def bf16_rne(v, exact_asm: bool):
    """fp32 -> nearest bf16 value, kept in fp32, inside a kernel: the convert pair on the GPU
    (Triton emits both conversions); ``lax.reduce_precision`` in interpret mode
    (``exact_asm`` False), where XLA's excess-precision simplifier may drop a convert pair."""
    if exact_asm:
        return v.astype(jnp.bfloat16).astype(jnp.float32)
    return lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)


def fc1_activation(first, second, alpha, *, activation: str, gate_up_order: str, mode: str,
                   exact_asm: bool = True):
    """FC1 epilogue in registers: accumulators fp32 [BN, BM] (the two halves' tiles for swiglu,
    ``second`` None for relu2) ``* alpha`` (-> bf16 in trtllm_cutlass), activation in fp32 ->
    ``h`` bf16 [BN, BM]. ``exact_asm`` False: interpret mode (see ``bf16_rne``). ``alpha``
    None: the accumulators are already bf16(alpha * acc) (trtllm_cutlass products stored by
    the GEMM, ``mosaic.grouped_matmul(alpha=...)``), in fp32."""

    def scaled(acc):
        if alpha is None:
            return acc
        u = acc * alpha
        if mode == "trtllm_cutlass":  # GEMM1 output buffer is bf16 in TRT-LLM CUTLASS
            u = bf16_rne(u, exact_asm)
        return u

    if activation == "relu2":
        # relu that keeps NaN (a GPU max may return the non-NaN operand): NaN rows stay NaN
        u = scaled(first)
        r = jnp.where(u < 0.0, 0.0, u)
        return (r * r).astype(jnp.bfloat16)
    up, gate = (first, second) if gate_up_order == "up_gate" else (second, first)
    up, gate = scaled(up), scaled(gate)
    return (gate / (1.0 + jnp.exp(-gate)) * up).astype(jnp.bfloat16)
