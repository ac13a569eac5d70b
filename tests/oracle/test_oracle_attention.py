"""The oracle's decode attention on cases with closed-form answers, and its bound against an
fp32 evaluation with the kernel's rounding points (inside it), and against one that rounds
the scores to bf16 before ``exp``, a realistic fault (outside it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import oracle


def test_equal_scores_average_the_values_and_slots_past_the_length_are_ignored():
    """q = 0: every score is 0, so each head's output is the mean of its kv head's first n
    values; NaN past n shows a read of them."""
    rng = np.random.default_rng(0)
    b, s, kvh, g, d = 2, 9, 2, 3, 4
    q = np.zeros((b, kvh * g, d))
    k = rng.standard_normal((b, s, kvh, d))
    v = rng.standard_normal((b, s, kvh, d))
    lengths = [5, 9]
    k[0, 5:] = v[0, 5:] = np.nan
    got = oracle.decode_attention(q, k, v, lengths)
    for bi, n in enumerate(lengths):
        for h in range(kvh * g):
            np.testing.assert_allclose(got[bi, h], v[bi, :n, h // g].mean(axis=0), rtol=1e-14)


def test_one_dominant_key_selects_its_value():
    """Key 3 aligned with q at score 50 * sqrt(D) / sqrt(D) = 50 above the others (0): its
    weight is 1 / (1 + (n - 1) e^-50), the output its value to ~1e-21."""
    d, n = 16, 6
    q = np.zeros((1, 1, d))
    q[0, 0, 0] = 50.0 * math.sqrt(d)
    k = np.zeros((1, n, 1, d))
    k[0, 3, 0, 0] = 1.0
    v = np.arange(n * d, dtype=np.float64).reshape(1, n, 1, d)
    got = oracle.decode_attention(q, k, v, [n])
    np.testing.assert_allclose(got[0, 0], v[0, 3, 0], rtol=1e-18, atol=1e-18)


def test_bound_holds_for_the_kernels_rounding_and_breaks_for_bf16_scores():
    rng = np.random.default_rng(1)
    b, s, kvh, g, d = 1, 200, 1, 4, 64
    bf16 = oracle.bf16_round
    q = bf16(rng.standard_normal((b, kvh * g, d)) * 4)
    k = bf16(rng.standard_normal((b, s, kvh, d)) * 4)
    v = bf16(rng.standard_normal((b, s, kvh, d)))
    exact, bound = oracle.decode_attention_error_bound(q, k, v, [s])
    f32 = np.float32

    def kernel(score_round):
        sc = (q[0].astype(f32) @ k[0, :, 0].T.astype(f32)) * f32(1 / math.sqrt(d))
        sc = score_round(sc.astype(np.float64)).astype(f32)
        p = np.exp(sc - sc.max(axis=1, keepdims=True)).astype(f32)
        o = (bf16(p).astype(f32) @ v[0, :, 0].astype(f32)) / p.sum(axis=1, keepdims=True)
        return bf16(o.astype(np.float64))[None]

    assert (np.abs(kernel(lambda x: x) - exact) <= bound).all()
    assert (np.abs(kernel(bf16) - exact) > bound).any()


@pytest.mark.parametrize("shapes,lengths,match", [
    (((2, 4, 8), (2, 5, 2, 8)), [1, 6], "lengths"),
    (((2, 4, 8), (2, 5, 3, 8)), [1, 1], "not a multiple"),
    (((2, 4, 8), (1, 5, 2, 8)), [1, 1], "k: expected"),
    (((4, 8), (2, 5, 2, 8)), [1, 1], "q: expected"),
])
def test_bad_shapes_and_lengths_raise(shapes, lengths, match):
    q, k = np.zeros(shapes[0]), np.zeros(shapes[1])
    with pytest.raises(ValueError, match=match):
        oracle.decode_attention(q, k, k, lengths)
