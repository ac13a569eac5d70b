"""A compact decoder-only transformer over NVFP4 linears: Llama-style dense and Qwen3-MoE.

One forward covers both families (:class:`DecoderConfig` says which parts a layer has):
token embedding (bf16) -> per layer [RMSNorm -> GQA attention (q/k RMSNorm for Qwen3, RoPE,
bf16 q/k/v with fp32 scores and softmax) -> residual -> RMSNorm -> MLP (SwiGLU on three NVFP4
linears) or MoE (``nvfp4_jax.nn.moe_block``) -> residual] -> RMSNorm -> LM head (bf16, or NVFP4
when the checkpoint quantized it) -> fp32 logits.

Weights stay NVFP4 (``nvfp4_jax.nn.Linear``, ``nvfp4_jax.nn.MoE``); embeddings, norms and
attention are bf16. The KV cache is bf16 ``[L, B, S_max, KVH, D]``; a decode step's attention
reads it in place with ``nvfp4_jax.attention.decode_attention`` where
``attention.runs_kernel`` says so (GPUs, and ``backend="pallas"``), else XLA's einsums on the
layer's slice. Layers of one structure
are stacked and run under one ``lax.while_loop`` over the layer index (one compiled layer body
for all 48 layers of a Qwen3-30B-A3B), otherwise unrolled.

Entry points: :func:`prefill` (prompt [B, T] -> logits, cache), :func:`decode_step` (one token
per sequence), :func:`sample`, :func:`generate` (jitted prefill and decode step, greedy or
temperature sampling, timings).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import nn
from ..attention import cache_attention, decode_qkv_attention, runs_kernel
from ..device import pallas_interpret
from ..moe.xla import add_residual
from ..quantize import NVFP4Array


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a Llama-style or Qwen3(-MoE) decoder (HF config.json names in brackets).

    ``moe_layers``: indices of the layers whose MLP is a routed MoE (empty for dense models).
    ``rope_scaling``: None or a dict with ``rope_type`` "default" or "llama3" (HF semantics).
    ``sliding_window``: None, or the attention window W config.json makes active
    (``checks.sliding_window``: a query attends to the W latest positions). The decoders
    attend to every cached position, which is the windowed attention while a sequence holds at
    most W positions: ``init_cache`` refuses a longer cache and ``generate`` a longer sequence.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int                # [num_hidden_layers]
    num_heads: int                 # [num_attention_heads]
    num_kv_heads: int              # [num_key_value_heads]
    head_dim: int
    intermediate_size: int = 0     # dense MLP width
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    qk_norm: bool = False          # Qwen3: RMSNorm over head_dim on q and k before RoPE
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None

    def __post_init__(self):
        def bad(name: str, want: str):
            return ValueError(f"DecoderConfig.{name}: expected {want}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        for name in ("intermediate_size", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "an integer >= 0")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise bad(name, "a finite number > 0")
        if self.sliding_window is not None and (not is_int(self.sliding_window)
                                                or self.sliding_window < 1):
            raise bad("sliding_window", "None or an integer >= 1")
        if not all(is_int(i) and 0 <= i < self.num_layers for i in self.moe_layers):
            raise bad("moe_layers", f"layer indices in [0, {self.num_layers})")
        if self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", f"at most num_experts ({self.num_experts})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.moe_layers and not (self.num_experts and self.num_experts_per_tok):
            raise ValueError("moe_layers: a MoE layer needs num_experts and num_experts_per_tok")


# --------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------

def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """float32 [head_dim/2] inverse frequencies (HF ``default`` or ``llama3`` rope)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv.astype(np.float32)
    if kind != "llama3":
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, llama3)")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(pos: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) fp32 [B, T, D] of positions ``pos`` int32 [B, T], rounded to bf16 (HF's
    rotary embedding in the activations' dtype): computed once per forward, for every layer."""
    ang = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([ang, ang], axis=-1)
    cos = jnp.cos(emb).astype(jnp.bfloat16).astype(jnp.float32)
    sin = jnp.sin(emb).astype(jnp.bfloat16).astype(jnp.float32)
    return cos, sin


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE: x bf16 [B, T, heads, D], ``rope`` = :func:`rope_tables` -> bf16 (fp32
    arithmetic)."""
    cos, sin = (t[:, :, None, :] for t in rope)
    xf = x.astype(jnp.float32)
    h = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., h:], xf[..., :h]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


# --------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------

def attention(cfg: DecoderConfig, p: dict, x: jax.Array, pos: jax.Array, k_all: jax.Array,
              v_all: jax.Array, li, start: jax.Array, rope: tuple | None, backend: str,
              w4a4: bool, ablate: frozenset = frozenset(), qkv: jax.Array | None = None,
              o_proj=None, qk_norms: tuple | None = None, norm_layer=None,
              o_operand: tuple | None = None):
    """GQA attention of one layer. x bf16 [B, T, H] at positions ``pos`` int32 [B, T]
    (start..start+T-1); caches bf16 [L, B, S, KVH, D], this layer's index ``li``; ``cfg``:
    any config with num_heads, num_kv_heads, head_dim, qk_norm, rms_norm_eps. ``rope``:
    :func:`rope_tables` of ``pos``, or None for attention without RoPE (Nemotron-H). Returns
    (out bf16 [B, T, H], k_all, v_all), the caches updated in place. ``qkv``: None, or the
    fused q/k/v projection already made from the layer's input (x is then unused);
    ``o_proj``: None, or the callable ``o -> o_proj(o)`` to use; ``qk_norms``: None, or
    inside a scan the (q_norm, k_norm) stacks bf16 [n, D] of the scanned group, with this
    layer's row ``norm_layer``, which the decode kernel reads in place. ``o_operand``: None,
    or ((input_scale, layer, rows), linear) where o_proj is a W4A4 Mosaic GEMM: the decode
    kernel's last launch then writes its operand (``decode_qkv_attention(w4a4_operand=)``)
    and ``linear(operand)`` is the projection (``nn.linear_on_operand``).

    A decode step (T = 1) where ``attention.runs_kernel`` says so runs
    ``attention.decode_qkv_attention`` on the q/k/v projection: two launches from it to the
    attention output (q/k norms, RoPE, the cache writes and the attention's chunks, then
    their combine)."""
    b, t = (x if qkv is None else qkv).shape[:2]
    nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lin = _linear_or_stub(ablate, backend, w4a4)
    out_proj = o_proj or (lambda o: lin(p["o_proj"], o))
    if qkv is not None:
        pass
    elif "qkv_proj" in p:  # one GEMM (fuse_projections)
        qkv = lin(p["qkv_proj"], x)
    else:
        qkv = jnp.concatenate([lin(p[n], x) for n in ("q_proj", "k_proj", "v_proj")], axis=-1)
    if t == 1 and "attention" not in ablate and runs_kernel(backend, d, nh, kvh):
        norms = (None, None, None)
        if cfg.qk_norm:
            norms = ((p["q_norm"], p["k_norm"], None) if qk_norms is None
                     else (*qk_norms, norm_layer))
        o, k_all, v_all = decode_qkv_attention(
            qkv[:, 0], k_all, v_all, li, start, num_heads=nh, q_norm=norms[0],
            k_norm=norms[1], norm_layer=norms[2], eps=cfg.rms_norm_eps,
            rope=None if rope is None else (rope[0][:, 0], rope[1][:, 0]),
            w4a4_operand=None if o_operand is None else o_operand[0],
            interpret=pallas_interpret())
        if o_operand is not None:  # o is o_proj's operand
            return o_operand[1](o).reshape(b, 1, -1), k_all, v_all
        return out_proj(o.reshape(b, 1, nh * d)), k_all, v_all
    q, k, v = jnp.split(qkv, [nh * d, (nh + kvh) * d], axis=-1)
    q = q.reshape(b, t, nh, d)
    k = k.reshape(b, t, kvh, d)
    v = v.reshape(b, t, kvh, d)
    if cfg.qk_norm:
        q = nn.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = nn.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    if rope is not None:
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
    if "attention" in ablate:  # no RoPE, cache or attention core: q + k + v stand in
        o = (q + jnp.repeat(k + v, nh // kvh, axis=2)).reshape(b, t, nh * d)
        return out_proj(o), k_all, v_all
    zero = jnp.zeros((), jnp.int32)
    at = (jnp.asarray(li, jnp.int32), zero, start, zero, zero)
    k_all = jax.lax.dynamic_update_slice(k_all, k[None], at)
    v_all = jax.lax.dynamic_update_slice(v_all, v[None], at)
    kc = jax.lax.dynamic_index_in_dim(k_all, li, axis=0, keepdims=False)
    vc = jax.lax.dynamic_index_in_dim(v_all, li, axis=0, keepdims=False)
    o = cache_attention(q, kc, vc, pos).reshape(b, t, nh * d)
    return out_proj(o), k_all, v_all


def _linear_or_stub(ablate: frozenset, backend: str, w4a4: bool):
    """``nn.linear``, or with "dense" in ``ablate`` a stand-in of the same output shape that
    reads no weight (x tiled to N columns), for time breakdowns."""
    if "dense" not in ablate:  # a callable p: a parallel share (models.sharding)
        return lambda p, x: (p(x, backend=backend, w4a4=w4a4) if callable(p)
                             else nn.linear(p, x, backend=backend, w4a4=w4a4))

    def stub(p, x):
        n = p.shape[0] if isinstance(p, nn.Linear) else p.shape[-2]
        reps = -(-n // x.shape[-1])
        return jnp.tile(x, (1,) * (x.ndim - 1) + (reps,))[..., :n]

    return stub


def _mlp(p: dict, x: jax.Array, backend: str, w4a4: bool,
         ablate: frozenset = frozenset()) -> jax.Array:
    """SwiGLU MLP on three NVFP4 linears: x bf16 [..., H] -> bf16 [..., H]."""
    lin = _linear_or_stub(ablate, backend, w4a4)
    if "gate_up_proj" in p:  # one GEMM (fuse_projections)
        gate, up = jnp.split(lin(p["gate_up_proj"], x).astype(jnp.float32), 2, axis=-1)
    else:
        gate = lin(p["gate_proj"], x).astype(jnp.float32)
        up = lin(p["up_proj"], x).astype(jnp.float32)
    h = (jax.nn.silu(gate).astype(jnp.bfloat16).astype(jnp.float32) * up).astype(jnp.bfloat16)
    return lin(p["down_proj"], h)


#: (block, linear, norm before it): the linears whose stacked norm weights and input scales a
#: scanned layer hands to ``nn.norm_linear`` (in place on the Mosaic W4A4 decode path)
PROLOGUE_LINEARS = (("self_attn", "qkv_proj", "input_layernorm"), ("self_attn", "o_proj", None),
                    ("mlp", "gate_up_proj", "post_attention_layernorm"), ("mlp", "down_proj", None))


def prologue_stacks(g: dict) -> dict | None:
    """Of a group of stacked layers: {(block, linear): (norm stack bf16 [n, H] or None, input
    scale stack fp32 [n])} for :data:`PROLOGUE_LINEARS` that are W4A4 ``nn.Linear``s; None if
    there are none."""
    out = {}
    for block, name, norm in PROLOGUE_LINEARS:
        lin = g.get(block, {}).get(name)
        if isinstance(lin, nn.Linear) and lin.input_scale is not None:
            out[(block, name)] = (None if norm is None else g[norm], lin.input_scale)
    return out or None


def _layer(cfg, p, x, pos, k_all, v_all, li, start, rope, backend, w4a4, ablate,
           stacks=None, gl=None, qk_norms=None, moe_norm=None):
    """One decoder layer. ``stacks``: None, or :func:`prologue_stacks` of the scanned group
    and ``gl`` this layer's index in it: its W4A4 linears then go through ``nn.norm_linear``
    on the stacks (their norm before them). ``qk_norms``: None, or the group's (q_norm,
    k_norm) stacks, which the decode attention kernel reads at ``gl``. ``moe_norm``: None, or
    the group's (post_attention_layernorm, router) stacks, which ``nn.add_norm_router`` reads at
    ``gl``."""
    eps = cfg.rms_norm_eps
    sa = p["self_attn"]
    stacks = stacks if stacks and "dense" not in ablate else {}

    def pro(block, name, v, norm_weight=None):
        st = stacks.get((block, name))
        if st is None:
            h = v if norm_weight is None else nn.rms_norm(v, norm_weight, eps)
            return _linear_or_stub(ablate, backend, w4a4)(p[block][name], h)
        return nn.norm_linear(p[block][name], v, st[0], eps, backend=backend, w4a4=w4a4,
                              layer=gl, input_scales=st[1])

    if ("self_attn", "qkv_proj") in stacks:
        qkv = pro("self_attn", "qkv_proj", x, p["input_layernorm"])
        o_operand = None
        st = stacks.get(("self_attn", "o_proj"))
        rows = None if st is None or x.shape[1] != 1 else nn.w4a4_operand_rows(
            sa["o_proj"], x.shape[0], backend=backend, w4a4=w4a4)
        if rows is not None:  # the attention's last launch makes o_proj's operand
            o_operand = ((st[1], gl, rows), lambda xp: nn.linear_on_operand(
                sa["o_proj"], xp, x.shape[0], layer=gl, input_scales=st[1]))
        a, k_all, v_all = attention(cfg, sa, None, pos, k_all, v_all, li, start, rope,
                                    backend, w4a4, ablate, qkv=qkv,
                                    o_proj=lambda o: pro("self_attn", "o_proj", o),
                                    qk_norms=qk_norms, norm_layer=gl, o_operand=o_operand)
    else:
        h = nn.rms_norm(x, p["input_layernorm"], eps)
        a, k_all, v_all = attention(cfg, sa, h, pos, k_all, v_all, li, start, rope,
                                    backend, w4a4, ablate, qk_norms=qk_norms, norm_layer=gl)
    mp = p.get("moe")
    if isinstance(mp, nn.MoE) and "moe" not in ablate:
        # the residual add, the MoE's input norm and its router logits: one launch at decode
        # (nn.add_norm_router)
        b, t, hd = x.shape
        norm, router, row = ((p["post_attention_layernorm"], mp.router, None) if moe_norm is None
                             else (*moe_norm, gl))
        x, h, logits = nn.add_norm_router(x, a, norm, router, eps, layer=row, backend=backend)
        # x + the MoE's output: added in the MoE's last launch on the Mosaic path
        out = nn.moe_block(mp, h.reshape(b * t, hd), backend=backend,
                           logits=logits.reshape(b * t, -1), residual=x.reshape(b * t, hd))
        return out.reshape(b, t, hd), k_all, v_all
    # the two bf16 arrays' add, as add_norm_router and HF have it (XLA may otherwise fuse the
    # add with a's producer and add the fp32 value a was rounded from)
    x = add_residual(x, a)
    if ("mlp", "gate_up_proj") in stacks and ("mlp", "down_proj") in stacks:
        gate, up = jnp.split(pro("mlp", "gate_up_proj", x, p["post_attention_layernorm"])
                             .astype(jnp.float32), 2, axis=-1)
        hm = (jax.nn.silu(gate).astype(jnp.bfloat16).astype(jnp.float32) * up).astype(jnp.bfloat16)
        return x + pro("mlp", "down_proj", hm), k_all, v_all
    h = nn.rms_norm(x, p["post_attention_layernorm"], eps)
    if "moe" in p:
        if "moe" in ablate:
            m = h
        else:
            b, t, hd = h.shape
            mp, x2 = p["moe"], h.reshape(b * t, hd)
            if callable(mp):  # expert-parallel (models.sharding): the add as moe(residual=)'s
                out = add_residual(x.reshape(b * t, hd), mp(x2, backend=backend))
                return out.reshape(b, t, hd), k_all, v_all
            m = nn.moe_block(mp, x2, backend=backend).reshape(b, t, hd)
    else:
        m = _mlp(p["mlp"], h, backend, w4a4, ablate)
    return x + m, k_all, v_all


#: (block, fused name, projections) that read the same input and can run as one GEMM
FUSIBLE = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def _concrete(a) -> np.ndarray | None:
    try:
        return np.asarray(a)
    except jax.errors.TracerArrayConversionError:  # traced: no value to compare
        return None


def _same_scalar(values) -> bool:
    arrs = [_concrete(v) for v in values]
    return all(a is not None for a in arrs) and all(np.array_equal(a, arrs[0]) for a in arrs)


def concat_linears(parts: list) -> nn.Linear | jax.Array | None:
    """Linears [N_i, K] on the same input as one linear [sum N_i, K], or None where that would
    change the numerics.

    NVFP4 linears (``nn.Linear``) concatenate (codes and block scales along N) only when their
    ``decode_scale`` (weight_scale_2) and ``input_scale`` agree: then every output column is
    computed with the same operands, block scales and alpha as by its own GEMM (the fp32
    summation order may differ where the kernel's split-K differs with N; both are within
    ``oracle.gemm_error_bound``). ModelOpt's HF export gives q/k/v and gate/up one shared
    weight_scale_2 and input_scale for exactly this fusion. bf16 weights always concatenate.
    """
    if all(isinstance(p, nn.Linear) for p in parts):
        ws = [p.w for p in parts]
        if any(w.layout != "linear" or len(w.shape) != 2 for w in ws):
            return None
        if not _same_scalar([w.decode_scale for w in ws]):
            return None
        scales = [p.input_scale for p in parts]
        if any(s is None for s in scales) and not all(s is None for s in scales):
            return None
        if scales[0] is not None and not _same_scalar(scales):
            return None
        k = ws[0].shape[1]
        if any(w.shape[1] != k for w in ws):
            return None
        w = NVFP4Array.from_parts(jnp.concatenate([w.codes for w in ws]),
                                  jnp.concatenate([w.scales for w in ws]), ws[0].decode_scale,
                                  layout="linear", shape=(sum(w.shape[0] for w in ws), k))
        return nn.Linear(w, parts[0].input_scale)
    if all(isinstance(p, jax.Array) and p.ndim == 2 for p in parts):
        return jnp.concatenate(parts)
    return None


def fuse_projections(layer: dict) -> dict:
    """A layer dict with q/k/v (and gate/up) replaced by one ``qkv_proj`` (``gate_up_proj``)
    where :func:`concat_linears` allows it; otherwise the layer unchanged. One GEMM launch
    instead of three (two) per token: at decode the calls are launch-bound, not byte-bound."""
    out = dict(layer)
    for block, fused, names in FUSIBLE:
        p = layer.get(block)
        if not isinstance(p, dict) or not all(n in p for n in names):
            continue
        w = concat_linears([p[n] for n in names])
        if w is None:
            continue
        out[block] = {**{k: v for k, v in p.items() if k not in names}, fused: w}
    return out


def _split_rows(p, sizes: list[int]) -> list:
    """A linear [..., sum(sizes), K] (nn.Linear or bf16; stacked layers keep their leading
    axis) sliced along N into linears of ``sizes`` rows: exact (codes and block scales are
    sliced, the shared scales kept)."""
    offs = np.cumsum([0, *sizes])
    out = []
    for a, b in zip(offs[:-1], offs[1:]):
        if isinstance(p, nn.Linear):
            w = p.w
            part = NVFP4Array(w.codes[..., a:b, :], w.scales[..., a:b, :], w.decode_scale,
                              (int(b - a), w.shape[-1]), w.layout)
            out.append(nn.Linear(part, p.input_scale))
        else:
            out.append(p[..., a:b, :])
    return out


def unfuse_projections(layer: dict, cfg: DecoderConfig) -> dict:
    """The inverse of :func:`fuse_projections`: ``qkv_proj`` / ``gate_up_proj`` back into
    q/k/v (heads nh, kvh, kvh of head_dim) and gate/up (I rows each), exactly; a layer
    without fused projections is returned unchanged. Stacked layer groups work too."""
    out = dict(layer)
    d = cfg.head_dim
    sizes = {"qkv_proj": [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]}
    for block, fused, names in FUSIBLE:
        p = layer.get(block)
        if not isinstance(p, dict) or fused not in p:
            continue
        rows = sizes.get(fused)
        if rows is None:  # gate/up: two halves
            n = p[fused].shape[-2]
            rows = [n // 2, n // 2]
        parts = _split_rows(p[fused], rows)
        out[block] = {**{k: v for k, v in p.items() if k != fused}, **dict(zip(names, parts))}
    return out


def stack_trees(trees: list, *, consume: bool = False):
    """Trees of one structure -> one tree whose leaves are ``jnp.stack`` of theirs (a leading
    axis). ``consume``: the caller gives the trees up; each leaf's source arrays are deleted
    once its stack exists, so stacking holds one leaf's stack on top of the trees at a time
    instead of all of them (arrays that appear more than once are kept)."""
    cols = list(zip(*(jax.tree_util.tree_leaves(t) for t in trees)))
    seen = collections.Counter(id(a) for col in cols for a in col)
    out = []
    for col in cols:
        out.append(jnp.stack(col))
        if consume:
            for a in col:
                if isinstance(a, jax.Array) and seen[id(a)] == 1 and not a.is_deleted():
                    a.delete()  # freed once the stack has read it
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(trees[0]), out)


def stack_layers(layers: list[dict], *, consume: bool = False) -> list[tuple[str, Any]]:
    """Group consecutive layers of one pytree structure: ``[("scan", stacked) | ("one", p)]``.

    Stacked leaves gain a leading layer axis; NVFP4Array metadata (logical shape) stays that of
    one layer, so the layer loop's slice at an index is a valid per-layer array. ``consume``: see
    :func:`stack_trees` (the stacked layers' arrays are deleted as they are stacked).
    """
    groups: list[list[dict]] = []
    for p in layers:
        same = groups and (jax.tree_util.tree_structure(groups[-1][0])
                           == jax.tree_util.tree_structure(p))
        if same:
            groups[-1].append(p)
        else:
            groups.append([p])
    out = []
    for g in groups:
        if len(g) == 1:
            out.append(("one", g[0]))
        else:
            out.append(("scan", stack_trees(g, consume=consume)))
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
    """Parameters (a pytree) and static configuration of a decoder.

    embed: bf16 [V, H]; groups: ``stack_layers`` output (layer dicts: ``input_layernorm``,
    ``post_attention_layernorm`` bf16 [H]; ``self_attn`` {q,k,v,o}_proj ``nn.Linear`` (or
    ``qkv_proj`` [(NH + 2 KVH) * D, H] and o_proj, :func:`fuse_projections`) and, for qk_norm,
    ``q_norm``/``k_norm`` bf16 [D]; ``mlp`` {gate,up,down}_proj ``nn.Linear`` (or
    ``gate_up_proj`` [2I, H] and down_proj) or ``moe`` ``nn.MoE``); norm: bf16 [H]; lm_head:
    bf16 [V, H] or ``nn.Linear``.
    """

    embed: jax.Array
    groups: list
    norm: jax.Array
    lm_head: Any
    config: DecoderConfig = dataclasses.field(metadata={"static": True})
    group_kinds: tuple = dataclasses.field(default=(), metadata={"static": True})

    @staticmethod
    def build(config: DecoderConfig, embed, layers: list[dict], norm, lm_head, *,
              stack: bool = True, fuse: bool = True, consume: bool = False) -> Model:
        """A Model from per-layer dicts: stacked for the layer loop where consecutive layers
        share a structure (``stack``), else one unrolled layer each (separate weight buffers,
        longer compiles). ``fuse``: q/k/v and gate/up as one linear each where their scales
        agree (:func:`fuse_projections`). ``consume``: ``layers`` are given up, their arrays
        deleted as they are stacked (:func:`stack_trees`; how ``load_model`` bounds memory)."""
        if fuse:
            layers = [fuse_projections(p) for p in layers]
        groups = (stack_layers(layers, consume=consume) if stack
                  else [("one", p) for p in layers])
        return Model(embed, [g for _, g in groups], norm, lm_head, config,
                     tuple(k for k, _ in groups))

    def unstacked(self) -> Model:
        """The same model with every layer unrolled (stacked groups sliced apart)."""
        layers = []
        for kind, g in zip(self.group_kinds, self.groups):
            if kind == "one":
                layers.append(g)
            else:
                n = jax.tree_util.tree_leaves(g)[0].shape[0]
                layers += [jax.tree_util.tree_map(lambda a, i=i: a[i], g) for i in range(n)]
        return Model.build(self.config, self.embed, layers, self.norm, self.lm_head, stack=False,
                           fuse=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """bf16 ``k``, ``v`` [L, B, S_max, KVH, D] and ``length`` int32 [] (tokens written)."""

    k: jax.Array
    v: jax.Array
    length: jax.Array


def init_cache(cfg: DecoderConfig, batch: int, max_len: int) -> KVCache:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens (for a config with
    its own cache, e.g. ``models.NemotronHConfig``: ``cfg.init_cache(batch, max_len)``)."""
    if not isinstance(cfg, DecoderConfig) and hasattr(cfg, "init_cache"):
        return cfg.init_cache(batch, max_len)
    if cfg.sliding_window is not None and max_len > cfg.sliding_window:
        raise ValueError(f"max_len: {max_len} positions exceed config.json's sliding_window "
                         f"({cfg.sliding_window}): the decoder attends to every cached "
                         f"position, the windowed attention only for sequences of at most "
                         f"{cfg.sliding_window}")
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16),
                   jnp.zeros((), jnp.int32))


def forward(model: Model, tokens: jax.Array, cache: KVCache, *, backend: str = "auto",
            w4a4: bool = True, ablate: frozenset = frozenset()) -> tuple[jax.Array, KVCache]:
    """tokens int32 [B, T] at positions ``cache.length ..`` -> (fp32 logits [B, T, V], cache).

    ``model``: a :class:`Model`, a ``models.ShardedModel`` (``models.shard_model``: the
    same forward on each device of a mesh axis, logits sharded on V), or a
    ``models.NemotronHModel`` (its own ``forward``, with a ``models.HybridCache``).

    ``w4a4=False`` runs every dense linear W4A16 even where the checkpoint has an
    ``input_scale`` (the MoE experts always quantize their activations). ``ablate`` (for time
    breakdowns only; the output is then meaningless): parts left out, any of "attention" (RoPE,
    KV cache and attention core), "moe" (router and experts), "dense" (the NVFP4 linears of
    attention and dense MLPs, replaced by weight-free stand-ins of the same shapes).

    A cache with fewer than T free positions: ValueError when T exceeds its capacity, else
    (``cache.length`` is traced) every logit of the step is NaN. A token id outside
    [0, vocab_size) gives NaN logits from its position on in its sequence
    (:func:`embed_tokens`); the batch's other sequences are unaffected.
    """
    bad = set(ablate) - {"attention", "moe", "dense"}
    if bad:
        raise ValueError(f"ablate: unknown parts {sorted(bad)}; expected attention, moe, dense")
    check_tokens(tokens)
    check_model(model)
    if not isinstance(model, Model):  # ShardedModel (one shard_map of this), NemotronHModel
        return model.forward(tokens, cache, backend=backend, w4a4=w4a4, ablate=ablate)
    cfg = model.config
    b, t = tokens.shape
    check_cache_room(t, cache.k.shape[2])
    start = cache.length
    pos = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    rope = rope_tables(pos, jnp.asarray(rope_inv_freq(cfg)))
    x = embed_tokens(model.embed, tokens)
    k_all, v_all = cache.k, cache.v
    li = 0
    for kind, g in zip(model.group_kinds, model.groups):
        if kind == "one":
            x, k_all, v_all = _layer(cfg, g, x, pos, k_all, v_all, li, start, rope,
                                     backend, w4a4, ablate)
            li += 1
        else:
            n = jax.tree_util.tree_leaves(g)[0].shape[0]

            def body(x, k_all, v_all, p, i, stacks=None, pro=None, qk=None, mn=None, ms=None,
                     li=li):
                if stacks is not None:
                    p = nn.join_stacks(p, stacks, i - li)
                if ms is not None:  # the MoE's scale launch reads the scale stacks in place
                    p = {**p, "moe": dataclasses.replace(p["moe"], stacks=ms, layer=i - li)}
                return _layer(cfg, p, x, pos, k_all, v_all, i, start, rope, backend, w4a4,
                              ablate, stacks=pro, gl=i - li, qk_norms=qk, moe_norm=mn)

            lin, moe = (nn.stacks_read_in_place(backend, kind) for kind in ("linear", "moe"))
            # the W4A4 linears' norm weights and input scales, read in place at decode
            body = functools.partial(body, pro=prologue_stacks(g) if w4a4 else None)
            if cfg.qk_norm:  # the decode attention kernel reads them in place
                body = functools.partial(body, qk=(g["self_attn"]["q_norm"],
                                                   g["self_attn"]["k_norm"]))
            if isinstance(g.get("moe"), nn.MoE):  # nn.add_norm_router reads them in place
                body = functools.partial(body, mn=(g["post_attention_layernorm"], g["moe"].router))
            if lin or moe:  # those kernels read the stacks in place; the rest keep slices
                body = functools.partial(body, stacks=nn.weight_stacks(g))
                g = nn.strip_stacks(g, linears=lin, moe=moe)
            elif isinstance(g.get("moe"), nn.MoE):  # the MoE's weights stay the loop's slices
                body = functools.partial(body, ms=nn.moe_stacks(g["moe"]))
            # a while loop over the layer index (a lax.scan over (layers, indices) slices the
            # index too: one more launch a layer); its trip count is static, as a scan's
            def step(c, g=g, body=body, li=li):
                i, x, k_all, v_all = c
                p = jax.tree_util.tree_map(
                    lambda a: jax.lax.dynamic_index_in_dim(a, i - li, keepdims=False), g)
                return (i + 1, *body(x, k_all, v_all, p, i))

            _, x, k_all, v_all = jax.lax.while_loop(lambda c, end=li + n: c[0] < end, step,
                                                    (jnp.int32(li), x, k_all, v_all))
            li += n
    x = nn.rms_norm(past_cache_nan(x, start + t, k_all.shape[2]), model.norm, cfg.rms_norm_eps)
    if isinstance(model.lm_head, nn.Linear):
        logits = nn.linear(model.lm_head, x, backend=backend, w4a4=w4a4).astype(jnp.float32)
    else:
        logits = jax.lax.dot_general(x, model.lm_head, (((2,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
        logits = logits.astype(jnp.bfloat16).astype(jnp.float32)
    return logits, KVCache(k_all, v_all, start + t)


def check_cache_room(t: int, capacity: int) -> None:
    """ValueError when ``t`` new tokens cannot fit a cache of ``capacity`` positions at all."""
    if t > capacity:
        raise ValueError(f"tokens: {t} tokens do not fit the cache's {capacity} positions "
                         f"(models.init_cache(config, batch, max_len) with max_len >= {t})")


def check_model(model) -> None:
    """ValueError naming ``model`` unless it is a :class:`Model` or has its own ``forward`` (a
    ``models.ShardedModel``, a ``NemotronHModel``)."""
    if not isinstance(model, Model) and not callable(getattr(model, "forward", None)):
        raise ValueError(f"model: expected a models.Model or models.ShardedModel (or a "
                         f"NemotronHModel), got {type(model).__name__}")


def check_tokens(tokens) -> None:
    """ValueError naming ``tokens`` unless it is an integer array [B, T]."""
    if not (hasattr(tokens, "dtype") and hasattr(tokens, "shape")) or len(tokens.shape) != 2 \
            or not jnp.issubdtype(tokens.dtype, jnp.integer):
        what = (f"{tokens.dtype} {tuple(tokens.shape)}" if hasattr(tokens, "shape")
                else type(tokens).__name__)
        raise ValueError(f"tokens: expected int token ids [B, T], got {what}")


def embed_tokens(embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """The rows of ``embed`` [V, H] for int ``tokens`` [B, T]: bf16 [B, T, H], a row of NaN for
    an id outside [0, V) (traced ids cannot raise, and a clamped or wrapped lookup would embed
    another token); the layers carry it into the logits of that position and the later ones
    of its sequence (and, where an attention multiplies masked-out keys' values by zero, the
    earlier ones), never into another sequence's."""
    v = embed.shape[0]
    ok = (tokens >= 0) & (tokens < v)
    x = embed[jnp.clip(tokens, 0, v - 1)]
    return jnp.where(ok[..., None], x, jnp.asarray(jnp.nan, x.dtype))


def past_cache_nan(x: jax.Array, end: jax.Array, capacity: int) -> jax.Array:
    """The last hidden state ``x``, or all NaN when the step ran past the cache (``end`` =
    cache.length + T > capacity: a traced length cannot raise; its keys and values were not
    stored); the final norm and the LM head carry the NaN into every logit. On x [B, T, H], not
    the logits [B, T, V]: the select fuses with the residual add before the norm."""
    return jnp.where(end <= capacity, x, jnp.asarray(jnp.nan, x.dtype))


def _prefill(model, tokens, cache, backend="auto", w4a4=True, all_logits=False,
             ablate=frozenset()):
    logits, cache = forward(model, tokens, cache, backend=backend, w4a4=w4a4, ablate=ablate)
    return (logits if all_logits else logits[:, -1]), cache


def _decode(model, token, cache, backend="auto", w4a4=True, ablate=frozenset()):
    logits, cache = forward(model, token[:, None], cache, backend=backend, w4a4=w4a4,
                            ablate=ablate)
    return logits[:, 0], cache


#: jitted ``(model, tokens [B, T], cache) -> (logits [B, V] or [B, T, V], cache)``
prefill = jax.jit(_prefill, static_argnames=("backend", "w4a4", "all_logits", "ablate"),
                  donate_argnames=("cache",))
#: jitted ``(model, token [B], cache) -> (logits [B, V], cache)``
decode_step = jax.jit(_decode, static_argnames=("backend", "w4a4", "ablate"),
                      donate_argnames=("cache",))


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming ``temperature`` (finite, >= 0), ``top_k`` (an integer >= 0) or
    ``top_p`` (in (0, 1]) when out of range."""
    def real(v) -> float:
        try:
            return math.nan if isinstance(v, bool) else float(v)
        except (TypeError, ValueError):
            return math.nan

    t, p = real(temperature), real(top_p)
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k: expected an integer >= 0 (0: off), got {top_k!r}")
    if not 0 < p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1] (1: off), got {top_p!r}")


def filter_logits(scores: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """fp32 scores [B, V] (logits / temperature) with the tokens top-k and then top-p sampling
    leave out set to -inf, as transformers' ``TopKLogitsWarper`` and ``TopPLogitsWarper`` do:
    top-k keeps the scores >= the k-th largest (ties with it included); top-p sorts the kept
    scores ascending and drops those whose cumulative softmax is <= 1 - top_p, always keeping
    the largest. ``top_k`` 0 and ``top_p`` 1 leave the scores as they are."""
    neg = jnp.asarray(-jnp.inf, scores.dtype)
    if top_k and top_k < scores.shape[-1]:
        kth = jax.lax.top_k(scores, top_k)[0][..., -1:]
        scores = jnp.where(scores < kth, neg, scores)
    if top_p < 1:
        order = jnp.argsort(scores, axis=-1)  # ascending
        srt = jnp.take_along_axis(scores, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
        drop = (cum <= 1 - top_p).at[..., -1].set(False)
        drop = jnp.zeros_like(drop).at[jnp.arange(scores.shape[0])[:, None], order].set(drop)
        scores = jnp.where(drop, neg, scores)
    return scores


def sample(logits: jax.Array, key: jax.Array | None, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """fp32 logits [B, V] -> int32 token ids [B]: argmax for ``temperature == 0``, else a draw
    from ``softmax(filter_logits(logits / temperature, top_k, top_p))`` (transformers' order:
    temperature, then top-k, then top-p; ``top_k`` 0 and ``top_p`` 1 turn them off)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("key: temperature sampling needs a jax.random key")
    scores = filter_logits(logits / temperature, top_k, top_p)
    return jax.random.categorical(key, scores, axis=-1).astype(jnp.int32)


_sample = jax.jit(sample, static_argnames=("temperature", "top_k", "top_p"))


@dataclasses.dataclass
class Generation:
    """Output of :func:`generate`: ``tokens`` int32 [B, N] (new tokens only), prefill and decode
    wall times in seconds (compilation excluded when ``warmup``), and token rates."""

    tokens: np.ndarray
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    new_tokens: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.tokens.shape[0] * max(self.new_tokens - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else float("nan")


def _check_generate_args(cfg: DecoderConfig, prompt, max_new_tokens, temperature,
                         top_k: int = 0, top_p: float = 1.0) -> None:
    """ValueError naming the argument of :func:`generate` that is out of range, before any
    allocation: token ids, positions within ``max_position_embeddings``, the temperature."""
    p = np.asarray(prompt)
    if p.dtype.kind not in "iu" or p.ndim != 2 or p.size == 0:
        raise ValueError(f"prompt: expected int token ids [B, T] with B, T >= 1, got {p.dtype} "
                         f"{p.shape}")
    if int(p.max()) >= cfg.vocab_size or int(p.min()) < 0:
        bad = p[(p < 0) | (p >= cfg.vocab_size)]
        raise ValueError(f"prompt: token ids must lie in [0, {cfg.vocab_size}) (vocab_size), "
                         f"got {int(bad[0])}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    limit = cfg.max_position_embeddings
    what = f"max_position_embeddings ({limit})"
    if getattr(cfg, "sliding_window", None) is not None and cfg.sliding_window < limit:
        limit = cfg.sliding_window
        what = (f"config.json's sliding_window ({limit}): the decoder attends to every "
                "position, the windowed attention only up to it")
    if p.shape[1] + max_new_tokens > limit:
        raise ValueError(f"max_new_tokens: {p.shape[1]} prompt tokens + {max_new_tokens} new "
                         f"exceed {what}; expected at most {limit - p.shape[1]}")
    check_sampling(temperature, top_k, top_p)


def generate(model: Model, prompt: np.ndarray | jax.Array, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             backend: str = "auto", w4a4: bool = True, warmup: bool = True,
             eos_id: int | Sequence[int] | None = None) -> Generation:
    """Greedy (``temperature=0``) or sampled generation from ``prompt`` int [B, T]; with a
    temperature, ``top_k`` / ``top_p`` restrict each draw as transformers does (:func:`sample`).

    The cache holds ``T + max_new_tokens`` positions. With ``warmup``, prefill and the decode
    step are compiled on a throwaway cache first, so the timings are steady-state. Generation
    stops early (checked every 8 tokens) once every sequence has produced an end token
    (``eos_id``: one id or several, as generation_config.json lists them); tokens after a
    sequence's first end token are whatever the model produced next.
    """
    check_model(model)
    _check_generate_args(model.config, prompt, max_new_tokens, temperature, top_k, top_p)
    eos = None
    if eos_id is not None:
        ids = np.atleast_1d(np.asarray(eos_id, dtype=object))
        if ids.ndim != 1 or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                    and 0 <= i < 2**31 for i in ids):
            raise ValueError(f"eos_id: expected a token id or a list of them, got {eos_id!r}")
        eos = jnp.asarray(ids.astype(np.int64), jnp.int32)
    prompt = jnp.asarray(prompt, jnp.int32)
    cfg = model.config
    b, t = prompt.shape
    max_len = t + max_new_tokens
    key = jax.random.key(seed)
    kw = {"backend": backend, "w4a4": w4a4}
    if warmup:
        logits, c = prefill(model, prompt, init_cache(cfg, b, max_len), all_logits=False, **kw)
        _, c = decode_step(model, _sample(logits, key, temperature, top_k, top_p), c, **kw)
        jax.block_until_ready(c)
    cache = init_cache(cfg, b, max_len)
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    logits, cache = prefill(model, prompt, cache, all_logits=False, **kw)
    key, sub = jax.random.split(key)
    tok = _sample(logits, sub, temperature, top_k, top_p)
    tok.block_until_ready()
    t1 = time.perf_counter()
    out = [tok]
    for step in range(max_new_tokens - 1):
        # the end-of-sequence test syncs with the host, so it runs every 8 steps only
        if eos is not None and step % 8 == 7 and bool(
                jnp.all(jnp.any(jnp.isin(jnp.stack(out, 1), eos), axis=1))):
            break
        logits, cache = decode_step(model, tok, cache, **kw)
        key, sub = jax.random.split(key)
        tok = _sample(logits, sub, temperature, top_k, top_p)
        out.append(tok)
    tokens = np.asarray(jnp.stack(out, axis=1))
    t2 = time.perf_counter()
    return Generation(tokens, t1 - t0, t2 - t1, b * t, tokens.shape[1])
