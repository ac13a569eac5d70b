"""Shared random MoE problems for the MoE tests (no tests here)."""

from __future__ import annotations

import numpy as np

import oracle
from oracle.formats import bf16_round, f32
from oracle.moe import activate


def quantize_stack(w: np.ndarray, scale_factor: float = 1.0) -> oracle.NVFP4:
    """ModelOpt-quantize each expert of w [E, N, K]; decode_scale [E] = weight_scale_2.

    scale_factor > 1 inflates weight_scale_2 so the E4M3 block scales fall into the
    subnormal range (2^15 puts nearly all of them below 2^-6).
    """
    parts = [oracle.quantize(we, "modelopt", decode_scale=float(f32(np.abs(we).max() / 2688 * scale_factor)))
             for we in w]
    return oracle.NVFP4(np.stack([p.codes for p in parts]), np.stack([p.scales for p in parts]),
                        np.array([float(p.decode_scale) for p in parts]))


def routing_ids(rng, t: int, e: int, k: int, kind: str = "random") -> np.ndarray:
    """topk_ids [T, k] with distinct experts per token; 'skewed' favours low ids, 'one' uses ids 0..k-1."""
    if kind == "one":
        return np.tile(np.arange(k), (t, 1))
    if kind == "skewed":
        p = 1.0 / (1.0 + np.arange(e)) ** 1.5
        return np.stack([rng.choice(e, size=k, replace=False, p=p / p.sum()) for _ in range(t)])
    return np.argsort(rng.random((t, e)), axis=1)[:, :k]


def make_case(rng, *, t, h, inter, e, k, activation="relu2", routing="random", scale_factor=1.0,
              ids=None):
    """(hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale, fc2_input_scale), oracle form."""
    r = 2 * inter if activation == "swiglu" else inter
    hidden = bf16_round(rng.standard_normal((t, h)))
    w1 = bf16_round(rng.standard_normal((e, r, h)) / np.sqrt(h))
    w2 = bf16_round(rng.standard_normal((e, h, inter)) / np.sqrt(inter))
    fc1, fc2 = quantize_stack(w1, scale_factor), quantize_stack(w2, scale_factor)
    if ids is None:
        ids = routing_ids(rng, t, e, k, routing)
    wts = f32(rng.random(ids.shape) + 0.1)
    wts = f32(wts / wts.sum(1, keepdims=True))
    amax_x = max(float(np.abs(hidden).max()), 1e-3)
    s1 = f32(amax_x * rng.uniform(0.7, 1.3, e) / 2688)
    u = np.einsum("th,erh->ter", hidden, oracle.dequantize(fc1))
    hf = activate(u, activation)
    amax_h = max(float(np.abs(hf).max()), 1e-3)
    s2 = f32(amax_h * rng.uniform(0.7, 1.3, e) / 2688)
    return hidden, ids, wts, fc1, fc2, s1, s2
