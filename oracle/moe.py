"""Exact routed NVFP4 mixture of experts: TensorRT-LLM CUTLASS and b12x reference semantics.

``moe(hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale, fc2_input_scale, ...)``
computes one MoE layer for tokens ``hidden[T, H]`` routed to ``k`` experts each. Weights are
NVFP4 stacks as a ModelOpt checkpoint holds them: ``fc1`` codes ``[E, R, H/2]``, scales
``[E, R, H/16]`` (linear layout, used exactly as stored), ``decode_scale [E]`` =
``weight_scale_2`` per expert; ``R = I`` for ``relu2`` and ``R = 2I`` for ``swiglu``; ``fc2``
``[E, H, I]``. ``fc1_input_scale`` / ``fc2_input_scale`` are ModelOpt ``input_scale`` values
(decode form, ``amax/2688``), one per expert. Global scales always live in fp32 alphas applied
after the block-scaled dot; they are never folded into the E4M3 block scales.

What is exact and what rounds (both modes)
------------------------------------------
* Activation quantization (FC1 input and FC2 input) reproduces the named recipe bit for bit
  (``oracle.quantize``: the recipe's fp32 op order, E4M3/E2M1 RNE).
* Each quantized GEMM is an exact integer dot (``oracle.gemm.exact_dot_int``) of the scaled
  operands ``e2m1 * e4m3`` (activation values are ``q * sf`` in units of the encode scale,
  i.e. ``~ x * G``; weights ``q * sf`` without ``weight_scale_2``), then one float64 multiply
  by the fp32 alpha (the float64 product of a <= 2^53 integer multiple of 2^-20 and an fp32
  number rounds once at 2^-53 relative: negligible against every named rounding).
* The activation (``relu(u)^2`` or ``silu(gate) * up``) is evaluated in float64. A kernel
  evaluates it in fp32 (and ``exp`` with an approximation), which differs by a few fp32 ulp;
  that only matters where the next bf16 rounding is near a tie (see below).
* The top-k weighted sum is exact in float64 (a kernel sums in fp32 in some order).
* The named rounding points (below) round the float64 value once, RNE.

Modes
-----
``trtllm_cutlass`` (TensorRT-LLM ``NVFP4CutlassFusedMoEMethod`` + ``cutlass_fused_moe_kernels``):

* FC1 input: recipe ``trtllm`` (fast math off), one scalar encode scale
  ``G1 = fp32(1 / max_e fc1_input_scale)``; likewise ``G2`` from ``fc2_input_scale``.
* ``alpha1[e] = fp32(1 / fp32(G1 * fp32(1 / weight_scale_2_fc1[e])))`` (TRT-LLM
  ``load_expert_fc31_alpha_nvfp4``: ``1 / (fc31_input_scale * (1 / w_scale_2))``, each op fp32);
  ``alpha2`` likewise.
* ``u = bf16(dot1 * alpha1)`` (GEMM1 output buffer is bf16); ``h = bf16(act(u))``;
  ``h`` requantized with ``G2``; ``d = bf16(dot2 * alpha2)`` (GEMM2 output is bf16);
  ``c = fp32(w * d)`` per route; ``out = bf16(sum_k c)``.

``b12x`` (b12x 1.5.1 ``moe_reference_nvfp4``, ``quant_scale_math="direct_division"``):

* Activation quant with recipe ``b12x`` and ``a1_gscale`` = per expert
  ``fp32(1 / fc1_input_scale[e])`` (``activation_scale="per_expert"``, default) or the scalar
  ``fp32(1 / max_e fc1_input_scale)`` (``"scalar"``); ``a2_gscale`` likewise.
* ``alpha1[e] = fp32(weight_scale_2_fc1[e] / a1_gscale[e])`` (b12x
  ``_prepare_modelopt_nvfp4_runtime_alphas``); ``alpha2`` likewise.
* ``u = dot1 * alpha1`` (fp32 in b12x, not rounded here), ``h = bf16(act(u))``, requantized
  with ``a2_gscale``, ``d = dot2 * alpha2`` (not rounded), ``out = bf16(sum_k w * d)``.

Gated layout: ``gate_up_order="up_gate"`` (TRT-LLM fc31 / b12x w13: rows ``[0, I)`` = up (w3),
``[I, 2I)`` = gate (w1)), ``"gate_up"`` (vLLM w13: gate first).

Why a kernel can differ from this oracle, and by how much: its fp32 accumulation and fp32
activation move the value before a bf16 rounding point by a bounded amount (for the dot,
``gamma_K * alpha * sum|a||w|``, see ``oracle.gemm_error_bound``); the bf16 result can then
differ by one bf16 ulp where the exact value is within that distance of a bf16 rounding
boundary, and a changed ``h`` can change one FP4 code of the FC2 input. ``moe_trace`` returns
the per-route intermediates and ``|a| . |w|`` sums so tests can bound each stage separately,
and accepts ``h_override`` (a kernel's own bf16 ``h``) to check the FC2 half on identical
inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import bf16_round, f32, f32_div, f32_mul, f32_rcp
from .gemm import exact_dot_int, scaled_integers
from .quantize import NVFP4, dequantize, quantize

MOE_MODES = ("trtllm_cutlass", "b12x")
ACTIVATIONS = ("relu2", "swiglu")
GATE_UP_ORDERS = ("up_gate", "gate_up")
ACTIVATION_SCALES = ("scalar", "per_expert")


@dataclass(frozen=True)
class MoETrace:
    """Per-route intermediates of :func:`moe_trace` (route ``r = t * k + j``; all float64).

    g1, g2:          [T*k] encode scale used to quantize each route's FC1 / FC2 input.
    alpha1, alpha2:  [E] fp32 alphas.
    x_values:        [T*k, H] FC1 input after quantization, ``q * sf`` (no global scale).
    u:               [T*k, R] FC1 output ``dot1 * alpha1`` (bf16-rounded in trtllm_cutlass).
    u_exact:         [T*k, R] FC1 output before any rounding.
    h:               [T*k, I] activation output, bf16-representable.
    h_values:        [T*k, I] FC2 input after requantization, ``q * sf``.
    d:               [T*k, H] FC2 output ``dot2 * alpha2`` (bf16-rounded in trtllm_cutlass).
    d_exact:         [T*k, H] FC2 output before any rounding.
    contrib:         [T*k, H] ``w * d`` per route (fp32-rounded in trtllm_cutlass).
    out:             [T, H] final bf16-representable output.
    absdot1, absdot2: [T*k, R] and [T*k, H] ``sum |a||w|`` of each dot (no alpha), for bounds.
    """

    g1: np.ndarray
    g2: np.ndarray
    alpha1: np.ndarray
    alpha2: np.ndarray
    x_values: np.ndarray
    u: np.ndarray
    u_exact: np.ndarray
    h: np.ndarray
    h_values: np.ndarray
    d: np.ndarray
    d_exact: np.ndarray
    contrib: np.ndarray
    out: np.ndarray
    absdot1: np.ndarray
    absdot2: np.ndarray


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` in float64, stable for large |x|."""
    x = np.asarray(x, dtype=np.float64)
    # np.where evaluates both branches: the unused one overflows (inf / inf) for large |x|
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(x >= 0, x / (1.0 + np.exp(-x)), x * np.exp(x) / (1.0 + np.exp(x)))


def activate(u: np.ndarray, activation: str, gate_up_order: str = "up_gate") -> np.ndarray:
    """``relu(u)^2`` ([.., I] -> [.., I]) or ``silu(gate) * up`` ([.., 2I] -> [.., I]), float64."""
    u = np.asarray(u, dtype=np.float64)
    if activation == "relu2":
        return np.square(np.maximum(u, 0.0))
    if activation == "swiglu":
        i = u.shape[-1] // 2
        first, second = u[..., :i], u[..., i:]
        up, gate = (first, second) if gate_up_order == "up_gate" else (second, first)
        return silu(gate) * up
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def moe_scales(
    fc1: NVFP4,
    fc2: NVFP4,
    fc1_input_scale: np.ndarray,
    fc2_input_scale: np.ndarray,
    mode: str,
    activation_scale: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-expert encode scales and alphas ``(g1 [E], g2 [E], alpha1 [E], alpha2 [E])`` (fp32 values)."""
    if mode not in MOE_MODES:
        raise ValueError(f"mode: expected one of {MOE_MODES}, got {mode!r}")
    if activation_scale is None:
        activation_scale = "scalar" if mode == "trtllm_cutlass" else "per_expert"
    if activation_scale not in ACTIVATION_SCALES:
        raise ValueError(f"activation_scale: expected one of {ACTIVATION_SCALES}, got {activation_scale!r}")
    if mode == "trtllm_cutlass" and activation_scale != "scalar":
        raise ValueError("activation_scale: trtllm_cutlass uses one scalar activation scale per layer")
    e = fc1.codes.shape[0]
    out = []
    for w, s_in in ((fc1, fc1_input_scale), (fc2, fc2_input_scale)):
        s_in = f32(np.broadcast_to(np.asarray(s_in, np.float64), (e,)))
        ws2 = f32(np.broadcast_to(w.decode_scale, (e,)))
        if activation_scale == "scalar":
            g = np.full(e, float(f32_rcp(np.max(s_in))))
        else:
            g = f32_rcp(s_in)
        if mode == "trtllm_cutlass":
            alpha = f32_rcp(f32_mul(g, f32_rcp(ws2)))
        else:
            alpha = f32_div(ws2, g)
        out.append((g, alpha))
    (g1, a1), (g2, a2) = out
    return g1, g2, a1, a2


def _expert(w: NVFP4, e: int) -> NVFP4:
    return NVFP4(w.codes[e], w.scales[e], np.float64(1.0))


def _quantize_routes(x: np.ndarray, g_route: np.ndarray, recipe: str) -> NVFP4:
    """Quantize rows x[r] with encode scale g_route[r] (grouped by distinct scale)."""
    codes = np.zeros(x.shape[:-1] + (x.shape[-1] // 2,), np.uint8)
    scales = np.zeros(x.shape[:-1] + (x.shape[-1] // 16,), np.uint8)
    for g in np.unique(g_route):
        rows = np.nonzero(g_route == g)[0]
        q = quantize(x[rows], recipe, encode_scale=float(g))
        codes[rows], scales[rows] = q.codes, q.scales
    return NVFP4(codes, scales, np.float64(1.0))


def _grouped_dot(a: NVFP4, w: NVFP4, expert_of_row: np.ndarray, alpha: np.ndarray):
    """Per row r: exact ``a[r] . w[expert_of_row[r]]^T`` (float64 [rows, N]) and |a|.|w| sums."""
    n = w.codes.shape[1]
    exact = np.zeros((a.codes.shape[0], n))
    absdot = np.zeros_like(exact)
    a_int = scaled_integers(a)
    a_abs = np.abs(dequantize(a, include_decode_scale=False))
    for e in np.unique(expert_of_row):
        rows = np.nonzero(expert_of_row == e)[0]
        we = _expert(w, int(e))
        acc = exact_dot_int(a_int[rows], scaled_integers(we))
        exact[rows] = np.ldexp(acc.astype(np.float64), -20) * alpha[e]
        absdot[rows] = a_abs[rows] @ np.abs(dequantize(we, include_decode_scale=False)).T
    return exact, absdot


def _check(hidden, topk_ids, topk_weights, fc1, fc2, activation, gate_up_order):
    hidden = np.asarray(hidden, dtype=np.float64)
    if hidden.ndim != 2:
        raise ValueError(f"hidden: expected [T, H], got shape {hidden.shape}")
    if not np.array_equal(bf16_round(hidden), hidden):
        raise ValueError("hidden: values must be bf16-representable (the layer input is bf16)")
    ids = np.asarray(topk_ids)
    if ids.ndim != 2 or ids.shape[0] != hidden.shape[0] or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"topk_ids: expected integer [T={hidden.shape[0]}, k], got {ids.dtype} {ids.shape}")
    wts = np.asarray(topk_weights, dtype=np.float64)
    if wts.shape != ids.shape:
        raise ValueError(f"topk_weights: expected shape {ids.shape}, got {wts.shape}")
    if not isinstance(fc1, NVFP4) or fc1.codes.ndim != 3:
        raise ValueError("fc1: expected an oracle.NVFP4 stack [E, R, H]")
    if not isinstance(fc2, NVFP4) or fc2.codes.ndim != 3:
        raise ValueError("fc2: expected an oracle.NVFP4 stack [E, H, I]")
    e, r, h2 = fc1.codes.shape
    if 2 * h2 != hidden.shape[1]:
        raise ValueError(f"fc1: expected K = H = {hidden.shape[1]}, got {2 * h2}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_order not in GATE_UP_ORDERS:
        raise ValueError(f"gate_up_order: expected one of {GATE_UP_ORDERS}, got {gate_up_order!r}")
    i = r // 2 if activation == "swiglu" else r
    if fc2.codes.shape != (e, hidden.shape[1], i // 2):
        raise ValueError(f"fc2: expected codes shape {(e, hidden.shape[1], i // 2)} ([E, H, I/2]), got {fc2.codes.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= e):
        raise ValueError(f"topk_ids: expert ids must lie in [0, {e}), got [{ids.min()}, {ids.max()}]")
    return hidden, ids, wts, i


def moe_trace(
    hidden: np.ndarray,
    topk_ids: np.ndarray,
    topk_weights: np.ndarray,
    fc1: NVFP4,
    fc2: NVFP4,
    fc1_input_scale: np.ndarray,
    fc2_input_scale: np.ndarray,
    *,
    activation: str = "relu2",
    gate_up_order: str = "up_gate",
    mode: str = "trtllm_cutlass",
    activation_scale: str | None = None,
    h_override: np.ndarray | None = None,
) -> MoETrace:
    """:func:`moe` with every per-route intermediate (see :class:`MoETrace`).

    ``h_override`` [T*k, I] (bf16 values): use these activation outputs instead of the
    oracle's own for the FC2 half (to check a kernel's FC2 on its own FC1 result).
    """
    hidden, ids, wts, _inter = _check(hidden, topk_ids, topk_weights, fc1, fc2, activation, gate_up_order)
    g1e, g2e, alpha1, alpha2 = moe_scales(fc1, fc2, fc1_input_scale, fc2_input_scale, mode, activation_scale)
    t, k = ids.shape
    expert = ids.reshape(-1).astype(np.int64)
    token = np.repeat(np.arange(t), k)
    recipe = "trtllm" if mode == "trtllm_cutlass" else "b12x"
    g1, g2 = g1e[expert], g2e[expert]

    xq = _quantize_routes(hidden[token], g1, recipe)
    u_exact, absdot1 = _grouped_dot(xq, fc1, expert, alpha1)
    u = bf16_round(u_exact) if mode == "trtllm_cutlass" else u_exact
    h = bf16_round(activate(u, activation, gate_up_order))
    if h_override is not None:
        h_override = np.asarray(h_override, np.float64)
        if h_override.shape != h.shape:
            raise ValueError(f"h_override: expected shape {h.shape}, got {h_override.shape}")
        if not np.array_equal(bf16_round(h_override), h_override):
            raise ValueError("h_override: values must be bf16-representable")
        h = h_override
    hq = _quantize_routes(h, g2, recipe)
    d_exact, absdot2 = _grouped_dot(hq, fc2, expert, alpha2)
    w = f32(wts.reshape(-1))[:, None]
    if mode == "trtllm_cutlass":
        d = bf16_round(d_exact)
        contrib = f32(w * d)  # one fp32 multiply of an fp32 weight and a bf16 value
    else:
        d = d_exact
        contrib = w * d
    out = bf16_round(contrib.reshape(t, k, -1).sum(axis=1))
    return MoETrace(
        g1=g1, g2=g2, alpha1=alpha1, alpha2=alpha2,
        x_values=dequantize(xq, include_decode_scale=False), u=u, u_exact=u_exact, h=h,
        h_values=dequantize(hq, include_decode_scale=False), d=d, d_exact=d_exact,
        contrib=contrib, out=out, absdot1=absdot1, absdot2=absdot2,
    )


def moe(
    hidden: np.ndarray,
    topk_ids: np.ndarray,
    topk_weights: np.ndarray,
    fc1: NVFP4,
    fc2: NVFP4,
    fc1_input_scale: np.ndarray,
    fc2_input_scale: np.ndarray,
    *,
    activation: str = "relu2",
    gate_up_order: str = "up_gate",
    mode: str = "trtllm_cutlass",
    activation_scale: str | None = None,
) -> np.ndarray:
    """Routed NVFP4 MoE layer -> float64 [T, H] holding bf16 values (see the module docstring).

    hidden [T, H] bf16 values; topk_ids [T, k] int in [0, E); topk_weights [T, k] (fp32
    values); fc1 NVFP4 [E, R, H] (R = I relu2, 2I swiglu) with decode_scale [E] =
    weight_scale_2; fc2 NVFP4 [E, H, I]; fc1/fc2_input_scale [E] ModelOpt decode scales.
    """
    return moe_trace(
        hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale, fc2_input_scale,
        activation=activation, gate_up_order=gate_up_order, mode=mode,
        activation_scale=activation_scale,
    ).out
