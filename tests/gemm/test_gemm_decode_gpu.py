"""The bf16 decodes by multiply (``asm2m``, ``asmm``) and the SM12x config table on an NVIDIA GPU: the decoded
operand bit-exact against the oracle, GEMMs against the oracle's bound with poisoned outputs,
and bitwise equal to the same tile with the other decodes (same operand values, same MMA order).
Skipped without a CUDA GPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from nvfp4_jax.device import on_gpu
from nvfp4_jax.gemm import Config, configs, dequantize_pallas, matmul_pallas
from nvfp4_jax.testing import assert_gemm_close

pytestmark = pytest.mark.gpu

if not on_gpu():  # the package's one device probe
    pytest.skip("needs an NVIDIA GPU (jax has no gpu device here)", allow_module_level=True)


def _case(rng, m, n, k):
    mag = np.exp2(rng.uniform(-5, 5, (n, k // 16))).repeat(16, 1)
    wo = oracle.quantize((rng.standard_normal((n, k)) * mag).astype(np.float32), "trtllm")
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)).astype(jnp.bfloat16)
    return wo, x


def _run(wo, x, cfg, out_dtype=jnp.float32):
    return matmul_pallas(x, jnp.asarray(wo.codes), jnp.asarray(wo.scales),
                         np.float32(wo.decode_scale), out_dtype=out_dtype, config=cfg,
                         poison=True)


@pytest.mark.parametrize("decode", ["asm2m", "asmm"])
def test_dequant_2byte_exhaustive_codes_and_scales(decode):
    codes = np.tile(np.arange(256, dtype=np.uint8), (128, 1))
    scales = np.resize(np.concatenate([np.arange(0, 127), np.arange(128, 255)]).astype(np.uint8),
                       (128, 32))
    t = oracle.NVFP4(codes, scales, np.float64(1.0))
    got = dequantize_pallas(jnp.asarray(codes), jnp.asarray(scales), config=Config(decode=decode))
    np.testing.assert_array_equal(
        np.asarray(got, np.float64), oracle.dequantize(t, include_decode_scale=False)
    )


@pytest.mark.parametrize(
    "m,n,k,tile",
    [
        (1, 4096, 4096, (16, 128, 256, 1, 4, 4)),
        (16, 6144, 4096, (16, 128, 128, 2, 8, 3)),
        (37, 4000, 4112, (64, 64, 128, 1, 4, 3)),
        (64, 3000, 2048, (64, 128, 128, 1, 8, 3)),
    ],
)
def test_2byte_gemms_equal_asm_and_bits_bitwise(m, n, k, tile):
    """Same tile, three decodes: the MMA sees the same operand values in the same order, so
    the fp32 outputs agree bit for bit (the decodes' power-of-two post scale is exact)."""
    rng = np.random.default_rng(m * n + k)
    wo, x = _case(rng, m, n, k)
    outs = {d: np.asarray(_run(wo, x, Config(*tile, decode=d, load2d=True)))
            for d in ("asm2m", "asmm", "asm", "bits")}
    assert_gemm_close(outs["asm2m"], np.asarray(x, np.float32), wo, out_dtype="float32",
                      splits=16)
    for d in ("asm2m", "asmm", "asm"):
        np.testing.assert_array_equal(outs[d], outs["bits"], err_msg=d)
    np.testing.assert_array_equal(outs["asm"], outs["bits"])


def test_sm12x_table_configs_vs_oracle():
    """Every SM12x table entry runs (here on the local GPU) within the oracle's bound on a
    ragged shape of its M bucket."""
    rng = np.random.default_rng(5)
    seen = []
    for (mb, _, _), cfg in sorted(configs.TUNED_SM12X.items()):
        if cfg in seen:
            continue
        seen.append(cfg)
        m, n, k = max(1, mb - 3), 1000, 2064
        wo, x = _case(rng, m, n, k)
        out = matmul_pallas(x, jnp.asarray(wo.codes), jnp.asarray(wo.scales),
                            np.float32(wo.decode_scale), out_dtype=jnp.bfloat16, config=cfg,
                            poison=cfg.algo == "fused")
        assert_gemm_close(np.asarray(out, np.float32), np.asarray(x, np.float32), wo,
                          out_dtype="bfloat16", splits=16)
