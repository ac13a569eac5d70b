"""The SM12x proxy tooling in bench/: the proxy rows gemm_bench and moe_bench measure, the
proxy table, the result header, the SASS main-loop count of sm12x_compile, and the arithmetic
of sm12x_model (roofline cases worked out by hand here)."""

from __future__ import annotations

import math
import os
import sys

import pytest
from bench_modules import ROOT, fresh

# --------------------------------------------------------------------------- sm12x_model


def test_model_decode_roofline_by_hand():
    """RTX 5060 Ti, 4096 x 4096 NVFP4 weight, one token: DRAM-bound.
    bytes = 4096*4096*0.5625 + 2*4096 (x) + 2*4096 (out) = 9,453,568;
    448 GB/s * 0.9 = 403.2 GB/s -> 23.446 us."""
    sm = fresh("sm12x_model")
    gpu = sm.GPUS["rtx_5060_ti"]
    parts = sm.fused_gemm(gpu, 1, 4096, 4096, block_m=16, ipw=None)
    t, lim = sm.combine(parts)
    assert parts["bytes"] == 9_453_568
    assert lim == "DRAM"
    assert t * 1e6 == pytest.approx(9_453_568 / 403.2e3, rel=1e-12)
    # the MMA ceiling: 16 padded tokens, 36 SMs x 2.572 GHz x 512 FLOP/clk = 47.41 TFLOP/s
    assert parts["t_mma"] * 1e6 == pytest.approx(2 * 16 * 4096 * 4096 / (36 * 2.572e3 * 512))


def test_model_prefill_is_mma_bound_by_hand():
    """RTX 5090, 4096^3 through the bf16 MMA: 2*4096^3 FLOP over 170 x 2.407 GHz x 512 FLOP/clk
    (209.5 TFLOP/s) = 656 us, far above the 47 us of its 76.5 MB."""
    sm = fresh("sm12x_model")
    gpu = sm.GPUS["rtx_5090"]
    parts = sm.fused_gemm(gpu, 4096, 4096, 4096, block_m=128, ipw=None)
    t, lim = sm.combine(parts)
    assert lim == "MMA"
    assert t * 1e6 == pytest.approx(2 * 4096**3 / (170 * 2.407e9 * 512) * 1e6, rel=1e-12)
    assert 650 < t * 1e6 < 660
    assert parts["t_mem"] * 1e6 == pytest.approx(
        (4096 * 4096 * 0.5625 + 2 * 4096 * 4096 * 2) / (1792e9 * 0.9) * 1e6)
    # the FP4 MMA path: 1676 TFLOP/s dense (3352 sparse / 2)
    t4, _ = sm.combine(sm.fused_gemm(gpu, 4096, 4096, 4096, block_m=8, ipw=None, mma="fp4"))
    assert t4 * 1e6 == pytest.approx(2 * 4096**3 / 1676e12 * 1e6, rel=1e-12)


def test_model_issue_ceiling_by_hand():
    """DGX Spark: 48 SMs x 4 warp-instr/clk x 2.52 GHz = 483.84 G warp-instr/s. A loop of 2
    warp-instructions per weight over 4096 x 4096 weights (one token tile): 69.35 us, above
    the 38.5 us of its bytes; the budget at 90 % of 273 GB/s is 1.108 per weight."""
    sm = fresh("sm12x_model")
    gpu = sm.GPUS["dgx_spark_gb10"]
    parts = sm.fused_gemm(gpu, 1, 4096, 4096, block_m=16, ipw=2.0)
    t, lim = sm.combine(parts)
    assert lim == "issue"
    assert t * 1e6 == pytest.approx(4096 * 4096 * 2.0 / 483.84e3, rel=1e-12)
    assert sm.issue_budget_per_weight(gpu) == pytest.approx(483.84e9 / (273e9 * 0.9 / 0.5625))
    # two token tiles issue the loop twice
    p2 = sm.fused_gemm(gpu, 17, 4096, 4096, block_m=16, ipw=2.0)
    assert p2["t_issue"] == pytest.approx(2 * parts["t_issue"])


def test_model_bf16_baseline_and_touched_experts():
    sm = fresh("sm12x_model")
    gpu = sm.GPUS["rtx_5090"]
    # decode: 2 B/weight streamed -> the NVFP4 roofline is 2 / 0.5625 = 3.56x faster
    ratio = sm.bf16_gemm(gpu, 1, 28672, 8192) / sm.combine(
        sm.fused_gemm(gpu, 1, 28672, 8192, block_m=16, ipw=None))[0]
    assert ratio == pytest.approx(3.555, abs=0.01)
    assert sm.touched_experts(8, 2, 0) == 0
    assert sm.touched_experts(8, 2, 1) == pytest.approx(2.0)
    assert sm.touched_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert sm.touched_experts(128, 8, 10_000) == pytest.approx(128.0)


def test_model_document_labels_every_row_a_prediction():
    sm = fresh("sm12x_model")
    doc = sm.build(os.path.join(ROOT, "bench", "results"))
    assert doc["label"] == "prediction"
    gpus = {"rtx_5090", "rtx_5060_ti", "dgx_spark_gb10"}
    assert {r["gpu"] for r in doc["gemm"]} == gpus == {r["gpu"] for r in doc["moe"]}
    assert len(doc["gemm"]) == len(sm.GEMM_SHAPES) * len(sm.GEMM_MS) * 3
    for r in doc["gemm"] + doc["moe"]:
        assert r["label"] == "prediction"
        assert math.isfinite(r["predicted_us"]) and r["predicted_us"] > 0
        assert 0 < r["predicted_dram_fraction"] <= 1.0 + 1e-9
    for g in gpus:
        assert doc["gpus"][g]["sources"]
    assert all(a["source"] for a in doc["assumptions"])
    assert "All numbers are predictions" in sm.table(doc)


# --------------------------------------------------------------------------- sm12x_compile

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x0 */
        /*0010*/                   BRA 0x70 ;                                   /* 0x0 */
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;                    /* 0x0 */
        /*0030*/                   IADD3 R3, R3, 0x1, RZ ;                    /* 0x0 */
        /*0040*/                   IADD3 R4, R4, 0x1, RZ ;                    /* 0x0 */
        /*0050*/                   ISETP.NE.AND P0, PT, R2, R5, PT ;          /* 0x0 */
        /*0060*/              @P0 BRA 0x20 &wr=0x1 ?trans6;                  /* 0x0 */
{label}        /*0070*/                   LDG.E R4, desc[UR4][R2.64] ;               /* 0x0 */
        /*0080*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;        /* 0x0 */
        /*0090*/                   LOP3.LUT R5, R4, 0xf, RZ, 0xc0, !PT ;       /* 0x0 */
        /*00a0*/              @!P1 BRA {target} ;                           /* 0x0 */
        /*00b0*/                   EXIT ;                                       /* 0x0 */
        /*00c0*/                   BRA 0xc0;                                    /* 0x0 */
"""


@pytest.mark.parametrize("label,target", [("", "0x70"), (".L_x_1:\n", "`(.L_x_1)")])
def test_main_loop_is_the_backward_branch_around_the_mma(label, target):
    """Of the two loops (0x20..0x60: 5 instructions, no MMA; 0x70..0xa0: 4 with an HMMA) the
    main loop is the one with the MMA; forward branches and the trailing self-branch are not
    loops. Branch targets as addresses (cuobjdump 12.x) or labels."""
    sc = fresh("sm12x_compile")
    loop = sc.main_loop_stats(_SASS.format(label=label, target=target))
    assert loop["n_instructions"] == 4
    assert loop["mma"] == 1 and loop["global_loads"] == 1
    assert loop["opcodes"] == {"LDG": 1, "HMMA": 1, "LOP3": 1, "BRA": 1}
    assert sc.main_loop_stats("        /*0000*/  EXIT ;\n") is None


def test_per_weight_counts_the_warps_over_the_weight_tile():
    from nvfp4_jax.gemm.pallas_triton import Config

    sc = fresh("sm12x_compile")
    pw = sc.per_weight({"n_instructions": 616, "mma": 32}, Config(16, 64, 256, 1, 4, 3))
    assert pw["warp_instructions_per_weight"] == 616 * 4 / (64 * 256)
    assert pw["mma_per_weight"] == 32 * 4 / (64 * 256)


# --------------------------------------------------------------------------- benches, table


def test_gemm_proxy_plan_selects_backends_through_the_public_api():
    gb = fresh("gemm_bench")
    rows = gb.plan(gb.PROXY_SHAPES, gb.PROXY_MS, gb.PROXY_IMPLS)
    assert len(rows) == len(gb.PROXY_SHAPES) * len(gb.PROXY_MS) * len(gb.PROXY_IMPLS)
    assert {r["M"] for r in rows} >= {1, 4096}
    want = {"nvfp4_w4a16_pallas": "pallas", "nvfp4_w4a4_pallas": "pallas", "nvfp4_w4a16": "auto"}
    for r in rows:
        assert r.get("backend_requested") == want.get(r["impl"])
    assert gb.impl_backend("nvfp4_w4a4_mosaic") == "mosaic"
    assert set(gb.EXTRA_IMPLS) <= set(gb.ALL_IMPLS)


def test_moe_proxy_plan_and_kernel_selection_in_one_place():
    mb = fresh("moe_bench")
    rows = mb.plan(["nemotron"], [1, 8], ["random", "skewed"], list(mb.PROXY_IMPLS)
                   + ["dequant_ragged_dot"])
    assert not any(r["impl"] == "dequant_ragged_dot" and r["routing"] == "skewed" for r in rows)
    tri = [r for r in rows if r["impl"] == "nvfp4_moe_triton"]
    assert tri and all(r["select"]["backend"] == "pallas" and r["scale_layout"] == "linear"
                       for r in tri)
    assert "nvfp4_moe" in mb.PROXY_IMPLS and "bf16_ragged_dot" in mb.PROXY_IMPLS


def test_proxy_tables_ratios():
    tables = fresh("tables")
    rec = {"N": 4096, "K": 4096, "M": 1}
    doc = {"records": [
        {**rec, "impl": "nvfp4_w4a16_pallas", "median_us": 50.0},
        {**rec, "impl": "nvfp4_w4a16", "median_us": 25.0, "backend": "mosaic"},
        {**rec, "impl": "bf16_dot", "median_us": 100.0},
    ]}
    row = tables.proxy_gemm(doc).splitlines()[2]
    assert row == "| 4096x4096 | 1 | 50.0 | - | 2.00x | 25.0 (mosaic) | 4.00x | 100 |"
    moe = {"records": [
        {"impl": "hbm_copy", "tbps": 4.0},
        {"impl": "nvfp4_moe_triton", "shape": "qwen3_30b", "routing": "random", "T": 8,
         "median_us": 130.0},
        {"impl": "nvfp4_moe", "shape": "qwen3_30b", "routing": "random", "T": 8,
         "median_us": 65.0, "kernel": "mosaic"},
        {"impl": "bf16_ragged_dot", "shape": "qwen3_30b", "routing": "random", "T": 8,
         "median_us": 1300.0},
    ]}
    row = tables.proxy_moe(moe).splitlines()[2]
    assert row == "| qwen3_30b | 8 | 130 | 65.0 (mosaic) | 2.00 | 1300 | 10.0x |"


def test_result_header_carries_date_commit_gpu_and_versions(monkeypatch):
    monkeypatch.setenv("NVFP4_COMMIT", "abc123")
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo")
    meta = fresh("run_meta").run_metadata()
    for key in ("date", "gpu", "compute_capability", "driver", "jax", "jaxlib", "ml_dtypes",
                "python"):
        assert key in meta
    assert meta["commit"] == "abc123" and meta["xla_flags"] == "--xla_foo"
    assert fresh("run_meta").gpu_tag("NVIDIA GeForce RTX 5090") == "rtx-5090"
    assert fresh("run_meta").gpu_tag("NVIDIA H200") == "h200"


def test_model_calibration_scales_by_the_h200_shortfall(tmp_path):
    """A proxy run that measured the Pallas-Triton kernel at twice its H200 roofline (4096 x
    4096, M = 1: 9,453,568 B at 0.9 x 4.8 TB/s = 2.1883 us; no SASS counts here, so no issue
    ceiling) gives every GPU's row calibrated_us = 2 x its prediction (RTX 5060 Ti: 46.89 us)."""
    import json

    sm = fresh("sm12x_model")
    h200_us = 9_453_568 / (4.8e12 * 0.9) * 1e6
    rec = {"impl": "nvfp4_w4a16_pallas", "N": 4096, "K": 4096, "M": 1, "median_us": 2 * h200_us}
    (tmp_path / "gemm-proxy-h200.json").write_text(json.dumps({"records": [rec]}))
    doc = sm.build(str(tmp_path))
    assert doc["calibration_source"] == "gemm-proxy-h200.json"
    rows = {(r["gpu"], r["N"], r["K"], r["M"]): r for r in doc["gemm"]}
    r = rows[("rtx_5060_ti", 4096, 4096, 1)]
    assert r["h200_measured_over_model"] == pytest.approx(2.0)
    assert r["calibrated_us"] == pytest.approx(2 * 9_453_568 / 403.2e3)
    assert rows[("rtx_5060_ti", 4096, 4096, 16)]["calibrated_us"] is None  # not measured


def test_model_takes_the_moe_kernels_own_counts():
    """An MoE grouped GEMM takes the count of its own layer's kernel over a GEMM kernel of the
    same tiles; a GEMM takes the GEMM kernel; tiles nobody compiled take the largest count."""
    sm = fresh("sm12x_model")
    cfg = {"block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 4, "decode": "asm",
           "load2d": True}
    sass = [
        {"kernel": "gemm", "config": cfg, "side": "pip_sm120", "ipw": 0.1, "moe": None},
        {"kernel": "moe_fc1_x", "config": cfg, "side": "pip_sm120", "ipw": 0.3,
         "moe": {"layer": "x", "gemm": "fc1"}},
    ]
    assert sm.ipw_for(sass, cfg, {"layer": "x", "gemm": "fc1"})[0] == 0.3
    assert sm.ipw_for(sass, cfg)[0] == 0.1
    other = {**cfg, "block_n": 32, "block_k": 64}
    ipw, how = sm.ipw_for(sass, other)
    assert ipw == 0.3 and how.startswith("upper bound")


# --------------------------------------------------------------------------- resumed proxy runs


def _results(path, records):
    import json

    path.write_text(json.dumps({"commit": "abc", "records": records}))
    return str(path)


def test_gemm_resume_skips_exactly_the_measured_rows(tmp_path):
    gb, mr = fresh("gemm_bench"), fresh("merge_results")
    assert {256, 1024, 4096} <= set(gb.PROXY_MS)
    old = [{"impl": i, "N": 28672, "K": 8192, "M": m, "median_us": 1.0}
           for i in gb.PROXY_IMPLS for m in (1, 16, 64)]
    old.append({"impl": "bf16_dot", "N": 28672, "K": 8192, "M": 256, "error": "oom"})
    path = _results(tmp_path / "gemm-proxy-h200.json", old)
    skip = mr.measured("gemm", path, "unused")
    assert skip == mr.measured("gemm", str(tmp_path), "gemm-proxy-h200")  # directory form
    rows = gb.plan(gb.PROXY_SHAPES, gb.PROXY_MS, gb.PROXY_IMPLS, skip)
    keys = {(r["impl"], r["N"], r["K"], r["M"]) for r in rows}
    assert len(rows) == len(gb.PROXY_SHAPES) * len(gb.PROXY_MS) * len(gb.PROXY_IMPLS) - 12
    assert not keys & skip
    assert ("bf16_dot", 28672, 8192, 256) in keys  # an error is no measurement: run again
    assert {r["M"] for r in rows if r["N"] == 28672} == {256, 1024, 4096}
    with pytest.raises(SystemExit, match="--resume"):
        mr.measured("gemm", str(tmp_path / "missing.json"), "x")


def test_moe_resume_skips_measured_rows_and_whole_shapes(tmp_path):
    mb, mr = fresh("moe_bench"), fresh("merge_results")
    impls = list(mb.PROXY_IMPLS)
    old = [{"impl": "hbm_copy", "tbps": 3.8}]
    old += [{"impl": i, "shape": "qwen3_30b", "routing": "random", "T": t, "median_us": 9.0}
            for i in impls for t in (1, 8, 64)]
    skip = mr.measured("moe", _results(tmp_path / "m.json", old), "x")
    rows = mb.plan(["nemotron", "qwen3_30b"], [1, 8, 64, 512, 4096], ["random"], impls, skip)
    got = {(r["shape"], r["T"]) for r in rows}
    assert got == {("nemotron", t) for t in (1, 8, 64, 512, 4096)} | {
        ("qwen3_30b", 512), ("qwen3_30b", 4096)}
    assert mb.plan(["qwen3_30b"], [1, 8, 64], ["random"], impls, skip) == []


def test_merge_of_a_resumed_run_keeps_old_rows_and_adds_new(tmp_path):
    import json
    import subprocess

    old = {"commit": "a", "date": "d0", "timing": "t", "records": [
        {"impl": "bf16_dot", "N": 8, "K": 16, "M": 1, "median_us": 5.0},
        {"impl": "bf16_dot", "N": 8, "K": 16, "M": 256, "error": "budget"}]}
    new = {"commit": "b", "date": "d1", "timing": "t", "records": [
        {"impl": "bf16_dot", "N": 8, "K": 16, "M": 256, "median_us": 7.0}]}
    paths = [tmp_path / f for f in ("old.json", "new.json", "gemm-proxy-h200.json")]
    for p, d in zip(paths, (old, new)):
        p.write_text(json.dumps(d))
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "merge_results.py"), "gemm",
                    *map(str, paths), "--no-plot"], check=True, capture_output=True, text=True)
    out = json.loads(paths[2].read_text())
    by = {r["M"]: r for r in out["records"]}
    assert by[1]["median_us"] == 5.0 and by[256]["median_us"] == 7.0
    assert by[256]["commit"] == "b" and by[1]["commit"] == "a"  # each row its own run's
    assert not list(tmp_path.glob("*.png"))
