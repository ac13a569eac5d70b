"""W4A4 GEMM on FP4 tensor cores (nvfp4_jax/gemm/fp4mma.py) on CPU: the Triton IR it lowers to,
the same source in Pallas interpret mode against the exact oracle, argument checks, and (where a
Triton compiler is installed) the block-scaled FP4 MMA count in sm_120a/sm_121a SASS."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import nvfp4_jax
import oracle
from nvfp4_jax.gemm.fp4mma import (
    Fp4MmaConfig,
    decode_tile,
    dot_scaled,
    gemm_fp4mma,
    matmul_fp4mma,
)
from nvfp4_jax.testing import assert_gemm_close
from nvfp4_jax.testing import strategies as nst


def _random_nvfp4(rng, rows, k, *, subnormal_frac=0.3, decode_scale=1.0) -> oracle.NVFP4:
    """All 16 codes; E4M3 scale bytes 0x00..0x7E (no NaN, sign clear), a share of them
    subnormal (0x01..0x07)."""
    codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    normal = rng.integers(0x08, 0x7F, (rows, k // 16))
    sub = rng.integers(0x00, 0x08, (rows, k // 16))
    scales = np.where(rng.random((rows, k // 16)) < subnormal_frac, sub, normal).astype(np.uint8)
    return oracle.NVFP4(codes, scales, np.float64(np.float32(decode_scale)))


def _fp32_alpha(a: oracle.NVFP4, w: oracle.NVFP4) -> float:
    """alpha as the kernel forms it: one fp32 product of the two decode scales."""
    return float(np.float32(a.decode_scale) * np.float32(w.decode_scale))


def _capture_ttir(m, n, k, cfg):
    import sm12x_fp4mma_compile
    return sm12x_fp4mma_compile.capture_ttir(m, n, k, cfg)[0]


def test_ttir_is_one_scaled_fp4_dot_with_e4m3_scales_per_16():
    cfg = Fp4MmaConfig(block_m=16, block_n=64, block_k=256)
    ttir = _capture_ttir(16, 256, 1024, cfg)
    dots = [ln for ln in ttir.splitlines() if "tt.dot_scaled" in ln]
    assert len(dots) == 1, dots
    # weights [BN, BK/2] are the MMA's lhs, tokens [BK/2, BM] its rhs; scales one per 16 of K
    assert "lhs = e2m1 rhs = e2m1" in dots[0]
    assert "tensor<64x128xi8>, tensor<64x16xf8E4M3FN> * tensor<128x16xi8>, " \
           "tensor<16x16xf8E4M3FN> -> tensor<64x16xf32>" in dots[0], dots[0]
    # no decode in the kernel: no plain dot, no float conversion of the codes
    assert not re.search(r"\btt\.dot\b(?!_scaled)", ttir)
    assert "tt.fp_to_fp" not in ttir


@pytest.mark.parametrize(
    "m,n,k,cfg,out_dtype",
    [
        (1, 64, 128, Fp4MmaConfig(block_m=8, block_n=64, block_k=64), jnp.float32),
        (5, 48, 80, Fp4MmaConfig(block_m=8, block_n=16, block_k=64), jnp.bfloat16),
        (33, 130, 272, Fp4MmaConfig(block_m=16, block_n=64, block_k=128), jnp.float32),
        (16, 64, 512, Fp4MmaConfig(block_m=16, block_n=32, block_k=256), jnp.float16),
    ],
)
def test_interpret_matches_oracle(m, n, k, cfg, out_dtype):
    rng = np.random.default_rng(m * 1000 + n + k)
    # fp16 saturates at 65504: smaller global scales keep its outputs finite
    a = _random_nvfp4(rng, m, k, decode_scale=2.0**-9 if out_dtype == jnp.float16 else 0.37)
    w = _random_nvfp4(rng, n, k, decode_scale=1.0 / 3.0)
    out = matmul_fp4mma(nvfp4_jax.from_oracle(a), nvfp4_jax.from_oracle(w),
                        out_dtype=out_dtype, config=cfg, interpret=True)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_gemm_close(np.asarray(out, np.float32), a, w, alpha=_fp32_alpha(a, w),
                      out_dtype=jnp.dtype(out_dtype).name, label="fp4mma interpret")


@settings(max_examples=12)
@given(
    nst.nvfp4_tensors(rows=3, blocks_per_row=6),
    nst.nvfp4_tensors(rows=20, blocks_per_row=6),
)
def test_interpret_matches_oracle_on_quantized_tensors(a, w):
    """Recipe-quantized operands (subnormal, underflowing and saturating block scales)."""
    cfg = Fp4MmaConfig(block_m=8, block_n=16, block_k=64)
    out = matmul_fp4mma(nvfp4_jax.from_oracle(a), nvfp4_jax.from_oracle(w),
                        out_dtype=jnp.float32, config=cfg, interpret=True)
    assert_gemm_close(np.asarray(out), a, w, alpha=_fp32_alpha(a, w), out_dtype="float32")


def test_reference_decode_is_exact_for_every_code_byte_and_scale():
    """The primitive's reference decode (what interpret mode and plain XLA run): all 256 code
    bytes under each of the 127 non-NaN non-negative E4M3 scales, against the oracle."""
    codes = np.tile(np.arange(256, dtype=np.uint8).reshape(32, 8), (127, 1))  # [127*32, 8]
    scales = np.repeat(np.arange(0x7F, dtype=np.uint8), 32)[:, None]  # [127*32, 1]
    got = np.asarray(decode_tile(jnp.asarray(codes), jnp.asarray(scales)), np.float64)
    want = oracle.dequantize(oracle.NVFP4(codes, scales, np.float64(1.0)),
                             include_decode_scale=False)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_dot_scaled_outside_a_kernel_matches_oracle():
    rng = np.random.default_rng(7)
    a, w = _random_nvfp4(rng, 8, 64), _random_nvfp4(rng, 16, 64)
    acc = np.zeros((8, 16), np.float32)
    got = dot_scaled(jnp.asarray(acc), jnp.asarray(a.codes), jnp.asarray(a.scales),
                     jnp.asarray(w.codes), jnp.asarray(w.scales))
    assert_gemm_close(np.asarray(got), a, w, alpha=1.0, out_dtype="float32")
    acc1 = dot_scaled(jnp.ones((8, 16), jnp.float32), jnp.asarray(a.codes),
                      jnp.asarray(a.scales), jnp.asarray(w.codes), jnp.asarray(w.scales))
    np.testing.assert_array_equal(np.asarray(acc1), np.asarray(got) + np.float32(1))


def test_argument_errors_name_the_argument():
    x = jnp.zeros((4, 32), jnp.uint8)
    xs = jnp.zeros((4, 4), jnp.float8_e4m3fn)
    w = jnp.zeros((8, 32), jnp.uint8)
    ws = jnp.zeros((8, 4), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="w_codes: K mismatch"):
        gemm_fp4mma(x, xs, jnp.zeros((8, 16), jnp.uint8), ws, 1.0, interpret=True)
    with pytest.raises(ValueError, match="x_scales: expected float8_e4m3fn"):
        gemm_fp4mma(x, xs.astype(jnp.float32), w, ws, 1.0, interpret=True)
    with pytest.raises(ValueError, match="w_scales: expected shape"):
        gemm_fp4mma(x, xs, w, ws[:, :2], 1.0, interpret=True)
    with pytest.raises(ValueError, match="alpha: expected an fp32 scalar"):
        gemm_fp4mma(x, xs, w, ws, jnp.ones(2), interpret=True)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm_fp4mma(x, xs, w, ws, 1.0, out_dtype=jnp.int8, interpret=True)
    with pytest.raises(ValueError, match="config: expected an Fp4MmaConfig"):
        gemm_fp4mma(x, xs, w, ws, 1.0, config=(16, 64, 128), interpret=True)
    with pytest.raises(ValueError, match="block_k >= 64"):
        Fp4MmaConfig(block_k=32)
    with pytest.raises(ValueError, match="block_n: expected a power of two"):
        Fp4MmaConfig(block_n=48)
    with pytest.raises(ValueError, match="x: expected an NVFP4Array"):
        matmul_fp4mma(np.zeros((4, 64)), nvfp4_jax.quantize(jnp.ones((8, 64), jnp.float32)))


def test_sm12x_sass_has_block_scaled_fp4_mma():
    """sm_120a and sm_121a builds contain OMMA...E2M1.E2M1.UE4M3.4X and no other MMA; sm_90a
    builds the same TTIR decomposed (bf16 wgmma). Needs a Triton compiler: XLA's through a jax
    CUDA plugin (jax <= 0.10.x) or pip triton (>= 3.8 for sm_121a and sm_90a). Each default
    tile (decode, mid, prefill M) fits SM12x's 99 KiB of shared memory."""
    import sm12x_fp4mma_compile as sc
    jt, why = sc.xla_compiler()
    if jt is None and sc.pip_triton_version() is None:
        pytest.skip(f"no Triton compiler here (pip triton absent; XLA's: {why})")
    summary = sc.run(None, shapes=((16, 256, 512), (1, 128, 4096), (64, 256, 1024),
                                   (300, 256, 1024)))
    assert summary["checked_builds"] > 0
    assert not summary["problems"], "\n".join(summary["problems"])
