"""nvfp4_jax.models on the GPU: the kernels (backend "auto": Pallas-Triton / Mosaic GEMMs and
MoE) inside the scanned decoder against the XLA reference path, at Qwen3-30B-A3B layer widths
(2 layers, 16 experts) and a Llama-3-8B-like dense layer width.

Bound: the kernel and XLA paths sum in different orders, so bf16 outputs differ by an ulp here
and there. In W4A4 such an ulp can flip an activation's FP4 code (a step of up to a third of
the block's largest value), and every quantization point of these random layers adds flips:
their logits move by 40-66 % of their RMS when each embedding value moves by one bf16 ulp
(XLA path, CPU), where unrelated logits differ by ~140 %. So each test measures that
sensitivity on its own model and inputs (``ulp_sensitivity``) and holds the kernels to
max(10 %, sensitivity): a check for gross faults (a wrong layer slice, scale or kernel). The
kernels' arithmetic, E4M3 subnormal scales included, is held to the oracle's bounds by the
kernel tests (tests/gemm, tests/moe).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bench_modules import fresh

from nvfp4_jax import models

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
    pytest.skip("needs an NVIDIA GPU (Pallas kernels compiled for real)", allow_module_level=True)


SHAPES = {
    "qwen3-moe": dict(vocab_size=1024, hidden_size=2048, num_layers=2, num_heads=32,
                      num_kv_heads=4, head_dim=128, rope_theta=1e6, qk_norm=True, num_experts=16,
                      num_experts_per_tok=8, moe_intermediate_size=768),
    "llama": dict(vocab_size=1024, hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                  head_dim=128, intermediate_size=14336, rope_theta=5e5),
}


def rel_rms(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))


def ulp_sensitivity(model, ids) -> float:
    """rms(moved - logits) / rms(logits) of the XLA path's prefill logits when every embedding
    value moves by one bf16 ulp (random signs): how far an ulp-level difference moves this
    model."""
    bits = jax.lax.bitcast_convert_type(model.embed, jnp.uint16)
    up = jax.random.bernoulli(jax.random.key(1), 0.5, bits.shape)
    moved = jax.lax.bitcast_convert_type(jnp.where(up, bits + 1, bits - 1).astype(jnp.uint16),
                                         jnp.bfloat16)
    outs = []
    for m in (model, dataclasses.replace(model, embed=moved)):
        cache = models.init_cache(model.config, ids.shape[0], 20)
        logits, _ = models.prefill(m, ids, cache, backend="xla", all_logits=True)
        outs.append(np.asarray(logits, np.float64))
    sens = rel_rms(outs[1], outs[0])
    assert sens < 0.9, f"an ulp moves the XLA logits by {sens:.3g}: no bound to hold to"
    return sens

@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 8])
def test_kernels_in_decoder_match_xla(name, batch):
    bench = fresh("e2e_bench")
    model = bench.build_model(bench.config_of(SHAPES[name]), "nvfp4")
    ids = (jnp.arange(batch * 16, dtype=jnp.int32).reshape(batch, 16) * 37) % 1024
    # the decode step's token is fixed, not either path's argmax: a near-tie that the two
    # summation orders break differently would feed the paths different tokens
    nxt = (ids[:, -1] * 7 + 3) % 1024
    outs = {}
    for backend in ("auto", "xla"):
        cache = models.init_cache(model.config, batch, 20)
        logits, cache = models.prefill(model, ids, cache, backend=backend, all_logits=True)
        step, _ = models.decode_step(model, nxt, cache, backend=backend)
        outs[backend] = np.concatenate([np.asarray(logits, np.float64).reshape(-1),
                                        np.asarray(step, np.float64).reshape(-1)])
    assert np.isfinite(outs["auto"]).all()
    bound = max(0.1, ulp_sensitivity(model, ids))
    rel = rel_rms(outs["auto"], outs["xla"])
    assert rel < bound, f"{name} batch {batch}: rms(kernels - xla) / rms(xla) = {rel:.3g} " \
                        f"(bound {bound:.3g})"
    # unrolled layers run the same kernels on their own weight buffers
    cache = models.init_cache(model.config, batch, 20)
    logits, _ = models.prefill(model.unstacked(), ids, cache, all_logits=True)
    got = np.asarray(logits, np.float64).reshape(-1)
    rel = rel_rms(got, outs["auto"][:got.size])
    assert rel < bound, (f"{name} batch {batch}: unrolled vs scanned layers differ by {rel:.3g} "
                         f"(bound {bound:.3g})")


def test_generate_on_gpu():
    bench = fresh("e2e_bench")
    model = bench.build_model(bench.config_of(SHAPES["qwen3-moe"]), "nvfp4")
    gen = models.generate(model, np.arange(8)[None], 8)
    assert gen.tokens.shape == (1, 8) and gen.decode_tokens_per_s > 0


def test_folded_experts_match_xla_on_gpu():
    """CUTEDSL-b12x folded expert scales (E4M3 subnormals among them) through the GPU kernels
    against the XLA path, which decodes E4M3 exactly. A check for gross faults: flushing the
    subnormal block scales (65 % of these blocks) moves the XLA logits by 40 % of their RMS,
    as much as an ulp does; the kernel tests hold subnormal scales to the oracle."""
    bench = fresh("e2e_bench")
    model = bench.build_model(bench.config_of(SHAPES["qwen3-moe"]), "nvfp4")
    folded, stats = models.fold_cutedsl_b12x(model)
    assert sum(s.subnormal for s in stats) > 0
    ids = (jnp.arange(16, dtype=jnp.int32).reshape(1, 16) * 37) % 1024
    outs = {}
    for backend in ("auto", "xla"):
        cache = models.init_cache(folded.config, 1, 16)
        logits, _ = models.prefill(folded, ids, cache, backend=backend, all_logits=True)
        outs[backend] = np.asarray(logits, np.float64)
    assert np.isfinite(outs["auto"]).all()
    bound = max(0.1, ulp_sensitivity(folded, ids))
    rel = rel_rms(outs["auto"], outs["xla"])
    assert rel < bound, f"folded experts: rms(kernels - xla) / rms(xla) = {rel:.3g} " \
                        f"(bound {bound:.3g})"


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_o_proj_operand_and_residual_add_change_no_bit(name, batch, monkeypatch):
    """The decode step with o_proj's W4A4 operand written by the attention's last launch
    (``nn.w4a4_operand_rows``) and, on Qwen3, the residual add in the norm-router launch
    (``nn.add_norm_router``) gives the logits of the step with the operand kernel and XLA's
    add, bit for bit: the same operand bytes into the same GEMM, the same bf16 add."""
    from nvfp4_jax import nn
    from nvfp4_jax.moe.xla import add_residual

    bench = fresh("e2e_bench")
    model = bench.build_model(bench.config_of(SHAPES[name]), "nvfp4")
    ids = (jnp.arange(batch * 16, dtype=jnp.int32).reshape(batch, 16) * 37) % 1024
    nxt = (ids[:, -1] * 7 + 3) % 1024
    cache = models.init_cache(model.config, batch, 20)
    _, cache = models.prefill(model, ids, cache)

    def step():  # decode_step donates its cache: each call gets a copy
        return models.decode_step(model, nxt, jax.tree.map(jnp.copy, cache))[0]

    fused = step()
    text = str(jax.make_jaxpr(models.decode_step)(model, nxt, cache))
    assert "nvfp4_decode_attention_combine_operand" in text
    assert ("nvfp4_moe_add_norm_router" in text) == (name == "qwen3-moe")

    real = nn.add_norm_router

    def unfused_add(x, a, *args, **kw):  # XLA's add of the two arrays, then the kernel
        s = add_residual(x, a)
        return (s, *nn.norm_router(s, *args, **kw))

    monkeypatch.setattr(nn, "w4a4_operand_rows", lambda *a, **k: None)
    monkeypatch.setattr(nn, "add_norm_router", unfused_add)
    jax.clear_caches()
    plain = step()
    text = str(jax.make_jaxpr(models.decode_step)(model, nxt, cache))
    assert "combine_operand" not in text and "nvfp4_moe_add_norm_router" not in text
    monkeypatch.setattr(nn, "add_norm_router", real)
    jax.clear_caches()
    got, want = np.asarray(fused, np.float32), np.asarray(plain, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
