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


def make_case_fast(rng, *, t, h, inter, e, k, activation="relu2", routing="random", scale_factor=1.0):
    """``make_case`` at realistic widths in seconds: weights quantized by nvfp4_jax (jitted, on the
    default device; ``trtllm`` recipe, per-expert decode scale as in make_case) instead of the
    float64 oracle quantizer, and the FC2 input scale from an fp32 estimate of the FC1 output
    on the unquantized weights. The oracle takes whatever bytes it is given, so the checks are
    the same; only the problem generator is cheaper."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    import nvfp4_jax

    r = 2 * inter if activation == "swiglu" else inter
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
    hidden = bf(rng.standard_normal((t, h), dtype=np.float32)).astype(np.float64)
    w1 = bf(rng.standard_normal((e, r, h), dtype=np.float32) / np.sqrt(h))
    w2 = bf(rng.standard_normal((e, h, inter), dtype=np.float32) / np.sqrt(inter))
    quant = jax.jit(jax.vmap(lambda x, d: nvfp4_jax.quantize(x, "trtllm", decode_scale=d)))

    def q(w):
        d = (np.abs(w.astype(np.float32)).max(axis=(1, 2)) / 2688 * scale_factor).astype(np.float32)
        qs = quant(jnp.asarray(w), jnp.asarray(d))
        sb = np.asarray(jax.lax.bitcast_convert_type(qs.scales, jnp.uint8))
        return oracle.NVFP4(np.asarray(qs.codes), sb, d.astype(np.float64))

    fc1, fc2 = q(w1), q(w2)
    ids = routing_ids(rng, t, e, k, routing)
    wts = f32(rng.random(ids.shape) + 0.1)
    wts = f32(wts / wts.sum(1, keepdims=True))
    amax_x = max(float(np.abs(hidden).max()), 1e-3)
    s1 = f32(amax_x * rng.uniform(0.7, 1.3, e) / 2688)
    u = jnp.einsum("th,erh->ter", jnp.asarray(hidden, jnp.float32), jnp.asarray(w1, jnp.float32))
    hf = activate(np.asarray(u, np.float64), activation)
    amax_h = max(float(np.abs(hf).max()), 1e-3)
    s2 = f32(amax_h * rng.uniform(0.7, 1.3, e) / 2688)
    return hidden, ids, wts, fc1, fc2, s1, s2


# ---------------------------------------------------------------------------------------
# Stage-wise comparison of a kernel's MoE with the oracle (bounds derived, not tuned)
# ---------------------------------------------------------------------------------------
#
# Stage A (FC1 + activation -> bf16 h). The kernel accumulates the exact dot in fp32 in any
# order: |acc - dot| <= gamma_{K-1} * sum|a||w| with gamma_n = n*u/(1-n*u), u = 2^-23 (twice
# fp32's unit roundoff: covers truncating tensor-core adders), then one fp32 multiply by alpha
# (2^-24 relative). So the pre-rounding FC1 value lies in an interval around the oracle's exact
# value; bf16 rounding is monotone, so the kernel's bf16 value lies between the roundings of the
# interval ends. The activation is propagated over that interval exactly (relu^2 is monotone,
# silu has one minimum at g* = -1.27846...), plus the fp32 evaluation error of the activation
# (ACT_REL: a few fp32 ulps for exp/div approximations), then rounded to bf16 at both ends.
# The kernel's h must lie inside; where the exact value is far from a bf16 boundary the interval
# holds one bf16 value, so h is then bit-exact.
#
# Stage B (requantize h, FC2, router weight, top-k sum -> bf16 out), checked on the kernel's own
# h (oracle.moe_trace(h_override=...)): the requantization of identical bf16 inputs is exact
# (same recipe op order, IEEE divisions), FC2 gets the same interval argument, the fp32 product
# with the router weight rounds once (2^-24), the fp32 sum of k terms errs by gamma_{k-1} *
# sum|terms|, and bf16 rounding of the interval ends gives the allowed output range.

U_ACC = 2.0**-23
ACT_REL = 2.0**-18
SILU_ARGMIN = -1.2784645427610738


def _gamma(n):
    nu = max(n - 1, 0) * U_ACC
    return nu / (1 - nu)


def _silu_range(lo, hi):
    s = lambda x: x / (1 + np.exp(-np.clip(x, -700, 700)))
    a, b = s(lo), s(hi)
    vmin = np.where((lo <= SILU_ARGMIN) & (SILU_ARGMIN <= hi), s(np.float64(SILU_ARGMIN)), np.minimum(a, b))
    return vmin, np.maximum(a, b)


def _mul_range(alo, ahi, blo, bhi):
    c = np.stack([alo * blo, alo * bhi, ahi * blo, ahi * bhi])
    return c.min(0), c.max(0)


def h_bounds(tr, k_dim, mode, activation, gate_up_order):
    """Allowed bf16 range [lo, hi] of each kernel h value (stage A), arrays [T*k, I]."""
    a1 = tr.alpha1[np.asarray(tr_expert_of_route(tr))][:, None]
    err = a1 * _gamma(k_dim) * tr.absdot1 + 2.0**-24 * np.abs(tr.u_exact) * (1 + 2.0**-20)
    lo, hi = tr.u_exact - err, tr.u_exact + err
    if mode == "trtllm_cutlass":
        lo, hi = bf16_round(lo), bf16_round(hi)
    if activation == "relu2":
        flo, fhi = np.maximum(lo, 0) ** 2, np.maximum(hi, 0) ** 2
    else:
        i = lo.shape[1] // 2
        (ulo, uhi), (glo, ghi) = ((lo[:, :i], hi[:, :i]), (lo[:, i:], hi[:, i:]))
        if gate_up_order == "gate_up":
            (ulo, uhi), (glo, ghi) = (glo, ghi), (ulo, uhi)
        slo, shi = _silu_range(glo, ghi)
        flo, fhi = _mul_range(slo, shi, ulo, uhi)
    return bf16_round(flo - ACT_REL * np.abs(flo)), bf16_round(fhi + ACT_REL * np.abs(fhi))


def tr_expert_of_route(tr):
    return tr.expert


def out_bounds(tr, k, i_dim, mode):
    """Allowed bf16 range [lo, hi] of the kernel output given the oracle trace on the kernel's h."""
    e = np.asarray(tr_expert_of_route(tr))
    a2 = tr.alpha2[e][:, None]
    err = a2 * _gamma(i_dim) * tr.absdot2 + 2.0**-24 * np.abs(tr.d_exact) * (1 + 2.0**-20)
    dlo, dhi = tr.d_exact - err, tr.d_exact + err
    if mode == "trtllm_cutlass":
        dlo, dhi = bf16_round(dlo), bf16_round(dhi)
    w = tr.weights[:, None]
    clo, chi = np.minimum(w * dlo, w * dhi), np.maximum(w * dlo, w * dhi)
    clo, chi = clo - 2.0**-24 * np.abs(clo), chi + 2.0**-24 * np.abs(chi)
    t = clo.shape[0] // k
    slo, shi = clo.reshape(t, k, -1).sum(1), chi.reshape(t, k, -1).sum(1)
    mag = np.maximum(np.abs(clo), np.abs(chi)).reshape(t, k, -1).sum(1)
    serr = _gamma(k) * mag * 1.0000001
    return bf16_round(slo - serr), bf16_round(shi + serr)


def check_against_oracle(case, out, h, *, mode, activation, gate_up_order="up_gate",
                         activation_scale=None):
    """Assert stage A and stage B bounds; return a dict of mismatch statistics."""
    hidden, ids, wts, _fc1, _fc2, _s1, _s2 = case
    kw = {"activation": activation, "gate_up_order": gate_up_order, "mode": mode,
              "activation_scale": activation_scale}
    out = np.asarray(out, np.float64)
    h = np.asarray(h, np.float64)
    tr = _with_routes(oracle.moe_trace(*case, **kw), ids, wts)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(h))
    hlo, hhi = h_bounds(tr, hidden.shape[1], mode, activation, gate_up_order)
    bad = ~((hlo <= h) & (h <= hhi))
    assert not bad.any(), (
        f"stage A: {bad.sum()} h values outside the derived bound, e.g. h={h[bad][:4]}, "
        f"oracle={tr.h[bad][:4]}, range=[{hlo[bad][:4]}, {hhi[bad][:4]}]")
    tr2 = _with_routes(oracle.moe_trace(*case, h_override=h, **kw), ids, wts)
    olo, ohi = out_bounds(tr2, ids.shape[1], h.shape[1], mode)
    bad = ~((olo <= out) & (out <= ohi))
    assert not bad.any(), (
        f"stage B: {bad.sum()} outputs outside the derived bound, e.g. out={out[bad][:4]}, "
        f"oracle(kernel h)={tr2.out[bad][:4]}, range=[{olo[bad][:4]}, {ohi[bad][:4]}]")
    return {"h_mismatch": float(np.mean(h != tr.h)), "out_mismatch_vs_oracle": float(np.mean(out != tr.out)),
            "out_mismatch_vs_oracle_on_kernel_h": float(np.mean(out != tr2.out)),
            "rel_l2_vs_oracle": float(np.linalg.norm(out - tr.out) / max(np.linalg.norm(tr.out), 1e-30))}


def _with_routes(tr, ids, wts):
    object.__setattr__(tr, "expert", np.asarray(ids).reshape(-1))
    object.__setattr__(tr, "weights", f32(np.asarray(wts, np.float64).reshape(-1)))
    return tr
