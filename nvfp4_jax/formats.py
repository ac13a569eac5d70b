"""E2M1 / E4M3FN coding in JAX, bit-exact with ``oracle.formats`` on float32 inputs.

Bit layouts are defined once in :mod:`oracle.formats`. Rounding is done explicitly (RNE onto
the format's grid with float32 arithmetic that is exact: scaling by powers of two and
``round`` half-to-even), and only then cast, so no backend conversion routine (some of which
go through f16, or return NaN on overflow) decides a rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: numpy, not a device array: importing the package must not start a backend (on a GPU, the
#: allocator would take its share of memory in every process that merely imports us)
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       np.float32)


def _pow2(e: jax.Array) -> jax.Array:
    """2^e as float32 for integer e in [-126, 127] (built from bits, exact)."""
    return lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def _exponent(mag: jax.Array) -> jax.Array:
    """floor(log2(mag)) for positive normal float32 (int32); subnormals give -127."""
    bits = lax.bitcast_convert_type(mag.astype(jnp.float32), jnp.uint32)
    return ((bits >> 23) & 0xFF).astype(jnp.int32) - 127


def _round_to_grid(mag: jax.Array, mant_bits: int, min_exp: int) -> jax.Array:
    """RNE of finite non-negative float32 onto a grid with ``mant_bits`` fraction bits and
    minimum exponent ``min_exp`` (unbounded above). Exact: see oracle.formats._round_to_grid."""
    e = jnp.maximum(_exponent(mag), min_exp)
    q = e - mant_bits
    # mag / 2^q can exceed float32's exponent range only for huge mag; split the scaling.
    scaled = mag * _pow2(-q // 2) * _pow2(-q - (-q // 2))
    r = jnp.round(scaled)  # half to even
    return r * _pow2(q // 2) * _pow2(q - q // 2)


def e4m3_round(v: jax.Array, overflow: str = "saturate") -> jax.Array:
    """Nearest E4M3FN value of float32 ``v`` (RNE, subnormals to 2^-9) as float32.

    ``overflow``: "saturate" (CUDA satfinite, torch >= 2.12) or "nan" (ml_dtypes, JAX casts).
    """
    v = jnp.asarray(v, jnp.float32)
    mag = jnp.abs(v)
    finite = jnp.isfinite(mag)
    r = _round_to_grid(jnp.where(finite, mag, 0.0), 3, -6)
    over = (r > E4M3_MAX) | jnp.isinf(mag)
    if overflow == "saturate":
        r = jnp.where(over, E4M3_MAX, r)
    elif overflow == "nan":
        r = jnp.where(over, jnp.nan, r)
    else:
        raise ValueError(f"overflow: expected 'saturate' or 'nan', got {overflow!r}")
    r = jnp.where(jnp.isnan(mag), jnp.nan, r)
    return jnp.where(jnp.signbit(v), -r, r)


def e4m3_encode(v: jax.Array, overflow: str = "saturate") -> jax.Array:
    """float32 -> E4M3FN as ``jnp.float8_e4m3fn`` (the value is rounded first, the cast is exact)."""
    return e4m3_round(v, overflow).astype(jnp.float8_e4m3fn)


def e4m3_to_f32(s: jax.Array) -> jax.Array:
    """E4M3FN (``float8_e4m3fn``, or raw uint8 bytes) -> float32, exact."""
    if s.dtype == jnp.uint8:
        s = lax.bitcast_convert_type(s, jnp.float8_e4m3fn)
    return s.astype(jnp.float32)


def e4m3_bytes(s: jax.Array) -> jax.Array:
    """View E4M3FN values as their uint8 bytes."""
    return lax.bitcast_convert_type(s, jnp.uint8)


def e2m1_round_magnitude(mag: jax.Array) -> jax.Array:
    """RNE of non-negative float32 onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating (Inf -> 6)."""
    r = _round_to_grid(jnp.where(jnp.isfinite(mag), mag, 0.0), 1, 0)
    return jnp.where((r > E2M1_MAX) | jnp.isinf(mag), E2M1_MAX, r)


def e2m1_encode(
    y: jax.Array, *, negative_zero: str = "sign_of_input", nan_code: int | None = None
) -> jax.Array:
    """float32 -> E2M1 codes 0..15 (uint8), RNE ties-to-even, saturating.

    ``negative_zero``: "sign_of_input" (sign bit from the float's sign, as hardware cvt and
    ml_dtypes) or "never" (+0 whenever the magnitude code is 0, as b12x packers).
    ``nan_code``: code written for NaN inputs (ml_dtypes/JAX write 8); None leaves NaN -> 0.
    """
    y = jnp.asarray(y, jnp.float32)
    isnan = jnp.isnan(y)
    r = e2m1_round_magnitude(jnp.where(isnan, 0.0, jnp.abs(y)))
    # magnitude code = number of table entries (after 0) that r reaches
    code = (
        (r >= 0.5).astype(jnp.uint8) + (r >= 1.0) + (r >= 1.5) + (r >= 2.0)
        + (r >= 3.0) + (r >= 4.0) + (r >= 6.0)
    ).astype(jnp.uint8)
    neg = jnp.signbit(y)
    if negative_zero == "never":
        neg = neg & (code != 0)
    elif negative_zero != "sign_of_input":
        raise ValueError(f"negative_zero: expected 'sign_of_input' or 'never', got {negative_zero!r}")
    code = code | (neg.astype(jnp.uint8) << 3)
    if nan_code is not None:
        code = jnp.where(isnan, jnp.uint8(nan_code), code)
    return code


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """E2M1 codes 0..15 (any integer dtype) -> float32 (code 8 -> -0.0)."""
    return jnp.take(E2M1_VALUES, codes.astype(jnp.int32), mode="clip")


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Codes [..., K] -> bytes [..., K/2], element 2j in the low nibble."""
    c = codes.astype(jnp.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Bytes [..., K/2] -> codes [..., K] (uint8), inverse of :func:`pack_nibbles`."""
    lo = packed & 0xF
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
