"""Mosaic GPU grouped-GEMM MoE (Hopper) at realistic layer widths vs the oracle (stage-wise
derived bounds of moe_cases). Skipped without an sm_90 GPU.

The FC1 epilogue runs in XLA when FC2 falls back to Pallas-Triton (the glue kernels divide with
``div.rn.f32`` themselves): its divisions are ``division.divide``, IEEE whatever XLA's flags, so
the module runs with or without ``XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import check_against_oracle, make_case_fast
from test_moe import to_jax

from nvfp4_jax.device import gpu_compute_capability
from nvfp4_jax.gemm.mosaic import MosaicConfig
from nvfp4_jax.moe.api import choose_backend
from nvfp4_jax.moe.mosaic import _QWEN, AUTO_SM90, MosaicMoEConfig, moe_mosaic
from nvfp4_jax.moe.pallas_triton import moe_pallas

pytestmark = pytest.mark.gpu


if gpu_compute_capability() != 90:
    pytest.skip("needs an sm_90 (Hopper) NVIDIA GPU", allow_module_level=True)

NEMO = {"h": 1024, "inter": 2688, "activation": "relu2"}  # FC2 K = 2688: whole-K scales
QWEN = {"h": 2048, "inter": 768, "activation": "swiglu"}  # both GEMMs on Mosaic
ALT = MosaicMoEConfig(block_m=16, fc1=MosaicConfig(block_n=64, split_k=2, num_stages=3),
                      fc2=MosaicConfig(block_n=64, split_k=3, num_stages=2))
ALT8 = MosaicMoEConfig(block_m=8, fc1=MosaicConfig(block_n=128, split_k=2, num_stages=3, block_k=512),
                       fc2=MosaicConfig(block_n=128, split_k=1, num_stages=4))

BM128 = MosaicMoEConfig(block_m=128, fc1=MosaicConfig(block_n=64, split_k=1, num_stages=2),
                        fc2=MosaicConfig(block_n=64, split_k=1, num_stages=2))


def _run(case, *, mode, activation, order="up_gate", config=None, backend="mosaic"):
    act_scale = "scalar" if mode == "trtllm_cutlass" else "per_expert"
    args = to_jax(case)
    if backend == "auto":
        backend = choose_backend("auto", config, routes=args[1].size, hidden=args[0].shape[1],
                                 experts=args[3].shape[0])
    fn = functools.partial(moe_mosaic if backend == "mosaic" else moe_pallas, activation=activation,
                           gate_up_order=order, mode=mode, activation_scale=act_scale,
                           config=config, return_intermediates=True)
    out, inter = jax.jit(fn)(*args)
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    return f(out), f(inter["h"])


# Few experts keep the float64 oracle fast (its cost grows with E); cheap cases first.
@pytest.mark.parametrize("name,mode,shape,order,config", [
    # E4M3 subnormal block scales; relu2 with both GEMMs on Mosaic (I % 256 == 0)
    ("subnormal_relu2_trtllm", "trtllm_cutlass", {"h": 512, "inter": 1024, "activation": "relu2",
                                                  "t": 9, "e": 8, "k": 2, "scale_factor": 2.0**15},
     "up_gate", None),
    # T = 1: 8 of 16 experts without tokens
    ("qwen_T1_b12x", "b12x", {**QWEN, "t": 1, "e": 16, "k": 8}, "up_gate", None),
    ("nemotron_T20_trtllm", "trtllm_cutlass", {**NEMO, "t": 20, "e": 8, "k": 6}, "up_gate", None),
    # skewed routing: uneven blocks, experts without tokens; block_k 512 in FC1
    ("qwen_T16_skewed_trtllm", "trtllm_cutlass", {**QWEN, "t": 16, "e": 16, "k": 4, "routing": "skewed"},
     "up_gate", ALT8),
    ("subnormal_swiglu_b12x", "b12x", {"h": 768, "inter": 512, "activation": "swiglu",
                                       "t": 3, "e": 8, "k": 3, "scale_factor": 2.0**15}, "gate_up", ALT),
    ("nemotron_T1_b12x", "b12x", {**NEMO, "t": 1, "e": 16, "k": 6}, "up_gate", None),
    # top-22 (the combine's 32-row gather, 8 warps)
    ("nemotron_top22_trtllm", "trtllm_cutlass", {**NEMO, "t": 6, "e": 24, "k": 22}, "up_gate", None),
    # prefill-sized groups: the default config picks 64-row blocks (64 routes per expert)
    ("nemotron_T64_bm64_trtllm", "trtllm_cutlass", {**NEMO, "t": 64, "e": 4, "k": 4}, "up_gate", None),
    # 128-row blocks
    ("qwen_bm128_b12x", "b12x", {**QWEN, "t": 96, "e": 4, "k": 4}, "up_gate", BM128),
    # the one-launch routing kernel (Pallas-Triton) instead of the XLA routing
    ("nemotron_routing_kernel_trtllm", "trtllm_cutlass", {**NEMO, "t": 3, "e": 24, "k": 6}, "up_gate",
     MosaicMoEConfig(block_m=8, routing="kernel")),
    # padding rows skipped (left unwritten: whatever the memory held stays in unread rows)
    ("qwen_skip_padding_b12x", "b12x", {**QWEN, "t": 6, "e": 16, "k": 4, "routing": "skewed"}, "up_gate",
     MosaicMoEConfig(block_m=8, skip_padding=True)),
    # the GEMMs store bf16(alpha * acc) instead of fp32 partials (64-row blocks; nemotron's
    # FC2 with whole-K scales), and at decode with skip_padding (qwen3, swiglu)
    ("nemotron_bf16_partials_trtllm", "trtllm_cutlass", {**NEMO, "t": 64, "e": 4, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=64, bf16_partials=True)),
    ("qwen_bf16_partials_trtllm", "trtllm_cutlass", {**QWEN, "t": 5, "e": 16, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=8, bf16_partials=True, skip_padding=True)),
    # the scales (G, 1/G, alphas) from one Pallas-Triton kernel instead of XLA: both modes
    ("qwen_scales_kernel_b12x", "b12x", {**QWEN, "t": 3, "e": 16, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=8, routing="kernel", skip_padding=True)),
    ("nemotron_scales_kernel_trtllm", "trtllm_cutlass", {**NEMO, "t": 5, "e": 24, "k": 6}, "up_gate",
     MosaicMoEConfig(block_m=8)),
    # routing, scales and the FC1 operand in one launch (routing="fused"): both modes
    ("qwen_fused_routing_b12x", "b12x", {**QWEN, "t": 3, "e": 16, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=8, routing="fused", skip_padding=True)),
    ("qwen_fused_routing_trtllm", "trtllm_cutlass", {**QWEN, "t": 8, "e": 128, "k": 8}, "up_gate",
     MosaicMoEConfig(block_m=8, routing="fused", skip_padding=True)),
    # the FC1 epilogue one program per route (epilogue="routes")
    ("nemotron_epilogue_routes_trtllm", "trtllm_cutlass", {**NEMO, "t": 8, "e": 24, "k": 6}, "up_gate",
     MosaicMoEConfig(block_m=8, epilogue="routes", skip_padding=True)),
    ("qwen_epilogue_routes_b12x", "b12x", {**QWEN, "t": 3, "e": 16, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=8, epilogue="routes", routing="fused", skip_padding=True)),
    # wide glue: 8-row FC1-operand programs (4 at qwen3's H = 2048), 256 / 512
    # combine columns per program, at prefill-like blocks
    ("nemotron_wide_glue_trtllm", "trtllm_cutlass", {**NEMO, "t": 64, "e": 4, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=64, bf16_partials=True, wide_glue=True)),
    ("qwen_wide_glue_b12x", "b12x", {**QWEN, "t": 40, "e": 4, "k": 2}, "up_gate",
     MosaicMoEConfig(block_m=32, wide_glue=True)),
    # qwen3's prefill default at 64-row blocks: the FC1 epilogue in programs of 32 rows
    # (epilogue_row_chunk), each token quantized once, the wide glue
    ("qwen_prefill_default_trtllm", "trtllm_cutlass", {**QWEN, "t": 96, "e": 4, "k": 2}, "up_gate",
     MosaicMoEConfig(block_m=64, bf16_partials=True, wide_glue=True, token_quant=True)),
    # qwen3's measured prefill entry: skip_padding, FC2 on one warpgroup
    ("qwen_prefill_auto_trtllm", "trtllm_cutlass", {**QWEN, "t": 96, "e": 4, "k": 2}, "up_gate",
     AUTO_SM90[(*_QWEN, 32768)]),
    # token_quant: each token quantized once,
    # the routed rows gathered (trtllm_cutlass: one encode scale), wide and narrow
    ("nemotron_token_quant_wide_trtllm", "trtllm_cutlass", {**NEMO, "t": 64, "e": 4, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=64, bf16_partials=True, wide_glue=True, token_quant=True)),
    ("qwen_token_quant_trtllm", "trtllm_cutlass", {**QWEN, "t": 13, "e": 16, "k": 8, "routing": "skewed"},
     "up_gate", MosaicMoEConfig(block_m=16, token_quant=True, routing="kernel")),
    # warp-specialized grouped GEMMs (consumers: compute warpgroups sharing x); "ws" in the
    # name: run them alone first on a new GPU
    ("qwen_ws2_trtllm", "trtllm_cutlass", {**QWEN, "t": 40, "e": 4, "k": 2}, "up_gate",
     MosaicMoEConfig(block_m=32, fc1=MosaicConfig(block_n=64, num_stages=2, consumers=2),
                     fc2=MosaicConfig(block_n=64, num_stages=2, consumers=3))),
    ("nemotron_ws2_bf16_partials_trtllm", "trtllm_cutlass", {**NEMO, "t": 64, "e": 4, "k": 4}, "up_gate",
     MosaicMoEConfig(block_m=64, bf16_partials=True,
                     fc1=MosaicConfig(block_n=128, num_stages=2, consumers=2))),
    # mma.sync grouped GEMMs (the SM 12.x form): nemotron's FC2 with whole-K scales (K % 256 ==
    # 128), split FC1, fused routing; swiglu with subnormal scales, split FC1, block_k 512 in FC2
    ("nemotron_sync_trtllm", "trtllm_cutlass", {**NEMO, "t": 8, "e": 24, "k": 6}, "up_gate",
     MosaicMoEConfig(block_m=8, fc1=MosaicConfig(block_n=128, split_k=2, num_stages=2, mma="sync"),
                     fc2=MosaicConfig(block_n=128, num_stages=2, mma="sync"), routing="fused",
                     skip_padding=True, epilogue="routes")),
    ("subnormal_swiglu_sync_b12x", "b12x", {"h": 768, "inter": 512, "activation": "swiglu", "t": 5,
                                            "e": 8, "k": 3, "scale_factor": 2.0**15}, "gate_up",
     MosaicMoEConfig(block_m=16, fc1=MosaicConfig(block_n=64, split_k=3, num_stages=3, mma="sync"),
                     fc2=MosaicConfig(block_n=64, num_stages=2, block_k=512, mma="sync"))),
])
def test_moe_mosaic_gpu_matches_oracle(name, mode, shape, order, config):
    case = make_case_fast(np.random.default_rng(len(name)), **shape)
    if "subnormal" in name:
        assert np.mean(case[3].scales < 0x08) > 0.5  # most block scales are E4M3 subnormals
    out, h = _run(case, mode=mode, activation=shape["activation"], order=order, config=config)
    stats = check_against_oracle(case, out, h, mode=mode, activation=shape["activation"],
                                 gate_up_order=order)
    print(name, stats)


def test_auto_picks_mosaic_at_decode_and_matches_triton(caplog):
    case = make_case_fast(np.random.default_rng(3), **{**QWEN, "t": 4, "e": 8, "k": 4})
    with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe.api"):
        out_a, h_a = _run(case, mode="b12x", activation="swiglu", backend="auto")
    assert "backend auto -> mosaic" in caplog.text
    out_t, h_t = _run(case, mode="b12x", activation="swiglu", backend="pallas")
    check_against_oracle(case, out_a, h_a, mode="b12x", activation="swiglu")
    check_against_oracle(case, out_t, h_t, mode="b12x", activation="swiglu")


@pytest.mark.parametrize("n,k,split,bk,bn", [
    (1024, 2688, 1, 256, 128), (2688, 1024, 2, 256, 128), (333, 1024, 1, 512, 128),
    # block_n 64: each CTA reads half of a 128-row swizzled tile (8 bytes on for
    # the odd CTAs); N = 333 ends in a partial tile
    (1536, 2048, 2, 256, 64), (2048, 768, 1, 256, 64), (1024, 2688, 1, 256, 64), (333, 1024, 1, 256, 64),
])
def test_grouped_kernel_swizzled_scales_equal_linear(n, k, split, bk, bn):
    """The kernel reading swizzled_128x4 scales (per-step 2 KB tiles) gives bit for bit the
    partials of the linear-scale kernel (whole-K scales at K % 256 == 128): same arithmetic,
    only where the scale bytes come from differs. Random codes, scale bytes over the whole
    E4M3 range below 448 (subnormals included), uneven blocks."""
    from nvfp4_jax.layouts import swizzle
    from nvfp4_jax.moe.mosaic import grouped_matmul

    rng = np.random.default_rng(n + k)
    e, mt, nb = 6, 8, 9
    codes = jnp.asarray(rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(0x01, 0x7E, (e, n, k // 16), dtype=np.uint8))
    x = jnp.asarray(rng.standard_normal((nb * mt, k)), jnp.bfloat16)
    be = jnp.asarray(rng.integers(0, e, nb), jnp.int32)
    nbk = jnp.asarray([nb - 2], jnp.int32)  # the last two blocks are skipped
    cfg = MosaicConfig(block_n=bn, split_k=split, num_stages=2, block_k=bk)
    lin = jax.jit(lambda *a: grouped_matmul(*a, block_m=mt, config=cfg))(x, codes, scales, be, nbk)
    swz = jax.jit(lambda *a: grouped_matmul(*a, block_m=mt, config=cfg, scale_layout="swizzled_128x4"))(
        x, codes, swizzle(scales, "swizzled_128x4"), be, nbk)
    rows = (nb - 2) * mt
    a, b = np.asarray(lin)[:, :rows, :n], np.asarray(swz)[:, :rows, :n]
    assert np.all(np.isfinite(a)) and np.count_nonzero(a) > a.size // 2
    np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("fc2_split", [1, 2, 3])
def test_moe_mosaic_gpu_swizzled_weights_match_oracle(fc2_split, consumers=1):
    """Swizzled weight stacks, FC2 (K = 2688) split unevenly over its 11 steps."""
    case = make_case_fast(np.random.default_rng(11), **{**NEMO, "t": 5, "e": 12, "k": 6})
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    cfg = MosaicMoEConfig(block_m=8, fc1=MosaicConfig(block_n=128, split_k=2, num_stages=2, consumers=consumers),
                          fc2=MosaicConfig(block_n=128, split_k=fc2_split, num_stages=2, consumers=consumers))
    fn = functools.partial(moe_mosaic, activation="relu2", gate_up_order="up_gate", mode="trtllm_cutlass",
                           activation_scale="scalar", return_intermediates=True,
                           config=cfg)
    out, inter = jax.jit(fn)(hidden, ids, w, fc1.with_layout("swizzled_128x4"),
                             fc2.with_layout("swizzled_128x4"), s1, s2)
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    check_against_oracle(case, f(out), f(inter["h"]), mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("fc2_split", [1, 3])
def test_moe_mosaic_gpu_swizzled_weights_ws2_match_oracle(fc2_split):
    """The same with warp-specialized grouped GEMMs (two compute warpgroups sharing x; FC1's 21
    row tiles end in a CTA whose second tile lies past N). Run alone first on a new GPU."""
    test_moe_mosaic_gpu_swizzled_weights_match_oracle(fc2_split, consumers=2)


def test_prefill_default_config_matches_oracle(monkeypatch, caplog):
    """The default config of prefill-sized routings (two compute warpgroups, bf16 products;
    WS_ROUTES, BF16_PARTIALS_ROUTES), lowered to 256 routes so the oracle stays cheap; nemotron's FC2 (K = 2688) with
    linear scales has no warp-specialized kernel and runs with one warpgroup, logged."""
    from nvfp4_jax.moe import mosaic as mm

    monkeypatch.setattr(mm, "WS_ROUTES", 256)
    monkeypatch.setattr(mm, "BF16_PARTIALS_ROUTES", 256)
    cfg = mm.default_config(256, 4, hidden=1024, rows1=2688, inter=2688)
    assert cfg.bf16_partials and cfg.fc1.consumers == 2 and cfg.fc2.consumers == 2
    case = make_case_fast(np.random.default_rng(11), **{**NEMO, "t": 64, "e": 4, "k": 4})
    with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe.mosaic"):
        out, h = _run(case, mode="trtllm_cutlass", activation="relu2")
    assert "fc2: linear scales with K=2688 have no warp-specialized kernel" in caplog.text
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("layout,split", [("swizzled_128x4", 1), ("swizzled_128x4", 2),
                                          ("linear", 1), ("linear", 3)])
def test_grouped_kernel_padded_weights_equal_unpadded(layout, split):
    """Nemotron's FC2 (K = 2688) on codes and scales zero-padded to K = 2816 (``pad_fc2``:
    128-byte aligned rows) gives bit for bit the unpadded kernel's partials with the same K
    split (11 steps; the unpadded kernel's half step reads past the end, where TMA fills
    zeros). The unpadded reference for a linear split is the swizzled kernel (linear K = 2688
    has whole-K scales and no split)."""
    import nvfp4_jax
    from nvfp4_jax.moe import pad_fc2
    from nvfp4_jax.moe.mosaic import grouped_matmul

    rng = np.random.default_rng(split)
    e, n, k, mt, nb = 6, 1024, 2688, 8, 9
    codes = jnp.asarray(rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(0x01, 0x7E, (e, n, k // 16), dtype=np.uint8))
    w = nvfp4_jax.NVFP4Array.from_parts(codes, jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn),
                                        jnp.ones((e,), jnp.float32), shape=(e, n, k))
    x = jnp.asarray(rng.standard_normal((nb * mt, k)), jnp.bfloat16)
    be = jnp.asarray(rng.integers(0, e, nb), jnp.int32)
    nbk = jnp.asarray([nb - 2], jnp.int32)  # the last two blocks are skipped
    cfg = MosaicConfig(block_n=128, split_k=split, num_stages=2)
    u8 = lambda s: jax.lax.bitcast_convert_type(s, jnp.uint8)

    def run(wt, lay):
        return jax.jit(lambda *a: grouped_matmul(*a, block_m=mt, config=cfg, scale_layout=lay))(
            x, wt.codes, u8(wt.scales), be, nbk)

    ref_lay = "swizzled_128x4" if split > 1 else layout
    ref = np.asarray(run(w.with_layout(ref_lay), ref_lay))
    got = np.asarray(run(pad_fc2(w.with_layout(layout)), layout))
    assert got.shape == ref.shape and got.shape[0] == split
    rows = (nb - 2) * mt
    a, b = ref[:, :rows, :n], got[:, :rows, :n]
    assert np.all(np.isfinite(a)) and np.count_nonzero(a) > a.size // 2
    np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("layout", ["linear", "swizzled_128x4"])
def test_moe_mosaic_gpu_padded_fc2_matches_oracle(layout):
    """The nemotron-width layer on FC2 weights padded by ``pad_fc2``, its default config and an
    FC2 split over the 11 padded steps, against the oracle of the unpadded layer."""
    from nvfp4_jax.moe import pad_fc2

    case = make_case_fast(np.random.default_rng(12), **{**NEMO, "t": 5, "e": 12, "k": 6})
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    fc2p = pad_fc2(fc2.with_layout(layout))
    assert fc2p.shape[2] == 2816
    for cfg in (None, MosaicMoEConfig(block_m=8, fc2=MosaicConfig(block_n=128, split_k=2, num_stages=2))):
        fn = functools.partial(moe_mosaic, activation="relu2", gate_up_order="up_gate", mode="trtllm_cutlass",
                               activation_scale="scalar", return_intermediates=True,
                               config=cfg)
        out, inter = jax.jit(fn)(hidden, ids, w, fc1.with_layout(layout), fc2p, s1, s2)
        f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
        check_against_oracle(case, f(out), f(inter["h"]), mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("t,e,k", [(1, 512, 22), (8, 512, 22), (23, 512, 22), (1, 128, 8), (8, 128, 8)])
def test_routing_kernel_routes_method_on_gpu(t, e, k):
    """The routing kernels' "routes" method on the GPU (nemotron: 22 routes per token over 512
    experts; qwen3: 8 over 128, where it is the default up to T = 8): its
    CTA barriers and the read-back of the sorted order give exactly the XLA
    ``block_routing``, alone, with the scales, and inside the fused launch (whose FC1 operand
    rows are bit for bit ``fc1_operand``'s)."""
    from nvfp4_jax.moe import operand as opd
    from nvfp4_jax.moe import routing_kernel as rtk
    from nvfp4_jax.moe.routing import block_routing

    rng = np.random.default_rng(t)
    bm, h = 8, 1024
    methods = rtk.routing_methods(t * k, e, bm, explicit=True)
    assert methods == (("routes", "experts") if e <= rtk.ROUTING_EXPERTS_MAX else ("routes",))
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32))
    want = block_routing(ids, e, bm)
    vecs = [jnp.asarray(np.exp2(rng.uniform(-12, 4, e)).astype(np.float32)) for _ in range(4)]
    scales = (*vecs, "trtllm_cutlass", "scalar")
    hidden = jnp.asarray(rng.standard_normal((t, h)) * 64, jnp.bfloat16)
    got = jax.jit(lambda i: rtk.routing_kernel(i, e, bm, method="routes"))(ids)
    got_s, sv = jax.jit(lambda i: rtk.routing_kernel(i, e, bm, scales=scales, method="routes"))(ids)
    got_f, sv_f, xp = jax.jit(lambda i, x: rtk.routing_operand_kernel(i, x, e, bm, scales, recipe="trtllm",
                                                                     method="routes"))(ids, hidden)
    for br in (got, got_s, got_f):
        for name in ("sorted_route", "block_expert", "num_blocks", "route_pos"):
            np.testing.assert_array_equal(np.asarray(getattr(br, name)), np.asarray(getattr(want, name)),
                                          err_msg=name)
    for a, b in zip(sv, sv_f, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    ref = opd.fc1_operand(hidden, want.sorted_route, want.block_expert, want.num_blocks, sv[0], sv[1],
                         top_k=k, block_m=bm, recipe="trtllm", per_expert=False, skip_padding=True)
    live = np.asarray(want.route_pos)
    a, b = np.asarray(xp, np.float32)[live], np.asarray(ref, np.float32)[live]
    assert np.all(np.isfinite(a)) and np.count_nonzero(a) > a.size // 20
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("t,warps", [(1, None), (8, None), (23, None), (46, None), (8, 8), (8, 16)])
def test_routing_kernel_tokens_method_on_gpu(t, warps, monkeypatch):
    """The routing kernels' "tokens" method (nemotron: 22 routes per token over 512 experts)
    on the GPU: its scratch table's barriers give exactly the XLA ``block_routing``, alone and
    with the scales; also with every token routed twice to its first expert. ``warps``: the
    program's warp count instead of ``routing_warps``'s default (T = 8: 4)."""
    from nvfp4_jax import triton_ops as tops
    from nvfp4_jax.moe import routing_kernel as rtk
    from nvfp4_jax.moe.routing import block_routing

    rng = np.random.default_rng(t)
    e, k, bm = 512, 22, 8
    assert "tokens" in rtk.routing_methods(t * k, e, bm, top_k=k, explicit=True)
    if warps is not None:
        monkeypatch.setitem(rtk.ROUTING_WARPS, ("tokens", tops.pow2(t * k)), warps)
        assert rtk.routing_warps("tokens", t * k) == warps
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    rep = ids.copy()
    rep[:, 1] = rep[:, 0]
    vecs = [jnp.asarray(np.exp2(rng.uniform(-12, 4, e)).astype(np.float32)) for _ in range(4)]
    scales = (*vecs, "trtllm_cutlass", "scalar")
    for i in (jnp.asarray(ids), jnp.asarray(rep)):
        want = block_routing(i, e, bm)
        got = jax.jit(lambda i: rtk.routing_kernel(i, e, bm, method="tokens"))(i)
        got_s, _ = jax.jit(lambda i: rtk.routing_kernel(i, e, bm, scales=scales, method="tokens"))(i)
        for br in (got, got_s):
            for name in ("sorted_route", "block_expert", "num_blocks", "route_pos"):
                np.testing.assert_array_equal(np.asarray(getattr(br, name)), np.asarray(getattr(want, name)),
                                              err_msg=name)


@pytest.mark.parametrize("routing,method", [("kernel", "routes"), ("fused", "routes"), ("kernel", "tokens")])
def test_moe_mosaic_gpu_routes_method_matches_oracle(routing, method, monkeypatch):
    """The layer with the "routes" routing method (taken above 128 experts; forced here at 24
    by lowering ROUTING_EXPERTS_MAX) against the oracle, in the routing kernel's launch or
    fused with the FC1 operand; and with the "tokens" method (ROUTES_AUTO_MAX 0)."""
    from nvfp4_jax.moe import routing_kernel as rtk

    monkeypatch.setattr(rtk, "ROUTING_EXPERTS_MAX", 8)
    if method == "tokens":
        monkeypatch.setattr(rtk, "ROUTES_AUTO_MAX", 0)
    assert rtk.routing_methods(8 * 6, 24, 8, top_k=6)[0] == method
    case = make_case_fast(np.random.default_rng(24), **{**NEMO, "t": 8, "e": 24, "k": 6})
    cfg = MosaicMoEConfig(block_m=8, routing=routing, skip_padding=True)
    out, h = _run(case, mode="trtllm_cutlass", activation="relu2", config=cfg)
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("bucket,t", [(32, 1), (256, 8)])
def test_auto_sm90_nemotron_decode_entries_match_oracle(bucket, t, monkeypatch):
    """nemotron's decode ``AUTO_SM90`` entries as the bench runs them (swizzled weights, FC2
    padded by ``pad_fc2``) at 24 experts, against the oracle. ROUTING_EXPERTS_MAX lowered so
    the routing kernels take the methods they take at nemotron's 512 experts (T = 1: the
    routes method, fused with the scales and the FC1 operand; T = 8: the tokens method with
    the scales)."""
    from nvfp4_jax.moe import mosaic as mm
    from nvfp4_jax.moe import pad_fc2
    from nvfp4_jax.moe import routing_kernel as rtk

    monkeypatch.setattr(rtk, "ROUTING_EXPERTS_MAX", 8)
    key = (*mm._NEMO, bucket)
    cfg = mm.AUTO_SM90[key]
    if key in mm.AUTO_SM90_PADDED_FC2:  # what the layer picks for padded FC2 weights
        cfg = dataclasses.replace(cfg, fc2=mm.AUTO_SM90_PADDED_FC2[key])
    assert rtk.routing_kernel_fits(t * 22, 24, cfg.block_m,
                                  top_k=None if cfg.routing == "fused" else 22) == (cfg.routing != "xla")
    case = make_case_fast(np.random.default_rng(bucket), **{**NEMO, "t": t, "e": 24, "k": 22})
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    fn = functools.partial(moe_mosaic, activation="relu2", gate_up_order="up_gate", mode="trtllm_cutlass",
                           activation_scale="scalar", return_intermediates=True,
                           config=cfg)
    out, inter = jax.jit(fn)(hidden, ids, w, fc1.with_layout("swizzled_128x4"),
                             pad_fc2(fc2.with_layout("swizzled_128x4")), s1, s2)
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    check_against_oracle(case, f(out), f(inter["h"]), mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("bucket,t,overlap", [(8, 1, False), (8, 3, False), (64, 8, False),
                                               (8, 1, True)])
def test_auto_sm90_qwen3_decode_entries_match_oracle(bucket, t, overlap, caplog):
    """qwen3's decode ``AUTO_SM90`` entries (block_n 64 on swizzled scales: each CTA half of a
    128-row scale tile; fused routing) as the bench runs them, at 16 experts, against the
    oracle; the scales read as they are (T = 3 with the T = 1 entry: more routed blocks).
    ``overlap``: the T = 1 entry with both grouped GEMMs decoding the next 128-deep group
    while the previous wgmma runs (FC1 two K steps per CTA, FC2 one)."""
    from nvfp4_jax.moe import mosaic as mm

    cfg = mm.AUTO_SM90[(*mm._QWEN, bucket)]
    if overlap:
        cfg = dataclasses.replace(cfg, fc1=dataclasses.replace(cfg.fc1, overlap=True),
                                  fc2=dataclasses.replace(cfg.fc2, overlap=True))
    case = make_case_fast(np.random.default_rng(bucket), **{**QWEN, "t": t, "e": 16, "k": 8})
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    fn = functools.partial(moe_mosaic, activation="swiglu", gate_up_order="up_gate", mode="b12x",
                           activation_scale="per_expert", return_intermediates=True,
                           config=cfg)
    with caplog.at_level(logging.WARNING, logger="nvfp4_jax.moe"):
        out, inter = jax.jit(fn)(hidden, ids, w, fc1.with_layout("swizzled_128x4"),
                                 fc2.with_layout("swizzled_128x4"), s1, s2)
    assert "converted to linear" not in caplog.text
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    check_against_oracle(case, f(out), f(inter["h"]), mode="b12x", activation="swiglu")


@pytest.mark.parametrize("arch", [(12, 0), (12, 1)])
def test_moe_auto_on_sm12x_lowered_as_sm12x(arch, monkeypatch, caplog):
    """``nvfp4_jax.moe(backend="auto")`` as an RTX 50xx (12.0) / DGX Spark (12.1) user calls
    it at decode: ``choose_backend`` picks the Mosaic MoE (grouped GEMMs on mma.sync, within
    99 KB), Mosaic lowers it as for SM 12.x and it runs on this GPU, within the oracle's bound
    (qwen3-like swiglu at T = 4, nemotron-like relu2 with whole-K FC2 scales at T = 3)."""
    import nvfp4_jax
    from nvfp4_jax.gemm import mosaic as gemm_mosaic
    from nvfp4_jax.moe import api
    from nvfp4_jax.moe import mosaic as moe_mosaic_mod
    from nvfp4_jax.testing import assert_moe_close, mosaic_lowered_as

    if not gemm_mosaic.has_mma_sync():
        pytest.skip(f"plgpu.mma needs JAX >= 0.11, this is {jax.__version__}")
    cc = 10 * arch[0] + arch[1]
    monkeypatch.setattr(api, "is_sm90", lambda: False)
    monkeypatch.setattr(api, "is_sm12x", lambda: True)
    monkeypatch.setattr(api, "gpu_compute_capability", lambda: cc)
    monkeypatch.setattr(moe_mosaic_mod, "is_sm12x", lambda: True)
    monkeypatch.setattr(gemm_mosaic, "is_sm12x", lambda: True)
    for name, shape in (("qwen", {**QWEN, "t": 4, "e": 16, "k": 8}),
                        ("nemotron", {**NEMO, "t": 3, "e": 24, "k": 6})):
        case = make_case_fast(np.random.default_rng(cc + len(name)), **shape)
        hidden, ids, wts, fc1, fc2, s1, s2 = to_jax(case)
        act = shape["activation"]
        caplog.clear()
        with caplog.at_level("INFO", logger="nvfp4_jax.moe"), mosaic_lowered_as(arch):
            out = jax.jit(lambda x, f1, f2, a1, a2, i, w, act=act: nvfp4_jax.moe(
                x, fc1=f1, fc2=f2, fc1_input_scale=a1, fc2_input_scale=a2, topk_ids=i,
                topk_weights=w, activation=act))(hidden, fc1, fc2, s1, s2, ids, wts)
        assert f"auto -> mosaic (sm_{cc}, grouped GEMMs on mma.sync" in caplog.text
        assert "grouped GEMMs on mma.sync (fc1" in caplog.text
        assert_moe_close(np.asarray(out, np.float32), *case, activation=act,
                         mode="trtllm_cutlass", label=f"{name} auto sm_{cc}")


def test_moe_mosaic_sm12x_form_lowered_as_sm12x(monkeypatch, caplog):
    """``moe(backend="mosaic")`` as an SM 12.x user runs it: the measured tiles in their
    mma.sync form within 99 KB (``for_sm12x``), lowered by Mosaic as for SM 12.0, against the
    oracle (qwen3-like swiglu at T = 8, nemotron-like relu2 with whole-K FC2 scales at T = 5)."""
    from nvfp4_jax.gemm import mosaic as gemm_mosaic
    from nvfp4_jax.moe import mosaic as moe_mosaic_mod
    from nvfp4_jax.testing import mosaic_lowered_as

    if not gemm_mosaic.has_mma_sync():
        pytest.skip(f"plgpu.mma needs JAX >= 0.11, this is {jax.__version__}")
    monkeypatch.setattr(moe_mosaic_mod, "is_sm12x", lambda: True)
    monkeypatch.setattr(gemm_mosaic, "is_sm12x", lambda: True)
    for name, shape in (("qwen", {**QWEN, "t": 8, "e": 16, "k": 8}), ("nemotron", {**NEMO, "t": 5, "e": 24, "k": 6})):
        case = make_case_fast(np.random.default_rng(len(name)), **shape)
        caplog.clear()
        with caplog.at_level("INFO", logger="nvfp4_jax.moe.mosaic"), mosaic_lowered_as((12, 0)):
            out, h = _run(case, mode="trtllm_cutlass", activation=shape["activation"])
        assert "grouped GEMMs on mma.sync" in caplog.text
        check_against_oracle(case, out, h, mode="trtllm_cutlass", activation=shape["activation"],
                             gate_up_order="up_gate")


@pytest.mark.parametrize("name,shape,mode,config", [
    # both GEMMs on Mosaic: the combine launch adds the residual (narrow and wide combine,
    # nemotron's FC2 with whole-K scales)
    ("qwen_T8_b12x", {**QWEN, "t": 8, "e": 16, "k": 8}, "b12x", None),
    ("nemotron_T20_trtllm", {**NEMO, "t": 20, "e": 8, "k": 6}, "trtllm_cutlass", None),
    ("qwen_T64_wide_trtllm", {**QWEN, "t": 64, "e": 8, "k": 4}, "trtllm_cutlass",
     MosaicMoEConfig(block_m=16, wide_glue=True, bf16_partials=True, skip_padding=True)),
    # I % 128 != 0: FC2 on Pallas-Triton, XLA adds the residual
    ("fc2_triton_trtllm", {"h": 1024, "inter": 800, "activation": "relu2", "t": 6, "e": 8, "k": 4},
     "trtllm_cutlass", None),
])
def test_moe_mosaic_gpu_residual_is_xla_add(name, shape, mode, config):
    """``moe(backend="mosaic", residual=r)`` is bit for bit ``r + moe(backend="mosaic")`` (XLA's
    add of the two bf16 arrays) with the residual larger than, comparable with and cancelling
    the layer output, eager and inside one jit."""
    from nvfp4_jax.moe.api import moe

    case = make_case_fast(np.random.default_rng(len(name)), **shape)
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    kw = {"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2, "topk_ids": ids,
          "topk_weights": w, "activation": shape["activation"], "mode": mode, "backend": "mosaic",
          "config": config}
    out = moe(hidden, **kw)
    o = np.asarray(out, np.float32)
    assert np.all(np.isfinite(o)) and np.abs(o).max() > 0
    rng = np.random.default_rng(0)
    g = rng.standard_normal(o.shape).astype(np.float32)
    bits = lambda a: np.asarray(a).view(np.uint16)
    for kind, r in (("larger", g * np.abs(o).max() * 2.0**10), ("same", g * np.abs(o).max()),
                    ("cancel", -o * (1 + g * 2.0**-7))):
        r = jnp.asarray(r, jnp.bfloat16)
        want = bits(r + out)
        np.testing.assert_array_equal(bits(moe(hidden, residual=r, **kw)), want, err_msg=kind)
        jitted = jax.jit(lambda x, r: moe(x, residual=r, **kw))(hidden, r)
        np.testing.assert_array_equal(bits(jitted), want, err_msg=f"{kind}, jit")
