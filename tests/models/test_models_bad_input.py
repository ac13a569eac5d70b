"""``models.load_model`` and ``nvfp4 generate`` refuse bad input with a clear error.

Every case starts from a tiny ModelOpt NVFP4 export (``hf_reference.make_checkpoint``, built
once per module, dense Llama and Qwen3-MoE), copies it, damages one thing (config.json, the
quantization config, one tensor, the shard index, the file itself) and expects a ``ValueError``
(``checkpoint.CheckpointError`` where a file is at fault) whose message names the file, tensor
or key and what was expected; never a KeyError/TypeError traceback, a NaN, or a model that
loads and computes something else. Sizes are checked against the tensors' headers before any
tensor is read, so an absurd config (vocab 10^12) allocates nothing. The CLI cases expect exit
code 2 and one line on stderr without a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("modelopt.torch.quantization")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_reference import make_checkpoint, save_char_tokenizer

from nvfp4_jax import checkpoint as C
from nvfp4_jax import models
from nvfp4_jax.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ST = "model.safetensors"
L0 = "model.layers.0"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad-model-src")
    return {k: make_checkpoint(k, str(base / k)) for k in ("dense", "moe")}


# ---------------------------------------------------------------------------------------
# damage helpers: each takes the copied checkpoint directory
# ---------------------------------------------------------------------------------------

def _json_edit(name: str, fn):
    def damage(d):
        p = os.path.join(d, name)
        with open(p) as f:
            c = json.load(f)
        fn(c)
        with open(p, "w") as f:
            json.dump(c, f)
    return damage


def cfg(**kv):
    """config.json with keys set (a value None deletes the key)."""
    def fn(c):
        for k, v in kv.items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = v
    return _json_edit("config.json", fn)


def quant(**kv):
    """hf_quant_config.json's "quantization" with keys set (and config.json's
    quantization_config alike, so that neither disagrees)."""
    def fn_hf(c):
        c["quantization"].update(kv)

    def fn_cfg(c):
        c["quantization_config"].update(kv)

    def damage(d):
        _json_edit("hf_quant_config.json", fn_hf)(d)
        _json_edit("config.json", fn_cfg)(d)
    return damage


def no_quant_config(d):
    os.remove(os.path.join(d, "hf_quant_config.json"))
    cfg(quantization_config=None)(d)


def _read_all(d) -> dict:
    f = C.SafetensorsFile(os.path.join(d, ST))
    out = {}
    for n in f.names():
        a = f.get(n)
        dt = f.dtype(n)
        out[n] = (a.view(np.uint16) if dt == "BF16" else a, dt)
    return out


def tensors(fn):
    """Rewrite model.safetensors with ``fn(tensors)`` applied to {name: (array, dtype)}."""
    def damage(d):
        t = _read_all(d)
        fn(t)
        C.write_safetensors(os.path.join(d, ST), t, {"format": "pt"})
    return damage


def drop(name):
    return tensors(lambda t: t.pop(name))


def put(name, array, dtype):
    def fn(t):
        t[name] = (np.asarray(array), dtype)
    return tensors(fn)


def scalar(name, value):
    return put(name, np.array(value, np.float32), "F32")


def retype(name, dtype, np_dtype):
    def fn(t):
        a, _ = t[name]
        t[name] = (a.astype(np_dtype), dtype)
    return tensors(fn)


def reshape_linear(prefix, n, k):
    """A consistent NVFP4 linear [n, k] (codes and block scales agree) of another shape."""
    def fn(t):
        t[f"{prefix}.weight"] = (np.full((n, k // 2), 0x11, np.uint8), "U8")
        t[f"{prefix}.weight_scale"] = (np.full((n, k // 16), 0x38, np.uint8), "F8_E4M3")
    return tensors(fn)


def _bf16_linear(prefix, n, k):
    """An excluded (unquantized) linear: a bf16 weight [n, k] and no scales."""
    def fn(t):
        for x in ("weight_scale", "weight_scale_2", "input_scale"):
            t.pop(f"{prefix}.{x}")
        t[f"{prefix}.weight"] = (np.full((n, k), 0x3C00, np.uint16), "BF16")  # bf16 1.0
    return tensors(fn)


def _then(*damages):
    """The damages one after another."""
    def damage(d):
        for fn in damages:
            fn(d)
    return damage


def truncate(d):
    p = os.path.join(d, ST)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 1000)


def sharded(extra: dict | None = None, missing_shard: bool = False):
    """Split into two shards with an index (``extra``: more weight_map entries)."""
    def damage(d):
        t = _read_all(d)
        names = sorted(t)
        half = len(names) // 2
        wm = {}
        for i, part in enumerate((names[:half], names[half:])):
            fn = f"model-0000{i + 1}-of-00002.safetensors"
            if not (missing_shard and i == 1):
                C.write_safetensors(os.path.join(d, fn), {n: t[n] for n in part})
            wm.update({n: fn for n in part})
        wm.update(extra or {})
        os.remove(os.path.join(d, ST))
        with open(os.path.join(d, C.INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)
    return damage


def rm(name):
    return lambda d: os.remove(os.path.join(d, name))


def write(name, text):
    def damage(d):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    return damage


# (id, checkpoint, damage, substrings the error names)
CASES = [
    # config.json
    ("config-missing", "dense", rm("config.json"), ["config.json", "missing"]),
    ("config-not-json", "dense", write("config.json", "{not json"), ["config.json", "JSON"]),
    ("config-a-list", "dense", write("config.json", "[1, 2]"), ["config.json", "JSON object"]),
    ("arch-absent", "dense", cfg(architectures=None), ["architectures"]),
    ("arch-unsupported", "dense", cfg(architectures=["GPT2LMHeadModel"]),
     ["architectures", "GPT2LMHeadModel"]),
    ("arch-not-a-list", "dense", cfg(architectures="LlamaForCausalLM"),
     ["architectures", "a list of class names"]),
    ("arch-unsupported-other-keys", "dense", cfg(architectures=["GPT2LMHeadModel"],
                                                  hidden_size=None, n_embd=64),
     ["architectures[0] is 'GPT2LMHeadModel'", "supported"]),
    ("arch-a-number", "dense", cfg(architectures=5), ["architectures", "got 5"]),
    ("arch-an-object", "dense", cfg(architectures={"0": "LlamaForCausalLM"}), ["architectures"]),
    ("rope-type-unknown", "dense", cfg(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     ["rope_parameters.rope_type", "yarn"]),
    ("llama3-rope-incomplete", "dense", cfg(rope_parameters={"rope_type": "llama3",
                                                              "factor": 8.0}),
     ["rope_parameters.low_freq_factor", "missing"]),
    ("hidden_size-missing", "dense", cfg(hidden_size=None), ["config.json", "hidden_size"]),
    ("heads-missing", "dense", cfg(num_attention_heads=None), ["num_attention_heads"]),
    ("layers-missing", "dense", cfg(num_hidden_layers=None), ["num_hidden_layers"]),
    ("vocab-missing", "dense", cfg(vocab_size=None), ["vocab_size"]),
    ("hidden_size-string", "dense", cfg(hidden_size="64"), ["hidden_size", "integer"]),
    ("hidden_size-float", "dense", cfg(hidden_size=64.5), ["hidden_size", "integer"]),
    ("layers-bool", "dense", cfg(num_hidden_layers=True), ["num_hidden_layers", "integer"]),
    ("layers-null", "dense", cfg(num_hidden_layers="null"), ["num_hidden_layers"]),
    ("heads-zero", "dense", cfg(num_attention_heads=0), ["num_attention_heads", ">= 1"]),
    ("layers-negative", "dense", cfg(num_hidden_layers=-1), ["num_hidden_layers"]),
    ("eps-string", "dense", cfg(rms_norm_eps="tiny"), ["rms_norm_eps"]),
    ("eps-negative", "dense", cfg(rms_norm_eps=-1e-6), ["rms_norm_eps"]),
    ("rope-theta-zero", "dense", cfg(rope_theta=0, rope_parameters=None), ["rope_theta"]),
    ("kv-heads-not-divisor", "dense", cfg(num_key_value_heads=3),
     ["num_attention_heads", "num_key_value_heads"]),
    ("head-dim-vs-q-proj", "dense", cfg(head_dim=32), ["q_proj", "head_dim"]),
    ("hidden-vs-tensors", "dense", cfg(hidden_size=128, head_dim=16), ["hidden_size"]),
    ("intermediate-vs-tensors", "dense", cfg(intermediate_size=256), ["intermediate_size"]),
    ("vocab-huge", "dense", cfg(vocab_size=10**12), ["vocab_size", "embed_tokens"]),
    ("hidden-huge", "dense", cfg(hidden_size=10**12, head_dim=16), ["hidden_size"]),
    ("layers-huge", "dense", cfg(num_hidden_layers=10**9), ["num_hidden_layers"]),
    ("layers-more-than-file", "moe", cfg(num_hidden_layers=3),
     ["config.json", "num_hidden_layers", "no model.layers.2"]),
    ("experts-huge", "moe", cfg(num_local_experts=10**12),
     ["config.json", "num_experts", "experts 0..3"]),
    ("layers-fewer-than-file", "dense", cfg(num_hidden_layers=1),
     ["num_hidden_layers", "model.layers.1"]),
    ("max-pos-zero", "dense", cfg(max_position_embeddings=0), ["max_position_embeddings"]),
    ("partial-rotary", "dense", cfg(partial_rotary_factor=0.5),
     ["partial_rotary_factor", "whole heads", "0.5"]),
    ("sliding-window-zero", "dense", cfg(architectures=["MistralForCausalLM"], sliding_window=0),
     ["sliding_window", ">= 1", "got 0"]),
    ("sliding-window-string", "moe", cfg(use_sliding_window=True, sliding_window="8"),
     ["sliding_window", "integer"]),
    ("use-sliding-window-string", "moe", cfg(use_sliding_window="yes"),
     ["use_sliding_window", "true or false"]),
    ("hidden-act", "dense", cfg(hidden_act="gelu"), ["hidden_act"]),
    ("topk-above-experts", "moe", cfg(num_experts_per_tok=5),
     ["num_experts_per_tok", "num_experts"]),
    ("topk-zero", "moe", cfg(num_experts_per_tok=0), ["num_experts_per_tok"]),
    ("experts-vs-tensors", "moe", cfg(num_local_experts=8), ["experts"]),
    ("moe-width-vs-tensors", "moe", cfg(moe_intermediate_size=64), ["moe_intermediate_size"]),
    # quantization config
    ("quant-missing", "dense", no_quant_config, ["hf_quant_config.json"]),
    ("quant-fp8", "dense", quant(quant_algo="FP8"), ["quant_algo", "FP8"]),
    ("quant-awq", "dense", quant(quant_algo="W4A16_AWQ"), ["quant_algo", "W4A16_AWQ"]),
    ("quant-group-32", "dense", quant(group_size=32), ["group_size", "32", "16"]),
    # safetensors: index and shards
    ("index-missing-shard", "dense", sharded(missing_shard=True),
     ["model-00002-of-00002.safetensors", "not a file"]),
    ("index-lists-absent-tensor", "dense", sharded({"model.extra.weight":
                                                    "model-00001-of-00002.safetensors"}),
     ["model.extra.weight", "not in this shard"]),
    ("truncated-shard", "dense", truncate, [ST]),
    # safetensors: tensors
    ("norm-absent", "dense", drop("model.norm.weight"), ["model.norm.weight", "missing"]),
    ("embed-absent", "dense", drop("model.embed_tokens.weight"), ["model.embed_tokens.weight"]),
    ("q-weight-absent", "dense", drop(f"{L0}.self_attn.q_proj.weight"),
     [f"{L0}.self_attn.q_proj.weight"]),
    ("q-norm-absent", "moe", drop(f"{L0}.self_attn.q_norm.weight"),
     [f"{L0}.self_attn.q_norm.weight"]),
    ("router-absent", "moe", drop(f"{L0}.mlp.gate.weight"), [f"{L0}.mlp.gate.weight"]),
    ("expert-absent", "moe", drop(f"{L0}.mlp.experts.3.down_proj.weight"),
     [f"{L0}.mlp.experts.3.down_proj"]),
    ("weight_scale_2-absent", "dense", drop(f"{L0}.mlp.up_proj.weight_scale_2"),
     [f"{L0}.mlp.up_proj.weight_scale_2"]),
    ("weight_scale-absent", "dense", drop(f"{L0}.mlp.up_proj.weight_scale"),
     [f"{L0}.mlp.up_proj.weight_scale"]),
    ("input_scale-absent", "dense", drop(f"{L0}.self_attn.k_proj.input_scale"),
     [f"{L0}.self_attn.k_proj.input_scale"]),
    ("expert-input_scale-absent", "moe", drop(f"{L0}.mlp.experts.1.up_proj.input_scale"),
     [f"{L0}.mlp.experts.1.up_proj.input_scale"]),
    ("weight-not-u8", "dense", retype(f"{L0}.mlp.up_proj.weight", "I8", np.int8),
     [f"{L0}.mlp.up_proj.weight", "U8"]),
    ("weight_scale-f32", "dense", retype(f"{L0}.mlp.up_proj.weight_scale", "F32", np.float32),
     [f"{L0}.mlp.up_proj.weight_scale", "F8_E4M3"]),
    ("weight-wrong-k", "dense", reshape_linear(f"{L0}.mlp.up_proj", 128, 32),
     [f"{L0}.mlp.up_proj.weight", "[128, 32]"]),
    ("weight-wrong-n", "dense", reshape_linear(f"{L0}.self_attn.k_proj", 48, 64),
     [f"{L0}.self_attn.k_proj.weight", "[32, 32]"]),
    ("weight_scale-wrong-shape", "dense",
     put(f"{L0}.mlp.up_proj.weight_scale", np.full((128, 2), 0x38, np.uint8), "F8_E4M3"),
     [f"{L0}.mlp.up_proj.weight_scale", "[128, 4]"]),
    ("expert-wrong-shape", "moe", reshape_linear(f"{L0}.mlp.experts.2.gate_proj", 32, 32),
     [f"{L0}.mlp.experts.2.gate_proj.weight"]),
    ("embed-wrong-shape", "dense", put("model.embed_tokens.weight",
                                       np.zeros((256, 32), np.uint16), "BF16"),
     ["model.embed_tokens.weight", "[256, 64]"]),
    ("norm-wrong-dtype", "dense", put("model.norm.weight", np.ones(64, np.int32), "I32"),
     ["model.norm.weight", "I32"]),
    ("lm_head-wrong-shape", "dense", put("lm_head.weight", np.zeros((255, 64), np.uint16),
                                         "BF16"), ["lm_head.weight", "[256, 64]"]),
    ("lm_head-absent-untied", "dense", drop("lm_head.weight"),
     ["lm_head.weight", "tie_word_embeddings"]),
    ("ws2-nan", "dense", scalar(f"{L0}.mlp.up_proj.weight_scale_2", np.nan),
     [f"{L0}.mlp.up_proj.weight_scale_2", "finite positive"]),
    ("ws2-inf", "dense", scalar(f"{L0}.mlp.up_proj.weight_scale_2", np.inf),
     [f"{L0}.mlp.up_proj.weight_scale_2", "finite positive"]),
    ("ws2-zero", "dense", scalar(f"{L0}.mlp.up_proj.weight_scale_2", 0.0),
     [f"{L0}.mlp.up_proj.weight_scale_2", "finite positive"]),
    ("ws2-negative", "dense", scalar(f"{L0}.mlp.up_proj.weight_scale_2", -1e-3),
     [f"{L0}.mlp.up_proj.weight_scale_2", "finite positive"]),
    ("input_scale-nan", "dense", scalar(f"{L0}.self_attn.o_proj.input_scale", np.nan),
     [f"{L0}.self_attn.o_proj.input_scale", "finite positive"]),
    ("input_scale-zero", "moe", scalar(f"{L0}.mlp.experts.0.down_proj.input_scale", 0.0),
     [f"{L0}.mlp.experts.0.down_proj.input_scale", "finite positive"]),
    ("input_scale-negative", "dense", scalar(f"{L0}.mlp.down_proj.input_scale", -0.5),
     [f"{L0}.mlp.down_proj.input_scale", "finite positive"]),
    ("weight_scale-nan-byte", "dense",
     put(f"{L0}.mlp.up_proj.weight_scale", np.full((128, 4), 0x7F, np.uint8), "F8_E4M3"),
     [f"{L0}.mlp.up_proj.weight_scale", "NaN"]),
    # tensors beside a read module's, which the decoder would run without
    ("q-proj-bias", "dense", put(f"{L0}.self_attn.q_proj.bias", np.zeros(64, np.uint16), "BF16"),
     [f"{L0}.self_attn.q_proj.bias", "a bias", "attention_bias", "refusing"]),
    ("excluded-linear-bias", "dense", _then(_bf16_linear(f"{L0}.mlp.up_proj", 128, 64),
                                            put(f"{L0}.mlp.up_proj.bias", np.zeros(128, np.uint16),
                                                "BF16")),
     [f"{L0}.mlp.up_proj.bias", "a bias"]),
    ("awq-pre-quant-scale", "dense",
     put(f"{L0}.mlp.up_proj.pre_quant_scale", np.full(64, 0x3F80, np.uint16), "BF16"),
     [f"{L0}.mlp.up_proj.pre_quant_scale", "AWQ", "refusing"]),
    ("norm-bias", "moe", put(f"{L0}.input_layernorm.bias", np.zeros(64, np.uint16), "BF16"),
     [f"{L0}.input_layernorm.bias", "a bias"]),
    ("expert-extra-tensor", "moe",
     scalar(f"{L0}.mlp.experts.1.down_proj.output_scale", 1.0),
     [f"{L0}.mlp.experts.1.down_proj.output_scale", "not a tensor the decoder reads",
      f"{L0}.mlp.experts.1.down_proj"]),
]


def _damaged(pristine, tmp_path, kind, damage) -> str:
    d = str(tmp_path / "ck")
    shutil.copytree(pristine[kind], d)
    damage(d)
    return d


@pytest.mark.parametrize("case,kind,damage,needles", CASES, ids=[c[0] for c in CASES])
def test_load_model_refuses(pristine, tmp_path, case, kind, damage, needles):
    d = _damaged(pristine, tmp_path, kind, damage)
    with pytest.raises(ValueError) as exc:
        models.load_model(d)
    msg = str(exc.value)
    for n in needles:
        assert n in msg, f"{case}: {n!r} not in {msg!r}"


def _untie(d):
    drop("lm_head.weight")(d)
    cfg(tie_word_embeddings=True)(d)


#: unusual but valid exports: they load
FINE = [
    ("weight_scale-as-u8", "dense", retype(f"{L0}.mlp.up_proj.weight_scale", "U8", np.uint8)),
    ("excluded-linear-bf16", "dense", _bf16_linear(f"{L0}.self_attn.q_proj", 64, 64)),
    ("tied-lm-head", "dense", _untie),
    ("head_dim-derived", "moe", cfg(head_dim=None)),
    ("quant-config-in-config-json", "dense", rm("hf_quant_config.json")),
    # a module the decoder does not use (a speculative-decoding head): left alone
    ("unused-module", "dense", put("mtp.layers.0.eh_proj.weight", np.zeros((64, 128), np.uint16),
                                   "BF16")),
]


@pytest.mark.parametrize("case,kind,damage", FINE, ids=[c[0] for c in FINE])
def test_load_model_accepts_unusual_but_valid(pristine, tmp_path, case, kind, damage):
    model = models.load_model(_damaged(pristine, tmp_path, kind, damage), stack=False)
    assert model.config.vocab_size == 256 and model.config.hidden_size == 64


# ---------------------------------------------------------------------------------------
# generate: arguments checked before the cache is allocated or anything compiles
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_model(pristine):
    return models.load_model(pristine["dense"])


GEN_CASES = [
    ("id-at-vocab", {"prompt": [[1, 256]]}, ["prompt", "[0, 256)", "got 256"]),
    ("id-negative", {"prompt": [[-1, 2]]}, ["prompt", "got -1"]),
    ("id-huge", {"prompt": [[10**30]]}, ["prompt", "int token ids"]),
    ("ids-float", {"prompt": np.array([[1.5, 2.0]])}, ["prompt", "float64"]),
    ("prompt-empty", {"prompt": np.zeros((1, 0), np.int32)}, ["prompt", "T >= 1"]),
    ("prompt-1d", {"prompt": np.array([1, 2])}, ["prompt", "[B, T]"]),
    ("new-zero", {"max_new_tokens": 0}, ["max_new_tokens", ">= 1"]),
    ("new-negative", {"max_new_tokens": -3}, ["max_new_tokens", ">= 1"]),
    ("new-float", {"max_new_tokens": 2.5}, ["max_new_tokens", "integer"]),
    ("new-beyond-positions", {"max_new_tokens": 255}, ["max_position_embeddings (256)",
                                                       "at most 253"]),
    ("new-absurd", {"max_new_tokens": 10**12}, ["max_position_embeddings"]),
    ("temperature-negative", {"temperature": -0.5}, ["temperature", ">= 0"]),
    ("temperature-nan", {"temperature": float("nan")}, ["temperature", "nan"]),
    ("temperature-inf", {"temperature": float("inf")}, ["temperature", "inf"]),
]


@pytest.mark.parametrize("case,kw,needles", GEN_CASES, ids=[c[0] for c in GEN_CASES])
def test_generate_refuses(dense_model, case, kw, needles):
    args = {"prompt": [[1, 2, 3]], "max_new_tokens": 4, **kw}
    with pytest.raises(ValueError) as exc:
        models.generate(dense_model, args.pop("prompt"), args.pop("max_new_tokens"), **args)
    for n in needles:
        assert n in str(exc.value), f"{case}: {n!r} not in {str(exc.value)!r}"


#: config.json sliding-window settings -> the window transformers (5.24.0) applies: its
#: config classes' sliding_window, where a layer is a sliding one (Qwen3: layer_types)
WINDOWS = [
    ("MistralForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": None}),
    ("MistralForCausalLM", {"sliding_window": 8}),
    ("Qwen3MoeForCausalLM", {"sliding_window": 8}),
    ("Qwen3MoeForCausalLM", {"sliding_window": 8, "use_sliding_window": True}),
    ("Qwen3MoeForCausalLM", {"sliding_window": None, "use_sliding_window": True}),
    ("Qwen3ForCausalLM", {"sliding_window": 8, "use_sliding_window": True}),
    ("Qwen3ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                          "max_window_layers": 1}),
    ("Qwen3ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                          "layer_types": ["full_attention", "sliding_attention"]}),
    ("Qwen3ForCausalLM", {"sliding_window": 8, "use_sliding_window": False,
                          "layer_types": ["full_attention", "sliding_attention"]}),
    ("LlamaForCausalLM", {"sliding_window": 8}),
]


@pytest.mark.parametrize("arch,kv", WINDOWS)
def test_sliding_window_is_the_one_transformers_applies(arch, kv):
    import transformers

    from nvfp4_jax.models.checks import sliding_window

    base = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "architectures": [arch]}
    hf = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**base, **kv)
    types = getattr(hf, "layer_types", None) or []
    want = hf.sliding_window if arch != "Qwen3ForCausalLM" or "sliding_attention" in types \
        else None
    if arch == "LlamaForCausalLM":
        want = None  # LlamaAttention has no window (its config keeps the unknown key)
    assert sliding_window({**base, **kv}) == want


def test_a_sliding_window_limits_sequences_to_it(pristine, tmp_path):
    """A Mistral config.json with sliding_window 8 on the dense export: 8 positions generate
    the tokens the same weights give as a Llama (no window); a 9th position is refused by
    ``generate`` and ``init_cache``, naming the window."""
    mistral = models.load_model(_damaged(pristine, tmp_path, "dense", cfg(
        architectures=["MistralForCausalLM"], sliding_window=8)))
    assert mistral.config.sliding_window == 8
    llama = models.load_model(pristine["dense"])
    assert llama.config.sliding_window is None
    got = models.generate(mistral, [[1, 2, 3]], 5, warmup=False, backend="xla").tokens
    want = models.generate(llama, [[1, 2, 3]], 5, warmup=False, backend="xla").tokens
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"exceed config.json's sliding_window \(8\).*at most 5"):
        models.generate(mistral, [[1, 2, 3]], 6)
    with pytest.raises(ValueError, match=r"^max_len: 9 positions exceed config.json's "
                                         r"sliding_window \(8\)"):
        models.init_cache(mistral.config, 1, 9)
    models.init_cache(mistral.config, 1, 8)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("bad_id", [-1, 256, 2**31 - 1])
def test_an_id_outside_the_vocabulary_gives_nan_in_its_sequence_only(pristine, kind, bad_id):
    """prefill and decode_step (traced ids: nothing can raise) with id ``bad_id`` at position 2
    of sequence 0: its logits from there on are NaN, and the next step's (the XLA prefill's
    attention multiplies the masked-out later keys' values by zero, so here the earlier
    positions' too); sequence 1 is bit for bit what it is beside a valid sequence 0. A clamped
    lookup would embed token 255, a wrapped one token 255 for -1."""
    model = models.load_model(pristine[kind])
    good = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)

    def run(tokens):
        cache = models.init_cache(model.config, 2, 6)
        logits, cache = models.prefill(model, tokens, cache, all_logits=True, backend="xla")
        step, _ = models.decode_step(model, jnp.asarray([1, 1], jnp.int32), cache,
                                     backend="xla")
        return np.asarray(logits), np.asarray(step)

    gl, gs = run(good)
    bl, bs = run(good.at[0, 2].set(bad_id))
    assert np.isfinite(gl).all() and np.isfinite(gs).all()
    assert np.isnan(bl[0, 2:]).all() and np.isnan(bs[0]).all()
    np.testing.assert_array_equal(bl[1], gl[1])
    np.testing.assert_array_equal(bs[1], gs[1])


def test_forward_refuses_tokens_that_are_not_int_ids(dense_model):
    cache = models.init_cache(dense_model.config, 1, 4)
    for tokens, what in ((jnp.ones((1, 2), jnp.float32), "float32 (1, 2)"),
                         (jnp.ones((2,), jnp.int32), "int32 (2,)"), ([[1, 2]], "list")):
        with pytest.raises(ValueError, match=r"^tokens: expected int token ids \[B, T\]") as e:
            models.forward(dense_model, tokens, cache)
        assert what in str(e.value)


def test_generate_accepts_the_last_position(dense_model):
    """prompt + new tokens == max_position_embeddings is allowed (the boundary)."""
    gen = models.generate(dense_model, [[1, 2, 3] * 83 + [4]], 6, warmup=False)
    assert gen.tokens.shape == (1, 6)


@pytest.mark.parametrize("kernel", [False, True])
def test_a_full_cache_gives_nan_logits_and_too_many_tokens_raise(dense_model, kernel,
                                                                   monkeypatch):
    """A decode step on a full cache cannot store its key and value: its logits are all NaN
    (the length is traced: no exception), through XLA's attention and through
    ``attention.decode_attention`` (interpreted here), which never reads past a sequence's
    slots. A prompt longer than the cache raises, naming tokens."""
    from nvfp4_jax.models import decoder

    if kernel:
        monkeypatch.setattr(decoder, "runs_kernel", lambda *a: True)
    step = jax.jit(lambda m, t, c: models.decode_step(m, t, c))  # traced anew, under the patch
    cache = models.init_cache(dense_model.config, 1, 4)
    logits, cache = models.prefill(dense_model, jnp.asarray([[1, 2, 3]], jnp.int32), cache)
    logits, cache = step(dense_model, jnp.asarray([4], jnp.int32), cache)  # the 4th: fits
    assert np.isfinite(np.asarray(logits)).all()
    logits, cache = step(dense_model, jnp.asarray([5], jnp.int32), cache)  # a 5th: no room
    assert np.isnan(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="tokens: 5 tokens do not fit the cache's 4 positions"):
        models.prefill(dense_model, jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32),
                       models.init_cache(dense_model.config, 1, 4))


def test_sample_refuses_non_finite_temperature():
    logits = np.zeros((1, 8), np.float32)
    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            models.sample(logits, None, t)


# ---------------------------------------------------------------------------------------
# nvfp4 generate: exit 2, one line on stderr, no traceback
# ---------------------------------------------------------------------------------------

def _last_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("nvfp4: ")]  # progress
    assert len(lines) == 1 and lines[0].startswith("nvfp4 generate: "), err
    return lines[0]


CLI_CASES = [
    ("new-zero", ["--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("new-beyond-positions", ["--prompt-ids", "1,2", "--max-new-tokens", "300"],
     "max_position_embeddings (256)"),
    ("temperature-nan", ["--prompt-ids", "1,2", "--temperature", "nan"], "--temperature"),
    ("id-at-vocab", ["--prompt-ids", "7,256", "--max-new-tokens", "2"], "[0, 256)"),
    ("json-no-dir", ["--prompt-ids", "1", "--json", "/nonexistent-dir/x.json"], "--json"),
    ("prompt-no-tokenizer", ["--prompt", "hi"], "needs a tokenizer"),
]


@pytest.mark.parametrize("case,argv,needle", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_generate_refuses(pristine, capsys, case, argv, needle):
    assert main(["generate", "--checkpoint", pristine["dense"], *argv]) == 2
    assert needle in _last_line_error(capsys)


def test_cli_generate_refuses_missing_dir_empty_prompt_and_damaged_checkpoint(
        pristine, tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "not a directory" in _last_line_error(capsys)
    d = _damaged(pristine, tmp_path, "dense", drop(f"{L0}.mlp.up_proj.weight_scale_2"))
    save_char_tokenizer(d)
    assert main(["generate", "--checkpoint", d, "--prompt", ""]) == 2
    assert "gives no tokens" in _last_line_error(capsys)
    assert main(["generate", "--checkpoint", d, "--prompt", chr(0x101)]) == 2
    assert f"{L0}.mlp.up_proj.weight_scale_2" in _last_line_error(capsys)


def generate_subprocess(checkpoint: str) -> subprocess.CompletedProcess:
    """``python -m nvfp4_jax.cli generate --checkpoint CHECKPOINT --prompt-ids 1,2`` in a new
    interpreter with the repository on its path."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "nvfp4_jax.cli", "generate", "--checkpoint",
                           checkpoint, "--prompt-ids", "1,2"], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


def test_cli_generate_subprocess_exit_2_no_traceback(pristine, tmp_path):
    """Through the interpreter: an absurd config (vocab 10^12) is refused from the headers,
    with exit status 2 and exactly one stderr line."""
    d = _damaged(pristine, tmp_path, "dense", cfg(vocab_size=10**12))
    r = generate_subprocess(d)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "model.embed_tokens.weight" in r.stderr and "vocab_size = 1000000000000" in r.stderr


@pytest.mark.parametrize("kw,needle", [
    ({"num_heads": 0}, "DecoderConfig.num_heads: expected an integer >= 1, got 0"),
    ({"vocab_size": 256.0}, "DecoderConfig.vocab_size: expected an integer >= 1"),
    ({"head_dim": True}, "DecoderConfig.head_dim"),
    ({"num_experts": -1}, "DecoderConfig.num_experts: expected an integer >= 0"),
    ({"rms_norm_eps": float("nan")}, "DecoderConfig.rms_norm_eps: expected a finite number > 0"),
    ({"rope_theta": 0}, "DecoderConfig.rope_theta"),
    ({"sliding_window": 0}, "DecoderConfig.sliding_window"),
    ({"moe_layers": (2,), "num_experts": 4, "num_experts_per_tok": 2},
     "DecoderConfig.moe_layers: expected layer indices in [0, 2)"),
    ({"moe_layers": (0,), "num_experts": 4, "num_experts_per_tok": 5},
     "DecoderConfig.num_experts_per_tok: expected at most num_experts (4)")])
def test_decoder_config_names_a_bad_field(kw, needle):
    """A DecoderConfig built by hand (random-weight models, the benchmark) is checked as
    config.json is: the field and what it expects."""
    base = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "head_dim": 16}
    with pytest.raises(ValueError) as exc:
        models.DecoderConfig(**{**base, **kw})
    assert needle in str(exc.value)


def _nvfp4(*shape, decode=1.0):
    """An NVFP4Array [..., N, K] of zero codes and unit block scales (nothing compiles)."""
    import nvfp4_jax as nj

    *lead, n, k = shape
    return nj.NVFP4Array.from_parts(
        jnp.zeros((*lead, n, k // 2), jnp.uint8),
        jnp.ones((*lead, n, k // 16), jnp.float32).astype(jnp.float8_e4m3fn),
        jnp.full(tuple(lead), decode, jnp.float32))


def test_building_blocks_name_a_bad_argument():
    """nn.rms_norm, nn.moe_block's router, nn.linear's input_scale and generate's model and
    eos_id: a ValueError naming the argument, not an error from inside JAX."""
    from nvfp4_jax import nn

    fc1, fc2, w = _nvfp4(4, 64, 128), _nvfp4(4, 128, 32), _nvfp4(64, 128)
    router, s = jnp.ones((4, 128), jnp.bfloat16), jnp.full(4, 0.01, jnp.float32)
    x = jnp.ones((3, 128), jnp.bfloat16)
    cases = [
        (lambda: nn.rms_norm(x, jnp.ones(64, jnp.bfloat16), 1e-6),
         "weight: expected [D] with x's last dimension D = 128, got shape (64,)"),
        (lambda: nn.moe_block(nn.MoE(router[:, :64], fc1, fc2, s, s, top_k=2), x),
         "router: expected [E, H] with x's H = 128"),
        (lambda: nn.moe_block(nn.MoE(router, fc1, fc2, s, s, top_k=2), x[:, :64]),
         "router: expected [E, H] with x's H = 64"),
        (lambda: nn.linear(nn.Linear(w, "x"), x), "input_scale: expected a float32 scale"),
        (lambda: models.generate(None, [[1]], 2), "model: expected a models.Model"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError) as exc:
            fn()
        assert needle in str(exc.value)


@pytest.mark.parametrize("eos", ["x", [-5], [1.5], True, [[1, 2]]])
def test_generate_refuses_a_bad_eos_id(dense_model, eos):
    with pytest.raises(ValueError, match="^eos_id: expected a token id or a list of them"):
        models.generate(dense_model, [[1, 2]], 2, eos_id=eos)
