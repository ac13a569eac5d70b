"""In-kernel NVFP4 weight decode for the Pallas-Triton GEMM (shared by every kernel here).

Layout handed to the kernels: ``codes`` uint8 ``[..., K/16, 8]`` (one 16-element scale block per
row of 8 bytes; byte ``j`` holds element ``2j`` in its low nibble and ``2j+1`` in its high
nibble) and ``scales`` float8_e4m3fn ``[..., K/16]``.

Decode (the Marlin/fp16 bit trick, see pallas-gpu.md 6.1): an E2M1 nibble ``s e1 e0 m`` placed
as ``s`` -> fp16 bit 15 and ``e1 e0 m`` -> fp16 bits 11..9 is the fp16 number
``e2m1 * 2^-14`` exactly, for all 16 codes (code 1, 0.5, becomes the fp16 subnormal 2^-15, which
fp16->fp32 converts exactly). Low and high nibbles give two tensors: the even and the odd
K-elements. The kernels multiply by ``e4m3 * 2^14`` in fp32 (an exact product: <= 6 significant
bits, >= 2^-10) and cast to bf16 (exact), so the MMA operand is ``e2m1 * e4m3`` with no
rounding; the per-tensor decode scale is applied to the fp32 accumulator afterwards.

Two implementations of the nibble step, bit-identical:

* ``"bits"``: jnp integer ops on uint16, one element per op (runs everywhere, including the
  Pallas interpreter on CPU);
* ``"asm"``: PTX per 4 packed bytes (8 nibbles): ``prmt`` spreads the bytes into the high
  byte of each 16-bit lane, then shift/mask (``lop3`` after ptxas) make fp16x2 registers,
  under 2 instructions per weight (NVIDIA GPUs only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

DECODE_MODES = ("asm", "bits")

# fp32 factor that undoes the 2^-14 of the fp16 placement; folded into the block scale.
F16_PLACEMENT_SCALE = 16384.0

# Per 32-bit register r = [b3 b2 b1 b0] (byte b_i = elements 2i, 2i+1 of the pack):
#   t01 = [b1 0 b0 0] (prmt selector 0x1404), t23 = [b3 0 b2 0] (0x3424) put each byte in the
#   high byte of a 16-bit lane; the high nibble then sits at lane bits 12..15 (sign already at
#   bit 15, magnitude >> 3 -> bits 11..9), the low nibble at bits 8..11 (sign << 4,
#   magnitude << 1). Two single-result asm blocks (JAX's lowering of multi-result inline asm
#   returns one value), so each repeats the two prmt: 7 ops per 4 weights.
_ASM_LO = """
{
.reg .b32 t, a, b;
prmt.b32 t, $2, 0, 0x1404;
shl.b32 a, t, 4;
shl.b32 b, t, 1;
and.b32 a, a, 0x80008000;
and.b32 b, b, 0x0E000E00;
or.b32 $0, a, b;
prmt.b32 t, $2, 0, 0x3424;
shl.b32 a, t, 4;
shl.b32 b, t, 1;
and.b32 a, a, 0x80008000;
and.b32 b, b, 0x0E000E00;
or.b32 $1, a, b;
}
"""
_ASM_HI = """
{
.reg .b32 t, a, b;
prmt.b32 t, $2, 0, 0x1404;
shr.b32 b, t, 3;
and.b32 a, t, 0x80008000;
and.b32 b, b, 0x0E000E00;
or.b32 $0, a, b;
prmt.b32 t, $2, 0, 0x3424;
shr.b32 b, t, 3;
and.b32 a, t, 0x80008000;
and.b32 b, b, 0x0E000E00;
or.b32 $1, a, b;
}
"""


def nibbles_to_f16(codes: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """uint8 codes [...] -> (even, odd) fp16 [...] holding ``e2m1 * 2^-14`` exactly."""
    if mode == "asm":
        from jax.experimental.pallas import triton as plgpu

        out = [jax.ShapeDtypeStruct(codes.shape, jnp.float16)]
        (lo,) = plgpu.elementwise_inline_asm(_ASM_LO, args=[codes], constraints="=r,=r,r",
                                             pack=4, result_shape_dtypes=out)
        (hi,) = plgpu.elementwise_inline_asm(_ASM_HI, args=[codes], constraints="=r,=r,r",
                                             pack=4, result_shape_dtypes=out)
        return lo, hi
    if mode == "bits":
        b = codes.astype(jnp.uint16)
        lo = ((b & 0x7) << 9) | ((b & 0x8) << 12)
        hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
        return (lax.bitcast_convert_type(lo, jnp.float16),
                lax.bitcast_convert_type(hi, jnp.float16))
    raise ValueError(f"decode: expected one of {DECODE_MODES}, got {mode!r}")


def scaled(half: jax.Array, scale_f32: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """fp16 ``e2m1*2^-14`` [..., nb, 8] times fp32 ``e4m3*2^14`` [..., nb] -> exact weights.

    ``dtype`` bf16 or fp16: e2m1*e4m3 lies in [2^-10, 2688] with <= 6 significant bits, exact
    in both.
    """
    return (half.astype(jnp.float32) * scale_f32[..., None]).astype(dtype)


def decode_block(codes: jax.Array, scales: jax.Array, mode: str,
                 dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """codes uint8 [R, nb, 8], scales E4M3 bytes (uint8) [R, nb] -> (even, odd) [R, nb, 8]
    = e2m1*e4m3. Scales travel as uint8 so masked loads can fill 0 (Triton cannot splat an
    integer into an fp8 tensor); the bitcast to float8_e4m3fn is free."""
    if scales.dtype == jnp.uint8:
        scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    lo, hi = nibbles_to_f16(codes, mode)
    s = scales.astype(jnp.float32) * F16_PLACEMENT_SCALE
    return scaled(lo, s, dtype), scaled(hi, s, dtype)
