"""Tensor- and expert-parallel decoders: :func:`shard_model` places a :class:`Model` on a mesh axis.

``sharded = shard_model(model, mesh, axis="tp")`` returns a :class:`ShardedModel` that
``forward``, ``prefill``, ``decode_step`` and ``generate`` take in place of the model. Each
forward is one ``shard_map`` over ``axis`` (D devices) running the decoder's own layer code on
each device's share, with these splits (NVFP4 codes, block scales and the per-tensor or
per-expert ``decode_scale`` of a weight always travel together; nothing is dequantized or
refolded):

* attention: q/k/v_proj column-parallel by heads (device p holds q heads [p nh/D, (p+1) nh/D)
  and kv heads [p kvh/D, (p+1) kvh/D), the kv heads its q heads read under GQA); RoPE, q/k
  norms and the attention core run on the local heads; o_proj row-parallel (below);
* dense MLP: gate/up_proj column-parallel (I/D rows each), down_proj row-parallel;
* MoE: the router (bf16 [E, H]) replicated, experts split E/D per device (expert
  parallelism, ``nvfp4_jax.parallel.ep_route_outputs``); each device computes its experts'
  routes and the per-route bf16 outputs are combined exactly (below);
* KV cache [L, B, S, KVH, D] sharded on KVH (each device caches its own kv heads);
* embedding (bf16 [V, H]) replicated: a lookup of B*T rows reads little, and a vocab split
  would add a collective per forward to save memory only; LM head column-parallel over V
  (the largest dense read of a decode step, divided by D); the logits [B, T, V] come back
  sharded on V, each the single-device dot (no collective; argmax and sampling run on the
  sharded array under jit).

Row-parallel linears (o_proj, down_proj: x [.., K] split on K) have two exact-by-design
choices, ``row_parallel``:

* ``"psum"`` (default): weight split on K in whole 16-value blocks (K % (16 D) == 0), fp32
  partials without any scale, ``psum``, then alpha and the cast
  (``nvfp4_jax.parallel.row_parallel_matmul``). One all-reduce of fp32 [T, N]; it changes
  the fp32 summation order (D partial sums added by the collective), so the output is within
  ``oracle.gemm_error_bound``'s accumulation bound of the single-device one, not bit for bit
  (at D = 2 it is bit for bit the two-slice sum ``p0 + p1``, as fp32 addition commutes).
* ``"gather"``: weight split on N; x all-gathered to the full K, each device computes N/D
  output columns over the full K (the single-device dot), outputs all-gathered: bit for bit
  the single-device linear, at two all-gathers.

Bytes each device sends per layer (ring collectives, f = (D-1)/D, T tokens, bf16 activations,
:func:`tp_bytes`): o_proj ``psum`` 2 f T H 4, ``gather`` f T (nh hd + H) 2; down_proj ``psum``
2 f T H 4, ``gather`` f T (I + H) 2; MoE combine min(all-reduce of the per-route outputs
2 f T k H 2, reduce-scatter + all-gather f T' H 2 (k + 1) with T' = T rounded up to a
multiple of D). For Qwen3-30B-A3B (H 2048, nh hd 4096): o_proj ``gather`` sends 3/4 of what
``psum`` sends and is exact, at two collectives instead of one (latency at decode sizes);
for Llama-3-8B's down_proj (I 14336 = 3.5 H) ``gather`` sends 9/8 of ``psum``.

MoE: expert parallelism rather than TP within experts: a split of each expert's I would
all-reduce fp32 FC2 partials per route, 2 f T k H 4 bytes (64 f T H at k = 8), against
EP's exact bf16 per-route combine, at most f T' H 2 (k + 1) (18 f T' H), and it would cut
each expert GEMM to I/D columns. Each device computes ``capacity`` route rows: by default
T*k (every route may pick its experts: exact for any routing, and the whole layer's expert
FLOPs on each device); ``moe_capacity_factor`` c computes ``ceil(c T k / D)`` rows, and a
route past it makes its token's row NaN (visible, never silently finite).

Errors: a mesh axis that does not divide the heads, kv heads, experts, vocabulary, MLP width
(in multiples of 16 per device for a ``psum`` row split) or hidden size (``gather``) raises
ValueError naming ``mesh`` and the config field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import nn
from .. import parallel as par
from ..moe import select_experts
from ..quantize import NVFP4Array
from .decoder import DecoderConfig, KVCache, Model, forward, unfuse_projections

__all__ = ["ROW_PARALLEL", "ExpertParallelMoE", "RowParallelLinear", "ShardedModel",
           "moe_combine_bytes", "shard_model", "tp_bytes"]

ROW_PARALLEL = ("psum", "gather")

#: (block, name) -> role of each linear of a layer dict; anything else is replicated
_ROLES = {("self_attn", "q_proj"): "column", ("self_attn", "k_proj"): "column",
          ("self_attn", "v_proj"): "column", ("self_attn", "o_proj"): "row",
          ("mlp", "gate_proj"): "column", ("mlp", "up_proj"): "column",
          ("mlp", "down_proj"): "row"}


def _local_nvfp4(w: NVFP4Array) -> NVFP4Array:
    """The same arrays with the logical shape of this device's slice."""
    shape = tuple(w.codes.shape[:-1]) + (2 * w.codes.shape[-1],)
    return NVFP4Array(w.codes, w.scales, w.decode_scale, shape, w.layout)


def _local_linear(p):
    return dataclasses.replace(p, w=_local_nvfp4(p.w)) if isinstance(p, nn.Linear) else p


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParallelLinear:
    """One device's share of a row-parallel linear (inside :class:`ShardedModel`'s shard_map).

    p: ``nn.Linear`` or bf16 weight; ``scheme`` "psum": [N, K/D] (this device's K slice),
    x [..., K/D] -> bf16 [..., N] after a ``psum`` of fp32 partials; "gather": [N/D, K], x
    [..., K/D] all-gathered to [..., K], output columns all-gathered to [..., N].
    """

    p: Any
    axis: str = dataclasses.field(metadata={"static": True})
    scheme: str = dataclasses.field(metadata={"static": True})
    devices: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the output and of this device's input slice."""
        n, k = self.p.shape[-2], self.p.shape[-1]
        return (n * self.devices, k) if self.scheme == "gather" else (n, k)

    def __call__(self, x: jax.Array, *, backend: str = "auto", w4a4: bool = True) -> jax.Array:
        if self.scheme == "gather":
            x = lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)
            y = nn.linear(self.p, x, backend=backend, w4a4=w4a4)
            return lax.all_gather(y, self.axis, axis=y.ndim - 1, tiled=True)
        if isinstance(self.p, nn.Linear):
            s = self.p.input_scale if w4a4 else None
            return par.row_parallel_matmul(x, self.p.w, axis=self.axis, input_scale=s,
                                           backend=backend)
        # a bf16 weight (left unquantized by the checkpoint): nn.linear's dot, K split
        part = lax.dot_general(x, self.p.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
        return lax.psum(part, self.axis).astype(jnp.bfloat16)


def moe_combine_bytes(tokens: int, hidden: int, top_k: int, devices: int) -> dict:
    """Bytes one device sends to combine the per-route bf16 outputs [T*k, H] of an
    expert-parallel layer whose tokens every device holds: ``all_reduce`` (then every device
    adds all tokens' routes) or ``reduce_scatter`` + ``all_gather`` (each device adds T'/D
    tokens' routes, T' = T rounded up to a multiple of D, then the outputs are gathered)."""
    t, h, k, d = tokens, hidden, top_k, devices
    f = (d - 1) / d
    tp = -(-t // d) * d
    return {"all_reduce": 2 * f * t * k * h * 2,
            "reduce_scatter": f * tp * h * 2 * (k + 1)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertParallelMoE:
    """One device's share of an ``nn.MoE`` (inside :class:`ShardedModel`'s shard_map): the
    router bf16 [E, H] (replicated), fc1/fc2 and their input scales for E/D experts."""

    moe: nn.MoE
    axis: str = dataclasses.field(metadata={"static": True})
    devices: int = dataclasses.field(metadata={"static": True})
    capacity_factor: float | None = dataclasses.field(default=None, metadata={"static": True})

    def __call__(self, x: jax.Array, *, backend: str = "auto") -> jax.Array:
        """x bf16 [T, H] (every token, the same on every device) -> bf16 [T, H], bit for bit
        ``nn.moe_block`` of the unsharded layer (same routing, per-route arithmetic and fp32
        top-k sum) unless a route falls past the capacity (its token's row is then NaN)."""
        m, d, axis = self.moe, self.devices, self.axis
        t, h = x.shape
        k = m.top_k
        ids, wts = select_experts(nn.router_logits(m, x), k, routing=m.routing,
                                  renormalize=m.renormalize, correction_bias=m.correction_bias,
                                  routed_scaling_factor=m.routed_scaling_factor)
        cap = (None if self.capacity_factor is None
               else par.ep_capacity(t, k, d, self.capacity_factor))
        buf, done = par.ep_route_outputs(x, ids, m.fc1, m.fc2, m.fc1_input_scale,
                                         m.fc2_input_scale, axis=axis, capacity=cap,
                                         activation=m.activation, gate_up_order="up_gate",
                                         mode="trtllm_cutlass", backend=backend)
        b = moe_combine_bytes(t, h, k, d)
        if b["all_reduce"] <= b["reduce_scatter"]:
            out = par.ep_weighted_sum(lax.psum(buf, axis), wts)
            if cap is not None:
                lost = jnp.any(lax.psum(done, axis).reshape(t, k) == 0, axis=1)
                out = jnp.where(lost[:, None], jnp.asarray(jnp.nan, out.dtype), out)
            return out
        tpad = -(-t // d) * d
        tl = tpad // d
        buf = jnp.concatenate([buf, jnp.full(((tpad - t) * k, h), -0.0, buf.dtype)])
        wts = jnp.concatenate([wts, jnp.zeros((tpad - t, k), wts.dtype)])
        mine = lax.psum_scatter(buf, axis, scatter_dimension=0, tiled=True)  # [T'/D*k, H]
        w_loc = lax.dynamic_slice_in_dim(wts, lax.axis_index(axis) * tl, tl)
        out = par.ep_weighted_sum(mine, w_loc)
        if cap is not None:
            done = jnp.concatenate([done, jnp.ones(((tpad - t) * k,), done.dtype)])
            got = lax.psum_scatter(done, axis, scatter_dimension=0, tiled=True)
            lost = jnp.any(got.reshape(tl, k) == 0, axis=1)
            out = jnp.where(lost[:, None], jnp.asarray(jnp.nan, out.dtype), out)
        return lax.all_gather(out, axis, tiled=True)[:t]


def _split(a, dim: int, axis: str) -> P:
    return P(*[axis if i == dim else None for i in range(a.ndim)])


def _linear_spec(p, lead: int, split_k: bool, axis: str):
    """PartitionSpecs for a linear (``nn.Linear`` or bf16 [.., N, K]): N (dim ``lead``) or K
    (the last dim of the codes, block scales or weight) split over ``axis``."""
    def one(a):
        return _split(a, a.ndim - 1 if split_k else lead, axis)

    if isinstance(p, nn.Linear):
        w = p.w
        return dataclasses.replace(
            p, w=NVFP4Array(one(w.codes), one(w.scales), P(), w.shape, w.layout),
            input_scale=None if p.input_scale is None else P())
    return one(p)


def _replicated(tree):
    return jax.tree_util.tree_map(lambda a: P(), tree)


def _layer_specs(p: dict, lead: int, axis: str, row: str) -> dict:
    out = {}
    for key, v in p.items():
        if key == "moe":
            m = v
            if not isinstance(m, nn.MoE):
                raise ValueError(f"model: expert parallelism needs nn.MoE layers, got "
                                 f"{type(m).__name__}")
            ex = lambda a: _split(a, lead, axis)  # noqa: E731 - experts on their leading E
            out[key] = dataclasses.replace(
                m, router=P(), fc1=jax.tree_util.tree_map(ex, m.fc1),
                fc2=jax.tree_util.tree_map(ex, m.fc2), fc1_input_scale=ex(m.fc1_input_scale),
                fc2_input_scale=ex(m.fc2_input_scale),
                correction_bias=None if m.correction_bias is None else P())
        elif isinstance(v, dict):
            out[key] = {}
            for name, lin in v.items():
                role = _ROLES.get((key, name))
                if role is None:
                    out[key][name] = _replicated(lin)
                else:
                    out[key][name] = _linear_spec(lin, lead, role == "row" and row == "psum",
                                                  axis)
        else:
            out[key] = _replicated(v)
    return out


def _local_layer(p: dict, axis: str, row: str, d: int, capacity_factor) -> dict:
    out = {}
    for key, v in p.items():
        if key == "moe":
            m = dataclasses.replace(v, fc1=_local_nvfp4(v.fc1), fc2=_local_nvfp4(v.fc2))
            out[key] = ExpertParallelMoE(m, axis, d, capacity_factor)
        elif isinstance(v, dict):
            out[key] = {}
            for name, lin in v.items():
                role = _ROLES.get((key, name))
                if role == "row":
                    out[key][name] = RowParallelLinear(_local_linear(lin), axis, row, d)
                else:
                    out[key][name] = _local_linear(lin) if role else lin
        else:
            out[key] = v
    return out


def _check(cfg: DecoderConfig, d: int, axis: str, row: str, model: Model) -> None:
    def need(ok, what, value, unit=""):
        if not ok:
            raise ValueError(f"mesh: the {d} devices of axis {axis!r} do not split {what} = "
                             f"{value}{unit}")

    need(cfg.num_heads % d == 0, "num_heads", cfg.num_heads)
    need(cfg.num_kv_heads % d == 0, "num_kv_heads", cfg.num_kv_heads,
         " (the KV cache and k/v_proj split by kv heads)")
    need(cfg.vocab_size % d == 0, "vocab_size", cfg.vocab_size, " (LM head split by vocab)")
    if row == "psum":
        k_attn = cfg.num_heads * cfg.head_dim
        need(k_attn % (16 * d) == 0, "num_heads * head_dim", k_attn,
             " (o_proj's K in whole 16-value blocks per device)")
    else:
        need(cfg.hidden_size % d == 0, "hidden_size", cfg.hidden_size,
             " (row_parallel='gather' splits o_proj/down_proj outputs)")
    dense = any("mlp" in g for g in model.groups)
    if dense:
        i = cfg.intermediate_size
        need(i % (16 * d if row == "psum" else d) == 0, "intermediate_size", i,
             " (down_proj's K in whole 16-value blocks per device)" if row == "psum" else "")
    if cfg.moe_layers:
        need(cfg.num_experts % d == 0, "num_experts", cfg.num_experts)
    if isinstance(model.lm_head, nn.Linear) and model.lm_head.w.layout != "linear":
        raise ValueError("model: the LM head's block scales must be in the linear layout")
    for g in model.groups:
        for key, v in g.items():
            for name, lin in (v.items() if isinstance(v, dict) else ()):
                if (key, name) in _ROLES and isinstance(lin, nn.Linear) \
                        and lin.w.layout != "linear":
                    raise ValueError(f"model: {key}.{name}: tensor parallelism splits linear "
                                     f"block scales, got layout {lin.w.layout!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """A :class:`Model` whose parameters are placed on ``mesh`` (see the module docstring);
    pass it to ``forward``, ``prefill``, ``decode_step`` and ``generate`` like a Model.
    ``model`` holds the global arrays (NamedSharding-placed); ``config`` is the model's."""

    model: Model
    mesh: Mesh = dataclasses.field(metadata={"static": True})
    axis: str = dataclasses.field(metadata={"static": True})
    row_parallel: str = dataclasses.field(metadata={"static": True})
    moe_capacity_factor: float | None = dataclasses.field(metadata={"static": True})

    @property
    def config(self) -> DecoderConfig:
        return self.model.config

    @property
    def devices(self) -> int:
        return self.mesh.shape[self.axis]

    def specs(self) -> Model:
        """The model's pytree with a PartitionSpec in place of every array."""
        m, a, row = self.model, self.axis, self.row_parallel
        groups = [_layer_specs(g, 1 if kind == "scan" else 0, a, row)
                  for kind, g in zip(m.group_kinds, m.groups)]
        return Model(P(), groups, P(), _linear_spec(m.lm_head, 0, False, a), m.config,
                     m.group_kinds)

    def forward(self, tokens: jax.Array, cache: KVCache, *, backend: str = "auto",
                w4a4: bool = True, ablate: frozenset = frozenset()):
        """``models.forward`` on D devices: tokens int32 [B, T] (replicated), cache bf16
        [L, B, S, KVH, D] (sharded on KVH) -> (fp32 logits [B, T, V] sharded on V, cache)."""
        m, a, d = self.model, self.axis, self.devices
        cfg = m.config
        leaves, treedef = jax.tree_util.tree_flatten(m)
        specs = jax.tree_util.tree_leaves(self.specs(), is_leaf=lambda s: isinstance(s, P))
        local_cfg = dataclasses.replace(
            cfg, num_heads=cfg.num_heads // d, num_kv_heads=cfg.num_kv_heads // d,
            intermediate_size=cfg.intermediate_size // d)
        row, capf = self.row_parallel, self.moe_capacity_factor
        kv = P(None, None, None, a, None)

        def body(local_leaves, tokens, k, v, length):
            g = jax.tree_util.tree_unflatten(treedef, local_leaves)
            groups = [_local_layer(p, a, row, d, capf) for p in g.groups]
            local = Model(g.embed, groups, g.norm, _local_linear(g.lm_head), local_cfg,
                          g.group_kinds)
            logits, c = forward(local, tokens, KVCache(k, v, length), backend=backend,
                                w4a4=w4a4, ablate=ablate)
            return logits, c.k, c.v, c.length

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(), kv, kv, P()),
                           out_specs=(P(None, None, a), kv, kv, P()), check_vma=False)
        logits, k, v, length = fn(leaves, tokens, cache.k, cache.v, cache.length)
        return logits, KVCache(k, v, length)


def shard_model(model: Model, mesh: Mesh, axis: str = "tp", *, row_parallel: str = "psum",
                moe_capacity_factor: float | None = None) -> ShardedModel:
    """Place ``model`` on the D devices of ``mesh``'s ``axis`` for tensor (attention, dense
    MLP, LM head) and expert (MoE) parallelism; module docstring for the splits and bytes.

    ``row_parallel``: "psum" (fp32 partials all-reduced; within the accumulation bound of the
    single-device model) or "gather" (bit for bit the single-device model). ``moe_capacity_
    factor``: None (every route computed, exact) or c > 0 (``ceil(c T k / D)`` route rows
    per device; a route past it makes its token's row NaN). Returns a :class:`ShardedModel`
    whose arrays are placed with ``NamedSharding`` (stacked and unrolled layers alike).
    Raises ValueError naming ``mesh`` when D does not split a dimension it must split.
    """
    if not isinstance(model, Model):
        raise ValueError(f"model: expected a models.Model, got {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: expected one of the mesh's axes {mesh.axis_names}, "
                         f"got {axis!r}")
    if row_parallel not in ROW_PARALLEL:
        raise ValueError(f"row_parallel: expected one of {ROW_PARALLEL}, got {row_parallel!r}")
    if moe_capacity_factor is not None and not moe_capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor: expected None or > 0, got "
                         f"{moe_capacity_factor}")
    # fused q/k/v and gate/up (decoder.fuse_projections) split by heads / rows as separate
    # linears: slice them apart first (exact)
    model = dataclasses.replace(
        model, groups=[unfuse_projections(g, model.config) for g in model.groups])
    d = mesh.shape[axis]
    _check(model.config, d, axis, row_parallel, model)
    sm = ShardedModel(model, mesh, axis, row_parallel, moe_capacity_factor)
    leaves, treedef = jax.tree_util.tree_flatten(model)
    specs = jax.tree_util.tree_leaves(sm.specs(), is_leaf=lambda s: isinstance(s, P))
    if len(specs) != len(leaves):
        raise ValueError(f"model: {len(leaves)} arrays but {len(specs)} placements: a layer "
                         "holds a part the sharding does not know")
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs)]
    return dataclasses.replace(sm, model=jax.tree_util.tree_unflatten(treedef, placed))


def tp_bytes(config: DecoderConfig, tokens: int, devices: int,
             row_parallel: str = "psum") -> dict:
    """Bytes one device sends per forward of ``tokens`` tokens (B*T) on ``devices`` devices:
    ``o_proj``, ``down_proj`` (dense layers) and ``moe`` (expert layers, the cheaper combine
    of :func:`moe_combine_bytes`) summed over the layers, and ``total``. The logits stay
    sharded (an all-gather of them would add (D-1)/D * T * V * 4)."""
    c, t, d = config, tokens, devices
    f = (d - 1) / d
    h = c.hidden_size
    n_moe = len(c.moe_layers)
    n_dense = c.num_layers - n_moe
    if row_parallel == "psum":
        o = 2 * f * t * h * 4
        down = 2 * f * t * h * 4
    else:
        o = f * t * (c.num_heads * c.head_dim + h) * 2
        down = f * t * (c.intermediate_size + h) * 2
    moe = (min(moe_combine_bytes(t, h, c.num_experts_per_tok, d).values()) if n_moe else 0.0)
    out = {"o_proj": c.num_layers * o, "down_proj": n_dense * down, "moe": n_moe * moe}
    out["total"] = math.fsum(out.values())
    return out
