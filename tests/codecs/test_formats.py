"""E2M1 / E4M3FN coding: every code, every rounding boundary, oracle and JAX.

Expected values come from the bit layouts written out here, from ``fractions.Fraction``
arithmetic, or from ml_dtypes / torch on float32 inputs (where those round once).
"""

from __future__ import annotations

import bisect
import itertools
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import f32_bits
from peer_facts import peer_fact

import oracle
from nvfp4_jax import formats as F
from oracle import formats as OF

# jitted once per static argument set: eager op-by-op dispatch would compile every op
_e4m3_encode_j = jax.jit(F.e4m3_encode, static_argnums=1)
_e2m1_encode_j = jax.jit(F.e2m1_encode, static_argnames=("negative_zero", "nan_code"))

ALL_BYTES = np.arange(256, dtype=np.uint8)


def _e4m3_value_from_bits(code: int) -> Fraction | None:
    """E4M3FN value of one byte from the bit layout (None for NaN)."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return None
    if e == 0:
        mag = Fraction(m, 8) * Fraction(1, 64)  # subnormal: m/8 * 2^-6
    else:
        mag = (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
    return -mag if s else mag


E2M1_MAG = [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2), Fraction(3),
            Fraction(4), Fraction(6)]


def _rne_fraction(v: Fraction, grid: list[tuple[Fraction, int]]) -> int:
    """Code of the nearest grid value to v >= 0 (grid sorted ascending); ties to the code
    with mantissa bit 0."""
    i = bisect.bisect_left([g for g, _ in grid], v)
    cands = grid[max(i - 1, 0): i + 1]
    best = min(cands, key=lambda gc: (abs(v - gc[0]), gc[1] & 1))
    return best[1]


E4M3_POS = [(_e4m3_value_from_bits(c), c) for c in range(0x7F)]
E2M1_POS = [(v, c) for c, v in enumerate(E2M1_MAG)]


def _e4m3_exact(v: float, overflow: str) -> int:
    """First-principles E4M3 byte of a float64 (RNE; beyond 464 -> 448 or NaN)."""
    if np.isnan(v):
        return 0x7F
    f = Fraction(abs(v)) if np.isfinite(v) else None
    sign = 0x80 if np.signbit(v) else 0
    if f is None or f > 464:
        return sign | (0x7E if overflow == "saturate" else 0x7F)
    if f == 464:  # tie between 448 (m=6, even) and 480 (not representable): to 448
        return sign | 0x7E
    return sign | _rne_fraction(f, E4M3_POS)


def _e2m1_exact(v: float) -> int:
    f = Fraction(abs(v)) if np.isfinite(v) else Fraction(100)
    code = _rne_fraction(min(f, Fraction(7)), E2M1_POS)  # > 5 -> 6 (code 7)
    return code | (8 if np.signbit(v) else 0)


# ---------------------------------------------------------------------------------------
# E4M3: all 256 codes
# ---------------------------------------------------------------------------------------

def test_e4m3_decode_all_codes_from_bit_layout():
    got = oracle.e4m3_decode(ALL_BYTES)
    for c in range(256):
        want = _e4m3_value_from_bits(c)
        if want is None:
            assert np.isnan(got[c]), hex(c)
        else:
            assert Fraction(float(got[c])) == want, hex(c)
            assert np.signbit(got[c]) == bool(c & 0x80), hex(c)


def test_e4m3_decode_all_codes_vs_ml_dtypes_and_torch():
    ref_ml = ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ref_t = torch.from_numpy(ALL_BYTES.copy()).view(torch.float8_e4m3fn).double().numpy()
    got = oracle.e4m3_decode(ALL_BYTES)
    got_j = np.asarray(F.e4m3_to_f32(jnp.asarray(ALL_BYTES))).astype(np.float64)
    for ref in (ref_ml, ref_t, got_j):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        ok = ~np.isnan(got)
        np.testing.assert_array_equal(got[ok], ref[ok])
        np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(ref[ok]))
    assert np.isnan(got[[0x7F, 0xFF]]).all() and np.isnan(got).sum() == 2


def test_e4m3_reencode_all_codes():
    vals = oracle.e4m3_decode(ALL_BYTES)
    ok = ~np.isnan(vals)
    for policy in ("saturate", "nan"):
        np.testing.assert_array_equal(oracle.e4m3_encode(vals[ok], policy), ALL_BYTES[ok])
    assert oracle.e4m3_encode(np.array([np.nan]))[0] == 0x7F
    assert oracle.e4m3_encode(np.array([-np.nan]))[0] == 0xFF
    # JAX: round then cast, bytes identical
    j = np.asarray(F.e4m3_bytes(_e4m3_encode_j(jnp.asarray(vals[ok], jnp.float32), 'saturate')))
    np.testing.assert_array_equal(j, ALL_BYTES[ok])


def test_e4m3_scale_units_all_codes():
    units = OF.e4m3_scale_units(ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F])
    vals = np.abs(oracle.e4m3_decode(ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F]))
    np.testing.assert_array_equal(units * 2.0**-9, vals)  # sign ignored (UE4M3)
    with pytest.raises(ValueError, match="NaN"):
        OF.e4m3_scale_units(np.array([0x7F], np.uint8))


def _e4m3_boundaries() -> np.ndarray:
    """Every E4M3 value, every midpoint between neighbours, and the float32 neighbours
    of each (ulp above/below), plus the special points of the brief."""
    vals = [float(v) for v, _ in E4M3_POS]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(vals)] + [464.0]
    pts = np.array(vals + mids + [2.0**-10, 2.0**-9, 2.0**-6, 1.5 * 2.0**-10, 448.0, 464.0,
                                   480.0, 1e6, 2.0**-12, 7.5 * 2.0**-9], np.float32)
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(0))
    allp = np.concatenate([pts, up, down])
    return np.concatenate([allp, -allp]).astype(np.float32)


def test_e4m3_rounding_boundaries_first_principles():
    x = _e4m3_boundaries().astype(np.float64)
    for policy in ("saturate", "nan"):
        got = oracle.e4m3_encode(x, policy)
        want = np.array([_e4m3_exact(v, policy) for v in x], np.uint8)
        np.testing.assert_array_equal(got, want)


def test_e4m3_named_points():
    enc = lambda v, p="saturate": int(oracle.e4m3_encode(np.array([v]), p)[0])
    assert enc(2.0**-10) == 0x00  # tie between 0 and 2^-9 -> 0 (even)
    assert enc(np.nextafter(2.0**-10, 1)) == 0x01
    assert enc(1.5 * 2.0**-10) == 0x01  # below the 2^-9 / 2*2^-9 midpoint
    assert enc(2.0**-9) == 0x01 and enc(2.0**-6) == 0x08
    assert enc(7.5 * 2.0**-9) == 0x08  # midpoint of 7*2^-9 and 2^-6 -> even mantissa (0x08)
    assert enc(448.0) == 0x7E and enc(464.0) == 0x7E and enc(464.0, "nan") == 0x7E
    assert enc(np.nextafter(464.0, 1000)) == 0x7E and enc(np.nextafter(464.0, 1000), "nan") == 0x7F
    assert enc(np.inf) == 0x7E and enc(np.inf, "nan") == 0x7F and enc(-np.inf) == 0xFE
    assert enc(np.nan) == 0x7F and enc(-0.0) == 0x80


def test_e4m3_float32_vs_ml_dtypes_and_torch_random_and_boundaries():
    """On float32 inputs ml_dtypes and torch round once: oracle == them byte for byte on the
    boundary set and 2^18 random float32 bit patterns spanning 2^-12 .. 2^10, with each
    peer's recorded overflow policy (NaN or saturate, tests/peer_facts.py)."""
    rng = np.random.default_rng(0)
    e = rng.integers(127 - 12, 127 + 10, 1 << 18, dtype=np.uint32)
    bits = (e << 23) | rng.integers(0, 1 << 23, 1 << 18, dtype=np.uint32)
    bits |= rng.integers(0, 2, 1 << 18, dtype=np.uint32) << 31
    x = np.concatenate([bits.view(np.float32), _e4m3_boundaries(),
                        np.array([np.inf, -np.inf, 0.0, -0.0], np.float32)])
    ml = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    th = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    on = oracle.e4m3_encode(x.astype(np.float64), "nan")
    os_ = oracle.e4m3_encode(x.astype(np.float64), "saturate")
    np.testing.assert_array_equal(oracle.e4m3_encode(x.astype(np.float64),
                                                     peer_fact("ml_dtypes", "e4m3_overflow")), ml)
    np.testing.assert_array_equal(oracle.e4m3_encode(x.astype(np.float64),
                                                     peer_fact("torch", "e4m3_overflow")), th)
    jn = np.asarray(F.e4m3_bytes(_e4m3_encode_j(jnp.asarray(x), "nan")))
    js = np.asarray(F.e4m3_bytes(_e4m3_encode_j(jnp.asarray(x), "saturate")))
    np.testing.assert_array_equal(jn, on)
    np.testing.assert_array_equal(js, os_)


def test_e4m3_nan_input_stays_nan_jax_and_oracle():
    for policy in ("saturate", "nan"):
        assert np.isnan(oracle.e4m3_round(np.array([np.nan]), policy)[0])
        assert np.isnan(np.asarray(F.e4m3_round(jnp.array([np.nan]), policy))[0])


# ---------------------------------------------------------------------------------------
# E2M1: all 16 codes
# ---------------------------------------------------------------------------------------

def test_e2m1_decode_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    got = oracle.e2m1_decode(codes)
    want = [float(v) for v in E2M1_MAG] + [-float(v) for v in E2M1_MAG]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), codes >= 8)
    ml = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    np.testing.assert_array_equal(got, ml)
    np.testing.assert_array_equal(np.signbit(ml), codes >= 8)
    gj = np.asarray(F.e2m1_decode(jnp.asarray(codes)))
    np.testing.assert_array_equal(f32_bits(gj), f32_bits(got))


def test_e2m1_reencode_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    vals = oracle.e2m1_decode(codes)
    np.testing.assert_array_equal(oracle.e2m1_encode(vals), codes)
    np.testing.assert_array_equal(np.asarray(_e2m1_encode_j(jnp.asarray(vals, jnp.float32))), codes)
    ml = vals.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(ml, codes)


def _e2m1_boundaries() -> np.ndarray:
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    pts = np.array(mids + grid + [7.0, 100.0, 1e30, 2.0**-149], np.float32)
    allp = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                           np.nextafter(pts, np.float32(0))])
    return np.concatenate([allp, -allp]).astype(np.float32)


def test_e2m1_midpoints_first_principles():
    x = _e2m1_boundaries()
    want = np.array([_e2m1_exact(float(v)) for v in x], np.uint8)
    np.testing.assert_array_equal(oracle.e2m1_encode(x.astype(np.float64)), want)
    np.testing.assert_array_equal(np.asarray(_e2m1_encode_j(jnp.asarray(x))), want)
    ml = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(ml, want)


def test_e2m1_named_ties():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 7.0, np.inf])
    assert oracle.e2m1_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 7]
    assert oracle.e2m1_encode(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14, 15, 15, 15]


def test_e2m1_random_float32_vs_ml_dtypes_and_jax():
    rng = np.random.default_rng(1)
    e = rng.integers(127 - 30, 127 + 5, 1 << 18, dtype=np.uint32)
    bits = (e << 23) | rng.integers(0, 1 << 23, 1 << 18, dtype=np.uint32)
    bits |= rng.integers(0, 2, 1 << 18, dtype=np.uint32) << 31
    x = bits.view(np.float32)
    ml = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(oracle.e2m1_encode(x.astype(np.float64)), ml)
    np.testing.assert_array_equal(np.asarray(_e2m1_encode_j(jnp.asarray(x))), ml)


def test_e2m1_nan_policies():
    with pytest.raises(ValueError, match="NaN"):
        oracle.e2m1_encode(np.array([np.nan]))
    assert oracle.e2m1_encode(np.array([np.nan, -np.nan]), nan="neg_zero").tolist() == [8, 8]
    assert np.asarray(_e2m1_encode_j(jnp.array([np.nan]), nan_code=8)).tolist() == [8]
    # JAX's own cast (XLA) writes 8 for NaN of either sign
    j = np.asarray(jnp.array([np.nan, -np.nan], jnp.float32).astype(jnp.float4_e2m1fn))
    assert j.view(np.uint8).tolist() == [8, 8]


def test_ml_dtypes_e2m1_nan_depends_on_nan_sign():
    """ml_dtypes 0.6: +NaN -> code 8 (-0) but -NaN (e.g. numpy's 0/0 on x86) -> code 0.
    The notes say 'NaN -> -0 (code 8)' without the sign caveat (FINDINGS.md)."""
    pos = np.array([0x7FC00000], np.uint32).view(np.float32)
    neg = np.array([0xFFC00000], np.uint32).view(np.float32)
    assert pos.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0] == 8
    assert neg.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0] == 0


def test_e2m1_negative_zero_policies():
    x = np.array([-0.0, -0.1, -0.25, 0.0, -0.26])
    assert oracle.e2m1_encode(x).tolist() == [8, 8, 8, 0, 9]
    assert oracle.e2m1_encode(x, negative_zero="never").tolist() == [0, 0, 0, 0, 9]
    xj = jnp.asarray(x, jnp.float32)
    assert np.asarray(_e2m1_encode_j(xj)).tolist() == [8, 8, 8, 0, 9]
    assert np.asarray(_e2m1_encode_j(xj, negative_zero="never")).tolist() == [0, 0, 0, 0, 9]


def test_pack_nibbles_even_element_in_low_nibble():
    codes = np.array([[0x2, 0xF, 0x1, 0x0]], np.uint8)  # [+1, -6, +0.5, 0]
    assert oracle.pack_nibbles(codes).tolist() == [[0xF2, 0x01]]
    assert np.asarray(F.pack_nibbles(jnp.asarray(codes))).tolist() == [[0xF2, 0x01]]
    allc = np.arange(256, dtype=np.uint8).reshape(1, -1)
    un = oracle.unpack_nibbles(allc)
    np.testing.assert_array_equal(un[0, 0::2], np.arange(256) & 0xF)
    np.testing.assert_array_equal(un[0, 1::2], np.arange(256) >> 4)
    np.testing.assert_array_equal(oracle.pack_nibbles(un), allc)
    np.testing.assert_array_equal(np.asarray(F.unpack_nibbles(jnp.asarray(allc))), un)


# ---------------------------------------------------------------------------------------
# float64 near ties: the oracle rounds once (ml_dtypes and torch by version: test_peers.py)
# ---------------------------------------------------------------------------------------

DOUBLE_ROUNDING_E4M3 = [2.0**-10 * (1 + 2.0**-40)]                       # exact: 2^-9 (0x01)
DOUBLE_ROUNDING_E2M1 = [0.25 * (1 + 2.0**-40), 0.75 * (1 - 2.0**-40), 5 * (1 + 2.0**-40)]


def test_float64_double_rounding_oracle_exact():
    for v in DOUBLE_ROUNDING_E4M3:
        f = Fraction(v)
        assert Fraction(1, 1024) < f < Fraction(3, 2048)  # above the 0 / 2^-9 midpoint
        assert oracle.e4m3_encode(np.array([v]))[0] == _e4m3_exact(v, "saturate") == 0x01
    want = {DOUBLE_ROUNDING_E2M1[0]: 1, DOUBLE_ROUNDING_E2M1[1]: 1, DOUBLE_ROUNDING_E2M1[2]: 7}
    for v, code in want.items():
        assert _e2m1_exact(v) == code  # first principles: not a tie in float64
        assert oracle.e2m1_encode(np.array([v]))[0] == code


def test_random_float64_oracle_vs_fractions():
    """2,000 random float64 values near E4M3 midpoints (perturbed by < 2^-30 relative):
    the oracle equals first-principles RNE."""
    rng = np.random.default_rng(5)
    vals = np.array([float(v) for v, _ in E4M3_POS])
    mids = (vals[1:] + vals[:-1]) / 2
    x = rng.choice(mids, 2000) * (1 + rng.uniform(-2.0**-30, 2.0**-30, 2000))
    want = np.array([_e4m3_exact(v, "saturate") for v in x], np.uint8)
    np.testing.assert_array_equal(oracle.e4m3_encode(x), want)
    x2 = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], 2000) * (
        1 + rng.uniform(-2.0**-30, 2.0**-30, 2000))
    want2 = np.array([_e2m1_exact(v) for v in x2], np.uint8)
    np.testing.assert_array_equal(oracle.e2m1_encode(x2), want2)


def test_bf16_round_vs_ml_dtypes():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(1 << 16).astype(np.float32) * np.exp2(rng.integers(-40, 40, 1 << 16))
    x = x.astype(np.float32)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(oracle.bf16_round(x.astype(np.float64)), want)


def test_jax_formats_jit_equals_eager():
    x = _e4m3_boundaries()
    f = jax.jit(lambda v: (F.e4m3_encode(v, "saturate"), _e2m1_encode_j(v)))
    a, b = f(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(F.e4m3_bytes(a)),
                                  oracle.e4m3_encode(x.astype(np.float64), "saturate"))
    np.testing.assert_array_equal(np.asarray(b), oracle.e2m1_encode(x.astype(np.float64)))
