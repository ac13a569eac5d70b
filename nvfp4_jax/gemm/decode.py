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

Implementations (all give the same operand values):

* ``"bits"``: jnp integer ops on uint16, one element per op (runs everywhere, including the
  Pallas interpreter on CPU);
* ``"asm16"``: PTX per 4 packed bytes (8 nibbles): ``prmt`` spreads the bytes into the high
  byte of each 16-bit lane, then shift/mask (``lop3`` after ptxas) make fp16x2 registers
  (NVIDIA GPUs only); scaling as above in fp32;
* ``"asm"`` (bf16 operands): the same spreading but straight into bf16x2 lanes, with the block
  scale applied inside the asm by one ``fma.rn.bf16x2`` per two weights (no fp32 round trip),
  about 1.2 instructions per weight; fp16 operands fall back to ``"asm16"``. One block per 4
  bytes: the right grouping where each thread holds 4 consecutive bytes of a row (the
  ``mma.sync`` operand layout Triton picks on sm_120a/sm_80+, ``kWidth = 4``);
* ``"asm2m"`` (bf16 operands): one block per 2 bytes, the right grouping where each thread
  holds 2 consecutive bytes (the ``wgmma`` register operand on sm_90a, ``kWidth = 2``; a 4-byte
  pack there mixes two rows, which costs a byte unpack and repack per pack). ``prmt`` spreads
  the two bytes 16 bits apart, then per nibble half ``and, mul.lo, and`` places sign and
  magnitude (the Mosaic kernel's placement, mosaic.py) and one ``fma.rn.bf16x2`` scales:
  1163 main-loop instructions per warp and step on sm_90a (M <= 16 tile of 28672x8192) against
  1227 for the same grouping with placement by shifts and masks (73.1 against 84.4 us on the
  H200, bench/results/gemm-candidates-h200.json). On sm_120a the 4-byte ``"asm"`` stays
  cheaper (1104 against 1297).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

DECODE_MODES = ("asm", "asmm", "asm2m", "asm16", "bits")


def check_tile_config(cfg, power_of_two: tuple[str, ...]) -> None:
    """Validate a kernel tile config: the named fields powers of two (Pallas-Triton tiles must
    have power-of-2 sizes), MMA-sized blocks, a known decode mode. Raises ValueError."""
    for name in power_of_two:
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"Config.{name}: expected a power of two, got {v}")
    if cfg.block_m < 16 or cfg.block_n < 16 or cfg.block_k < 32:
        raise ValueError(f"Config: need block_m, block_n >= 16 and block_k >= 32, got {cfg}")
    if cfg.decode not in DECODE_MODES:
        raise ValueError(f"Config.decode: expected one of {DECODE_MODES}, got {cfg.decode!r}")

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


_ASM_BF16 = """
{
.reg .b32 t, a, b, z;
mov.b32 z, 0x80008000;
prmt.b32 t, $2, 0, SEL01;
SHIFTS01
and.b32 a, a, 0x80008000;
and.b32 b, b, 0x01C001C0;
or.b32 a, a, b;
fma.rn.bf16x2 $0, a, $3, z;
prmt.b32 t, $2, 0, SEL23;
SHIFTS23
and.b32 a, a, 0x80008000;
and.b32 b, b, 0x01C001C0;
or.b32 a, a, b;
fma.rn.bf16x2 $1, a, $4, z;
}
"""
# bf16 placement: sign -> bit 15, magnitude e1 e0 m -> bits 8..6 gives e2m1 * 2^-126 (code 1 is
# the bf16 subnormal 2^-127; fma.rn.bf16x2 keeps subnormals). The block scale enters as the
# bf16 ``e4m3 * 2^119`` (<= 1.75 * 2^127, no overflow), so one fma gives ``e2m1*e4m3*2^-7``
# exactly (<= 6 significant bits, >= 2^-17: normal); the kernel multiplies its fp32
# accumulator by 2^7 (``BF16_POST_SCALE``).
_LO_SHIFTS = "shl.b32 a, t, 4;\nshr.b32 b, t, 2;"  # low nibble at lane bits 8..11
_HI_SHIFTS = "mov.b32 a, t;\nshr.b32 b, t, 6;"  # high nibble at lane bits 12..15
_ASM_BF16_LO = (
    _ASM_BF16.replace("SEL01", "0x1404")
    .replace("SEL23", "0x3424")
    .replace("SHIFTS01", _LO_SHIFTS)
    .replace("SHIFTS23", _LO_SHIFTS)
)
_ASM_BF16_HI = (
    _ASM_BF16.replace("SEL01", "0x1404")
    .replace("SEL23", "0x3424")
    .replace("SHIFTS01", _HI_SHIFTS)
    .replace("SHIFTS23", _HI_SHIFTS)
)


def _placed_by_mul(out: str, src: str, sel: str, scale: str) -> str:
    """One bf16x2 result: ``prmt`` spreads the two bytes of ``src`` picked by ``sel`` 16 bits
    apart, then ``and, mul.lo, and`` (MASK / MUL: the nibble half) and the scale ``fma``."""
    return (f"prmt.b32 t, {src}, 0, {sel};\nand.b32 t, t, MASK;\nmul.lo.u32 t, t, MUL;\n"
            f"and.b32 t, t, 0x81C081C0;\nfma.rn.bf16x2 {out}, t, {scale}, z;\n")


def _nibble_halves(asm: str) -> dict[str, str]:
    """{"lo", "hi"}: ``asm`` for the low nibbles (even elements) and the high ones (odd)."""
    return {"lo": asm.replace("MASK", "0x000F000F").replace("MUL", "4160"),
            "hi": asm.replace("MASK", "0x00F000F0").replace("MUL", "260")}


# ``"asm2m"`` (2-byte grouping) and ``"asmm"`` (4-byte): the Mosaic kernel's placement by
# multiply (mosaic.py ``_DECODE_WORD``): ``prmt`` spreads two bytes 16 bits apart ([0 b1 0 b0]),
# then per nibble half ``and, mul.lo, and``: (t & 0x000F000F) * 4160 = (y << 12) + (y << 6)
# puts the sign at lane bit 15 and e1 e0 m at bits 8..6 (no overlap, no carry);
# 260 = 2^8 + 2^2 does the same for the nibbles at bits 4..7.
# 2-byte pack: $1 the 16-bit pair, $2 the bf16x2 scale; 4-byte pack: $2 the word, $3 / $4
# the scales of bytes 0-1 / 2-3.
_ASM2M_BF16 = _nibble_halves(
    "\n{\n.reg .b32 w, t, z;\nmov.b32 z, 0x80008000;\ncvt.u32.u16 w, $1;\n"
    + _placed_by_mul("$0", "w", "0x4140", "$2") + "}\n")
_ASMM_BF16 = _nibble_halves(
    "\n{\n.reg .b32 t, z;\nmov.b32 z, 0x80008000;\n"
    + _placed_by_mul("$0", "$2", "0x4140", "$3") + _placed_by_mul("$1", "$2", "0x4342", "$4")
    + "}\n")
#: the bf16 decode blocks by mode and nibble ({"lo": even elements, "hi": odd elements})
BF16_ASM = {
    "asm": {"lo": _ASM_BF16_LO, "hi": _ASM_BF16_HI},
    "asm2m": _ASM2M_BF16,
    "asmm": _ASMM_BF16,
}
BF16_SCALE_BIAS = 2.0**119
BF16_POST_SCALE = 2.0**7


def nibbles_to_f16(codes: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """uint8 codes [...] -> (even, odd) fp16 [...] holding ``e2m1 * 2^-14`` exactly."""
    if mode in ("asm", "asmm", "asm2m", "asm16"):
        from jax.experimental.pallas import triton as plgpu

        out = [jax.ShapeDtypeStruct(codes.shape, jnp.float16)]
        (lo,) = plgpu.elementwise_inline_asm(
            _ASM_LO, args=[codes], constraints="=r,=r,r", pack=4, result_shape_dtypes=out
        )
        (hi,) = plgpu.elementwise_inline_asm(
            _ASM_HI, args=[codes], constraints="=r,=r,r", pack=4, result_shape_dtypes=out
        )
        return lo, hi
    if mode == "bits":
        b = codes.astype(jnp.uint16)
        lo = ((b & 0x7) << 9) | ((b & 0x8) << 12)
        hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
        return (
            lax.bitcast_convert_type(lo, jnp.float16),
            lax.bitcast_convert_type(hi, jnp.float16),
        )
    raise ValueError(f"decode: expected one of {DECODE_MODES}, got {mode!r}")


def post_scale(mode: str, dtype) -> float:
    """Power of two by which a kernel multiplies its fp32 accumulator for this decode."""
    bf16_asm = mode in ("asm", "asmm", "asm2m") and jnp.dtype(dtype) == jnp.bfloat16
    return BF16_POST_SCALE if bf16_asm else 1.0


def decode_block(
    codes: jax.Array, scales: jax.Array, mode: str, dtype=jnp.bfloat16
) -> tuple[jax.Array, jax.Array, float]:
    """E2M1 codes (uint8 [..., 8]) and E4M3 scale bytes -> (even, odd, post_scale).

    ``scales``: uint8 or float8_e4m3fn, either one per row of 8 bytes (shape
    ``codes.shape[:-1]``) or already one per byte (shape ``codes.shape``). Returns the even and
    odd elements in ``dtype`` equal to ``e2m1 * e4m3 / post_scale`` exactly; the caller
    multiplies its fp32 accumulator by ``post_scale`` (a power of two). Scales travel as uint8
    so masked loads can fill 0 (Triton cannot splat an integer into fp8); the bitcast is free.
    """
    if scales.dtype == jnp.uint8:
        scales = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    s32 = scales.astype(jnp.float32)
    per_elem = scales.shape == codes.shape
    if post_scale(mode, dtype) != 1.0:
        from jax.experimental.pallas import triton as plgpu

        sb = (s32 * BF16_SCALE_BIAS).astype(jnp.bfloat16)
        if not per_elem:
            sb = jnp.broadcast_to(sb[..., None], codes.shape)
        out = [jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)]
        if mode == "asm2m":
            (lo,) = plgpu.elementwise_inline_asm(
                BF16_ASM[mode]["lo"], args=[codes, sb], constraints="=r,h,r", pack=2,
                result_shape_dtypes=out)
            (hi,) = plgpu.elementwise_inline_asm(
                BF16_ASM[mode]["hi"], args=[codes, sb], constraints="=r,h,r", pack=2,
                result_shape_dtypes=out)
            return lo, hi, BF16_POST_SCALE
        (lo,) = plgpu.elementwise_inline_asm(
            BF16_ASM[mode]["lo"],
            args=[codes, sb],
            constraints="=r,=r,r,r,r",
            pack=4,
            result_shape_dtypes=out,
        )
        (hi,) = plgpu.elementwise_inline_asm(
            BF16_ASM[mode]["hi"],
            args=[codes, sb],
            constraints="=r,=r,r,r,r",
            pack=4,
            result_shape_dtypes=out,
        )
        return lo, hi, BF16_POST_SCALE
    lo, hi = nibbles_to_f16(codes, mode)
    s = s32 * F16_PLACEMENT_SCALE
    if not per_elem:
        s = s[..., None]
    return (
        (lo.astype(jnp.float32) * s).astype(dtype),
        (hi.astype(jnp.float32) * s).astype(dtype),
        1.0,
    )
