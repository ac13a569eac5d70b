"""Expert- and tensor-parallel NVFP4 layers on 2 or more GPUs, with the GPU kernels.

On GPUs the per-device MoE runs the Pallas kernels (``backend="auto"``), whose top-k sum
order is their own, so ``moe_ep`` is checked against the oracle under
``nvfp4_jax.testing.assert_moe_close``'s derived interval (as test_moe_gpu.py checks the
single-device layer); the column-parallel linear against single-device ``matmul`` bit for
bit; the row-parallel linear against the oracle under ``oracle.gemm_error_bound``; the
sharded decoder (``models.shard_model``) against the single-device decoder within the
execution noise of two single-device backends (test_parallel_models.model_agreement, whose
body the CPU suite also runs on 2 host devices).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
from nvfp4_jax import parallel as par
from nvfp4_jax.testing import assert_gemm_close, assert_moe_close

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
    pytest.skip("needs 2 or more NVIDIA GPUs", allow_module_level=True)

DEVICES = [d for d in (2, 4, 8) if d <= len(jax.devices())]


def _stack(rng, e, n, k):
    """trtllm quantization of a random [E, N, K] stack, one decode scale per expert."""
    return nj.quantize_experts(jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32), "trtllm")


@pytest.mark.parametrize("d", DEVICES)
def test_moe_ep_gpu_within_oracle_bound(d):
    rng = np.random.default_rng(d)
    e, h, inter, t, k = 16, 1024, 512, 64, 4
    fc1, fc2 = _stack(rng, e, inter, h), _stack(rng, e, h, inter)
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    s1 = jnp.full((e,), 4.0 / 2688, jnp.float32)
    s2 = jnp.full((e,), 1.0 / 2688, jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    mesh = par.mesh_1d(d, "ep")
    out = par.moe_ep(x, fc1=par.shard_experts(fc1, mesh), fc2=par.shard_experts(fc2, mesh),
                     fc1_input_scale=s1, fc2_input_scale=s2, topk_ids=ids, topk_weights=wts,
                     mesh=mesh, backend="auto")
    assert_moe_close(np.asarray(out.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)),
                     np.asarray(ids), np.asarray(wts), nj.to_oracle(fc1), nj.to_oracle(fc2),
                     np.asarray(s1), np.asarray(s2), label=f"moe_ep D={d}")


@pytest.mark.parametrize("d", DEVICES)
def test_linear_tp_gpu(d):
    rng = np.random.default_rng(d)
    w = nj.quantize(jnp.asarray(rng.standard_normal((1024, 2048)), jnp.float32), "trtllm")
    x = jnp.asarray(rng.standard_normal((16, 2048)), jnp.bfloat16)
    mesh = par.mesh_1d(d, "tp")
    single = nj.matmul(x, w, out_dtype=jnp.float32)
    col = par.linear_tp(x, w, mesh=mesh, mode="column", out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(col), np.asarray(single))
    row = par.linear_tp(x, w, mesh=mesh, mode="row", out_dtype=jnp.float32)
    assert_gemm_close(np.asarray(row), np.asarray(x.astype(jnp.float32), np.float64),
                      nj.to_oracle(w), out_dtype="float32", label=f"row-parallel D={d}")


@functools.lru_cache(maxsize=1)
def _model_checks():
    """test_parallel_models as a module (once: its jitted programs are reused by each case)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_parallel_models.py")
    spec = importlib.util.spec_from_file_location("parallel_model_checks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("row", ["psum", "gather"])
@pytest.mark.parametrize("d", DEVICES)
def test_sharded_model_gpu(d, row):
    ok, detail = _model_checks().model_agreement(d, row)
    assert ok, detail
