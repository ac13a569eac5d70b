"""Decode attention over a stacked KV cache, read in place: two Pallas-Triton launches per layer.

A decode step (one new token per sequence) under ``lax.scan`` over layers keeps the KV cache
as one carried buffer ``[L, B, S, KVH, D]``. XLA's attention (``jnp.einsum`` on
``cache[layer]``) copies the layer's slice out of the stack on every step before its dots
read it. :func:`decode_attention` takes the whole stack and the layer index instead: each
program reads its (sequence, kv head, key chunk) rows of layer ``layer`` straight from the
stack, only the ``lengths[b]`` written positions (``S`` is the cache's capacity), and keeps a
running softmax over its chunk (flash decoding). The chunks' partial results (fp32
numerators, maxima and sums) are combined by a second launch, one program per (sequence,
query head). :func:`cache_attention` is XLA's attention on one layer's slice (T query tokens:
prefill, and decode steps where the kernel does not run).

Arithmetic (:func:`cache_attention` has the same rounding points, in another order):
scores ``q . k`` with fp32 accumulation of the exact bf16 products, times fp32 ``1/sqrt(D)``;
probabilities ``exp(s - m)`` in fp32, rounded to bf16 for the ``p . v`` dot
(fp32 accumulation), the sum of probabilities in fp32; output rounded to bf16 once.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .device import on_gpu
from .gemm.operand import mosaic_columns, operand_values, scale_and_layer
from .triton_ops import bf16_rne, cdiv, div_rn, pow2
from .validate import check_layer, is_concrete

log = logging.getLogger(__name__)

BLOCK_S = 64  # keys per inner step (an MMA's N for the scores, its K for p . v)
COMBINE_CHUNKS = 32  # chunks a combine program adds per step ([32, D] fp32 in registers)
TARGET_PROGRAMS = 256  # about two per SM on an H200 (132 SMs) at the longest contexts
NEG = -1e30  # the running maximum's start: finite, so an empty chunk gives exp(NEG - m) = 0


def chunking(batch: int, kv_heads: int, capacity: int) -> int:
    """Keys per program (a multiple of :data:`BLOCK_S`): about :data:`TARGET_PROGRAMS`
    programs over ``batch * kv_heads`` heads when the cache is full."""
    splits = max(1, cdiv(TARGET_PROGRAMS, batch * kv_heads))
    return BLOCK_S * max(1, cdiv(capacity, splits * BLOCK_S))


def _load_block(k_ref, v_ref, row0, s0, i, n: jax.Array, cols):
    """Keys ``s0 + i * BLOCK_S ..`` of one (sequence, kv head) from the flattened caches:
    (positions [BLOCK_S], valid [BLOCK_S], k, v bf16 [BLOCK_S, D]); slots at or past ``n``
    are not read (zeros)."""
    kpos = s0 + i * BLOCK_S + jnp.arange(BLOCK_S)
    valid = kpos < n
    rows = pl.ds(row0 + i * BLOCK_S, BLOCK_S)
    k = plgpu.load(k_ref.at[rows, cols], mask=valid[:, None], other=0.0)
    # v with k: issued after the softmax's reductions (their barriers), its load would wait
    # for them
    v = plgpu.load(v_ref.at[rows, cols], mask=valid[:, None], other=0.0)
    return kpos, valid, k, v


def _softmax_step(q, carry, block, scale: float, new=None):
    """One block of keys into the running softmax (m, l, acc) of the rows of ``q`` [gp, D].
    ``new``: None, or (pos, k [1, D], v [1, D] bf16): the key at position ``pos`` is that k
    and v (the new token's, kept in registers) whatever the cache holds there."""
    m, l, acc = carry
    kpos, valid, k, v = block
    if new is not None:
        pos, k_new, v_new = new
        hit = (kpos == pos)[:, None]
        k, v = jnp.where(hit, k_new, k), jnp.where(hit, v_new, v)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * scale  # [gp, BLOCK_S]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    rescale = jnp.exp(m - m_new)
    pv = lax.dot_general(p.astype(jnp.bfloat16), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)  # [gp, d]
    return m_new, l * rescale + jnp.sum(p, axis=1), acc * rescale[:, None] + pv


def _softmax_init(gp: int, d: int):
    return (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
            jnp.zeros((gp, d), jnp.float32))


def _store_partials(acc_ref, m_ref, l_ref, carry, bh, j, g: int, gp: int):
    """The chunk's (m, l, acc): only the g real rows (row r of program (bh, j) at
    (bh * splits + j) * g + r)."""
    m, l, acc = carry
    out0 = (bh * pl.num_programs(1) + j) * g
    keep = jnp.arange(gp) < g
    plgpu.store(acc_ref.at[pl.ds(out0, gp), :], acc, mask=keep[:, None])
    plgpu.store(m_ref.at[pl.ds(out0, gp)], m, mask=keep)
    plgpu.store(l_ref.at[pl.ds(out0, gp)], l, mask=keep)


def _kernel(q_ref, k_ref, v_ref, meta_ref, acc_ref, m_ref, l_ref, *, n_layers: int, batch: int,
            capacity: int, kv_heads: int, d: int, g: int, gp: int, chunk: int, scale: float):
    bh, j = pl.program_id(0), pl.program_id(1)
    b, h = bh // kv_heads, bh % kv_heads
    # valid keys of sequence b: positions 0..n-1, never past its S slots, and a layer of the
    # stack (traced values out of range must not read another sequence's or layer's rows, nor
    # past the buffer; n <= 0 attends nothing: 0/0, NaN)
    layer = jnp.minimum(jnp.maximum(meta_ref[0], 0), n_layers - 1)
    n = jnp.minimum(meta_ref[1 + b], capacity)
    q = plgpu.load(q_ref.at[pl.ds(bh * gp, gp), :])  # [gp, d], rows past g are zeros
    s0 = j * chunk
    row0 = (layer * batch + b) * capacity + s0  # the flattened stack's row of key s0
    cols = pl.ds(h * d, d)
    carry = lax.fori_loop(
        0, chunk // BLOCK_S,
        lambda i, c: _softmax_step(q, c, _load_block(k_ref, v_ref, row0, s0, i, n, cols), scale),
        _softmax_init(gp, d))
    _store_partials(acc_ref, m_ref, l_ref, carry, bh, j, g, gp)


def _combine_kernel(acc_ref, m_ref, l_ref, *refs, splits: int, g: int, d: int, n_rows: int,
                    operand: tuple[int, int, int, int] | None, exact_asm: bool):
    """o = sum_j w_j acc_j / sum_j w_j l_j over the chunks j of one query head of one
    (sequence, kv head), with w_j = exp(m_j - max_j m_j) (an empty chunk: m_j = NEG, w_j = 0).
    One program per query head: its chunks' rows ([COMBINE_CHUNKS, D] at a time, all of them
    at once up to that many chunks) are loaded together, no load waiting on another's sum.

    operand: None (refs: the output o [B * NH, D]), or (batch, kv_heads, rows, n_scales): refs
    (layer [1] int32, input scales fp32 [n_scales], the operand bf16 [rows, NH * D]): o's
    values quantized for the next W4A4 linear (``gemm.operand.operand_values`` with the scale
    at ``layer``, clamped) at their ``gemm.operand.mosaic_columns`` of the sequence's row, and
    zeros in rows batch..rows-1 (written by the sequence-0 programs)."""
    pid = pl.program_id(0)
    bh, r = pid // g, pid % g  # (sequence, kv head), query head within it
    if operand is not None:  # the input scale's loads first, in flight with the chunks'
        batch, kv_heads, n_tile, n_scales = operand
        lay_ref, s_ref, xp_ref = refs
        layer = jnp.minimum(jnp.maximum(lay_ref[0], 0), n_scales - 1)
        s = plgpu.load(s_ref.at[pl.ds(layer, 1)]).reshape(1, 1)

    def chunk_rows(j):
        """The rows [len(j)] of this head in chunks ``j``, clamped into the buffer (gathers;
        the mask drops them), and the mask of the real ones."""
        return jnp.minimum(bh * splits * g + j * g + r, n_rows - 1), j < splits

    cols = jnp.arange(d)
    cs = min(pow2(splits), COMBINE_CHUNKS)

    def load_step(i):
        """(m, l, acc) of the chunks of step ``i``: [cs], [cs], [cs, d] (masked chunks: NEG,
        0, 0)."""
        rr, ok = chunk_rows(i * cs + jnp.arange(cs))
        return (plgpu.load(m_ref.at[rr], mask=ok, other=NEG),
                plgpu.load(l_ref.at[rr], mask=ok, other=0.0),
                plgpu.load(acc_ref.at[rr[:, None], cols[None, :]], mask=ok[:, None], other=0.0))

    def add_step(carry, m_max, m, l, acc):
        num, den = carry
        w = jnp.exp(m - m_max)  # [cs]
        return num + jnp.sum(acc * w[:, None], axis=0, keepdims=True), den + jnp.sum(l * w)

    init = (jnp.zeros((1, d), jnp.float32), jnp.zeros((), jnp.float32))
    if splits <= cs:  # one step: every load issued at once, the maximum from the same rows
        m, l, acc = load_step(0)
        num, den = add_step(init, jnp.max(m), m, l, acc)
    else:
        rows, valid = chunk_rows(jnp.arange(pow2(splits)))
        m_max = jnp.max(plgpu.load(m_ref.at[rows], mask=valid, other=NEG))
        num, den = lax.fori_loop(0, cdiv(splits, cs),
                                 lambda i, c: add_step(c, m_max, *load_step(i)), init)
    o = div_rn(num, jnp.broadcast_to(den, (1, d)), exact_asm)  # [1, d]
    if operand is None:
        (o_ref,) = refs
        plgpu.store(o_ref.at[bh * g + r, cols], o.reshape(d).astype(jnp.bfloat16))
        return
    b, h = bh // kv_heads, bh % kv_heads
    # o's bf16 values (a convert pair that interpret mode's XLA could drop), quantized
    q = operand_values(bf16_rne(o, exact_asm), s, exact_asm).astype(jnp.bfloat16).reshape(d)
    dst = mosaic_columns((h * g + r) * d + cols)  # [d]
    plgpu.store(xp_ref.at[b, dst], q)
    for pad in range(batch, n_tile):  # the token tile's rows past the batch: zeros
        plgpu.store(xp_ref.at[pad, dst], jnp.zeros_like(q), mask=(cols >= 0) & (b == 0))


def _check(q, k_cache, v_cache, layer, lengths):
    if q.ndim != 3 or q.dtype != jnp.bfloat16:
        raise ValueError(f"q: expected bf16 [B, NH, D], got {q.dtype} {q.shape}")
    b, nh, d = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 5 or c.dtype != jnp.bfloat16 or c.shape[1] != b or c.shape[4] != d:
            raise ValueError(f"{name}: expected bf16 [L, B={b}, S, KVH, D={d}], got "
                             f"{c.dtype} {c.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {k_cache.shape}, got "
                         f"{v_cache.shape}")
    kvh = k_cache.shape[3]
    if nh % kvh:
        raise ValueError(f"q: NH = {nh} query heads is not a multiple of KVH = {kvh} kv heads")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths: expected int32 [B={b}], got {lengths.dtype} {lengths.shape}")
    n_layers, _, s = k_cache.shape[:3]
    check_layer(layer, n_layers)
    if is_concrete(lengths):
        bad = np.flatnonzero((np.asarray(lengths) < 1) | (np.asarray(lengths) > s))
        if bad.size:  # no key to attend (a 0/0), or keys past the cache
            raise ValueError(f"lengths: expected 1 <= lengths[b] <= S = {s}, got "
                             f"lengths[{bad[0]}] = {int(lengths[bad[0]])}")


def supported(head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """None when :func:`decode_attention` runs these heads, else why not (Triton's dots want
    a power-of-two head_dim of at least 16)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    return None


def runs_kernel(backend: str, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the decoders' one-token attention runs :func:`decode_attention`: for
    ``backend`` other than "xla" on a GPU, and for "pallas" anywhere (interpreted off the GPU),
    on heads it supports; where it does not, the XLA attention runs and this logs why."""
    if backend == "xla" or not (on_gpu() or backend == "pallas"):
        return False
    why = supported(head_dim, num_heads, num_kv_heads)
    if why:
        log.info("decode attention: XLA's einsums on a slice of the cache (%s)", why)
    return why is None


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array) -> jax.Array:
    """XLA's attention of T query tokens per sequence against one layer's cache (the decoders'
    prefill, and their decode step where :func:`runs_kernel` says no).

    q: bf16 [B, T, NH, D] at positions pos int32 [B, T]; k, v: bf16 [B, S, KVH, D]. Query
    ``t`` of sequence ``b`` attends keys ``0 .. pos[b, t]`` (causal; the slots past it are
    masked out of the scores, but the ``p . v`` dot multiplies them by 0, so they must be
    finite: ``models.init_cache`` fills the cache with zeros). Query head ``i`` reads kv head
    ``i // (NH / KVH)``. Returns bf16 [B, T, NH, D]. The rounding points of
    :func:`decode_attention` (``oracle.decode_attention_error_bound``), except that the
    probabilities are normalized before their bf16 rounding.
    """
    b, t, nh, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kvh, nh // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / math.sqrt(d))
    mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(jnp.bfloat16)
    o = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return o.astype(jnp.bfloat16).reshape(b, t, nh, d)


def _qkv_kernel(qkv_ref, qn_ref, kn_ref, cos_ref, sin_ref, layer_ref, nrow_ref, start_ref,
                kin_ref, vin_ref, acc_ref, m_ref, l_ref, k_ref, v_ref, *, n_layers: int,
                batch: int, capacity: int, kv_heads: int, d: int, g: int, gp: int, chunk: int,
                scale: float, eps: float, norm: bool, norm_rows: int, rope: bool,
                exact_asm: bool):
    """Program (bh, j): kv head h of sequence b (bh = b * KVH + h) and its chunk j of keys,
    from the new token's q/k/v projection. The g query heads of kv head h and its new k,
    RMSNorm'd (``norm``) and rotated (``rope``) as ``nn.rms_norm`` and ``models.apply_rope``
    round them, in registers; the chunk's keys ``0 .. start`` of layer ``layer`` read from the
    caches in place, the new token's k and v (position ``start``) taken from registers; the
    chunk's running softmax stored as :func:`_kernel` stores it. The program whose chunk holds
    ``start`` writes k and v into the caches (aliased) at (layer, b, start). ``layer`` and
    ``start`` clamp into the stack as XLA's ``dynamic_update_slice`` clamps. The norm weights:
    row 0 of ``qn_ref`` and row 1 of ``kn_ref`` (both the packed [2, D]), or with
    ``norm_rows`` > 0 row ``nrow_ref[0]`` (clamped) of each [norm_rows, D] stack."""
    bh, j = pl.program_id(0), pl.program_id(1)
    b, h = bh // kv_heads, bh % kv_heads
    layer = jnp.minimum(jnp.maximum(layer_ref[0], 0), n_layers - 1)
    if norm_rows:
        row = jnp.minimum(jnp.maximum(nrow_ref[0], 0), norm_rows - 1)
        rows = (row, row)
    else:
        rows = (0, 1)
    pos = jnp.minimum(jnp.maximum(start_ref[0], 0), capacity - 1)
    c = jnp.arange(d)
    partner = (c + d // 2) % d  # rotate-half: column c takes -x[c + d/2] or x[c - d/2]
    sign = jnp.where(c < d // 2, -1.0, 1.0).astype(jnp.float32)
    nh = kv_heads * g

    def load_heads(col0, n: int, live):
        """([n, d], [n, d]) fp32: ``n`` heads from column ``col0`` (bf16 values) and their
        rotate-half partner columns; ``live`` masks the padding rows."""
        r = jnp.arange(n)[:, None]

        def load(cols):
            v = plgpu.load(qkv_ref.at[b, col0 + r * d + cols[None, :]],
                           mask=live[:, None], other=0.0)
            return v.astype(jnp.float32)

        return load(c), load(partner)

    def load_weights(which: int):
        """q's (``which`` 0) or k's norm weight at columns c and their partners."""
        ref = (qn_ref, kn_ref)[which]
        return tuple(plgpu.load(ref.at[rows[which], cols]).astype(jnp.float32)
                     for cols in (c, partner))

    # every load before the first reduction (a load after a reduction's barrier waits for
    # it): the q heads, the k head, v, the norm weights, the rotation
    one = jnp.arange(1) < 1
    q_in = load_heads(h * g * d, gp, jnp.arange(gp) < g)
    k_in = load_heads((nh + h) * d, 1, one)
    v_new = plgpu.load(qkv_ref.at[b, (nh + kv_heads + h) * d + c])
    weights = (load_weights(0), load_weights(1)) if norm else (None, None)
    if rope:
        cs = plgpu.load(cos_ref.at[b, c])[None, :]
        sn = plgpu.load(sin_ref.at[b, c])[None, :]
    s0 = j * chunk
    row0 = (layer * batch + b) * capacity + s0  # the flattened stack's row of key s0
    cols = pl.ds(h * d, d)

    def finish(x, xr, w):
        """Heads [n, d] normed (norm weight ``w``: (at c, at the partners)) and rotated."""
        if norm:
            inv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + eps)
            x = bf16_rne(w[0][None, :] * bf16_rne(x * inv, exact_asm), exact_asm)
            xr = bf16_rne(w[1][None, :] * bf16_rne(xr * inv, exact_asm), exact_asm)
        if rope:
            x = x * cs + (sign[None, :] * xr) * sn
        return x

    q = finish(*q_in, weights[0]).astype(jnp.bfloat16)  # [gp, d], rows past g are zeros
    k_new = finish(*k_in, weights[1]).astype(jnp.bfloat16)  # [1, d]
    mine = (c >= 0) & (j == pos // chunk)  # this program's chunk holds the new token
    dst = (layer * batch + b) * capacity + pos
    plgpu.store(k_ref.at[dst, cols], k_new.reshape(d), mask=mine)
    plgpu.store(v_ref.at[dst, cols], v_new, mask=mine)
    new = (pos, k_new, v_new[None, :])
    carry = lax.fori_loop(
        0, chunk // BLOCK_S,
        lambda i, cr: _softmax_step(
            q, cr, _load_block(kin_ref, vin_ref, row0, s0, i, pos + 1, cols), scale, new),
        _softmax_init(gp, d))
    _store_partials(acc_ref, m_ref, l_ref, carry, bh, j, g, gp)


def decode_qkv_attention(qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                         layer: jax.Array | int, start: jax.Array | int, *, num_heads: int,
                         q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
                         eps: float = 1e-6, rope: tuple[jax.Array, jax.Array] | None = None,
                         norm_layer: jax.Array | int | None = None,
                         w4a4_operand: tuple[jax.Array, jax.Array | int | None, int] | None = None,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's attention from its fused q/k/v projection, in two launches.

    qkv: bf16 [B, (NH + 2 KVH) * D], the new token's q, k and v heads side by side (the
    decoders' ``qkv_proj``); k_cache, v_cache: bf16 [L, B, S, KVH, D]; layer: int32 scalar;
    start: int32 scalar, the new token's position (every sequence's). q_norm, k_norm: None or
    bf16 [D], RMSNorm weights over each head (Qwen3; ``eps``); or with ``norm_layer`` (an
    int32 scalar, inside a scan over stacked layers) bf16 [L', D] stacks of them, read in
    place at row ``norm_layer`` (clamped into the stack): a Pallas-Triton kernel gets a copy
    of each scanned per-layer slice it takes (one fusion for the pair, about 1.4 us a step on
    the H200). rope: None or (cos, sin) fp32 [B, D] of the position (``models.rope_tables``;
    rotate-half RoPE).

    One Pallas-Triton launch, a program per (sequence, kv head, chunk of keys) as in
    :func:`decode_attention`, norms and rotates the new token's q and k heads in registers,
    attends keys ``0 .. start`` of the layer (the new token's k and v from registers, the
    others read in place) and writes k and v into the caches at (layer, b, start) (in place:
    the caches are aliased; one program of each kv head writes them); the second combines
    the chunks, as :func:`decode_attention`'s does: the values of ``nn.rms_norm``,
    ``models.apply_rope``, ``lax.dynamic_update_slice`` and :func:`decode_attention` (the same
    roundings; the RMSNorm's fp32 sum in another order). Out-of-range traced ``layer`` and
    ``start`` clamp into the stack as ``dynamic_update_slice`` does.

    w4a4_operand: None, or (input_scale, layer, rows) of the W4A4 linear the output feeds
    (``o_proj``): the last launch then writes that linear's Mosaic operand instead of the
    output, ``gemm.operand.mosaic_w4a4_operand(o.reshape(B, NH * D), input_scale, rows,
    layer=layer)`` bit for bit (quantized with IEEE divisions, K permuted, rows B..rows-1
    zero), for ``gemm.matmul_w4a4_operand``: one launch fewer. input_scale: an fp32 scalar
    (layer None) or, inside a scan over stacked layers, the fp32 [L'] stack read in place at
    ``layer`` (clamped); rows: the GEMM's token tile (``gemm.mosaic.token_tile(B)``), >= B.

    Returns (bf16 [B, NH, D] attention output, or with ``w4a4_operand`` the operand bf16
    [rows, NH * D]; k_cache, v_cache).
    """
    n_layers, b, s, kvh, d = k_cache.shape
    if qkv.ndim != 2 or qkv.dtype != jnp.bfloat16 or qkv.shape != (b, (num_heads + 2 * kvh) * d):
        raise ValueError(f"qkv: expected bf16 [B={b}, (NH + 2 KVH) * D = "
                         f"{(num_heads + 2 * kvh) * d}], got {qkv.dtype} {qkv.shape}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 5 or c.dtype != jnp.bfloat16 or c.shape != k_cache.shape:
            raise ValueError(f"{name}: expected bf16 [L, B, S, KVH, D] {k_cache.shape}, got "
                             f"{c.dtype} {c.shape}")
    why = supported(d, num_heads, kvh)
    if why:
        raise ValueError(f"qkv: {why}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: give both RMSNorm weights or neither")
    stacked = norm_layer is not None
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is None:
            continue
        if stacked and (w.ndim != 2 or w.shape[1] != d or w.shape != q_norm.shape):
            raise ValueError(f"{name}: expected the [L', D={d}] stack of both norms with "
                             f"norm_layer given, got {w.shape}")
        if not stacked and w.shape != (d,):
            raise ValueError(f"{name}: expected [D={d}], got {w.shape}")
    if stacked and jnp.size(norm_layer) != 1:
        raise ValueError(f"norm_layer: expected an int32 scalar, got shape {jnp.shape(norm_layer)}")
    if rope is not None:
        for name, t in zip(("rope cos", "rope sin"), rope):
            if t.shape != (b, d) or t.dtype != jnp.float32:
                raise ValueError(f"{name}: expected fp32 [B={b}, D={d}], got {t.dtype} {t.shape}")
    check_layer(layer, n_layers)
    operand = None
    if w4a4_operand is not None:
        operand = _operand_args(w4a4_operand, b, num_heads * d)
    g = num_heads // kvh
    gp = max(16, pow2(g))
    zeros = jnp.zeros((b, d), jnp.float32)
    cos, sin = rope if rope is not None else (zeros, zeros)
    if q_norm is not None and stacked:  # the stacks in place
        qn, kn = q_norm.astype(jnp.bfloat16), k_norm.astype(jnp.bfloat16)
        norm_rows = q_norm.shape[0]
    else:  # one packed operand (one copy of the two scanned slices, not one of each)
        qn = kn = (jnp.ones((2, d), jnp.bfloat16) if q_norm is None
                   else jnp.stack([q_norm, k_norm]).astype(jnp.bfloat16))
        norm_rows = 0
    chunk = chunking(b, kvh, s)
    splits = cdiv(s, chunk)
    kernel = functools.partial(
        _qkv_kernel, n_layers=n_layers, batch=b, capacity=s, kv_heads=kvh, d=d, g=g, gp=gp,
        chunk=chunk, scale=1.0 / math.sqrt(d), eps=float(eps), norm=q_norm is not None,
        norm_rows=norm_rows, rope=rope is not None, exact_asm=not interpret)
    flat = (n_layers * b * s, kvh * d)
    acc, m, lsum, kc, vc = pl.pallas_call(
        kernel, grid=(b * kvh, splits), interpret=interpret, name="nvfp4_decode_qkv_attention",
        out_shape=(*_partials_shape(b * kvh * splits * g, gp - g, d),
                   jax.ShapeDtypeStruct(flat, jnp.bfloat16),
                   jax.ShapeDtypeStruct(flat, jnp.bfloat16)),
        input_output_aliases={8: 3, 9: 4},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    )(qkv, qn, kn, cos, sin, jnp.asarray(layer, jnp.int32).reshape(1),
      jnp.asarray(0 if norm_layer is None else norm_layer, jnp.int32).reshape(1),
      jnp.asarray(start, jnp.int32).reshape(1), k_cache.reshape(flat), v_cache.reshape(flat))
    o = _combine(acc, m, lsum, batch=b, kv_heads=kvh, splits=splits, d=d, g=g,
                 interpret=interpret, operand=operand)
    if operand is None:
        o = o.reshape(b, num_heads, d)
    return o, kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)


def _operand_args(w4a4_operand, batch: int, k: int):
    """``decode_qkv_attention``'s ``w4a4_operand`` checked -> (layer int32 [1], input scales
    fp32 [L'], rows) for ``_attend``."""
    try:
        scale, layer, rows = w4a4_operand
    except (TypeError, ValueError):
        raise ValueError("w4a4_operand: expected (input_scale, layer, rows), got "
                         f"{type(w4a4_operand).__name__}") from None
    try:
        lay, sc = scale_and_layer(scale, layer)
    except ValueError as err:
        raise ValueError(f"w4a4_operand: {err}") from None
    if not isinstance(rows, int) or not batch <= rows <= 64:
        raise ValueError(f"w4a4_operand: expected rows an int in {batch}..64 (the GEMM's token "
                         f"tile for B = {batch}), got {rows!r}")
    if k % 128:
        raise ValueError(f"w4a4_operand: the Mosaic operand needs NH * D % 128 == 0, got {k}")
    return lay, sc, rows


def _partials_shape(rows: int, slack: int, d: int):
    """The chunks' (acc fp32 [rows + slack, D], m, l fp32 [rows + slack]): ``slack`` (gp - g)
    rows keep the last program's masked rows inside the buffers."""
    return (jax.ShapeDtypeStruct((rows + slack, d), jnp.float32),
            jax.ShapeDtypeStruct((rows + slack,), jnp.float32),
            jax.ShapeDtypeStruct((rows + slack,), jnp.float32))


def _attend(qp, k_flat, v_flat, meta, *, n_layers: int, batch: int, capacity: int,
            kv_heads: int, d: int, g: int, gp: int, interpret: bool) -> jax.Array:
    """The attention kernel and its combine on a laid-out q (``[B * KVH * gp, D]``, each kv
    head's g query heads then zero rows), the flattened caches and (layer, lengths):
    bf16 [B * NH, D]."""
    chunk = chunking(batch, kv_heads, capacity)
    splits = cdiv(capacity, chunk)
    kernel = functools.partial(_kernel, n_layers=n_layers, batch=batch, capacity=capacity,
                               kv_heads=kv_heads, d=d, g=g, gp=gp, chunk=chunk,
                               scale=1.0 / math.sqrt(d))
    acc, m, l = pl.pallas_call(
        kernel, out_shape=_partials_shape(batch * kv_heads * splits * g, gp - g, d),
        grid=(batch * kv_heads, splits), interpret=interpret, name="nvfp4_decode_attention",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    )(qp, k_flat, v_flat, meta)
    return _combine(acc, m, l, batch=batch, kv_heads=kv_heads, splits=splits, d=d, g=g,
                    interpret=interpret)


def _combine(acc, m, l, *, batch: int, kv_heads: int, splits: int, d: int, g: int,
             interpret: bool, operand: tuple | None = None) -> jax.Array:
    """The chunks' partials -> bf16 [B * NH, D]; with ``operand`` = (layer int32 [1], input
    scales fp32 [L'], rows) the next W4A4 linear's Mosaic operand instead, bf16 [rows, NH * D]
    (``_combine_kernel``)."""
    extra, out = (), jax.ShapeDtypeStruct((batch * kv_heads * g, d), jnp.bfloat16)
    spec = None
    if operand is not None:
        lay, scales, n_tile = operand
        extra = (lay, scales)
        out = jax.ShapeDtypeStruct((n_tile, kv_heads * g * d), jnp.bfloat16)
        spec = (batch, kv_heads, n_tile, scales.shape[0])
    combine = functools.partial(_combine_kernel, splits=splits, g=g, d=d,
                                n_rows=batch * kv_heads * splits * g, operand=spec,
                                exact_asm=not interpret)
    return pl.pallas_call(
        combine, out_shape=out, grid=(batch * kv_heads * g,), interpret=interpret,
        name="nvfp4_decode_attention_combine" + ("_operand" if spec else ""),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(acc, m, l, *extra)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int,
                     lengths: jax.Array, *, interpret: bool = False) -> jax.Array:
    """One query token per sequence against layer ``layer`` of a stacked KV cache, in place.

    q: bf16 [B, NH, D] (after RoPE); k_cache, v_cache: bf16 [L, B, S, KVH, D] (the new token's
    k and v already written); layer: int32 scalar; lengths: int32 [B], the number of valid
    positions per sequence (keys ``0 .. lengths[b] - 1`` are attended, 1 <= lengths[b] <= S;
    slots past it are never read). Concrete values outside those ranges, or a concrete
    ``layer`` outside ``0 .. L - 1``, raise ValueError; traced ones never read outside the
    stack: a length past S attends the S slots, a length <= 0 gives NaN for its sequence, a
    layer outside the stack reads its nearest layer.
    Query head ``i`` reads kv head ``i // (NH / KVH)`` (GQA).
    Returns bf16 [B, NH, D] = softmax(q k^T / sqrt(D)) v.
    """
    lengths = jnp.asarray(lengths)
    _check(q, k_cache, v_cache, layer, lengths)
    b, nh, d = q.shape
    n_layers, _, s, kvh, _ = k_cache.shape
    why = supported(d, nh, kvh)
    if why:
        raise ValueError(f"q: {why}")
    g = nh // kvh
    gp = max(16, pow2(g))  # an MMA's M: the group's rows, zero-padded
    qp = jnp.pad(q.reshape(b * kvh, g, d), ((0, 0), (0, gp - g), (0, 0))).reshape(-1, d)
    meta = jnp.concatenate([jnp.asarray(layer, jnp.int32).reshape(1),
                            lengths.astype(jnp.int32)])
    flat = (n_layers * b * s, kvh * d)
    o = _attend(qp, k_cache.reshape(flat), v_cache.reshape(flat), meta, n_layers=n_layers,
                batch=b, capacity=s, kv_heads=kvh, d=d, g=g, gp=gp, interpret=interpret)
    return o.reshape(b, nh, d)

