"""The E4M3-subnormal scale decode fault of b12x's / FlashInfer's SM12x quantizers, before and
after the fix.

Facts (``nvfp4_jax.interop.scale_decode``): before b12x PR #388 / FlashInfer PR #3932 the
quantizer's helper decoded an exponent-0 byte with the normal formula ``2^-7 (1 + m/8)``; b12x
PR #388 gives byte 0x01 -> 0.0087890625 instead of 0.001953125, FlashInfer PR #3932 "up to
4.5x off". The fuzzer finds the fault on its own: the generic self-consistency property of
``nvfp4_jax.testing`` run over the existing input strategy (whose scale regimes include E4M3
subnormals) fails on the old decode and passes on the fixed one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import oracle
from nvfp4_jax import explain
from nvfp4_jax.interop import scale_decode as SD
from nvfp4_jax.interop import trtllm
from nvfp4_jax.testing import assert_quantize_consistent, quantize_violations
from nvfp4_jax.testing import strategies as nst


def test_pre_fix_decode_is_the_normal_formula_on_subnormal_bytes():
    old = SD.decode(np.arange(8, dtype=np.uint8), "pre_fix")
    assert old[0] == 0.0 and old[1] == 0.0087890625  # b12x PR #388's example byte
    right = np.arange(8) * 2.0**-9
    np.testing.assert_array_equal(SD.decode(np.arange(8, dtype=np.uint8)), right)
    assert max(old[1:] / right[1:]) == 4.5  # "up to 4.5x off" (FlashInfer PR #3932)
    normal = np.arange(8, 0x7F, dtype=np.uint8)  # every normal byte decodes right in both
    np.testing.assert_array_equal(SD.decode(normal, "pre_fix"), oracle.e4m3_decode(normal))
    with pytest.raises(ValueError, match="decoder"):
        SD.decode(normal, "old")


def test_versions_select_the_decode():
    assert [SD.decoder_for("b12x", v) for v in ("1.2.6", "1.3.0", "1.5.0", "1.5.1")] == [
        "pre_fix", "pre_fix", "native", "native"]
    assert SD.decoder_for("flashinfer-python", "0.6.16") == "pre_fix"
    assert SD.decoder_for("flashinfer-python", "0.6.17") == "native"
    assert SD.decoder_for("flashinfer-python", "0.7.2.post1") == "native"
    with pytest.raises(ValueError, match="peer"):
        SD.decoder_for("vllm", "1.0")


@pytest.mark.parametrize("dist, helper", [
    ("b12x", "b12x/_lib/intrinsics.py"),
    ("flashinfer-python", "flashinfer/cute_dsl/fp4_common.py"),
])
def test_installed_peer_decodes_as_its_version_says(dist, helper):
    """The installed peer's source: the decode helper the recorded fix version predicts."""
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed")
    top = helper.split("/")[0]
    spec = importlib.util.find_spec(top)
    path = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), helper)
    src = open(path).read()
    body = src[src.index("def fp8_e4m3_to_f32("):][:1500]
    native = "cvt.rn.f16x2.e4m3x2" in body
    old = "fma.rn.f32 mant_f, mant_f, 0f3E000000, 0f3F800000" in body
    assert native != old, f"{dist} {version}: unrecognised fp8_e4m3_to_f32 in {path}"
    assert SD.decoder_for(dist, version) == ("native" if native else "pre_fix"), (dist, version)


def test_native_quantizer_is_the_oracle_b12x_recipe():
    rng = np.random.default_rng(0)
    mag = 10.0 ** rng.uniform(-7, 0, (8, 32, 1))
    x = oracle.bf16_round((rng.standard_normal((8, 32, 16)) * mag).reshape(8, 512))
    g = float(np.float32(2688.0 / np.abs(x).max()))
    q, want = SD.quantize(x, g), oracle.quantize(x, "b12x", encode_scale=g)
    np.testing.assert_array_equal(q.codes, want.codes)
    np.testing.assert_array_equal(q.scales, want.scales)
    old = SD.quantize(x, g, decoder="pre_fix")
    np.testing.assert_array_equal(old.scales, want.scales)  # the stored bytes are right
    sub = (want.scales > 0) & (want.scales < 8)
    assert sub.any()
    changed = (oracle.codes_of(old) != oracle.codes_of(want)).reshape(8, 32, 16).any(-1)
    assert not changed[~sub].any() and changed[sub].any()  # only subnormal-scale blocks move


@pytest.mark.parametrize("recipe", ["trtllm", "trtllm_fast", "b12x", "b12x_grouped",
                                    "flashinfer_reference"])
def test_property_holds_for_every_correct_quantizer(recipe):
    rng = np.random.default_rng(1)
    mag = 10.0 ** rng.uniform(-8, 1, (6, 16, 1))
    x = oracle.bf16_round((rng.standard_normal((6, 16, 16)) * mag).reshape(6, 256))
    g = float(np.float32(2688.0 / np.abs(x).max()))
    assert not np.any(quantize_violations(x, oracle.quantize(x, recipe, encode_scale=g), g) > 0)


def _fuzz(decoder: str):
    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(nst.nvfp4_inputs())
    def prop(inp):
        q = SD.quantize(inp.x, inp.encode_scale, decoder=decoder)
        assert_quantize_consistent(inp.x, q, inp.encode_scale,
                                   label=f"b12x quantizer ({decoder} decode)")

    return prop


def test_fuzzer_finds_the_pre_fix_subnormal_decode_on_its_own():
    with pytest.raises(AssertionError, match=r"E4M3 subnormal"):
        _fuzz("pre_fix")()


def test_fuzzer_passes_the_fixed_decode():
    _fuzz("native")()


def test_explain_attributes_the_wrong_output_to_the_subnormal_decode():
    """A W4A4 linear call whose activations came from the pre-fix quantizer (one token of small
    activations next to a large one, so its block scales are E4M3 subnormals), computed by the
    re-enacted ``nvfp4_gemm``: explain names the fault."""
    rng = np.random.default_rng(3)
    m, n, k = 8, 64, 256
    x = rng.standard_normal((m, k))
    x[0] *= 300.0  # an attention-sink-like token sets amax; the others get small block scales
    x[1:] *= 10.0 ** rng.uniform(-2.5, -1.0, (m - 1, 1))
    x = oracle.bf16_round(x)
    w = oracle.quantize(oracle.bf16_round(rng.standard_normal((n, k)) * 0.02), "modelopt")
    input_scale = float(np.float32(np.abs(x).max() / 2688.0))
    g = float(np.float32(1.0 / input_scale))
    act = SD.quantize(x, g, decoder="pre_fix")
    assert ((act.scales > 0) & (act.scales < 8)).any()
    alpha = float(np.float32(np.float32(input_scale) * np.float32(w.decode_scale)))
    out = trtllm.nvfp4_gemm(act.codes, w.codes, act.scales, w.scales, alpha, "float32")
    out = out.astype(np.float64)
    case = explain.GemmCase.from_linear(x, w.codes, w.scales, float(w.decode_scale), input_scale,
                                        out_dtype="float32")
    e = explain.explain_gemm(case, out)
    assert e.verdict == "explained", e.format()
    assert e.best.name == "act_sf_subnormal_decode" and e.best.match == 1.0, e.format()
    # the fixed quantizer's output is not attributed to the fault (b12x's division and
    # TensorRT-LLM's reciprocal can still round a tie differently: explain holds W4A4 to the latter)
    good = SD.quantize(x, g)
    fixed = trtllm.nvfp4_gemm(good.codes, w.codes, good.scales, w.scales, alpha, "float32")
    fixed = fixed.astype(np.float64)
    e_fixed = explain.explain_gemm(case, fixed)
    assert e_fixed.best is None or e_fixed.best.name != "act_sf_subnormal_decode", e_fixed.format()
    tq, ts = trtllm.fp4_quantize(x, g, fast_math=False)
    right = trtllm.nvfp4_gemm(tq, w.codes, ts, w.scales, alpha, "float32").astype(np.float64)
    assert explain.explain_gemm(case, right).verdict == "correct"
