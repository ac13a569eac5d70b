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
