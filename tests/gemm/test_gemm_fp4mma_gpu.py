"""The FP4-MMA W4A4 kernel (nvfp4_jax/gemm/fp4mma.py) on an NVIDIA GPU against the exact oracle.

The same source that builds to ``OMMA ... E2M1.E2M1.UE4M3.4X`` on sm_120a/sm_121a runs here
through the Triton XLA bundles: native on SM12x, decomposed to bf16 MMAs on sm_90 (H200). No
XLA flag is involved (the kernel divides nothing; operands are already NVFP4). Skipped without
a CUDA GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax
import oracle
from nvfp4_jax.device import on_gpu
from nvfp4_jax.gemm.fp4mma import Fp4MmaConfig, gemm_fp4mma, matmul_fp4mma
from nvfp4_jax.testing import assert_gemm_close

pytestmark = pytest.mark.gpu


if not on_gpu():  # the package's one device probe
    pytest.skip("needs an NVIDIA GPU (jax has no gpu device here)", allow_module_level=True)


def _operand(rng, rows, k, decode_scale, subnormal_frac=0.25) -> oracle.NVFP4:
    """Recipe-quantized rows (block maxima over 2^-5 .. 2^5), then a share of the blocks given
    E4M3-subnormal scale bytes 0x01..0x07 (codes kept), so both scale ranges meet the MMA."""
    mag = np.exp2(rng.uniform(-5, 5, (rows, k // 16))).repeat(16, 1)
    t = oracle.quantize((rng.standard_normal((rows, k)) * mag).astype(np.float32), "trtllm",
                        decode_scale=decode_scale)
    scales = np.where(rng.random(t.scales.shape) < subnormal_frac,
                      rng.integers(1, 8, t.scales.shape), t.scales).astype(np.uint8)
    return oracle.NVFP4(t.codes, scales, t.decode_scale)


def _alpha(a, w) -> float:
    return float(np.float32(a.decode_scale) * np.float32(w.decode_scale))


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 4096, 4096, Fp4MmaConfig(block_m=16, block_n=64, block_k=256)),
        (16, 6144, 4096, Fp4MmaConfig(block_m=16, block_n=64, block_k=256)),
        (37, 4000, 4112, Fp4MmaConfig(block_m=16, block_n=64, block_k=128)),
        (256, 4096, 1024, Fp4MmaConfig(block_m=64, block_n=128, block_k=128, num_warps=8)),
        (300, 333, 1040, Fp4MmaConfig(block_m=32, block_n=64, block_k=64)),
    ],
)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_fp4mma_vs_oracle(m, n, k, cfg, out_dtype):
    rng = np.random.default_rng(m * 7 + n + k)
    a = _operand(rng, m, k, decode_scale=2.0**-7)
    w = _operand(rng, n, k, decode_scale=float(np.float32(0.013)))
    out = jax.jit(lambda a, w: matmul_fp4mma(a, w, out_dtype=out_dtype, config=cfg))(
        nvfp4_jax.from_oracle(a), nvfp4_jax.from_oracle(w)
    )
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_gemm_close(np.asarray(out, np.float32), a, w, alpha=_alpha(a, w),
                      out_dtype=jnp.dtype(out_dtype).name, label=f"fp4mma {m}x{n}x{k}")


def test_fp4mma_every_code_and_scale_byte():
    """Each weight row holds all 256 code bytes under one of the 127 non-NaN E4M3 scales
    (subnormals included); the activation is a one-hot per K element with scale 1.0, so each
    output is one decoded weight element: the MMA's decode and scale application, exactly."""
    k = 512  # 256 bytes per row: every code byte once
    w_codes = np.tile(np.arange(256, dtype=np.uint8), (127, 1))
    w_scales = np.repeat(np.arange(127, dtype=np.uint8)[:, None], k // 16, axis=1)
    w = oracle.NVFP4(w_codes, w_scales, np.float64(1.0))
    x_codes = np.zeros((k, k // 2), np.uint8)  # row j: e2m1 1.0 (code 2) at element j
    x_codes[np.arange(k), np.arange(k) // 2] = (2 << (4 * (np.arange(k) % 2))).astype(np.uint8)
    x_scales = np.full((k, k // 16), 0x38, np.uint8)  # E4M3 1.0
    out = gemm_fp4mma(jnp.asarray(x_codes), jnp.asarray(x_scales), jnp.asarray(w_codes),
                      jnp.asarray(w_scales), 1.0, out_dtype=jnp.float32,
                      config=Fp4MmaConfig(block_m=64, block_n=64, block_k=128))
    np.testing.assert_array_equal(np.asarray(out, np.float64).T,
                                  oracle.dequantize(w, include_decode_scale=False))


def test_sm12x_builds_of_this_source_hold_the_fp4_mma():
    """The compile check of tests/test_gemm_fp4mma.py on the GPU host (its Triton: pip triton
    3.6 checks sm_120a only, >= 3.8 also sm_121a and sm_90a)."""
    import sm12x_fp4mma_compile as sc

    jt, why = sc.xla_compiler()
    if jt is None and sc.pip_triton_version() is None:
        pytest.skip(f"no Triton compiler importable (pip triton absent; XLA's: {why})")
    summary = sc.run(None)
    assert summary["checked_builds"] > 0
    assert not summary["problems"], "\n".join(summary["problems"])
