"""Softmax top-k routing in one Pallas-Triton launch: router logits -> (expert ids, weights).

``routing.select_experts`` in XLA is four launches and more per MoE layer (softmax, ``top_k``
as a sort, the renormalization, and ``moe``'s check that each token's hidden row is finite):
~7 us of a Qwen3-30B-A3B decode step's layer on the H200, each launch a microsecond or more
for 128 logits. :func:`select_kernel` does all of it in one program per block of tokens:

* the experts of the k largest logits, the lower index first among equal ones (by the logits
  themselves: exp is increasing, so these are the k largest probabilities of exact arithmetic,
  ``oracle.select_experts``; XLA's ``top_k`` compares the rounded probabilities instead, which
  can tie where the logits do not);
* their weights ``exp(l_j - m) / sum_i exp(l_i - m)`` in fp32 (IEEE divisions), renormalized
  over the k with ``renormalize`` (``p_j / sum of the k``, as XLA's path computes it);
* NaN weights for a token with a NaN or +inf logit or all logits -inf (softmax undefined), and
  for one whose hidden row holds a NaN or Inf (``moe``'s policy: that token's output row is
  NaN on every backend).

Held to ``oracle.select_experts_error_bound`` (the same bound holds XLA's path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..triton_ops import call, cdiv, div_rn, pow2

#: Most experts a token may have (one token's logits are one program's tile).
MAX_EXPERTS = 4096
#: Logit tile of one program: a token's 128 logits (Qwen3, Mixtral-style routers) or several
#: tokens' fewer. One token per program at E >= 128 spreads a batch over the SMs; one warp per
#: 128 elements keeps the k reductions in warp shuffles (``WARP_ELEMS``).
TILE_TARGET = 128
WARP_ELEMS = 128
#: Hidden values one warp checks per chunk (32 per thread).
CHUNK_PER_WARP = 1024


def _tiles(t: int, e: int, h: int) -> tuple[int, int, int]:
    """(tokens per program, warps, hidden chunk) for T tokens, E experts, hidden size H."""
    ep = pow2(e)
    tb = max(1, min(pow2(t), TILE_TARGET // ep))
    warps = max(1, min(4, tb * ep // WARP_ELEMS))
    hk = max(1, min(pow2(h), CHUNK_PER_WARP * warps // tb))
    return tb, warps, hk


def select_fits(num_experts: int, top_k: int) -> bool:
    """Whether :func:`select_kernel` takes E experts (one token's logits in one tile)."""
    return pow2(num_experts) <= MAX_EXPERTS and 1 <= top_k <= num_experts


def _select_kernel(lg_ref, x_ref, ids_ref, w_ref, *, t: int, e: int, k: int, h: int, tb: int,
                   hk: int, renormalize: bool, exact_asm: bool):
    ep = pow2(e)
    r0 = pl.program_id(0) * tb
    rows = r0 + lax.broadcasted_iota(jnp.int32, (tb, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (1, ep), 1)
    live = rows < t
    valid = live & (cols < e)
    inf = float("inf")  # a Python float: Triton lowering cannot negate a jnp constant
    lg = jnp.where(valid, plgpu.load(lg_ref.at[jnp.where(valid, rows * e + cols, 0)]), -inf)
    isnan = lg != lg
    # softmax undefined: a NaN or +inf logit, or (below) every logit -inf
    undefined = jnp.max(jnp.where(valid & (isnan | (lg == inf)), 1, 0), axis=1) > 0
    sel = jnp.where(isnan, -inf, lg)  # NaN never selected (its token's weights are NaN)
    m = jnp.max(sel, axis=1)
    undefined = undefined | (m == -inf)
    ex = jnp.exp(jnp.where(valid & ~undefined[:, None], sel - m[:, None], -inf))  # [tb, ep]
    total = jnp.sum(ex, axis=1)
    # a non-finite hidden value anywhere in the token's row
    hc = lax.broadcasted_iota(jnp.int32, (1, hk), 1)
    bad_x = jnp.zeros((tb,), jnp.bool_)
    for c0 in range(0, h, hk):  # static: h / hk chunks
        ok = live & (c0 + hc < h)
        xv = plgpu.load(x_ref.at[jnp.where(ok, rows * h + c0 + hc, 0)]).astype(jnp.float32)
        bad_x = bad_x | (jnp.max(jnp.where(ok & ~(jnp.abs(xv) < inf), 1, 0), axis=1) > 0)
    nan_w = undefined | bad_x
    r1 = r0 + lax.broadcasted_iota(jnp.int32, (tb,), 0)
    live1 = r1 < t
    # masked lanes store out of range (never a clamped duplicate of a live lane's index:
    # interpret mode writes them too, racing with that lane)
    out = lambda j: jnp.where(live1, r1 * k + j, t * k + r1)
    taken = jnp.zeros((tb, ep), jnp.bool_)
    probs = []
    for j in range(k):  # static: the k largest logits one by one
        cand = valid & ~taken
        v = jnp.where(cand, sel, -inf)
        mx = jnp.max(v, axis=1)
        idx = jnp.min(jnp.where(cand & (v == mx[:, None]), cols, ep), axis=1)
        hit = cols == idx[:, None]
        taken = taken | hit
        plgpu.store(ids_ref.at[out(j)], jnp.minimum(idx, e - 1), mask=live1)
        # the chosen expert's exp(l - m) is exp(mx - m): no third reduction (where the softmax
        # is undefined the weights are NaN whatever this gives)
        probs.append(div_rn(jnp.exp(mx - m), total, exact_asm))
    if renormalize:
        norm = probs[0]
        for p in probs[1:]:
            norm = norm + p
        probs = [div_rn(p, norm, exact_asm) for p in probs]
    for j, p in enumerate(probs):
        plgpu.store(w_ref.at[out(j)], jnp.where(nan_w, jnp.nan, p), mask=live1)


def select_kernel(router_logits: jax.Array, hidden: jax.Array, top_k: int, *,
                  renormalize: bool = False, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing as one Pallas-Triton launch (module docstring).

    router_logits: float [T, E] (computed in fp32); hidden: [T, H], the layer's input (only
    checked for non-finite values). Returns (topk_ids int32 [T, top_k], topk_weights float32
    [T, top_k]), as ``routing.select_experts(..., routing="softmax")`` with ``moe``'s NaN
    weights for non-finite hidden rows. Needs ``select_fits(E, top_k)``."""
    if router_logits.ndim != 2:
        raise ValueError(f"router_logits: expected [T, E], got shape {router_logits.shape}")
    t, e = router_logits.shape
    if hidden.ndim != 2 or hidden.shape[0] != t:
        raise ValueError(f"hidden: expected [T={t}, H], got shape {hidden.shape}")
    if not select_fits(e, top_k):
        raise ValueError(f"top_k: expected 1 <= top_k <= E = {e} with E <= {MAX_EXPERTS} "
                         f"experts, got top_k={top_k}")
    h = hidden.shape[1]
    tb, warps, hk = _tiles(t, e, h)
    kern = functools.partial(_select_kernel, t=t, e=e, k=top_k, h=h, tb=tb, hk=hk,
                             renormalize=renormalize, exact_asm=not interpret)
    ids, w = call(kern, (jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
                         jax.ShapeDtypeStruct((t * top_k,), jnp.float32)),
                  (cdiv(t, tb),), num_warps=warps, name="nvfp4_moe_select", interpret=interpret)(
        router_logits.astype(jnp.float32).reshape(-1), hidden.reshape(-1))
    return ids.reshape(t, top_k), w.reshape(t, top_k)
