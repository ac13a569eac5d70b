"""Mosaic GPU grouped-GEMM MoE on CPU: the grouped kernel lowers for CUDA (Pallas -> Mosaic GPU,
no GPU needed), argument validation names the argument, the kernel choice is logged, and the
dataflow around the kernel (block routing, the Pallas-Triton glue kernels in interpret mode, K
permutation, partial layout, the Pallas-Triton FC2 fallback with its XLA epilogue) matches the
oracle with the kernel replaced by its XLA emulation."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import check_against_oracle, make_case
from test_moe import to_jax

from nvfp4_jax.gemm.mosaic import MosaicConfig, check_config
from nvfp4_jax.moe import mosaic as mm
from nvfp4_jax.moe.api import moe
from nvfp4_jax.moe.configs import MoEConfig
from nvfp4_jax.moe.mosaic import MosaicMoEConfig, default_config, grouped_matmul, moe_mosaic


def _grouped_args(nb, mt, e, n, k):
    return (jax.ShapeDtypeStruct((nb * mt, k), jnp.bfloat16), jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((e, n, k // 16), jnp.uint8), jax.ShapeDtypeStruct((nb,), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))


@pytest.mark.parametrize("nb,mt,e,n,k,cfg", [
    (25, 8, 512, 2688, 1024, MosaicConfig(block_n=128, split_k=1, num_stages=2)),   # nemotron FC1, T=1
    (9, 8, 128, 1536, 2048, MosaicConfig(block_n=128, split_k=2, num_stages=2)),    # qwen3 FC1, T=1
    (9, 8, 128, 2048, 768, MosaicConfig(block_n=64, split_k=3, num_stages=4)),      # qwen3 FC2
    (12, 16, 16, 1000, 1024, MosaicConfig(block_n=128, split_k=2, num_stages=3, block_k=512)),
    (3, 64, 4, 333, 512, MosaicConfig(block_n=64, split_k=1, num_stages=2)),
    # K % 256 == 128: whole-K scales (nemotron FC2, K = 2688; the smallest such K, 384)
    (25, 8, 512, 1024, 2688, MosaicConfig(block_n=128, split_k=1, num_stages=2)),
    (6, 16, 4, 256, 384, MosaicConfig(block_n=64, split_k=2, num_stages=3, overlap=True)),
    # 128-row blocks (prefill-sized routings): block_n 64 keeps the 64 KB x stages in SMEM
    (9, 128, 8, 2688, 1024, MosaicConfig(block_n=64, split_k=1, num_stages=2)),
    (9, 128, 8, 1024, 2688, MosaicConfig(block_n=64, split_k=1, num_stages=2)),
    # warp-specialized: compute warpgroups sharing x (N padded to whole CTAs of 2-3 tiles)
    (9, 64, 8, 2688, 1024, MosaicConfig(block_n=128, split_k=1, num_stages=2, consumers=2)),
    (9, 32, 8, 2048, 768, MosaicConfig(block_n=64, split_k=3, num_stages=2, consumers=3)),
])
def test_grouped_kernel_lowers_for_cuda(nb, mt, e, n, k, cfg):
    f = jax.jit(lambda x, c, s, be, nbk: grouped_matmul(x, c, s, be, nbk, block_m=mt, config=cfg))
    text = f.trace(*_grouped_args(nb, mt, e, n, k)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "fma.rn.bf16x2" in text and "nvfp4_moe_mosaic" in text
    split = check_config(cfg, k, mt)
    rows = cfg.block_n * cfg.consumers
    assert f"tensor<{split}x{nb * mt}x{-(-n // rows) * rows}xf32>" in text  # token-major


@pytest.mark.parametrize("activation,inter,config", [
    ("swiglu", 768, None), ("relu2", 2688, None), ("relu2", 96, None),
    ("relu2", 2688, MosaicMoEConfig(block_m=64, bf16_partials=True)),
    ("swiglu", 768, MosaicMoEConfig(block_m=8, bf16_partials=True, skip_padding=True, routing="kernel")),
    ("relu2", 96, MosaicMoEConfig(block_m=16)),
    ("swiglu", 768, MosaicMoEConfig(block_m=8, routing="kernel")),
    ("swiglu", 768, MosaicMoEConfig(block_m=8, routing="fused", skip_padding=True)),
    ("relu2", 2688, MosaicMoEConfig(block_m=8, epilogue="routes", skip_padding=True)),
])
def test_moe_mosaic_layer_lowers_for_cuda(activation, inter, config):
    """The whole layer (routing, kernels, glue): both GEMMs on Mosaic (nemotron's FC2, K = 2688,
    with whole-K scales) and the three Pallas-Triton glue kernels, or FC2 on Pallas-Triton
    (K = 96) with the XLA epilogue; with bf16_partials both GEMMs return bf16 products."""
    e, h, t, k = 16, 1024, 3, 4
    r = 2 * inter if activation == "swiglu" else inter
    import nvfp4_jax

    def stack(n, kk):
        return nvfp4_jax.NVFP4Array.from_parts(
            jnp.zeros((e, n, kk // 2), jnp.uint8), jnp.zeros((e, n, kk // 16), jnp.float8_e4m3fn),
            jnp.ones((e,), jnp.float32), shape=(e, n, kk))

    fc1, fc2 = stack(r, h), stack(h, inter)

    def f(x, ids, w, s1, s2):
        return moe_mosaic(x, ids, w, fc1, fc2, s1, s2, activation=activation, gate_up_order="up_gate",
                          mode="trtllm_cutlass", activation_scale="scalar", config=config)

    args = (jax.ShapeDtypeStruct((t, h), jnp.bfloat16), jax.ShapeDtypeStruct((t, k), jnp.int32),
            jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.float32),
            jax.ShapeDtypeStruct((e,), jnp.float32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    on2 = inter % 256 in (0, 128)
    assert text.count("nvfp4_moe_mosaic") >= (2 if on2 else 1)
    assert ("nvfp4_moe_fc2" in text) == (not on2)  # the Pallas-Triton FC2
    fused = config is not None and config.routing == "fused"  # t * k = 12 routes: it fits
    assert ("nvfp4_moe_fc1_operand" in text) == (not fused)
    assert ("nvfp4_moe_routing_operand" in text) == fused
    rk = config is not None and config.routing == "kernel"
    assert ("nvfp4_moe_scales" in text) == (not rk and not fused)
    assert ("nvfp4_moe_routing_scales" in text) == rk
    for glue in ("nvfp4_moe_fc1_epilogue", "nvfp4_moe_combine"):  # only with FC2 on Mosaic
        assert (glue in text) == on2
    if config is not None and config.bf16_partials:
        em = config.block_m * mm.max_blocks(t * k, e, config.block_m)
        for n in (r, h):  # FC1's and FC2's outputs: bf16 products, unsplit
            assert f"tensor<1x{em}x{n}xbf16>" in text


@pytest.mark.parametrize("nb,mt,e,n,k,cfg", [
    (25, 8, 512, 1024, 2688, MosaicConfig(block_n=128, split_k=1, num_stages=2)),  # nemotron FC2
    (25, 8, 512, 2688, 1024, MosaicConfig(block_n=128, split_k=2, num_stages=2)),  # nemotron FC1
    (9, 16, 8, 333, 512, MosaicConfig(block_n=128, split_k=1, num_stages=3, block_k=512)),
    # warp-specialized, K % 256 == 128 split unevenly; 21 row tiles in CTAs of 2
    (25, 64, 512, 1024, 2688, MosaicConfig(block_n=128, split_k=3, num_stages=2, consumers=2)),
    (25, 64, 512, 2688, 1024, MosaicConfig(block_n=128, split_k=1, num_stages=2, consumers=2)),
    # block_n 64: each CTA reads its 128-row scale tile, half of it (qwen3 T = 1; nemotron FC2)
    (9, 8, 128, 1536, 2048, MosaicConfig(block_n=64, split_k=2, num_stages=2)),
    (9, 8, 128, 2048, 768, MosaicConfig(block_n=64, split_k=1, num_stages=2)),
    (25, 8, 512, 1024, 2688, MosaicConfig(block_n=64, split_k=2, num_stages=2)),
])
def test_grouped_kernel_with_swizzled_scales_lowers_for_cuda(nb, mt, e, n, k, cfg):
    from oracle.layouts import padded_shape

    np_, kp = padded_shape(n, k // 16, "swizzled_128x4")
    args = list(_grouped_args(nb, mt, e, n, k))
    args[2] = jax.ShapeDtypeStruct((e, np_ * kp), jnp.uint8)
    f = jax.jit(lambda x, c, s, be, nbk: grouped_matmul(x, c, s, be, nbk, block_m=mt, config=cfg,
                                                        scale_layout="swizzled_128x4"))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "nvfp4_moe_mosaic" in text
    # the decode reads each (row, group)'s scales as two 4-byte words 512 bytes apart
    with pytest.raises(ValueError, match="^config: swizzled_128x4 scales need block_n=128 "
                                         r"\(or 64 with one compute warpgroup\)"):
        f2 = jax.jit(lambda x, c, s, be, nbk: grouped_matmul(
            x, c, s, be, nbk, block_m=mt, config=MosaicConfig(block_n=64, consumers=2),
            scale_layout="swizzled_128x4"))
        f2.trace(*args).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match="^scales: expected swizzled_128x4 scales"):
        args[2] = jax.ShapeDtypeStruct((e, np_ * kp - 4), jnp.uint8)
        f.trace(*args).lower(lowering_platforms=("cuda",))


def _swizzle_case(case, which=("fc1", "fc2")):
    """The case with its weight stacks' scales in swizzled_128x4 (as TensorRT-LLM loads them)."""
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    if "fc1" in which:
        fc1 = fc1.with_layout("swizzled_128x4")
    if "fc2" in which:
        fc2 = fc2.with_layout("swizzled_128x4")
    return hidden, ids, w, fc1, fc2, s1, s2


def _run(case, *, mode, activation, order="up_gate", config=None, act_scale=None, swizzle=()):
    act_scale = act_scale or ("scalar" if mode == "trtllm_cutlass" else "per_expert")
    fn = functools.partial(moe_mosaic, activation=activation, gate_up_order=order, mode=mode,
                           activation_scale=act_scale, config=config, reference=True,
                           return_intermediates=True)
    out, inter = jax.jit(fn)(*_swizzle_case(case, swizzle))
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    return f(out), f(inter["h"])


SPLIT = MosaicMoEConfig(block_m=16, fc1=MosaicConfig(block_n=64, split_k=2, num_stages=3),
                        fc2=MosaicConfig(block_n=128, split_k=2, num_stages=2))


@pytest.mark.parametrize("name,mode,activation,order,kw,config", [
    ("relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate", {"t": 9, "h": 512, "inter": 256, "e": 6, "k": 3}, None),
    ("swiglu_b12x_gate_up", "b12x", "swiglu", "gate_up", {"t": 7, "h": 256, "inter": 256, "e": 5, "k": 2}, SPLIT),
    ("T1_swiglu_trtllm", "trtllm_cutlass", "swiglu", "up_gate", {"t": 1, "h": 512, "inter": 256, "e": 8, "k": 3}, None),
    # most experts without tokens, uneven blocks (skewed routing)
    ("skewed_relu2_b12x", "b12x", "relu2", "up_gate",
     {"t": 21, "h": 256, "inter": 512, "e": 32, "k": 2, "routing": "skewed"}, SPLIT),
    # FC2 K = I = 384 (128 mod 256): whole-K scales, block_m 8
    ("wholek_fc2_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate", {"t": 5, "h": 256, "inter": 384, "e": 4, "k": 2}, None),
    # FC2 K = I neither: FC2 on Pallas-Triton (interpret), block_m 16
    ("fc2_triton_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate", {"t": 5, "h": 256, "inter": 96, "e": 4, "k": 2}, None),
    ("fc2_triton_swiglu_b12x", "b12x", "swiglu", "up_gate", {"t": 3, "h": 256, "inter": 160, "e": 4, "k": 3}, None),
    # 128-row blocks: uneven groups, FC1 split-K, FC2 with whole-K scales (K = 384)
    ("bm128_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 70, "h": 256, "inter": 384, "e": 3, "k": 2, "routing": "skewed"},
     MosaicMoEConfig(block_m=128, fc1=MosaicConfig(block_n=64, split_k=2, num_stages=2),
                     fc2=MosaicConfig(block_n=64, split_k=1, num_stages=2))),
    # the one-launch routing kernel instead of the XLA routing
    ("routing_kernel_swiglu_trtllm", "trtllm_cutlass", "swiglu", "up_gate",
     {"t": 5, "h": 256, "inter": 256, "e": 8, "k": 3, "routing": "skewed"},
     MosaicMoEConfig(block_m=8, routing="kernel")),
    # padding rows skipped by the FC1 operand and epilogue kernels (both activations, split-K)
    ("skip_padding_relu2_b12x", "b12x", "relu2", "up_gate",
     {"t": 9, "h": 512, "inter": 256, "e": 6, "k": 3, "routing": "skewed"},
     MosaicMoEConfig(block_m=8, skip_padding=True, fc1=MosaicConfig(split_k=2))),
    ("skip_padding_swiglu_trtllm", "trtllm_cutlass", "swiglu", "gate_up",
     {"t": 4, "h": 256, "inter": 384, "e": 5, "k": 2}, MosaicMoEConfig(block_m=16, skip_padding=True)),
    ("subnormal_scales_b12x", "b12x", "relu2", "up_gate",
     {"t": 6, "h": 256, "inter": 256, "e": 3, "k": 2, "scale_factor": 2.0**15}, None),
    # the GEMMs store bf16(alpha * acc) (trtllm_cutlass's rounding points) instead of fp32
    # partials: both GEMMs (relu2, FC2 with K = 384), and swiglu with FC1 split (fp32 there)
    ("bf16_partials_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 9, "h": 256, "inter": 384, "e": 6, "k": 3, "routing": "skewed", "scale_factor": 2.0**15},
     MosaicMoEConfig(block_m=8, bf16_partials=True)),
    ("bf16_partials_swiglu_trtllm", "trtllm_cutlass", "swiglu", "gate_up",
     {"t": 7, "h": 512, "inter": 256, "e": 5, "k": 2},
     MosaicMoEConfig(block_m=16, bf16_partials=True, skip_padding=True, fc1=MosaicConfig(split_k=2))),
    # the scales (G, 1/G, alphas) from one kernel instead of XLA: both modes
    ("scales_kernel_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 9, "h": 256, "inter": 384, "e": 6, "k": 3, "scale_factor": 2.0**15},
     MosaicMoEConfig(block_m=8)),
    ("scales_kernel_swiglu_b12x", "b12x", "swiglu", "gate_up", {"t": 7, "h": 512, "inter": 256, "e": 5, "k": 2},
     MosaicMoEConfig(block_m=16, bf16_partials=True)),
    # ... and from the routing kernel's launch (routing and scales in one program)
    ("routing_scales_kernel_relu2_b12x", "b12x", "relu2", "up_gate",
     {"t": 5, "h": 256, "inter": 256, "e": 8, "k": 3, "routing": "skewed"},
     MosaicMoEConfig(block_m=8, routing="kernel")),
    # ... and the FC1 operand from that launch too (routing="fused"): both modes, FC1 K over
    # two operand tiles (H = 4096), E4M3-subnormal block scales
    ("fused_routing_swiglu_b12x", "b12x", "swiglu", "gate_up",
     {"t": 3, "h": 4096, "inter": 256, "e": 16, "k": 4},
     MosaicMoEConfig(block_m=8, routing="fused", skip_padding=True)),
    ("fused_routing_subnormal_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 5, "h": 256, "inter": 512, "e": 8, "k": 3, "scale_factor": 2.0**15},
     MosaicMoEConfig(block_m=8, routing="fused", skip_padding=True)),
    # warp-specialized GEMM configs: partials padded to whole CTAs of consumers * block_n rows
    ("ws_relu2_b12x", "b12x", "relu2", "up_gate", {"t": 9, "h": 256, "inter": 512, "e": 4, "k": 2},
     MosaicMoEConfig(block_m=8, fc1=MosaicConfig(block_n=64, consumers=3),
                     fc2=MosaicConfig(block_n=64, consumers=3))),
    # the FC1 epilogue one program per route (epilogue="routes"): fp32 partials with FC1
    # split, bf16 products, swiglu with fused routing
    ("epilogue_routes_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 9, "h": 256, "inter": 384, "e": 6, "k": 3, "routing": "skewed", "scale_factor": 2.0**15},
     MosaicMoEConfig(block_m=8, epilogue="routes", fc1=MosaicConfig(block_n=128, split_k=2))),
    ("epilogue_routes_bf16_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 5, "h": 256, "inter": 256, "e": 8, "k": 3}, MosaicMoEConfig(block_m=8, epilogue="routes",
                                                                    bf16_partials=True)),
    ("epilogue_routes_swiglu_b12x", "b12x", "swiglu", "gate_up", {"t": 4, "h": 512, "inter": 256, "e": 6, "k": 2},
     MosaicMoEConfig(block_m=8, epilogue="routes", routing="fused", skip_padding=True)),
    # wide glue: 8-row FC1-operand programs, 256-column combine programs (prefill), both modes
    ("wide_glue_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 9, "h": 512, "inter": 256, "e": 4, "k": 3, "routing": "skewed"},
     MosaicMoEConfig(block_m=16, wide_glue=True, bf16_partials=True)),
    ("wide_glue_swiglu_b12x", "b12x", "swiglu", "gate_up", {"t": 7, "h": 256, "inter": 256, "e": 5, "k": 2},
     MosaicMoEConfig(block_m=8, wide_glue=True, skip_padding=True)),
    # token_quant: each token's FC1 input quantized once, the routed rows gathered from it
    # (trtllm_cutlass: one encode scale), narrow and wide, E4M3-subnormal block scales
    ("token_quant_subnormal_relu2_trtllm", "trtllm_cutlass", "relu2", "up_gate",
     {"t": 9, "h": 256, "inter": 384, "e": 6, "k": 3, "routing": "skewed", "scale_factor": 2.0**15},
     MosaicMoEConfig(block_m=8, token_quant=True, routing="kernel")),
    ("token_quant_wide_swiglu_trtllm", "trtllm_cutlass", "swiglu", "up_gate",
     {"t": 11, "h": 512, "inter": 256, "e": 5, "k": 4},
     MosaicMoEConfig(block_m=16, token_quant=True, wide_glue=True, skip_padding=True, bf16_partials=True)),
    # 64-row blocks (the prefill default's): the swiglu FC1 epilogue in programs of 32 rows
    ("prefill_blocks_swiglu_trtllm", "trtllm_cutlass", "swiglu", "up_gate",
     {"t": 40, "h": 256, "inter": 256, "e": 3, "k": 2},
     MosaicMoEConfig(block_m=64, token_quant=True, wide_glue=True, bf16_partials=True)),
])
def test_moe_mosaic_dataflow_matches_oracle(name, mode, activation, order, kw, config):
    case = make_case(np.random.default_rng(len(name)), activation=activation, **kw)
    if "subnormal" in name:
        assert np.mean(case[3].scales < 0x08) > 0.5
    out, h = _run(case, mode=mode, activation=activation, order=order, config=config)
    check_against_oracle(case, out, h, mode=mode, activation=activation, gate_up_order=order)


@pytest.mark.parametrize("inter,swizzle", [(384, ("fc1", "fc2")), (256, ("fc2",))])
def test_moe_mosaic_dataflow_swizzled_weights(inter, swizzle, caplog):
    """swizzled_128x4 weight stacks go to the grouped kernel as they are (no conversion, no
    warning) at block_n 128 and 64, and the layer still matches the oracle; with two compute warpgroups at block_n 64 they are converted to linear on every
    call, with a warning."""
    case = make_case(np.random.default_rng(inter), t=7, h=256, inter=inter, e=5, k=2, activation="relu2")
    with caplog.at_level(logging.WARNING, logger="nvfp4_jax.moe"):
        out, h = _run(case, mode="trtllm_cutlass", activation="relu2", swizzle=swizzle)
    assert "converted to linear" not in caplog.text
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")
    # FC2 split-K over the (K + 128) / 256 steps (uneven at K % 256 == 128: the last split
    # runs past K), only possible with swizzled scales
    split = MosaicMoEConfig(block_m=8, fc1=MosaicConfig(block_n=128, split_k=2),
                            fc2=MosaicConfig(block_n=128, split_k=3))
    out, h = _run(case, mode="trtllm_cutlass", activation="relu2", swizzle=swizzle, config=split)
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")
    # block_n 64: read as they are (each CTA half of a 128-row tile), no warning
    bn64 = MosaicMoEConfig(block_m=8, fc1=MosaicConfig(block_n=64), fc2=MosaicConfig(block_n=64, split_k=2))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nvfp4_jax.moe"):
        out, h = _run(case, mode="trtllm_cutlass", activation="relu2", swizzle=swizzle, config=bn64)
    assert "converted to linear" not in caplog.text
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")
    # block_n 64 with two compute warpgroups cannot: converted on every call, with a warning
    which = "fc1" if "fc1" in swizzle else "fc2"  # (K = I = 384 has no linear ws form)
    ws64 = MosaicMoEConfig(block_m=16, **{which: MosaicConfig(block_n=64, consumers=2)})
    with caplog.at_level(logging.WARNING, logger="nvfp4_jax.moe"):
        out, h = _run(case, mode="trtllm_cutlass", activation="relu2", swizzle=swizzle, config=ws64)
    assert f"{which} scales in layout swizzled_128x4 are converted to linear on every call" in caplog.text
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("mode,activation", [("trtllm_cutlass", "relu2"), ("trtllm_cutlass", "swiglu"),
                                             ("b12x", "relu2")])
def test_bf16_partials_same_numbers_as_fp32_partials(mode, activation, caplog):
    """bf16 products stored by the GEMM are the rounding the fp32 path does in the next kernel
    (one fp32 multiply by alpha, round to nearest even), so the layer is bit-identical; b12x
    has no such rounding point: fp32 partials, with a log line."""
    case = make_case(np.random.default_rng(11), t=6, h=256, inter=256, e=4, k=3, activation=activation)
    base = MosaicMoEConfig(block_m=8)
    with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe"):
        got = _run(case, mode=mode, activation=activation, config=dataclasses.replace(base, bf16_partials=True))
    want = _run(case, mode=mode, activation=activation, config=base)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert ("bf16_partials ignored in mode b12x" in caplog.text) == (mode == "b12x")


def test_grouped_kernel_bf16_products():
    """grouped_matmul(alpha=...): bf16 [1, EM, N_pad] = bf16(alpha[e] * acc) per block, lowered
    for CUDA with a bf16 output; validation names the argument."""
    nb, mt, e, n, k = 4, 8, 3, 256, 512
    args = (*_grouped_args(nb, mt, e, n, k), jax.ShapeDtypeStruct((e,), jnp.float32))
    f = jax.jit(lambda x, c, s, be, nbk, a: grouped_matmul(x, c, s, be, nbk, block_m=mt, alpha=a))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_moe_mosaic" in text and f"tensor<1x{nb * mt}x{n}xbf16>" in text
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((nb * mt, k)), jnp.bfloat16)
    c = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    sc = jnp.asarray(rng.integers(0x20, 0x48, (e, n, k // 16)), jnp.uint8)
    be, nbk = jnp.asarray([2, 0, 1, 0], jnp.int32), jnp.asarray([3], jnp.int32)
    alpha = jnp.asarray([3e-3, 0.5, 7.0], jnp.float32)
    g = functools.partial(grouped_matmul, block_m=mt, reference=True)
    part = np.asarray(g(x, c, sc, be, nbk))[0]  # fp32 accumulators times 2^-7
    prod = np.asarray(g(x, c, sc, be, nbk, alpha=alpha).astype(jnp.float32))[0]
    # expected from the fp32 partials with numpy: fp32 product, then bf16 round to nearest even
    import ml_dtypes
    a_rows = np.repeat(np.asarray(alpha)[np.asarray(be)] * np.float32(128.0), mt)[:, None]
    want = (part * a_rows).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    rows = slice(0, 3 * mt)  # blocks past num_blocks are garbage in both
    np.testing.assert_array_equal(prod[rows], want[rows])
    assert np.all(np.isfinite(prod[rows])) and np.abs(prod[rows]).max() > 0
    with pytest.raises(ValueError, match="^alpha: expected float32"):
        g(x, c, sc, be, nbk, alpha=alpha[:2])
    with pytest.raises(ValueError, match="^config: alpha .* needs split_k=1"):
        g(x, c, sc, be, nbk, alpha=alpha, config=MosaicConfig(split_k=2))


def test_moe_mosaic_b12x_scalar_activation_scale():
    case = make_case(np.random.default_rng(3), t=6, h=256, inter=256, e=5, k=2, activation="relu2")
    out, h = _run(case, mode="b12x", activation="relu2", act_scale="scalar")
    check_against_oracle(case, out, h, mode="b12x", activation="relu2", activation_scale="scalar")


def test_public_api_backend_choice_is_logged(caplog):
    case = make_case(np.random.default_rng(2), t=4, h=256, inter=256, e=4, k=2, activation="relu2")
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    kw = {"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2, "topk_ids": ids,
          "topk_weights": w}
    with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe"):
        forced = moe(hidden, backend="mosaic", **kw)
        pallas = moe(hidden, backend="pallas", **kw)
        moe(hidden, backend="auto", **kw)
    assert "backend mosaic off the GPU -> XLA emulation" in caplog.text
    assert "backend auto -> xla (no GPU)" in caplog.text
    np.testing.assert_array_equal(np.asarray(forced, np.float32), np.asarray(pallas, np.float32))


def test_choose_backend(monkeypatch):
    from nvfp4_jax.moe import api

    assert api.choose_backend("pallas", MoEConfig(), routes=8, hidden=2048, experts=128) == "pallas"
    assert api.choose_backend("xla", None, routes=8, hidden=2048, experts=128) == "xla"
    with pytest.raises(ValueError, match="^backend: expected one of"):
        api.choose_backend("triton", None, routes=8, hidden=2048, experts=128)
    with pytest.raises(ValueError, match="^config: backend='pallas' takes a MoEConfig"):
        api.choose_backend("pallas", MosaicMoEConfig(), routes=8, hidden=2048, experts=128)
    with pytest.raises(ValueError, match="^config: backend='mosaic' takes a MosaicMoEConfig"):
        api.choose_backend("mosaic", MoEConfig(), routes=8, hidden=2048, experts=128)
    # the device as each kind of machine reports it
    for gpu, sm90, want in ((False, False, "xla"), (True, False, "pallas"), (True, True, "mosaic")):
        monkeypatch.setattr(api, "on_gpu", lambda gpu=gpu: gpu)
        monkeypatch.setattr(api, "is_sm90", lambda sm90=sm90: sm90)
        assert api.choose_backend("auto", None, routes=8, hidden=2048, experts=128) == want
    assert api.choose_backend("auto", MoEConfig(), routes=8, hidden=2048, experts=128) == "pallas"
    assert api.choose_backend("auto", None, routes=api.MAX_ROUTES + 1, hidden=2048,
                              experts=128) == "pallas"
    assert api.choose_backend("auto", None, routes=8, hidden=2048 + 128, experts=128) == "pallas"
    with pytest.raises(ValueError, match="^config: a MosaicMoEConfig was given"):
        api.choose_backend("auto", MosaicMoEConfig(), routes=api.MAX_ROUTES + 1, hidden=2048,
                           experts=128)
    monkeypatch.setattr(api, "is_sm90", lambda: False)
    with pytest.raises(ValueError, match="^backend: 'mosaic' needs an sm_90"):
        api.choose_backend("mosaic", None, routes=8, hidden=2048, experts=128)

def test_choose_backend_on_sm12x(monkeypatch, caplog):
    """SM 12.x: the mma.sync form when asked for, with plgpu.mma (JAX >= 0.11); auto runs it
    up to SM12X_ROUTES_PER_EXPERT mean routed rows per expert (rounded up) and the FP4-MMA
    Pallas-Triton MoE beyond, or without plgpu.mma; each choice logged with its reason."""
    from nvfp4_jax.gemm import mosaic as gemm_mosaic
    from nvfp4_jax.moe import api

    monkeypatch.setattr(api, "on_gpu", lambda: True)
    monkeypatch.setattr(api, "is_sm90", lambda: False)
    monkeypatch.setattr(api, "is_sm12x", lambda: True)
    monkeypatch.setattr(api, "gpu_compute_capability", lambda: 121)
    monkeypatch.setattr(gemm_mosaic, "has_mma_sync", lambda: False)
    with pytest.raises(ValueError, match=r"or SM 12.x with plgpu.mma \(JAX >= 0.11\)"):
        api.choose_backend("mosaic", None, routes=8, hidden=2048, experts=128)
    with caplog.at_level("INFO", logger="nvfp4_jax.moe.api"):
        assert api.choose_backend("auto", None, routes=8, hidden=2048, experts=128) == "pallas"
    assert "auto -> pallas (sm_121: the Mosaic kernels' SM 12.x form needs plgpu.mma" in caplog.text
    monkeypatch.setattr(gemm_mosaic, "has_mma_sync", lambda: True)
    assert api.choose_backend("mosaic", None, routes=8, hidden=2048, experts=128) == "mosaic"
    per = api.SM12X_ROUTES_PER_EXPERT
    for routes, experts, want in ((1, 128, "mosaic"), (8, 128, "mosaic"), (512, 128, "mosaic"),
                                  (per * 128, 128, "mosaic"), (per * 128 + 1, 128, "pallas"),
                                  (per * 8, 8, "mosaic"), (per * 8 + 1, 8, "pallas"),
                                  (per, 512, "mosaic"), (per + 1, 512, "mosaic"),
                                  (90112, 512, "pallas")):
        caplog.clear()
        with caplog.at_level("INFO", logger="nvfp4_jax.moe.api"):
            got = api.choose_backend("auto", None, routes=routes, hidden=2048, experts=experts)
        assert got == want, (routes, experts)
        why = "mma.sync" if want == "mosaic" else "the FP4 MMA"
        assert f"auto -> {want} (sm_121" in caplog.text and why in caplog.text
    assert api.choose_backend("auto", MoEConfig(), routes=8, hidden=2048, experts=128) == "pallas"
    assert api.choose_backend("auto", None, routes=8, hidden=2048 + 128, experts=128) == "pallas"
    with pytest.raises(ValueError, match="^config: a MosaicMoEConfig was given"):
        api.choose_backend("auto", MosaicMoEConfig(), routes=per * 128 + 1, hidden=2048,
                           experts=128)


def test_validation_names_the_argument():
    x = jnp.zeros((16, 256), jnp.bfloat16)
    c = jnp.zeros((3, 64, 128), jnp.uint8)
    s = jnp.zeros((3, 64, 16), jnp.uint8)
    be = jnp.zeros((2,), jnp.int32)
    nb = jnp.ones((1,), jnp.int32)
    g = functools.partial(grouped_matmul, block_m=8, reference=True)
    with pytest.raises(ValueError, match="^x: expected bfloat16"):
        g(x.astype(jnp.float16), c, s, be, nb)
    with pytest.raises(ValueError, match="^x: rows"):
        g(x[:12], c, s, be, nb)
    with pytest.raises(ValueError, match="^block_m"):
        grouped_matmul(x, c, s, be, nb, block_m=12)
    with pytest.raises(ValueError, match="^codes: expected uint8"):
        g(x, c.astype(jnp.int8), s, be, nb)
    with pytest.raises(ValueError, match="^codes: expected shape"):
        g(x, c[:, :, :64], s, be, nb)
    with pytest.raises(ValueError, match="^scales: expected shape"):
        g(x, c, s[:, :, :8], be, nb)
    with pytest.raises(ValueError, match="^scales: expected uint8"):
        g(x, c, s.astype(jnp.int32), be, nb)
    with pytest.raises(ValueError, match="^block_expert"):
        g(x, c, s, be[:1], nb)
    with pytest.raises(ValueError, match="^num_blocks"):
        g(x, c, s, be, nb.reshape(()))
    with pytest.raises(ValueError, match="^config: expected a MosaicConfig"):
        g(x, c, s, be, nb, config="fast")
    with pytest.raises(ValueError, match="^config: block_k=512"):
        g(x, c, s, be, nb, config=MosaicConfig(block_k=512))
    with pytest.raises(ValueError, match="^config: MosaicConfig.bf16_store is the dense kernel's"):
        g(x, c, s, be, nb, config=MosaicConfig(bf16_store=True))
    with pytest.raises(ValueError, match="^config: .* bytes of shared memory"):
        grouped_matmul(jnp.zeros((128, 512), jnp.bfloat16), c[:, :, :1] .repeat(256, 2), s[:, :, :1].repeat(32, 2),
                       be, nb, block_m=64, reference=True,
                       config=MosaicConfig(block_n=128, num_stages=8, block_k=512))
    with pytest.raises(ValueError, match="^codes: the Mosaic grouped kernel needs K % 256"):
        g(jnp.zeros((16, 96), jnp.bfloat16), c[:, :, :48], s[:, :, :6], be, nb)
    c3 = jnp.zeros((c.shape[0], 33, 192), jnp.uint8)  # K % 256 == 128 but N odd: no pair view
    with pytest.raises(ValueError, match="^codes: .* N even .* got N=33, K=384"):
        g(jnp.zeros((16, 384), jnp.bfloat16), c3, jnp.zeros((c.shape[0], 33, 24), jnp.uint8), be, nb)
    with pytest.raises(ValueError, match="^config: K=384 .* needs block_k=256"):
        g(jnp.zeros((16, 384), jnp.bfloat16), jnp.zeros((3, 64, 192), jnp.uint8),
          jnp.zeros((3, 64, 24), jnp.uint8), be, nb, config=MosaicConfig(block_k=512))
    for bad in ({"block_m": 4}, {"fc1": "x"}, {"fc2_triton": 3}, {"routing": "sort"}):
        with pytest.raises(ValueError, match="^MosaicMoEConfig"):
            MosaicMoEConfig(**bad)
    with pytest.raises(TypeError, match="^MosaicMoEConfig.skip_padding"):
        MosaicMoEConfig(skip_padding=1)
    # public API: the backend name and the backend/config pairing
    case = make_case(np.random.default_rng(0), t=2, h=256, inter=96, e=2, k=1)
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    kw = {"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2, "topk_ids": ids,
          "topk_weights": w}
    with pytest.raises(ValueError, match="^backend: expected one of"):
        moe(hidden, backend="cuda", **kw)
    with pytest.raises(ValueError, match="^config: backend='mosaic' takes a MosaicMoEConfig"):
        moe(hidden, backend="mosaic", config=MoEConfig(), **kw)
    with pytest.raises(ValueError, match="^config: backend='pallas' takes a MoEConfig"):
        moe(hidden, backend="pallas", config=MosaicMoEConfig(), **kw)
    with pytest.raises(ValueError, match="^config: block_m=8; FC2 runs on Pallas-Triton"):
        moe(hidden, backend="mosaic", config=MosaicMoEConfig(block_m=8), **kw)
    case = make_case(np.random.default_rng(0), t=2, h=96, inter=64, e=2, k=1)
    hidden, ids, w, fc1, fc2, s1, s2 = to_jax(case)
    kw.update({"fc1": fc1, "fc2": fc2, "fc1_input_scale": s1, "fc2_input_scale": s2, "topk_ids": ids,
               "topk_weights": w})
    with pytest.raises(ValueError, match="^fc1: the Mosaic grouped kernel needs K % 256"):
        moe(hidden, backend="mosaic", **kw)


def test_default_configs():
    nemo = default_config(22, 512, hidden=1024, rows1=2688, inter=2688)
    assert nemo.block_m == 8  # FC2 (K = 2688) on Mosaic with whole-K scales
    assert default_config(22, 512, hidden=1024, rows1=2688, inter=2560 + 96).block_m == 16  # Triton FC2
    qwen = default_config(8, 128, hidden=2048, rows1=1536, inter=768)
    assert qwen.block_m == 8
    for cfg, k1, k2 in ((nemo, 1024, 2688), (qwen, 2048, 768)):
        assert (k1 // 256) % cfg.fc1.split_k == 0
        if k2 % 256 == 0:
            assert (k2 // 256) % cfg.fc2.split_k == 0
        for c, k in ((cfg.fc1, k1), (cfg.fc2, k2)):
            assert c.smem_bytes(cfg.block_m, whole_k=k if k % 256 else None) < 200 * 1024
    for key, cfg in mm.AUTO_SM90.items():
        assert isinstance(cfg, MosaicMoEConfig) and len(key) == 5
    # prefill-sized routings: the block holds the mean rows per expert (at most 64), and the
    # tiles still fit the shared memory
    for routes, want in ((22 * 512, 32), (22 * 4096, 64), (22 * 64, 8)):
        cfg = default_config(routes, 512, hidden=1024, rows1=2688, inter=2688)
        assert cfg.block_m == want, (routes, cfg)
        for c, k in ((cfg.fc1, 1024), (cfg.fc2, 2688)):
            assert c.smem_bytes(cfg.block_m, whole_k=k if k % 256 else None) <= 227 * 1024
            # from WS_ROUTES routed rows on: two compute warpgroups
            assert c.consumers == (2 if routes >= mm.WS_ROUTES else 1), (routes, cfg)
        assert cfg.bf16_partials == (routes >= mm.BF16_PARTIALS_ROUTES)
        assert cfg.wide_glue == (routes >= mm.WIDE_GLUE_ROUTES)
        assert cfg.token_quant == (routes >= mm.TOKEN_QUANT_ROUTES)


def test_prefill_default_config_drops_ws_for_linear_whole_k(monkeypatch, caplog):
    """An auto-picked warp-specialized FC2 over linear scales with K % 256 == 128 (no
    warp-specialized whole-K kernel) runs with one warpgroup, logged, and matches the oracle;
    a caller's config is refused instead."""
    monkeypatch.setattr(mm, "WS_ROUTES", 16)
    monkeypatch.setattr(mm, "BF16_PARTIALS_ROUTES", 16)
    monkeypatch.setattr(mm, "WIDE_GLUE_ROUTES", 16)  # the prefill default's wide glue too
    case = make_case(np.random.default_rng(5), t=9, h=256, inter=384, e=4, k=2, activation="relu2")
    with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe"):
        out, h = _run(case, mode="trtllm_cutlass", activation="relu2")
    assert "fc2: linear scales with K=384 have no warp-specialized kernel" in caplog.text
    assert "fc1:" not in caplog.text  # FC1's K = 256: warp-specialized as picked
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")
    ws = MosaicMoEConfig(block_m=8, fc2=MosaicConfig(block_n=128, consumers=2))
    with pytest.raises(ValueError, match="consumers=2 needs K % 256 == 0 or swizzled"):
        _run(case, mode="trtllm_cutlass", activation="relu2", config=ws)


def test_bf16_round_is_the_bf16_conversion():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1 << 16) * np.exp2(rng.uniform(-140, 120, 1 << 16))).astype(np.float32)
    x = np.concatenate([x, np.float32([np.inf, -np.inf, 3.3895e38, 1e-45, -1e-45, 0.0, -0.0])])
    import ml_dtypes

    from nvfp4_jax.moe.xla import bf16_round

    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # numpy RNE conversion, not XLA's
    got = np.asarray(jax.jit(bf16_round)(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_auto_table_entries_are_valid_and_looked_up():
    """The measured entries run (check_config passes for both GEMMs, linear and swizzled
    scales), keep the default heuristic's block size, and auto_config returns them."""
    for (e, h, r, i, b), cfg in mm.AUTO_SM90.items():
        routes = {32: 22, 256: 176, 2048: 1408, 8: 8, 64: 64, 32768: 32768}[b]
        assert mm._bucket(routes) == b
        assert default_config(routes, e, hidden=h, rows1=r, inter=i).block_m == cfg.block_m
        assert mm.auto_config(routes, e, hidden=h, rows1=r, inter=i) == cfg
        for c, k in ((cfg.fc1, h), (cfg.fc2, i)):
            for swz in (False, True):
                assert check_config(c, k, cfg.block_m, swizzled=swz) >= 1
    # qwen3 prefill: the default config with skip_padding and FC2 on one warpgroup
    q = default_config(32768, mm._QWEN[0], hidden=mm._QWEN[1], rows1=mm._QWEN[2], inter=mm._QWEN[3])
    assert mm.AUTO_SM90[(*mm._QWEN, 32768)] == dataclasses.replace(
        q, skip_padding=True, fc2=dataclasses.replace(q.fc2, consumers=1))
    assert mm.auto_config(16384, 128, hidden=2048, rows1=1536, inter=768) == default_config(
        16384, 128, hidden=2048, rows1=1536, inter=768)  # T = 2048: not measured, the default
    # FC2 zero-padded along K (pad_fc2): its own FC2 config where measured, the rest as above
    for key, c2 in mm.AUTO_SM90_PADDED_FC2.items():
        e, h, r, i, b = key
        routes = {32: 22, 256: 176}[b]
        want = dataclasses.replace(mm.AUTO_SM90[key], fc2=c2)
        assert mm.auto_config(routes, e, hidden=h, rows1=r, inter=i, fc2_padded=True) == want
        assert mm.auto_config(routes, e, hidden=h, rows1=r, inter=i) == mm.AUTO_SM90[key]
        for swz in (False, True):
            assert check_config(c2, -(-i // 256) * 256, want.block_m, swizzled=swz, padded=True) >= 1
    # SM 12.x: its own grouped-GEMM tiles where SM12X_GEMMS has them, the rest of the entry as
    # sm_90's; elsewhere the sm_90 entry
    for key, (c1, c2) in mm.SM12X_GEMMS.items():
        e, h, r, i, b = key
        got = mm.auto_config(b, e, hidden=h, rows1=r, inter=i, sm12x=True)
        assert got == dataclasses.replace(mm.AUTO_SM90[key], fc1=c1, fc2=c2)
        assert (got.fc1, got.fc2) != (mm.AUTO_SM90[key].fc1, mm.AUTO_SM90[key].fc2)
        for c, k in ((c1, h), (c2, i)):
            assert check_config(c, k, got.block_m, swizzled=True) >= 1
    nemo = (*mm._NEMO, 256)
    assert mm.auto_config(176, *nemo[:1], hidden=nemo[1], rows1=nemo[2], inter=nemo[3],
                          sm12x=True) == mm.AUTO_SM90[nemo]


@pytest.mark.parametrize("n,k,bn", [(1024, 2688, 128), (1024, 2688, 64), (256, 384, 64), (300, 1152, 128)])
def test_whole_k_scale_addressing(n, k, bn):
    """The whole-K scale mode's byte arithmetic, replayed in numpy: the CTA's copy of the pair
    view (``whole_k_pair_rows`` pair rows from row n0/2, zeros past N) read at the decoder's
    offsets (step i: 16*i, row r: r*K/16, group g: 8*g) gives scale bytes [r, 16i + 8g, +8) of
    the tile for every real K group, and stays inside the copy for the padding group."""
    from nvfp4_jax.gemm.mosaic import whole_k_chunk, whole_k_pair_rows, whole_k_scale_view

    rng = np.random.default_rng(k)
    scales = rng.integers(0, 0x7F, (n, k // 16), dtype=np.uint8)
    view = np.asarray(whole_k_scale_view(jnp.asarray(scales)))
    c = whole_k_chunk(k)
    assert c % 16 == 0 and c <= 256 and view.shape == (n // 2, 2 * (k // 16) // c, c)
    p = whole_k_pair_rows(bn, k)
    assert p > bn // 2 and (p * 2 * (k // 16)) % 128 == 0
    steps = (k + 128) // 256
    for n0 in range(0, n, bn):
        copy = np.zeros((p,) + view.shape[1:], np.uint8)  # TMA: zeros past the last pair row
        rows = view[n0 // 2 : n0 // 2 + p]
        copy[: len(rows)] = rows
        flat = copy.reshape(-1)
        for i in range(steps):
            for g in range(2):
                for r in range(min(bn, n - n0)):
                    off = 16 * i + r * (k // 16) + 8 * g
                    assert off + 8 <= flat.size
                    if 128 * (2 * i + g) < k:  # a real K group: its 8 scale bytes
                        np.testing.assert_array_equal(
                            flat[off : off + 8], scales[n0 + r, 16 * i + 8 * g : 16 * i + 8 * g + 8])



def test_fused_routing_config_is_checked():
    """routing="fused" writes only the routed operand rows: a config without skip_padding is
    refused, naming the field."""
    with pytest.raises(ValueError, match="^MosaicMoEConfig.routing: 'fused'"):
        MosaicMoEConfig(routing="fused")
    with pytest.raises(ValueError, match="^MosaicMoEConfig.routing: expected 'xla', 'kernel' or 'fused'"):
        MosaicMoEConfig(routing="triton")
    assert MosaicMoEConfig(routing="fused", skip_padding=True).routing == "fused"


@pytest.mark.parametrize("routing,method", [("kernel", "routes"), ("fused", "routes"), ("kernel", "tokens")])
def test_moe_mosaic_dataflow_routes_method(routing, method, monkeypatch, caplog):
    """The routing kernels' "routes" method (above 128 experts, up to ROUTES_AUTO_MAX routes;
    forced here at 24 experts by lowering ROUTING_EXPERTS_MAX) and "tokens" method (with
    ROUTES_AUTO_MAX 0) inside the layer, against the oracle; no fallback to XLA."""
    from nvfp4_jax.moe import routing_kernel as rtk

    monkeypatch.setattr(rtk, "ROUTING_EXPERTS_MAX", 8)
    if method == "tokens":
        monkeypatch.setattr(rtk, "ROUTES_AUTO_MAX", 0)
    assert rtk.routing_methods(9 * 3, 24, 8, top_k=3)[0] == method
    case = make_case(np.random.default_rng(31), t=9, h=256, inter=384, e=24, k=3, activation="relu2",
                     routing="skewed")
    cfg = MosaicMoEConfig(block_m=8, routing=routing, skip_padding=True)
    with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe"):
        out, h = _run(case, mode="trtllm_cutlass", activation="relu2", config=cfg)
    assert "does not fit" not in caplog.text
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")


def test_token_quant_runs_where_one_scale_serves_all_experts(caplog):
    """token_quant: with one encode scale (trtllm_cutlass, scalar activation scale) the layer
    runs the token quantization and the gather kernel (their names in the program) instead of
    the per-route operand kernel; with per-expert scales (b12x) it keeps the per-route kernel
    and says why; with the fused routing it is refused."""
    case = make_case(np.random.default_rng(5), t=6, h=256, inter=256, e=4, k=2, activation="relu2")
    cfg = MosaicMoEConfig(block_m=8, token_quant=True)
    for mode, act, gather in (("trtllm_cutlass", "scalar", True), ("b12x", "per_expert", False)):
        fn = functools.partial(moe_mosaic, activation="relu2", gate_up_order="up_gate", mode=mode,
                               activation_scale=act, config=cfg, reference=True)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe"):
            text = str(jax.make_jaxpr(fn)(*to_jax(case)))
        assert ("nvfp4_moe_fc1_gather" in text) == gather
        assert ("nvfp4_moe_token_operand" in text) == gather
        assert ("nvfp4_moe_fc1_operand" in text) == (not gather)
        assert ("token_quant ignored" in caplog.text) == (not gather)
    with pytest.raises(ValueError, match="^MosaicMoEConfig.token_quant: routing='fused'"):
        MosaicMoEConfig(token_quant=True, routing="fused", skip_padding=True)
    with pytest.raises(TypeError, match="^MosaicMoEConfig.token_quant"):
        MosaicMoEConfig(token_quant=1)


def test_sm12x_form_of_every_moe_config_fits_99_kb():
    """Every measured MoE entry and the default configs at decode and prefill routings, in the
    form SM 12.x runs (``for_sm12x``, as ``moe_mosaic`` converts them there): mma.sync, one
    warpgroup, within 99 KB of shared memory, whole-K scale buffers included."""
    from nvfp4_jax.gemm.mosaic import SM12X_SMEM_LIMIT, for_sm12x
    from nvfp4_jax.moe.mosaic import AUTO_SM90, default_config

    cases = [(key[1], key[3], cfg) for key, cfg in AUTO_SM90.items()]
    for e, h, r, i in ((512, 1024, 2688, 2688), (128, 2048, 1536, 768)):
        for routes in (8, 176, 1408, 11264, 90112):
            cases.append((h, i, default_config(routes, e, hidden=h, rows1=r, inter=i)))
    for h, i, cfg in cases:
        for fc, k in ((cfg.fc1, h), (cfg.fc2, i)):
            whole = k if k % 256 else None
            c = for_sm12x(fc, cfg.block_m, whole)
            assert (c.mma, c.consumers, c.overlap) == ("sync", 1, False)
            assert c.smem_bytes(cfg.block_m, whole) <= SM12X_SMEM_LIMIT, (cfg, c)


def test_moe_mosaic_on_sm12x_converts_its_configs(monkeypatch, caplog):
    """On SM 12.x ``moe_mosaic`` runs its grouped GEMMs in the mma.sync form within 99 KB
    (logged), whole-K FC2 scales included (I % 256 == 128); the XLA emulation checks the same
    numbers against the oracle."""
    from nvfp4_jax.gemm import mosaic as gemm_mosaic

    monkeypatch.setattr(mm, "is_sm12x", lambda: True)
    monkeypatch.setattr(gemm_mosaic, "is_sm12x", lambda: True)  # check_config's 99 KB
    case = make_case(np.random.default_rng(12), t=5, h=512, inter=384, e=6, k=2, activation="relu2")
    with caplog.at_level(logging.INFO, logger="nvfp4_jax.moe.mosaic"):
        out, h = _run(case, mode="trtllm_cutlass", activation="relu2",
                      config=MosaicMoEConfig(block_m=64, fc1=MosaicConfig(block_n=128, num_stages=4),
                                             fc2=MosaicConfig(block_n=128, num_stages=3)))
    text = caplog.text
    assert "grouped GEMMs on mma.sync" in text and "mma='sync'" in text
    assert "num_stages=4" not in text  # 4 stages of a 64-row block do not fit 99 KB
    check_against_oracle(case, out, h, mode="trtllm_cutlass", activation="relu2")


@pytest.mark.parametrize("sm12x", [False, True], ids=["sm90", "sm12x"])
@pytest.mark.parametrize("t", [1, 3])
def test_qwen3_decode_entry_splits_match_oracle(t, sm12x):
    """qwen3's T = 1 entry (sm_90: FC1 in 4 splits, FC2 in 3, one K step per CTA;
    SM 12.x: ``SM12X_GEMMS``' 2 / 1) at qwen3's H and I with 8 experts, the reference kernels
    (their split partials summed as the GPU's), against the oracle; T = 3 routes more blocks
    through the same entry."""
    from moe_cases import make_case_fast

    cfg = mm.auto_config(8, mm._QWEN[0], hidden=mm._QWEN[1], rows1=mm._QWEN[2],
                         inter=mm._QWEN[3], sm12x=sm12x)
    assert (cfg.fc1.split_k, cfg.fc2.split_k) == ((2, 1) if sm12x else (4, 3))
    case = make_case_fast(np.random.default_rng(40 + t), t=t, h=mm._QWEN[1], inter=mm._QWEN[3],
                          e=8, k=4, activation="swiglu")
    out, h = _run(case, mode="b12x", activation="swiglu", config=cfg, swizzle=("fc1", "fc2"))
    check_against_oracle(case, out, h, mode="b12x", activation="swiglu")
