"""Cross-checks against peers that run on CPU: ModelOpt, FlashInfer's and b12x's torch references.

Each test skips with the peer's own reason when it is not importable (tools/install-peers.sh
installs b12x and FlashInfer; nvidia-modelopt comes with the ``peers`` extra).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from conftest import nvfp4_blocks
from moe_cases import make_case

import oracle
from nvfp4_jax.interop import b12x as B
from nvfp4_jax.interop import flashinfer as FI
from nvfp4_jax.interop import modelopt as MO
from nvfp4_jax.interop import trtllm_torch as T

_moe = importlib.import_module("oracle.moe")


def _need(avail):
    ok, why = avail()
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("sigma", [1e-3, 2e-2, 1.0])
def test_modelopt_quantizer_equals_our_three_backends(sigma):
    _need(MO.live_available)
    rng = np.random.default_rng(int(sigma * 1000))
    w = oracle.bf16_round(rng.standard_normal((64, 256)) * sigma).astype(np.float32)
    w[3, :16] = 0.0  # an all-zero block: ModelOpt writes scale 1.0
    want = MO.live_quantize(w)
    for backend in ("jax", "torch", "oracle"):
        got = MO.quantize_linear(w, backend=backend)
        np.testing.assert_array_equal(got.weight, want.weight)
        np.testing.assert_array_equal(got.weight_scale, want.weight_scale)
        assert got.weight_scale_2 == want.weight_scale_2
    assert want.weight_scale[3, 0] == 0x38


def test_flashinfer_reference_quantizer_is_oracle_recipe():
    _need(FI.reference_available)
    for seed in range(3):
        d = 10.0 ** -seed
        x = nvfp4_blocks(seed, 2048, d, bf16=True, scale_log2_lo=-9, scale_log2_hi=8.7).reshape(-1, 64)
        g = float(oracle.f32(1.0 / d))
        q, s = FI.reference_quantize(torch.from_numpy(x), g)
        want = oracle.quantize(x.astype(np.float64), "flashinfer_reference", encode_scale=g)
        np.testing.assert_array_equal(s, want.scales)
        np.testing.assert_array_equal(q, want.codes)


def test_flashinfer_b12x_reference_sees_the_folding():
    """FlashInfer's own b12x MoE reference: the fix equals CUTLASS semantics, the fold does not."""
    _need(FI.reference_available)
    rng = np.random.default_rng(5)
    case = make_case(rng, t=8, h=128, inter=64, e=4, k=2, activation="swiglu", scale_factor=1.0)
    hidden, ids, wts = (torch.from_numpy(np.asarray(a, np.float32)) for a in case[:3])
    ids = ids.to(torch.int64)
    fc1, fc2 = case[3], case[4]
    out = {p: FI.reference_b12x_moe(hidden, ids, wts, T.moe_weights(p, fc1, fc2, *case[5:], activation="swiglu"))
           .float().numpy() for p in T.PIPELINES}
    np.testing.assert_allclose(out["flashinfer_fixed"], out["trtllm_cutlass"], rtol=2e-2, atol=1e-3)
    rel = np.linalg.norm(out["trtllm_cutedsl_b12x"] - out["flashinfer_fixed"]) / np.linalg.norm(out["flashinfer_fixed"])
    assert rel > 0.02, rel


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_b12x_reference_equals_oracle_and_exposes_folding(activation):
    _need(B.reference_available)
    rng = np.random.default_rng(6)
    case = make_case(rng, t=6, h=128, inter=64, e=4, k=2, activation=activation)
    want = _moe.moe(*case, activation=activation, mode="b12x")
    kept = B.reference_moe(*case, activation=activation)
    # b12x accumulates in fp32 where the oracle is exact: equal up to rare bf16 flips
    assert np.linalg.norm(kept - want) / np.linalg.norm(want) < 1e-2
    folded = B.reference_moe(*case, activation=activation, folded=True)
    assert np.linalg.norm(folded - want) / np.linalg.norm(want) > 0.03


def test_flashinfer_live_reports_reason():
    ok, why = FI.live_available()
    if ok:  # pragma: no cover
        pytest.skip(f"live FlashInfer present ({why})")
    with pytest.raises(T.LiveUnavailable):
        FI.live_fp4_quantize(torch.zeros(1, 16), 1.0)
    with pytest.raises(T.LiveUnavailable):
        FI.live_b12x_moe(None, None, None, None)
