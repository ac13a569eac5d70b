"""Routing: router scores -> top-k, and the block-aligned grouping the grouped kernels read.

All functions are jittable with static shapes (no host sync).

``block_routing(topk_ids, num_experts, block_m)`` groups the ``N = T*k`` routes by expert
(stable argsort, so routes of one expert keep token order), pads every expert's group to a
multiple of ``block_m`` and gives each block of ``block_m`` sorted rows one expert id. The
number of blocks is data dependent; its static upper bound is

    num_blocks <= sum_e cdiv(c_e, BM) <= #touched experts + floor(N / BM)
               <= min(E, N) + cdiv(N, BM)                       (= max_blocks)

so a decode step (small N) launches few programs, and programs past ``num_blocks`` exit at
once (experts without tokens cost nothing). Padding rows hold the sentinel ``N``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

ROUTINGS = ("softmax", "sigmoid_bias")


def max_blocks(num_routes: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the number of expert blocks (see module docstring)."""
    return min(num_experts, num_routes) + -(-num_routes // block_m)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockRouting:
    """Block-aligned routing (all int32).

    sorted_route [EM]: route index ``r = t*k + j`` at each sorted row, or the sentinel ``N``.
    block_expert [NB]: expert of each block of ``block_m`` rows (clamped to E-1 past the end).
    num_blocks   [1]:  number of valid blocks.
    route_pos    [N]:  sorted row of each route (inverse of sorted_route).
    """

    sorted_route: jax.Array
    block_expert: jax.Array
    num_blocks: jax.Array
    route_pos: jax.Array


#: ``block_routing`` uses the dense (sort-free) formulation up to this many routes.
DENSE_MAX_ROUTES = 2048


def sort_keys(flat: jax.Array, num_experts: int) -> jax.Array:
    """Expert ids int32 [N] as the narrowest unsigned type that holds [0, num_experts): uint8
    up to 256 experts, uint16 up to 65536, else int32 unchanged. XLA:GPU sorts such keys with
    CUB's radix sort, one 8-bit digit pass per key byte (4 passes for int32 keys: ~27 us of
    qwen3's T = 4096 layer on the H200), and its H100 heuristic hands every
    single-row 8-bit sort to CUB, where 32-bit keys go to XLA's own sort below ~22000
    elements. The order is the same: a stable sort of the same values."""
    if num_experts <= 1 << 8:
        return flat.astype(jnp.uint8)
    if num_experts <= 1 << 16:
        return flat.astype(jnp.uint16)
    return flat


def block_routing(topk_ids: jax.Array, num_experts: int, block_m: int, *,
                  method: str = "auto") -> BlockRouting:
    """Group routes by expert into blocks of ``block_m`` rows; topk_ids int [T, k] in [0, E).

    method: "sort" (stable argsort of ``sort_keys``, scatter-add counts, cumsums, two
    scatters), "dense" (no sort: counts, each route's rank among the routes of its expert and
    the padded cumsum as compare-and-count reductions over [E, N], [N, N] and [E, E]; the
    inverse permutation by a [EM, N] reduction while that is at most 2^20 elements, else one
    scatter), or "auto"
    (dense up to ``DENSE_MAX_ROUTES`` routes, where its ~5 fusions cost less than the sort
    path's ~10 launches; the quadratic terms grow past that). Both give the same routing.
    """
    if method not in ("auto", "sort", "dense"):
        raise ValueError(f"method: expected 'auto', 'sort' or 'dense', got {method!r}")
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    nb = max_blocks(n, num_experts, block_m)
    em = nb * block_m
    p = jnp.arange(n, dtype=jnp.int32)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    if method == "dense" or (method == "auto" and n <= DENSE_MAX_ROUTES):
        counts = jnp.sum(flat[None, :] == experts[:, None], axis=1, dtype=jnp.int32)
        padded = (counts + block_m - 1) // block_m * block_m
        pad_end = jnp.sum(jnp.where(experts[None, :] <= experts[:, None], padded[None, :], 0),
                          axis=1, dtype=jnp.int32)  # inclusive cumsum as one reduction
        rank = jnp.sum((flat[None, :] == flat[:, None]) & (p[None, :] < p[:, None]), axis=1,
                       dtype=jnp.int32)  # earlier routes of the same expert (stable order)
        route_pos = (pad_end - padded)[flat] + rank
        if em * n <= 1 << 20:  # invert route_pos by one [EM, N] reduction (no scatter, no init copy)
            hit = route_pos[None, :] == jnp.arange(em, dtype=jnp.int32)[:, None]
            sorted_route = jnp.sum(jnp.where(hit, p[None, :] - n, 0), axis=1, dtype=jnp.int32) + n
        else:
            sorted_route = jnp.full((em,), n, jnp.int32).at[route_pos].set(p)
    else:
        order = jnp.argsort(sort_keys(flat, num_experts), stable=True).astype(jnp.int32)
        counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
        padded = (counts + block_m - 1) // block_m * block_m
        pad_end = jnp.cumsum(padded)
        pad_start = pad_end - padded
        start = jnp.cumsum(counts) - counts
        e_sorted = flat[order]
        dest = pad_start[e_sorted] + (p - start[e_sorted])
        sorted_route = jnp.full((em,), n, jnp.int32).at[dest].set(order)
        route_pos = jnp.zeros((n,), jnp.int32).at[order].set(dest)
    block_start = jnp.arange(nb, dtype=jnp.int32) * block_m
    # searchsorted(pad_end, block_start, side="right") as one dense compare-and-count fusion
    # ([NB, E] booleans): jnp.searchsorted's default "scan" method is a device while loop
    # (one launch per bisection step), which costs more than the whole decode step at small T.
    block_expert = jnp.sum(pad_end[None, :] <= block_start[:, None], axis=1, dtype=jnp.int32)
    block_expert = jnp.minimum(block_expert, num_experts - 1)
    num_blocks = (pad_end[-1] // block_m).reshape(1).astype(jnp.int32)
    return BlockRouting(sorted_route, block_expert, num_blocks, route_pos)


def select_experts(
    router_logits: jax.Array,
    top_k: int,
    *,
    routing: str = "softmax",
    renormalize: bool = False,
    correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """router_logits [T, E] -> (topk_ids int32 [T, k], topk_weights f32 [T, k]).

    ``softmax``: probabilities ``softmax(logits)`` (fp32), the top-k of them, optionally
    renormalized to sum to 1 (Mixtral / Qwen3-MoE). ``sigmoid_bias`` (DeepSeek-V3 / Nemotron-H
    style, without group-limited selection): scores ``sigmoid(logits)``; experts are selected by
    ``scores + correction_bias``, weights are the unbiased scores, optionally renormalized,
    then multiplied by ``routed_scaling_factor``.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")
    logits = router_logits.astype(jnp.float32)
    if routing == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        w, ids = jax.lax.top_k(probs, top_k)
    else:
        scores = jax.nn.sigmoid(logits)
        sel = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
        _, ids = jax.lax.top_k(sel, top_k)
        w = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    if routing == "sigmoid_bias" and routed_scaling_factor != 1.0:
        w = w * jnp.float32(routed_scaling_factor)
    return ids.astype(jnp.int32), w.astype(jnp.float32)
