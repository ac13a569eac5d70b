"""bench/sm12x_model.py on the Mosaic MoE in its mma.sync form, what ``nvfp4_jax.moe(backend=
"auto")`` runs on SM 12.x up to ``moe.mosaic.SM12X_ROUTES_PER_EXPERT`` routed rows per expert:
the ``mosaic_sync_moe`` rows take each grouped GEMM's sm_120a count from the ptxas records of
``bench/mosaic_sm12x.py --moe`` (bench/results/mosaic-sync-moe-sm12x-ptxas.json). Synthetic
ptxas documents with hand-picked counts pin the choice of record and the ceilings; expected
times are worked by hand from the GPUs' datasheet figures; the stored rows are the basis of
the routes-per-expert threshold and are checked against it."""

from __future__ import annotations

import json
import os

import pytest
from bench_modules import RESULTS

GPUS = ("rtx_5090", "rtx_5060_ti", "dgx_spark_gb10")
# RTX 5060 Ti: 36 SMs x 4 warp-instructions/clock x 2.572 GHz; 448 GB/s x 0.9 streamed
ISSUE_5060 = 36 * 4 * 2.572e9
STREAM_5060 = 448e9 * 0.9
QWEN = {"E": 128, "H": 2048, "R": 1536, "I": 768, "k": 8}


def _moe_record(shape, t, gemm, ipw, block_n, block_k=256, arch="sm_120a", rc=0) -> dict:
    return {"ptx": f"nvfp4_moe_mosaic_{gemm}_{shape}_{t}_{arch}.ptx", "arch": arch, "rc": rc,
            "case": {"shape": shape, "T": t}, "gemm": gemm,
            "config": {"block_n": block_n, "block_k": block_k},
            "warp_instructions_per_weight": ipw}


def _write(tmp_path, records, cases, name="moe-ptxas.json") -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "w") as f:
        json.dump({"ptxas": "synthetic", "records": records, "lowered_cases": cases}, f)
    return path


def _rows(sm, moe_path: str, gemm_records=()) -> dict:
    gemm_path = os.path.join(os.path.dirname(moe_path), "gemm-ptxas.json")
    with open(gemm_path, "w") as f:
        json.dump({"records": list(gemm_records)}, f)
    rows = sm.mosaic_moe_rows(sm.GPUS, sm.load_mosaic_moe_sass(moe_path),
                              sm.load_mosaic_sass(gemm_path), [])
    return {(r["gpu"], r["shape"], r["T"]): r for r in rows}


def test_rows_run_the_configs_auto_runs_with_their_own_counts(sm, doc):
    """Every layer, T of MOSAIC_MOE_TOKENS and GPU has a row; its tiles are moe.mosaic's
    auto_config in the for_sm12x form; where the stored file holds that layer and T, both
    GEMMs' counts are that file's records of them (FC1 first), said in ipw_from."""
    from nvfp4_jax.moe.mosaic import SM12X_ROUTES_PER_EXPERT

    with open(os.path.join(RESULTS, "mosaic-sync-moe-sm12x-ptxas.json")) as f:
        stored = json.load(f)
    by = {(r["case"]["shape"], r["case"]["T"], r["gemm"]): r["warp_instructions_per_weight"]
          for r in stored["records"] if r["arch"] == "sm_120a" and r["rc"] == 0}
    rows = {(r["gpu"], r["shape"], r["T"]): r for r in doc["mosaic_sync_moe"]}
    assert set(rows) == {(g, s, t) for g in GPUS for s in sm.MOE_SHAPES
                         for t in sm.MOSAIC_MOE_TOKENS}
    for (_, shape, t), r in rows.items():
        s = sm.MOE_SHAPES[shape]
        bm, c1, c2 = sm.mosaic_moe_configs(s, t)
        assert r["block_m"] == bm
        fc1 = r["config"]["fc1"]
        assert (fc1["block_n"], fc1["split_k"]) == (c1.block_n, c1.split_k)
        assert r["config"]["fc2"]["mma"] == "sync" and r["config"]["fc2"]["consumers"] == 1
        per = -(-t * s["top_k"] // min(s["experts"], t * s["top_k"]))
        assert r["routes_per_expert"] == per
        assert r["auto_on_sm12x"] == ("mosaic" if per <= SM12X_ROUTES_PER_EXPERT else "pallas")
        if (shape, t, "fc1") in by:
            assert r["warp_instructions_per_weight"] == [by[(shape, t, "fc1")],
                                                         by[(shape, t, "fc2")]]
            assert all(h.startswith("this GEMM") for h in r["ipw_from"])
    # the tiles moe(backend="auto") ran when lowered as SM 12.0 (the stored lowering run's
    # cases) are the rows' tiles
    ran = [c for c in stored["lowered_cases"] if "error" not in c]
    assert ran
    for c in ran:
        r = rows[(GPUS[0], c["shape"], c["T"])]
        assert r["block_m"] == c["block_m"]
        assert r["config"] == {"fc1": c["fc1_config"], "fc2": c["fc2_config"]}, c


def test_threshold_is_where_the_model_puts_it(doc):
    """The numbers behind SM12X_ROUTES_PER_EXPERT: up to 16 rows per expert every row is
    DRAM-bound on every GPU and within 3 % of the FP4-MMA Pallas-Triton MoE; at 32 rows (where
    auto picks the FP4 MMA) the bf16 MMA bounds at least one GPU and costs more than 30 %
    there."""
    rows = doc["mosaic_sync_moe"]
    small = [r for r in rows if r["routes_per_expert"] <= 16]
    large = [r for r in rows if r["routes_per_expert"] > 16]
    assert small and large
    for r in small:
        assert r["auto_on_sm12x"] == "mosaic" and r["limiter"] == "DRAM", r
        assert r["ratio_vs_fp4_mma_moe"] < 1.03, r
    for shape in {r["shape"] for r in large}:
        mine = [r for r in large if r["shape"] == shape]
        assert all(r["auto_on_sm12x"] == "pallas" for r in mine)
        assert any(r["limiter"] == "MMA" and r["ratio_vs_fp4_mma_moe"] > 1.3 for r in mine)


def test_own_record_first_then_same_tiles_then_the_gemm(sm, tmp_path):
    """qwen3_30b at T = 1 runs FC1 8 x 64 split 2 and FC2 8 x 64 (auto_config): with its own
    FC1 record (0.3) beside a larger record of the same tiles at T = 8 (0.9), FC1 takes 0.3
    and FC2, without a record of its own, the larger same-tiles record (0.9). At T = 64
    (block_n 128, no MoE record of those tiles) both take the Mosaic GEMM's count of token tile
    8 and block_n 128 (0.4). A failed build (rc 1) and an sm_90a record are never taken."""
    cases = [{"shape": "qwen3_30b", "T": 1, "block_m": 8}, {"shape": "qwen3_30b", "T": 8,
                                                              "block_m": 8}]
    path = _write(tmp_path, [
        _moe_record("qwen3_30b", 1, "fc1", 0.3, 64),
        _moe_record("qwen3_30b", 8, "fc2", 0.9, 64),
        _moe_record("qwen3_30b", 1, "fc2", 5.0, 64, rc=1),
        _moe_record("qwen3_30b", 1, "fc2", 0.01, 64, arch="sm_90a"),
    ], cases)
    gemm = [{"ptx": "g.ptx", "arch": "sm_120a", "rc": 0, "warp_instructions_per_weight": 0.4,
             "case": {"M": 5, "N": 4000, "K": 4096, "config": {"block_n": 128}}}]
    rows = _rows(sm, path, gemm)
    r1 = rows[("rtx_5090", "qwen3_30b", 1)]
    assert r1["warp_instructions_per_weight"] == [0.3, 0.9]
    assert r1["ipw_from"][0].startswith("this GEMM") and r1["ipw_from"][1].startswith("same tiles")
    r64 = rows[("rtx_5090", "qwen3_30b", 64)]
    assert r64["warp_instructions_per_weight"] == [0.4, 0.4]
    assert all(h.startswith("the Mosaic GEMM's count") for h in r64["ipw_from"])


def test_dram_and_issue_ceilings_by_hand(sm, tmp_path):
    """qwen3_30b at T = 1 on the RTX 5060 Ti: 8 routes to 8 experts (touched = 128 (1 - (1 -
    8/128)^1) = 8). DRAM: 8 experts x (1536 x 2048 + 2048 x 768) weights x 0.5625 B + the bf16
    activations and outputs (8 x (2 x 2048 + 2 x 1536) + 8 x (2 x 768 + 2 x 2048)), at 403.2 GB/s.
    With 0.05 warp-instructions per weight it is DRAM-bound; with 5.0 issue-bound: (8 + 8 // 8)
    row tiles per GEMM x its weights x 5.0 / the 5060 Ti's issue rate."""
    cases = [{"shape": "qwen3_30b", "T": 1, "block_m": 8}]
    e, h, r, i, k = (QWEN[x] for x in ("E", "H", "R", "I", "k"))
    touched = e * (1 - (1 - k / e) ** 1)
    nbytes = (touched * (r * h + h * i) * 0.5625 + k * (2 * h + 2 * r) + k * (2 * i + 2 * h))
    for ipw, limiter in ((0.05, "DRAM"), (5.0, "issue")):
        path = _write(tmp_path, [_moe_record("qwen3_30b", 1, g, ipw, 64) for g in ("fc1", "fc2")],
                      cases, name=f"moe-{ipw}.json")
        row = _rows(sm, path)[("rtx_5060_ti", "qwen3_30b", 1)]
        assert row["limiter"] == limiter
        assert row["predicted_t_mem_us"] == pytest.approx(nbytes / STREAM_5060 * 1e6)
        tiles = touched + k // 8
        t_issue = tiles * (r * h + h * i) * ipw / ISSUE_5060
        assert row["predicted_t_issue_us"] == pytest.approx(t_issue * 1e6)
        assert row["predicted_us"] == pytest.approx(max(nbytes / STREAM_5060, t_issue) * 1e6)


def test_table_names_its_source_and_has_a_row_per_layer_and_t(sm, doc):
    """The Markdown: a captioned section naming the ptxas file, a row per layer and T with the
    routes per expert, auto's pick, the tiles, the counts and per GPU 'us (limiter, % DRAM) /
    FP4 us (ratio)'."""
    lines = sm.table(doc).splitlines()
    start = next(j for j, ln in enumerate(lines) if ln.startswith("Routed MoE layer (FC1 + FC2) "
                                                                  "on SM 12.x, the Mosaic MoE"))
    assert "mosaic-sync-moe-sm12x-ptxas.json" in lines[start]
    body = [ln for ln in lines[start + 4:] if ln.startswith("|")]
    assert len(body) == len(sm.MOE_SHAPES) * len(sm.MOSAIC_MOE_TOKENS)
    for ln in body:
        cols = [c.strip() for c in ln.split("|")[1:-1]]
        assert cols[3] in ("mosaic", "pallas")
        assert all(" / " in c and c.endswith("x)") for c in cols[6:9]), ln
