"""Plain-XLA routed NVFP4 MoE: the reference path every kernel must agree with (runs on CPU).

Same semantics as ``oracle.moe`` (see its docstring for the two modes): activation
quantization with the mode's recipe (bit-exact), weights dequantized to bf16 (exact:
``e2m1 * e4m3`` has at most 6 significant bits), ``lax.ragged_dot`` with fp32 accumulation
over routes sorted by expert, fp32 alphas, the mode's bf16 rounding points, router weight,
fp32 sum over the top-k, bf16 output.

Also holds the pieces the Pallas path shares: :func:`moe_scales` and
:func:`quantized_values` (the FC1/FC2 activation quantization, written as ``q * sf`` values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import formats as F
from ..quantize import NVFP4Array, dequantize, ieee_div, quantize_blocks
from .routing import sort_keys

MODES = ("trtllm_cutlass", "b12x")
ACTIVATIONS = ("relu2", "swiglu")
GATE_UP_ORDERS = ("up_gate", "gate_up")
ACTIVATION_SCALES = ("scalar", "per_expert")


def bf16_round(v: jax.Array) -> jax.Array:
    """fp32 -> nearest bf16 value (RNE), kept in fp32: ``reduce_precision``, not a convert pair.

    XLA:GPU allows excess precision by default (``--xla_allow_excess_precision``): its
    simplify-fp-conversions pass may drop an ``f32 -> bf16 -> f32`` round trip inside a fusion,
    which would skip the bf16 rounding points of the modes (the Pallas-Triton kernels round
    inside the kernel and are not affected). ``reduce_precision`` is never removed; it is bit
    for bit the bf16 conversion, subnormals and overflow included (tests/test_moe_mosaic.py).
    """
    return lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)


def add_residual(residual: jax.Array, out: jax.Array) -> jax.Array:
    """bf16 [T, H] + bf16 [T, H] -> bf16 [T, H]: the bits of XLA's add of the two arrays
    materialized (each widened to fp32, added, rounded to nearest even), as the Mosaic combine
    kernel adds its residual.

    ``out``'s bf16 rounding goes through ``bf16_round``: inside one fusion XLA (the CPU backend
    too) may add the fp32 value ``out`` was converted from instead of its bf16 value.
    """
    return (residual.astype(jnp.float32) + bf16_round(out.astype(jnp.float32))).astype(jnp.bfloat16)


def recipe_of(mode: str) -> str:
    return "trtllm" if mode == "trtllm_cutlass" else "b12x"


def moe_scales(fc1_weight_scale_2, fc2_weight_scale_2, fc1_input_scale, fc2_input_scale,
               mode: str, activation_scale: str):
    """fp32 ``(g1 [E], g2 [E], alpha1 [E], alpha2 [E])``, the same expressions as ``oracle.moe_scales``.

    trtllm_cutlass: ``G = 1/max_e input_scale``, ``alpha = 1/(G * (1/weight_scale_2))``;
    b12x: ``G = 1/input_scale[e]`` (or the scalar), ``alpha = weight_scale_2 / G``.
    """
    out = []
    for ws2, s_in in ((fc1_weight_scale_2, fc1_input_scale), (fc2_weight_scale_2, fc2_input_scale)):
        ws2 = jnp.asarray(ws2, jnp.float32)
        s_in = jnp.broadcast_to(jnp.asarray(s_in, jnp.float32), ws2.shape)
        if activation_scale == "scalar":
            g = jnp.broadcast_to(ieee_div(1.0, jnp.max(s_in)), ws2.shape)
        else:
            g = ieee_div(1.0, s_in)
        alpha = ieee_div(1.0, g * ieee_div(1.0, ws2)) if mode == "trtllm_cutlass" else ieee_div(ws2, g)
        out.append((g, alpha))
    (g1, a1), (g2, a2) = out
    return g1, g2, a1, a2


def quantized_values(x: jax.Array, encode_scale: jax.Array, recipe: str) -> jax.Array:
    """Quantize rows of ``x [S, K]`` with per-row (``[S]``) or scalar encode scale G.

    Returns ``q * sf`` as bf16 ``[S, K]`` (exact: an E2M1 value times an E4M3 scale), i.e. the
    activation in units of ``1/G``; the global scale is carried by the GEMM's alpha.
    """
    xf = x.astype(jnp.float32)
    xb = xf.reshape(xf.shape[:-1] + (xf.shape[-1] // 16, 16))
    vmax = jnp.max(jnp.abs(xb), axis=-1)
    g = jnp.asarray(encode_scale, jnp.float32)
    g = g.reshape(g.shape + (1,) * (vmax.ndim - g.ndim))
    s, codes = quantize_blocks(xb, vmax, g, recipe)
    vals = F.e2m1_decode(codes).astype(jnp.float32) * s[..., None]
    return vals.reshape(xf.shape).astype(jnp.bfloat16)


def sorted_rows(hidden: jax.Array, topk_weights: jax.Array, g1: jax.Array, sorted_route: jax.Array,
                block_expert: jax.Array, *, top_k: int, block_m: int, recipe: str,
                activation_scale: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per sorted row of a block routing (``routing.block_routing``), the grouped kernels' operands.

    hidden bf16 [T, H]; topk_weights [T, k]; g1 fp32 [E] FC1 encode scales; sorted_route int32
    [EM] (sentinel T*k on padding rows); block_expert int32 [EM/block_m]. Returns the quantized FC1
    input ``q * sf`` bf16 [EM, H] (zero on padding rows), the router weight fp32 [EM] (0 on
    padding rows) and each row's expert int32 [EM].
    """
    n_routes = topk_weights.size
    valid = sorted_route < n_routes
    route = jnp.where(valid, sorted_route, 0)
    tok = route // top_k
    row_expert = jnp.repeat(block_expert, block_m)
    if activation_scale == "scalar":
        xv = quantized_values(hidden, g1[0], recipe)[tok]
    else:
        xv = quantized_values(hidden[tok], g1[row_expert], recipe)
    xv = jnp.where(valid[:, None], xv, jnp.zeros((), xv.dtype))
    wt = jnp.where(valid, topk_weights.reshape(-1).astype(jnp.float32)[route], 0.0)
    return xv, wt, row_expert


def activate(u: jax.Array, activation: str, gate_up_order: str) -> jax.Array:
    """fp32 activation: ``relu(u)^2`` or ``silu(gate) * up`` with halves per gate_up_order."""
    if activation == "relu2":
        r = jnp.where(u < 0.0, 0.0, u)  # relu keeping NaN (GPU max may drop it)
        return r * r
    i = u.shape[-1] // 2
    first, second = u[..., :i], u[..., i:]
    up, gate = (first, second) if gate_up_order == "up_gate" else (second, first)
    return gate / (1.0 + jnp.exp(-gate)) * up


def moe_xla(
    hidden: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    fc1: NVFP4Array,
    fc2: NVFP4Array,
    fc1_input_scale: jax.Array,
    fc2_input_scale: jax.Array,
    *,
    activation: str,
    gate_up_order: str,
    mode: str,
    activation_scale: str,
    return_intermediates: bool = False,
):
    """XLA MoE -> bf16 [T, H] (and, with ``return_intermediates``, per-route ``h`` [T*k, I])."""
    t, k = topk_ids.shape
    e = fc1.shape[0]
    recipe = recipe_of(mode)
    g1, g2, a1, a2 = moe_scales(fc1.decode_scale, fc2.decode_scale, fc1_input_scale,
                                fc2_input_scale, mode, activation_scale)
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(sort_keys(flat, e), stable=True)
    e_sorted = flat[order]
    tok_sorted = order // k
    group_sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)

    if activation_scale == "scalar":
        x_sorted = quantized_values(hidden, g1[0], recipe)[tok_sorted]
    else:
        x_sorted = quantized_values(hidden[tok_sorted], g1[e_sorted], recipe)
    w1 = dequantize(fc1, jnp.bfloat16, include_decode_scale=False)  # [E, R, H], exact
    w2 = dequantize(fc2, jnp.bfloat16, include_decode_scale=False)  # [E, H, I]
    acc1 = lax.ragged_dot(x_sorted, jnp.swapaxes(w1, 1, 2), group_sizes,
                          preferred_element_type=jnp.float32)
    u = acc1 * a1[e_sorted][:, None]
    if mode == "trtllm_cutlass":  # GEMM1 output buffer is bf16 (see bf16_round: not astype pairs)
        u = bf16_round(u)
    h = bf16_round(activate(u, activation, gate_up_order)).astype(jnp.bfloat16)
    hv = quantized_values(h, g2[e_sorted], recipe)
    acc2 = lax.ragged_dot(hv, jnp.swapaxes(w2, 1, 2), group_sizes,
                          preferred_element_type=jnp.float32)
    d = acc2 * a2[e_sorted][:, None]
    if mode == "trtllm_cutlass":  # GEMM2 output is bf16
        d = bf16_round(d)
    contrib = d * topk_weights.reshape(-1).astype(jnp.float32)[order][:, None]
    per_route = jnp.zeros_like(contrib).at[order].set(contrib)
    out = per_route.reshape(t, k, -1).sum(axis=1).astype(jnp.bfloat16)
    if return_intermediates:
        h_route = jnp.zeros_like(h).at[order].set(h)
        return out, {"h": h_route}
    return out
