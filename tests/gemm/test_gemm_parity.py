"""One parity suite for every GEMM backend: ``nvfp4_jax.matmul(backend=b)`` for each of
``gemm.api.BACKENDS``, W4A16 and W4A4, meets the same check against the oracle
(``testing.assert_gemm_close``: the derived fp32-accumulation bound). Off the GPU "pallas" runs
in interpret mode and "mosaic" falls back to it (logged); "auto" runs what the device picks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax
import oracle
from nvfp4_jax.gemm.api import BACKENDS
from nvfp4_jax.testing import assert_gemm_close


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (19, 96, 512)])
@pytest.mark.parametrize("w4a4", [False, True])
def test_every_backend_meets_the_oracle(backend, m, n, k, w4a4):
    rng = np.random.default_rng(m * 31 + n + k)
    wf = rng.standard_normal((n, k)) * np.exp2(rng.uniform(-4, 4, (n, k // 16)).repeat(16, 1))
    w = oracle.quantize(wf.astype(np.float32), "trtllm")
    x = oracle.bf16_round(rng.standard_normal((m, k)))
    input_scale = float(np.float32(np.abs(x).max() / 2688)) if w4a4 else None
    out = nvfp4_jax.matmul(jnp.asarray(x, jnp.bfloat16), nvfp4_jax.from_oracle(w),
                           input_scale=input_scale, out_dtype=jnp.float32, backend=backend)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert_gemm_close(np.asarray(out), x, w, input_scale=input_scale, out_dtype="float32",
                      label=f"matmul backend={backend} {'w4a4' if w4a4 else 'w4a16'}")
