"""The MoE's encode scales and alphas in one Pallas-Triton launch (IEEE divisions).

``moe_scales_kernel`` computes ``xla.moe_scales``' four [E] vectors and the two reciprocals the
glue kernels take in one program instead of ~8 small XLA fusions, every division
``div.rn.f32`` whatever XLA's division flags. ``load_scales`` / ``store_scales`` are its body,
which the routing kernels reuse to compute the scales in their own launch.

Inside a loop over stacked layers the four operands are per-layer slices; a Pallas-Triton
kernel gets each slice copied (a launch), so one XLA fusion packs them into one operand. With
``layer`` the kernels read the four [L, E] (or [L]) stacks in place at the layer's row
instead, and no launch packs or copies them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from ..triton_ops import call, div_rn, pow2
from ..validate import check_layer

#: the four scale operands, in the order the kernels take them (the names errors give)
SCALE_NAMES = ("fc1_weight_scale_2", "fc2_weight_scale_2", "fc1_input_scale", "fc2_input_scale")


def scales_plan(scales: tuple, num_experts: int, interpret: bool, layer=None):
    """``(fc1_weight_scale_2, fc2_weight_scale_2, fc1_input_scale, fc2_input_scale, mode,
    activation_scale)`` -> (the kernel's scale operands, ``load_scales``' static arguments,
    the six fp32 [E] outputs' shapes).

    ``layer``: None (the four fp32 [E] or scalars, packed in one fp32 [4 * E] operand), or an
    int32 scalar: the four are stacks fp32 [L, E] or [L] (one value per layer for every
    expert), read in place at row ``layer`` (clamped to [0, L)); the operands are then
    ``layer`` int32 [1] and the four stacks, flat."""
    *vecs, mode, activation_scale = scales
    kw = {"e": num_experts, "activation_scale": activation_scale, "mode": mode,
          "exact_asm": not interpret}
    f32 = jax.ShapeDtypeStruct((num_experts,), jnp.float32)
    if layer is None:
        return (_scale_operands(vecs, num_experts),), kw, (f32,) * 6
    stacks, cols = _scale_stacks(vecs, num_experts)
    n_layers = stacks[0].size // cols[0]
    check_layer(layer, n_layers)
    lay = jnp.asarray(layer, jnp.int32).reshape(1)
    return (lay, *stacks), {**kw, "cols": cols, "n_layers": n_layers}, (f32,) * 6


def load_scales(sc_refs, *, e: int, activation_scale: str, mode: str, exact_asm: bool,
                cols: tuple | None = None, n_layers: int = 1):
    """Issues the loads of the four scale vectors from ``scales_plan``'s operands ``sc_refs``
    (the packed fp32 [4 * E], or with ``cols``, each stack's columns E or 1, the layer and the
    four flat stacks) and returns the function that computes from them (j, valid, [g1, 1/g1,
    alpha1, g2, 1/g2, alpha2]): the six [E] scale vectors in registers, lanes past E invalid.
    A kernel loads early, before reductions whose barriers a later load cannot be hoisted
    across, and computes where it needs the values."""
    ep = pow2(e)
    j = lax.broadcasted_iota(jnp.int32, (ep,), 0)
    valid = j < e
    jc = jnp.minimum(j, e - 1)
    if cols is None:
        def vec(row):  # row ``row`` of the packed [4, E]
            return plgpu.load(sc_refs[0].at[row * e + jc])
    else:
        layer = jnp.minimum(jnp.maximum(sc_refs[0][0], 0), n_layers - 1)

        def vec(row):  # stack ``row`` at the layer's row; one column: every expert's value
            c = cols[row]
            col = jc if c > 1 else jnp.zeros_like(jc)
            return plgpu.load(sc_refs[1 + row].at[layer * c + col])

    loaded = [vec(row) for row in range(4)]

    def values():
        one = jnp.ones((ep,), jnp.float32)
        vals = []
        for w_row, s_row in ((0, 2), (1, 3)):
            ws2, s_in = loaded[w_row], loaded[s_row]
            if activation_scale == "scalar":  # one encode scale: 1 / max over the input scales
                m = jnp.max(jnp.where(valid, s_in, -jnp.inf))
                g = div_rn(one, jnp.full((ep,), m, jnp.float32), exact_asm)
            else:
                g = div_rn(one, s_in, exact_asm)
            if mode == "trtllm_cutlass":
                alpha = div_rn(one, g * div_rn(one, ws2, exact_asm), exact_asm)
            else:
                alpha = div_rn(ws2, g, exact_asm)
            vals += [g, div_rn(one, g, exact_asm), alpha]
        return j, valid, vals

    return values


def store_scales(j, valid, vals, out_refs) -> None:
    """Stores ``load_scales``' six vectors."""
    for ref, v in zip(out_refs, vals, strict=True):
        # masked lanes index past E (not clamped: a duplicate index would race with the valid
        # lane's store; interpret mode drops them)
        plgpu.store(ref.at[j], v, mask=valid)


def scales_kernel(*refs, n_in: int, **kw):
    """``load_scales`` of the first ``n_in`` refs, stored to the six after them."""
    store_scales(*load_scales(refs[:n_in], **kw)(), refs[n_in:])


def moe_scales_kernel(fc1_weight_scale_2: jax.Array, fc2_weight_scale_2: jax.Array,
                      fc1_input_scale: jax.Array, fc2_input_scale: jax.Array, *, num_experts: int,
                      mode: str, activation_scale: str, interpret: bool = False,
                      layer: jax.Array | int | None = None):
    """``xla.moe_scales`` plus the two reciprocals the glue kernels take, as one Pallas-Triton
    launch (one program) instead of ~8 small XLA fusions, each division ``div.rn.f32`` (IEEE,
    whatever XLA's division flags). Operands: fp32 [E] or scalars (one value for every
    expert); with ``layer`` (an int32 scalar) stacks fp32 [L, E] or [L], read in place at
    that row (``scales_plan``). Returns fp32 [E] each: ``(g1, 1/g1, alpha1, g2, 1/g2,
    alpha2)``, bit for bit the expressions of ``oracle.moe_scales``."""
    ops, kw, outs = scales_plan((fc1_weight_scale_2, fc2_weight_scale_2, fc1_input_scale,
                                 fc2_input_scale, mode, activation_scale), num_experts, interpret,
                                layer)
    return call(functools.partial(scales_kernel, n_in=len(ops), **kw), outs, (1,), num_warps=4,
                name="nvfp4_moe_scales", interpret=interpret)(*ops)


def _scale_operands(vecs, e: int) -> jax.Array:
    """The four scale operands (fp32 [E], or a scalar for every expert), validated, as one
    fp32 [4 * E]: one XLA fusion makes it from a scan's per-layer slices, where four operands
    of their own would each be copied out of their stack (a launch each) for the kernel."""
    ops = []
    for name, v in zip(SCALE_NAMES, vecs, strict=True):
        v = jnp.asarray(v, jnp.float32)
        if v.shape not in ((), (1,), (e,)):
            raise ValueError(f"{name}: expected a scalar or shape ({e},), got {v.shape}")
        ops.append(jnp.broadcast_to(v.reshape(-1), (e,)))
    return jnp.concatenate(ops)


def _scale_stacks(vecs, e: int) -> tuple[tuple, tuple]:
    """The four scale stacks (fp32 [L, E], or [L] for every expert), validated, flat, and
    their columns (E or 1)."""
    flat, cols, n_layers = [], [], None
    for name, v in zip(SCALE_NAMES, vecs, strict=True):
        v = jnp.asarray(v, jnp.float32)
        if v.ndim == 1 or (v.ndim == 2 and v.shape[1] == 1):
            c = 1
        elif v.ndim == 2 and v.shape[1] == e:
            c = e
        else:
            raise ValueError(f"{name}: expected a stack [L, {e}] or [L] with layer given, got "
                             f"shape {v.shape}")
        if n_layers is not None and v.shape[0] != n_layers:
            raise ValueError(f"{name}: expected {n_layers} layers (the stacks before it), got "
                             f"shape {v.shape}")
        n_layers = v.shape[0]
        if n_layers == 0:
            raise ValueError(f"{name}: expected a stack of at least one layer, got shape {v.shape}")
        flat.append(v.reshape(-1))
        cols.append(c)
    return tuple(flat), tuple(cols)
