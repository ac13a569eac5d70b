"""Checks of a ModelOpt NVFP4 export before :func:`~nvfp4_jax.models.load_model` reads it.

``check_config_file(path)``: the directory has a config.json. ``check_hf_config(c)``: the
config.json keys the decoder reads have the right types and ranges and agree with each other
(``ValueError`` naming ``config.json`` and the key). ``check_tensors(ck, cfg)``: every tensor
the config implies is present with its dtype and shape, from the safetensors headers alone
(nothing is read or allocated, so a config claiming a 10^12-token vocabulary costs nothing),
the layers and experts in the files are the ones the config names, the quantization is NVFP4
with 16-value blocks, and every NVFP4 linear has all its tensors (``weight``,
``weight_scale``, ``weight_scale_2``, ``input_scale``); ``checkpoint.CheckpointError`` naming
the file and tensor. A tensor beside those of a module the decoder reads (a linear's ``bias``
or AWQ ``pre_quant_scale``, a norm's ``bias``) is refused, named: the decoder would run
without it. The per-layer tensors of a quantized KV cache (``k_proj.k_scale``,
``v_proj.v_scale``, and ``k_bias`` / ``v_bias`` of an affine one) are returned instead, for
the loader to say that they are not applied (``KV_CACHE_TENSORS``). Scale values (finite,
positive, no E4M3 NaN byte) are checked as the tensors are read
(``checkpoint.Checkpoint.linear``).

``check_nemotron_h_config(c)`` and ``check_nemotron_h_tensors(ck, cfg)`` do the same for a
``NemotronHForCausalLM`` export: the layer pattern and the sizes each layer type reads, then
every tensor of each Mamba2, attention, MLP and MoE layer (under ``backbone.`` or ``model.``).
"""

from __future__ import annotations

import math
import os
import re

from .. import checkpoint as ckpt
from ..interop import modelopt as MO
from .decoder import DecoderConfig
from .nemotron_h import LAYER_TYPES, NemotronHConfig

#: safetensors dtypes of tensors the decoder holds in bf16 (cast on load)
FLOAT_DTYPES = ("BF16", "F16", "F32")
#: more layers than any decoder has: refused before the layer list is built
MAX_LAYERS = 100_000
#: NVFP4 block size: values per E4M3 block scale
GROUP_SIZE = 16


def check_config_file(path: str) -> None:
    """Raise ``CheckpointError`` when the directory ``path`` has no config.json (a missing
    directory is left to ``checkpoint.load``, which raises ``FileNotFoundError``)."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ckpt.CheckpointError(os.path.join(path, "config.json"), None,
                                   "missing: a ModelOpt HF export holds the model's config.json")


def _bad(key: str, want: str, v) -> ValueError:
    return ValueError(f"config.json: {key}: expected {want}, got {v!r}")


def _int(c: dict, key: str, lo: int = 1, required: bool = False) -> int | None:
    v = c.get(key)
    if v is None:
        if required:
            raise ValueError(f"config.json: {key}: missing (expected an integer >= {lo})")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(key, f"an integer >= {lo}", v)
    return v


def _positive(c: dict, key: str, where: str = "") -> None:
    v = c.get(key)
    if v is None:
        return
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or v <= 0):
        raise _bad(f"{where}{key}", "a finite number > 0", v)


def architecture(c: dict) -> str:
    """``architectures[0]`` of a config.json dict; ``ValueError`` naming the key unless
    ``architectures`` is a non-empty list of class names."""
    arch = c.get("architectures")
    if not (isinstance(arch, list) and arch and isinstance(arch[0], str)):
        raise _bad("architectures", "a list of class names, e.g. [\"LlamaForCausalLM\"]", arch)
    return arch[0]


def check_hf_config(c: dict, architectures: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming the config.json key when a value the decoder reads has the
    wrong type or range, or values disagree (heads and KV heads, experts and top-k).

    ``architectures``: where given, a config whose ``architectures[0]`` is not one of them is
    left to the caller (which names the supported ones) after the type of ``architectures``
    is checked.
    """
    if architectures and architecture(c) not in architectures:
        return
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        _int(c, key, required=True)
    if c["num_hidden_layers"] > MAX_LAYERS:  # the decoder lists its layers: bound them first
        raise _bad("num_hidden_layers", f"at most {MAX_LAYERS}", c["num_hidden_layers"])
    for key in ("num_key_value_heads", "head_dim", "intermediate_size", "num_experts_per_tok",
                "moe_intermediate_size", "decoder_sparse_step", "max_position_embeddings"):
        _int(c, key)
    for key in ("num_experts", "num_local_experts"):
        _int(c, key, lo=0)
    for key in ("rms_norm_eps", "rope_theta"):
        _positive(c, key)
    for key in ("tie_word_embeddings", "norm_topk_prob"):
        if key in c and not isinstance(c[key], bool):
            raise _bad(key, "true or false", c[key])
    only = c.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list)
                                 and all(isinstance(i, int) for i in only)):
        raise _bad("mlp_only_layers", "a list of layer indices", only)
    _check_rope(c)
    prf = c.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise _bad("partial_rotary_factor", "1 (the decoders rotate whole heads)", prf)
    sliding_window(c)
    nh, kvh = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    if nh % kvh:
        raise ValueError(f"config.json: num_attention_heads ({nh}) must be a multiple of "
                         f"num_key_value_heads ({kvh})")
    if c.get("head_dim") is None and c["hidden_size"] % nh:
        raise ValueError(f"config.json: hidden_size ({c['hidden_size']}) is not a multiple of "
                         f"num_attention_heads ({nh}) and no head_dim is given")
    n_exp = c.get("num_experts") or c.get("num_local_experts") or 0
    if n_exp and c["architectures"][0] == "Qwen3MoeForCausalLM":
        k = c.get("num_experts_per_tok")
        if not k or k > n_exp:
            raise _bad("num_experts_per_tok", f"1..{n_exp} (num_experts)", k)
        _int(c, "moe_intermediate_size", required=True)


def sliding_window(c: dict) -> int | None:
    """The attention window W a config.json makes active, as transformers reads it, or None: a
    Mistral's ``sliding_window`` (every layer; 4096 where the key is absent), a Qwen3-MoE's with
    ``use_sliding_window``, a Qwen3's with ``use_sliding_window`` where a layer is a
    "sliding_attention" one (``layer_types``, else the layers from ``max_window_layers`` on).
    Under it a query attends to the W latest positions, itself included. ``ValueError`` naming
    ``sliding_window`` unless an active one is an integer >= 1."""
    arch = architecture(c)
    w = c.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
    use = c.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise _bad("use_sliding_window", "true or false", use)
    if arch == "MistralForCausalLM":
        active = w is not None
    elif arch == "Qwen3MoeForCausalLM":
        active = use and w is not None
    elif arch == "Qwen3ForCausalLM":
        types = c.get("layer_types")
        if types is not None:
            if not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
                raise _bad("layer_types", "a list of layer types", types)
            sliding = "sliding_attention" in types
        else:
            first = c.get("max_window_layers", 28)
            sliding = isinstance(first, int) and first < c["num_hidden_layers"]
        active = use and w is not None and sliding
    else:
        active = False
    if not active:
        return None
    return _int({"sliding_window": w}, "sliding_window", required=True)


def _check_rope(c: dict) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        rs = c.get(key)
        if rs is None:
            continue
        if not isinstance(rs, dict):
            raise _bad(key, "an object", rs)
        _positive(rs, "rope_theta", f"{key}.")
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise _bad(f"{key}.rope_type", "'default' or 'llama3'", kind)
        if kind == "llama3":
            for k in ("factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings"):
                if k not in rs:
                    raise ValueError(f"config.json: {key}.{k}: missing (llama3 rope)")
                _positive(rs, k, f"{key}.")
            if rs["high_freq_factor"] == rs["low_freq_factor"]:
                raise ValueError(f"config.json: {key}: llama3 rope needs high_freq_factor != "
                                 "low_freq_factor")


def _indices(names, pattern: str) -> set[int]:
    rx = re.compile(pattern)
    return {int(m[1]) for m in map(rx.match, names) if m}


def _is_range(ids: set[int], n: int) -> bool:
    """``ids == set(range(n))`` without building the range (n may be absurd)."""
    return len(ids) == n and (n == 0 or (min(ids) == 0 and max(ids) == n - 1))


def _span(ids: set[int]) -> str:
    return f"{min(ids)}..{max(ids)}" if ids else "none"


def _check_quant(ck: ckpt.Checkpoint) -> None:
    q = ck.quantization
    file = os.path.join(ck.path, MO.QUANT_CONFIG_FILE)
    if not os.path.exists(file):
        file = os.path.join(ck.path, "config.json")
    sizes = [("group_size", q.get("group_size"))]
    for g, spec in (q.get("config_groups") or {}).items():
        for part in ("weights", "input_activations"):
            v = (spec or {}).get(part) or {}
            if isinstance(v, dict):
                sizes.append((f"config_groups.{g}.{part}.group_size", v.get("group_size")))
    for key, v in sizes:
        if v is not None and v != GROUP_SIZE:
            raise ckpt.CheckpointError(file, None, f"{key} is {v!r}; NVFP4 has one E4M3 scale "
                                       f"per {GROUP_SIZE} values")


#: tensor names (their last part) of a quantized KV cache: ModelOpt's ``k_proj.k_scale`` /
#: ``v_proj.v_scale`` (amax / 448), an affine cache's biases, others' ``self_attn.k_scale``.
#: The decoders keep K and V in bf16 and do not apply them (the loader says so).
KV_CACHE_TENSORS = ("k_scale", "v_scale", "k_bias", "v_bias")

#: why a tensor beside a read module's would change the layer's arithmetic, by its last part
_UNREAD_WHY = {
    "bias": "a bias, which the decoder's linears and RMSNorms do not have (config.json "
            "attention_bias / mlp_bias are not supported)",
    "pre_quant_scale": "an AWQ pre-quantization scale of the linear's input, which nvfp4_jax "
                       "does not apply",
}


class _Expect:
    """Collects the first mismatch between the tensors the config implies and the files, and
    the tensors it looked at (``read``) and their modules (``modules``: a tensor's name up to
    its last dot)."""

    def __init__(self, ck: ckpt.Checkpoint):
        self.ck = ck
        self.names = set(ck.names())
        self.read: set[str] = set()
        self.modules: set[str] = set()

    def fail(self, name: str, reason: str):
        file = self.ck.file_of(name) if name in self.names else self.ck.path
        raise ckpt.CheckpointError(file, name, reason)

    def has(self, name: str, what: str) -> None:
        if name not in self.names:
            self.fail(name, f"missing ({what})")
        self.read.add(name)
        self.modules.add(name.rpartition(".")[0])

    def unread(self) -> list[str]:
        """Refuse (``CheckpointError``, the first by name) a tensor that sits beside the tensors
        of a module the checks read (same name up to its last dot) and is neither read nor a
        KV-cache tensor; return the KV-cache tensors (``KV_CACHE_TENSORS``, under whichever
        module: ModelOpt's ``k_proj.k_scale``, others' ``self_attn.k_scale``), sorted. Tensors
        of modules the decoder does not use at all (a speculative-decoding head, say) are left
        alone."""
        kv = []
        for n in sorted(self.names - self.read):
            module, _, leaf = n.rpartition(".")
            if leaf in KV_CACHE_TENSORS:
                kv.append(n)
                continue
            if module not in self.modules:
                continue
            why = _UNREAD_WHY.get(leaf, f"not a tensor the decoder reads for {module}")
            self.fail(n, f"{why}; refusing rather than running without it")
        return kv

    def float_tensor(self, name: str, dims: list[tuple[str, int]]) -> None:
        want = [n for _, n in dims]
        what = "[" + ", ".join(f"{k} = {n}" for k, n in dims) + "]"
        self.has(name, f"expected a float tensor {what}")
        dt, shape = self.ck.dtype(name), list(self.ck.shape(name))
        if dt not in FLOAT_DTYPES:
            self.fail(name, f"dtype {dt}, expected one of {', '.join(FLOAT_DTYPES)}")
        if shape != want:
            self.fail(name, f"shape {shape}, expected {want} ({what} from config.json)")

    def linear(self, prefix: str, dims: list[tuple[str, int]]) -> None:
        """An NVFP4 linear (codes U8 [N, K/2], E4M3 scales [N, K/16], scalars and, as quant_algo
        NVFP4 is W4A4, an input_scale) or, without ``weight_scale``/``weight_scale_2`` and with a
        float weight, a bf16 weight [N, K]."""
        (nk, n), (kk, k) = dims
        w, s, s2 = (f"{prefix}.{x}" for x in (MO.WEIGHT, MO.WEIGHT_SCALE, MO.WEIGHT_SCALE_2))
        what = f"[{nk} = {n}, {kk} = {k}]"
        self.has(w, f"expected the weight of a {what} linear")
        nvfp4 = s in self.names or s2 in self.names or self.ck.dtype(w) == "U8"
        if not nvfp4:
            self.float_tensor(w, dims)
            return
        for name, part in ((s, "its E4M3 block scales"), (s2, "its weight_scale_2")):
            self.has(name, f"{w} is NVFP4 ({self.ck.dtype(w)}), so it needs {part}")
        self.has(f"{prefix}.{MO.INPUT_SCALE}",
                 "quant_algo NVFP4 is W4A4: every quantized linear has an input_scale")
        if self.ck.dtype(w) != "U8":
            self.fail(w, f"dtype {self.ck.dtype(w)}, expected U8 (packed E2M1 codes)")
        if k % GROUP_SIZE:
            self.fail(w, f"{kk} = {k} is not a multiple of {GROUP_SIZE}")
        for name, want, kind in ((w, [n, k // 2], "packed E2M1 codes [N, K/2]"),
                                 (s, [n, k // GROUP_SIZE], "E4M3 block scales [N, K/16]")):
            shape = list(self.ck.shape(name))
            if shape != want:
                self.fail(name, f"shape {shape}, expected {want} ({kind} of a {what} linear "
                                "from config.json)")


def _check_layer_range(e, conf: str, base: str, n: int, claim: str) -> None:
    """``CheckpointError`` on config.json unless the files hold exactly ``base``.layers.0..n-1
    (``claim``: what config.json says, for the message)."""
    layers = _indices(e.names, rf"{re.escape(base)}\.layers\.(\d+)\.")
    if not _is_range(layers, n):
        extra = sorted(i for i in layers if i >= n)
        at = f"holds {base}.layers.{extra[0]}" if extra else \
            f"has no {base}.layers.{min(set(range(len(layers) + 1)) - layers)}"
        raise ckpt.CheckpointError(conf, None, f"{claim} but the checkpoint {at} "
                                   f"(layers {_span(layers)})")


def check_tensors(ck: ckpt.Checkpoint, cfg: DecoderConfig) -> list[str]:
    """Raise ``CheckpointError`` unless the checkpoint holds exactly the layers and experts of
    ``cfg`` and every tensor the decoder reads, with its dtype and shape (headers only), and
    nothing beside a read module's tensors that the decoder would drop (``_Expect.unread``).
    Returns the KV-cache tensors (``KV_CACHE_TENSORS``), which the decoder does not apply."""
    _check_quant(ck)
    e = _Expect(ck)
    conf = os.path.join(ck.path, "config.json")
    _check_layer_range(e, conf, "model", cfg.num_layers, f"num_hidden_layers is {cfg.num_layers}")
    h, v, d = ("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size), cfg.head_dim
    q = ("num_attention_heads * head_dim", cfg.num_heads * d)
    kv = ("num_key_value_heads * head_dim", cfg.num_kv_heads * d)
    e.float_tensor("model.embed_tokens.weight", [v, h])
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}"
        for n in ("input_layernorm", "post_attention_layernorm"):
            e.float_tensor(f"{pre}.{n}.weight", [h])
        a = f"{pre}.self_attn"
        for n, dims in (("q_proj", [q, h]), ("k_proj", [kv, h]), ("v_proj", [kv, h]),
                        ("o_proj", [h, q])):
            e.linear(f"{a}.{n}", dims)
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                e.float_tensor(f"{a}.{n}.weight", [("head_dim", d)])
        if i in cfg.moe_layers:
            m = f"{pre}.mlp"
            have = _indices(e.names, rf"{re.escape(m)}\.experts\.(\d+)\.")
            if not _is_range(have, cfg.num_experts):
                raise ckpt.CheckpointError(conf, None, f"num_experts is {cfg.num_experts} but "
                                           f"the checkpoint has {m}.experts {_span(have)} "
                                           f"({len(have)})")
            e.float_tensor(f"{m}.gate.weight", [("num_experts", cfg.num_experts), h])
            mi = ("moe_intermediate_size", cfg.moe_intermediate_size)
            for x in range(cfg.num_experts):
                for n, dims in (("gate_proj", [mi, h]), ("up_proj", [mi, h]),
                                ("down_proj", [h, mi])):
                    e.linear(f"{m}.experts.{x}.{n}", dims)
        else:
            mi = ("intermediate_size", cfg.intermediate_size)
            for n, dims in (("gate_proj", [mi, h]), ("up_proj", [mi, h]), ("down_proj", [h, mi])):
                e.linear(f"{pre}.mlp.{n}", dims)
    e.float_tensor("model.norm.weight", [h])
    if "lm_head.weight" in e.names:
        e.linear("lm_head", [v, h])
    elif not cfg.tie_word_embeddings:
        e.fail("lm_head.weight", "missing, and config.json's tie_word_embeddings is false")
    return e.unread()


#: config.json integer keys a Nemotron-H layer type reads (besides vocab_size, hidden_size)
_NH_REQUIRED = {"*": ("num_attention_heads",), "-": ("intermediate_size",),
                "M": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size"),
                "E": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "moe_shared_expert_intermediate_size")}


def _nh_pattern(c: dict) -> str:
    """The layer pattern ("M", "E", "*", "-" per layer) of a Nemotron-H config.json, as
    ``NemotronHConfig.from_hf`` reads it: ``layers_block_type`` (or ``layer_types``), else
    ``hybrid_override_pattern``."""
    key = next((k for k in ("layers_block_type", "layer_types") if c.get(k) not in (None, [])),
               None)
    if key is not None:
        types = c[key]
        if not isinstance(types, list):
            raise _bad(key, f"a list of {sorted(LAYER_TYPES)}", types)
        if len(types) > MAX_LAYERS:
            raise _bad(key, f"at most {MAX_LAYERS} layers", f"{len(types)} layers")
        unknown = [t for t in types if not isinstance(t, str) or t not in LAYER_TYPES]
        if unknown:
            raise _bad(key, f"layer types among {sorted(LAYER_TYPES)}", unknown[0])
        return "".join(LAYER_TYPES[t] for t in types)
    pat = c.get("hybrid_override_pattern")
    if pat is None:
        raise ValueError("config.json: layers_block_type: missing (Nemotron-H needs "
                         "layers_block_type or hybrid_override_pattern)")
    if not isinstance(pat, str) or not pat:
        raise _bad("hybrid_override_pattern", "a string of 'M', 'E', '*', '-'", pat)
    if len(pat) > MAX_LAYERS:
        raise _bad("hybrid_override_pattern", f"at most {MAX_LAYERS} layers",
                   f"{len(pat)} layers")
    bad = sorted({ch for ch in pat if ch not in "ME*-"})
    if bad:
        raise _bad("hybrid_override_pattern", "only 'M' (Mamba2), 'E' (MoE), '*' (attention), "
                   f"'-' (MLP); it has {bad}", pat)
    return pat


def check_nemotron_h_config(c: dict) -> None:
    """Raise ``ValueError`` naming the config.json key when a value the Nemotron-H model reads
    has the wrong type or range, or values disagree: the layer pattern (``layers_block_type``
    or ``hybrid_override_pattern``: known types only, as many as ``num_hidden_layers``), the
    sizes each layer type in it reads, heads and KV heads, Mamba heads and ``n_groups``, experts
    and top-k."""
    for key in ("vocab_size", "hidden_size"):
        _int(c, key, required=True)
    pat = _nh_pattern(c)
    n = _int(c, "num_hidden_layers")
    if n is not None and n != len(pat):
        key = "hybrid_override_pattern" if "hybrid_override_pattern" in c and not any(
            c.get(k) for k in ("layers_block_type", "layer_types")) else "layers_block_type"
        raise ValueError(f"config.json: num_hidden_layers is {n} but {key} names {len(pat)} "
                         "layers")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                "mamba_n_groups", "conv_kernel", "mamba_d_conv", "num_experts_per_tok",
                "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                "max_position_embeddings", "n_group", "topk_group"):
        _int(c, key)
    _int(c, "n_routed_experts", lo=0)
    for key in ("layer_norm_epsilon", "routed_scaling_factor"):
        _positive(c, key)
    t = c.get("time_step_min")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                          or not math.isfinite(t) or t < 0):
        raise _bad("time_step_min", "a finite number >= 0", t)
    for key in ("tie_word_embeddings", "norm_topk_prob", "use_conv_bias"):
        if key in c and not isinstance(c[key], bool):
            raise _bad(key, "true or false", c[key])
    for letter in sorted(set(pat)):
        for key in _NH_REQUIRED[letter]:
            if not c.get(key):
                raise ValueError(f"config.json: {key}: missing (expected an integer >= 1: the "
                                 f"pattern has {letter!r} layers)")
    if "*" in pat:
        nh = c["num_attention_heads"]
        kvh = c.get("num_key_value_heads") or nh
        if nh % kvh:
            raise ValueError(f"config.json: num_attention_heads ({nh}) must be a multiple of "
                             f"num_key_value_heads ({kvh})")
        if not c.get("head_dim") and c["hidden_size"] % nh:
            raise ValueError(f"config.json: hidden_size ({c['hidden_size']}) is not a multiple "
                             f"of num_attention_heads ({nh}) and no head_dim is given")
    if "M" in pat:
        g = c.get("n_groups") or c.get("mamba_n_groups") or 1
        if c["mamba_num_heads"] % g:
            raise ValueError(f"config.json: mamba_num_heads ({c['mamba_num_heads']}) must be a "
                             f"multiple of n_groups ({g}): B and C are shared per group")
    if "E" in pat:
        e, k = c["n_routed_experts"], c["num_experts_per_tok"]
        if k > e:
            raise _bad("num_experts_per_tok", f"1..{e} (n_routed_experts)", k)


def check_nemotron_h_tensors(ck: ckpt.Checkpoint, cfg: NemotronHConfig) -> list[str]:
    """Raise ``CheckpointError`` unless the checkpoint holds exactly the layers of ``cfg``'s
    pattern and every tensor each layer type reads, with its dtype and shape (headers only),
    under ``backbone.`` (NVIDIA's and ModelOpt's names) or ``model.``, and nothing beside a read
    module's tensors that the model would drop; returns the KV-cache tensors
    (``check_tensors``)."""
    _check_quant(ck)
    e = _Expect(ck)
    conf = os.path.join(ck.path, "config.json")
    base = "backbone" if "backbone.embeddings.weight" in e.names else "model"
    _check_layer_range(e, conf, base, cfg.num_layers,
                       f"the layer pattern names {cfg.num_layers} layers")
    h, v = ("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)
    e.float_tensor(f"{base}.embeddings.weight", [v, h])
    inner = ("mamba_num_heads * mamba_head_dim", cfg.mamba_inner)
    heads = ("mamba_num_heads", cfg.mamba_num_heads)
    cdim = ("conv_dim", cfg.conv_dim)
    proj = ("2 * inner + 2 * n_groups * ssm_state_size + mamba_num_heads",
            cfg.mamba_inner + cfg.conv_dim + cfg.mamba_num_heads)
    q = ("num_attention_heads * head_dim", cfg.num_heads * cfg.head_dim)
    kv = ("num_key_value_heads * head_dim", cfg.num_kv_heads * cfg.head_dim)
    for i, kind in enumerate(cfg.layer_types):
        e.float_tensor(f"{base}.layers.{i}.norm.weight", [h])
        pre = f"{base}.layers.{i}.mixer"
        if kind == "M":
            e.linear(f"{pre}.in_proj", [proj, h])
            e.linear(f"{pre}.out_proj", [h, inner])
            conv, k = f"{pre}.conv1d.weight", ("conv_kernel", cfg.conv_kernel)
            if not (conv in e.names and list(ck.shape(conv)) == [cdim[1], k[1]]):
                e.float_tensor(conv, [cdim, ("depthwise", 1), k])  # HF's [C, 1, K] (or [C, K])
            e.has(conv, "the depthwise conv's weight")
            bias = f"{pre}.conv1d.bias"
            if cfg.use_conv_bias:
                e.float_tensor(bias, [cdim])
            elif bias in e.names:
                e.fail(bias, "present, but config.json's use_conv_bias is false")
            for n in ("A_log", "D", "dt_bias"):
                e.float_tensor(f"{pre}.{n}", [heads])
            e.float_tensor(f"{pre}.norm.weight", [inner])
        elif kind == "*":
            for n, dims in (("q_proj", [q, h]), ("k_proj", [kv, h]), ("v_proj", [kv, h]),
                            ("o_proj", [h, q])):
                e.linear(f"{pre}.{n}", dims)
        elif kind == "-":
            mi = ("intermediate_size", cfg.intermediate_size)
            e.linear(f"{pre}.up_proj", [mi, h])
            e.linear(f"{pre}.down_proj", [h, mi])
        else:
            ne = ("n_routed_experts", cfg.num_experts)
            have = _indices(e.names, rf"{re.escape(pre)}\.experts\.(\d+)\.")
            if not _is_range(have, cfg.num_experts):
                raise ckpt.CheckpointError(conf, None, f"n_routed_experts is {cfg.num_experts} "
                                           f"but the checkpoint has {pre}.experts "
                                           f"{_span(have)} ({len(have)})")
            e.float_tensor(f"{pre}.gate.weight", [ne, h])
            if f"{pre}.gate.e_score_correction_bias" in e.names:
                e.float_tensor(f"{pre}.gate.e_score_correction_bias", [ne])
            mi = ("moe_intermediate_size", cfg.moe_intermediate_size)
            for x in range(cfg.num_experts):
                e.linear(f"{pre}.experts.{x}.up_proj", [mi, h])
                e.linear(f"{pre}.experts.{x}.down_proj", [h, mi])
            si = ("moe_shared_expert_intermediate_size", cfg.moe_shared_expert_intermediate_size)
            e.linear(f"{pre}.shared_experts.up_proj", [si, h])
            e.linear(f"{pre}.shared_experts.down_proj", [h, si])
    e.float_tensor(f"{base}.norm_f.weight", [h])
    if "lm_head.weight" in e.names:
        e.linear("lm_head", [v, h])
    elif not cfg.tie_word_embeddings:
        e.fail("lm_head.weight", "missing, and config.json's tie_word_embeddings is false")
    return e.unread()
