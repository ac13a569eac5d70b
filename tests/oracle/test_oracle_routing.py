"""The oracle's softmax top-k routing on cases with closed-form answers, and its bound against
an fp32 evaluation with the kernel's rounding points (inside it), and against one that rounds
the probabilities to bf16, a realistic fault (outside it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import oracle


@pytest.mark.parametrize("renormalize", [False, True])
def test_equal_logits_select_the_lowest_indices_with_equal_weights(renormalize):
    e, k = 12, 3
    ids, w = oracle.select_experts(np.full((2, e), 0.75), k, renormalize=renormalize)
    np.testing.assert_array_equal(ids, [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(w, 1 / k if renormalize else 1 / e, rtol=1e-15)


def test_order_and_weights_of_distinct_logits():
    """Logits 0, 1, 2, 3 at experts 3, 0, 2, 1 (and a tie of 1 at expert 4: after expert 0)."""
    lg = np.array([[1.0, 3.0, 2.0, 0.0, 1.0]])
    ids, w = oracle.select_experts(lg, 4)
    np.testing.assert_array_equal(ids, [[1, 2, 0, 4]])
    z = math.e**3 + math.e**2 + 2 * math.e + 1
    np.testing.assert_allclose(w, [[math.e**3 / z, math.e**2 / z, math.e / z, math.e / z]],
                               rtol=1e-15)
    _, wr = oracle.select_experts(lg, 2, renormalize=True)
    np.testing.assert_allclose(wr, [[math.e / (math.e + 1), 1 / (math.e + 1)]], rtol=1e-15)


def test_undefined_softmax_gives_nan_weights_and_minus_inf_logits_weight_zero():
    lg = np.array([[0.0, np.nan, 1.0], [np.inf, 0.0, 1.0], [-np.inf] * 3, [2.0, -np.inf, 0.0]])
    ids, w = oracle.select_experts(lg, 3)
    assert np.isnan(w[:3]).all()
    np.testing.assert_array_equal(ids[3], [0, 2, 1])
    np.testing.assert_allclose(w[3], [1 / (1 + math.e**-2), math.e**-2 / (1 + math.e**-2), 0.0],
                               rtol=1e-15)


@pytest.mark.parametrize("renormalize", [False, True])
def test_bound_holds_for_fp32_rounding_and_breaks_for_bf16_probabilities(renormalize):
    rng = np.random.default_rng(3)
    t, e, k = 64, 128, 8
    f32 = np.float32
    lg = (rng.standard_normal((t, e)) * rng.choice([0.01, 1.0, 8.0], (t, 1))).astype(f32)
    ids, exact, bound = oracle.select_experts_error_bound(lg, k, renormalize=renormalize)

    def evaluate(prob_round):
        ex = np.exp(lg - lg.max(axis=1, keepdims=True)).astype(f32)
        p = prob_round(ex / ex.sum(axis=1, keepdims=True, dtype=f32)).astype(f32)
        sel = np.take_along_axis(p, ids, axis=1)
        return sel / sel.sum(axis=1, keepdims=True, dtype=f32) if renormalize else sel

    good = evaluate(lambda p: p)
    assert (np.abs(good - exact) <= bound).all()
    bad = evaluate(lambda p: oracle.bf16_round(p.astype(np.float64)))
    assert (np.abs(bad - exact) > bound).any()
