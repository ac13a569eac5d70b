"""Expert- and tensor-parallel NVFP4 layers over a ``jax.sharding.Mesh`` axis (``shard_map``).

* :func:`moe_ep`: expert parallelism for ``nvfp4_jax.moe``. The E experts are split into D
  contiguous groups of E/D over the mesh axis; an :class:`~nvfp4_jax.NVFP4Array` stack is
  split on its leading (expert) dimension as one pytree: codes [E, N, K/2], block scales
  [E, N, K/16] and the per-expert global scales ``decode_scale`` [E] travel together
  (:func:`shard_experts`), so every expert keeps its own ``weight_scale_2``.
* :func:`linear_tp`: tensor parallelism for the NVFP4 linear (``nvfp4_jax.matmul``),
  column-parallel (N split, outputs concatenated) or row-parallel (K split in multiples of 16
  so NVFP4 blocks stay whole; fp32 partials, ``psum``, then alpha and the output cast).
* Per-device pieces for a caller's own ``shard_map`` (``models.shard_model`` uses them):
  :func:`ep_route_outputs` (one device's routes of an MoE layer), :func:`ep_weighted_sum`
  (the top-k combine), :func:`row_partial` and :func:`row_parallel_matmul`.

Expert parallelism: dispatch and combine
----------------------------------------
Tokens are sharded over the axis (T/D per device, e.g. after data-parallel attention). Per
device and layer, with bf16 hidden states (2 bytes), H the hidden size, k routes per token and
ring collectives (a device sends (D-1)/D of a gathered or reduced buffer):

* ``all_gather`` (implemented): all-gather the tokens (and the int32 expert ids [T, k]; the
  router weights stay on their tokens' devices), every device
  runs its own experts' routes, and a reduce-scatter over the per-route bf16 outputs brings
  each route's result back to its token's device, where the k routes are weighted and summed
  in fp32 exactly as on one device::

      B_ag   = (D-1)/D * T * H * 2 * (1 + k)

* static ``all_to_all`` of route rows (dispatch, then combine back): jitted shapes need the
  worst case per (source, destination) pair (all T/D * k routes of a device may go to one
  device), so each direction moves the full buffers::

      B_a2a  = 2 * (D-1)/D * T * k * H * 2          (B_a2a / B_ag = 2k / (1 + k) > 1)

* ``ragged_all_to_all`` (only the routes that exist; uniform routing, in expectation)::

      B_rag  = 2 * (D-1)/D^2 * T * k * H * 2        (B_rag / B_ag = 2k / (D (1 + k)) < 1)

* all-gather plus a reduce-scatter of per-device fp32 partial sums over [T, H]::

      B_part = (D-1)/D * T * H * (2 + 4)

With static shapes the all-gather scheme moves fewer bytes than all-to-all for every k > 1
(2k/(1+k) times fewer), so it is the one implemented. Partial sums move fewer bytes than
either static scheme (at k = 8 (Qwen3-30B): 6 vs 18 bytes per T*H at D -> inf), but they
add each token's k routes in a different order than one device does (per device first, then
across devices), so the layer is no longer bit for bit the single-device layer; the
per-route combine keeps it so. ``ragged_all_to_all`` moves the fewest bytes; it needs the
per-destination counts exchanged first (one more all-to-all) and worst-case receive buffers,
and it is not implemented here (the next step where links are the bottleneck).
:func:`ep_bytes` evaluates all four.

Each device computes ``capacity`` route rows (default T*k: every route of the layer may pick
this device's experts, so no route is ever dropped). A smaller ``capacity`` saves compute
(the expected load is T*k/D); a route past it is not computed, and its token's output row is
NaN (visible, never a silently finite wrong value).

The per-device layer is ``nvfp4_jax.moe`` with k = 1 over the received route rows (any
``backend``), so each route's FC2 output (bf16 in ``mode="trtllm_cutlass"``) comes back
unchanged; ``mode="b12x"`` keeps its FC2 outputs in fp32 before the weighted sum, which the
k = 1 layer would round to bf16, so ``moe_ep`` rejects it.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .division import divide
from .gemm.api import matmul
from .moe import moe, select_experts
from .quantize import NVFP4Array, quantize

__all__ = ["EP_SCHEMES", "ep_bytes", "ep_capacity", "ep_route_outputs", "ep_weighted_sum",
           "linear_tp", "mesh_1d", "moe_ep", "row_parallel_matmul", "row_partial",
           "shard_experts"]

EP_SCHEMES = ("all_gather",)


def ep_bytes(tokens: int, hidden: int, top_k: int, experts: int, devices: int, *,
             capacity_limited: bool = False) -> dict:
    """Bytes one device sends per MoE layer for each dispatch/combine scheme (module
    docstring): ``all_gather`` (implemented, per-route combine), ``all_to_all_static``,
    ``all_to_all_ragged`` (expected, uniform routing) and ``all_gather_partial_fp32`` (not
    bit-exact), plus ``routing``, which the implemented scheme also moves: the all-gather of
    the int32 expert ids [T, k] and, with a ``capacity`` below T*k (``capacity_limited``), the
    reduce-scatter of int32 per-route "computed" flags [T*k] (the router weights stay on their
    tokens' devices). ``experts`` only checks that it splits over ``devices``."""
    t, h, k, d = tokens, hidden, top_k, devices
    if d < 1 or experts % d:
        raise ValueError(f"devices: expected a divisor of experts = {experts}, got {d}")
    f = (d - 1) / d
    return {
        "all_gather": f * t * h * 2 * (1 + k),
        "all_to_all_static": 2 * f * t * k * h * 2,
        "all_to_all_ragged": 2 * f / d * t * k * h * 2,
        "all_gather_partial_fp32": f * t * h * 6,
        "routing": f * t * k * 4 * (2 if capacity_limited else 1),
    }


def _axis_size(mesh: Mesh, axis: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: expected one of the mesh's axes {mesh.axis_names}, got {axis!r}")
    return mesh.shape[axis]


def _expert_specs(w: NVFP4Array, axis: str) -> NVFP4Array:
    """A PartitionSpec pytree for an expert stack: every field split on its leading E."""
    spec = lambda a: P(axis, *([None] * (a.ndim - 1)))
    return jax.tree_util.tree_map(spec, w)


def shard_experts(w: NVFP4Array, mesh: Mesh, axis: str = "ep") -> NVFP4Array:
    """Place an expert stack NVFP4Array [E, N, K] on ``mesh``, E split over ``axis``: codes,
    block scales and the per-expert ``decode_scale`` [E] of one expert on the same device."""
    d = _axis_size(mesh, axis)
    if not isinstance(w, NVFP4Array) or len(w.shape) != 3:
        raise ValueError(f"w: expected an NVFP4Array stack [E, N, K], got {w!r}")
    if w.shape[0] % d:
        raise ValueError(f"w: E = {w.shape[0]} experts do not split over {d} devices of {axis!r}")
    if tuple(jnp.shape(w.decode_scale)) != (w.shape[0],):
        raise ValueError(f"w: expected decode_scale [E={w.shape[0]}], got "
                         f"{jnp.shape(w.decode_scale)}")
    specs = _expert_specs(w, axis)
    return jax.tree_util.tree_map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), w, specs)


def moe_ep(
    hidden: jax.Array,
    *,
    fc1: NVFP4Array,
    fc2: NVFP4Array,
    fc1_input_scale: jax.Array,
    fc2_input_scale: jax.Array,
    mesh: Mesh,
    axis: str = "ep",
    router_logits: jax.Array | None = None,
    topk_ids: jax.Array | None = None,
    topk_weights: jax.Array | None = None,
    top_k: int | None = None,
    routing: str = "softmax",
    renormalize: bool = False,
    correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
    activation: str = "relu2",
    gate_up_order: str = "up_gate",
    mode: str = "trtllm_cutlass",
    backend: str = "auto",
    scheme: str = "all_gather",
    capacity: int | None = None,
) -> jax.Array:
    """Expert-parallel ``nvfp4_jax.moe`` -> bf16 [T, H], sharded on T over ``axis``.

    Same arguments and result as ``nvfp4_jax.moe`` (bit for bit on the ``xla`` backend: the
    same per-route arithmetic and the same fp32 top-k sum), plus ``mesh`` and ``axis`` (a
    mesh axis of D devices; E % D == 0 and T % D == 0). hidden bf16 [T, H] (sharded on T
    over ``axis`` inside; any input placement). fc1 NVFP4Array [E, R, H], fc2 [E, H, I]
    with decode_scale [E] (place them once with :func:`shard_experts`), fc1/fc2_input_scale
    fp32 [E] (ModelOpt decode form; the layer's one activation scale is their max over all
    experts, taken with ``pmax``). ``scheme``: "all_gather" (module docstring, bytes in
    :func:`ep_bytes`). ``capacity``: route rows each device computes, None for T*k (exact
    for any routing); a route past it leaves its token's output NaN, as does an expert id
    outside [0, E) under jit (outside jit: ValueError). ``mode``:
    "trtllm_cutlass" only (module docstring). Jittable.
    """
    d = _axis_size(mesh, axis)
    hidden = jnp.asarray(hidden)
    if hidden.ndim != 2 or hidden.dtype != jnp.bfloat16:
        raise ValueError(f"hidden: expected bfloat16 [T, H], got {hidden.dtype} {hidden.shape}")
    if scheme not in EP_SCHEMES:
        raise ValueError(f"scheme: expected one of {EP_SCHEMES}, got {scheme!r}")
    if mode != "trtllm_cutlass":
        raise ValueError(f"mode: moe_ep supports 'trtllm_cutlass' (bf16 per-route outputs), got "
                         f"{mode!r}: b12x sums fp32 per-route outputs, which the per-device "
                         "k = 1 layer rounds to bf16")
    for name, w in (("fc1", fc1), ("fc2", fc2)):
        if not isinstance(w, NVFP4Array) or len(w.shape) != 3:
            raise ValueError(f"{name}: expected an NVFP4Array stack [E, N, K], got {w!r}")
    e = fc1.shape[0]
    t = hidden.shape[0]
    if e % d:
        raise ValueError(f"fc1: E = {e} experts do not split over {d} devices of axis {axis!r}")
    if t % d:
        raise ValueError(f"hidden: T = {t} tokens do not split over {d} devices of axis {axis!r}")
    if router_logits is not None:
        if topk_ids is not None or topk_weights is not None:
            raise ValueError("router_logits: pass either router_logits (+ top_k) or topk_ids + "
                             "topk_weights, not both")
        if top_k is None or not 0 < top_k <= e:
            raise ValueError(f"top_k: expected an int in [1, {e}] with router_logits, got {top_k}")
        topk_ids, topk_weights = select_experts(
            jnp.asarray(router_logits), top_k, routing=routing, renormalize=renormalize,
            correction_bias=correction_bias, routed_scaling_factor=routed_scaling_factor)
    elif topk_ids is None or topk_weights is None:
        raise ValueError("topk_ids: pass topk_ids and topk_weights, or router_logits with top_k")
    ids_in = topk_ids  # concrete (checked below) unless traced
    topk_ids = jnp.asarray(topk_ids).astype(jnp.int32)
    topk_weights = jnp.asarray(topk_weights)
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids: expected int [T={t}, k] with topk_weights of the same shape, "
                         f"got {topk_ids.shape} and {topk_weights.shape}")
    if not isinstance(ids_in, jax.core.Tracer) and np.size(ids_in):
        lo, hi = int(np.min(np.asarray(ids_in))), int(np.max(np.asarray(ids_in)))
        if lo < 0 or hi >= e:
            raise ValueError(f"topk_ids: expected expert ids in [0, {e}), got values in "
                             f"[{lo}, {hi}]")
    k = topk_ids.shape[1]
    n_routes = t * k
    cap = n_routes if capacity is None else int(capacity)
    if not 0 < cap <= n_routes:
        raise ValueError(f"capacity: expected an int in [1, T*k = {n_routes}] or None, "
                         f"got {capacity}")
    s1 = jnp.broadcast_to(jnp.asarray(fc1_input_scale, jnp.float32), (e,))
    s2 = jnp.broadcast_to(jnp.asarray(fc2_input_scale, jnp.float32), (e,))
    kw = {"activation": activation, "gate_up_order": gate_up_order, "mode": mode,
          "backend": backend}

    def body(h_loc, ids_loc, w_loc, f1, f2, s1_loc, s2_loc):
        h_all = lax.all_gather(h_loc, axis, tiled=True)  # [T, H]
        ids_all = lax.all_gather(ids_loc, axis, tiled=True)  # [T, k] route -> expert
        buf, done = ep_route_outputs(h_all, ids_all, f1, f2, s1_loc, s2_loc, axis=axis,
                                     capacity=cap, **kw)
        mine = lax.psum_scatter(buf, axis, scatter_dimension=0, tiled=True)  # [T/D*k, H]
        out = ep_weighted_sum(mine, w_loc)
        bad = jnp.any((ids_loc < 0) | (ids_loc >= e), axis=1)  # a route to no expert
        if cap < n_routes:  # routes past the capacity
            done = lax.psum_scatter(done, axis, scatter_dimension=0, tiled=True)
            bad = bad | jnp.any(done.reshape(ids_loc.shape) == 0, axis=1)
        return jnp.where(bad[:, None], jnp.asarray(jnp.nan, out.dtype), out)

    fn = jax.shard_map(
        body, mesh=mesh,
        in_specs=(P(axis, None), P(axis, None), P(axis, None), _expert_specs(fc1, axis),
                  _expert_specs(fc2, axis), P(axis), P(axis)),
        out_specs=P(axis, None), check_vma=False)
    return fn(hidden, topk_ids, topk_weights, fc1, fc2, s1, s2)


def ep_route_outputs(
    h_all: jax.Array,
    ids_all: jax.Array,
    fc1: NVFP4Array,
    fc2: NVFP4Array,
    fc1_input_scale: jax.Array,
    fc2_input_scale: jax.Array,
    *,
    axis: str,
    capacity: int | None = None,
    activation: str = "relu2",
    gate_up_order: str = "up_gate",
    mode: str = "trtllm_cutlass",
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """One device's share of an expert-parallel MoE layer; call inside ``shard_map`` over
    ``axis`` (D devices, device p holding experts [p E/D, (p+1) E/D)).

    h_all bf16 [T, H] and ids_all int32 [T, k] (expert ids in [0, E)): every token and route
    of the layer, the same on every device. fc1 NVFP4Array [E/D, R, H], fc2 [E/D, H, I] and
    fc1/fc2_input_scale fp32 [E/D]: this device's experts (the layer's one activation scale
    per FC is the max over all experts, taken here with ``pmax``). ``capacity``: route rows
    computed here (None: T*k, every route). Returns ``(out, computed)``: out bf16 [T*k, H],
    route r's FC2 output (``nvfp4_jax.moe`` with k = 1, unweighted) where this device holds
    its expert and computed it, else -0.0 (the additive identity of every value, so a sum
    over the devices, ``psum`` or ``psum_scatter``, returns each route's output exactly);
    computed int32 [T*k], 1 where this device computed route r.
    """
    t, k = ids_all.shape
    n_routes = t * k
    cap = n_routes if capacity is None else int(capacity)
    e_loc = fc1.codes.shape[0]
    h = h_all.shape[1]
    p = lax.axis_index(axis)
    f1, f2 = (NVFP4Array(f.codes, f.scales, f.decode_scale, tuple(f.codes.shape[:-1])
                         + (2 * f.codes.shape[-1],), f.layout) for f in (fc1, fc2))
    flat = ids_all.reshape(-1).astype(jnp.int32)
    # one activation scale per layer: the max over all experts' input scales (exact)
    g1 = jnp.full((e_loc,), lax.pmax(jnp.max(fc1_input_scale), axis), jnp.float32)
    g2 = jnp.full((e_loc,), lax.pmax(jnp.max(fc2_input_scale), axis), jnp.float32)
    local = flat // e_loc == p
    # this device's routes first, in route order (stable), then the others
    sel = jnp.argsort(jnp.logical_not(local), stable=True)[:cap].astype(jnp.int32)
    valid = local[sel]
    rows = jnp.where(valid[:, None], h_all[sel // k], jnp.zeros((), h_all.dtype))
    # padding rows: zero input, spread over the local experts (no one oversized group)
    lid = jnp.where(valid, flat[sel] - p * e_loc, jnp.arange(cap, dtype=jnp.int32) % e_loc)
    y = moe(rows, fc1=f1, fc2=f2, fc1_input_scale=g1, fc2_input_scale=g2,
            topk_ids=lid[:, None], topk_weights=jnp.ones((cap, 1), jnp.float32),
            activation=activation, gate_up_order=gate_up_order, mode=mode, backend=backend)
    dest = jnp.where(valid, sel, n_routes)
    out = jnp.full((n_routes, h), -0.0, y.dtype).at[dest].set(y, mode="drop")
    computed = jnp.zeros((n_routes,), jnp.int32).at[dest].set(1, mode="drop")
    return out, computed


def ep_weighted_sum(route_out: jax.Array, weights: jax.Array) -> jax.Array:
    """The top-k combine of ``nvfp4_jax.moe``: route_out bf16 [n*k, H] (token-major: token i's
    routes at rows i*k .. i*k+k-1), weights fp32 [n, k] -> bf16 [n, H], each token's k
    weighted routes added in fp32 in route order, as one device adds them."""
    n, k = weights.shape
    contrib = (route_out.astype(jnp.float32).reshape(n, k, -1)
               * weights.astype(jnp.float32)[:, :, None])
    return contrib.sum(axis=1).astype(jnp.bfloat16)


def _check_tp_weight(w, d: int, mode: str) -> None:
    if not isinstance(w, NVFP4Array) or len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D NVFP4Array [N, K], got {w!r}")
    if w.layout != "linear":
        raise ValueError(f"w: tensor parallelism splits linear block scales; got layout "
                         f"{w.layout!r}: pass w.with_layout('linear')")
    if jnp.ndim(w.decode_scale) != 0:
        raise ValueError(f"w: expected a scalar decode_scale, got shape "
                         f"{jnp.shape(w.decode_scale)}")
    n, k = w.shape
    if mode == "column" and n % d:
        raise ValueError(f"w: N = {n} does not split over {d} devices (column-parallel)")
    if mode == "row" and k % (16 * d):
        raise ValueError(f"w: K = {k} does not split over {d} devices in whole 16-value blocks "
                         f"(row-parallel needs K % (16 * {d}) == 0)")


def linear_tp(
    x,
    w: NVFP4Array,
    *,
    mesh: Mesh,
    axis: str = "tp",
    mode: Literal["column", "row"] = "column",
    input_scale=None,
    out_dtype=jnp.bfloat16,
    backend: str = "auto",
) -> jax.Array:
    """Tensor-parallel ``nvfp4_jax.matmul(x, w)`` -> out_dtype [..., N] over a mesh axis.

    x bf16/fp16 [..., K]; w NVFP4Array [N, K] with linear scales and a scalar decode_scale;
    ``input_scale`` (fp32 scalar) for W4A4 as in ``matmul``.

    * ``mode="column"``: w's rows (N) split over the D devices of ``axis`` (codes, block
      scales; decode_scale replicated), x replicated; each device computes its N/D output
      columns with ``matmul``; the result is sharded on N (its concatenation). Every output
      element is the single-device element (the same K reduction), bit for bit.
    * ``mode="row"``: K split in D slices of whole 16-value blocks (K % (16 D) == 0); x is
      split on K with it (W4A4 activation blocks lie inside one slice, so their codes are the
      single-device codes); each device computes the fp32 partial ``x_p @ w_p^T`` without any
      scale, ``psum`` adds the D partials, then alpha (``decode_scale``, times
      ``input_scale`` for W4A4) and the cast, as one device does. Only the fp32 accumulation
      order changes: the single-device and the sharded sum are each some order of the same
      K - 1 additions of exact products (D - 1 of them in the ``psum``), so each is within
      ``gamma_{K-1} * sum|x||w|`` (``gamma_n = n u / (1 - n u)``, u = 2^-24; 2^-23 for
      truncating tensor cores) of the exact dot (``oracle.gemm_error_bound``), and they
      differ by at most the sum of the two bounds.
    """
    d = _axis_size(mesh, axis)
    if mode not in ("column", "row"):
        raise ValueError(f"mode: expected 'column' or 'row', got {mode!r}")
    _check_tp_weight(w, d, mode)
    x = jnp.asarray(x)
    n, k = w.shape
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected [..., K={k}], got shape {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x: expected bfloat16 or float16, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    s_in = None if input_scale is None else jnp.asarray(input_scale, jnp.float32)
    if s_in is not None and s_in.ndim != 0:
        raise ValueError(f"input_scale: expected an fp32 scalar, got shape {s_in.shape}")
    wspec_col = NVFP4Array(P(axis, None), P(axis, None), P(), w.shape, w.layout)
    wspec_row = NVFP4Array(P(None, axis), P(None, axis), P(), w.shape, w.layout)

    if mode == "column":
        def col(xs, ws, si):
            loc = NVFP4Array(ws.codes, ws.scales, ws.decode_scale, (n // d, k), ws.layout)
            return matmul(xs, loc, input_scale=si, out_dtype=out_dtype, backend=backend)

        si_spec = None if s_in is None else P()
        out = jax.shard_map(col, mesh=mesh, in_specs=(P(), wspec_col, si_spec),
                            out_specs=P(None, axis), check_vma=False)(x2, w, s_in)
        return out.reshape(lead + (n,))

    def row(xs, ws, si):
        loc = NVFP4Array(ws.codes, ws.scales, ws.decode_scale, (n, k // d), ws.layout)
        return row_parallel_matmul(xs, loc, axis=axis, input_scale=si, out_dtype=out_dtype,
                                   backend=backend)

    si_spec = None if s_in is None else P()
    out = jax.shard_map(row, mesh=mesh, in_specs=(P(None, axis), wspec_row, si_spec),
                        out_specs=P(), check_vma=False)(x2, w, s_in)
    return out.reshape(lead + (n,))


def row_partial(x: jax.Array, w: NVFP4Array, *, input_scale=None,
                backend: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The unscaled fp32 GEMM ``x @ (codes * block scales)^T`` and its alpha, so that
    ``(partial * alpha).astype(out)`` is ``nvfp4_jax.matmul(x, w, input_scale=...)``.

    x bf16/fp16 [..., K]; w NVFP4Array [N, K] (linear scales). With ``input_scale`` (W4A4)
    x is quantized as ``matmul`` quantizes it (``trtllm`` recipe, encode scale
    ``1/input_scale``, one block per 16 values along K, so a K slice of whole blocks gets
    the codes of the full row) and alpha = input_scale * decode_scale; else alpha =
    decode_scale. Returns (fp32 [..., N], fp32 scalar); the partial is the accumulator
    itself (``matmul`` with unit alphas, exact)."""
    unit = NVFP4Array(w.codes, w.scales, jnp.float32(1.0), w.shape, w.layout)
    w_decode = jnp.asarray(w.decode_scale, jnp.float32)
    if input_scale is None:
        return matmul(x, unit, out_dtype=jnp.float32, backend=backend), w_decode
    s_in = jnp.asarray(input_scale, jnp.float32)
    xq = quantize(x, "trtllm", encode_scale=divide(1.0, s_in))
    xq = NVFP4Array(xq.codes, xq.scales, jnp.float32(1.0), xq.shape, xq.layout)
    return matmul(xq, unit, out_dtype=jnp.float32, backend=backend), s_in * w_decode


def row_parallel_matmul(x: jax.Array, w: NVFP4Array, *, axis: str, input_scale=None,
                        out_dtype=jnp.bfloat16, backend: str = "auto") -> jax.Array:
    """Row-parallel NVFP4 GEMM; call inside ``shard_map`` over ``axis``: x [..., K/D] and w
    NVFP4Array [N, K/D] are this device's K slice (whole 16-value blocks), decode_scale and
    ``input_scale`` the full tensor's. The fp32 partials (:func:`row_partial`) are added
    over the axis with ``psum``, then alpha and the cast to ``out_dtype`` [..., N], as
    ``nvfp4_jax.matmul`` applies them to its one accumulator."""
    part, alpha = row_partial(x, w, input_scale=input_scale, backend=backend)
    return (lax.psum(part, axis) * alpha).astype(out_dtype)


def mesh_1d(devices: int | None = None, axis: str = "ep") -> Mesh:
    """A one-axis mesh over the first ``devices`` devices (all by default)."""
    devs = jax.devices()
    n = len(devs) if devices is None else int(devices)
    if not 0 < n <= len(devs):
        raise ValueError(f"devices: expected 1..{len(devs)}, got {devices}")
    return Mesh(devs[:n], (axis,))


def ep_capacity(tokens: int, top_k: int, devices: int, factor: float = 2.0) -> int:
    """``ceil(factor * T * k / D)`` route rows per device, at most T*k (a ``capacity`` for
    :func:`moe_ep` with headroom ``factor`` over uniform routing's expected load)."""
    return min(tokens * top_k, math.ceil(factor * tokens * top_k / devices))

