"""Mosaic GPU NVFP4 kernel on CPU: argument validation, the K permutation, and that the kernel
lowers for CUDA (Pallas -> Mosaic GPU lowering, incl. layouts and wgmma checks) without a GPU."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_jax.gemm.mosaic import (
    AUTO_SM90,
    PERM,
    MosaicConfig,
    check_config,
    check_supported,
    default_config,
    matmul_mosaic,
    permute_x,
    token_tile,
)


def _args(m, n, k, sdtype=jnp.float8_e4m3fn):
    return (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((n, k // 16), sdtype),
        jax.ShapeDtypeStruct((), jnp.float32),
    )


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 4096, 4096, None),
        (5, 4000, 4096, None),
        (16, 28672, 8192, None),
        (37, 333, 512, MosaicConfig(block_n=64, split_k=2, num_stages=2)),
        (64, 2048, 1024, MosaicConfig(block_n=128, split_k=1, num_stages=3)),
        (16, 1000, 2048, MosaicConfig(block_n=64, split_k=2, num_stages=3, block_k=512)),
        (37, 3000, 1536, MosaicConfig(block_n=64, split_k=1, num_stages=2, block_k=512)),
        # decode overlapping the previous wgmma
        (37, 3000, 1536, MosaicConfig(block_n=64, split_k=1, num_stages=2, block_k=512,
                                      overlap=True)),
        # warp-specialized: 2-3 compute warpgroups sharing the x stages, a TMA producer
        (64, 2048, 1024, MosaicConfig(block_n=64, split_k=1, num_stages=2, consumers=2)),
        (16, 4000, 4096, MosaicConfig(block_n=128, split_k=2, num_stages=2, consumers=2)),
        (1, 1000, 2048, MosaicConfig(block_n=64, split_k=2, num_stages=2, consumers=3,
                                     block_k=512, overlap=True)),
    ],
)
def test_lowers_for_cuda(m, n, k, cfg):
    f = jax.jit(lambda x, c, s, a: matmul_mosaic(x, c, s, a, config=cfg))
    text = f.trace(*_args(m, n, k)).lower(lowering_platforms=("cuda",)).as_text()
    assert "fma.rn.bf16x2" in text  # the in-register decode made it into the Mosaic module
    ws = bool(cfg and cfg.consumers > 1)
    assert ("nvfp4_w4a16_mosaic_ws" in text) == ws
    # the kernel's output: fp32 partials [split, mt, N padded to whole CTA tiles of
    # consumers * block_n rows]
    c = cfg or default_config(m, n, k)
    rows = c.consumers * c.block_n
    split = check_config(c, k, token_tile(m))
    shape = f"tensor<{split}x{token_tile(m)}x{-(-n // rows) * rows}"
    assert f"{shape}xf32>" in text and "tensor<1xf32>" not in text
    # bf16_store: unsplit, the kernel stores the finished bf16 output (alpha, a 4th operand)
    bs = dataclasses.replace(c, bf16_store=True)
    for out_dtype in (jnp.bfloat16, jnp.float32):
        g = jax.jit(functools.partial(matmul_mosaic, config=bs, out_dtype=out_dtype))
        text = g.trace(*_args(m, n, k)).lower(lowering_platforms=("cuda",)).as_text()
        fused = split == 1 and out_dtype == jnp.bfloat16
        assert f"{shape}x{'bf16' if fused else 'f32'}>" in text
        assert ("tensor<1xf32>" in text) == fused


def test_permutation_matches_fragment_layout():
    """Fragment column p = 32w + 8j + 2c + l holds element 32c + 8w + 4l + j of each 128-group."""
    x = jnp.arange(256, dtype=jnp.float32)[None]
    xp = np.asarray(permute_x(x, 8))
    assert xp.shape == (8, 256) and not xp[1:].any()
    for p in range(128):
        w, j, c, l = p // 32, (p // 8) % 4, (p // 2) % 4, p % 2
        assert PERM[p] == 32 * c + 8 * w + 4 * l + j
        assert xp[0, p] == PERM[p] and xp[0, 128 + p] == 128 + PERM[p]
    assert sorted(PERM.tolist()) == list(range(128))


def test_validation_names_the_argument():
    x = jnp.zeros((4, 512), jnp.bfloat16)
    c = jnp.zeros((64, 256), jnp.uint8)
    s = jnp.zeros((64, 32), jnp.uint8)
    with pytest.raises(ValueError, match="^x: expected bfloat16"):
        matmul_mosaic(x.astype(jnp.float16), c, s, 1.0)
    with pytest.raises(ValueError, match="^x: expected a 2-D"):
        matmul_mosaic(x[None], c, s, 1.0)
    with pytest.raises(ValueError, match="^w_codes: expected shape"):
        matmul_mosaic(x, c[:, :128], s, 1.0)
    with pytest.raises(ValueError, match="^w_codes: expected uint8"):
        matmul_mosaic(x, c.astype(jnp.int8), s, 1.0)
    with pytest.raises(ValueError, match="^w_scales: expected shape"):
        matmul_mosaic(x, c, s[:, :16], 1.0)
    with pytest.raises(ValueError, match="^w_scales: expected float8_e4m3fn"):
        matmul_mosaic(x, c, s.astype(jnp.int32), 1.0)
    with pytest.raises(ValueError, match="^out_dtype"):
        matmul_mosaic(x, c, s, 1.0, out_dtype=jnp.int8)
    with pytest.raises(ValueError, match="^config"):
        matmul_mosaic(x, c, s, 1.0, config="fast")
    with pytest.raises(ValueError, match="^x: the Mosaic kernel handles"):
        matmul_mosaic(jnp.zeros((65, 512), jnp.bfloat16), c, s, 1.0)
    xk = jnp.zeros((4, 768), jnp.bfloat16)
    ck, sk = jnp.zeros((64, 384), jnp.uint8), jnp.zeros((64, 48), jnp.uint8)
    with pytest.raises(ValueError, match="^config: block_k=512 does not divide K=768"):
        matmul_mosaic(xk, ck, sk, 1.0, config=MosaicConfig(block_n=64, block_k=512))
    big = MosaicConfig(block_n=128, split_k=1, num_stages=3, block_k=512)  # 300 KB at 64 tokens
    with pytest.raises(ValueError, match="^config: .* shared memory"):
        matmul_mosaic(jnp.zeros((64, 1024), jnp.bfloat16), jnp.zeros((64, 512), jnp.uint8),
                      jnp.zeros((64, 64), jnp.uint8), 1.0, config=big)
    with pytest.raises(ValueError, match="^w: the Mosaic kernel needs K % 256"):
        check_supported(4, 64, 528)
    for bad in ({"block_n": 96}, {"split_k": 0}, {"num_stages": 1}, {"num_stages": 9},
                {"block_k": 384}):
        with pytest.raises(ValueError, match="^MosaicConfig"):
            MosaicConfig(**bad)
    with pytest.raises(TypeError, match="^MosaicConfig.overlap"):
        MosaicConfig(overlap=1)
    with pytest.raises(TypeError, match="^MosaicConfig.bf16_store"):
        MosaicConfig(bf16_store=1)
    with pytest.raises(ValueError, match="^alpha: expected an fp32 scalar"):
        matmul_mosaic(jnp.zeros((16, 1024), jnp.bfloat16), jnp.zeros((64, 512), jnp.uint8),
                      jnp.zeros((64, 64), jnp.uint8), jnp.ones(2))
    for bad in ({"consumers": 0}, {"consumers": 4}):
        with pytest.raises(ValueError, match="^MosaicConfig"):
            MosaicConfig(**bad)
    with pytest.raises(ValueError, match="^config: consumers=2 needs K % 256 == 0 or swizzled"):
        check_config(MosaicConfig(consumers=2, block_n=64), 2688, 8)
    assert check_config(MosaicConfig(consumers=2, block_n=128), 2688, 8, swizzled=True) == 1


def test_smem_bytes_output_tile_reuses_the_pipeline():
    # stages: codes bn*bk/2 + scales bn*bk/16 + x mt*bk*2 bytes each; the fp32 output tile
    # (bn*mt*4) lives in a later scope, so a CTA needs the larger of the two, not the sum
    assert MosaicConfig(block_n=128, num_stages=2).smem_bytes(64) == 2 * (16384 + 2048 + 32768)
    assert MosaicConfig(block_n=64, num_stages=2).smem_bytes(16) == 2 * (8192 + 1024 + 8192)
    # whole-K scales: one [pair rows, 2K/16] buffer instead of per-stage scale tiles
    whole = MosaicConfig(block_n=128, num_stages=2).smem_bytes(8, whole_k=2688)
    assert whole == 2 * (16384 + 4096) + 72 * 336  # 72 = 64 + 1 pair rows, to a 128-byte copy
    # warp-specialized: each stage holds every consumer's weight tile and one shared x tile;
    # the consumers' output tiles are kernel-level scratch
    ws = MosaicConfig(block_n=64, num_stages=2, consumers=3).smem_bytes(64)
    assert ws == 2 * (3 * (8192 + 1024) + 32768) + 3 * 64 * 64 * 4


def test_default_config_fills_the_gpu():
    cfg = default_config(16, 4096, 4096)
    assert cfg.split_k * (4096 // cfg.block_n) >= 256 and (4096 // 256) % cfg.split_k == 0
    assert default_config(16, 28672, 8192).split_k * (28672 // 128) >= 256
    for m, n, k in ((1, 4096, 512), (64, 14336, 4096), (16, 333, 256)):
        cfg = default_config(m, n, k)
        steps = k // 256
        assert steps % cfg.split_k == 0 and (cfg.split_k == 1 or steps // cfg.split_k >= 2)
        assert cfg.smem_bytes(64) <= 227 * 1024


def test_auto_table_lookup():
    from nvfp4_jax.gemm.mosaic import AUTO_SM90, auto_config

    assert auto_config(1, 28672, 8192) == AUTO_SM90[(8, 28672, 8192)]
    assert auto_config(9, 28672, 8192) == AUTO_SM90[(16, 28672, 8192)]
    assert auto_config(8, 14336, 4096) == AUTO_SM90[(16, 14336, 4096)]  # no M <= 8 entry there
    assert auto_config(40, 28672, 8192) == AUTO_SM90[(64, 28672, 8192)]
    assert auto_config(65, 28672, 8192) is None and auto_config(16, 28672, 4096) is None
    for (mb, n, k), cfg in AUTO_SM90.items():
        check_supported(mb, n, k)
        assert isinstance(cfg, MosaicConfig)


def test_auto_on_sm90_picks_mosaic_for_every_shape_it_runs(monkeypatch, caplog):
    """On sm_90 ``auto`` runs the Mosaic kernel at every shape it supports (tuned tiles where
    listed, default_config elsewhere, logged), and Pallas-Triton where it cannot run."""
    from nvfp4_jax.gemm import api

    monkeypatch.setattr(api, "gpu_compute_capability", lambda: 90)
    pick = api._pick_mosaic  # noqa: SLF001 - the routing rule itself
    bf16 = jnp.bfloat16
    with caplog.at_level("INFO", logger="nvfp4_jax.gemm.api"):
        assert pick("auto", "pallas", 1, 28672, 8192, bf16) == "mosaic"
        assert "tuned" in caplog.text
        caplog.clear()
        assert pick("auto", "pallas", 1, 6144, 4096, bf16) == "mosaic"  # a fused q/k/v
        assert "default_config tiles" in caplog.text
    assert pick("auto", "pallas", 65, 6144, 4096, bf16) == "pallas"  # M beyond the kernel
    assert pick("auto", "pallas", 1, 6144, 4112, bf16) == "pallas"  # K % 256 != 0
    assert pick("auto", "pallas", 1, 6144, 4096, jnp.float16) == "pallas"
    assert pick("auto", "xla", 1, 6144, 4096, bf16) == "xla"
    from nvfp4_jax.gemm.pallas_triton import Config

    assert pick("auto", "pallas", 1, 6144, 4096, bf16, Config()) == "pallas"  # tiles asked for
    # what the benchmarks record as the kernel auto runs: the same rule
    assert api.auto_impl(1, 28672, 8192) == "mosaic" and api.auto_impl(65, 28672, 8192) == "pallas"
    monkeypatch.setattr(api, "gpu_compute_capability", lambda: 89)
    assert pick("auto", "pallas", 1, 28672, 8192, bf16) == "pallas"


def test_auto_on_sm12x_picks_the_mma_sync_form(monkeypatch, caplog):
    """On SM 12.x ``auto`` runs the Mosaic kernel in its mma.sync form where this JAX has
    ``plgpu.mma``, says so, and says why not where it has not (JAX 0.10)."""
    from nvfp4_jax.gemm import api, mosaic

    bf16 = jnp.bfloat16
    pick = api._pick_mosaic  # noqa: SLF001 - the routing rule itself
    for cc in (120, 121):
        monkeypatch.setattr(api, "gpu_compute_capability", lambda cc=cc: cc)
        monkeypatch.setattr(mosaic, "has_mma_sync", lambda: False)
        caplog.clear()
        with caplog.at_level("INFO", logger="nvfp4_jax.gemm.api"):
            assert pick("auto", "pallas", 1, 28672, 8192, bf16) == "pallas"
            assert pick("mosaic", "mosaic", 1, 28672, 8192, bf16) == "pallas"
        assert "needs plgpu.mma (JAX >= 0.11)" in caplog.text
        assert "backend mosaic -> pallas fallback" in caplog.text
        monkeypatch.setattr(mosaic, "has_mma_sync", lambda: True)
        caplog.clear()
        with caplog.at_level("INFO", logger="nvfp4_jax.gemm.api"):
            assert pick("auto", "pallas", 16, 28672, 8192, bf16) == "mosaic"
            assert pick("mosaic", "mosaic", 16, 28672, 8192, bf16) == "mosaic"
        assert f"auto -> mosaic (sm_{cc}, mma.sync" in caplog.text
        assert pick("auto", "pallas", 65, 28672, 8192, bf16) == "pallas"


@pytest.mark.parametrize("m,n,k", [(mb, n, k) for (mb, n, k) in AUTO_SM90]
                         + [(1, 6144, 4096), (40, 1024, 2048), (64, 128256, 4096), (5, 512, 512)])
def test_sm12x_configs_are_the_sync_form_within_99_kb(m, n, k, monkeypatch):
    """``config_for`` on SM 12.x: the sm_90 tiles in the mma.sync form (one warpgroup, no
    overlap), shrunk until one CTA fits 99 KB, and ``check_config`` takes them there; sm_90
    keeps its table."""
    from nvfp4_jax.gemm import mosaic

    sm90 = mosaic.config_for(m, n, k, 90)
    assert sm90 == (mosaic.auto_config(m, n, k) or mosaic.default_config(m, n, k))
    mt = mosaic.token_tile(m)
    for cc in (120, 121):
        c = mosaic.config_for(m, n, k, cc)
        assert (c.mma, c.consumers, c.overlap) == ("sync", 1, False)
        assert c.smem_bytes(mt) <= mosaic.SM12X_SMEM_LIMIT
        if sm90.smem_bytes(mt) <= mosaic.SM12X_SMEM_LIMIT:  # fits: the same tiles
            assert (c.block_n, c.split_k, c.num_stages, c.block_k) == (
                sm90.block_n, sm90.split_k, sm90.num_stages, sm90.block_k)
        monkeypatch.setattr(mosaic, "is_sm12x", lambda: True)
        mosaic.check_config(c, k, mt)
        monkeypatch.undo()
    big = MosaicConfig(block_n=128, num_stages=4)  # 4 x 48 KB at a 64-token tile
    monkeypatch.setattr(mosaic, "is_sm12x", lambda: True)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic.check_config(big, 4096, 64)
    fitted = mosaic.for_sm12x(big, 64)
    assert fitted.smem_bytes(64) <= mosaic.SM12X_SMEM_LIMIT and fitted.num_stages == 2


def test_sync_config_is_checked():
    for kw, msg in ((dict(mma="mma"), "expected one of"), (dict(mma="sync", consumers=2), "one warpgroup"),
                    (dict(mma="sync", overlap=True), "without overlap")):
        with pytest.raises(ValueError, match=msg):
            MosaicConfig(**kw)


def test_api_mosaic_backend_on_cpu_falls_back_to_pallas(caplog):
    import nvfp4_jax
    from nvfp4_jax.gemm import matmul

    rng = np.random.default_rng(0)
    w = nvfp4_jax.quantize(jnp.asarray(rng.standard_normal((64, 256)), jnp.float32), "trtllm")
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    with caplog.at_level("INFO", logger="nvfp4_jax.gemm.api"):
        got = matmul(x, w, backend="mosaic", out_dtype=jnp.float32)
        auto = matmul(x, w, backend="auto", out_dtype=jnp.float32)
    assert "backend mosaic -> pallas fallback" in caplog.text
    assert "backend auto -> xla" in caplog.text and "auto -> mosaic" not in caplog.text
    ref = matmul(x, w, backend="xla", out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))


def test_bf16_store_elsewhere_is_logged(caplog):
    """bf16_store with a split or a non-bf16 output keeps the fp32 partials, and says so."""
    for cfg, out_dtype in ((MosaicConfig(block_n=64, split_k=2, num_stages=2, bf16_store=True), jnp.bfloat16),
                           (MosaicConfig(block_n=64, split_k=1, num_stages=2, bf16_store=True), jnp.float16)):
        caplog.clear()
        f = jax.jit(functools.partial(matmul_mosaic, config=cfg, out_dtype=out_dtype))
        with caplog.at_level("INFO", logger="nvfp4_jax.gemm.mosaic"):
            f.trace(*_args(16, 1024, 2048)).lower(lowering_platforms=("cuda",))
        assert "bf16_store needs split_k 1 and a bf16 output" in caplog.text


@given(m=st.integers(1, 64), n=st.integers(1, 200_000), k=st.integers(1, 128).map(lambda v: 256 * v))
@settings(max_examples=200, deadline=None)
def test_sm12x_config_for_any_shape_runs_there(m, n, k):
    """Any shape the Mosaic kernel takes gets an SM 12.x config that ``check_config`` accepts
    with SM 12.x's 99 KB (the sm_90 one for the same shape fits 227 KB)."""
    from unittest import mock

    from nvfp4_jax.gemm import mosaic

    mt = token_tile(m)
    check_config(mosaic.config_for(m, n, k, 90), k, mt)
    c = mosaic.config_for(m, n, k, 120)
    assert c.mma == "sync"
    with mock.patch.object(mosaic, "is_sm12x", lambda: True):
        check_config(c, k, mt)


def test_mosaic_lowered_as_sets_and_restores_the_arch_hook():
    """``testing.mosaic_lowered_as``: inside, the compute capability Mosaic GPU's lowering
    reads is the one asked for; outside (also after an error) the JAX hook is back."""
    from jax.experimental.mosaic.gpu import core, utils

    from nvfp4_jax.testing import mosaic_lowered_as

    owner = utils if hasattr(utils, "_infer_arch") else core
    before = owner._infer_arch  # noqa: SLF001
    with mosaic_lowered_as((12, 1)):
        assert owner._infer_arch() == (12, 1)  # noqa: SLF001
    assert owner._infer_arch is before  # noqa: SLF001
    with pytest.raises(RuntimeError), mosaic_lowered_as((12, 0)):
        raise RuntimeError("inside")
    assert owner._infer_arch is before  # noqa: SLF001
