"""One parity suite for every MoE backend: ``nvfp4_jax.moe(backend=b)`` for each of
``moe.BACKENDS`` meets the same checks against the oracle (``testing.assert_moe_close``: the
interval propagated through the mode's rounding points). Off the GPU "pallas" runs in interpret
mode and "mosaic" as the XLA emulation of its grouped GEMMs with the glue kernels interpreted;
"auto" runs whatever the device picks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import make_case

import nvfp4_jax
from nvfp4_jax.moe import BACKENDS
from nvfp4_jax.testing import assert_moe_close

CASES = [  # (mode, activation, gate_up_order, shape); H % 256 == 0 for the Mosaic kernels
    ("trtllm_cutlass", "relu2", "up_gate", {"t": 5, "h": 256, "inter": 256, "e": 6, "k": 3}),
    ("b12x", "swiglu", "gate_up", {"t": 4, "h": 256, "inter": 128, "e": 4, "k": 2}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,activation,order,shape", CASES, ids=lambda v: str(v)[:12])
def test_every_backend_meets_the_oracle(backend, mode, activation, order, shape):
    case = make_case(np.random.default_rng(shape["t"]), activation=activation, **shape)
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    out = nvfp4_jax.moe(jnp.asarray(hidden, jnp.bfloat16), fc1=nvfp4_jax.from_oracle(fc1),
                        fc2=nvfp4_jax.from_oracle(fc2),
                        fc1_input_scale=jnp.asarray(s1, jnp.float32),
                        fc2_input_scale=jnp.asarray(s2, jnp.float32), topk_ids=jnp.asarray(ids),
                        topk_weights=jnp.asarray(wts), activation=activation,
                        gate_up_order=order, mode=mode, backend=backend)
    assert out.shape == hidden.shape and out.dtype == jnp.bfloat16
    assert_moe_close(np.asarray(out.astype(jnp.float32)), *case, mode=mode, activation=activation,
                     gate_up_order=order, label=f"moe backend={backend} {mode} {activation}")
