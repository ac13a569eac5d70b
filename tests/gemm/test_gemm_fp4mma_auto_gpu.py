"""W4A4 on the FP4-MMA kernel through ``nvfp4_jax.matmul`` on an NVIDIA GPU: the NVFP4 operand
quantizer (``gemm.operand.w4a4_codes``, ``div.rn.f32``) byte-identical to the oracle, the
choice of ``backend="auto"`` (FP4 MMA on SM 12.x only: the H200 keeps Mosaic / the bf16 MMA),
and ``mma="fp4"`` forced, within the oracle's ``gemm_w4a4`` bound. Skipped without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
import oracle
from nvfp4_jax.device import gpu_compute_capability, is_sm12x, on_gpu
from nvfp4_jax.gemm import api
from nvfp4_jax.gemm.operand import w4a4_codes
from nvfp4_jax.testing import assert_gemm_close
from oracle.formats import bf16_round, f32

pytestmark = pytest.mark.gpu

if not on_gpu():  # the package's one device probe
    pytest.skip("needs an NVIDIA GPU (jax has no gpu device here)", allow_module_level=True)


def _case(seed: int, m: int, k: int, decades: float, headroom: float):
    """bf16 x, blocks over ``decades`` decades (E4M3-subnormal block scales), input_scale =
    headroom * amax / 2688 (headroom < 1: saturating block scales)."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-decades, 0, (m, k // 16)).repeat(16, 1)
    x = bf16_round(rng.standard_normal((m, k)) * mag * 10.0 ** rng.uniform(-3, 3))
    x[0, :2] = [-0.0, 0.0]
    return x, float(f32(np.abs(x).max() / 2688.0 * headroom))


def _weight(seed, n, k) -> oracle.NVFP4:
    rng = np.random.default_rng(seed + 1)
    mag = np.exp2(rng.uniform(-20, 0, (n, k // 16))).repeat(16, 1)
    return oracle.quantize(f32(rng.standard_normal((n, k)) * mag), "modelopt")


@pytest.mark.parametrize("m,k,headroom", [(1, 4096, 1.0), (37, 14336, 0.5), (300, 1040, 2.0**-6),
                                          (2048, 4096, 1.0), (9, 48, 2.0**-12)])
def test_codes_are_byte_exact_on_the_gpu(m, k, headroom):
    x, s = _case(m + k, m, k, 6.0, headroom)
    want = oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s)))
    codes, scales = jax.jit(w4a4_codes)(jnp.asarray(x, jnp.bfloat16), jnp.float32(s))
    np.testing.assert_array_equal(np.asarray(scales), want.scales, err_msg=f"scales M={m} K={k}")
    np.testing.assert_array_equal(np.asarray(codes), want.codes, err_msg=f"codes M={m} K={k}")


def test_codes_cover_subnormal_and_saturating_block_scales():
    x, s = _case(1, 64, 4096, 6.0, 0.5)
    want = oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s)))
    assert ((want.scales > 0) & (want.scales < 8)).any() and (want.scales == 0x7E).any()
    codes, scales = jax.jit(w4a4_codes)(jnp.asarray(x, jnp.bfloat16), jnp.float32(s))
    np.testing.assert_array_equal(np.asarray(scales), want.scales)
    np.testing.assert_array_equal(np.asarray(codes), want.codes)


def test_nonfinite_blocks_give_nan_scale_bytes_and_nan_rows():
    """docs/input-policy.md (traced, unchecked): a block with NaN/Inf gets scale byte 0x7F and
    its row of the FP4-MMA output is NaN, whatever the tensor core does with that byte."""
    x, s = _case(2, 4, 256, 2.0, 1.0)
    x[1, 20], x[2, 250] = np.nan, -np.inf
    xb = jnp.asarray(x, jnp.bfloat16)
    _, scales = jax.jit(w4a4_codes)(xb, jnp.float32(s))
    assert np.asarray(scales)[1, 1] == 0x7F and np.asarray(scales)[2, 15] == 0x7F
    w = nj.from_oracle(_weight(2, 128, 256))
    out = jax.jit(lambda v, t: nj.matmul(v, w, input_scale=t, mma="fp4",
                                         out_dtype=jnp.float32))(xb, jnp.float32(s))
    out = np.asarray(out)
    assert np.isnan(out[1:3]).all() and np.isfinite(out[[0, 3]]).all()


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 1024, 2048), (300, 256, 1040)])
def test_auto_picks_the_fp4_mma_only_on_sm12x(monkeypatch, m, n, k):
    calls = []
    real = api.gemm_fp4mma
    monkeypatch.setattr(api, "gemm_fp4mma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, s = _case(m, m, k, 3.0, 1.0)
    wo = _weight(m, n, k)
    out = jax.jit(lambda v, w, t: nj.matmul(v, w, input_scale=t, out_dtype=jnp.float32))(
        jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo), jnp.float32(s))
    assert len(calls) == (1 if is_sm12x() else 0), f"sm_{gpu_compute_capability()}: {calls}"
    assert_gemm_close(np.asarray(out), x, wo, input_scale=s, out_dtype="float32",
                      label=f"auto {m}x{n}x{k}")


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (5, 6144, 4096), (64, 512, 4096),
                                   (300, 256, 1040), (2048, 2048, 2048)])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_forced_fp4_mma_through_matmul(m, n, k, out_dtype):
    x, s = _case(m * 3 + k, m, k, 6.0, 1.0)
    wo = _weight(m, n, k)
    out = jax.jit(lambda v, w, t: nj.matmul(v, w, input_scale=t, mma="fp4", out_dtype=out_dtype))(
        jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo), jnp.float32(s))
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert_gemm_close(np.asarray(out, np.float32), x, wo, input_scale=s,
                      out_dtype=jnp.dtype(out_dtype).name, label=f"fp4 {m}x{n}x{k}")


def test_forced_fp4_mma_on_a_prequantized_activation():
    x, s = _case(7, 33, 2048, 4.0, 1.0)
    a = oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s)))
    wo = _weight(7, 512, 2048)
    out = jax.jit(lambda xa, w: nj.matmul(xa, w, mma="fp4", out_dtype=jnp.float32))(
        nj.from_oracle(a), nj.from_oracle(wo))
    assert_gemm_close(np.asarray(out), a, wo, out_dtype="float32", label="fp4 NVFP4Array x")
