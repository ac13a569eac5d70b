"""Softmax top-k routing in float64, and the error bound of its fp32 evaluation.

``select_experts(logits, top_k, renormalize)`` defines the routing a MoE layer takes from its
router: probabilities ``p = softmax(l)`` over the E experts of each token; the k experts of the
largest logits (the largest probabilities: ``exp`` is increasing), the lower expert index
first among equal logits; their weights ``p_j``, or ``p_j / sum of the k`` with
``renormalize`` (Qwen3-MoE, Mixtral). A token whose logits hold a NaN or a +inf, or are all
-inf, has NaN weights (softmax is undefined there; a MoE layer then gives that token a NaN
row, never a silently wrong one).

The bound covers an fp32 evaluation with these rounding points (those of
``nvfp4_jax.moe.select_kernel`` and of XLA's ``softmax`` / ``top_k``), per token with
``m = max l`` and ``x_i = l_i - m <= 0``, ``u = 2^-24``:

* ``fl(l_i - m)`` is within ``|x_i| u`` of ``x_i``, so ``exp`` of it within a relative
  ``|x_i| u``; ``exp`` itself adds ``|x_i| u`` (the product with ``log2 e`` of an ``ex2``
  evaluation) and ``eps = 2^-21``: ``e~_i = e_i (1 + eta_i)``, ``|eta_i| <= 2 |x_i| u + eps``;
* the sum ``S`` of the E terms (any order; all terms >= 0, the largest exactly 1) gains
  ``(E - 1) u`` and, from the terms' errors, ``eps + 2 u (E - 1) / e`` relative
  (``sum e_i |x_i| <= (E - 1) / e`` since ``x e^-x <= 1 / e``);
* each division adds ``2 u`` (XLA:GPU's ``div.full.f32`` is within 2 ulp; an IEEE one, u).

So ``|w~_j - w_j| <= 1.01 w_j (eta_j + sigma_S + 2 u)`` without renormalization, and with it
(the normalizer ``S`` cancels: it is the same rounded value in every ``p_j``)
``|w~_j - w_j| <= 1.01 w_j (eta_j + max_sel eta_i + (k + 5) u)`` (two divisions per weight, a
sum of k); 1.01 covers the second-order terms. Terms that flush to zero or fall into fp32
subnormals (``x_i < -87``; XLA:CPU and the GPU kernels flush subnormals) are off by less
than ``2^-126`` before the divisions, which add at most a factor E (the top expert's
probability is at least 1 / E): an absolute ``E 2^-125`` more per weight.
"""

from __future__ import annotations

import math

import numpy as np

from .formats import bf16_round

U = 2.0**-24
EXP_EPS = 2.0**-21


def _check(logits, top_k: int) -> np.ndarray:
    lg = np.asarray(logits, np.float64)
    if lg.ndim != 2:
        raise ValueError(f"logits: expected [T, E], got shape {lg.shape}")
    if not (isinstance(top_k, (int, np.integer)) and 1 <= top_k <= lg.shape[1]):
        raise ValueError(f"top_k: expected an int in [1, E={lg.shape[1]}], got {top_k!r}")
    return lg


def _undefined(lg: np.ndarray) -> np.ndarray:
    """[T] bool: tokens whose softmax is undefined (a NaN or +inf logit, or all -inf)."""
    return np.isnan(lg).any(axis=1) | np.isposinf(lg).any(axis=1) | np.isneginf(lg).all(axis=1)


def select_experts(logits, top_k: int, *, renormalize: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [T, k], weights float64 [T, k]) of the softmax top-k routing of ``logits``
    [T, E] (the values of fp32 router logits), as the module docstring defines it. A token with
    undefined softmax keeps the ids of its logits' order (NaN counted as -inf) and NaN weights."""
    lg = _check(logits, top_k)
    t, e = lg.shape
    order_key = np.where(np.isnan(lg), -np.inf, lg)
    # stable sort of -l: the largest logits first, the lower index first among equal ones
    ids = np.argsort(-order_key, axis=1, kind="stable")[:, :top_k]
    bad = _undefined(lg)
    w = np.full((t, top_k), np.nan)
    for i in np.flatnonzero(~bad):
        ex = np.exp(lg[i] - lg[i].max())
        sel = ex[ids[i]]
        w[i] = sel / (sel.sum() if renormalize else ex.sum())
    return ids.astype(np.int64), w


def select_experts_error_bound(logits, top_k: int, *, renormalize: bool = False
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, exact weights, bound) with ``bound`` float64 [T, k] the module docstring's bound on
    ``|fp32 weight - exact weight|`` (NaN where the weights are NaN)."""
    ids, w = select_experts(logits, top_k, renormalize=renormalize)
    lg = _check(logits, top_k)
    e = lg.shape[1]
    with np.errstate(invalid="ignore"):
        x = np.take_along_axis(lg, ids, axis=1) - lg.max(axis=1, keepdims=True)  # <= 0
        # a selected term below the fp32 normal range (or -inf) is covered by the absolute
        # part alone: its relative error is not defined and must not enter max_sel eta
        eta = np.where(x > -88.0, 2 * np.abs(x) * U + EXP_EPS, 0.0)
        eta = np.where(np.isnan(x), np.nan, eta)
        if renormalize:
            rel = eta + eta.max(axis=1, keepdims=True) + (top_k + 5) * U
        else:
            sigma = (e - 1) * U + EXP_EPS + 2 * U * (e - 1) / math.e
            rel = eta + sigma + 2 * U
        return ids, w, 1.01 * rel * w + e * 2.0**-125


def router_logits_interval(h, router) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) float64 [T, E]: the values a bf16 router's logits may take, ``bf16(fp32 sum_k
    h_k r_ek)`` with the H products exact in fp32 (bf16 times bf16) and summed in any order
    (``nvfp4_jax.nn.router_logits``, ``nvfp4_jax.moe.norm_router``).

    h: [T, H] and router: [E, H], bf16 values. The fp32 sum of H terms in any order is within
    ``gamma_{H-1} sum |h_k r_ek|`` of the exact sum ``s`` (``gamma_n = n u / (1 - n u)``),
    plus ``H 2^-126`` for products and partial sums that flush below the fp32 normal range;
    the float64 ``s`` here adds its own ``gamma64_H`` relative. bf16 rounding (to nearest,
    ties to even) is monotone, so the logit lies in ``[bf16(s - b), bf16(s + b)]``.
    """
    hh = np.asarray(h, np.float64)
    r = np.asarray(router, np.float64)
    if hh.ndim != 2 or r.ndim != 2 or hh.shape[1] != r.shape[1]:
        raise ValueError(f"h, router: expected [T, H] and [E, H], got {hh.shape} and {r.shape}")
    n = hh.shape[1]
    s = hh @ r.T
    mag = np.abs(hh) @ np.abs(r).T
    gamma = (n - 1) * U / (1 - (n - 1) * U) + n * 2.0**-53 / (1 - n * 2.0**-53)
    b = gamma * mag + n * 2.0**-126
    return bf16_round(s - b), bf16_round(s + b)
