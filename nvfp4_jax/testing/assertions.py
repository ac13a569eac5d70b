"""Compare any NVFP4 backend with the oracle under a derived bound; explain the worst element.

* :func:`assert_gemm_close` -- a GEMM output against ``oracle.gemm_w4a4`` / ``gemm_w4a16``
  within ``oracle.gemm_error_bound`` (fp32 accumulation in any order, the alpha multiply and
  the output cast).
* :func:`norm_linear_bound` / :func:`assert_norm_linear_close` -- a W4A4 linear of an
  RMSNorm'd activation (``nn.norm_linear``) within an elementwise interval: the norm's
  rounding interval (``oracle.norm_rope_interval``) through the activation quantizer and the
  GEMM as in steps 1-2 below, then the output cast.
* :func:`moe_bound` / :func:`assert_moe_close` -- an MoE output against ``oracle.moe`` within
  an elementwise interval ``[lo, hi]`` propagated through every rounding point of the MoE
  (derivation below).

MoE bound derivation (``oracle/moe.py`` lists the rounding points). A correct kernel may
differ from the oracle only where its fp32 arithmetic moves a value across a rounding
boundary, so the bound follows each value as an interval and pushes it through the same
(monotone) rounding functions:

1. Activation quantization (FC1 and FC2 inputs). Per block the scale byte is
   ``E4M3(vmax * G / 6)``; the interval of ``vmax`` (widened by ``quant_slack`` relative, for
   fp32 op-order differences such as ``rcp.approx``) gives a range of scale codes. For each
   candidate scale ``s``, ``e2m1(x * G / s) * s`` is monotone in ``x``, so the element's
   interval maps to ``[q(lo), q(hi)]`` (the scaled value again widened by ``quant_slack``); the
   union over candidate scales is the quantized interval. Near E2M1 ties and E4M3 scale
   boundaries this is one FP4 step wide; elsewhere it collapses to the oracle's value.
2. Each GEMM: the exact dot of the oracle's quantized operands, plus the shift the input
   interval can cause (``W+ . dlo + W- . dhi`` and the converse), plus the fp32 accumulation
   bound ``alpha * gamma_{K-1}(accum_u) * sum |a||w|`` and ``2^-22 |u|`` for the fp32 alpha
   multiply; then bf16 rounding of both ends (``trtllm_cutlass`` rounds GEMM outputs; ``b12x``
   does not).
3. Activation: ``relu(u)^2`` is monotone; ``silu`` is handled piecewise around its minimum at
   ``u = -1.2785``, the gated product by interval multiplication; widened by ``act_rel`` for an
   fp32 ``exp``; bf16 rounding of both ends.
4. Top-k sum: ``w * d`` per route (``w`` fp32), summed with ``gamma_k(2^-24) * sum|w d|``
   for fp32 accumulation, bf16 rounding of both ends.

The interval always contains the oracle (checked) and is rigorous for kernels whose
arithmetic differs from the oracle only in the modelled ways. It is tight at small shapes
(most intervals collapse to a point) and therefore catches any semantic change of the weights
or scales, such as folding ``weight_scale_2`` into the block scales.
"""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np

import oracle
from oracle.formats import bf16_round, e2m1_round_magnitude, e4m3_decode, e4m3_encode, f32

_moe = importlib.import_module("oracle.moe")

SILU_ARGMIN = -1.2784645427610738
SILU_MIN = -0.2784645427610738


# ---------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------

def _as_f64(a) -> np.ndarray:
    return np.asarray(np.asarray(a, dtype=np.float32) if not isinstance(a, np.ndarray) else a,
                      dtype=np.float64)


def _out_u(out_dtype: str) -> float:
    return {"bfloat16": 2.0**-8, "bf16": 2.0**-8, "float16": 2.0**-11, "fp16": 2.0**-11,
            "float32": 2.0**-24, "fp32": 2.0**-24}[str(out_dtype)]


def gemm_reference(x, w: oracle.NVFP4, *, input_scale: float | None = None, alpha: float | None = None):
    """Oracle GEMM for the three ways a backend is called.

    x: ``oracle.NVFP4`` [M, K] (W4A4, alpha = product of decode scales), or a float array [M, K]
    holding bf16/fp16 values: W4A16 when ``input_scale`` is None (alpha = w.decode_scale), else
    W4A4 as TensorRT-LLM does it (x quantized with recipe ``trtllm`` and
    ``G = fp32(1/input_scale)``, ``alpha = fp32(input_scale * weight_scale_2)``).
    Returns ``(ref float64 [M, N], |a| float64 [M, K], alpha)``.
    """
    if isinstance(x, oracle.NVFP4):
        a = x
        if alpha is None:
            alpha = float(a.decode_scale) * float(w.decode_scale)
        return oracle.gemm_w4a4(a, w, alpha), np.abs(oracle.dequantize(a, include_decode_scale=False)), alpha
    x = np.asarray(x, dtype=np.float64)
    if input_scale is None:
        if alpha is None:
            alpha = float(w.decode_scale)
        return oracle.gemm_w4a16(x, w, alpha), np.abs(x), alpha
    s = float(f32(input_scale))
    a = oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s)))
    if alpha is None:
        alpha = float(f32(s * float(w.decode_scale)))
    return oracle.gemm_w4a4(a, w, alpha), np.abs(oracle.dequantize(a, include_decode_scale=False)), alpha


def assert_gemm_close(
    out,
    x,
    w: oracle.NVFP4,
    *,
    input_scale: float | None = None,
    alpha: float | None = None,
    out_dtype: str = "bfloat16",
    accum_u: float = 2.0**-23,
    splits: int = 1,
    label: str = "gemm",
) -> None:
    """Assert ``out`` [M, N] (a backend's result) is within ``oracle.gemm_error_bound`` of the oracle.

    Arguments as :func:`gemm_reference`; ``out_dtype`` names the backend's output dtype
    (its rounding enters the bound). Raises AssertionError naming the worst element, its
    value, the oracle's, the bound, and the inputs of that row and column.
    """
    ref, abs_a, alpha = gemm_reference(x, w, input_scale=input_scale, alpha=alpha)
    out = _as_f64(out)
    if out.shape != ref.shape:
        raise AssertionError(f"{label}: output shape {out.shape}, oracle shape {ref.shape}")
    abs_w = np.abs(oracle.dequantize(w, include_decode_scale=False))
    bound = oracle.gemm_error_bound(abs_a, abs_w, alpha, ref, accum_u=accum_u,
                                    out_u=_out_u(out_dtype), splits=splits)
    err = np.abs(out - ref)
    bad = ~(err <= bound)  # NaN counts as bad
    if not bad.any():
        return
    ratio = np.where(np.isfinite(err), err / bound, np.inf)
    m, n = np.unravel_index(int(np.nanargmax(np.where(bad, ratio, -1.0))), ref.shape)
    a_row = abs_a[m]
    w_row = oracle.dequantize(w, include_decode_scale=False)[n]
    w_sc = e4m3_decode(w.scales[n])
    raise AssertionError(
        f"{label}: {int(bad.sum())} of {bad.size} elements exceed the derived bound; worst at "
        f"[{m}, {n}]: backend {out[m, n]!r}, oracle {ref[m, n]!r}, |diff| {err[m, n]:.4g} > bound "
        f"{bound[m, n]:.4g} ({ratio[m, n]:.3g}x)\n"
        f"  alpha {alpha!r}, K {abs_a.shape[-1]}, sum|a||w| {float(a_row @ np.abs(w_row)):.4g}\n"
        f"  activation row {m}: max|a| {a_row.max():.4g}\n"
        f"  weight row {n}: max|w| {np.abs(w_row).max():.4g}, block scales min {w_sc.min():.4g} "
        f"max {w_sc.max():.4g} ({int((w_sc < 2.0**-6).sum())} subnormal/zero of {w_sc.size}), "
        f"decode_scale {float(np.asarray(w.decode_scale))!r}"
    )


# ---------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------

def _gamma(n: int, u: float) -> float:
    nu = max(n, 0) * u
    return nu / (1.0 - nu)


def quantize_interval(lo: np.ndarray, hi: np.ndarray, encode_scale: np.ndarray,
                      slack: float = 2.0**-21) -> tuple[np.ndarray, np.ndarray]:
    """Interval of ``e2m1 * e4m3`` values (no global scale) that quantizing any ``x`` in
    ``[lo, hi]`` (elementwise, [..., K]) with encode scale ``G`` ([...] per row) can give.

    Covers every TRT-LLM / b12x / FlashInfer op order whose fp32 results lie within ``slack``
    (relative) of the exact ``vmax * G / 6`` and ``x * G / s``.
    """
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    shape = lo.shape
    nb = shape[-1] // 16
    blo = lo.reshape(shape[:-1] + (nb, 16))
    bhi = hi.reshape(shape[:-1] + (nb, 16))
    g = np.broadcast_to(np.asarray(encode_scale, np.float64), shape[:-1])[..., None]
    straddle = (blo <= 0) & (bhi >= 0)
    amin = np.where(straddle, 0.0, np.minimum(np.abs(blo), np.abs(bhi)))
    amax = np.maximum(np.abs(blo), np.abs(bhi))
    sf_lo = amin.max(-1) * g / 6.0 * (1 - slack)
    sf_hi = amax.max(-1) * g / 6.0 * (1 + slack)
    c_lo = e4m3_encode(sf_lo).astype(np.int64)
    c_hi = e4m3_encode(sf_hi).astype(np.int64)
    out_lo = np.full(blo.shape, np.inf)
    out_hi = np.full(blo.shape, -np.inf)
    for j in range(int((c_hi - c_lo).max(initial=0)) + 1):
        s = e4m3_decode(np.minimum(c_lo + j, c_hi).astype(np.uint8))[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            os_ = np.where(s > 0, g[..., None] / s, 0.0)
        ylo, yhi = blo * os_, bhi * os_
        ylo = ylo - np.abs(ylo) * slack
        yhi = yhi + np.abs(yhi) * slack
        qlo = np.sign(ylo) * e2m1_round_magnitude(np.abs(ylo)) * s
        qhi = np.sign(yhi) * e2m1_round_magnitude(np.abs(yhi)) * s
        out_lo = np.minimum(out_lo, qlo)
        out_hi = np.maximum(out_hi, qhi)
    return out_lo.reshape(shape), out_hi.reshape(shape)


def _silu_interval(lo, hi):
    s_lo, s_hi = _moe.silu(lo), _moe.silu(hi)
    left = hi <= SILU_ARGMIN  # decreasing branch
    right = lo >= SILU_ARGMIN
    out_lo = np.where(left, s_hi, np.where(right, s_lo, SILU_MIN))
    out_hi = np.where(left, s_lo, np.where(right, s_hi, np.maximum(s_lo, s_hi)))
    return out_lo, out_hi


def _mul_interval(alo, ahi, blo, bhi):
    p = np.stack([alo * blo, alo * bhi, ahi * blo, ahi * bhi])
    return p.min(0), p.max(0)


def _widen(lo, hi, rel, absol=0.0):
    return lo - np.abs(lo) * rel - absol, hi + np.abs(hi) * rel + absol


def _dot_interval(point, a_lo, a_hi, a_point, w_nvfp4, expert, alpha, accum_u):
    """Interval of ``alpha[e] * a . W[e]^T`` per row, given the operand interval."""
    lo = np.array(point, dtype=np.float64, copy=True)
    hi = lo.copy()
    dlo, dhi = a_lo - a_point, a_hi - a_point
    a_abs = np.maximum(np.abs(a_lo), np.abs(a_hi))
    k = a_point.shape[-1]
    for e in np.unique(expert):
        rows = np.nonzero(expert == e)[0]
        w = oracle.dequantize(oracle.NVFP4(w_nvfp4.codes[e], w_nvfp4.scales[e], np.float64(1.0)),
                              include_decode_scale=False)
        wp, wn = np.maximum(w, 0.0), np.minimum(w, 0.0)
        al = float(alpha[e])
        shift_lo = (dlo[rows] @ wp.T + dhi[rows] @ wn.T) * al
        shift_hi = (dhi[rows] @ wp.T + dlo[rows] @ wn.T) * al
        acc = abs(al) * _gamma(k - 1, accum_u) * (a_abs[rows] @ np.abs(w).T)
        slop = 2.0**-40 * abs(al) * (np.abs(dlo[rows]) + np.abs(dhi[rows])) @ np.abs(w).T
        lo[rows] += shift_lo - acc - slop
        hi[rows] += shift_hi + acc + slop
    return _widen(lo, hi, 2.0**-22)


@dataclasses.dataclass(frozen=True)
class IntervalBound:
    """An oracle output and the interval a correct backend must land in (float64, same shape)."""

    ref: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def norm_linear_bound(x, w: oracle.NVFP4, input_scale: float, norm_weight=None,
                      eps: float = 1e-6, *, out_dtype: str = "bfloat16",
                      quant_slack: float = 2.0**-21, accum_u: float = 2.0**-23) -> IntervalBound:
    """W4A4 ``linear(rms_norm(x, norm_weight, eps))`` (``nn.norm_linear``) and its bound.

    x: bf16 values [M, K]; w: the oracle's NVFP4 [N, K]; input_scale: the activation's
    decode scale (``G = fp32(1/input_scale)``, ``alpha = fp32(input_scale * w.decode_scale)``);
    norm_weight: bf16 values [K], or None (no norm: the plain W4A4 linear). The normed
    activation may be any value of ``oracle.norm_rope_interval`` (an fp32 sum of squares in
    any order, an inexact rsqrt); the interval follows it through the ``trtllm`` quantizer
    (:func:`quantize_interval`) and the GEMM (fp32 accumulation in any order, the alpha
    multiply), and both ends through the output cast. ``ref``: the oracle's value at the
    interval's low end, cast as the output. Returns an :class:`IntervalBound` [M, N]."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[1] % 16:
        raise ValueError(f"x: expected [M, K] with K a multiple of 16, got shape {x.shape}")
    if tuple(np.shape(w.codes)) != (np.shape(w.codes)[0], x.shape[1] // 2):
        raise ValueError(f"w: expected an NVFP4 [N, K={x.shape[1]}] (codes [N, K/2]), got codes "
                         f"of shape {np.shape(w.codes)}")
    if norm_weight is not None and np.shape(norm_weight) != (x.shape[1],):
        raise ValueError(f"norm_weight: expected [K={x.shape[1]}], got shape "
                         f"{np.shape(norm_weight)}")
    if not (np.size(input_scale) == 1 and np.isfinite(input_scale) and float(input_scale) > 0):
        raise ValueError(f"input_scale: expected a positive finite scalar, got {input_scale!r}")
    if norm_weight is None:
        xlo = xhi = x
    else:
        xlo, xhi = oracle.norm_rope_interval(x, np.asarray(norm_weight, np.float64), eps, None,
                                             None)
    s = float(f32(input_scale))
    g = float(f32(1.0 / s))
    alpha = np.array([float(f32(s * float(w.decode_scale)))])
    point = oracle.dequantize(oracle.quantize(xlo, "trtllm", encode_scale=g),
                              include_decode_scale=False)
    wd = oracle.dequantize(w, include_decode_scale=False)
    ref = alpha[0] * (point @ wd.T)
    qlo, qhi = quantize_interval(xlo, xhi, np.full(x.shape[:-1], g), quant_slack)
    one = oracle.NVFP4(np.asarray(w.codes)[None], np.asarray(w.scales)[None], np.float64(1.0))
    lo, hi = _dot_interval(ref, qlo, qhi, point, one, np.zeros(len(x), np.int64), alpha,
                           accum_u)
    if str(out_dtype) not in ("float32", "fp32"):
        rnd = bf16_round if _out_u(out_dtype) == 2.0**-8 else (
            lambda v: np.asarray(v, np.float16).astype(np.float64))
        ref, lo, hi = rnd(ref), rnd(lo), rnd(hi)
    if not (np.all(lo <= ref) and np.all(ref <= hi)):  # pragma: no cover - a bug here
        raise RuntimeError("norm_linear_bound: the interval does not contain the oracle")
    return IntervalBound(ref, lo, hi)


def interval_violations(out, bound) -> np.ndarray:
    """Distance of each element of ``out`` outside ``bound``'s ``[lo, hi]`` (0 inside, inf
    for NaN); ``bound``: an :class:`IntervalBound` or a :class:`MoEBound`."""
    out = _as_f64(out)
    d = np.maximum(bound.lo - out, out - bound.hi)
    return np.where(np.isnan(out), np.inf, np.maximum(d, 0.0))


def assert_norm_linear_close(out, x, w: oracle.NVFP4, input_scale: float, norm_weight=None,
                             eps: float = 1e-6, *, out_dtype: str = "bfloat16",
                             label: str = "norm_linear") -> IntervalBound:
    """Assert a backend's ``nn.norm_linear`` output [M, N] lies in :func:`norm_linear_bound`'s
    interval elementwise; the AssertionError names the worst element, the backend value, the
    oracle's and the interval."""
    bound = norm_linear_bound(x, w, input_scale, norm_weight, eps, out_dtype=out_dtype)
    out = _as_f64(out)
    if out.shape != bound.ref.shape:
        raise AssertionError(f"{label}: output shape {out.shape}, oracle shape {bound.ref.shape}")
    v = interval_violations(out, bound)
    if not v.any():
        return bound
    m, n = np.unravel_index(int(np.argmax(v)), v.shape)
    raise AssertionError(
        f"{label}: {int((v > 0).sum())} of {v.size} elements outside the derived interval; "
        f"worst at [{m}, {n}]: backend {out[m, n]!r}, oracle {bound.ref[m, n]!r}, interval "
        f"[{bound.lo[m, n]!r}, {bound.hi[m, n]!r}]")


@dataclasses.dataclass(frozen=True)
class MoEBound:
    """``oracle.moe`` output and the interval a correct backend must land in ([T, H] float64)."""

    ref: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    trace: object


def moe_bound(
    hidden, topk_ids, topk_weights, fc1: oracle.NVFP4, fc2: oracle.NVFP4,
    fc1_input_scale, fc2_input_scale, *, activation: str = "relu2",
    gate_up_order: str = "up_gate", mode: str = "trtllm_cutlass",
    activation_scale: str | None = None, quant_slack: float = 2.0**-21,
    accum_u: float = 2.0**-23, act_rel: float = 2.0**-20,
) -> MoEBound:
    """The oracle MoE and its elementwise bound (module docstring); arguments as ``oracle.moe``."""
    tr = _moe.moe_trace(hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale,
                        fc2_input_scale, activation=activation, gate_up_order=gate_up_order,
                        mode=mode, activation_scale=activation_scale)
    ids = np.asarray(topk_ids)
    t, k = ids.shape
    expert = ids.reshape(-1).astype(np.int64)
    token = np.repeat(np.arange(t), k)
    x = np.asarray(hidden, np.float64)[token]
    rnd = bf16_round if mode == "trtllm_cutlass" else (lambda v: v)

    xlo, xhi = quantize_interval(x, x, tr.g1, quant_slack)
    ulo, uhi = _dot_interval(tr.u_exact, xlo, xhi, tr.x_values, fc1, expert, tr.alpha1, accum_u)
    ulo, uhi = rnd(ulo), rnd(uhi)
    if activation == "relu2":
        hlo, hhi = np.square(np.maximum(ulo, 0.0)), np.square(np.maximum(uhi, 0.0))
    else:
        i = ulo.shape[-1] // 2
        f_lo, s_lo, f_hi, s_hi = ulo[:, :i], ulo[:, i:], uhi[:, :i], uhi[:, i:]
        if gate_up_order == "up_gate":
            up, gate = (f_lo, f_hi), (s_lo, s_hi)
        else:
            up, gate = (s_lo, s_hi), (f_lo, f_hi)
        sg = _silu_interval(*gate)
        hlo, hhi = _mul_interval(sg[0], sg[1], up[0], up[1])
    hlo, hhi = _widen(hlo, hhi, act_rel, 1e-38)
    hlo, hhi = bf16_round(hlo), bf16_round(hhi)

    qlo, qhi = quantize_interval(hlo, hhi, tr.g2, quant_slack)
    dlo, dhi = _dot_interval(tr.d_exact, qlo, qhi, tr.h_values, fc2, expert, tr.alpha2, accum_u)
    dlo, dhi = rnd(dlo), rnd(dhi)
    w = f32(np.asarray(topk_weights, np.float64).reshape(-1))[:, None]
    clo, chi = np.minimum(w * dlo, w * dhi), np.maximum(w * dlo, w * dhi)
    clo, chi = _widen(clo, chi, 2.0**-24)
    mag = np.maximum(np.abs(clo), np.abs(chi)).reshape(t, k, -1).sum(1)
    slo = clo.reshape(t, k, -1).sum(1) - _gamma(k, 2.0**-24) * mag
    shi = chi.reshape(t, k, -1).sum(1) + _gamma(k, 2.0**-24) * mag
    lo, hi = bf16_round(slo), bf16_round(shi)
    if not (np.all(lo <= tr.out) and np.all(tr.out <= hi)):  # pragma: no cover - a bug here
        raise RuntimeError("moe_bound: the interval does not contain the oracle (bug in the bound)")
    return MoEBound(tr.out, lo, hi, tr)


def moe_violations(out, bound: MoEBound) -> np.ndarray:
    """Distance of each element of ``out`` outside ``[lo, hi]`` (0 inside, inf for NaN)."""
    return interval_violations(out, bound)


def assert_moe_close(out, hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale,
                     fc2_input_scale, *, label: str = "moe", bound: MoEBound | None = None,
                     **kw) -> MoEBound:
    """Assert a backend's MoE output [T, H] lies in :func:`moe_bound`'s interval elementwise.

    The AssertionError names the worst element (token, column), the backend value, the oracle,
    the interval, and that token's routes (expert, weight) and the block scales involved.
    Returns the bound (for further checks).
    """
    if bound is None:
        bound = moe_bound(hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale,
                          fc2_input_scale, **kw)
    out = _as_f64(out)
    if out.shape != bound.ref.shape:
        raise AssertionError(f"{label}: output shape {out.shape}, oracle shape {bound.ref.shape}")
    viol = moe_violations(out, bound)
    if not (viol > 0).any():
        return bound
    width = np.maximum(bound.hi - bound.lo, np.abs(bound.ref) * 2.0**-8)
    score = viol / np.maximum(width, 1e-300)
    ti, ci = np.unravel_index(int(np.argmax(score)), out.shape)
    ids = np.asarray(topk_ids)[ti]
    wts = np.asarray(topk_weights, np.float64)[ti]
    lines = []
    for e, wt in zip(ids, wts):
        s2 = e4m3_decode(fc2.scales[int(e), ci])
        lines.append(f"    expert {int(e)} weight {wt:.4g}: fc2 row {ci} block scales min "
                     f"{s2.min():.4g} max {s2.max():.4g}, weight_scale_2 "
                     f"{float(np.broadcast_to(fc2.decode_scale, (fc2.codes.shape[0],))[int(e)]):.4g}")
    rel = np.linalg.norm(out - bound.ref) / max(np.linalg.norm(bound.ref), 1e-300)
    raise AssertionError(
        f"{label}: {int((viol > 0).sum())} of {viol.size} outputs outside the derived interval "
        f"(relative Frobenius error vs oracle {rel:.3g}); worst at token {ti}, column {ci}: "
        f"backend {out[ti, ci]!r}, oracle {bound.ref[ti, ci]!r}, allowed [{bound.lo[ti, ci]!r}, "
        f"{bound.hi[ti, ci]!r}], outside by {viol[ti, ci]:.4g} ({score[ti, ci]:.3g}x the interval "
        f"width)\n  token {ti}: max|x| {np.abs(np.asarray(hidden)[ti]).max():.4g}, routes:\n"
        + "\n".join(lines)
    )


# ---------------------------------------------------------------------------------------
# Quantizer self-consistency
# ---------------------------------------------------------------------------------------

def quantize_violations(
    x, q: oracle.NVFP4, encode_scale: float, *, slack: float = 2.0**-21
) -> np.ndarray:
    """Per element [..., K]: how far the code lies beyond the nearest E2M1 value of
    ``x * G / s``, with ``s`` the *stored* scale byte decoded exactly (as the tensor core reads it).

    0 where the code is a nearest grid value (either one at a tie, allowing ``slack`` relative
    for fp32 op-order differences), else the excess distance in E2M1 units. Blocks whose scale
    byte is 0 hold no information (dequantize to 0) and are 0 here. Any quantizer that computes
    its codes from the scale it stores passes, whatever its scale choice; one that divides by a
    differently decoded scale (b12x <= 1.3.0 and FlashInfer < 0.6.17 on subnormal bytes,
    ``nvfp4_jax.interop.scale_decode``) does not.
    """
    x = np.asarray(x, np.float64)
    s = e4m3_decode(np.asarray(q.scales, np.uint8))
    codes = oracle.codes_of(q)
    if codes.shape != x.shape or s.shape != x.shape[:-1] + (x.shape[-1] // 16,):
        raise ValueError(f"q: expected codes for x of shape {x.shape}, got codes {codes.shape}, "
                         f"scales {s.shape}")
    sb = np.repeat(s, 16, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(sb > 0, x * float(encode_scale) / sb, 0.0)
    a = np.abs(y)
    nearest = e2m1_round_magnitude(np.minimum(a, 6.0))
    got = oracle.e2m1_decode(codes)
    wrong_sign = (got != 0) & (np.sign(got) != np.sign(x))
    a6 = np.minimum(a, 6.0)
    excess = np.abs(np.abs(got) - a6) - np.abs(nearest - a6) - slack * a
    out = np.maximum(excess, 0.0) + wrong_sign * np.abs(got)
    return np.where(sb > 0, out, 0.0)


def assert_quantize_consistent(
    x, q: oracle.NVFP4, encode_scale: float, *, label: str = "quantizer"
) -> None:
    """Assert every code of ``q`` (a quantizer's output for ``x [..., K]`` with encode scale G)
    is a nearest E2M1 value of ``x * G / s`` for its stored block scale ``s``
    (:func:`quantize_violations`); the message names the worst element and its block."""
    v = quantize_violations(x, q, encode_scale)
    if not np.any(v > 0):
        return
    idx = np.unravel_index(int(np.argmax(v)), v.shape)
    blk = idx[:-1] + (idx[-1] // 16,)
    sbyte = int(np.asarray(q.scales)[blk])
    code = int(oracle.codes_of(q)[idx])
    s = float(e4m3_decode(np.uint8(sbyte)))
    raise AssertionError(
        f"{label}: {int((v > 0).sum())} of {v.size} codes are not a nearest E2M1 value of x*G/s "
        f"for their stored scale; worst at {tuple(int(i) for i in idx)}: "
        f"x = {float(np.asarray(x)[idx]):.6g}, "
        f"scale byte 0x{sbyte:02x} = {s:.6g}{' (E4M3 subnormal)' if 0 < s < 2.0**-6 else ''}, "
        f"x*G/s = {float(np.asarray(x)[idx]) * encode_scale / s:.6g}, code 0x{code:x} = "
        f"{float(oracle.e2m1_decode(np.uint8(code))):g}")
