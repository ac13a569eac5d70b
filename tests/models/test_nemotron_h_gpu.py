"""models.NemotronHModel on the GPU: the kernels (backend "auto": Pallas-Triton / Mosaic GEMMs,
the relu2 MoE with sigmoid-and-bias routing) inside the hybrid decoder against the XLA path,
at Nemotron-3-Nano-like widths (hidden 2688, Mamba2 64 heads x 64 with d_state 128 in 8
groups, attention 32 heads / 2 KV heads of 128, experts of width 1856 with a shared expert of
3712; 16 experts top-6 instead of 128 to keep the test small), pattern "ME*-ME".

Bound: as tests/models/test_models_gpu.py argues, within one layer kernel and XLA paths differ
only in their summation order (plus the FP4 codes that flips, for W4A4 activations), so the RMS
of the logit difference of a one-layer model stays below 10 % of the logits' RMS; a wrong
slice, scale or kernel gives O(1).
The model is random (Gaussian weights quantized with ``nj.quantize``), built on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bench_modules import fresh

import nvfp4_jax as nj
from nvfp4_jax import models, nn

e2e_bench = fresh("e2e_bench")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu",
                                 reason="needs an NVIDIA GPU (Pallas kernels compiled for real)")]

NANO = {"vocab_size": 2048, "hidden_size": 2688, "layer_types": tuple("ME*-ME"),
        "num_heads": 32, "num_kv_heads": 2, "head_dim": 128, "intermediate_size": 3712,
        "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
        "conv_kernel": 4, "num_experts": 16, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "routed_scaling_factor": 2.5}
#: activations after RMSNorm are ~N(0, 1): amax ~ 8 as the calibrated input_scale's decode form
INPUT_SCALE = 8.0 / 2688


def _lin(key, n, k, std=0.02):
    w = jax.random.normal(key, (n, k), jnp.float32) * std
    return nn.Linear(nj.quantize(w, "modelopt"), jnp.float32(INPUT_SCALE))


def _experts(key, shape):
    return nj.quantize_experts(jax.random.normal(key, shape) * 0.02, "modelopt")


def _dense(key, shape, role):
    """Gaussian conv weight (bf16), router (fp32) and correction bias (fp32)."""
    if role == "conv":
        return (jax.random.normal(key, shape) * 0.3).astype(jnp.bfloat16)
    return jax.random.normal(key, shape, jnp.float32) * 0.05


def random_nemotron_h(cfg: models.NemotronHConfig, seed: int = 0) -> models.NemotronHModel:
    """Random Nemotron-H weights (Gaussian, the NVFP4 linears and experts quantized as a
    ModelOpt export holds them; bf16/fp32 the rest), layers from the benchmark's builder."""
    key = jax.random.key(seed)
    h = cfg.hidden_size
    layers = []
    for kind in cfg.layer_types:
        key, *ks = jax.random.split(key, 8)
        layers.append(e2e_bench.nemotron_h_layer(ks, kind, cfg, _lin, _experts, _dense,
                                                 INPUT_SCALE))
    k1, k2 = jax.random.split(key)
    embed = jax.random.normal(k1, (cfg.vocab_size, h), jnp.bfloat16)
    head = (jax.random.normal(k2, (cfg.vocab_size, h)) * 0.02).astype(jnp.bfloat16)
    return models.NemotronHModel(embed, layers, jnp.ones((h,), jnp.bfloat16), head, cfg)


def kernels_vs_xla(cfg: models.NemotronHConfig, batch: int, backend: str = "auto",
                   w4a4: bool = True) -> float:
    """rms(``backend`` - xla) / rms(xla) over the prefill logits of 16 tokens and one decode
    step's."""
    model = random_nemotron_h(cfg)
    v = cfg.vocab_size
    ids = (jnp.arange(batch * 16, dtype=jnp.int32).reshape(batch, 16) * 37) % v
    # the decode step's token is fixed, not either path's argmax: a near-tie that the two
    # summation orders break differently would feed the paths different tokens
    nxt = (ids[:, -1] * 7 + 3) % v
    outs = {}
    for b in (backend, "xla"):
        cache = models.init_cache(cfg, batch, 20)
        logits, cache = models.prefill(model, ids, cache, backend=b, w4a4=w4a4, all_logits=True)
        step, _ = models.decode_step(model, nxt, cache, backend=b, w4a4=w4a4)
        outs[b] = np.concatenate([np.asarray(logits, np.float64).reshape(-1),
                                  np.asarray(step, np.float64).reshape(-1)])
    ref = outs["xla"]
    assert np.isfinite(outs[backend]).all()
    return float(np.sqrt(np.mean((outs[backend] - ref) ** 2) / np.mean(ref ** 2)))


@pytest.mark.parametrize("batch", [1, 8])
def test_nemotron_h_kernels_match_xla(batch):
    """Each layer kind alone (one-layer models, so both paths see the same layer input): the
    bound holds per layer. Across layers it does not: the two paths' last-bit differences
    flip top-k expert choices and FP4 activation codes downstream, which are discontinuous
    (the six-layer pattern measured 0.25 with W4A4 and 0.064 with W4A16 in interpret mode,
    each kind alone 0.0004-0.025)."""
    rels = {kind: kernels_vs_xla(models.NemotronHConfig(**{**NANO, "layer_types": (kind,)}),
                                 batch) for kind in "ME*-"}
    bad = {kind: r for kind, r in rels.items() if not r < 0.1}
    assert not bad, f"batch {batch}: rms(kernels - xla) / rms(xla) per layer kind: {rels}"


def test_nemotron_h_generate_on_gpu():
    model = random_nemotron_h(models.NemotronHConfig(**NANO))
    gen = models.generate(model, np.arange(8)[None], 8)
    assert gen.tokens.shape == (1, 8) and gen.decode_tokens_per_s > 0
    print(f"\nNemotron-H (Nano-like widths, 6 layers) b=1: prefill "
          f"{gen.prefill_tokens_per_s:.1f} tok/s, decode {gen.decode_tokens_per_s:.1f} tok/s")
