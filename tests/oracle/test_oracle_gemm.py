"""The oracle GEMM against exact rational arithmetic (fractions)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle

E2M1 = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]


def _e2m1_frac(code: int) -> Fraction:
    return -E2M1[code & 7] if code & 8 else E2M1[code & 7]


def _e4m3_frac(byte: int) -> Fraction:
    e, m = (byte >> 3) & 0xF, byte & 7
    return Fraction(m, 512) if e == 0 else Fraction(8 + m, 8) * Fraction(2) ** (e - 7)


def _values_frac(t: oracle.NVFP4):
    codes = oracle.unpack_nibbles(t.codes)
    rows, k = codes.shape
    return [[_e2m1_frac(int(codes[r, j])) * _e4m3_frac(int(t.scales[r, j // 16]))
             for j in range(k)] for r in range(rows)]


def _random_nvfp4(rng, rows, k, decode_scale):
    codes = rng.integers(0, 16, (rows, k), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (rows, k // 16), dtype=np.uint8)  # all finite codes incl. 0
    scales[rng.random(scales.shape) < 0.1] = 0x7E
    return oracle.NVFP4(oracle.pack_nibbles(codes), scales, np.float64(decode_scale))


@settings(max_examples=60)
@given(m=st.integers(1, 4), n=st.integers(1, 4), kb=st.integers(1, 3), seed=st.integers(0, 2**31),
       log2_da=st.integers(-20, 5), log2_dw=st.integers(-20, 5))
def test_gemm_w4a4_exact_rational(m, n, kb, seed, log2_da, log2_dw):
    """Property: with power-of-two decode scales (so alpha is exact), gemm_w4a4 ==
    alpha * sum_k a*w computed in Fractions, then rounded once to float64."""
    rng = np.random.default_rng(seed)
    k = 16 * kb
    a = _random_nvfp4(rng, m, k, 2.0**log2_da)
    w = _random_nvfp4(rng, n, k, 2.0**log2_dw)
    got = oracle.gemm_w4a4(a, w)
    av, wv = _values_frac(a), _values_frac(w)
    alpha = Fraction(2.0**log2_da) * Fraction(2.0**log2_dw)
    for i in range(m):
        for j in range(n):
            exact = alpha * sum(x * y for x, y in zip(av[i], wv[j]))
            assert got[i, j] == float(exact), (i, j, got[i, j], exact)


def test_gemm_w4a4_cancellation_is_exact():
    """A sum where float64 accumulation of the products would lose the small term:
    448*6 * 448*6 products cancel exactly, leaving 2^-9 * 0.5 * 2^-9 * 0.5."""
    k = 32
    ca = np.zeros((1, k), np.uint8)
    cw = np.zeros((1, k), np.uint8)
    ca[0, 0], cw[0, 0] = 7, 7     # +6 * 448 (block 0, scale 448)
    ca[0, 1], cw[0, 1] = 15, 7    # -6 * 448 -> cancels
    ca[0, 16], cw[0, 16] = 1, 1   # 0.5 * 2^-9 each (block 1, scale 2^-9)
    sa = np.array([[0x7E, 0x01]], np.uint8)
    sw = np.array([[0x7E, 0x01]], np.uint8)
    a = oracle.NVFP4(oracle.pack_nibbles(ca), sa, np.float64(1.0))
    w = oracle.NVFP4(oracle.pack_nibbles(cw), sw, np.float64(1.0))
    assert oracle.gemm_w4a4(a, w)[0, 0] == float(Fraction(1, 4) * Fraction(1, 2**18))


def test_gemm_w4a4_large_k_integer_exactness():
    """K = 4096 of maximal products: the int64 accumulator equals the Python-int sum."""
    rng = np.random.default_rng(1)
    a = _random_nvfp4(rng, 3, 4096, 1.0)
    w = _random_nvfp4(rng, 2, 4096, 1.0)
    ai, wi = oracle.scaled_integers(a), oracle.scaled_integers(w)
    got = oracle.exact_dot_int(ai, wi)
    for i in range(3):
        for j in range(2):
            assert int(got[i, j]) == sum(int(x) * int(y) for x, y in zip(ai[i], wi[j]))


def test_scaled_integers_are_the_values():
    rng = np.random.default_rng(2)
    a = _random_nvfp4(rng, 2, 32, 1.0)
    q = oracle.scaled_integers(a)
    av = _values_frac(a)
    for r in range(2):
        for j in range(32):
            assert Fraction(int(q[r, j]), 1024) == av[r][j]


def test_gemm_w4a16_matches_fractions():
    rng = np.random.default_rng(3)
    w = _random_nvfp4(rng, 3, 32, 2.0**-3)
    x = rng.standard_normal((2, 32)).astype(np.float32).astype(np.float64)
    got = oracle.gemm_w4a16(x, w)
    wv = _values_frac(w)
    for i in range(2):
        for j in range(3):
            exact = Fraction(2.0**-3) * sum(Fraction(float(a)) * b for a, b in zip(x[i], wv[j]))
            # float64 summation of exact products: relative error <= K * 2^-53 of sum|.|
            mags = sum(abs(Fraction(float(a)) * b) for a, b in zip(x[i], wv[j]))
            bound = 32 * 2.0**-52 * float(mags) * 2.0**-3
            assert abs(got[i, j] - float(exact)) <= bound


def test_gemm_rejects_mismatched_k():
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="K mismatch"):
        oracle.gemm_w4a4(_random_nvfp4(rng, 1, 16, 1.0), _random_nvfp4(rng, 1, 32, 1.0))


def test_gemm_rejects_nan_scale():
    rng = np.random.default_rng(5)
    a = _random_nvfp4(rng, 1, 16, 1.0)
    bad = oracle.NVFP4(a.codes, np.array([[0x7F]], np.uint8), np.float64(1.0))
    with pytest.raises(ValueError, match="NaN"):
        oracle.gemm_w4a4(bad, a)


def test_gemm_of_quantized_equals_dequantized_dot():
    """gemm_w4a4(quantize(x), quantize(w)) == exact dot of the dequantized operands times
    alpha (both sides rational; compared after one rounding)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 48)).astype(np.float32)
    w = rng.standard_normal((3, 48)).astype(np.float32)
    a = oracle.quantize(x, "trtllm", decode_scale=2.0**-9)
    b = oracle.quantize(w, "trtllm", decode_scale=2.0**-9)
    got = oracle.gemm_w4a4(a, b)
    av, bv = _values_frac(a), _values_frac(b)
    for i in range(2):
        for j in range(3):
            exact = Fraction(2.0**-18) * sum(p * q for p, q in zip(av[i], bv[j]))
            assert got[i, j] == float(exact)
