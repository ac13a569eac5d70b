"""A loaded model's MoE experts as TensorRT-LLM's CUTEDSL-b12x backend holds them.

``NVFP4CuteDslB12xFusedMoEMethod.transform_weights`` folds each expert's ``weight_scale_2``
into its E4M3 block scales, ``E4M3(float(scale) * w_scale_2[e])``, and drops the fp32 factor
(``nvfp4_jax.interop.trtllm.cutedsl_b12x_moe_weights`` re-enacts it in numpy). Where
``w_scale_2`` is small (weights with a small amax), the folded scales fall into E4M3
subnormals (below 2^-6, 3 significant bits at most) or flush to zero, and those blocks lose
precision or vanish. :func:`fold_cutedsl_b12x` applies that folding to a :class:`Model`'s MoE
layers so that the same decoder runs the folded weights, and lists the damaged blocks per
layer, matrix and expert.

The result models the b12x kernel, which TensorRT-LLM runs for MoE calls of fewer than 64 rows
(decode); calls of 64 rows or more (prefill) run CUTLASS on the checkpoint's scales.
Arithmetic: folded block scales with decode scale 1 and the layer's activation scale as the
output factor, as b12x's ``w_alpha = 1 / fc_input_scale`` (equal up to fp32 operation order).
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .. import nn
from ..interop import trtllm as T
from .decoder import Model

#: the smallest normal E4M3 value: folded scales below it are subnormal
E4M3_MIN_NORMAL = 2.0**-6


@dataclasses.dataclass(frozen=True)
class FoldedBlocks:
    """Folding damage in one expert matrix: ``layer``, ``fc`` ("fc1" | "fc2"), ``expert``;
    ``blocks``: blocks with a nonzero checkpoint scale; ``subnormal``: of those, folded to an
    E4M3 subnormal; ``flushed``: folded to zero; ``w_scale_2``: the folded fp32 factor."""

    layer: int
    fc: str
    expert: int
    blocks: int
    subnormal: int
    flushed: int
    w_scale_2: float


def _fold_layer(p: nn.MoE, layer: int, stats: list) -> nn.MoE:
    """One layer's MoE (fc1/fc2 [E, ...]) with folded block scales and decode scales of 1."""
    stack = {}
    for fc in ("fc1", "fc2"):
        a = getattr(p, fc)
        stack[fc] = types.SimpleNamespace(codes=np.asarray(a.codes),
                                          scales=np.asarray(a.scales).view(np.uint8),
                                          decode_scale=np.asarray(a.decode_scale, np.float32))
    args = (stack["fc1"], stack["fc2"], np.asarray(p.fc1_input_scale),
            np.asarray(p.fc2_input_scale))
    base = T.cutlass_moe_weights(*args, activation=p.activation, gate_up_order="up_gate")
    rt = T.cutedsl_b12x_moe_weights(*args, activation=p.activation, gate_up_order="up_gate")
    out = {}
    for fc in ("fc1", "fc2"):
        a, orig = getattr(p, fc), stack[fc].scales
        folded = getattr(rt, f"{fc}_scales")
        # the factor b12x folds: w_scale_2 = fc_alpha * fc_input_scale (fp32)
        ws = (getattr(base, f"{fc}_alpha") * getattr(base, f"{fc}_act_scale")).astype(np.float32)
        v, v0 = T.e4m3_values(folded), T.e4m3_values(orig)
        for e in range(orig.shape[0]):
            live = v0[e] != 0
            stats.append(FoldedBlocks(
                layer, fc, e, int(live.sum()),
                int((live & (v[e] > 0) & (v[e] < E4M3_MIN_NORMAL)).sum()),
                int((live & (v[e] == 0)).sum()), float(ws[e])))
        scales = jnp.asarray(folded.view(ml_dtypes.float8_e4m3fn))
        ones = jnp.ones(np.shape(a.decode_scale), jnp.float32)
        out[fc] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(a),
                                               [a.codes, scales, ones])
    return dataclasses.replace(p, **out)


def fold_cutedsl_b12x(model: Model) -> tuple[Model, list[FoldedBlocks]]:
    """``model`` with every MoE layer's expert block scales folded as TensorRT-LLM's
    CUTEDSL-b12x backend folds them (see the module docstring), and the per-expert damage.

    Dense linears, attention, router and LM head are unchanged. Returns (folded model, one
    :class:`FoldedBlocks` per MoE layer, matrix and expert).
    """
    stats: list[FoldedBlocks] = []
    groups = []
    li = 0
    for kind, g in zip(model.group_kinds, model.groups):
        n = 1 if kind == "one" else jax.tree_util.tree_leaves(g)[0].shape[0]
        if "moe" in g:
            p = g["moe"]
            if kind == "one":
                moe = _fold_layer(p, li, stats)
            else:
                per = [_fold_layer(jax.tree_util.tree_map(lambda a, i=i: a[i], p), li + i, stats)
                       for i in range(n)]
                moe = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per)
            g = {**g, "moe": moe}
        groups.append(g)
        li += n
    return dataclasses.replace(model, groups=groups), stats
