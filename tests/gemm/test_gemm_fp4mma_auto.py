"""W4A4 on FP4 tensor cores through ``nvfp4_jax.matmul`` on CPU: the activation quantizer that
writes the NVFP4 operand itself (``gemm.operand.w4a4_codes``, byte-identical to the oracle), and
the routing of ``mma`` / ``backend="auto"`` with the device probe monkeypatched to an SM 12.x GPU
(interpret mode runs ``dot_scaled``'s exact reference), checked against the oracle's
``gemm_w4a4`` bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfp4_jax as nj
import oracle
from nvfp4_jax.gemm import api
from nvfp4_jax.gemm.fp4mma import Fp4MmaConfig, default_mma
from nvfp4_jax.gemm.operand import w4a4_codes
from nvfp4_jax.gemm.pallas_triton import Config
from nvfp4_jax.testing import assert_gemm_close
from oracle.formats import bf16_round, f32


def _case(seed: int, m: int, k: int, decades: float, headroom: float):
    """bf16 x whose 16-value blocks span ``decades`` (block scales reach E4M3 subnormals) and
    input_scale = headroom * amax / 2688 (headroom < 1: saturating block scales)."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-decades, 0, (m, k // 16)).repeat(16, 1)
    x = bf16_round(rng.standard_normal((m, k)) * mag * 10.0 ** rng.uniform(-3, 3))
    x[0, :3] = [-0.0, 0.0, -0.0]  # signed zeros: trtllm keeps the sign bit (code 8)
    return x, float(f32(np.abs(x).max() / 2688.0 * headroom))


def _oracle(x, s) -> oracle.NVFP4:
    return oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s)))


def _codes(x, s, dtype=jnp.bfloat16):
    c, sc = w4a4_codes(jnp.asarray(x, dtype), jnp.float32(s), interpret=True)
    assert c.dtype == jnp.uint8 and sc.dtype == jnp.uint8
    return np.asarray(c), np.asarray(sc)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 11), kb=st.integers(1, 24),
       decades=st.floats(0.0, 6.0), headroom=st.sampled_from([1.0, 0.5, 2.0**-6, 2.0**-12]))
def test_codes_are_the_oracles_quantization(seed, m, kb, decades, headroom):
    x, s = _case(seed, m, 16 * kb, decades, headroom)
    want = _oracle(x, s)
    codes, scales = _codes(x, s)
    np.testing.assert_array_equal(scales, want.scales)
    np.testing.assert_array_equal(codes, want.codes)


def test_codes_cover_subnormal_saturating_and_zero_block_scales():
    """One case with every kind of block scale present, so the property above is not vacuous."""
    x, s = _case(5, 9, 4096, 6.0, 0.5)
    x[1, 16:32] = 0.0
    want = _oracle(x, s)
    assert ((want.scales > 0) & (want.scales < 8)).any()  # E4M3 subnormal
    assert (want.scales == 0x7E).any() and (want.scales == 0).any()  # saturated, zero
    codes, scales = _codes(x, s)
    np.testing.assert_array_equal(scales, want.scales)
    np.testing.assert_array_equal(codes, want.codes)
    assert (codes[0, 0] & 0xF) == 8  # -0.0


def test_fp16_input():
    x, s = _case(3, 4, 272, 4.0, 1.0)
    want = _oracle(x, s)
    codes, scales = _codes(x, s, jnp.float16)
    np.testing.assert_array_equal(scales, want.scales)
    np.testing.assert_array_equal(codes, want.codes)


def test_nonfinite_blocks_get_a_nan_scale_byte_and_nan_rows():
    """docs/input-policy.md, traced and unchecked: a block holding NaN/Inf gets scale byte 0x7F
    (its other blocks as the oracle's), and the W4A4 output row is NaN, the others finite."""
    x, s = _case(11, 4, 64, 2.0, 1.0)
    x[1, 20] = np.nan
    x[2, 50] = np.inf
    _, scales = jax.jit(lambda v, t: w4a4_codes(v, t, interpret=True))(
        jnp.asarray(x, jnp.bfloat16), jnp.float32(s))
    scales = np.asarray(scales)
    finite = np.where(np.isfinite(x), x, 0.0)
    want = _oracle(finite, s)
    bad = np.zeros_like(scales, bool)
    bad[1, 1] = bad[2, 3] = True
    assert (scales[bad] == 0x7F).all()
    np.testing.assert_array_equal(scales[~bad], want.scales[~bad])
    w = nj.quantize(jnp.asarray(np.random.default_rng(0).standard_normal((16, 64)), jnp.float32))
    out = jax.jit(lambda v, t: nj.matmul(v, w, input_scale=t, mma="fp4", out_dtype=jnp.float32))(
        jnp.asarray(x, jnp.bfloat16), jnp.float32(s))
    out = np.asarray(out)
    assert np.isnan(out[1:3]).all() and np.isfinite(out[[0, 3]]).all()


def test_codes_errors_name_the_argument():
    with pytest.raises(ValueError, match="x: expected bf16/fp16"):
        w4a4_codes(jnp.zeros((3, 32), jnp.float32), jnp.float32(1.0), interpret=True)
    with pytest.raises(ValueError, match="x: K must be a positive multiple of 16"):
        w4a4_codes(jnp.zeros((3, 40), jnp.bfloat16), jnp.float32(1.0), interpret=True)
    with pytest.raises(ValueError, match="input_scale: expected an fp32 scalar"):
        w4a4_codes(jnp.zeros((3, 32), jnp.bfloat16), jnp.ones((2,), jnp.float32), interpret=True)


def test_codes_lower_for_the_gpu_with_ieee_division():
    f = jax.jit(lambda x, s: w4a4_codes(x, s))
    text = f.trace(jnp.zeros((3, 512), jnp.bfloat16), jnp.float32(0.1)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "nvfp4_w4a4_codes" in text and "div.rn.f32" in text


# --------------------------------------------------------------------------------- routing


@pytest.fixture
def spy(monkeypatch):
    """Counts the FP4-MMA GEMM's calls from ``matmul`` (the real kernel still runs)."""
    calls = []
    real = api.gemm_fp4mma

    def wrapped(*a, **kw):
        calls.append(kw.get("config"))
        return real(*a, **kw)

    monkeypatch.setattr(api, "gemm_fp4mma", wrapped)
    return calls


def _device(monkeypatch, cc: int | None):
    """The probe as ``matmul`` reads it: compute capability ``cc`` (Pallas still interprets)."""
    monkeypatch.setattr(api, "gpu_compute_capability", lambda: cc)
    monkeypatch.setattr(api, "is_sm12x", lambda: cc is not None and 120 <= cc < 130)


def _problem(seed=0, lead=(5,), n=48, k=128):
    rng = np.random.default_rng(seed)
    x, s = _case(seed, int(np.prod(lead)), k, 3.0, 1.0)
    wo = oracle.quantize(f32(rng.standard_normal((n, k))), "modelopt")
    return x, s, wo


@pytest.mark.parametrize("cc", [120, 121])
@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_sm12x_w4a4_runs_on_the_fp4_mma(monkeypatch, spy, cc, backend):
    _device(monkeypatch, cc)
    x, s, wo = _problem(cc)
    out = nj.matmul(jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo), input_scale=jnp.float32(s),
                    backend=backend, out_dtype=jnp.float32)
    assert len(spy) == 1
    assert_gemm_close(np.asarray(out), x, wo, input_scale=s, out_dtype="float32",
                      label=f"sm_{cc} {backend}")


def test_sm12x_prequantized_activation_uses_its_own_codes(monkeypatch, spy):
    _device(monkeypatch, 120)
    x, s, wo = _problem(3, lead=(6,))
    a = _oracle(x, s)
    xa = nj.from_oracle(a).with_layout("swizzled_128x4")  # read back as linear
    out = jax.jit(lambda xa, w: nj.matmul(xa, w, out_dtype=jnp.float32))(xa, nj.from_oracle(wo))
    assert len(spy) == 1 and out.shape == (6, 48)
    assert_gemm_close(np.asarray(out), a, wo, out_dtype="float32")


def test_sm12x_leading_axes(monkeypatch, spy):
    _device(monkeypatch, 120)
    x, s, wo = _problem(6, lead=(6,))
    out = jax.jit(lambda v, w, t: nj.matmul(v, w, input_scale=t, out_dtype=jnp.float32))(
        jnp.asarray(x.reshape(2, 3, -1), jnp.bfloat16), nj.from_oracle(wo), jnp.float32(s))
    assert len(spy) == 1 and out.shape == (2, 3, 48)
    assert_gemm_close(np.asarray(out).reshape(6, 48), x, wo, input_scale=s, out_dtype="float32")


@pytest.mark.parametrize("cc", [None, 89, 100])
def test_auto_elsewhere_keeps_the_bf16_mma(monkeypatch, spy, cc):
    _device(monkeypatch, cc)
    x, s, wo = _problem(1)
    out = nj.matmul(jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo), input_scale=jnp.float32(s),
                    out_dtype=jnp.float32)
    assert spy == []
    assert_gemm_close(np.asarray(out), x, wo, input_scale=s, out_dtype="float32")


def test_sm12x_w4a16_and_forced_bf16_keep_the_bf16_mma(monkeypatch, spy):
    _device(monkeypatch, 120)
    x, s, wo = _problem(2)
    xb, w = jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo)
    nj.matmul(xb, w)  # W4A16: the activation is not FP4
    nj.matmul(xb, w, input_scale=jnp.float32(s), mma="bf16")
    nj.matmul(xb, w, input_scale=jnp.float32(s), config=Config(block_m=16, decode="bits"))
    assert spy == []


@pytest.mark.parametrize("how", [{"mma": "fp4"}, {"config": Fp4MmaConfig(block_m=8, block_n=16,
                                                                          block_k=64)}])
def test_fp4_forced_off_sm12x(monkeypatch, spy, how):
    _device(monkeypatch, 90)
    x, s, wo = _problem(4, lead=(7,), n=40, k=96)
    out = nj.matmul(jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo), input_scale=jnp.float32(s),
                    backend="pallas", out_dtype=jnp.bfloat16, **how)
    assert len(spy) == 1 and spy[0] == how.get("config")
    assert_gemm_close(np.asarray(out, np.float32), x, wo, input_scale=s, out_dtype="bfloat16")


def test_default_mma_follows_the_probe(monkeypatch):
    from nvfp4_jax.gemm import fp4mma

    monkeypatch.setattr(fp4mma, "is_sm12x", lambda: True)
    assert default_mma() == "fp4"
    monkeypatch.setattr(fp4mma, "is_sm12x", lambda: False)
    assert default_mma() == "bf16"


@pytest.mark.parametrize("kwargs, message", [
    ({"mma": "fp8"}, r"mma: expected one of \('bf16', 'fp4'\)"),
    ({"mma": "fp4", "input_scale": None}, "mma: 'fp4' multiplies FP4 activations"),
    ({"mma": "fp4", "backend": "xla"}, "mma: 'fp4' runs on the Pallas backend"),
    ({"mma": "fp4", "backend": "mosaic"}, "mma: 'fp4' runs on the Pallas backend"),
    ({"mma": "bf16", "config": Fp4MmaConfig()}, "config: a Fp4MmaConfig is for mma='fp4'"),
    ({"mma": "fp4", "config": Config()}, "config: a Config is for mma='bf16'"),
    ({"config": (16, 64)}, "config: expected a Config, an Fp4MmaConfig or None"),
])
def test_mma_errors_name_the_argument(kwargs, message):
    x = jnp.ones((2, 64), jnp.bfloat16)
    w = nj.quantize(jnp.ones((16, 64), jnp.float32))
    kw = {"input_scale": jnp.float32(0.01), **kwargs}
    with pytest.raises(ValueError, match=message):
        nj.matmul(x, w, **kw)


# --------------------------------------------------------------------------------- selftest


def test_selftest_plans_the_fp4_mma_where_it_runs():
    from nvfp4_jax import selftest

    for cc, present in ((None, True), (90, True), (120, True), (121, True), (89, False)):
        kernels = {k for k, _, _ in selftest.plan(cc)}
        assert ("matmul/fp4mma/w4a4" in kernels) == present, cc
        assert "matmul/fp4mma/w4a16" not in kernels


def test_selftest_fp4_mma_check_passes_on_cpu():
    from nvfp4_jax import selftest

    _, checks = selftest.run(only=("matmul/fp4mma",))
    assert len(checks) == len(selftest.GEMM_SHAPES["cpu"])
    assert all(c.status == selftest.PASS for c in checks), [c.detail for c in checks]
