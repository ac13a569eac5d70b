"""The Pallas-Triton MoE on the FP4 MMA (``MoEConfig.mma="fp4"``) compiled for the GPU: forced on
any GPU (native on SM 12.x, Triton's decomposition on sm_90), against ``oracle.moe`` inside
``moe_bound``'s interval with zero slack in the activation quantization (so a code flipped by an
inexact division fails); the default picks it on SM 12.x only. Skipped without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import make_case

import nvfp4_jax
from nvfp4_jax.device import is_sm12x, on_gpu
from nvfp4_jax.moe import pallas_triton
from nvfp4_jax.moe.configs import MoEConfig, default_config
from nvfp4_jax.testing import assert_moe_close

pytestmark = pytest.mark.gpu

if not on_gpu():  # the package's one device probe
    pytest.skip("needs an NVIDIA GPU (Pallas-Triton kernels compiled for real)",
                allow_module_level=True)


def _run(case, *, mode, activation, config, order="up_gate"):
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    f = jax.jit(lambda x, w1, w2, a, b, i, w: nvfp4_jax.moe(
        x, fc1=w1, fc2=w2, fc1_input_scale=a, fc2_input_scale=b, topk_ids=i, topk_weights=w,
        activation=activation, gate_up_order=order, mode=mode, backend="pallas", config=config))
    out = f(jnp.asarray(hidden, jnp.bfloat16), nvfp4_jax.from_oracle(fc1),
            nvfp4_jax.from_oracle(fc2), jnp.asarray(s1, jnp.float32), jnp.asarray(s2, jnp.float32),
            jnp.asarray(ids, jnp.int32), jnp.asarray(wts, jnp.float32))
    return np.asarray(out.astype(jnp.float32), np.float64)


def _fp4_config(shape, activation):
    r = shape["t"] * shape["k"]
    return default_config(r, shape["e"], inter=shape["inter"], hidden=shape["h"],
                          gated=activation == "swiglu", mma="fp4")


# layer widths of Nemotron (H 1024, I 2688, relu2) and Qwen3-30B (H 2048, I 768, swiglu) with
# fewer experts (the float64 oracle stays fast); decode and prefill row counts
@pytest.mark.parametrize("mode,activation,order,shape", [
    ("trtllm_cutlass", "relu2", "up_gate", {"t": 37, "h": 1024, "inter": 2688, "e": 16, "k": 6}),
    ("b12x", "swiglu", "up_gate", {"t": 1, "h": 2048, "inter": 768, "e": 32, "k": 8}),
    ("trtllm_cutlass", "swiglu", "gate_up", {"t": 100, "h": 2048, "inter": 768, "e": 16, "k": 8,
                                             "routing": "skewed"}),
    ("b12x", "relu2", "up_gate", {"t": 300, "h": 1024, "inter": 1056, "e": 8, "k": 2,
                                  "scale_factor": 2.0**15}),
])
def test_forced_fp4_moe_meets_the_oracle(mode, activation, order, shape):
    case = make_case(np.random.default_rng(shape["t"]), activation=activation, **shape)
    out = _run(case, mode=mode, activation=activation, order=order,
               config=_fp4_config(shape, activation))
    b = assert_moe_close(out, *case, mode=mode, activation=activation, gate_up_order=order,
                         quant_slack=0.0, label=f"moe fp4 {mode} {activation} T{shape['t']}")
    print(mode, activation, shape, f"{np.mean(out == b.ref):.1%} bit-identical to the oracle")


def test_fp4_moe_nonfinite_token_gives_a_nan_row_only():
    shape = {"t": 8, "h": 512, "inter": 256, "e": 8, "k": 2}
    case = make_case(np.random.default_rng(3), **shape)
    hidden = case[0].copy()
    hidden[5, 100] = np.inf
    out = _run((hidden, *case[1:]), mode="trtllm_cutlass", activation="relu2",
               config=_fp4_config(shape, "relu2"))
    others = np.delete(out, 5, axis=0)
    assert np.isnan(out[5]).all(), f"token 5: {int(np.isfinite(out[5]).sum())} finite outputs"
    assert np.isfinite(others).all(), (f"other tokens: {int((~np.isfinite(others)).sum())} "
                                       f"non-finite outputs in rows "
                                       f"{sorted(set(np.nonzero(~np.isfinite(others))[0]))}")


def test_default_mma_is_fp4_on_sm12x_only(monkeypatch):
    calls = []
    real = pallas_triton.dot_scaled
    monkeypatch.setattr(pallas_triton, "dot_scaled", lambda *a: calls.append(1) or real(*a))
    shape = {"t": 5, "h": 512, "inter": 256, "e": 8, "k": 2}
    case = make_case(np.random.default_rng(5), **shape)
    out = _run(case, mode="trtllm_cutlass", activation="relu2", config=None)
    assert (len(calls) > 0) == is_sm12x()
    assert default_config(10, 8).mma == ("fp4" if is_sm12x() else "bf16")
    assert_moe_close(out, *case, mode="trtllm_cutlass", activation="relu2", quant_slack=0.0)
    assert MoEConfig().resolved_mma() == ("fp4" if is_sm12x() else "bf16")
