"""Load a ModelOpt NVFP4 HF export directory into a :class:`~nvfp4_jax.models.decoder.Model`.

The directory holds ``config.json`` (``architectures``: ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` or ``NemotronHForCausalLM``,
the last read into a ``nemotron_h.NemotronHModel``), ``hf_quant_config.json``
(or ``quantization_config`` in config.json) and one or more ``*.safetensors`` shards.
Tensors are read lazily through ``nvfp4_jax.checkpoint`` (memory-mapped, one layer at a time)
and put on the device as they are: NVFP4 codes and E4M3 scales stay NVFP4 (never dequantized),
bf16 tensors stay bf16. A linear with ``weight_scale`` / ``weight_scale_2`` becomes an
``nn.Linear`` (W4A4 when it has ``input_scale``); one without (an excluded module) stays a
bf16 weight. Before any tensor is read, ``checks`` holds config.json and every tensor's
presence, dtype and shape (from the safetensors headers) to the architecture and raises a
``ValueError`` (``checkpoint.CheckpointError`` for a file) naming what is wrong.

A quantized KV cache (``kv_cache_quant_algo`` "FP8" or "NVFP4" and each attention layer's
``k_scale`` / ``v_scale``, as ModelOpt exports it) is not applied: the decoders keep K and V in
bf16, and ``load_model`` logs a warning saying so (``KV_CACHE_NOTICE``), since TensorRT-LLM
and vLLM read keys and values from the quantized cache and their logits differ by its rounding.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .. import checkpoint as ckpt
from .. import nn
from ..interop import modelopt as MO
from ..models.checks import (
    architecture,
    check_config_file,
    check_hf_config,
    check_nemotron_h_config,
    check_nemotron_h_tensors,
    check_tensors,
    sliding_window,
)
from ..quantize import NVFP4Array
from .decoder import DecoderConfig, Model, fuse_projections
from .nemotron_h import NemotronHConfig, NemotronHModel

log = logging.getLogger("nvfp4_jax.models")

#: the warning ``load_model`` logs for a checkpoint with a quantized KV cache
KV_CACHE_NOTICE = ("checkpoint {path}: its KV cache is quantized ({algo}; {tensors}), which "
                   "nvfp4_jax does not apply: K and V stay bf16, so attention reads unquantized "
                   "keys and values where TensorRT-LLM and vLLM read them from the {algo} "
                   "cache, and logits differ from theirs by that rounding")


def warn_kv_cache(ck: ckpt.Checkpoint, kv_tensors: list[str]) -> None:
    """Log ``KV_CACHE_NOTICE`` (a WARNING) for a checkpoint that declares a KV-cache
    quantization (``Checkpoint.kv_cache_quant``) or holds KV-cache tensors (``kv_tensors``,
    from ``checks.check_tensors``)."""
    algo = ck.kv_cache_quant
    if algo is None and not kv_tensors:
        return
    layers = {n.split(".self_attn.")[0].split(".mixer.")[0] for n in kv_tensors}
    leaves = sorted({n.rpartition(".")[2] for n in kv_tensors})
    tensors = (f"{' / '.join(leaves)} of {len(layers)} attention layer"
               f"{'s' if len(layers) != 1 else ''}" if kv_tensors
               else "no k_scale / v_scale tensors")
    log.warning(KV_CACHE_NOTICE.format(path=ck.path, algo=algo or "undeclared", tensors=tensors))


#: architectures of :class:`DecoderConfig` models
DECODER_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                         "Qwen3MoeForCausalLM")
#: every architecture ``load_model`` reads
ARCHITECTURES = (*DECODER_ARCHITECTURES, "NemotronHForCausalLM")


def config_from_hf(c: dict) -> DecoderConfig:
    """A :class:`DecoderConfig` from an HF ``config.json`` dict (``DECODER_ARCHITECTURES``)."""
    check_hf_config(c, DECODER_ARCHITECTURES)
    arch = architecture(c)
    if arch not in DECODER_ARCHITECTURES:
        raise ValueError(f"config.json: architectures[0] is {arch!r}; supported: "
                         f"{DECODER_ARCHITECTURES} (NemotronHForCausalLM: "
                         "NemotronHConfig.from_hf)")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (silu)")
    n_layers = int(c["num_hidden_layers"])
    moe_layers: tuple[int, ...] = ()
    n_experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if arch == "Qwen3MoeForCausalLM" and n_experts:
        step = int(c.get("decoder_sparse_step", 1))
        only = set(c.get("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(n_layers) if i not in only and (i + 1) % step == 0)
    nh = int(c["num_attention_heads"])
    return DecoderConfig(
        vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
        num_layers=n_layers, num_heads=nh,
        num_kv_heads=int(c.get("num_key_value_heads") or nh),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // nh),
        intermediate_size=int(c.get("intermediate_size") or 0),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
                         or 10000.0),
        rope_scaling=_rope_scaling(c),
        qk_norm=arch.startswith("Qwen3"),
        moe_layers=moe_layers, num_experts=n_experts,
        num_experts_per_tok=int(c.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        sliding_window=sliding_window(c))


def _rope_scaling(c: dict):
    rs = c.get("rope_scaling") or c.get("rope_parameters")
    if not rs:
        return None
    rs = dict(rs)
    if rs.get("rope_type", rs.get("type", "default")) == "default":
        return None
    return rs


class _Reader:
    """Tensors of one checkpoint as device arrays (bf16 or NVFP4), read on demand."""

    def __init__(self, ck: ckpt.Checkpoint):
        self.ck = ck
        self.names = set(ck.names())

    def bf16(self, name: str) -> jax.Array:
        a = np.asarray(self.ck.get(name))
        if a.dtype == np.uint16:  # BF16 bytes
            a = a.view(ml_dtypes.bfloat16)
        return jnp.asarray(a.astype(ml_dtypes.bfloat16))

    def linear(self, prefix: str) -> nn.Linear | jax.Array:
        if f"{prefix}.weight_scale_2" not in self.names:
            return self.bf16(f"{prefix}.weight")
        lin = self.ck.linear(prefix)
        return _to_linear(lin)


def _nvfp4(weight: np.ndarray, weight_scale: np.ndarray, decode_scale) -> NVFP4Array:
    scales = np.asarray(weight_scale)
    if scales.dtype != ml_dtypes.float8_e4m3fn:
        scales = scales.view(ml_dtypes.float8_e4m3fn)  # E4M3 bytes: a view, never a numeric cast
    return NVFP4Array.from_parts(jnp.asarray(weight, jnp.uint8), jnp.asarray(scales),
                                 jnp.asarray(decode_scale, jnp.float32))


def _to_linear(lin: MO.NVFP4Linear) -> nn.Linear:
    s = None if lin.input_scale is None else jnp.asarray(lin.input_scale, jnp.float32)
    return nn.Linear(_nvfp4(lin.weight, lin.weight_scale, np.float32(lin.weight_scale_2)), s)


def _expert_stacker(prefix: str, groups) -> Callable[[list], NVFP4Array]:
    """Check that every expert linear of ``groups`` ((name, [MO.NVFP4Linear]) pairs) has an
    input_scale (the MoE runs W4A4 experts only) and return the function that stacks one
    group into an [E, N, K] NVFP4Array with one weight_scale_2 per expert."""
    for name, ls in groups:
        if any(lin.input_scale is None for lin in ls):
            raise ValueError(f"{prefix}.experts: {name}_proj without input_scale; nvfp4_jax.moe "
                             "runs W4A4 experts only (TensorRT-LLM semantics)")

    def stack(ls):
        return _nvfp4(np.stack([lin.weight for lin in ls]),
                      np.stack([lin.weight_scale for lin in ls]),
                      np.array([lin.weight_scale_2 for lin in ls], np.float32))

    return stack


def _moe(r: _Reader, prefix: str, cfg: DecoderConfig) -> nn.MoE:
    fc1, fc2 = [], []
    for e in range(cfg.num_experts):
        p = f"{prefix}.experts.{e}"
        gate, up = r.ck.linear(f"{p}.gate_proj"), r.ck.linear(f"{p}.up_proj")
        fc1.append(MO.fuse_gate_up(gate, up, "up_gate"))
        fc2.append(r.ck.linear(f"{p}.down_proj"))
    stack = _expert_stacker(prefix, (("gate/up", fc1), ("down", fc2)))
    return nn.MoE(router=r.bf16(f"{prefix}.gate.weight"), fc1=stack(fc1), fc2=stack(fc2),
                  fc1_input_scale=jnp.asarray([lin.input_scale for lin in fc1], jnp.float32),
                  fc2_input_scale=jnp.asarray([lin.input_scale for lin in fc2], jnp.float32),
                  top_k=cfg.num_experts_per_tok, routing="softmax",
                  renormalize=cfg.norm_topk_prob, activation="swiglu")


def load_model(path: str, *, progress: Callable[[str], None] | None = None,
               stack: bool = True, fuse: bool = True) -> Model | NemotronHModel:
    """Read a ModelOpt NVFP4 export (see module docstring) into a Model on the default device.

    ``progress``: called with one line per loaded layer (e.g. ``print``); None for silence.
    ``stack``: stack layers of one structure for ``lax.scan`` (``Model.build``; for a
    ``NemotronHForCausalLM`` checkpoint, which gives a
    :class:`~nvfp4_jax.models.nemotron_h.NemotronHModel`, its repeated layer units:
    ``NemotronHModel.stacked``); the loaded layers' arrays are freed as they are stacked, so
    stacking holds one weight's stack on top of the model at a time. Unrolled layers run
    host-bound on a GPU (docs/models.md). ``fuse``: q/k/v and gate/up as one linear each where
    their scales agree (``decoder.fuse_projections``; ModelOpt exports make them agree).
    """
    check_config_file(path)
    ck = ckpt.load(path)
    if architecture(ck.config) == "NemotronHForCausalLM":
        say = progress or (lambda msg: None)
        model = _load_nemotron_h(ck, say, fuse)  # warn_kv_cache included
        if stack:
            say("stacking repeated layer units")
            model = model.stacked(consume=True)
        return model
    cfg = config_from_hf(ck.config)
    r = _Reader(ck)
    warn_kv_cache(ck, check_tensors(ck, cfg))
    say = progress or (lambda msg: None)
    embed = r.bf16("model.embed_tokens.weight")
    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}"
        attn = {n: r.linear(f"{pre}.self_attn.{n}")
                for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if cfg.qk_norm:
            attn["q_norm"] = r.bf16(f"{pre}.self_attn.q_norm.weight")
            attn["k_norm"] = r.bf16(f"{pre}.self_attn.k_norm.weight")
        layer = {"input_layernorm": r.bf16(f"{pre}.input_layernorm.weight"),
                 "post_attention_layernorm": r.bf16(f"{pre}.post_attention_layernorm.weight"),
                 "self_attn": attn}
        if i in cfg.moe_layers:
            layer["moe"] = _moe(r, f"{pre}.mlp", cfg)
        else:
            layer["mlp"] = {n: r.linear(f"{pre}.mlp.{n}")
                            for n in ("gate_proj", "up_proj", "down_proj")}
        layers.append(layer)
        say(f"loaded layer {i + 1}/{cfg.num_layers}")
    norm = r.bf16("model.norm.weight")
    if "lm_head.weight" in r.names:
        head = r.linear("lm_head")
    elif cfg.tie_word_embeddings:
        head = embed
    else:
        raise ValueError(f"checkpoint: no lm_head.weight in {path!r} and tie_word_embeddings "
                         "is false")
    if stack:
        say("stacking layers")
    return Model.build(cfg, embed, layers, norm, head, stack=stack, fuse=fuse, consume=True)


def _f32(r: _Reader, name: str) -> jax.Array:
    a = np.asarray(r.ck.get(name))
    if a.dtype == np.uint16:  # BF16 bytes
        a = a.view(ml_dtypes.bfloat16)
    return jnp.asarray(a.astype(np.float32))


def _load_nemotron_h(ck: ckpt.Checkpoint, say: Callable[[str], None],
                     fuse: bool) -> NemotronHModel:
    """A Nemotron-H export (tensors under ``backbone.`` as NVIDIA and ModelOpt name them, or
    ``model.``): NVFP4 linears stay NVFP4, the MoE router and correction bias float32, the
    Mamba conv, A_log, D, dt_bias and norms as stored (bf16)."""
    check_nemotron_h_config(ck.config)
    cfg = NemotronHConfig.from_hf(ck.config)
    warn_kv_cache(ck, check_nemotron_h_tensors(ck, cfg))
    r = _Reader(ck)
    base = "backbone" if "backbone.embeddings.weight" in r.names else "model"
    embed = r.bf16(f"{base}.embeddings.weight")
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        pre = f"{base}.layers.{i}.mixer"
        layer = {"norm": r.bf16(f"{base}.layers.{i}.norm.weight")}
        if kind == "M":
            m = {n: r.linear(f"{pre}.{n}") for n in ("in_proj", "out_proj")}
            m["conv_weight"] = r.bf16(f"{pre}.conv1d.weight").reshape(cfg.conv_dim, -1)
            if f"{pre}.conv1d.bias" in r.names:
                m["conv_bias"] = r.bf16(f"{pre}.conv1d.bias")
            for n in ("A_log", "D", "dt_bias"):
                m[n] = r.bf16(f"{pre}.{n}")
            m["norm"] = r.bf16(f"{pre}.norm.weight")
            layer["mamba"] = m
        elif kind == "*":
            attn = {n: r.linear(f"{pre}.{n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
            layer["self_attn"] = attn
            if fuse:
                layer = fuse_projections(layer)
        elif kind == "-":
            layer["mlp"] = {n: r.linear(f"{pre}.{n}") for n in ("up_proj", "down_proj")}
        else:
            layer["moe"] = {"routed": _moe_relu2(r, pre, cfg),
                            "shared": {n: r.linear(f"{pre}.shared_experts.{n}")
                                       for n in ("up_proj", "down_proj")}}
        layers.append(layer)
        say(f"loaded layer {i + 1}/{cfg.num_layers}")
    norm = r.bf16(f"{base}.norm_f.weight")
    if "lm_head.weight" in r.names:
        head = r.linear("lm_head")
    elif cfg.tie_word_embeddings:
        head = embed
    else:
        raise ValueError("checkpoint: no lm_head.weight and tie_word_embeddings is false")
    return NemotronHModel(embed, layers, norm, head, cfg)


def _moe_relu2(r: _Reader, prefix: str, cfg: NemotronHConfig) -> nn.MoE:
    fc1 = [r.ck.linear(f"{prefix}.experts.{e}.up_proj") for e in range(cfg.num_experts)]
    fc2 = [r.ck.linear(f"{prefix}.experts.{e}.down_proj") for e in range(cfg.num_experts)]
    stack = _expert_stacker(prefix, (("up", fc1), ("down", fc2)))
    bias = f"{prefix}.gate.e_score_correction_bias"
    return nn.MoE(router=_f32(r, f"{prefix}.gate.weight"), fc1=stack(fc1), fc2=stack(fc2),
                  fc1_input_scale=jnp.asarray([lin.input_scale for lin in fc1], jnp.float32),
                  fc2_input_scale=jnp.asarray([lin.input_scale for lin in fc2], jnp.float32),
                  correction_bias=_f32(r, bias) if bias in r.names else None,
                  top_k=cfg.num_experts_per_tok, routing="sigmoid_bias",
                  renormalize=cfg.norm_topk_prob,
                  routed_scaling_factor=cfg.routed_scaling_factor, activation="relu2")


def stderr_progress(msg: str) -> None:
    """A ``progress`` callback that writes to stderr."""
    print(f"nvfp4: {msg}", file=sys.stderr, flush=True)
