"""E2M1 (FP4) and E4M3FN (FP8) coding, exact, from float64.

Bit layouts (stated once, here):

* E2M1: 4 bits ``s ee m``, bias 1, no Inf/NaN. Magnitude codes 0..7 are
  0, 0.5, 1, 1.5, 2, 3, 4, 6; code 1 (0.5) is the only subnormal. Codes 8..15 are
  the negatives (8 is -0).
* E4M3FN: 8 bits ``s eeee mmm``, bias 7. ``e >= 1``: ``2^(e-7) * (1 + m/8)``;
  ``e == 0``: subnormal ``m * 2^-9``. Max finite 448 (0x7E). 0x7F / 0xFF are NaN.
  No Inf. NVFP4 block scales are UE4M3: the same bytes with the sign bit 0.

Rounding is round-to-nearest, ties-to-even, computed once from the float64 value
(``np.rint`` on a value scaled by an exact power of two), never through float32:
torch (2.13) and ml_dtypes before 0.7 round float64 twice (through float32) and are not
exact near ties; ml_dtypes 0.7 rounds once.
Only numpy and Python integers are used.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MIN_SUBNORMAL = 2.0**-9

#: magnitude of each E2M1 code 0..7
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
#: value of each of the 16 E2M1 codes (code 8 is -0.0)
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])

OverflowPolicy = Literal["saturate", "nan"]
E2M1NaNPolicy = Literal["raise", "neg_zero"]


def _round_to_grid(mag: np.ndarray, mant_bits: int, min_exp: int) -> np.ndarray:
    """RNE of non-negative finite float64 ``mag`` onto a binary float grid with
    ``mant_bits`` fraction bits and minimum (normal) exponent ``min_exp``, unbounded above.

    The quantum at exponent e is 2^(e - mant_bits), with e clamped below at min_exp
    (gradual underflow). Division by the quantum is exact (a power of two), so
    ``np.rint`` (ties to even) is the only rounding.
    """
    mag = np.asarray(mag, dtype=np.float64)
    out = np.zeros_like(mag)
    nz = mag > 0
    m = mag[nz]
    _, e2 = np.frexp(m)  # m = f * 2^e2 with f in [0.5, 1) -> exponent of m is e2 - 1
    exp = np.maximum(e2 - 1, min_exp)
    quantum = np.ldexp(1.0, exp - mant_bits)
    out[nz] = np.rint(m / quantum) * quantum  # a carry to the next binade stays exact
    return out


# ---------------------------------------------------------------------------------------
# E4M3FN
# ---------------------------------------------------------------------------------------

def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """Decode E4M3FN bytes (uint8 array, any shape) to float64. 0x7F/0xFF -> NaN, 0x80 -> -0."""
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise TypeError(f"codes: expected uint8 E4M3 bytes, got dtype {c.dtype}")
    c = c.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 0x7
    mag = np.where(e == 0, m * 2.0**-9, np.ldexp(1.0 + m / 8.0, e - 7))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return sign * mag


def e4m3_round(values: np.ndarray, overflow: OverflowPolicy = "saturate") -> np.ndarray:
    """Round float64 values to the nearest E4M3FN value (RNE, subnormals down to 2^-9).

    ``overflow``: ``"saturate"`` (CUDA ``__nv_fp8_e4m3``/``cvt.rn.satfinite``, torch >= 2.12:
    anything above 448 after rounding, and +-Inf, become +-448) or ``"nan"`` (ml_dtypes,
    JAX, torch < 2.12: a value that rounds above 448 becomes NaN, so 464 -> 448 (tie to
    even) but 464.1 -> NaN; +-Inf -> NaN). NaN stays NaN under both policies.
    """
    if overflow not in ("saturate", "nan"):
        raise ValueError(f"overflow: expected 'saturate' or 'nan', got {overflow!r}")
    v = np.asarray(values, dtype=np.float64)
    mag = np.abs(v)
    finite = np.isfinite(mag)
    r = _round_to_grid(np.where(finite, mag, 0.0), 3, -6)
    over = (r > E4M3_MAX) | (np.isinf(mag))
    if overflow == "saturate":
        r = np.where(over, E4M3_MAX, r)
    else:
        r = np.where(over, np.nan, r)
    r = np.where(np.isnan(mag), np.nan, r)
    return np.copysign(r, v)


def e4m3_encode(values: np.ndarray, overflow: OverflowPolicy = "saturate") -> np.ndarray:
    """Encode float64 values as E4M3FN bytes (uint8), rounding as :func:`e4m3_round`.

    NaN -> 0x7F (0xFF when the sign bit is set); signed zero keeps its sign (0x80).
    """
    v = np.asarray(values, dtype=np.float64)
    r = e4m3_round(v, overflow)
    return _e4m3_bits_of_representable(r)


def _e4m3_bits_of_representable(r: np.ndarray) -> np.ndarray:
    sign = np.signbit(r).astype(np.int64) << 7
    mag = np.abs(r)
    nan = np.isnan(mag)
    mag = np.where(nan, 0.0, mag)
    sub = mag < E4M3_MIN_NORMAL
    # subnormal: m = mag / 2^-9 ; normal: e = floor(log2 mag) + 7, m = (mag/2^(e-7) - 1) * 8
    _, e2 = np.frexp(np.where(sub, 1.0, mag))
    e = e2 - 1 + 7
    m_norm = (np.ldexp(np.where(sub, 1.0, mag), -(e - 7)) - 1.0) * 8.0
    m_sub = mag / 2.0**-9
    bits = np.where(sub, m_sub.astype(np.int64), (e << 3) | m_norm.astype(np.int64))
    bits = np.where(nan, 0x7F, bits) | sign
    return bits.astype(np.uint8)


def e4m3_scale_units(codes: np.ndarray) -> np.ndarray:
    """E4M3 bytes -> exact integer multiples of 2^-9 (int64): value = units * 2^-9.

    The sign bit is ignored (UE4M3, as cuBLAS does); NaN codes raise.
    """
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise TypeError(f"codes: expected uint8 E4M3 bytes, got dtype {c.dtype}")
    c = c.astype(np.int64) & 0x7F
    if np.any(c == 0x7F):
        raise ValueError("scales: E4M3 NaN code (0x7F/0xFF) in a block scale")
    e = c >> 3
    m = c & 0x7
    return np.where(e == 0, m, (8 + m) << np.maximum(e - 1, 0))


# ---------------------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------------------

def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """Decode E2M1 codes (integers 0..15, any integer dtype) to float64; code 8 -> -0.0."""
    c = np.asarray(codes)
    if not np.issubdtype(c.dtype, np.integer):
        raise TypeError(f"codes: expected integer E2M1 codes, got dtype {c.dtype}")
    if c.size and (c.min() < 0 or c.max() > 15):
        raise ValueError("codes: E2M1 codes must lie in 0..15")
    return E2M1_VALUES[c.astype(np.int64)]


def e2m1_round_magnitude(mag: np.ndarray) -> np.ndarray:
    """RNE of non-negative float64 magnitudes onto {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6."""
    m = np.asarray(mag, dtype=np.float64)
    r = _round_to_grid(np.where(np.isfinite(m), m, 0.0), 1, 0)
    return np.where((r > E2M1_MAX) | np.isinf(m), E2M1_MAX, r)


def e2m1_magnitude_code(mag: np.ndarray) -> np.ndarray:
    """Code 0..7 of an E2M1-representable magnitude (float64)."""
    r = np.asarray(mag, dtype=np.float64)
    return np.searchsorted(E2M1_MAGNITUDES, r).astype(np.uint8)


def e2m1_encode(
    values: np.ndarray,
    *,
    nan: E2M1NaNPolicy = "raise",
    negative_zero: Literal["sign_of_input", "never"] = "sign_of_input",
) -> np.ndarray:
    """Encode float64 values as E2M1 codes 0..15 (uint8, one code per element).

    RNE with ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4),
    saturating (> 5 and +-Inf -> +-6), as PTX ``cvt.rn.satfinite.e2m1x2.f32`` and
    ml_dtypes ``float4_e2m1fn``.

    ``negative_zero``: ``"sign_of_input"`` sets the sign bit for every input with the sign
    bit set, including -0.0 and negatives that round to 0 (hardware cvt, ml_dtypes);
    ``"never"`` writes +0 whenever the magnitude code is 0 (b12x's packers).
    ``nan``: ``"raise"`` (default) or ``"neg_zero"`` (ml_dtypes/JAX map NaN to code 8).
    """
    v = np.asarray(values, dtype=np.float64)
    isnan = np.isnan(v)
    if np.any(isnan) and nan == "raise":
        raise ValueError("values: NaN cannot be encoded as E2M1 (pass nan='neg_zero' for ml_dtypes behaviour)")
    code = e2m1_magnitude_code(e2m1_round_magnitude(np.abs(np.where(isnan, 0.0, v))))
    neg = np.signbit(v)
    if negative_zero == "never":
        neg = neg & (code != 0)
    elif negative_zero != "sign_of_input":
        raise ValueError(f"negative_zero: expected 'sign_of_input' or 'never', got {negative_zero!r}")
    code = code | (neg.astype(np.uint8) << 3)
    return np.where(isnan, np.uint8(8), code).astype(np.uint8)


# ---------------------------------------------------------------------------------------
# Packing: element 2j -> low nibble, 2j+1 -> high nibble
# ---------------------------------------------------------------------------------------

def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack E2M1 codes [..., K] (K even) into bytes [..., K/2]: element 2j in the low nibble."""
    c = np.asarray(codes)
    if c.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even, got shape {c.shape}")
    c = c.astype(np.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: bytes [..., K/2] -> codes [..., K] (uint8)."""
    p = np.asarray(packed)
    if p.dtype != np.uint8:
        raise TypeError(f"packed: expected uint8, got dtype {p.dtype}")
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


# ---------------------------------------------------------------------------------------
# IEEE float32 arithmetic on float64 carriers
# ---------------------------------------------------------------------------------------
# The recipes reproduce each system's order of fp32 operations. Each op is computed in
# float64 and rounded once to float32: exact for products of two fp32 values, and correctly
# rounded for sums/quotients too, because float64 has >= 2*24+2 significand bits (double
# rounding is innocuous). float32 subnormals are kept (no flush-to-zero).

FLT_MAX = float(np.finfo(np.float32).max)


def f32(v) -> np.ndarray:
    """Round float64 to the nearest float32 (RNE) and return it as float64. Beyond the float32
    range the result is +-inf, as IEEE rounding gives (numpy's overflow warning is silenced:
    it is the defined result, not an error)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=np.float64).astype(np.float32).astype(np.float64)


def f32_mul(a, b) -> np.ndarray:
    return f32(np.multiply(a, b, dtype=np.float64))


def f32_div(a, b) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return f32(np.divide(a, b, dtype=np.float64))


def f32_rcp(a) -> np.ndarray:
    """Correctly rounded fp32 reciprocal (1/0 = inf).

    TensorRT-LLM's fast path uses ``rcp.approx.ftz.f32``, which is within 1 ulp of this and
    differs from it for about 13 % of inputs; a CPU oracle cannot reproduce it bit for bit.
    """
    return f32_div(1.0, a)


def is_f32_representable(x: np.ndarray) -> bool:
    x = np.asarray(x, dtype=np.float64)
    fin = np.isfinite(x)
    return bool(np.all(f32(x[fin]) == x[fin]))


def bf16_round(v) -> np.ndarray:
    """Round float64 values to the nearest bfloat16 (RNE, from float64 in one step)."""
    v = np.asarray(v, dtype=np.float64)
    mag = np.abs(v)
    fin = np.isfinite(mag)
    # bf16: 7 fraction bits, min normal exponent -126; overflow to inf above the max
    r = _round_to_grid(np.where(fin, mag, 0.0), 7, -126)
    bf16_max = float.fromhex("0x1.fep127")
    r = np.where(r > bf16_max, np.inf, r)
    r = np.where(fin, r, mag)
    return np.copysign(r, v)
