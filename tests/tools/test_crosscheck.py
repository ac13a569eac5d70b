"""``nvfp4_jax.crosscheck`` / ``nvfp4 crosscheck``: every backend against the oracle, and a
broken backend is reported as FAIL with its fault explained."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nvfp4_jax import crosscheck, explain
from nvfp4_jax.cli import main

CPU_BACKENDS = ("jax", "jax_xla", "jax_pallas", "trtllm_reenacted", "trtllm_reenacted_fast")


def test_generated_cases_reach_e4m3_subnormal_scales():
    subnormal = 0
    for i in range(len(crosscheck.MAGNITUDES)):
        c = crosscheck.make_case(i, magnitude=i)
        s = c.weight.scales
        subnormal += int(((s & 0x78) == 0).sum())  # exponent field 0: subnormal or zero
        assert c.mode == "w4a4" and c.weight_sf_layout == "swizzled_128x4"
    assert subnormal > 0


def test_every_cpu_backend_passes():
    pytest.importorskip("torch")
    res = crosscheck.run(cases=2, backends=CPU_BACKENDS)
    ran = {(r.op, r.backend) for r in res if r.status != "SKIP"}
    assert ("quantize", "jax") in ran and ("gemm_w4a4", "jax_pallas") in ran
    assert ("gemm_w4a4", "trtllm_reenacted") in ran and ("gemm_w4a16", "jax_xla") in ran
    assert all(r.status == "PASS" for r in res if r.status != "SKIP"), crosscheck.format_table(res)
    skipped = [r for r in res if r.status == "SKIP"]
    assert all(r.detail for r in skipped)  # every skip says why
    assert {r.backend for r in skipped} <= {"trtllm_reenacted"}  # W4A16 is not TensorRT-LLM's op


def test_moe_backends_pass_inside_the_oracles_interval():
    pytest.importorskip("torch")
    res = crosscheck.run(cases=1, ops=("moe",), backends=("jax_xla", "jax_pallas", "trtllm_reenacted"))
    assert {(r.op, r.backend, r.status) for r in res} == {
        (f"moe_{a}", b, "PASS") for a in ("relu2", "swiglu") for b in ("jax_xla", "jax_pallas", "trtllm_reenacted")}


def test_a_broken_moe_backend_fails(monkeypatch):
    real = crosscheck._moe

    def broken(backend, case):  # one token's output one bf16 ulp off in one column
        out = real(backend, case)
        out[2, 7] = float(np.nextafter(np.float32(out[2, 7]), np.float32(np.inf))) + abs(out[2, 7]) * 2.0**-7
        return out

    monkeypatch.setattr(crosscheck, "_moe", broken)
    res = crosscheck.run(cases=1, ops=("moe",), backends=("jax_xla",))
    assert [r.status for r in res] == ["FAIL", "FAIL"]
    assert all("1 of 1280 outputs outside" in r.detail and "worst [2, 7]" in r.detail for r in res)


def test_backends_that_cannot_run_here_skip_with_their_reason():
    res = crosscheck.run(cases=1, backends=("jax_mosaic", "trtllm_live"))
    assert {r.status for r in res} == {"SKIP"}
    mosaic = [r for r in res if r.backend == "jax_mosaic"]
    assert all("sm_90" in r.detail for r in mosaic)


def test_a_broken_gemm_backend_fails_with_its_fault_explained(monkeypatch, capsys):
    real = crosscheck._gemm

    def broken(backend, case):  # the XLA backend loses weight_scale_2 from its alpha
        out = real(backend, case)
        return out / case.weight_scale_2 if backend == "jax_xla" else out

    monkeypatch.setattr(crosscheck, "_gemm", broken)
    res = crosscheck.run(cases=1, backends=("jax_xla", "jax_pallas"))
    bad = [r for r in res if r.status == "FAIL"]
    assert {(r.op, r.backend) for r in bad} == {("gemm_w4a4", "jax_xla"), ("gemm_w4a16", "jax_xla")}
    assert all("weight_scale_2 missing from alpha" in r.detail for r in bad)
    assert main(["crosscheck", "--cases", "1", "--backends", "jax_xla"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_broken_quantizer_fails_byte_for_byte(monkeypatch):
    real = crosscheck._quantize

    def broken(backend, x, encode):
        codes, scales, recipe = real(backend, x, encode)
        scales = scales.copy()
        scales[0, 0] ^= 1  # one scale byte off by one ulp
        return codes, scales, recipe

    monkeypatch.setattr(crosscheck, "_quantize", broken)
    [r] = crosscheck.run(cases=1, backends=("jax",))
    assert r.status == "FAIL" and "1 of 512 scale bytes differ" in r.detail


def test_cli_json_and_inputs(tmp_path, capsys):
    path = str(tmp_path / "call.npz")
    case = crosscheck.make_case(5, m=4, n=128, k=256)
    explain.save_npz(path, case)
    out = str(tmp_path / "cc.json")
    assert main(["crosscheck", "--inputs", path, "--backends", "jax,jax_xla", "--json", out]) == 0
    with open(out) as f:
        rows = json.load(f)
    assert [(r["op"], r["backend"], r["status"]) for r in rows] == [
        ("quantize", "jax", "PASS"), ("gemm_w4a4", "jax_xla", "PASS"), ("gemm_w4a16", "jax_xla", "PASS")]
    assert "3 passed, 0 failed, 0 skipped" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["crosscheck", "--backends", "cublas"], "unknown ['cublas']"),
    (["crosscheck", "--k", "100"], "--k a positive multiple of 16"),
    (["crosscheck", "--inputs", "nope.npz"], "nope.npz"),
    (["crosscheck", "--ops", "gemm,conv"], "--ops: unknown ['conv']"),
])
def test_cli_errors_name_the_argument(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_w4a16_input_file_is_refused_with_the_reason(tmp_path, capsys):
    case = crosscheck.make_case(1, m=2, n=128, k=256)
    path = str(tmp_path / "w16.npz")
    np.savez(path, x=case.x, weight_fp4=case.weight.codes, weight_sf=case.weight.scales,
             weight_scale_2=np.float32(case.weight_scale_2))
    assert main(["crosscheck", "--inputs", path]) == 2
    assert "W4A4 linear-layer case" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_kernels_pass_the_crosscheck():
    """On an NVIDIA GPU: the compiled Pallas-Triton kernel (and on sm_90 the Mosaic kernel) at
    a realistic K, every generated magnitude, W4A4 and W4A16: run (not skipped) and PASS."""
    from nvfp4_jax.device import gpu_compute_capability

    cc = gpu_compute_capability()
    if cc is None:
        pytest.skip("needs an NVIDIA GPU")
    res = []
    for m, cases in ((1, 2), (5, 2), (16, len(crosscheck.MAGNITUDES)), (64, 2)):  # token tiles 8..64
        res += crosscheck.run(cases=cases, seed=m, m=m, n=1024, k=2048,
                              backends=("jax", "jax_xla", "jax_pallas", "jax_mosaic"),
                              ops=("quantize", "gemm", "moe") if m == 16 else ("quantize", "gemm"))
    print(crosscheck.format_table(res))
    ran = {(r.op, r.backend) for r in res if r.status == "PASS"}
    assert {("gemm_w4a4", "jax_pallas"), ("gemm_w4a16", "jax_pallas")} <= ran
    assert {("moe_relu2", "jax_pallas"), ("moe_swiglu", "jax_pallas")} <= ran
    if cc == 90:
        assert {("gemm_w4a4", "jax_mosaic"), ("gemm_w4a16", "jax_mosaic"), ("moe_swiglu", "jax_mosaic")} <= ran
    assert not [r for r in res if r.status == "FAIL"], crosscheck.format_table(res)
    assert all("interpret" not in r.detail for r in res)


@pytest.mark.gpu
def test_gpu_w4a4_kernels_are_exact_without_the_xla_division_flag():
    """In a process without ``-nvptx-prec-divf32=2`` (XLA's fp32 division is then div.full.f32):
    every row passes (the operand kernel divides with div.rn.f32, the XLA quantizer with
    ``division.divide``)."""
    import os
    import subprocess
    import sys

    from nvfp4_jax.device import gpu_compute_capability

    if gpu_compute_capability() is None:
        pytest.skip("needs an NVIDIA GPU")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "nvfp4_jax.cli", "crosscheck", "--m", "16", "--n", "1024", "--k", "2048",
           "--backends", "jax,jax_pallas,jax_mosaic"]  # all ops: quantize, gemm and the MoE layer
    p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    print(p.stdout)
    rows = [line.split() for line in p.stdout.splitlines() if line[:4].strip().isdigit()]
    gemm = [r for r in rows if r[1].startswith(("gemm", "moe"))]
    assert any(r[1].startswith("moe") and r[2] == "jax_mosaic" for r in gemm)
    assert gemm and all(r[3] in ("PASS", "SKIP") for r in gemm), p.stdout + p.stderr
    assert any(r[2] == "jax_pallas" and r[3] == "PASS" for r in gemm)
    assert all(r[3] in ("PASS", "SKIP") for r in rows if r[1] == "quantize"), p.stdout
