"""Nemotron-H: a hybrid decoder of Mamba2, attention, MLP and MoE layers over NVFP4 linears.

Each layer has ONE mixer after an RMSNorm, added to the residual stream (HF
``config.layers_block_type`` / ``hybrid_override_pattern``: "M" Mamba2, "*" attention, "-"
MLP, "E" MoE), as in HF transformers' ``modeling_nemotron_h``:

* **Mamba2** ("M"): ``in_proj`` (NVFP4) -> [gate z, xBC, dt]; a causal depthwise conv1d over
  xBC (kernel ``conv_kernel``, with bias) and SiLU; the selective state space recurrence per
  head h (state [head_dim, d_state], fp32; B and C shared by the heads of a group)::

      dt = max(softplus(dt + dt_bias), time_step_min);  A = -exp(A_log)
      state = exp(dt * A) * state + dt * x (outer) B;    y = state @ C + D * x

  then a gated RMSNorm per group (``y * silu(z)``, normalized over groups of
  ``mamba_num_heads * mamba_head_dim / n_groups``, times its weight) and ``out_proj`` (NVFP4).
  The recurrence runs **sequentially**, one ``lax.scan`` step per token, in prefill too (HF's
  torch path computes the same recurrence in chunks; the results agree to fp32 rounding).
  The clamp at ``time_step_min`` is HF's chunked (prefill) form; HF's one-token update does
  not clamp, and here both do, so a prefill and a token-by-token decode agree.
* **attention** ("*"): GQA without RoPE (``decoder.attention`` with no frequencies), bf16 KV
  cache, fp32 scores and softmax.
* **MLP** ("-"): ``down_proj(relu(up_proj(x))^2)`` on two NVFP4 linears.
* **MoE** ("E"): ``nn.MoE`` with an fp32 router, ``routing="sigmoid_bias"`` (scores
  ``sigmoid(logits)``, experts chosen by ``scores + e_score_correction_bias``, weights the
  unbiased scores, renormalized with ``norm_topk_prob``, times ``routed_scaling_factor``),
  relu2 experts (W4A4, ``nvfp4_jax.moe``), plus the shared expert (a relu2 MLP of
  ``moe_shared_expert_intermediate_size``) added unscaled.

Embedding, norms, residual stream and logits are bf16 (norms computed in fp32, HF's
``NemotronHRMSNorm``: weight times the fp32 normalized value, then rounded); the Mamba conv,
recurrence and gated norm run in fp32. Layers are unrolled (one mixer type per layer).

Not supported (a clear ``ValueError`` from :meth:`NemotronHConfig.from_hf`): group-limited
expert selection (``n_group > 1`` with ``topk_group < n_group``), a latent MoE projection
(``moe_latent_size``), sliding-window attention, biases on the linears, activations other
than relu2 (MLP) and SiLU (Mamba). Multi-token-prediction layers in a checkpoint are ignored.

Entry points: ``load_model(dir)`` (``models.loader``) returns a :class:`NemotronHModel`;
``models.prefill``, ``models.decode_step`` and ``models.generate`` run it with the
:class:`HybridCache` that ``models.init_cache(model.config, batch, max_len)`` makes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .. import nn
from .decoder import attention, check_cache_room, embed_tokens, past_cache_nan, stack_trees

#: HF ``layers_block_type`` names and their pattern characters
LAYER_TYPES = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig:
    """Architecture of a Nemotron-H decoder (HF config.json names in brackets).

    ``layer_types``: one of "M", "E", "*", "-" per layer [layers_block_type or
    hybrid_override_pattern].
    """

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int = 0                     # [num_attention_heads]
    num_kv_heads: int = 0                  # [num_key_value_heads]
    head_dim: int = 0
    intermediate_size: int = 0             # "-" layers
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    n_groups: int = 1
    conv_kernel: int = 4
    use_conv_bias: bool = True
    time_step_min: float = 0.001
    num_experts: int = 0                   # [n_routed_experts]
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    qk_norm: bool = dataclasses.field(default=False, init=False)  # for decoder.attention

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in "ME*-"]
        if bad or not self.layer_types:
            raise ValueError(f"layer_types: expected a non-empty sequence of 'M', 'E', '*', '-', "
                             f"got {self.layer_types!r}")
        if "*" in self.layer_types and (not self.num_kv_heads
                                        or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_heads ({self.num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if "M" in self.layer_types and (self.mamba_num_heads % self.n_groups or
                                        not self.mamba_head_dim or not self.ssm_state_size):
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of "
                             f"n_groups ({self.n_groups}), with mamba_head_dim and "
                             "ssm_state_size > 0")
        if "E" in self.layer_types and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(f"num_experts_per_tok: expected 1..{self.num_experts}, got "
                             f"{self.num_experts_per_tok}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def mamba_inner(self) -> int:
        """Mamba inner width: mamba_num_heads * mamba_head_dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C (inner + 2 * n_groups * ssm_state_size)."""
        return self.mamba_inner + 2 * self.n_groups * self.ssm_state_size

    @staticmethod
    def from_hf(c: dict) -> NemotronHConfig:
        """From an HF ``config.json`` dict (``architectures[0] == "NemotronHForCausalLM"``)."""
        types = c.get("layers_block_type") or c.get("layer_types")
        if types:
            unknown = [t for t in types if t not in LAYER_TYPES]
            if unknown:
                raise ValueError(f"config.json: layers_block_type {unknown} not among "
                                 f"{sorted(LAYER_TYPES)}")
            pattern = tuple(LAYER_TYPES[t] for t in types)
        elif c.get("hybrid_override_pattern"):
            pattern = tuple(c["hybrid_override_pattern"])
        else:
            raise ValueError("config.json: Nemotron-H needs layers_block_type or "
                             "hybrid_override_pattern")
        n_group, topk_group = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
        if n_group > 1 and topk_group < n_group:
            raise ValueError(f"config.json: n_group {n_group} with topk_group {topk_group}: "
                             "group-limited expert selection is not implemented")
        if c.get("moe_latent_size") is not None:
            raise ValueError("config.json: moe_latent_size (latent MoE projections) is not "
                             "supported")
        if c.get("sliding_window") is not None:
            raise ValueError("config.json: sliding_window attention is not supported")
        for key in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias"):
            if c.get(key):
                raise ValueError(f"config.json: {key} true is not supported (no biases)")
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if c.get(key, want) != want:
                raise ValueError(f"config.json: {key} {c[key]!r} is not supported ({want})")
        nh = int(c.get("num_attention_heads") or 0)
        return NemotronHConfig(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            layer_types=pattern, num_heads=nh,
            num_kv_heads=int(c.get("num_key_value_heads") or nh),
            head_dim=int(c.get("head_dim") or (c["hidden_size"] // nh if nh else 0)),
            intermediate_size=int(c.get("intermediate_size") or 0),
            mamba_num_heads=int(c.get("mamba_num_heads") or 0),
            mamba_head_dim=int(c.get("mamba_head_dim") or 0),
            ssm_state_size=int(c.get("ssm_state_size") or 0),
            n_groups=int(c.get("n_groups") or c.get("mamba_n_groups") or 1),
            conv_kernel=int(c.get("conv_kernel") or c.get("mamba_d_conv") or 4),
            use_conv_bias=bool(c.get("use_conv_bias", True)),
            time_step_min=float(c.get("time_step_min", c.get("mamba_dt_min", 0.001))),
            num_experts=int(c.get("n_routed_experts") or 0),
            num_experts_per_tok=int(c.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
            moe_shared_expert_intermediate_size=int(
                c.get("moe_shared_expert_intermediate_size") or 0),
            routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            layer_norm_epsilon=float(c.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)))

    def init_cache(self, batch: int, max_len: int) -> HybridCache:
        """An empty :class:`HybridCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        n_att, n_mamba = self.layer_types.count("*"), self.layer_types.count("M")
        kv = (n_att, batch, max_len, self.num_kv_heads, self.head_dim)
        return HybridCache(
            jnp.zeros(kv, jnp.bfloat16), jnp.zeros(kv, jnp.bfloat16),
            jnp.zeros((n_mamba, batch, self.conv_dim, self.conv_kernel - 1), jnp.bfloat16),
            jnp.zeros((n_mamba, batch, self.mamba_num_heads, self.mamba_head_dim,
                       self.ssm_state_size), jnp.float32),
            jnp.zeros((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """Decode state of a Nemotron-H model.

    k, v: bf16 [L_attn, B, S_max, KVH, D] (the attention layers, in order); conv: bf16
    [L_mamba, B, conv_dim, conv_kernel - 1] (the last inputs of each Mamba layer's conv);
    ssm: float32 [L_mamba, B, mamba_num_heads, mamba_head_dim, ssm_state_size]; length:
    int32 [] (tokens written).
    """

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    ssm: jax.Array
    length: jax.Array


def norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF ``NemotronHRMSNorm``: ``x [..., D]`` -> ``fp32(weight) * x / rms(x)`` computed in fp32,
    then rounded to x's dtype (unlike Llama's, the normalized value is not rounded first)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


def gated_norm(y: jax.Array, z: jax.Array, weight: jax.Array, groups: int,
               eps: float) -> jax.Array:
    """HF ``NemotronHRMSNormGated`` in fp32: ``y * silu(z)`` [..., I] normalized over ``groups``
    equal groups of the last axis, times ``weight`` [I] -> float32 [..., I]."""
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    shape = h.shape
    hg = h.reshape(*shape[:-1], groups, shape[-1] // groups)
    hg = hg * jax.lax.rsqrt(jnp.mean(hg * hg, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * hg.reshape(shape)


def _linear(p, x, backend, w4a4):
    return nn.linear(p, x, backend=backend, w4a4=w4a4)


def relu2_mlp(p: dict, x: jax.Array, backend: str = "auto", w4a4: bool = True) -> jax.Array:
    """``down_proj(relu(up_proj(x))^2)``: x bf16 [..., H] -> bf16 [..., H] (relu2 in fp32,
    rounded to bf16 before down_proj)."""
    u = _linear(p["up_proj"], x, backend, w4a4).astype(jnp.float32)
    r = jnp.maximum(u, 0.0)
    return _linear(p["down_proj"], (r * r).astype(jnp.bfloat16), backend, w4a4)


def mamba2(cfg: NemotronHConfig, p: dict, x: jax.Array, conv_state: jax.Array,
           ssm_state: jax.Array, backend: str = "auto",
           w4a4: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Mamba2 mixer (module docstring) over x bf16 [B, T, H], continuing from
    ``conv_state`` bf16 [B, conv_dim, K-1] and ``ssm_state`` fp32 [B, heads, head_dim, N].

    ``p``: in_proj, out_proj (``nn.Linear`` or bf16), conv_weight bf16 [conv_dim, K],
    conv_bias bf16 [conv_dim] (absent without ``use_conv_bias``), A_log, D, dt_bias [heads],
    norm bf16 [inner]. Returns (out bf16 [B, T, H], conv_state, ssm_state). The recurrence is a
    sequential ``lax.scan`` over the T tokens.
    """
    b, t, _ = x.shape
    inner, cdim, nh = cfg.mamba_inner, cfg.conv_dim, cfg.mamba_num_heads
    hd, n, g, k = cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups, cfg.conv_kernel
    proj = _linear(p["in_proj"], x, backend, w4a4)
    z, xbc, dt = jnp.split(proj, [inner, inner + cdim], axis=-1)
    # causal depthwise conv over [previous K-1 inputs, this call's T inputs]
    full = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(xbc.dtype), xbc], axis=1)
    w = p["conv_weight"].astype(jnp.float32)  # [C, K]
    fullf = full.astype(jnp.float32)
    conv = sum(fullf[:, i:i + t, :] * w[:, i] for i in range(k))
    if "conv_bias" in p:
        conv = conv + p["conv_bias"].astype(jnp.float32)
    xbc = jax.nn.silu(conv).astype(jnp.bfloat16)
    new_conv = jnp.swapaxes(full[:, t:, :], 1, 2).astype(conv_state.dtype)
    xs, bm, cm = jnp.split(xbc.astype(jnp.float32), [inner, inner + g * n], axis=-1)
    xs = xs.reshape(b, t, nh, hd)
    rep = nh // g
    bm = jnp.repeat(bm.reshape(b, t, g, n), rep, axis=2)  # head h reads group h // rep
    cm = jnp.repeat(cm.reshape(b, t, g, n), rep, axis=2)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    dt = jnp.maximum(dt, jnp.float32(cfg.time_step_min))  # [B, T, heads]
    a = -jnp.exp(p["A_log"].astype(jnp.float32))
    d = p["D"].astype(jnp.float32)

    def step(state, inp):
        xt, dtt, bt, ct = inp  # [B, h, p], [B, h], [B, h, n], [B, h, n]
        da = jnp.exp(dtt * a)
        state = state * da[:, :, None, None] + (dtt[:, :, None] * xt)[..., None] * bt[:, :, None]
        yt = jnp.sum(state * ct[:, :, None, :], axis=-1) + d[:, None] * xt
        return state, yt

    tm = (jnp.swapaxes(v, 0, 1) for v in (xs, dt, bm, cm))
    new_ssm, y = jax.lax.scan(step, ssm_state.astype(jnp.float32), tuple(tm))
    y = jnp.swapaxes(y, 0, 1).reshape(b, t, inner)
    y = gated_norm(y, z, p["norm"], g, cfg.layer_norm_epsilon).astype(jnp.bfloat16)
    return _linear(p["out_proj"], y, backend, w4a4), new_conv, new_ssm


def moe(p: dict, x: jax.Array, backend: str = "auto", w4a4: bool = True) -> jax.Array:
    """Nemotron-H MoE mixer: ``nn.moe_block(p["routed"])`` (sigmoid-and-bias routing, relu2
    experts, routed_scaling_factor on the routed weights) + ``relu2_mlp(p["shared"])``.
    x bf16 [B, T, H] -> bf16 [B, T, H]."""
    b, t, h = x.shape
    routed = nn.moe_block(p["routed"], x.reshape(b * t, h), backend=backend).reshape(b, t, h)
    return routed + relu2_mlp(p["shared"], x, backend, w4a4)


#: the longest repeated unit of layers ``segment_layers`` looks for
MAX_UNIT = 8


def segment_layers(tokens: Sequence) -> tuple[tuple[int, int], ...]:
    """Cover a layer sequence with repeated units, greedily from the front: at each position
    the unit of 1..``MAX_UNIT`` layers whose back-to-back repeats cover the most layers (two
    repeats at least; else one layer). ``tokens``: one comparable item per layer (its kind
    and parameter structure). Returns ((unit length, repeats), ...) in order; e.g.
    Nemotron-3-Nano's 52-layer pattern gives 6 segments, "MEMEM*E" x 5 the first."""
    out, i, n_all = [], 0, len(tokens)
    while i < n_all:
        best = (1, 1)
        for u in range(1, MAX_UNIT + 1):
            if i + 2 * u > n_all:
                break
            unit = tokens[i:i + u]
            n = 1
            while tokens[i + n * u:i + (n + 1) * u] == unit:
                n += 1
            if n >= 2 and u * n > best[0] * best[1]:
                best = (u, n)
        out.append(best)
        i += best[0] * best[1]
    return tuple(out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NemotronHModel:
    """Parameters (a pytree) and static configuration of a Nemotron-H decoder.

    embed: bf16 [V, H]; layers: one dict per layer, ``norm`` bf16 [H] and the mixer's entry:
    ``mamba`` (:func:`mamba2`'s ``p``), ``self_attn`` (q/k/v/o_proj, or ``qkv_proj`` and
    o_proj: ``decoder.fuse_projections``), ``mlp`` (up_proj, down_proj) or ``moe``
    {"routed": ``nn.MoE``, "shared": {up_proj, down_proj}}; linears are ``nn.Linear`` (NVFP4)
    or bf16 [N, K]. norm: bf16 [H]; lm_head: bf16 [V, H] or ``nn.Linear``.

    ``segments``: None (``layers`` one dict per layer), or the ((unit length, repeats), ...)
    of :func:`segment_layers` (``stacked()``): then ``layers`` holds one entry per segment, a
    list of the unit's layer dicts whose arrays carry a leading ``repeats`` axis, run by one
    ``lax.scan`` (one layer dict per position, no extra axis, where repeats is 1). A GPU runs
    a scan's body as one CUDA graph; unrolled layers pay ~15-20 us of host time per kernel
    launch (docs/models.md).
    """

    embed: jax.Array
    layers: list
    norm: jax.Array
    lm_head: object
    config: NemotronHConfig = dataclasses.field(metadata={"static": True})
    segments: tuple | None = dataclasses.field(default=None, metadata={"static": True})

    def stacked(self, *, consume: bool = False) -> NemotronHModel:
        """The same model with its repeated layer units stacked (``segments``). Layers repeat
        when their kind and parameter structure (pytree and array shapes) match (no repeats:
        the model itself). The stacked
        arrays are copies: both forms are alive until the caller drops this one, unless
        ``consume`` (this model is given up: its stacked layers' arrays are deleted as they
        are stacked, ``decoder.stack_trees``; how ``load_model`` bounds memory)."""
        if self.segments is not None:
            return self
        toks = [(kind, jax.tree_util.tree_structure(p),
                 tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(p)))
                for kind, p in zip(self.config.layer_types, self.layers)]
        segs = segment_layers(toks)
        if all(n == 1 for _, n in segs):  # no unit repeats: nothing to scan
            return self
        layers, i = [], 0
        for u, n in segs:
            if n == 1:
                layers.append(list(self.layers[i:i + u]))
            else:
                layers.append([stack_trees(self.layers[i + j:i + u * n:u], consume=consume)
                               for j in range(u)])
            i += u * n
        return dataclasses.replace(self, layers=layers, segments=segs)

    def unstacked(self) -> NemotronHModel:
        """One layer dict per layer (the inverse of ``stacked``)."""
        if self.segments is None:
            return self
        layers = []
        for (u, n), unit in zip(self.segments, self.layers):
            if n == 1:
                layers += list(unit)
            else:
                layers += [jax.tree_util.tree_map(lambda a, r=r: a[r], unit[j])
                           for r in range(n) for j in range(u)]
        return dataclasses.replace(self, layers=layers, segments=None)

    def forward(self, tokens: jax.Array, cache: HybridCache, *, backend: str = "auto",
                w4a4: bool = True,
                ablate: frozenset = frozenset()) -> tuple[jax.Array, HybridCache]:
        """tokens int32 [B, T] at positions ``cache.length ..`` -> (fp32 logits [B, T, V],
        cache). ``models.forward`` / ``prefill`` / ``decode_step`` call this. ``w4a4=False``
        runs the dense linears W4A16 (the experts stay W4A4). ``ablate`` must be empty (the
        time breakdown of ``decoder.forward`` is not implemented here)."""
        if ablate:
            raise ValueError(f"ablate: not supported for Nemotron-H, got {sorted(ablate)}")
        cfg = self.config
        b, t = tokens.shape
        check_cache_room(t, cache.k.shape[2])
        start = cache.length
        pos = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        x = embed_tokens(self.embed, tokens)
        k_all, v_all = cache.k, cache.v
        convs, ssms = [], []  # per segment, [Mamba layers, ...] each
        ai = mi = li = 0

        def layer(kind, p, x, k_all, v_all, conv, ssm, ai):
            """One layer: (x, k_all, v_all, new conv or None, new ssm or None)."""
            h = norm(x, p["norm"], cfg.layer_norm_epsilon)
            c = s = None
            if kind == "M":
                out, c, s = mamba2(cfg, p["mamba"], h, conv, ssm, backend, w4a4)
            elif kind == "*":
                out, k_all, v_all = attention(cfg, p["self_attn"], h, pos, k_all, v_all, ai,
                                              start, None, backend, w4a4)
            elif kind == "-":
                out = relu2_mlp(p["mlp"], h, backend, w4a4)
            else:
                out = moe(p["moe"], h, backend, w4a4)
            return x + out, k_all, v_all, c, s

        segments = self.segments or ((1, 1),) * len(self.layers)
        units = self.layers if self.segments else [[p] for p in self.layers]
        for (u, n), unit in zip(segments, units):
            kinds = cfg.layer_types[li:li + u]
            mu, au = kinds.count("M"), kinds.count("*")

            def run_unit(carry, xs, kinds=kinds, au=au, ai0=ai, stacks=None):
                """Repeat ``r`` of the unit: its layers in order, the Mamba states of repeat r
                in and out ([mu, ...] each, None without Mamba layers)."""
                x, k_all, v_all = carry
                ps, conv, ssm, r = xs
                if stacks is not None:
                    ps = nn.join_stacks(ps, stacks, r)
                cs, ss, a = [], [], 0
                for kind, p in zip(kinds, ps):
                    m = len(cs)
                    x, k_all, v_all, c, s_ = layer(
                        kind, p, x, k_all, v_all, conv[m] if kind == "M" else None,
                        ssm[m] if kind == "M" else None, ai0 + r * au + a)
                    a += kind == "*"
                    if c is not None:
                        cs.append(c)
                        ss.append(s_)
                return (x, k_all, v_all), ((jnp.stack(cs), jnp.stack(ss)) if cs else None)

            # [n * mu, ...] -> [n, mu, ...]: repeat r's Mamba states
            conv_in = cache.conv[mi:mi + n * mu].reshape(n, mu, *cache.conv.shape[1:]) \
                if mu else None
            ssm_in = cache.ssm[mi:mi + n * mu].reshape(n, mu, *cache.ssm.shape[1:]) \
                if mu else None
            if n == 1:  # no scan around a single repeat
                (x, k_all, v_all), ys = run_unit(
                    (x, k_all, v_all), (unit, None if conv_in is None else conv_in[0],
                                        None if ssm_in is None else ssm_in[0], 0))
                ys = ys if ys is None else tuple(y[None] for y in ys)
            else:
                # the kernels read the weight stacks in place (closed over, not sliced):
                # Nemotron-H runs its relu2 MoE and most GEMMs on Pallas-Triton, which gets a
                # copy of every scanned slice (nn.stacks_read_in_place)
                body = functools.partial(run_unit, stacks=nn.weight_stacks(unit))
                (x, k_all, v_all), ys = jax.lax.scan(
                    body, (x, k_all, v_all),
                    (nn.strip_stacks(unit), conv_in, ssm_in, jnp.arange(n, dtype=jnp.int32)))
            conv_out, ssm_out = ys if mu else (None, None)
            ys = ((conv_out.reshape(n * mu, *conv_out.shape[2:]),
                   ssm_out.reshape(n * mu, *ssm_out.shape[2:])) if mu else None)
            if mu:
                convs.append(ys[0])
                ssms.append(ys[1])
            ai += n * au
            mi += n * mu
            li += u * n
        x = norm(past_cache_nan(x, start + t, k_all.shape[2]), self.norm, cfg.layer_norm_epsilon)
        if isinstance(self.lm_head, nn.Linear):
            logits = nn.linear(self.lm_head, x, backend=backend, w4a4=w4a4)
        else:
            logits = jax.lax.dot_general(x, self.lm_head, (((2,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
        logits = logits.astype(jnp.bfloat16).astype(jnp.float32)
        conv = jnp.concatenate(convs) if convs else cache.conv
        ssm = jnp.concatenate(ssms) if ssms else cache.ssm
        return logits, HybridCache(k_all, v_all, conv, ssm, start + t)
