"""A MoE layer's input RMSNorm and its router logits in one Pallas-Triton launch.

In XLA the decoders' ``h = nn.rms_norm(x, w)`` then ``nn.router_logits`` are three launches per
MoE layer at decode (the sum of squares, the normalize, the router product as a reduction), and
inside a loop over stacked layers the norm weight and the router are per-layer slices.
:func:`norm_router_kernel` does it in one launch, the norm weight [L, H] and the router
[L, E, H] read in place at the layer's row:

* one program per (token, block of ``eb`` experts): the token's row normed in registers with
  ``nn.rms_norm``'s rounding points, ``y = bf16(x * rsqrt(sum(x^2) / H + eps))``, ``h =
  bf16(w * y)`` (the fp32 sum of squares in the tile's order, not XLA's: an inexact rsqrt
  and another order can move a bf16 rounding by an ulp, ``oracle.norm_rope_interval``);
* its experts' logits ``bf16(sum_k h_k r_ek)`` in fp32 (exact bf16 products, summed in the
  tile's order), as fp32 values: ``nn.router_logits``' bf16 rounding;
* the programs of the first expert block store h, the MoE's input.

With a ``residual`` (the decoders' ``x + attention(x)`` before the MoE) every program first
adds its token's two bf16 rows (``bf16(f32(x) + f32(a))``, the bits of XLA's bf16 add) and
norms the sum, which the first expert block's programs also store: the residual stream the
MoE's output is added to. That add is otherwise an XLA launch of its own each layer.

Each program recomputes its token's norm (H values, a few microseconds' worth of nothing next
to a launch) instead of waiting for another program's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..triton_ops import bf16_rne, call, pow2
from ..validate import check_layer

#: Most tokens the kernel takes (decode batches; prefill runs the XLA composition).
MAX_TOKENS = 64
#: Largest hidden size: one program holds a token's row (H / (32 * warps) fp32 a thread).
MAX_HIDDEN = 8192
#: Programs a launch aims for (the H100 and H200 have 132 SMs): experts per program
#: ``eb = clamp(T * E / TARGET_PROGRAMS, 1, MAX_EXPERT_BLOCK)``, a power of two.
TARGET_PROGRAMS = 128
MAX_EXPERT_BLOCK = 8


def norm_router_fits(tokens: int, hidden: int, experts: int, router_dtype) -> str | None:
    """None where :func:`norm_router_kernel` takes this layer, else why not."""
    if not 1 <= tokens <= MAX_TOKENS:
        return f"{tokens} tokens (the kernel takes 1..{MAX_TOKENS})"
    if hidden & (hidden - 1) or not 16 <= hidden <= MAX_HIDDEN:
        return f"hidden size {hidden} (a power of two in 16..{MAX_HIDDEN})"
    if jnp.dtype(router_dtype) != jnp.bfloat16:
        return f"a {jnp.dtype(router_dtype).name} router (bf16 only)"
    if experts < 1:
        return "no experts"
    return None


def expert_block(tokens: int, experts: int) -> int:
    """Experts per program (module docstring)."""
    eb = 1
    while eb < MAX_EXPERT_BLOCK and tokens * experts // (2 * eb) >= TARGET_PROGRAMS:
        eb *= 2
    return min(eb, pow2(experts))


def num_warps(eb: int, hidden: int) -> int:
    """Warps of a program: 4, up to 8 where its [eb, H] router tile passes 64 values a
    thread."""
    return max(4, min(8, eb * hidden // (32 * 64)))


def _kernel(l_ref, x_ref, *refs, e: int, eb: int, hd: int, n_layers: int, eps: float,
            add: bool, exact_asm: bool):
    if add:
        a_ref, w_ref, r_ref, h_ref, lg_ref, s_ref = refs
    else:
        (w_ref, r_ref, h_ref, lg_ref), a_ref, s_ref = refs, None, None
    t, j = pl.program_id(0), pl.program_id(1)
    layer = jnp.minimum(jnp.maximum(l_ref[0], 0), n_layers - 1)
    cols = lax.broadcasted_iota(jnp.int32, (1, hd), 1)
    # every load before the norm's sum (a load after a reduction's barrier waits for it)
    x = plgpu.load(x_ref.at[t, cols]).astype(jnp.float32)  # [1, H]
    a = plgpu.load(a_ref.at[t, cols]).astype(jnp.float32) if add else None
    w = plgpu.load(w_ref.at[layer, cols]).astype(jnp.float32)
    ex = j * eb + lax.broadcasted_iota(jnp.int32, (eb, 1), 0)
    r = plgpu.load(r_ref.at[layer, jnp.minimum(ex, e - 1), cols]).astype(jnp.float32)  # [eb, H]
    if add:  # the residual stream: x + a rounded once to bf16, as XLA's bf16 add
        x = bf16_rne(x + a, exact_asm)
    inv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) * (1.0 / hd) + eps)
    h = bf16_rne(w * bf16_rne(x * inv, exact_asm), exact_asm)  # [1, H], bf16 values

    @pl.when(j == 0)
    def _():
        plgpu.store(h_ref.at[t, cols], h.astype(jnp.bfloat16))
        if add:
            plgpu.store(s_ref.at[t, cols], x.astype(jnp.bfloat16))

    logit = bf16_rne(jnp.sum(r * h, axis=1), exact_asm)  # [eb]
    e1 = j * eb + lax.broadcasted_iota(jnp.int32, (eb,), 0)
    plgpu.store(lg_ref.at[t, e1], logit, mask=e1 < e)


def norm_router_kernel(x: jax.Array, norm_weight: jax.Array, router: jax.Array, eps: float, *,
                       layer: jax.Array | int | None = None, residual: jax.Array | None = None,
                       interpret: bool = False) -> tuple[jax.Array, ...]:
    """``h = nn.rms_norm(x, norm_weight, eps)`` and ``nn.router_logits`` of it, one launch.

    x: bf16 [T, H] (``norm_router_fits``: T <= MAX_TOKENS, H a power of two <= MAX_HIDDEN);
    norm_weight bf16 [H] and router bf16 [E, H], or with ``layer`` (an int32 scalar, clamped
    into [0, L)) the stacks bf16 [L, H] and [L, E, H], read in place at that row. Returns (h
    bf16 [T, H], logits float32 [T, E], bf16 values). h: ``nn.rms_norm``'s rounding points, its
    fp32 sum of squares in another order (within ``oracle.norm_rope_interval``); logits: the
    fp32 sum of the exact products h_k r_ek in another order than XLA's, rounded to bf16.
    residual: None, or bf16 [T, H]: the layer's input is ``s = x + residual`` (XLA's bf16
    add, bit for bit), normed as x would be; returns (s, h, logits).
    ``interpret``: Pallas interpret mode (CPU tests)."""
    x = jnp.asarray(x)
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x: expected bf16 [T, H], got {x.dtype} {x.shape}")
    t, hd = x.shape
    add = residual is not None
    if add and (jnp.shape(residual) != x.shape or jnp.asarray(residual).dtype != jnp.bfloat16):
        raise ValueError(f"residual: expected bf16 {list(x.shape)} (x's shape), got "
                         f"{jnp.asarray(residual).dtype} {jnp.shape(residual)}")
    stacked = layer is not None
    wn, r = jnp.asarray(norm_weight), jnp.asarray(router)
    if r.ndim != (3 if stacked else 2) or r.shape[-1] != hd or r.dtype != jnp.bfloat16:
        want = "[L, E, H]" if stacked else "[E, H]"
        raise ValueError(f"router: expected bf16 {want} with H = {hd}, got {r.dtype} {r.shape}")
    e = r.shape[-2]
    why = norm_router_fits(t, hd, e, r.dtype)
    if why:
        raise ValueError(f"x: the norm-router kernel does not take {why}")
    n_layers = r.shape[0] if stacked else 1
    want_w = (n_layers, hd) if stacked else (hd,)
    if wn.shape != want_w or wn.dtype != jnp.bfloat16:
        raise ValueError(f"norm_weight: expected bf16 {list(want_w)}, got {wn.dtype} {wn.shape}")
    if stacked:
        check_layer(layer, n_layers)
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    eb = expert_block(t, e)
    kern = functools.partial(_kernel, e=e, eb=eb, hd=hd, n_layers=n_layers, eps=float(eps),
                             add=add, exact_asm=not interpret)
    row = jax.ShapeDtypeStruct((t, hd), jnp.bfloat16)  # h, and with the add the sum
    out = (row, jax.ShapeDtypeStruct((t, e), jnp.float32)) + ((row,) if add else ())
    operands = (lay, x) + ((jnp.asarray(residual),) if add else ())
    h, logits, *s = call(kern, out, (t, -(-e // eb)), num_warps=num_warps(eb, hd),
                         name="nvfp4_moe_add_norm_router" if add else "nvfp4_moe_norm_router",
                         interpret=interpret)(*operands, wn.reshape(n_layers, hd),
                                              r.reshape(n_layers, e, hd))
    return (*s, h, logits)
