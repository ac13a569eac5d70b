"""GPU: oracle-exact in a process WITHOUT ``XLA_FLAGS`` (XLA's fp32 division is then
``div.full.f32``): ``quantize`` (every JAX recipe), the GEMM ``pallas`` and ``xla`` backends
(W4A16, W4A4) and the MoE's Pallas-Triton and XLA paths, at a few shapes with E4M3-subnormal
block scales.

Run without the flag (bench/run_gpu.sh step ``tests``), the tests check that configuration
directly. Run with it (step ``tests_ieee``), they check the flagged configuration, and
``test_every_check_passes_without_xla_flags`` also runs them in a child process with
``XLA_FLAGS`` removed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_jax as nj
import oracle
from nvfp4_jax.testing.assertions import assert_gemm_close, assert_moe_close
from oracle.formats import bf16_round, f32

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHILD = "NVFP4_JAX_NO_FLAGS_CHILD"

if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU", allow_module_level=True)


def test_every_check_passes_without_xla_flags():
    if os.environ.get(_CHILD):
        pytest.skip("the child process itself")
    if "nvptx-prec-divf32" not in os.environ.get("XLA_FLAGS", ""):
        pytest.skip("this process has no division flag: the tests below check that directly")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[_CHILD] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", __file__,
           "-k", "not test_every_check_passes_without_xla_flags"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
                       check=False)
    tail = p.stdout[-6000:] + p.stderr[-3000:]
    assert p.returncode == 0, tail
    assert " passed" in p.stdout and " failed" not in p.stdout, tail


def test_the_child_has_no_division_flag():
    if os.environ.get(_CHILD):
        assert "nvptx-prec-divf32" not in os.environ.get("XLA_FLAGS", "")


def _x(seed: int, m: int, k: int, lo: float = -40.0, hi: float = 10.0):
    """bf16 values whose 16-value blocks span 2^lo..2^hi: E4M3-subnormal block scales, some
    zero, some saturating."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(lo, hi, (m, k // 16, 1))).repeat(16, -1).reshape(m, k)
    return bf16_round(rng.standard_normal((m, k)) * mag)


@pytest.mark.parametrize("recipe", nj.JAX_RECIPES)
def test_quantize_is_the_oracle(recipe):
    f = jax.jit(lambda v, d: nj.quantize(v, recipe, decode_scale=d))
    g = jax.jit(lambda v: nj.quantize(v, recipe))  # global scale from max|x| (a division too)
    for seed, (m, k) in enumerate([(256, 512), (33, 4096), (1, 16), (300, 1040)]):
        x = _x(seed, m, k)
        d = float(f32(np.abs(x).max() / 2688 * np.exp2(np.random.default_rng(seed).uniform(-3, 3))))
        for got, want in ((f(jnp.asarray(x, jnp.float32), jnp.float32(d)),
                           oracle.quantize(x, recipe, decode_scale=d)),
                          (g(jnp.asarray(x, jnp.bfloat16)), oracle.quantize(x, recipe))):
            got = nj.to_oracle(got)
            np.testing.assert_array_equal(got.scales, want.scales,
                                          err_msg=f"{recipe} {m}x{k} scales")
            np.testing.assert_array_equal(got.codes, want.codes, err_msg=f"{recipe} {m}x{k} codes")
            assert float(got.decode_scale) == float(want.decode_scale)


def _weight(seed: int, n: int, k: int, scale_factor: float):
    w = bf16_round(np.random.default_rng(seed).standard_normal((n, k)) / np.sqrt(k))
    d = float(f32(np.abs(w).max() / 2688 * scale_factor))
    return oracle.quantize(w, "modelopt", decode_scale=d)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("m,n,k,scale_factor", [(1, 256, 512, 1.0), (16, 1024, 2048, 2.0**15),
                                                 (300, 256, 1040, 1.0), (5, 512, 4096, 2.0**15)])
def test_matmul_is_the_oracle(backend, m, n, k, scale_factor):
    """W4A16 within the oracle's derived bound; W4A4's activation codes the oracle's: the W4A4
    output equals, bit for bit, the same backend's W4A16 output on the oracle's quantized
    activation (same kernel, same alpha), and is within the bound."""
    x = _x(m + n, m, k, -12.0, 4.0)
    wo = _weight(k, n, k, scale_factor)
    w = nj.from_oracle(wo)
    out16 = nj.matmul(jnp.asarray(x, jnp.bfloat16), w, backend=backend)
    assert_gemm_close(np.asarray(out16, np.float32), x, wo, label=f"{backend} W4A16")

    s = float(f32(np.abs(x).max() / 2688))
    out4 = np.asarray(nj.matmul(jnp.asarray(x, jnp.bfloat16), w, input_scale=jnp.float32(s),
                                backend=backend), np.float32)
    assert_gemm_close(out4, x, wo, input_scale=s, label=f"{backend} W4A4")
    xq = oracle.dequantize(oracle.quantize(x, "trtllm", encode_scale=float(f32(1.0 / s))),
                           include_decode_scale=False)
    alpha = float(f32(s * float(wo.decode_scale)))
    w_alpha = nj.NVFP4Array.from_parts(w.codes, w.scales, jnp.float32(alpha))
    ref = np.asarray(nj.matmul(jnp.asarray(xq, jnp.bfloat16), w_alpha, backend=backend), np.float32)
    np.testing.assert_array_equal(out4, ref,
                                  err_msg=f"{backend} W4A4 vs W4A16 on the oracle's codes")


def _moe_case(seed, *, t, h, inter, e, k, activation, scale_factor):
    rng = np.random.default_rng(seed)
    r = 2 * inter if activation == "swiglu" else inter
    hidden = bf16_round(rng.standard_normal((t, h)))

    def stack(n, kk):
        w = bf16_round(rng.standard_normal((e, n, kk)) / np.sqrt(kk))
        parts = [oracle.quantize(we, "modelopt", decode_scale=float(
            f32(np.abs(we).max() / 2688 * scale_factor))) for we in w]
        return oracle.NVFP4(np.stack([p.codes for p in parts]), np.stack([p.scales for p in parts]),
                            np.array([float(p.decode_scale) for p in parts]))

    fc1, fc2 = stack(r, h), stack(h, inter)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    wts = f32(rng.random((t, k)) + 0.1)
    wts = f32(wts / wts.sum(1, keepdims=True))
    s1 = f32(np.abs(hidden).max() * rng.uniform(0.7, 1.3, e) / 2688)
    u = np.einsum("th,erh->ter", hidden, oracle.dequantize(fc1))
    hf = importlib.import_module("oracle.moe").activate(u, activation)
    s2 = f32(max(float(np.abs(hf).max()), 1e-3) * rng.uniform(0.7, 1.3, e) / 2688)
    return hidden, ids, wts, fc1, fc2, s1, s2


def _moe_paths():
    """(label, kwargs of nvfp4_jax.moe) for the Pallas-Triton and XLA MoE."""
    return [("pallas-triton", {"backend": "pallas"}), ("xla", {"backend": "xla"})]


@pytest.mark.parametrize("path", _moe_paths(), ids=lambda p: p[0])
@pytest.mark.parametrize("mode,shape", [
    ("trtllm_cutlass", {"t": 5, "h": 256, "inter": 256, "e": 8, "k": 2, "activation": "relu2",
                        "scale_factor": 1.0}),  # the layer of issue 28's measurement
    ("b12x", {"t": 5, "h": 256, "inter": 256, "e": 8, "k": 2, "activation": "relu2",
              "scale_factor": 1.0}),
    ("trtllm_cutlass", {"t": 9, "h": 512, "inter": 1024, "e": 8, "k": 2, "activation": "relu2",
                        "scale_factor": 2.0**15}),  # E4M3-subnormal weight block scales
    ("b12x", {"t": 3, "h": 768, "inter": 512, "e": 8, "k": 3, "activation": "swiglu",
              "scale_factor": 2.0**15}),
    ("trtllm_cutlass", {"t": 37, "h": 1024, "inter": 2688, "e": 16, "k": 6, "activation": "relu2",
                        "scale_factor": 1.0}),
])
def test_moe_is_the_oracle(path, mode, shape):
    """Within the oracle's derived interval with zero slack in the activation quantization:
    a code flipped by an inexact division (FC1 or FC2 input) leaves it."""
    label, kw = path
    shape = dict(shape)
    activation, sf = shape.pop("activation"), shape.pop("scale_factor")
    case = _moe_case(sum(shape.values()), activation=activation, scale_factor=sf, **shape)
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    out = nj.moe(jnp.asarray(hidden, jnp.bfloat16), fc1=nj.from_oracle(fc1),
                 fc2=nj.from_oracle(fc2), fc1_input_scale=jnp.asarray(s1),
                 fc2_input_scale=jnp.asarray(s2), topk_ids=jnp.asarray(ids),
                 topk_weights=jnp.asarray(wts), activation=activation, mode=mode, **kw)
    out = np.asarray(out, np.float32)
    b = assert_moe_close(out, *case, activation=activation, mode=mode, quant_slack=0.0,
                         label=f"moe {label} {mode} {activation}")
    print(label, mode, shape, "bit-identical to the oracle:", float(np.mean(out == b.ref)))
