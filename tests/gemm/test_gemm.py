"""NVFP4 GEMM on CPU: Pallas kernel (interpret mode) and XLA path vs the exact oracle.

Bound: ``oracle.gemm_error_bound`` (fp32 accumulation in any order, gamma_K with u = 2^-23 =
twice fp32's unit roundoff for truncating tensor cores, plus split-K partial additions, the
alpha multiply and the output rounding). Not a tuned tolerance; NaN never passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import nvfp4_jax
import oracle
from nvfp4_jax.gemm import Config, dequantize_pallas, dequantize_xla, matmul, matmul_pallas

OUT_U = {jnp.bfloat16: 2.0**-8, jnp.float32: 2.0**-24, jnp.float16: 2.0**-11}


def _weights(rng, n, k, scale_exp=(-4.0, 4.0), subnormal=False):
    """Random NVFP4 weight via the oracle; per-block magnitudes spread over ~2^+-6."""
    mag = np.exp2(rng.uniform(*scale_exp, (n, k // 16))).repeat(16, 1)
    wf = (rng.standard_normal((n, k)) * mag).astype(np.float32)
    if subnormal:  # block scales in the E4M3 subnormal range 2^-9..2^-6: tiny blocks, large amax
        wf[:, :16] *= 1e-4
        wf[0, 0] = 1e3
    return oracle.quantize(wf, "trtllm")


def _x(rng, m, k, mag=1.0):
    return (rng.standard_normal((m, k)) * mag).astype(ml_dtypes.bfloat16)


def _assert_within(out, ref, bound):
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out)), "non-finite output"
    err = np.abs(out - ref)
    worst = np.argmax(err - bound)
    assert np.all(err <= bound), (
        f"max excess at {np.unravel_index(worst, err.shape)}: err {err.flat[worst]:.3e} > "
        f"bound {bound.flat[worst]:.3e} (ref {ref.flat[worst]:.3e})"
    )


def _w4a16_ref(x, wo, out_dtype, splits=1):
    xd = np.asarray(x, np.float64)
    ref = oracle.gemm_w4a16(xd, wo)
    bound = oracle.gemm_error_bound(
        np.abs(xd),
        np.abs(oracle.dequantize(wo, include_decode_scale=False)),
        float(wo.decode_scale),
        ref,
        out_u=OUT_U[out_dtype],
        splits=splits,
    )
    return ref, bound


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 40, 272, Config(block_m=16, block_n=32, block_k=64)),  # M=1, K % BK != 0, N % BN != 0
        (37, 72, 160, Config(block_m=16, block_n=64, block_k=128, split_k=2)),  # ragged M, split-K
        (5, 96, 512, Config(block_m=32, block_n=32, block_k=256, split_k=4)),
        (70, 33, 48, Config(block_m=64, block_n=16, block_k=32)),  # K < BK... 48 = 1.5 tiles
    ],
)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_interpret_w4a16(m, n, k, cfg, out_dtype):
    rng = np.random.default_rng(m * 1000 + n + k)
    wo = _weights(rng, n, k, subnormal=(m == 1))
    x = _x(rng, m, k, mag=float(rng.choice([1e-3, 1.0, 50.0])))
    cfg = Config(**{**cfg.__dict__, "decode": "bits"})
    out = matmul_pallas(
        jnp.asarray(x),
        jnp.asarray(wo.codes),
        jnp.asarray(wo.scales),
        np.float32(wo.decode_scale),
        out_dtype=out_dtype,
        config=cfg,
        interpret=True,
    )
    ref, bound = _w4a16_ref(x, wo, out_dtype, splits=cfg.split_k)
    _assert_within(out, ref, bound)


def test_subnormal_scales_dequant_exact():
    """Every code byte x every finite E4M3 scale byte (incl. subnormals 2^-9..2^-6) is exact."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (16, 1))  # [16, 256] -> K = 512
    scales = np.resize(np.arange(0, 127, dtype=np.uint8), (16, 32))
    t = oracle.NVFP4(codes, scales, np.float64(1.0))
    ref = oracle.dequantize(t, include_decode_scale=False)
    got_x = dequantize_xla(jnp.asarray(codes), jnp.asarray(scales), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got_x, np.float64), ref)
    got_p = dequantize_pallas(
        jnp.asarray(codes),
        jnp.asarray(scales),
        config=Config(decode="bits"),
        interpret=True,
        block_n=16,
        block_k=128,
    )
    np.testing.assert_array_equal(np.asarray(got_p, np.float64), ref)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_matmul_w4a16_batch_dims(backend):
    rng = np.random.default_rng(7)
    wo = _weights(rng, 48, 96)
    x = _x(rng, 2 * 3, 96, 3.0).reshape(2, 3, 96)
    out = matmul(jnp.asarray(x), nvfp4_jax.from_oracle(wo), backend=backend)
    assert out.shape == (2, 3, 48) and out.dtype == jnp.bfloat16
    ref, bound = _w4a16_ref(x.reshape(6, 96), wo, jnp.bfloat16)
    _assert_within(np.asarray(out, np.float64).reshape(6, 48), ref, bound)


def test_matmul_fp16_activation():
    rng = np.random.default_rng(8)
    wo = _weights(rng, 32, 64, scale_exp=(-2, 2))
    x = rng.standard_normal((4, 64)).astype(np.float16)
    for backend in ("xla", "pallas"):
        out = matmul(
            jnp.asarray(x), nvfp4_jax.from_oracle(wo), backend=backend, out_dtype=jnp.float32
        )
        ref, bound = _w4a16_ref(x, wo, jnp.float32)
        _assert_within(out, ref, bound)


def _w4a4_case(rng, m, n, k):
    wo = _weights(rng, n, k)
    x = _x(rng, m, k, 4.0)
    input_scale = np.float32(np.abs(np.asarray(x, np.float32)).max() / np.float32(2688))
    g = float(np.float32(1) / input_scale)
    xo = oracle.quantize(np.asarray(x, np.float32), "trtllm", encode_scale=g)
    alpha = float(np.float32(input_scale) * np.float32(wo.decode_scale))
    return wo, x, input_scale, xo, alpha


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_w4a4_vs_oracle(backend, out_dtype):
    rng = np.random.default_rng(11)
    wo, x, input_scale, xo, alpha = _w4a4_case(rng, 9, 40, 208)
    out = matmul(
        jnp.asarray(x),
        nvfp4_jax.from_oracle(wo),
        input_scale=input_scale,
        backend=backend,
        out_dtype=out_dtype,
    )
    ref = oracle.gemm_w4a4(xo, wo, alpha)
    bound = oracle.gemm_error_bound(
        np.abs(oracle.dequantize(xo, include_decode_scale=False)),
        np.abs(oracle.dequantize(wo, include_decode_scale=False)),
        alpha,
        ref,
        out_u=OUT_U[out_dtype],
        splits=8,
    )
    _assert_within(out, ref, bound)


def test_w4a4_activation_codes_match_oracle_trtllm():
    """The on-the-fly activation quantization is byte-identical to oracle 'trtllm'."""
    rng = np.random.default_rng(12)
    _, x, input_scale, xo, _ = _w4a4_case(rng, 33, 16, 256)
    xq = nvfp4_jax.quantize(jnp.asarray(x), "trtllm", encode_scale=jnp.float32(1) / input_scale)
    np.testing.assert_array_equal(np.asarray(xq.codes), xo.codes)
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(xq.scales, jnp.uint8)), xo.scales
    )


def test_w4a4_prequantized_activation():
    rng = np.random.default_rng(13)
    wo, _, _, xo, _ = _w4a4_case(rng, 4, 24, 64)
    xa = nvfp4_jax.from_oracle(xo)
    alpha = float(np.float32(np.float32(xo.decode_scale) * np.float32(wo.decode_scale)))
    out = matmul(xa, nvfp4_jax.from_oracle(wo), backend="pallas", out_dtype=jnp.float32)
    ref = oracle.gemm_w4a4(xo, wo, alpha)
    bound = oracle.gemm_error_bound(
        np.abs(oracle.dequantize(xo, include_decode_scale=False)),
        np.abs(oracle.dequantize(wo, include_decode_scale=False)),
        alpha,
        ref,
        out_u=2.0**-24,
    )
    _assert_within(out, ref, bound)


def test_swizzled_weight_is_unswizzled(caplog):
    rng = np.random.default_rng(14)
    wo = _weights(rng, 40, 64)
    x = _x(rng, 3, 64)
    lin = matmul(jnp.asarray(x), nvfp4_jax.from_oracle(wo), backend="xla")
    with caplog.at_level("WARNING", logger="nvfp4_jax.gemm.api"):
        swz = matmul(jnp.asarray(x), nvfp4_jax.from_oracle(wo, layout="swizzled_128x4"), backend="xla")
    assert "converted to linear on every call" in caplog.text  # the per-call cost is said
    np.testing.assert_array_equal(np.asarray(lin), np.asarray(swz))


def test_jit_and_auto_backend_on_cpu(caplog):
    rng = np.random.default_rng(15)
    wo = _weights(rng, 32, 32)
    w = nvfp4_jax.from_oracle(wo)
    x = jnp.asarray(_x(rng, 2, 32))
    with caplog.at_level("INFO", logger="nvfp4_jax.gemm.api"):
        out = jax.jit(lambda x, w: matmul(x, w))(x, w)
    assert "backend auto -> xla" in caplog.text
    ref, bound = _w4a16_ref(np.asarray(x), wo, jnp.bfloat16)
    _assert_within(out, ref, bound)


def test_errors_name_the_argument():
    rng = np.random.default_rng(16)
    w = nvfp4_jax.from_oracle(_weights(rng, 16, 64))
    x = jnp.zeros((2, 64), jnp.bfloat16) + 1
    with pytest.raises(ValueError, match="x: K mismatch"):
        matmul(jnp.zeros((2, 48), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="x: expected bfloat16 or float16"):
        matmul(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match="w: expected an NVFP4Array"):
        matmul(x, jnp.zeros((16, 64)))
    with pytest.raises(ValueError, match="backend"):
        matmul(x, w, backend="cuda")
    with pytest.raises(ValueError, match="input_scale"):
        matmul(x, w, input_scale=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match="out_dtype"):
        matmul(x, w, out_dtype=jnp.int8)
    bad = nvfp4_jax.NVFP4Array(w.codes[:, :4], w.scales[:, :1], w.decode_scale, (16, 8), "linear")
    with pytest.raises(ValueError, match="w: K must be a multiple of 16"):
        matmul(jnp.zeros((2, 8), jnp.bfloat16), bad)
    with pytest.raises(ValueError, match="Config.block_k"):
        Config(block_k=48)


def test_nan_input_never_passes_bound():
    """A NaN in x must make the comparison fail (guards the test helper itself)."""
    rng = np.random.default_rng(17)
    wo = _weights(rng, 16, 32)
    x = _x(rng, 2, 32)
    x[0, 0] = np.nan  # traced: a concrete NaN x raises (docs/input-policy.md)
    out = jax.jit(lambda v: matmul(v, nvfp4_jax.from_oracle(wo), backend="xla"))(jnp.asarray(x))
    ref, bound = _w4a16_ref(np.nan_to_num(np.asarray(x, np.float32)), wo, jnp.bfloat16)
    with pytest.raises(AssertionError):
        _assert_within(out, ref, bound)


def test_poisoned_output_is_fully_written_interpret():
    rng = np.random.default_rng(18)
    wo = _weights(rng, 40, 80)
    x = _x(rng, 19, 80)
    for cfg in (
        Config(block_m=16, block_n=16, block_k=32, decode="bits"),
        Config(block_m=16, block_n=32, block_k=32, split_k=2, decode="bits"),
    ):
        out = matmul_pallas(
            jnp.asarray(x),
            jnp.asarray(wo.codes),
            jnp.asarray(wo.scales),
            np.float32(wo.decode_scale),
            out_dtype=jnp.float32,
            config=cfg,
            interpret=True,
            poison=True,
        )
        ref, bound = _w4a16_ref(x, wo, jnp.float32, splits=cfg.split_k)
        _assert_within(out, ref, bound)
