"""nvfp4_jax.models on the GPU: the kernels (backend "auto": Pallas-Triton / Mosaic GEMMs and
MoE) inside the scanned decoder against the XLA reference path, at Qwen3-30B-A3B layer widths
(2 layers, 16 experts) and a Llama-3-8B-like dense layer width.

Bound: the kernel and XLA paths sum in different orders, so bf16 outputs differ by an ulp here
and there. In W4A4 such an ulp can flip an activation's FP4 code (a step of up to a third of
the block's largest value), and every quantization point of random layers adds such flips:
two valid executions of these 2-layer models differ by 10-30 % of the logits' RMS (on the CPU
13-20 % between the scanned and unrolled XLA paths, which differ only in how XLA fuses the
glue). A wrong layer slice, scale or kernel gives unrelated logits, ~140 %. So each test
measures that spread on its own model and inputs (``xla_spread``: scanned against unrolled
XLA) and holds the kernels to max(10 %, 2 x spread).
"""

from __future__ import annotations

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


def xla_spread(model, ids) -> float:
    """rms(unrolled - scanned) / rms(scanned) of the XLA path's prefill logits: how far an
    ulp-level difference (XLA's fusions in and out of the scan) moves this model's logits."""
    outs = []
    for m in (model, model.unstacked()):
        cache = models.init_cache(model.config, ids.shape[0], 20)
        logits, _ = models.prefill(m, ids, cache, backend="xla", all_logits=True)
        outs.append(np.asarray(logits, np.float64))
    spread = rel_rms(outs[1], outs[0])
    assert spread < 0.5, f"the XLA paths alone differ by {spread:.3g}: no bound to hold to"
    return spread


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
    bound = max(0.1, 2 * xla_spread(model, ids))
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
    against the XLA path, which decodes E4M3 exactly: a kernel that flushed subnormal block
    scales would move the logits by 40 % of their RMS (XLA path on the CPU, 65 % of the blocks
    subnormal), against a spread of 12 % (bound 24 %)."""
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
    bound = max(0.1, 2 * xla_spread(folded, ids))
    rel = rel_rms(outs["auto"], outs["xla"])
    assert rel < bound, f"folded experts: rms(kernels - xla) / rms(xla) = {rel:.3g} " \
                        f"(bound {bound:.3g})"
