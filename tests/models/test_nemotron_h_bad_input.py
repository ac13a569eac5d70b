"""``models.load_model`` and ``nvfp4 generate`` refuse a damaged Nemotron-H export clearly.

Every case starts from the tiny ModelOpt NVFP4 Nemotron-H export of test_nemotron_h.py
(``make_checkpoint``: pattern "ME*-ME", tensors under ``backbone.``, built once per module),
copies it, damages one thing (a config.json key, one tensor, a layer or expert) and expects a
``ValueError`` naming config.json and the key (``checks.check_nemotron_h_config``) or a
``checkpoint.CheckpointError`` naming the file and tensor (``checks.check_nemotron_h_tensors``)
with what was expected; never a KeyError, a numpy reshape error, an allocation of the absurd
size or a model that loads and computes something else. Sizes are checked against the
safetensors headers before a tensor is read, so a config claiming 10^12 tokens or 10^9 Mamba
heads allocates nothing. The CLI case expects exit code 2 and one stderr line, no traceback.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers.models.nemotron_h")
pytest.importorskip("modelopt.torch.quantization")

from test_models_bad_input import (
    cfg,
    drop,
    generate_subprocess,
    put,
    reshape_linear,
    retype,
    tensors,
)
from test_nemotron_h import make_checkpoint

from nvfp4_jax import checkpoint as C
from nvfp4_jax import models

B = "backbone.layers"
M0, E1, A2, E5 = f"{B}.0.mixer", f"{B}.1.mixer", f"{B}.2.mixer", f"{B}.5.mixer"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("nemotron-h-bad-src")))


def _damaged(pristine, tmp_path, damage) -> str:
    d = str(tmp_path / "ck")
    shutil.copytree(pristine, d)
    damage(d)
    return d


def drop_prefix(prefix):
    """Remove every tensor whose name starts with ``prefix``."""
    def fn(t):
        for n in [n for n in t if n.startswith(prefix)]:
            t.pop(n)
    return tensors(fn)


def extra_layer(t):
    """A copy of layer 5 as layer 6 (the pattern names 6 layers)."""
    for n in [n for n in t if n.startswith(f"{B}.5.")]:
        t[n.replace(f"{B}.5.", f"{B}.6.")] = t[n]


def pattern(p):
    """hybrid_override_pattern ``p`` in place of layers_block_type."""
    return cfg(layers_block_type=None, hybrid_override_pattern=p)


# (id, damage, exception type, needles that must all be in the message)
CV, CE = ValueError, C.CheckpointError
CASES = [
    # config.json: types, ranges, the pattern, consistency
    ("vocab-missing", cfg(vocab_size=None), CV, ["config.json: vocab_size: missing"]),
    ("hidden-string", cfg(hidden_size="64"), CV, ["hidden_size", "integer >= 1", "'64'"]),
    ("ssm-state-float", cfg(ssm_state_size=16.0), CV, ["ssm_state_size", "integer >= 1"]),
    ("conv-kernel-zero", cfg(conv_kernel=0), CV, ["conv_kernel", "integer >= 1", "0"]),
    ("norm-topk-string", cfg(norm_topk_prob="yes"), CV, ["norm_topk_prob", "true or false"]),
    ("eps-negative", cfg(layer_norm_epsilon=-1e-5), CV, ["layer_norm_epsilon", "> 0"]),
    ("pattern-vs-num-layers", cfg(num_hidden_layers=7), CV,
     ["num_hidden_layers is 7", "6 layers"]),
    ("pattern-unknown-type", cfg(layers_block_type=["linear_attention", "mamba", "moe"]), CV,
     ["layers_block_type", "'mamba'"]),
    ("pattern-unknown-letter", pattern("ME*-MX"), CV, ["hybrid_override_pattern", "'X'"]),
    ("pattern-missing", cfg(layers_block_type=None), CV,
     ["layers_block_type: missing", "hybrid_override_pattern"]),
    ("pattern-not-a-list", cfg(layers_block_type="ME*-ME"), CV,
     ["layers_block_type", "a list"]),
    ("mamba-head-dim-missing", cfg(mamba_head_dim=None), CV,
     ["mamba_head_dim: missing", "'M' layers"]),
    ("heads-vs-kv-heads", cfg(num_attention_heads=3), CV,
     ["num_attention_heads (3)", "num_key_value_heads (2)"]),
    ("mamba-heads-vs-groups", cfg(mamba_num_heads=7), CV,
     ["mamba_num_heads (7)", "n_groups (2)"]),
    ("topk-above-experts", cfg(num_experts_per_tok=5), CV, ["num_experts_per_tok", "1..4"]),
    # a config that disagrees with the tensors: named from the headers
    ("n-groups-vs-tensors", cfg(n_groups=4), CE,
     [f"{M0}.in_proj.weight", "[392, 32]", "n_groups"]),
    ("conv-bias-off-but-stored", cfg(use_conv_bias=False), CE,
     [f"{M0}.conv1d.bias", "use_conv_bias is false"]),
    # absurd sizes: refused from the headers, nothing allocated
    ("vocab-absurd", cfg(vocab_size=10**12), CE,
     ["backbone.embeddings.weight", "vocab_size = 1000000000000"]),
    ("experts-absurd", cfg(n_routed_experts=10**9), CE,
     ["n_routed_experts is 1000000000", f"{E1}.experts 0..3 (4)"]),
    ("mamba-heads-absurd", cfg(mamba_num_heads=10**9), CE,
     [f"{M0}.in_proj.weight", "33000000064"]),
    # tensors: presence, dtype, shape, NVFP4 parts, layers and experts
    ("mamba-A_log-missing", drop(f"{M0}.A_log"), CE,
     [f"{M0}.A_log", "missing", "mamba_num_heads = 8"]),
    ("conv1d-shape", put(f"{M0}.conv1d.weight", np.zeros((192, 1, 3), np.uint16), "BF16"), CE,
     [f"{M0}.conv1d.weight", "[192, 1, 3]", "[192, 1, 4]", "conv_kernel = 4"]),
    ("conv1d-bias-missing", drop(f"{M0}.conv1d.bias"), CE, [f"{M0}.conv1d.bias", "missing"]),
    ("dt_bias-int", retype(f"{M0}.dt_bias", "I32", np.int32), CE,
     [f"{M0}.dt_bias", "dtype I32", "BF16"]),
    ("in_proj-rows", reshape_linear(f"{M0}.in_proj", 320, 64), CE,
     [f"{M0}.in_proj.weight", "[320, 32]", "[328, 32]"]),
    ("in_proj-weight_scale_2-missing", drop(f"{M0}.in_proj.weight_scale_2"), CE,
     [f"{M0}.in_proj.weight_scale_2", "missing"]),
    ("q_proj-input_scale-missing", drop(f"{A2}.q_proj.input_scale"), CE,
     [f"{A2}.q_proj.input_scale", "W4A4"]),
    ("expert-missing", drop_prefix(f"{E5}.experts.3."), CE,
     ["config.json", "n_routed_experts is 4", f"{E5}.experts 0..2"]),
    ("router-shape", put(f"{E1}.gate.weight", np.zeros((3, 64), np.float32), "F32"), CE,
     [f"{E1}.gate.weight", "[3, 64]", "n_routed_experts = 4"]),
    ("shared-expert-missing", drop(f"{E1}.shared_experts.down_proj.weight"), CE,
     [f"{E1}.shared_experts.down_proj.weight", "missing"]),
    ("extra-layer", tensors(extra_layer), CE, ["config.json", f"holds {B}.6"]),
    ("lm_head-missing", drop("lm_head.weight"), CE, ["lm_head.weight", "tie_word_embeddings"]),
    ("out_proj-bias", put(f"{M0}.out_proj.bias", np.zeros(64, np.uint16), "BF16"), CE,
     [f"{M0}.out_proj.bias", "a bias", "refusing"]),
    ("mixer-extra", put(f"{M0}.dt_scale", np.zeros(8, np.float32), "F32"), CE,
     [f"{M0}.dt_scale", "not a tensor the decoder reads"]),
]


@pytest.mark.parametrize("case,damage,exc,needles", CASES, ids=[c[0] for c in CASES])
def test_load_model_refuses(pristine, tmp_path, case, damage, exc, needles):
    d = _damaged(pristine, tmp_path, damage)
    with pytest.raises(exc) as info:
        models.load_model(d)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, msg
    if exc is CV:
        assert msg.startswith("config.json: "), msg


def _rename(fn):
    return tensors(lambda t: t.update({fn(n): t.pop(n) for n in list(t)}))


def _conv_2d(t):
    for n in list(t):
        if n.endswith("conv1d.weight"):
            a, dt = t[n]
            t[n] = (a.reshape(a.shape[0], a.shape[2]), dt)


ACCEPTS = [
    ("pristine", lambda d: None),
    ("model-prefix", _rename(lambda n: "model." + n[9:] if n.startswith("backbone.") else n)),
    ("conv1d-2d", tensors(_conv_2d)),
    ("pattern-string", cfg(layers_block_type=None, hybrid_override_pattern="ME*-ME",
                           num_hidden_layers=6)),
    ("no-correction-bias", drop(f"{E1}.gate.e_score_correction_bias")),
]


@pytest.mark.parametrize("case,damage", ACCEPTS, ids=[c[0] for c in ACCEPTS])
def test_load_model_accepts(pristine, tmp_path, case, damage):
    """What the checks must let through (the other spellings of a valid export) loads, with
    the pristine export's parameters (the correction bias dropped: none)."""
    import jax

    d = _damaged(pristine, tmp_path, damage)
    got, want = models.load_model(d), models.load_model(pristine)
    assert got.config == want.config
    if case == "no-correction-bias":
        assert got.layers[1]["moe"]["routed"].correction_bias is None
        return
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_generate_subprocess_exit_2_no_traceback(pristine, tmp_path):
    """Through the interpreter: a missing Mamba tensor is refused from the headers, with exit
    status 2 and exactly one stderr line naming it."""
    d = _damaged(pristine, tmp_path, drop(f"{M0}.D"))
    r = generate_subprocess(d)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("nvfp4 generate: ") and f"{M0}.D" in r.stderr, r.stderr
