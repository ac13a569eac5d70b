"""NVFP4 GEMM whose only error is one final rounding.

``out[m, n] = alpha * sum_k a[m,k] * w[n,k]`` with ``a`` and ``w`` NVFP4 (codes x E4M3 block
scales) and ``alpha = a.decode_scale * w.decode_scale`` (TensorRT-LLM ``nvfp4_gemm``).

Every product of an E2M1 value (a multiple of 1/2, |.| <= 6) and an E4M3 scale (a multiple of
2^-9, <= 448) is an integer multiple of 2^-10, so each scaled operand is an integer
``q = 2*e2m1 * 512*e4m3`` (|q| <= 12 * 229376 < 2^22) and the dot product is an integer
multiple of 2^-20. The integer sums are computed exactly: each operand is split into two
11-bit halves, the four half-products are dotted in float64 (every partial sum is an integer
below 2^53 for K < 2^30, so any summation order, BLAS included, is exact) and recombined in
int64. The int64 accumulator is converted to float64 once (the only rounding, and none at
all below 2^53), scaled by 2^-20 (exact), then multiplied by alpha (float64).
"""

from __future__ import annotations

import numpy as np

from .formats import e2m1_decode, e4m3_scale_units, unpack_nibbles
from .quantize import BLOCK, NVFP4, dequantize

_SPLIT = 1 << 11


def scaled_integers(t: NVFP4) -> np.ndarray:
    """Exact integer operand ``2*e2m1 * 512*e4m3`` [..., K] (int64); value = q * 2^-10."""
    twice = (2.0 * e2m1_decode(unpack_nibbles(t.codes))).astype(np.int64)  # -12..12
    units = e4m3_scale_units(t.scales)  # value * 2^9
    q = twice.reshape(twice.shape[:-1] + (-1, BLOCK)) * units[..., None]
    return q.reshape(twice.shape)


def exact_dot_int(a_int: np.ndarray, w_int: np.ndarray) -> np.ndarray:
    """Exact ``a_int @ w_int.T`` for integer matrices with |entries| < 2^22 (int64 [M, N])."""
    a_int = np.asarray(a_int, dtype=np.int64)
    w_int = np.asarray(w_int, dtype=np.int64)
    if a_int.shape[-1] >= (1 << 30):
        raise ValueError("K too large for the exact split accumulation")
    if np.abs(a_int).max(initial=0) >= (1 << 22) or np.abs(w_int).max(initial=0) >= (1 << 22):
        raise ValueError("operands exceed the 22-bit range of NVFP4 scaled integers")
    ah, al = np.divmod(a_int, _SPLIT)  # a = ah*2^11 + al, 0 <= al < 2^11
    wh, wl = np.divmod(w_int, _SPLIT)
    f = lambda u, v: np.rint(u.astype(np.float64) @ v.astype(np.float64).T).astype(np.int64)
    hh, hl, lh, ll = f(ah, wh), f(ah, wl), f(al, wh), f(al, wl)
    return (hh << 22) + ((hl + lh) << 11) + ll


def gemm_w4a4(a: NVFP4, w: NVFP4, alpha: float | None = None) -> np.ndarray:
    """``a[M, K]`` x ``w[N, K]`` -> float64 [M, N]; alpha defaults to the product of the decode scales."""
    if a.shape[-1] != w.shape[-1]:
        raise ValueError(f"w: K mismatch, a has K={a.shape[-1]}, w has K={w.shape[-1]}")
    if alpha is None:
        alpha = float(a.decode_scale) * float(w.decode_scale)
    acc = exact_dot_int(scaled_integers(a), scaled_integers(w))
    return np.ldexp(acc.astype(np.float64), -20) * float(alpha)


def gemm_w4a16(x: np.ndarray, w: NVFP4, alpha: float | None = None) -> np.ndarray:
    """``x[M, K]`` (bf16/fp32 values as float64) x dequantized ``w[N, K]`` -> float64 [M, N].

    Products are exact in float64 (8-24 bit significands times 6 bits); the float64 sum adds at
    most ``K * 2^-53`` relative error, far below any fp32-accumulating kernel's bound, which
    :func:`gemm_error_bound` adds explicitly. ``alpha`` defaults to ``w.decode_scale``.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"w: K mismatch, x has K={x.shape[-1]}, w has K={w.shape[-1]}")
    if alpha is None:
        alpha = float(w.decode_scale)
    return (x @ dequantize(w, include_decode_scale=False).T) * float(alpha)


def gemm_error_bound(
    abs_a: np.ndarray,
    abs_w: np.ndarray,
    alpha: float,
    out_ref: np.ndarray,
    *,
    accum_u: float = 2.0**-23,
    out_u: float = 2.0**-8,
    splits: int = 1,
) -> np.ndarray:
    """Bound on |kernel - oracle| for an fp32-accumulating NVFP4 GEMM, elementwise [M, N].

    Derivation: each operand value is exact in bf16 (e2m1 x e4m3 has <= 6 significant bits),
    so products are exact in fp32 and only the additions round. Any order of K-1 fp32
    additions (tensor-core trees, split-K partials added afterwards) errs by at most
    ``gamma_{K-1} * sum|a||w|`` with ``gamma_n = n*u / (1 - n*u)``. ``accum_u = 2^-23`` (twice
    fp32's unit roundoff) covers tensor cores that truncate instead of rounding. Then the
    fp32 multiply by alpha (``2^-24`` relative) and the cast to the output dtype (``out_u``:
    ``2^-8`` for bf16 (RNE), ``2^-24`` for fp32) each add one rounding of the result.
    ``abs_a``: |a| values [M, K]; ``abs_w``: |w| values [N, K] (without global scales).
    """
    k = abs_a.shape[-1] + max(splits - 1, 0)
    nu = (k - 1) * accum_u
    gamma = nu / (1.0 - nu)
    s = np.asarray(abs_a, np.float64) @ np.asarray(abs_w, np.float64).T
    acc_err = abs(alpha) * gamma * s
    # relative roundings of alpha-multiply and output cast apply to the (perturbed) result
    mag = np.abs(out_ref) + acc_err
    return acc_err + (2.0**-24 + out_u) * mag * (1 + 2.0**-23) + np.finfo(np.float32).tiny
