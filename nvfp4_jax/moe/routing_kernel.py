"""Block routing in one Pallas-Triton program, for small routings (decode).

``routing_kernel`` computes ``routing.block_routing``'s arrays (bit for bit: integers) in one
launch instead of ~5 XLA fusions, optionally with the scales (``scales.load_scales``) in the
same program; ``routing_operand_kernel`` adds the FC1 operand (``operand.fc1_operand``'s rows)
to that launch. Three methods, one per regime (see ``routing_methods``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..gemm.mosaic import permute_k_order
from ..triton_ops import call, pow2, requantize, row_tile
from .routing import BlockRouting, max_blocks
from .scales import load_scales, scales_plan, store_scales

#: The routing kernels' three methods. "experts" (``_route_positions``): per-expert counts, a
#: cumsum over experts and ranks from one [E, N] one-hot tile, the block experts from an
#: [NB, E] tile; for routings whose tiles (powers of two) have at most
#: ROUTING_KERNEL_MAX_ELEMS elements and at most ROUTING_EXPERTS_MAX experts (qwen3's 128;
#: with nemotron's 512 one such program is ~7 us slower than the XLA routing at T = 1).
#: "routes" (``_route_counts``): no expert dimension at all, every quantity from route-by-route
#: compares in [N, ROUTE_CHUNK] tiles (O(N^2)), the block experts read back from the sorted
#: order; for up to ROUTING_ROUTES_MAX routes (nemotron T = 8: 176). "tokens"
#: (``_route_tokens``): token-major, for top-k routings (the layer's [T, k]): a [T, E] table of
#: how many of each token's routes go to each expert, scattered into a scratch output, then
#: counts, padded starts and each cell's first row from cumsums over that table, written back
#: and gathered per route (a token's duplicate experts, if any, by a [N, k] compare); no
#: O(N^2) term. For tables and [N, k] tiles (powers of two) of at most
#: ROUTING_KERNEL_MAX_ELEMS elements (nemotron up to T = 46).
ROUTING_KERNEL_MAX_ELEMS = 1 << 15
ROUTING_EXPERTS_MAX = 128
ROUTING_ROUTES_MAX = 512
ROUTE_CHUNK = 32
#: Up to how many routes the layer picks the "routes" method by itself, and before "experts"
#: (an ``explicit`` request takes it up to ROUTING_ROUTES_MAX). Its quadratic compares run in
#: 2 x N / 32 dependent chunks, each ending in cross-warp reductions: on the H200 it saves 5-6
#: us against the XLA routing at nemotron T = 1 (22 routes) but costs 39 us at T = 8 (176
#: routes), where "tokens" saves 2 us; at qwen3 T = 8 (64 routes) it beats "experts" (67.3 vs
#: 69.4 us for the layer: 64 registers and ~1.4K SASS instructions against 128 and ~3.0K, the
#: one-hot tiles spanning all 128 experts).
ROUTES_AUTO_MAX = 64


def _route_positions(ids_ref, *, n: int, num_experts: int, block_m: int):
    """The routing's values in registers: (j, valid, pos, padded, pad_end, ep) with pos [np] each
    route's row in the expert-sorted, block-padded order (lanes past n invalid)."""
    np_, ep = pow2(n), pow2(num_experts)
    j = lax.broadcasted_iota(jnp.int32, (np_,), 0)
    valid = j < n
    jc = jnp.minimum(j, n - 1)
    ids = jnp.where(valid, plgpu.load(ids_ref.at[jc]), -1)  # -1 matches no expert
    e = lax.broadcasted_iota(jnp.int32, (ep, 1), 0)
    onehot = (e == ids[None, :]).astype(jnp.int32)  # [ep, np]
    counts = jnp.sum(onehot, axis=1)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = jnp.cumsum(padded, axis=0)  # inclusive
    pad_start = pad_end - padded
    earlier = jnp.cumsum(onehot, axis=1) - onehot  # routes of the same expert before j
    rank = jnp.sum(onehot * earlier, axis=0)
    pos = jnp.sum(onehot * pad_start[:, None], axis=0) + rank  # [np]
    return j, valid, pos, padded, pad_end, ep


def _lane_ids(ids_ref, start: int, size: int, n: int, fill: int):
    """(lanes start..start+size-1, their routes' experts; ``fill`` past the n routes)."""
    jj = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
    return jj, jnp.where(jj < n, plgpu.load(ids_ref.at[jnp.minimum(jj, n - 1)]), fill)


def _route_counts(ids_ref, *, n: int):
    """The "routes" method's first pass: (j, valid, ids, rank, count) [np] with each route's
    expert, its rank among the earlier routes of that expert and that expert's route count,
    from [np, ROUTE_CHUNK] compares of every route with each chunk of routes (lanes past n:
    invalid, id -1, count 0)."""
    np_ = pow2(n)
    c = min(np_, ROUTE_CHUNK)
    j, ids = _lane_ids(ids_ref, 0, np_, n, -1)
    valid = j < n
    rank = jnp.zeros((np_,), jnp.int32)
    count = jnp.zeros((np_,), jnp.int32)
    for c0 in range(0, np_, c):  # static: np_ / c <= 16 chunks
        jj, idc = _lane_ids(ids_ref, c0, c, n, -2)  # -2 matches no lane, valid (-1) or not
        same = ids[:, None] == idc[None, :]  # [np, c]
        count = count + jnp.sum(same.astype(jnp.int32), axis=1)
        rank = rank + jnp.sum((same & (jj[None, :] < j[:, None])).astype(jnp.int32), axis=1)
    return j, valid, ids, rank, count


def _first_padded(valid, rank, count, block_m: int):
    """Each expert's padded row count on its first route's lane, 0 elsewhere: summed over the
    lanes of experts below x, the start of expert x's rows."""
    return jnp.where(valid & (rank == 0), (count + block_m - 1) // block_m * block_m, 0)


def _route_rows(ids_ref, ids, fp, rank, *, n: int, block_m: int):
    """The "routes" method's second pass: every route's sorted row [np], its expert's start
    (sum of ``fp`` over the lanes of lower experts) plus its rank. A lane's ``fp`` cannot be
    sliced out of registers, so each chunk's is recomputed from its routes' compares."""
    np_ = pow2(n)
    c = min(np_, ROUTE_CHUNK)
    j = lax.broadcasted_iota(jnp.int32, (np_,), 0)
    start = jnp.zeros((np_,), jnp.int32)
    for c0 in range(0, np_, c):
        jj, idc = _lane_ids(ids_ref, c0, c, n, -2)
        vv = jj < n
        same = idc[:, None] == ids[None, :]  # [c, np]
        cnt = jnp.sum(same.astype(jnp.int32), axis=1)
        rk = jnp.sum((same & (j[None, :] < jj[:, None])).astype(jnp.int32), axis=1)
        fpc = _first_padded(vv, rk, cnt, block_m)
        start = start + jnp.sum(jnp.where(idc[None, :] < ids[:, None], fpc[None, :], 0), axis=1)
    return start + rank


def _store_sorted(j, valid, pos, sorted_ref, pos_ref, *, n: int, em: int, interpret: bool):
    """Stores each route's row (``route_pos``) and the inverse permutation (``sorted_route``,
    the sentinel n in padding rows)."""
    emp = pow2(em)
    # masked lanes index out of range (not clamped): interpret mode drops them, and a clamped
    # duplicate index would race with the valid lane's store
    plgpu.store(pos_ref.at[j], pos, mask=valid)
    pi = lax.broadcasted_iota(jnp.int32, (emp,), 0)
    plgpu.store(sorted_ref.at[pi], jnp.full((emp,), n, jnp.int32), mask=pi < em)  # sentinel n
    if not interpret:
        plgpu.debug_barrier()  # every sentinel is written before any route's row
    plgpu.store(sorted_ref.at[jnp.where(valid, pos, em + j)], j, mask=valid)


def _route_tokens(ids_ref, m_ref, *, n: int, top_k: int, num_experts: int, block_m: int,
                  interpret: bool):
    """The "tokens" method: (j, valid, pos, total blocks) with pos [np] each route's row. ``m_ref``:
    an int32 scratch output of [pow2(T) * pow2(E)] cells (token t, expert x at t * pow2(E) + x)."""
    np_, kp = pow2(n), pow2(top_k)
    tp, ep = pow2(n // top_k), pow2(num_experts)
    j, ids = _lane_ids(ids_ref, 0, np_, n, -1)
    valid = j < n
    tok = j // top_k
    # each route's token's routes: how many share its expert, how many of those come earlier
    c = lax.broadcasted_iota(jnp.int32, (1, kp), 1)
    jj = tok[:, None] * top_k + c  # [np, kp]
    inrow = (c < top_k) & valid[:, None]
    idt = jnp.where(inrow, plgpu.load(ids_ref.at[jnp.where(inrow, jj, 0)]), -2)
    same = idt == ids[:, None]
    mult = jnp.sum(same.astype(jnp.int32), axis=1)
    dup = jnp.sum((same & (jj < j[:, None])).astype(jnp.int32), axis=1)
    cell = lax.broadcasted_iota(jnp.int32, (tp, 1), 0) * ep + lax.broadcasted_iota(jnp.int32, (1, ep), 1)
    plgpu.store(m_ref.at[cell], jnp.zeros((tp, ep), jnp.int32))
    if not interpret:
        plgpu.debug_barrier()  # the table is zero before any route's count lands
    first = valid & (dup == 0)  # one store per (token, expert); masked lanes index past the end
    mine = tok * ep + ids  # the route's (token, expert) cell
    plgpu.store(m_ref.at[jnp.where(first, mine, tp * ep + j)], mult, mask=first)
    if not interpret:
        plgpu.debug_barrier()
    m = plgpu.load(m_ref.at[cell])  # [tp, ep] routes of token t on expert x
    padded = (jnp.sum(m, axis=0) + block_m - 1) // block_m * block_m
    start = jnp.cumsum(padded, axis=0) - padded
    base = start[None, :] + jnp.cumsum(m, axis=0) - m  # the first row of (t, x)'s routes
    if not interpret:
        plgpu.debug_barrier()  # every thread has read the table before it is overwritten
    plgpu.store(m_ref.at[cell], base)
    if not interpret:
        plgpu.debug_barrier()
    pos = plgpu.load(m_ref.at[jnp.where(valid, mine, 0)]) + dup
    return j, valid, pos, jnp.sum(padded) // block_m


def _store_block_experts(total, ids_ref, sorted_ref, be_ref, nb_ref, *, n: int, num_experts: int,
                         block_m: int, nb: int, interpret: bool):
    """After a CTA barrier, each block's expert read back as the expert of the block's first
    row (always a route: a block starts within its expert's routes), E - 1 past the last block
    (as ``block_routing``), and the block count ``total``."""
    if not interpret:
        plgpu.debug_barrier()  # the sorted order is in memory before it is read back
    nbp = pow2(nb)
    bi = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    live = bi < total
    row = plgpu.load(sorted_ref.at[jnp.where(live, bi * block_m, 0)])
    bexp = jnp.where(live, plgpu.load(ids_ref.at[jnp.clip(row, 0, n - 1)]), num_experts - 1)
    plgpu.store(be_ref.at[bi], bexp, mask=bi < nb)
    plgpu.store(nb_ref.at[lax.broadcasted_iota(jnp.int32, (1,), 0)], jnp.full((1,), total, jnp.int32))


def _store_routing_routes(j, valid, ids, rank, fp, ids_ref, sorted_ref, be_ref, nb_ref, pos_ref, *,
                          n: int, num_experts: int, block_m: int, nb: int, em: int, interpret: bool):
    """The "routes" method from its first pass's values (``_route_counts``, ``_first_padded``):
    every route's row (``_route_rows``), the rows and the sorted order (``_store_sorted``),
    the block experts and count (``_store_block_experts``)."""
    pos = _route_rows(ids_ref, ids, fp, rank, n=n, block_m=block_m)
    _store_sorted(j, valid, pos, sorted_ref, pos_ref, n=n, em=em, interpret=interpret)
    _store_block_experts(jnp.sum(fp) // block_m, ids_ref, sorted_ref, be_ref, nb_ref, n=n,
                         num_experts=num_experts, block_m=block_m, nb=nb, interpret=interpret)


def _store_routing(route, sorted_ref, be_ref, nb_ref, pos_ref, *, n: int, num_experts: int,
                   block_m: int, nb: int, em: int, interpret: bool):
    """Stores the routing ``route`` (``_route_positions``'s values) as ``BlockRouting``'s arrays."""
    j, valid, pos, padded, pad_end, ep = route
    nbp = pow2(nb)
    _store_sorted(j, valid, pos, sorted_ref, pos_ref, n=n, em=em, interpret=interpret)
    b = lax.broadcasted_iota(jnp.int32, (nbp, 1), 0) * block_m
    real = lax.broadcasted_iota(jnp.int32, (1, ep), 1) < num_experts
    bexp = jnp.minimum(jnp.sum(((pad_end[None, :] <= b) & real).astype(jnp.int32), axis=1),
                       num_experts - 1)
    bi = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    plgpu.store(be_ref.at[bi], bexp, mask=bi < nb)
    total = jnp.sum(padded) // block_m
    plgpu.store(nb_ref.at[lax.broadcasted_iota(jnp.int32, (1,), 0)], jnp.full((1,), total, jnp.int32))


def _routing_kernel(ids_ref, sorted_ref, be_ref, nb_ref, pos_ref, *scratch, n: int, num_experts: int,
                    block_m: int, nb: int, em: int, interpret: bool, method: str, top_k: int = 0):
    if method == "tokens":
        j, valid, pos, total = _route_tokens(ids_ref, scratch[0], n=n, top_k=top_k,
                                             num_experts=num_experts, block_m=block_m,
                                             interpret=interpret)
        _store_sorted(j, valid, pos, sorted_ref, pos_ref, n=n, em=em, interpret=interpret)
        _store_block_experts(total, ids_ref, sorted_ref, be_ref, nb_ref, n=n,
                             num_experts=num_experts, block_m=block_m, nb=nb, interpret=interpret)
        return
    if method == "routes":
        j, valid, ids, rank, count = _route_counts(ids_ref, n=n)
        _store_routing_routes(j, valid, ids, rank, _first_padded(valid, rank, count, block_m),
                              ids_ref, sorted_ref, be_ref, nb_ref, pos_ref, n=n,
                              num_experts=num_experts, block_m=block_m, nb=nb, em=em,
                              interpret=interpret)
        return
    route = _route_positions(ids_ref, n=n, num_experts=num_experts, block_m=block_m)
    _store_routing(route, sorted_ref, be_ref, nb_ref, pos_ref, n=n, num_experts=num_experts,
                   block_m=block_m, nb=nb, em=em, interpret=interpret)


def _routing_plan(topk_ids: jax.Array, num_experts: int, block_m: int, interpret: bool,
                  method: str | None = None, tokens: bool = True):
    """(flat int32 routes, the routing kernels' static arguments, their int32 outputs' shapes:
    BlockRouting's four, then the "tokens" method's scratch table) for a routing
    ``routing_kernel_fits`` takes; ValueError naming topk_ids if not. ``method``: one of
    ``routing_methods`` (it must fit), None: its first; ``tokens``: whether "tokens" may be."""
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids: expected [T, k] expert ids, got shape {topk_ids.shape}")
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    n, top_k = flat.shape[0], topk_ids.shape[1]
    fits = routing_methods(n, num_experts, block_m, top_k=top_k if tokens else None,
                           explicit=method is not None)
    if not fits or (method is not None and method not in fits):
        raise ValueError(f"topk_ids: {n} routes over {num_experts} experts are too many for the "
                         f"one-program routing kernel ({method or 'any'} method, "
                         f"routing_kernel_fits); use block_routing")
    nb = max_blocks(n, num_experts, block_m)
    em = nb * block_m
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    kw = {"n": n, "num_experts": num_experts, "block_m": block_m, "nb": nb, "em": em,
          "interpret": interpret, "method": method or fits[0]}
    outs = (i32(em), i32(nb), i32(1), i32(n))
    if kw["method"] == "tokens":
        kw["top_k"] = top_k
        outs += (i32(pow2(n // top_k) * pow2(num_experts)),)
    return flat, kw, outs


def routing_methods(n_routes: int, num_experts: int, block_m: int, *, top_k: int | None = None,
                    explicit: bool = False) -> tuple[str, ...]:
    """The routing kernels' methods that take this routing, the default first: "routes" up to
    ROUTES_AUTO_MAX routes (ROUTING_ROUTES_MAX for an ``explicit`` request, then after
    "experts"), "experts" up to ROUTING_EXPERTS_MAX experts when its tiles fit, "tokens" for a
    [T, top_k] routing (None: not offered, e.g. for the fused launch) when its tiles fit."""
    nb = max_blocks(n_routes, num_experts, block_m)
    out = []
    if (num_experts <= ROUTING_EXPERTS_MAX
            and pow2(num_experts) * max(pow2(n_routes), pow2(nb)) <= ROUTING_KERNEL_MAX_ELEMS):
        out.append("experts")
    if n_routes <= (ROUTING_ROUTES_MAX if explicit else min(ROUTES_AUTO_MAX, ROUTING_ROUTES_MAX)):
        if n_routes <= ROUTES_AUTO_MAX:
            out.insert(0, "routes")
        else:
            out.append("routes")
    if (top_k is not None and n_routes % top_k == 0
            and pow2(n_routes // top_k) * pow2(num_experts) <= ROUTING_KERNEL_MAX_ELEMS
            and pow2(n_routes) * pow2(top_k) <= ROUTING_KERNEL_MAX_ELEMS):
        out.append("tokens")
    return tuple(out)


#: Warps of the one-program routing kernel per (method, routes padded to a power of two),
#: overriding ``routing_warps``' default (empty: the defaults are the measured choice). The routes method's [N, 32] tiles: 8 warps
#: from 128 routes (ptxas sm_90 at nemotron T = 8, 176 routes: 248 registers with 4 warps).
ROUTING_WARPS: dict = {}


def routing_warps(method: str, n_routes: int) -> int:
    """The routing kernel's num_warps (``ROUTING_WARPS`` overrides the default; the tokens
    method: ~64 elements of its [N, 32] compare tile per thread, 4 to 16 warps)."""
    np_ = pow2(n_routes)
    default = {"routes": 8 if np_ >= 128 else 4, "tokens": max(4, min(16, np_ // 64))}.get(method, 4)
    return ROUTING_WARPS.get((method, np_), default)


def routing_kernel_fits(n_routes: int, num_experts: int, block_m: int, *,
                        top_k: int | None = None) -> bool:
    """Whether ``routing_kernel`` takes this routing (one of its methods fits one program;
    ``top_k``: as ``routing_methods``)."""
    return bool(routing_methods(n_routes, num_experts, block_m, top_k=top_k))


def routing_kernel(topk_ids: jax.Array, num_experts: int, block_m: int, *,
                   scales: tuple | None = None, interpret: bool = False, method: str | None = None,
                   layer: jax.Array | int | None = None):
    """``routing.block_routing`` as one Pallas-Triton launch (one program) instead of ~5 XLA
    fusions: counts, padded cumsum and each route's rank among its expert's routes from an
    [E, N] one-hot tile, the block experts from an [NB, E] compare tile, the inverse
    permutation as sentinel stores, a CTA barrier, then one scatter. Same outputs, bit for bit
    (integers). For small routings only (``routing_kernel_fits``). ``method``: "experts",
    "routes" or "tokens" (ROUTING_EXPERTS_MAX's comment), None: the first of ``routing_methods``.

    scales: None, or ``(fc1_weight_scale_2, fc2_weight_scale_2, fc1_input_scale,
    fc2_input_scale, mode, activation_scale)``: the same program also computes
    ``moe_scales_kernel``'s six vectors (one launch for both), returned after the routing:
    ``(BlockRouting, (g1, 1/g1, alpha1, g2, 1/g2, alpha2))``; with ``layer`` (an int32 scalar)
    the four are stacks fp32 [L, E] or [L], read in place at that row (``scales.scales_plan``)."""
    flat, rkw, outs = _routing_plan(topk_ids, num_experts, block_m, interpret, method)
    kern = functools.partial(_routing_kernel, **rkw)
    nw = routing_warps(rkw["method"], rkw["n"])
    nr = len(outs)  # BlockRouting's four arrays, then any scratch
    if scales is None:
        res = call(kern, outs, (1,), num_warps=nw, name="nvfp4_moe_routing", interpret=interpret)(flat)
        return BlockRouting(*res[:4])
    sops, skw, souts = scales_plan(scales, num_experts, interpret, layer)
    ns = len(sops)

    def both(ids_ref, *refs):
        # the scales' loads, then the routing (its expert ids loaded before its first
        # reduction), then the scales' arithmetic: no load waits on another part's barriers
        values = load_scales(refs[:ns], **skw)
        kern(ids_ref, *refs[ns:ns + nr])
        store_scales(*values(), refs[ns + nr:])

    res = call(both, (*outs, *souts), (1,), num_warps=nw, name="nvfp4_moe_routing_scales",
                interpret=interpret)(flat, *sops)
    return BlockRouting(*res[:4]), tuple(res[nr:])


def _routing_operand_kernel(ids_ref, *refs, n_scale_ops: int, routing_kw: dict, scales_kw: dict,
                            top_k: int, bk: int, recipe: str, per_expert: bool, exact_asm: bool):
    sc_refs = refs[:n_scale_ops]
    x_ref, srt_ref, be_ref, nb_ref, pos_ref, *rest = refs[n_scale_ops:]
    scale_refs, xp_ref = rest[:6], rest[6]
    r, kt = pl.program_id(0), pl.program_id(1)
    # every program computes the routing and the scales (a few thousand register ops; no
    # second launch, no wait for another program's stores); program (0, 0) also stores them
    kw = {k: v for k, v in routing_kw.items() if k != "method"}
    n, bm = kw["n"], kw["block_m"]
    # every global load before the first reduction (a load after a reduction's barrier waits
    # for it; issued here, their latencies overlap): this program's row of hidden, its route's
    # expert, the scales (after the layer's row, with stacks), then the routing's expert ids
    ex = plgpu.load(ids_ref.at[r]) if per_expert else 0
    x = plgpu.load(x_ref.at[r // top_k, pl.ds(kt * bk, bk)]).astype(jnp.float32)
    scale_vals = load_scales(sc_refs, **scales_kw)
    if routing_kw["method"] == "routes":  # this route's row from the first pass alone
        j, valid, ids, rank, count = _route_counts(ids_ref, n=n)
        fp = _first_padded(valid, rank, count, bm)
        mine = j == r
        row = (jnp.sum(jnp.where(ids < jnp.sum(jnp.where(mine, ids, 0)), fp, 0))
               + jnp.sum(jnp.where(mine, rank, 0)))
        je, evalid, vals = scale_vals()

        @pl.when((r == 0) & (kt == 0))
        def _():
            _store_routing_routes(j, valid, ids, rank, fp, ids_ref, srt_ref, be_ref, nb_ref, pos_ref,
                                  **kw)
            store_scales(je, evalid, vals, scale_refs)
    else:
        route = _route_positions(ids_ref, n=n, num_experts=kw["num_experts"], block_m=bm)
        je, evalid, vals = scale_vals()

        @pl.when((r == 0) & (kt == 0))
        def _():
            _store_routing(route, srt_ref, be_ref, nb_ref, pos_ref, **kw)
            store_scales(je, evalid, vals, scale_refs)

        j, pos = route[0], route[2]
        row = jnp.sum(jnp.where(j == r, pos, 0))  # this program's route's sorted row
    g, rg = (jnp.sum(jnp.where(je == ex, v, 0.0)) for v in vals[:2])  # one lane each: exact
    q = requantize(x.reshape(bk // 16, 16), g, rg, recipe, exact_asm)
    plgpu.store(xp_ref.at[row, pl.ds(kt * bk, bk)], permute_k_order(q.reshape(bk)).astype(jnp.bfloat16))


def routing_operand_kernel(topk_ids: jax.Array, hidden: jax.Array, num_experts: int, block_m: int,
                           scales: tuple, *, recipe: str, interpret: bool = False,
                           method: str | None = None, layer: jax.Array | int | None = None):
    """``routing_kernel(scales=...)`` and ``fc1_operand(skip_padding=True)`` as one launch
    (``MosaicMoEConfig.routing="fused"``): one program per (route, K tile of ``hidden``) stores
    its route's quantized row at the route's sorted position; program (0, 0) also stores the
    routing and the six scale vectors. Each program recomputes the routing positions and the
    scales in registers (small routings only, ``routing_kernel_fits``), so nothing waits for
    another program. Bit for bit the two kernels' outputs; padding rows are not written.

    topk_ids int [T, k]; hidden bf16 [T, H] (H % 256 == 0); scales: ``(fc1_weight_scale_2,
    fc2_weight_scale_2, fc1_input_scale, fc2_input_scale, mode, activation_scale)``; recipe:
    the FC1 operand's quantization recipe. Returns ``(BlockRouting, (g1, 1/g1, alpha1, g2,
    1/g2, alpha2), xp bf16 [EM, H])``. ``method``: as ``routing_kernel``'s (with "routes" each
    program needs only the first pass; program (0, 0) makes the second). ``layer``: as
    ``routing_kernel``'s (the scale stacks read in place)."""
    t, h = hidden.shape
    if h % 256:
        raise ValueError(f"hidden: expected [T, H] with H % 256 == 0 (the grouped kernel's K), got {hidden.shape}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids: expected [T, k] with T = {t} (hidden's rows), got {topk_ids.shape}")
    flat, rkw, outs = _routing_plan(topk_ids, num_experts, block_m, interpret, method,
                                    tokens=False)  # each program needs its row alone
    sops, skw, souts = scales_plan(scales, num_experts, interpret, layer)
    bk = row_tile(h)
    kern = functools.partial(
        _routing_operand_kernel, n_scale_ops=len(sops), routing_kw=rkw, scales_kw=skw,
        top_k=topk_ids.shape[1], bk=bk, recipe=recipe, per_expert=scales[-1] == "per_expert",
        exact_asm=not interpret)
    srt, be, nbk, pos, *sv, xp = call(
        kern, (*outs, *souts, jax.ShapeDtypeStruct((rkw["em"], h), jnp.bfloat16)),
        (rkw["n"], h // bk), num_warps=8, name="nvfp4_moe_routing_operand", interpret=interpret)(
        flat, *sops, hidden)
    return BlockRouting(srt, be, nbk, pos), tuple(sv), xp
