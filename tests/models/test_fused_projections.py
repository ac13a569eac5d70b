"""q/k/v and gate/up fused into one NVFP4 GEMM each (``models.fuse_projections``).

Fusing concatenates codes and block scales along N and keeps the shared alpha, so every output
column is computed from the same operands as by its own GEMM. On the CPU the XLA backend sums
each column in the same order either way, so the fused model's logits equal the unfused
model's bit for bit; a linear whose weight_scale_2 or input_scale differs from the others is
left unfused (a shared alpha would change its numbers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_jax as nj
from nvfp4_jax import models, nn
from nvfp4_jax.models import DecoderConfig, Model

CFG = DecoderConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, intermediate_size=96, rope_theta=1e4)


def _linear(rng, n, k, decode_scale=None, input_scale=0.02):
    """A trtllm-quantized random weight (blocks over 2^-30..2^4: E4M3-subnormal scales)."""
    mag = np.exp2(rng.uniform(-30, 4, (n, k // 16, 1))).repeat(16, -1).reshape(n, k)
    w = jnp.asarray(rng.standard_normal((n, k)) * mag, jnp.float32)
    q = nj.quantize(w, "trtllm", **({} if decode_scale is None else
                                    {"encode_scale": 1.0 / decode_scale}))
    return nn.Linear(q, jnp.float32(input_scale))


def _layers(rng, shared=True):
    h, d = CFG.hidden_size, CFG.head_dim
    ds = 2.0 ** -8 if shared else None  # shared: one weight_scale_2 per fused group
    layers = []
    for _ in range(CFG.num_layers):
        attn = {n: _linear(rng, m, h, ds) for n, m in
                (("q_proj", CFG.num_heads * d), ("k_proj", CFG.num_kv_heads * d),
                 ("v_proj", CFG.num_kv_heads * d))}
        attn["o_proj"] = _linear(rng, h, CFG.num_heads * d)
        mlp = {n: _linear(rng, CFG.intermediate_size, h, ds) for n in ("gate_proj", "up_proj")}
        mlp["down_proj"] = _linear(rng, h, CFG.intermediate_size)
        layers.append({"input_layernorm": jnp.ones((h,), jnp.bfloat16),
                       "post_attention_layernorm": jnp.ones((h,), jnp.bfloat16),
                       "self_attn": attn, "mlp": mlp})
    return layers


def _model(layers, fuse):
    rng = np.random.default_rng(1)
    embed = jnp.asarray(rng.standard_normal((CFG.vocab_size, CFG.hidden_size)), jnp.bfloat16)
    head = jnp.asarray(rng.standard_normal((CFG.vocab_size, CFG.hidden_size)) * 0.1,
                       jnp.bfloat16)
    return Model.build(CFG, embed, layers, jnp.ones((CFG.hidden_size,), jnp.bfloat16), head,
                       fuse=fuse)


def _logits(model, w4a4):
    ids = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)
    cache = models.init_cache(CFG, 2, 9)
    out, _ = models.prefill(model, ids, cache, all_logits=True, backend="xla", w4a4=w4a4)
    return np.asarray(out)


def test_fused_model_equals_unfused_bit_for_bit():
    layers = _layers(np.random.default_rng(0))
    fused, plain = _model(layers, True), _model(layers, False)
    g = jax.tree_util.tree_map(lambda a: a, fused.groups[0])
    assert set(g["self_attn"]) == {"qkv_proj", "o_proj"}
    assert set(g["mlp"]) == {"gate_up_proj", "down_proj"}
    assert g["self_attn"]["qkv_proj"].shape == ((CFG.num_heads + 2 * CFG.num_kv_heads)
                                                * CFG.head_dim, CFG.hidden_size)
    for w4a4 in (True, False):
        a, b = _logits(fused, w4a4), _logits(plain, w4a4)
        assert np.isfinite(a).all() and np.abs(a).max() > 0
        np.testing.assert_array_equal(a, b)


def test_different_scales_stay_unfused():
    rng = np.random.default_rng(3)
    layer = _layers(rng, shared=False)[0]  # each projection its own weight_scale_2
    out = models.fuse_projections(layer)
    assert set(out["self_attn"]) >= {"q_proj", "k_proj", "v_proj"}
    assert "gate_up_proj" not in out["mlp"]
    # shared weight_scale_2 but different input_scale: W4A4 alphas differ, so no fusion
    a = _linear(rng, 32, 64, 2.0 ** -8, input_scale=0.02)
    b = _linear(rng, 32, 64, 2.0 ** -8, input_scale=0.03)
    assert models.concat_linears([a, b]) is None
    c = _linear(rng, 32, 64, 2.0 ** -8, input_scale=0.02)
    fused = models.concat_linears([a, c])
    assert fused.shape == (64, 64)
    np.testing.assert_array_equal(np.asarray(fused.w.codes[32:]), np.asarray(c.w.codes))


def test_unfuse_restores_the_projections_exactly():
    from nvfp4_jax.models.decoder import unfuse_projections

    layer = _layers(np.random.default_rng(4))[0]
    back = unfuse_projections(models.fuse_projections(layer), CFG)
    for block in ("self_attn", "mlp"):
        assert set(back[block]) == set(layer[block])
        for name, lin in layer[block].items():
            if isinstance(lin, nn.Linear):
                got = back[block][name].w
                assert got.shape == lin.w.shape
                np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(lin.w.codes))
                np.testing.assert_array_equal(
                    np.asarray(jax.lax.bitcast_convert_type(got.scales, jnp.uint8)),
                    np.asarray(jax.lax.bitcast_convert_type(lin.w.scales, jnp.uint8)))
    stacked = _model([layer, layer], True).groups[0]  # two layers stacked for lax.scan
    k = unfuse_projections(stacked, CFG)["self_attn"]["k_proj"]
    assert k.w.shape == (CFG.num_kv_heads * CFG.head_dim, CFG.hidden_size)
    assert k.w.codes.shape[0] == 2
