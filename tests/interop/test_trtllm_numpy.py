"""The numpy re-enactment of TensorRT-LLM (``interop.trtllm``) against its torch form, under
live torch.

``nvfp4 audit`` runs ``interop.trtllm`` (numpy + ml_dtypes) so that it needs no torch. These
tests run both forms on the same inputs and require identical bytes and values, including the
E4M3 overflow, where torch's cast and ml_dtypes' differ: torch >= 2.12 (pytorch PR #178817;
torch 2.13 here) saturates at 448, ml_dtypes returns NaN. TensorRT-LLM's ``transform_weights``
casts with ``.to(torch.float8_e4m3fn)`` and no clamp, so the fold is checked against exactly
that torch line. The last test imports the audit path with torch blocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import oracle
from nvfp4_jax.interop import trtllm as N

torch = pytest.importorskip("torch")
from nvfp4_jax.interop import trtllm_torch as T  # noqa: E402

TORCH_SATURATES = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torch_fold(scale_bytes: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """TensorRT-LLM's two lines (@02320c35 ``transform_weights``), verbatim in torch: no clamp."""
    sf = torch.from_numpy(scale_bytes.copy()).view(torch.float8_e4m3fn).float()
    b = torch.from_numpy(ws.astype(np.float32)).view(-1, *([1] * (sf.dim() - 1)))
    return (sf * b).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_fold_equals_torch_on_every_byte_including_overflow():
    if not TORCH_SATURATES:
        pytest.skip(f"torch {torch.__version__} < 2.12 does not saturate its E4M3 cast")
    ws = np.array([2.0**-9, 1.9e-5, 3.7e-5, 0.013, 1.0, 1.04, 1.0357, 1.2, 3.0, 500.0], np.float32)
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8), (ws.size, 2, 256)).copy()
    want = _torch_fold(scales, ws)
    got = N.fold_block_scales(scales, ws)
    np.testing.assert_array_equal(got, want)
    exact = oracle.e4m3_decode(scales) * ws[:, None, None]
    over = (exact > 464) & ~np.isnan(exact)
    assert over.sum() > 100 and np.all(got[over] == 0x7E)  # saturated, as torch 2.13 does
    # the torch < 2.12 behaviour (NaN from 464 up) is the other option, not the default
    assert np.all(N.fold_block_scales(scales, ws, saturate=False)[over] & 0x7F == 0x7F)
    # and the torch form the audit used before agrees
    t_old = T.fold_block_scales(torch.from_numpy(scales).view(torch.float8_e4m3fn),
                                torch.from_numpy(ws))
    np.testing.assert_array_equal(t_old.view(torch.uint8).numpy(), got)


def _blocks(seed: int, m: int, k: int) -> np.ndarray:
    """bf16 rows whose 16-value blocks span 12 decades: subnormal, underflowing and huge scales."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-8, 4, (m, k // 16, 1))
    x = (rng.standard_normal((m, k // 16, 16)) * mag).reshape(m, k)
    x[0, :16] = 0.0
    return oracle.bf16_round(x).astype(np.float32)


@pytest.mark.parametrize("fast_math", [True, False])
@pytest.mark.parametrize("g", [1.0, 2688.0 / 3.0, 1e-3, 3e5])
def test_quantize_equals_torch(fast_math, g):
    x = _blocks(int(g) % 97, 33, 256)
    xt = torch.from_numpy(x).to(torch.bfloat16)
    q_t, s_t = T.fp4_quantize(xt, g, fast_math=fast_math)
    q_n, s_n = N.fp4_quantize(x, g, fast_math=fast_math)
    np.testing.assert_array_equal(q_n, q_t.numpy())
    np.testing.assert_array_equal(s_n, s_t.view(torch.uint8).numpy())
    _, sw_t = T.fp4_quantize(xt, g, fast_math=fast_math, sf_layout="swizzled_128x4")
    _, sw_n = N.fp4_quantize(x, g, fast_math=fast_math, sf_layout="swizzled_128x4")
    np.testing.assert_array_equal(sw_n, sw_t.numpy())


def test_gemm_equals_torch():
    x, w = _blocks(1, 17, 512), _blocks(2, 40, 512)
    aq, asf = N.fp4_quantize(x, 7.0, fast_math=False)
    wq, wsf = N.fp4_quantize(w, 0.5, fast_math=False)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    for dt, tdt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        want = T.nvfp4_gemm(t(aq), t(wq), t(asf), t(wsf), 1.7e-3, out_dtype=tdt)
        want = want.to(torch.float64).numpy()
        got = N.nvfp4_gemm(aq, wq, asf, wsf, 1.7e-3, dt).astype(np.float64)
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def moe_case():
    """A small layer, top-22 of 24 experts as the default audit layer routes (the fp32 sum over
    22 routes is where a reduction order would show)."""
    from moe_cases import make_case

    return lambda seed, activation, tokens: make_case(
        np.random.default_rng(seed), t=tokens, h=64, inter=32, e=24, k=22, activation=activation)


@pytest.mark.parametrize("pipeline", N.PIPELINES)
def test_moe_pipelines_equal_torch_relu2(moe_case, pipeline):
    case = moe_case(seed=5, activation="relu2", tokens=9)
    want = T.run_pipeline(pipeline, *case, activation="relu2")
    got = N.run_pipeline(pipeline, *case, activation="relu2")
    np.testing.assert_array_equal(got, want)
    rt_t, rt_n = (M.moe_weights(pipeline, *case[3:], activation="relu2") for M in (T, N))
    np.testing.assert_array_equal(rt_n.fc1_scales, rt_t.fc1_scales.view(torch.uint8).numpy())
    np.testing.assert_array_equal(rt_n.fc2_alpha, rt_t.fc2_alpha.numpy())


def test_moe_swiglu_within_one_silu_ulp_of_torch(moe_case):
    """torch's fp32 silu and the re-enactment's (float64, rounded once) differ by at most an fp32
    ulp; after the bf16 rounding of h that moves at most a few outputs by one bf16 step."""
    case = moe_case(seed=6, activation="swiglu", tokens=9)
    want = T.run_pipeline("trtllm_cutlass", *case, activation="swiglu")
    got = N.run_pipeline("trtllm_cutlass", *case, activation="swiglu")
    diff = got != want
    assert diff.mean() < 0.01, diff.mean()
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=1e-6 * np.abs(want).max())


def test_cutedsl_b12x_dispatch_follows_m():
    assert N.cutedsl_b12x_path(63) == "b12x" and N.cutedsl_b12x_path(64) == "cutlass"


def test_audit_path_imports_no_torch():
    """``nvfp4 audit`` on the default layer (1 expert, T = 1) with torch, hypothesis and
    matplotlib blocked: runs, prints the table, and leaves none of them imported."""
    code = textwrap.dedent("""
        import sys
        for name in ("torch", "hypothesis", "matplotlib"):
            sys.modules[name] = None
        from nvfp4_jax.cli import main
        rc = main(["audit", "--experts", "1", "--top-k", "1", "--tokens", "1", "--no-progress"])
        loaded = [m for m in ("torch", "hypothesis", "matplotlib")
                  if sys.modules.get(m) is not None]
        print("RC", rc, "LOADED", loaded)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RC 0 LOADED []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "TRT-LLM CUTEDSL-b12x" in r.stdout and "m >= 64" in r.stdout
