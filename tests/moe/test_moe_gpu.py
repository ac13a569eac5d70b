"""Pallas-Triton MoE on the GPU at realistic layer widths vs the oracle (stage-wise bounds).

Calls the Pallas-Triton path directly (on sm_90 ``backend="auto"`` picks the Mosaic kernels at
these sizes; those are tested in test_moe_mosaic_gpu.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import check_against_oracle, make_case
from test_moe import to_jax

from nvfp4_jax.moe.pallas_triton import moe_pallas

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
    pytest.skip("needs an NVIDIA GPU (Pallas-Triton kernels compiled for real)", allow_module_level=True)


# Nemotron (hidden 1024, intermediate 2688, relu2) and Qwen3-30B (2048, 768, swiglu) layer
# widths with fewer experts so the float64 oracle stays fast; T chosen off the block size.
@pytest.mark.parametrize("mode,shape", [
    ("trtllm_cutlass", {"t": 37, "h": 1024, "inter": 2688, "e": 16, "k": 6, "activation": "relu2"}),
    ("b12x", {"t": 1, "h": 2048, "inter": 768, "e": 32, "k": 8, "activation": "swiglu"}),
    ("trtllm_cutlass", {"t": 100, "h": 2048, "inter": 768, "e": 16, "k": 8, "activation": "swiglu", "routing": "skewed"}),
])
def test_moe_gpu_matches_oracle(mode, shape):
    case = make_case(np.random.default_rng(shape["t"]), **shape)
    act_scale = "scalar" if mode == "trtllm_cutlass" else "per_expert"
    fn = functools.partial(moe_pallas, activation=shape["activation"], gate_up_order="up_gate", mode=mode,
                           activation_scale=act_scale, return_intermediates=True)
    out, inter = jax.jit(fn)(*to_jax(case))
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    stats = check_against_oracle(case, f(out), f(inter["h"]), mode=mode, activation=shape["activation"])
    print(mode, shape, stats)


def test_moe_xla_backend_on_gpu_matches_oracle():
    """The XLA backend compiled by XLA:GPU (not just on CPU): its trtllm_cutlass bf16 rounding
    points must survive the GPU's excess-precision simplifications (``moe.xla.bf16_round``)."""
    from nvfp4_jax.moe.xla import moe_xla

    shape = {"t": 9, "h": 1024, "inter": 512, "e": 8, "k": 4, "activation": "relu2"}
    case = make_case(np.random.default_rng(9), **shape)
    fn = functools.partial(moe_xla, activation="relu2", gate_up_order="up_gate",
                           mode="trtllm_cutlass", activation_scale="scalar",
                           return_intermediates=True)
    out, inter = jax.jit(fn)(*to_jax(case))
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    stats = check_against_oracle(case, f(out), f(inter["h"]), mode="trtllm_cutlass",
                                 activation="relu2")
    print(stats)
