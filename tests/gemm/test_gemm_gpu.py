"""NVFP4 GEMM on an NVIDIA GPU (H200): real sizes vs the exact oracle, poisoned outputs, SM12x
compile. Skipped without a CUDA GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax
import oracle
from nvfp4_jax.device import on_gpu
from nvfp4_jax.gemm import Config, configs, dequantize_pallas, matmul, matmul_pallas
from nvfp4_jax.testing import assert_gemm_close

pytestmark = pytest.mark.gpu


if not on_gpu():  # the package's one device probe
    pytest.skip("needs an NVIDIA GPU (jax has no gpu device here)", allow_module_level=True)

def _case(rng, m, n, k):
    mag = np.exp2(rng.uniform(-5, 5, (n, k // 16))).repeat(16, 1)
    wo = oracle.quantize((rng.standard_normal((n, k)) * mag).astype(np.float32), "trtllm")
    x = jnp.asarray(
        (rng.standard_normal((m, k)) * rng.choice([1e-2, 1.0, 40.0])).astype(np.float32)
    ).astype(jnp.bfloat16)
    return wo, x


def _check(out, x, wo, out_dtype, splits=16):
    """The public oracle-bound assertion (NaN = unwritten output fails)."""
    assert_gemm_close(
        np.asarray(out, np.float32), np.asarray(x, np.float32), wo,
        out_dtype=jnp.dtype(out_dtype).name, splits=splits,
    )


@pytest.mark.parametrize(
    "m,n,k,decode",
    [
        (1, 4096, 4096, "asm"),
        (16, 6144, 4096, "asm"),
        (37, 4000, 4112, "asm"),
        (37, 4000, 4112, "bits"),
        (64, 3000, 2048, "asm16"),
        (256, 4096, 1024, "asm"),
        (1024, 2048, 2048, "asm"),
        (300, 333, 1040, "asm"),
    ],
)
def test_tuned_config_vs_oracle_poisoned(m, n, k, decode):
    rng = np.random.default_rng(m + n + k)
    wo, x = _case(rng, m, n, k)
    cfg = configs.get_config(m, n, k)
    cfg = Config(**{**cfg.__dict__, "decode": decode, "algo": "fused"})
    out = matmul_pallas(
        x,
        jnp.asarray(wo.codes),
        jnp.asarray(wo.scales),
        np.float32(wo.decode_scale),
        out_dtype=jnp.float32,
        config=cfg,
        poison=True,
    )
    _check(out, x, wo, jnp.float32)


def test_all_tuned_configs_vs_oracle():
    """Every committed config (fused and dequant_dot) on a ragged shape of its M bucket."""
    rng = np.random.default_rng(3)
    seen = set()
    for (mb, _, _), cfg in sorted(configs.TUNED.items()):
        if cfg in seen:
            continue
        seen.add(cfg)
        m, n, k = max(1, mb - 3), 1000, 2064
        wo, x = _case(rng, m, n, k)
        out = matmul_pallas(
            x,
            jnp.asarray(wo.codes),
            jnp.asarray(wo.scales),
            np.float32(wo.decode_scale),
            out_dtype=jnp.bfloat16,
            config=cfg,
            poison=cfg.algo == "fused",
        )
        _check(out, x, wo, jnp.bfloat16)


def test_public_matmul_auto_w4a16_and_w4a4(caplog):
    rng = np.random.default_rng(5)
    wo, x = _case(rng, 24, 2048, 4096)
    w = nvfp4_jax.from_oracle(wo)
    with caplog.at_level("INFO", logger="nvfp4_jax.gemm.api"):
        out = jax.jit(lambda x, w: matmul(x, w))(x, w)
    assert "backend auto -> pallas" in caplog.text
    _check(out, x, wo, jnp.bfloat16)
    s_in = np.float32(np.abs(np.asarray(x, np.float32)).max() / np.float32(2688))
    out = matmul(x, w, input_scale=s_in, out_dtype=jnp.float32)
    # W4A4 reference: x quantized with recipe trtllm and G = fp32(1/s_in),
    # alpha = fp32(s_in * weight_scale_2) (nvfp4_jax.testing.gemm_reference)
    assert_gemm_close(np.asarray(out, np.float32), np.asarray(x, np.float32), wo,
                      input_scale=float(s_in), out_dtype="float32", splits=16)


@pytest.mark.parametrize("decode", ["asm", "bits"])
def test_dequant_exhaustive_codes_and_scales(decode):
    codes = np.tile(np.arange(256, dtype=np.uint8), (128, 1))
    scales = np.resize(np.arange(0, 127, dtype=np.uint8), (128, 32))
    t = oracle.NVFP4(codes, scales, np.float64(1.0))
    got = dequantize_pallas(jnp.asarray(codes), jnp.asarray(scales), config=Config(decode=decode))
    np.testing.assert_array_equal(
        np.asarray(got, np.float64), oracle.dequantize(t, include_decode_scale=False)
    )


def test_sm12x_compile_has_tensor_core_mma(tmp_path):
    import sm12x_compile

    summary = sm12x_compile.run(str(tmp_path))
    assert summary["sm12x_hmma_ok"], summary


def test_register_rtx50_device_kind():
    """The RTX 50xx entry is added (JAX >= 0.11 only) and resolves to compute capability 12.0."""
    from nvfp4_jax.gemm import register_sm12x_device_kinds

    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        pytest.skip("this JAX has no jax._src.pallas.triton.gpu_info (JAX < 0.11)")
    kind = "NVIDIA GeForce RTX 5090 (test)"
    assert register_sm12x_device_kinds(kind)
    try:
        info = gpu_info.registry[kind]()
        assert info.compute_capability == 120
        assert not register_sm12x_device_kinds(kind)  # already known: no second entry
    finally:
        gpu_info.registry.pop(kind, None)
