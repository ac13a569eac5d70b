"""Decode attention in float64, and the error bound of an fp32 flash-decoding kernel.

One query token per sequence against its KV cache: query head ``i`` of ``NH`` reads kv head
``i // (NH / KVH)`` (GQA), keys ``0 .. lengths[b] - 1`` only,
``o = softmax(q k^T / sqrt(D)) v`` over the exact values of the (bf16) inputs.

The bound covers a kernel with fp32 arithmetic and these rounding points (those of
``nvfp4_jax.attention.decode_attention`` and of the decoders' XLA attention, in another
order): scores ``q . k`` accumulated in fp32 from exact bf16 products, times fp32
``1/sqrt(D)``;
probabilities ``exp(s - m)`` in fp32, rounded to bf16 for the ``p . v`` dot (fp32
accumulation); their sum in fp32, unrounded; partial results over chunks of keys combined in
fp32; the output rounded to bf16 once. Per output element ``i`` of a query head (``p`` the
exact probabilities, ``o`` the exact output):

* the scores carry fp32 error ``E <= (D + 2) 2^-24 max_s sum_d |q_d k_sd| / sqrt(D)``
  (accumulation, the ``1/sqrt(D)`` factor and its product), which moves each probability by a
  relative ``2 E`` at most (numerator and normalizer);
* ``exp`` adds ``2^-21``; rounding the probabilities to bf16 ``2^-8``; the fp32 sums over
  ``S`` keys and the chunks' combine ``(S + 8) 2^-24``;

so ``|o~_i - o_i| <= eta sum_s p_s |v_si| + (2 E + 2^-21 + (S + 8) 2^-24) |o_i|`` with
``eta = 2^-8 + 2 E + 2^-21 + (S + 8) 2^-24``, and the bf16 output adds ``2^-8 |o_i|`` (half
an ulp, relative to the rounded value's binade). Second-order terms are covered by a factor
1.01. A kernel that normalizes the probabilities before their bf16 rounding (XLA's softmax,
``attention.cache_attention``) moves the normalizer's fp32 sum and its division (<= 2 ulp)
into the same ``(S + 8) 2^-24`` term.
"""

from __future__ import annotations

import math

import numpy as np

from .formats import bf16_round, f32


def _check(q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths) -> tuple[int, ...]:
    if q.ndim != 3:
        raise ValueError(f"q: expected [B, NH, D], got shape {q.shape}")
    b, nh, d = q.shape
    if k.ndim != 4 or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: expected [B={b}, S, KVH, D={d}], got shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    s, kvh = k.shape[1], k.shape[2]
    if nh % kvh:
        raise ValueError(f"q: NH = {nh} query heads is not a multiple of KVH = {kvh}")
    lengths = np.asarray(lengths)
    if lengths.shape != (b,) or (lengths < 1).any() or (lengths > s).any():
        raise ValueError(f"lengths: expected [B={b}] integers in 1..S = {s}, got {lengths}")
    return b, nh, d, kvh


def _attend(q, k, v, lengths, with_bound: bool):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, nh, d, kvh = _check(q, k, v, lengths)
    g = nh // kvh
    o = np.zeros((b, nh, d))
    bound = np.zeros((b, nh, d)) if with_bound else None
    for bi in range(b):
        n = int(lengths[bi])
        for h in range(kvh):
            kk, vv = k[bi, :n, h], v[bi, :n, h]  # [n, D]
            qq = q[bi, h * g:(h + 1) * g]  # [g, D]: this kv head's query heads
            sc = qq @ kk.T / math.sqrt(d)  # [g, n]
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            oo = p @ vv
            o[bi, h * g:(h + 1) * g] = oo
            if with_bound:
                e = (d + 2) * 2.0**-24 * (np.abs(qq) @ np.abs(kk).T).max(axis=1) / math.sqrt(d)
                rel = (2 * e + 2.0**-21 + (n + 8) * 2.0**-24)[:, None]
                bound[bi, h * g:(h + 1) * g] = 1.01 * ((2.0**-8 + rel) * (p @ np.abs(vv))
                                                       + (rel + 2.0**-8) * np.abs(oo))
    return o, bound


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths) -> np.ndarray:
    """float64 [B, NH, D]: q [B, NH, D] against one layer's cache k, v [B, S, KVH, D] (the
    values of the kernel's bf16 inputs, as float64), keys ``0 .. lengths[b] - 1``
    (1 <= lengths[b] <= S; slots past them are never read and may hold anything)."""
    return _attend(q, k, v, lengths, False)[0]


def decode_attention_error_bound(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                 lengths) -> tuple[np.ndarray, np.ndarray]:
    """(exact output, bound) float64 [B, NH, D] each: :func:`decode_attention` and the bound
    of the module docstring on ``|bf16 kernel output - exact|`` per element."""
    return _attend(q, k, v, lengths, True)




def _fp32_error(v):
    """Bound on |fp32(v) - v| for one rounding of the exact value v: 0 where v is an fp32
    value (the rounding is exact), else half an ulp (2^-24 |v|, 2^-150 among subnormals)."""
    return np.where(f32(v) == v, 0.0, np.maximum(2.0**-24 * np.abs(v), 2.0**-150))


def norm_rope_interval(x: np.ndarray, weight: np.ndarray | None, eps: float,
                       cos: np.ndarray | None, sin: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) float64 [..., D]: the bf16 values an fp32 kernel with the decoders' rounding
    points may give for a head's RMSNorm then rotate-half RoPE (``nn.rms_norm``,
    ``models.apply_rope``, ``nvfp4_jax.attention.decode_qkv_attention``).

    x: [..., D] the head's bf16 values; weight: [D] the RMSNorm weight (bf16 values), or None
    for no norm; cos, sin: [..., D] broadcasting against x, bf16 values (``models.rope_tables``
    rounds them), or None for no RoPE. Rounding points: ``y = bf16(x * r)`` with ``r =
    rsqrt(fp32 sum(x^2) / D + eps)``, ``n = bf16(weight * y)``, ``out = bf16(n cos + rot(n)
    sin)`` with ``rot(n) = [-n[D/2:], n[:D/2]]``, fp32 in between.

    Each bf16 rounding is computed exactly, in float64, from the interval that holds the
    kernel's fp32 value: ``x * r`` within ``D 2^-25 + 2^-21 + 2^-24`` relative of the exact
    ``x / sqrt(mean(x^2) + eps)`` (the fp32 sum of exact bf16 squares within ``(D - 1)
    2^-24``, halved by the square root; ``+ eps``, rsqrt's 2 ulp and the product's rounding);
    ``weight * y`` exact in fp32 (bf16 times bf16); ``n cos`` and ``rot(n) sin`` exact in fp32
    (bf16 products) and their sum rounded once (none where it is an fp32 value). A kernel's
    value must lie in [lo, hi]: lo == hi (the correctly rounded value, ties to even) except
    where the inexact rsqrt can cross a bf16 rounding boundary, there an ulp apart.
    """
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"x: expected an even head dimension D, got {d}")
    if weight is None:
        lo = hi = x
    else:
        w = np.asarray(weight, np.float64)
        if w.shape != (d,):
            raise ValueError(f"weight: expected [D={d}], got shape {w.shape}")
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        width = (d * 2.0**-25 + 2.0**-21 + 2.0**-24) * np.abs(y) + 2.0**-149
        ylo, yhi = bf16_round(y - width), bf16_round(y + width)
        a, b = bf16_round(w * ylo), bf16_round(w * yhi)  # w * y: exact in fp32
        lo, hi = np.minimum(a, b), np.maximum(a, b)
    if cos is None:
        return lo, hi

    def rot(a):
        return np.concatenate([-a[..., d // 2:], a[..., :d // 2]], axis=-1)

    c, s = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    outs = []
    for n in (lo, hi):  # every combination of the ends of n and rot(n)
        for r in (rot(lo), rot(hi)):
            v = n * c + r * s  # the products are exact in fp32; the sum rounds once
            err = _fp32_error(v)
            outs += [bf16_round(v - err), bf16_round(v + err)]
    return np.min(outs, axis=0), np.max(outs, axis=0)


def decode_qkv_attention_error_bound(qkv: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
                                     num_heads: int, q_norm: np.ndarray | None,
                                     k_norm: np.ndarray | None, eps: float,
                                     cos: np.ndarray | None, sin: np.ndarray | None) -> dict:
    """A decode step's attention from its q/k/v projection, exactly, and the bounds of an fp32
    kernel with the decoders' rounding points (``nvfp4_jax.attention.decode_qkv_attention``).

    qkv: [B, (NH + 2 KVH) D] the new token's (bf16) q, k, v heads side by side; k, v: one
    layer of the cache [B, S, KVH, D] before the step (slots past ``start`` unread); the new
    token sits at ``start`` (0 <= start < S) of every sequence; q_norm, k_norm: [D] or None
    (no q/k RMSNorm); cos, sin: [B, D] or None (no RoPE).

    Returns float64 arrays: ``k_lo``, ``k_hi`` [B, KVH, D] (:func:`norm_rope_interval` of the
    new k heads), ``v_row`` (the new v heads: copied, exact), ``out`` [B, NH, D] (attention of
    the q interval's midpoints against the cache with the new row's midpoints) and
    ``out_bound``: :func:`decode_attention_error_bound` plus what the kernel's own q and new k
    (anywhere in their intervals, half-widths ``bq``, ``bk``) move the output: scores move by
    at most ``ds = max_s sum_d (bq |k_s| + |q| bk_s + bq bk_s) / sqrt(D)``, which moves each
    softmax probability by a factor within ``exp(+-2 ds)``, so the output by at most
    ``expm1(2 ds) max_s |v_s|`` (zero where the intervals are points, as almost everywhere).
    """
    qkv, k, v = (np.asarray(a, np.float64) for a in (qkv, k, v))
    b, s, kvh, d = k.shape
    if qkv.shape != (b, (num_heads + 2 * kvh) * d):
        raise ValueError(f"qkv: expected [B={b}, (NH + 2 KVH) * D = {(num_heads + 2 * kvh) * d}]"
                         f", got shape {qkv.shape}")
    if not 0 <= start < s:
        raise ValueError(f"start: expected 0 <= start < S = {s}, got {start}")
    heads = qkv.reshape(b, num_heads + 2 * kvh, d)
    c = sn = None
    if cos is not None:
        c, sn = np.asarray(cos, np.float64)[:, None], np.asarray(sin, np.float64)[:, None]
    qlo, qhi = norm_rope_interval(heads[:, :num_heads], q_norm, eps, c, sn)
    k_lo, k_hi = norm_rope_interval(heads[:, num_heads:num_heads + kvh], k_norm, eps, c, sn)
    q, bq = (qlo + qhi) / 2, (qhi - qlo) / 2
    k_row, k_half = (k_lo + k_hi) / 2, (k_hi - k_lo) / 2
    v_row = heads[:, num_heads + kvh:]
    k, v = k[:, :start + 1].copy(), v[:, :start + 1].copy()
    k[:, start], v[:, start] = k_row, v_row
    out, bound = decode_attention_error_bound(q, k, v, [start + 1] * b)
    g = num_heads // kvh
    bk = np.zeros_like(k)
    bk[:, start] = k_half
    for bi in range(b):
        for h in range(kvh):
            rows = slice(h * g, (h + 1) * g)
            qa, qb = np.abs(q[bi, rows]), bq[bi, rows]  # [g, D]
            ka, kb = np.abs(k[bi, :, h]), bk[bi, :, h]  # [n, D]
            ds = (qb @ ka.T + qa @ kb.T + qb @ kb.T).max(axis=1) / math.sqrt(d)  # [g]
            vmax = np.abs(v[bi, :, h]).max()
            bound[bi, rows] += (np.expm1(2 * ds) * vmax)[:, None]
    return {"k_lo": k_lo, "k_hi": k_hi, "v_row": v_row, "out": out, "out_bound": bound}
