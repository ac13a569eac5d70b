"""nvfp4_jax.interop.trtllm_torch: TensorRT-LLM's arithmetic in torch, against the oracle."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from conftest import nvfp4_blocks
from moe_cases import make_case

import oracle
from nvfp4_jax.interop import trtllm_torch as T
from nvfp4_jax.testing import assert_gemm_close, assert_moe_close

_moe = importlib.import_module("oracle.moe")


@pytest.mark.parametrize("fast_math, recipe", [(True, "trtllm_fast"), (False, "trtllm")])
@pytest.mark.parametrize("bf16", [True, False])
def test_quantizer_bit_exact_with_oracle(fast_math, recipe, bf16):
    """Every regime of conftest.nvfp4_blocks: zero, outlier, ties, tiny, underflow, saturation."""
    for seed in range(6):
        d = float(oracle.f32(np.exp2(np.random.default_rng(seed).uniform(-24, 6))))
        x = nvfp4_blocks(100 + seed, 4096, d, bf16=bf16).reshape(-1, 128)
        g = float(oracle.f32(1.0 / d))
        q, s = T.fp4_quantize(torch.from_numpy(x), g, fast_math=fast_math)
        want = oracle.quantize(x.astype(np.float64), recipe, encode_scale=g)
        np.testing.assert_array_equal(s.view(torch.uint8).numpy(), want.scales)
        np.testing.assert_array_equal(q.numpy(), want.codes)


def test_quantizer_per_row_scale_and_swizzled_layout():
    rng = np.random.default_rng(0)
    x = oracle.bf16_round(rng.standard_normal((200, 96)) * np.exp2(rng.uniform(-8, 8, (200, 1))))
    g = oracle.f32(2688.0 / np.abs(x).max(1))
    q, s = T.fp4_quantize(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(g.astype(np.float32)),
                          fast_math=False, sf_layout="swizzled_128x4")
    for r in (0, 77, 199):
        want = oracle.quantize(x[r:r + 1], "trtllm", encode_scale=float(g[r]))
        np.testing.assert_array_equal(q[r].numpy(), want.codes[0])
    lin = T.unswizzle_128x4(s, 200, 6)
    np.testing.assert_array_equal(oracle.swizzle(lin.numpy(), "swizzled_128x4"), s.numpy())
    assert s.numel() == 256 * 8  # rows padded to 128, scale columns to 4


def test_e4m3_cast_saturates_on_every_torch():
    v = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e6, float("inf"), -500.0, 2.0**-10,
                      1.5 * 2.0**-10, 2.0**-9])
    got = T.e4m3_saturating(v).view(torch.uint8).tolist()
    assert got == [0x7E] * 7 + [0xFE, 0x00, 0x01, 0x01]


def test_nvfp4_gemm_within_oracle_bound():
    rng = np.random.default_rng(1)
    a = oracle.quantize(oracle.bf16_round(rng.standard_normal((17, 256))), "trtllm_fast",
                        encode_scale=300.0)
    w = oracle.quantize(oracle.bf16_round(rng.standard_normal((40, 256)) * 0.02), "modelopt")
    alpha = float(oracle.f32(float(a.decode_scale) * float(w.decode_scale)))
    t = lambda v: torch.from_numpy(v)
    out = T.nvfp4_gemm(t(a.codes), t(w.codes), t(a.scales), t(w.scales), alpha)
    assert out.dtype == torch.bfloat16
    assert_gemm_close(out.float().numpy(), a, w, alpha=alpha)


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_cutlass_pipeline_is_the_oracle(activation):
    """Exact quantizer: bit-identical to oracle.moe(trtllm_cutlass); fast math: within the bound."""
    rng = np.random.default_rng(2)
    case = make_case(rng, t=7, h=64, inter=32, e=4, k=2, activation=activation)
    want = _moe.moe(*case, activation=activation, mode="trtllm_cutlass")
    got = T.run_pipeline("trtllm_cutlass", *case, activation=activation, fast_math=False)
    np.testing.assert_array_equal(got, want)
    fast = T.run_pipeline("trtllm_cutlass", *case, activation=activation, fast_math=True)
    assert_moe_close(fast, *case, activation=activation)


def test_pipeline_weight_transforms():
    rng = np.random.default_rng(3)
    case = make_case(rng, t=2, h=64, inter=32, e=3, k=2)
    fc1, fc2, s1, s2 = case[3:]
    cut = T.cutlass_moe_weights(fc1, fc2, s1, s2)
    g1 = np.float32(1) / np.float32(np.max(s1))
    assert cut.fc1_act_scale.item() == g1
    ws2 = np.float32(fc1.decode_scale)
    np.testing.assert_array_equal(cut.fc1_alpha.numpy(), np.float32(1) / (g1 * (np.float32(1) / ws2)))
    fold = T.cutedsl_b12x_moe_weights(fc1, fc2, s1, s2)
    w_scale_2 = (cut.fc1_alpha * cut.fc1_act_scale).numpy()
    want = oracle.e4m3_encode(oracle.f32(oracle.e4m3_decode(fc1.scales) * w_scale_2[:, None, None]))
    np.testing.assert_array_equal(fold.fc1_scales.view(torch.uint8).numpy(), want)
    np.testing.assert_array_equal(fold.fc1_alpha.numpy(), np.full(3, np.float32(1) / g1))
    assert torch.equal(fold.fc1_weight, cut.fc1_weight)
    fix = T.fixed_moe_weights(fc1, fc2, s1, s2)
    assert torch.equal(fix.fc1_scales.view(torch.uint8), cut.fc1_scales.view(torch.uint8))
    np.testing.assert_allclose(fix.fc1_alpha.numpy(), cut.fc1_alpha.numpy(), rtol=2**-22)
    with pytest.raises(ValueError, match="pipeline"):
        T.moe_weights("cutlass", fc1, fc2, s1, s2)


def test_folded_pipeline_breaks_at_checkpoint_scale_magnitudes():
    """weight_scale_2 ~ 2e-5 (weights sigma ~ 0.01): every folded scale is subnormal."""
    rng = np.random.default_rng(4)
    from nvfp4_jax.testing.strategies import modelopt_quantize

    w1 = oracle.bf16_round(rng.standard_normal((4, 64, 128)) * 0.01)
    w2 = oracle.bf16_round(rng.standard_normal((4, 128, 64)) * 0.01)
    fc1, fc2 = modelopt_quantize(w1), modelopt_quantize(w2)
    hidden = oracle.bf16_round(rng.standard_normal((5, 128)))
    ids = np.argsort(rng.random((5, 4)), 1)[:, :2]
    wts = oracle.f32(np.full((5, 2), 0.5))
    s1 = oracle.f32(np.full(4, np.abs(hidden).max() / 2688))
    h = _moe.activate(np.einsum("th,erh->ter", hidden, oracle.dequantize(fc1)), "relu2")
    s2 = oracle.f32(np.full(4, np.abs(h).max() / 2688))
    args = (hidden, ids, wts, fc1, fc2, s1, s2)
    fold = T.cutedsl_b12x_moe_weights(fc1, fc2, s1, s2)
    assert (fold.fc1_scales.float() < 2.0**-6).all()
    ref = _moe.moe(*args)
    err = lambda p: np.linalg.norm(T.run_pipeline(p, *args) - ref) / np.linalg.norm(ref)
    assert err("trtllm_cutedsl_b12x") > 0.05
    assert err("flashinfer_fixed") < 5e-3


def test_live_bridge_reports_why_and_never_pretends():
    ok, why = T.live_available()
    if ok:  # pragma: no cover - only on an SM10x/12x machine with TensorRT-LLM
        pytest.skip(f"live TensorRT-LLM present ({why}); covered by the GPU tests")
    assert why and isinstance(why, str)
    with pytest.raises(T.LiveUnavailable, match=why.split(" ")[0]):
        T.live_fp4_quantize(torch.zeros(1, 16), 1.0)
    with pytest.raises(T.LiveUnavailable):
        T.live_nvfp4_gemm(None, None, None, None, 1.0)


@pytest.mark.gpu
def test_live_trtllm_quantize_matches_reenactment():  # pragma: no cover - needs SM10x/12x + TRT-LLM
    ok, why = T.live_available()
    if not ok:
        pytest.skip(why)
    x = torch.from_numpy(nvfp4_blocks(7, 2048, 1e-3, bf16=True).reshape(-1, 64)).to(torch.bfloat16)
    q, s = T.live_fp4_quantize(x, 1000.0)
    q_ref, s_ref = T.fp4_quantize(x, 1000.0, fast_math=True)
    assert torch.equal(s, s_ref.view(torch.uint8))
    assert (q != q_ref).float().mean() < 2e-3  # rcp.approx ties only
