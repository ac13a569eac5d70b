"""NVFP4 W4A16 Mosaic GPU kernel (Hopper) vs the exact oracle: ragged shapes, M in {1, 5, 16, 64},
(best-effort) NaN-poisoned outputs, exhaustive decode through the kernel. Skipped without an sm_90 GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from nvfp4_jax.device import gpu_compute_capability
from nvfp4_jax.gemm.mosaic import MosaicConfig, matmul_mosaic
from nvfp4_jax.testing import assert_gemm_close

pytestmark = pytest.mark.gpu


if gpu_compute_capability() != 90:
    pytest.skip("needs an sm_90 (Hopper) NVIDIA GPU", allow_module_level=True)


def _case(rng, m, n, k, x_mag):
    # block magnitudes spread over 2^-14 .. 2^5 so that many scales are E4M3 subnormals
    mag = np.exp2(rng.uniform(-14, 5, (n, k // 16))).repeat(16, 1)
    wo = oracle.quantize((rng.standard_normal((n, k)) * mag).astype(np.float32), "trtllm")
    x = jnp.asarray((rng.standard_normal((m, k)) * x_mag).astype(np.float32)).astype(jnp.bfloat16)
    return wo, x


def _run(x, wo, out_dtype, cfg):
    return matmul_mosaic(
        x,
        jnp.asarray(wo.codes),
        jnp.asarray(wo.scales),
        np.float32(wo.decode_scale),
        out_dtype=out_dtype,
        config=cfg,
        poison=True,
    )


@pytest.mark.parametrize(
    "m,n,k,x_mag,cfg",
    [
        (1, 4096, 4096, 1.0, None),
        (5, 4000, 4096, 40.0, None),  # ragged N (not a multiple of block_n) and M
        (16, 6144, 2048, 1e-2, None),
        (16, 1000, 2304, 1.0, MosaicConfig(block_n=64, split_k=3, num_stages=2)),
        (37, 3000, 1024, 1.0, MosaicConfig(block_n=128, split_k=2, num_stages=3)),
        (64, 2048, 4096, 1.0, None),
        (64, 333, 512, 30.0, MosaicConfig(block_n=64, split_k=1, num_stages=2)),
        # four 128-deep wgmmas per pipeline step (scale tile rows of 32 bytes)
        (16, 1000, 2048, 1.0, MosaicConfig(block_n=64, split_k=2, num_stages=3, block_k=512)),
        (37, 3000, 1536, 3.0, MosaicConfig(block_n=64, split_k=1, num_stages=2, block_k=512)),
        # decode overlapping the previous wgmma
        (16, 4000, 4096, 1.0, MosaicConfig(block_n=64, split_k=2, num_stages=2, overlap=True)),
        (64, 1000, 3072, 5.0, MosaicConfig(block_n=64, split_k=1, num_stages=2, block_k=512,
                                           overlap=True)),
        (33, 2048, 8192, 1.0, MosaicConfig(block_n=64, split_k=4, num_stages=3, overlap=True)),
        # warp-specialized: 2-3 compute warpgroups sharing the x stages (ragged N: the last
        # CTA's rows run past N), a TMA producer warpgroup
        # (ids "ws*": run them alone first, with a short timeout, the first time on a GPU)
        pytest.param(64, 2048, 4096, 1.0, MosaicConfig(block_n=64, split_k=1, num_stages=2, consumers=2),
                     id="ws2_m64"),
        pytest.param(16, 4000, 4096, 3.0, MosaicConfig(block_n=128, split_k=2, num_stages=2, consumers=2),
                     id="ws2_m16_bn128"),
        pytest.param(37, 3000, 1024, 1.0, MosaicConfig(block_n=64, split_k=1, num_stages=3, consumers=3,
                                                       overlap=True), id="ws3_overlap"),
        pytest.param(5, 1000, 2048, 40.0, MosaicConfig(block_n=64, split_k=2, num_stages=2, consumers=3),
                     id="ws3_ragged"),
        # bf16_store: the unsplit kernel stores bf16(alpha * acc) itself (fp32 output: the
        # XLA epilogue, logged); one warpgroup, and two with ragged M and N
        pytest.param(64, 2048, 4096, 1.0, MosaicConfig(block_n=128, split_k=1, num_stages=2, bf16_store=True),
                     id="bs_m64"),
        pytest.param(37, 3000, 1024, 3.0, MosaicConfig(block_n=64, split_k=1, num_stages=2, consumers=2,
                                                       bf16_store=True), id="bs_ws2_ragged"),
        # warp-level mma.sync (the SM 12.x form): token tiles 8..64, block_n 64 / 128, block_k
        # 512, split-K, ragged M and N, the bf16 store
        pytest.param(1, 4096, 4096, 1.0, MosaicConfig(block_n=128, split_k=2, num_stages=2, mma="sync"),
                     id="sync_m1"),
        pytest.param(5, 4000, 4096, 40.0, MosaicConfig(block_n=64, split_k=4, num_stages=3, mma="sync"),
                     id="sync_ragged"),
        pytest.param(16, 1000, 2048, 1e-2, MosaicConfig(block_n=64, split_k=2, num_stages=3, block_k=512,
                                                        mma="sync"), id="sync_bk512"),
        pytest.param(37, 3000, 1024, 1.0, MosaicConfig(block_n=128, split_k=1, num_stages=2, mma="sync"),
                     id="sync_m37"),
        pytest.param(64, 2048, 4096, 3.0, MosaicConfig(block_n=128, split_k=1, num_stages=2, bf16_store=True,
                                                       mma="sync"), id="sync_bs_m64"),
    ],
)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_vs_oracle_poisoned(m, n, k, x_mag, cfg, out_dtype):
    rng = np.random.default_rng(m * 7 + n + k)
    wo, x = _case(rng, m, n, k, x_mag)
    out = _run(x, wo, out_dtype, cfg)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_gemm_close(
        np.asarray(out, np.float32), np.asarray(x, np.float32), wo,
        out_dtype=jnp.dtype(out_dtype).name, splits=16,
    )


@pytest.mark.parametrize("mma", ["wgmma", "sync"])
def test_mosaic_exhaustive_decode(mma):
    """Every code byte under every finite E4M3 scale byte (both signs, subnormals, zero),
    read back exactly through one-hot activations: out[t, n] = W[n, k_t], with either MMA."""
    cfg = MosaicConfig(block_n=128, split_k=1, num_stages=2, mma=mma)
    sbytes = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)  # 254 scales
    n, k = 2 * len(sbytes), 256
    codes = np.empty((n, k // 2), np.uint8)
    codes[0::2] = np.arange(128, dtype=np.uint8)
    codes[1::2] = np.arange(128, 256, dtype=np.uint8)
    scales = np.repeat(sbytes, 2)[:, None].repeat(k // 16, 1)
    wo = oracle.NVFP4(codes, scales, np.float64(1.0))
    ref = oracle.dequantize(wo, include_decode_scale=False)  # [n, k] float64
    for q in range(k // 64):
        x = np.zeros((64, k), np.float32)
        x[np.arange(64), 64 * q + np.arange(64)] = 1.0
        out = matmul_mosaic(
            jnp.asarray(x, jnp.bfloat16), jnp.asarray(codes), jnp.asarray(scales),
            np.float32(1.0), out_dtype=jnp.float32, poison=True, config=cfg,
        )
        np.testing.assert_array_equal(
            np.asarray(out, np.float64), ref[:, 64 * q : 64 * q + 64].T
        )


def test_mosaic_jit_and_scale_dtypes():
    rng = np.random.default_rng(11)
    wo, x = _case(rng, 3, 512, 1024, 1.0)
    f = jax.jit(lambda x, c, s: matmul_mosaic(x, c, s, 0.5, out_dtype=jnp.float32))
    s8 = jax.lax.bitcast_convert_type(jnp.asarray(wo.scales), jnp.float8_e4m3fn)
    a = f(x, jnp.asarray(wo.codes), s8)
    b = f(x, jnp.asarray(wo.codes), jnp.asarray(wo.scales))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_gemm_close(np.asarray(a), np.asarray(x, np.float32), wo, alpha=0.5,
                      out_dtype="float32", splits=16)


def test_every_auto_config_vs_oracle_poisoned():
    """Every committed ``AUTO_SM90`` config on a ragged shape of its M bucket (N not a multiple
    of block_n, M below the bucket's token tile) at its entry's K (so its split's K steps per
    CTA), bf16 output, against the oracle's bound."""
    from nvfp4_jax.gemm.mosaic import AUTO_SM90

    rng = np.random.default_rng(17)
    for (mb, _, k), cfg in sorted(AUTO_SM90.items(), key=lambda kv: (kv[0], repr(kv[1]))):
        m, n = max(1, mb - 3), 1000
        wo, x = _case(rng, m, n, k, 3.0)
        out = _run(x, wo, jnp.bfloat16, cfg)
        assert out.shape == (m, n)
        assert_gemm_close(np.asarray(out, np.float32), np.asarray(x, np.float32), wo,
                          out_dtype="bfloat16", splits=16)


@pytest.mark.parametrize("arch", [(12, 0), (12, 1)])
def test_sm12x_path_lowered_as_sm12x(arch, monkeypatch, caplog):
    """``nvfp4_jax.matmul`` as an RTX 50xx (12.0) / DGX Spark (12.1) user gets it: ``auto``
    picks the Mosaic kernel's mma.sync form with ``config_for``'s SM 12.x tiles, and Mosaic
    lowers it with the capability it reads set to SM 12.x (its C++ then compiles for this
    GPU); W4A16 at M = 1, 16, 64 on ragged shapes against the oracle's bound."""
    import nvfp4_jax
    from nvfp4_jax.gemm import api, mosaic
    from nvfp4_jax.testing import mosaic_lowered_as

    if not mosaic.has_mma_sync():
        pytest.skip(f"plgpu.mma needs JAX >= 0.11, this is {jax.__version__}")
    cc = 10 * arch[0] + arch[1]
    monkeypatch.setattr(api, "gpu_compute_capability", lambda: cc)
    monkeypatch.setattr(mosaic, "is_sm12x", lambda: True)
    rng = np.random.default_rng(cc)
    for m, n, k in ((1, 4000, 14336), (16, 6144, 4096), (64, 2000, 4096)):
        wo, x = _case(rng, m, n, k, 3.0)
        caplog.clear()
        with caplog.at_level("INFO", logger="nvfp4_jax.gemm.api"), mosaic_lowered_as(arch):
            out = jax.jit(lambda x, w: nvfp4_jax.matmul(x, w))(x, nvfp4_jax.from_oracle(wo))
        assert f"auto -> mosaic (sm_{cc}, mma.sync" in caplog.text
        assert_gemm_close(np.asarray(out, np.float32), np.asarray(x, np.float32), wo,
                          out_dtype="bfloat16", splits=16)


@pytest.mark.parametrize("m,n,k,x_mag", [(1, 5120, 2048, 1.0), (8, 2048, 4096, 1e-3),
                                         (37, 3000, 1024, 40.0), (64, 4096, 14336, 1.0)])
def test_w4a4_prologue_from_a_scale_stack(m, n, k, x_mag):
    """``gemm.matmul_w4a4_prologue``: the activation quantized, zero-padded and permuted in one
    launch, its input scale read from a [3] stack at layer 2, within the oracle's W4A4 bound;
    the activation's blocks span 2^-14..2^5 so its scales reach E4M3 subnormals."""
    import nvfp4_jax
    from nvfp4_jax.gemm import matmul_w4a4_prologue

    rng = np.random.default_rng(m * 7 + k)
    wo, _ = _case(rng, 1, n, k, 1.0)
    mag = np.exp2(rng.uniform(-14, 5, (m, k // 16))).repeat(16, 1)
    x = jnp.asarray((rng.standard_normal((m, k)) * mag * x_mag).astype(np.float32))
    x = x.astype(jnp.bfloat16)
    s_in = np.float32(np.abs(np.asarray(x, np.float32)).max() / np.float32(2688))
    stack = jnp.asarray([s_in * 8, s_in / 8, s_in], jnp.float32)
    w = nvfp4_jax.from_oracle(wo)
    f = jax.jit(lambda x, w, s: matmul_w4a4_prologue(x, w, s, layer=jnp.int32(2),
                                                      out_dtype=jnp.float32))
    assert "nvfp4_mosaic_w4a4_operand" in f.lower(x, w, stack).as_text()
    assert_gemm_close(np.asarray(f(x, w, stack), np.float32), np.asarray(x, np.float32), wo,
                      input_scale=float(s_in), out_dtype="float32", splits=16)


@pytest.mark.parametrize("m,n,k,norm,sm12x", [
    (1, 5120, 2048, True, False), (8, 2048, 4096, True, False), (37, 3000, 2048, True, False),
    (64, 4096, 8192, True, False), (5, 1024, 14336, False, False),
    (1, 5120, 2048, True, True), (33, 1024, 14336, False, True)])
def test_norm_linear_on_the_prologue_within_its_bound(m, n, k, norm, sm12x, monkeypatch):
    """``nn.norm_linear`` as the decoders' scan runs it (norm weight and input scale read from
    two-layer stacks at layer 1; RMSNorm'd or plain) on the one-launch prologue and the Mosaic
    GEMM, inside ``testing.norm_linear_bound`` (the norm's rounding interval through the
    quantizer and the GEMM); the norm weights span 2^-10..2^4, so activation block scales
    reach E4M3 subnormals, and the input scale saturates every other case. ``sm12x``: the GEMM
    lowered as SM 12.0 (mma.sync), the capability it reads patched."""
    import contextlib

    import nvfp4_jax
    from nvfp4_jax import nn
    from nvfp4_jax.gemm import api, mosaic, prologue_applies
    from nvfp4_jax.testing import assert_norm_linear_close, mosaic_lowered_as
    from oracle.formats import bf16_round, f32

    ctx = contextlib.nullcontext()
    if sm12x:
        if not mosaic.has_mma_sync():
            pytest.skip(f"plgpu.mma needs JAX >= 0.11, this is {jax.__version__}")
        monkeypatch.setattr(api, "gpu_compute_capability", lambda: 120)
        monkeypatch.setattr(mosaic, "is_sm12x", lambda: True)
        ctx = mosaic_lowered_as((12, 0))
    assert prologue_applies(m, n, k, norm=norm)
    fn = jax.jit(lambda p, x, nw, ss: nn.norm_linear(p, x, nw, 1e-6, layer=jnp.int32(1),
                                                      input_scales=ss))
    for i in range(2):
        rng = np.random.default_rng([m, n, k, i])
        wo, _ = _case(rng, 1, n, k, 1.0)
        x = bf16_round(rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-2, 2))
        norms = bf16_round(np.exp2(rng.uniform(-10, 4, (2, k))) * rng.choice([-1, 1], (2, k)))
        xn = oracle.norm_rope_interval(x, norms[1], 1e-6, None, None)[0] if norm else x
        s = float(f32(np.abs(xn).max() / 2688 * (1.0 if i == 0 else 2.0**-6)))
        args = (nn.Linear(nvfp4_jax.from_oracle(wo), jnp.float32(s)), jnp.asarray(x, jnp.bfloat16),
                jnp.asarray(norms, jnp.bfloat16) if norm else None,
                jnp.asarray([1.5 * s, s], jnp.float32))
        with ctx if i == 0 else contextlib.nullcontext():
            if i == 0:
                assert "nvfp4_mosaic_w4a4_operand" in fn.lower(*args).as_text()
            out = fn(*args)
        assert_norm_linear_close(np.asarray(out, np.float32), x, wo, s,
                                 norms[1] if norm else None, label=f"case {i}")
