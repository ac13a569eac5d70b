"""Property: nvfp4_jax.matmul stays within oracle.gemm_error_bound over the fuzzed range.

Inputs come from ``nvfp4_jax.testing.strategies``: activations whose blocks hit every E4M3
scale regime (underflow, subnormal, normal, overflow edge; zero and single-outlier blocks)
under log-uniform global scales, and ModelOpt-quantized checkpoint-like weights (sigma
1e-3 .. 1e-1). Shapes come from a small fixed set so XLA compiles a handful of programs.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfp4_jax
from nvfp4_jax.testing import assert_gemm_close
from nvfp4_jax.testing import strategies as nst

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
EXAMPLES = {"ci": 60, "deep": 2000}.get(PROFILE, 60)
N = 48


def _problem():
    return st.tuples(
        nst.nvfp4_inputs(rows=st.sampled_from([1, 3]), blocks_per_row=st.sampled_from([2, 4])),
        st.data(),
    )


def _weights(data, k):
    return data.draw(nst.checkpoint_weights(shape=(N, k))).nvfp4


@settings(max_examples=EXAMPLES)
@given(_problem(), st.sampled_from(["w4a16", "w4a4_input_scale", "w4a4_nvfp4"]))
def test_xla_matmul_within_bound(problem, mode):
    inp, data = problem
    w = _weights(data, inp.x.shape[1])
    wj = nvfp4_jax.from_oracle(w)
    x = jnp.asarray(inp.x, jnp.bfloat16)
    if mode == "w4a16":
        out = nvfp4_jax.matmul(x, wj, backend="xla")
        assert_gemm_close(np.asarray(out, np.float32), inp.x, w, label="matmul w4a16")
    elif mode == "w4a4_input_scale":
        out = nvfp4_jax.matmul(x, wj, input_scale=np.float32(inp.decode_scale), backend="xla")
        assert_gemm_close(np.asarray(out, np.float32), inp.x, w, input_scale=inp.decode_scale,
                          label="matmul w4a4 (input_scale)")
    else:
        a = inp.quantize("trtllm")
        out = nvfp4_jax.matmul(nvfp4_jax.from_oracle(a), wj, backend="xla", out_dtype=jnp.float32)
        assert_gemm_close(np.asarray(out), a, w, out_dtype="float32", label="matmul w4a4 (NVFP4Array)")


@settings(max_examples={"ci": 3, "deep": 50}.get(PROFILE, 3))
@given(nst.nvfp4_inputs(rows=2, blocks_per_row=4), st.data())
def test_pallas_interpret_matmul_within_bound(inp, data):
    """The Pallas-Triton kernel in interpret mode (CPU) at a tiny size."""
    w = _weights(data, inp.x.shape[1])
    out = nvfp4_jax.matmul(jnp.asarray(inp.x, jnp.bfloat16), nvfp4_jax.from_oracle(w), backend="pallas")
    assert_gemm_close(np.asarray(out, np.float32), inp.x, w, label="matmul pallas (interpret)")
