"""FC2 weights zero-padded along K (``nvfp4_jax.moe.pad_fc2``) on the CPU: the padding itself,
the layer on every backend against the oracle (and bit for bit against the unpadded weights
where the arithmetic is the same), the grouped kernel with padded codes lowering for CUDA, and
the errors. The kernel itself runs in test_moe_mosaic_gpu.py."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import check_against_oracle, make_case
from test_moe import to_jax

import nvfp4_jax
from nvfp4_jax.gemm.mosaic import MosaicConfig, check_config
from nvfp4_jax.moe import pad_fc2
from nvfp4_jax.moe.mosaic import MosaicMoEConfig, grouped_matmul, moe_mosaic
from nvfp4_jax.moe.pallas_triton import moe_pallas
from nvfp4_jax.moe.weights import padded_inter, unpad_fc2
from oracle.layouts import padded_shape

LAYOUTS = ("linear", "swizzled_128x4")


def _stack(rng, e, h, inter, layout):
    codes = rng.integers(0, 256, (e, h, inter // 2), dtype=np.uint8)
    scales = rng.integers(0x01, 0x7E, (e, h, inter // 16), dtype=np.uint8)
    w = nvfp4_jax.NVFP4Array.from_parts(
        jnp.asarray(codes), jax.lax.bitcast_convert_type(jnp.asarray(scales), jnp.float8_e4m3fn),
        jnp.asarray(rng.uniform(1e-5, 1e-3, e), jnp.float32), shape=(e, h, inter))
    return w.with_layout(layout), codes, scales


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pad_fc2_appends_zero_columns(layout):
    rng = np.random.default_rng(5)
    w, codes, scales = _stack(rng, 3, 256, 384, layout)
    p = pad_fc2(w)
    assert p.shape == (3, 256, 512) and p.layout == layout
    pc = np.asarray(p.codes)
    ps = np.asarray(jax.lax.bitcast_convert_type(p.linear_scales(), jnp.uint8))
    np.testing.assert_array_equal(pc[..., :192], codes)
    np.testing.assert_array_equal(ps[..., :24], scales)
    assert not pc[..., 192:].any() and not ps[..., 24:].any()  # +0 codes, zero scales
    np.testing.assert_array_equal(np.asarray(p.decode_scale), np.asarray(w.decode_scale))
    # oracle view: the padded matrix decodes to the original with zero columns appended
    dw = np.asarray(nvfp4_jax.dequantize(w.with_layout("linear"), dtype=jnp.float32))
    dp = np.asarray(nvfp4_jax.dequantize(p.with_layout("linear"), dtype=jnp.float32))
    np.testing.assert_array_equal(dp[..., :384], dw)
    assert not dp[..., 384:].any()
    u = unpad_fc2(p, 384)  # and back
    np.testing.assert_array_equal(np.asarray(u.codes), codes)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(u.scales, jnp.uint8)),
                                  np.asarray(jax.lax.bitcast_convert_type(w.scales, jnp.uint8)))
    assert pad_fc2(_stack(rng, 2, 256, 512, layout)[0]).shape == (2, 256, 512)  # nothing to pad
    assert padded_inter(2688) == 2816 and padded_inter(768) == 768


def _layer(case, fc2, *, backend="mosaic", config=None, mode="trtllm_cutlass"):
    hidden, ids, w, fc1, _, s1, s2 = to_jax(case)
    if backend == "xla":
        return nvfp4_jax.moe(hidden, fc1=fc1, fc2=fc2, fc1_input_scale=s1, fc2_input_scale=s2,
                             topk_ids=ids, topk_weights=w, activation="relu2", mode=mode,
                             backend="xla")
    kw = {"reference": True} if backend == "mosaic" else {"interpret": True}
    fn = functools.partial(moe_mosaic if backend == "mosaic" else moe_pallas, activation="relu2",
                           gate_up_order="up_gate", mode=mode,
                           activation_scale="scalar" if mode == "trtllm_cutlass" else "per_expert",
                           config=config, return_intermediates=True, **kw)
    return jax.jit(fn)(hidden, ids, w, fc1, fc2, s1, s2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", [
    None,
    # FC2's 3 padded steps (K = 640 -> 768) split unevenly: 2 + 1
    MosaicMoEConfig(block_m=8, fc2=MosaicConfig(block_n=128, split_k=2)),
    # bf16 products (trtllm_cutlass, unsplit), two compute warpgroups on the padded K
    MosaicMoEConfig(block_m=16, bf16_partials=True,
                    fc2=MosaicConfig(block_n=128, split_k=1, consumers=2)),
])
def test_padded_fc2_layer_matches_oracle(layout, config):
    """The Mosaic path (kernels emulated in XLA, glue in interpret mode) with padded FC2 weights
    against the oracle of the unpadded layer; FC1's output h is the same bits either way."""
    case = make_case(np.random.default_rng(7), t=9, h=256, inter=640, e=6, k=3, activation="relu2",
                     scale_factor=2.0**15)  # block scales in E4M3 subnormals
    fc2 = to_jax(case)[4].with_layout(layout)
    out, inter = _layer(case, pad_fc2(fc2), config=config)
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    check_against_oracle(case, f(out), f(inter["h"]), mode="trtllm_cutlass", activation="relu2")
    _, inter_u = _layer(case, fc2)  # (two warpgroups have no unpadded linear form: whole-K)
    np.testing.assert_array_equal(f(inter["h"]), f(inter_u["h"]))


def test_padded_fc2_other_backends_slice_it(caplog):
    """XLA and Pallas-Triton read K = I: the padded stack is sliced back (logged), and the
    layer is bit for bit the unpadded one's."""
    case = make_case(np.random.default_rng(3), t=5, h=256, inter=384, e=4, k=2, activation="relu2")
    fc2 = to_jax(case)[4]
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    with caplog.at_level(logging.INFO, logger="nvfp4_jax"):
        out_p = _layer(case, pad_fc2(fc2), backend="xla")
    assert "sliced (copied) on every call" in caplog.text
    np.testing.assert_array_equal(f(out_p), f(_layer(case, fc2, backend="xla")))
    out_t, _ = _layer(case, pad_fc2(fc2), backend="pallas")
    out_u, _ = _layer(case, fc2, backend="pallas")
    np.testing.assert_array_equal(f(out_t), f(out_u))


def test_padded_fc2_wrong_width_is_refused():
    case = make_case(np.random.default_rng(4), t=3, h=256, inter=384, e=4, k=2, activation="relu2")
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    bad = nvfp4_jax.NVFP4Array.from_parts(
        jnp.zeros((4, 256, 640 // 2), jnp.uint8), jnp.zeros((4, 256, 640 // 16), jnp.float8_e4m3fn),
        fc2.decode_scale, shape=(4, 256, 640))
    with pytest.raises(ValueError, match=r"^fc2: expected shape \(4, 256, 384\).*or \(4, 256, 512\) "
                                         r"zero-padded along K by moe.pad_fc2"):
        nvfp4_jax.moe(hidden, fc1=fc1, fc2=bad, fc1_input_scale=s1, fc2_input_scale=s2,
                      topk_ids=ids, topk_weights=w, activation="relu2", backend="xla")
    x = jnp.zeros((8, 384), jnp.bfloat16)
    be, nb = jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"^codes: expected shape \(4, 256, 192\) for K=384 \(or, "
                                         r"zero-padded along K, \(4, 256, 256\)\)"):
        grouped_matmul(x, bad.codes, jnp.zeros((4, 256, 40), jnp.uint8), be, nb, block_m=8,
                       reference=True)


@pytest.mark.parametrize("layout,cfg", [
    ("linear", MosaicConfig(block_n=128, split_k=1, num_stages=2)),
    ("linear", MosaicConfig(block_n=128, split_k=2, num_stages=2)),
    ("linear", MosaicConfig(block_n=64, split_k=3, num_stages=2)),
    ("swizzled_128x4", MosaicConfig(block_n=128, split_k=2, num_stages=2)),
    ("linear", MosaicConfig(block_n=128, split_k=2, num_stages=2, consumers=2)),
])
def test_grouped_kernel_padded_codes_lower_for_cuda(layout, cfg):
    """Nemotron's FC2 at T = 8 with codes padded to K = 2816: the kernel reads x (K = 2688) with
    11 steps of 256, split unevenly (6 + 5 at split 2; 4 + 4 + 3 at split 3)."""
    nb, mt, e, n, k, kp = 25, 8, 512, 1024, 2688, 2816
    split = check_config(cfg, kp, mt, swizzled=layout != "linear", padded=True)
    assert split == min(cfg.split_k, 11)
    if layout == "linear":
        s = jax.ShapeDtypeStruct((e, n, kp // 16), jnp.uint8)
    else:
        np_, kq = padded_shape(n, kp // 16, layout)
        s = jax.ShapeDtypeStruct((e, np_ * kq), jnp.uint8)
    args = (jax.ShapeDtypeStruct((nb * mt, k), jnp.bfloat16), jax.ShapeDtypeStruct((e, n, kp // 2), jnp.uint8),
            s, jax.ShapeDtypeStruct((nb,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    f = jax.jit(lambda x, c, s, be, nbk: grouped_matmul(x, c, s, be, nbk, block_m=mt, config=cfg,
                                                        scale_layout=layout))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    rows = cfg.block_n * cfg.consumers
    assert "mosaic_gpu" in text and f"tensor<{split}x{nb * mt}x{-(-n // rows) * rows}xf32>" in text


def test_padded_fc2_layer_lowers_for_cuda():
    """The whole nemotron-width layer with padded FC2 (both layouts) lowers; no whole-K path."""
    e, h, t, k, inter = 16, 1024, 3, 4, 2688

    def stack(n, kk, layout="linear"):
        return nvfp4_jax.NVFP4Array.from_parts(
            jnp.zeros((e, n, kk // 2), jnp.uint8), jnp.zeros((e, n, kk // 16), jnp.float8_e4m3fn),
            jnp.ones((e,), jnp.float32), shape=(e, n, kk)).with_layout(layout)

    for layout in LAYOUTS:
        fc1, fc2 = stack(inter, h, layout), pad_fc2(stack(h, inter, layout))
        assert fc2.shape == (e, h, 2816)

        def f(x, ids, w, s1, s2, fc1=fc1, fc2=fc2):
            return moe_mosaic(x, ids, w, fc1, fc2, s1, s2, activation="relu2", gate_up_order="up_gate",
                              mode="trtllm_cutlass", activation_scale="scalar")

        args = (jax.ShapeDtypeStruct((t, h), jnp.bfloat16), jax.ShapeDtypeStruct((t, k), jnp.int32),
                jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.float32),
                jax.ShapeDtypeStruct((e,), jnp.float32))
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("nvfp4_moe_mosaic") >= 2 and "nvfp4_moe_fc1_epilogue" in text
