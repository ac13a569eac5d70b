"""bench/sm12x_model.py on the Mosaic GPU kernel's mma.sync form, what W4A16
``nvfp4_jax.matmul(backend="auto")`` runs at M <= 64 on SM 12.x: the ``mosaic_sync_gemm`` rows
take the sm_120a count of the ptxas record with the token tile and block_n of
``mosaic.config_for(M, N, K, 120)`` (bench/results/mosaic-sync-sm12x-ptxas.json). Synthetic
ptxas documents with hand-picked counts pin the choice of record, the ceilings and the H200
calibration; expected times are worked by hand from the GPUs' datasheet figures."""

from __future__ import annotations

import json
import os
import re

import pytest
from bench_modules import RESULTS

SHAPES = ((28672, 8192), (4096, 14336), (14336, 4096), (4096, 4096))
GPUS = ("rtx_5090", "rtx_5060_ti", "dgx_spark_gb10")

# RTX 5060 Ti: 36 SMs x 4 warp-instructions/clock x 2.572 GHz; 448 GB/s x 0.9 streamed;
# bf16 with fp32 accumulate: 36 x 2.572 GHz x 512 FLOP/clock
ISSUE_5060 = 36 * 4 * 2.572e9
STREAM_5060 = 448e9 * 0.9
BF16_5060 = 36 * 2.572e9 * 512
# H200: 132 SMs x 4 x 1.98 GHz
ISSUE_H200 = 132 * 4 * 1.98e9
# warp-instructions per weight each GPU issues while weights stream at 85 % of DRAM bandwidth
# (0.5625 B per weight): 5090 1636.76e9 / (1523.2e9 / 0.5625) = 0.604, 5060 Ti 0.547,
# DGX Spark 483.84e9 / (232.05e9 / 0.5625) = 1.173
BUDGET_85 = {"rtx_5090": 170 * 4 * 2.407e9 / (1792e9 * 0.85 / 0.5625),
             "rtx_5060_ti": ISSUE_5060 / (448e9 * 0.85 / 0.5625),
             "dgx_spark_gb10": 48 * 4 * 2.52e9 / (273e9 * 0.85 / 0.5625)}


def _tile(m: int) -> int:
    return next(t for t in (8, 16, 32, 64) if m <= t)


def _record(m, n, k, ipw, arch="sm_120a", rc=0, **config) -> dict:
    return {"ptx": f"k_{m}_{n}x{k}_{config.get('block_n', 128)}_{arch}.ptx", "arch": arch,
            "rc": rc, "case": {"M": m, "N": n, "K": k, "config": config},
            "warp_instructions_per_weight": ipw}


def _write(tmp_path, records: list[dict], name="ptxas.json") -> str:
    path = os.path.join(tmp_path, name)
    with open(path, "w") as f:
        json.dump({"ptxas": "synthetic", "records": records}, f)
    return path


def _rows(sm, path: str, measured: dict | None = None) -> dict:
    rows = sm.mosaic_rows(sm.GPUS, sm.load_mosaic_sass(path),
                          sm.load_mosaic_sass(path, "sm_90a"), measured)
    return {(r["gpu"], r["N"], r["K"], r["M"]): r for r in rows}


def test_stored_counts_are_the_records_of_config_for_tiles(doc):
    """Every shape and M <= 64, on each GPU: the row's tiles are config_for(M, N, K, 120)'s and
    its count is that of a stored sm_120a record of the same token tile and block_n; only
    where the file has none is a record of the same block_n used, and the row says 'nearest'."""
    from nvfp4_jax.gemm import mosaic

    with open(os.path.join(RESULTS, "mosaic-sync-sm12x-ptxas.json")) as f:
        stored = [r for r in json.load(f)["records"]
                  if r["arch"] == "sm_120a" and r.get("case") and r.get("rc", 0) == 0]
    rows = {(r["gpu"], r["N"], r["K"], r["M"]): r for r in doc["mosaic_sync_gemm"]}
    assert set(rows) == {(g, n, k, m) for g in GPUS for n, k in SHAPES for m in (1, 16, 64)}
    for (g, n, k, m), r in rows.items():
        c = mosaic.config_for(m, n, k, 120)
        assert r["config"]["block_n"] == c.block_n and r["config"]["split_k"] == c.split_k
        assert r["config"]["mma"] == "sync" and r["token_tile"] == _tile(m)
        bn = [s for s in stored if s["case"]["config"].get("block_n", 128) == c.block_n]
        same = [s for s in bn if _tile(s["case"]["M"]) == _tile(m)]
        if same:
            assert r["warp_instructions_per_weight"] in [
                s["warp_instructions_per_weight"] for s in same], (n, k, m)
            assert not r["ipw_from"].startswith("nearest")
        else:
            assert r["ipw_from"].startswith("nearest"), (n, k, m)
            assert r["warp_instructions_per_weight"] in [
                s["warp_instructions_per_weight"] for s in bn]


def test_record_of_the_token_tile_and_block_n_is_picked(sm, tmp_path):
    """4096 x 14336 at M = 1 runs 8-token tiles of block_n 128 (config_for). Of a record of
    another token tile with that block_n (0.9), one of that token tile with block_n 64 (0.8),
    an sm_90a record of those tiles (0.7) and a failed build at that shape (rc 1, 5.0), none
    is its count: the sm_120a build of token tile 8 and block_n 128 (0.3, its case config
    leaving block_n at the default) is. 4096 x 4096 at M = 16 (block_n 128) takes the 0.9."""
    path = _write(tmp_path, [
        _record(16, 4096, 14336, 0.9, block_n=128),
        _record(3, 14336, 4096, 0.8, block_n=64),
        _record(5, 4000, 4096, 0.7, arch="sm_90a", block_n=128),
        _record(2, 4096, 14336, 5.0, rc=1, block_n=128),
        _record(5, 4000, 4096, 0.3, split_k=4),  # block_n left out: MosaicConfig's 128
    ])
    rows = _rows(sm, path)
    for g in GPUS:
        assert rows[(g, 4096, 14336, 1)]["warp_instructions_per_weight"] == 0.3
        assert rows[(g, 4096, 4096, 16)]["warp_instructions_per_weight"] == 0.9
    assert "M=5, 4000x4096" in rows[("rtx_5090", 4096, 14336, 1)]["ipw_from"]


def test_record_of_the_same_shape_first_then_the_largest_count(sm, tmp_path):
    """Two records of token tile 16 and block_n 128: at 4096 x 4096, M = 16 the one dumped at
    that very shape (0.4) over the larger (0.9); at 4096 x 14336, M = 16, where neither was
    dumped, the larger one."""
    path = _write(tmp_path, [
        _record(16, 4096, 4096, 0.4, block_n=128),
        _record(12, 8192, 1024, 0.9, block_n=128),
    ])
    rows = _rows(sm, path)
    assert rows[("rtx_5090", 4096, 4096, 16)]["warp_instructions_per_weight"] == 0.4
    assert rows[("rtx_5090", 4096, 14336, 16)]["warp_instructions_per_weight"] == 0.9


def test_nearest_token_tile_of_the_same_block_n_stands_in_and_says_so(sm, tmp_path):
    """No record of token tile 64 with block_n 64 (4096 x 4096 at M = 64): of the block_n 64
    records at token tiles 8 (0.8) and 32 (0.6), the nearer one, 32, with 'nearest' in
    ipw_from; a block_n 128 record of token tile 64 (0.1) is not taken. Without any block_n 64
    record the row has no count and no issue time."""
    path = _write(tmp_path, [
        _record(3, 14336, 4096, 0.8, block_n=64),
        _record(20, 14336, 4096, 0.6, block_n=64),
        _record(64, 4096, 4096, 0.1, block_n=128),
    ])
    r = _rows(sm, path)[("rtx_5060_ti", 4096, 4096, 64)]
    assert r["warp_instructions_per_weight"] == 0.6
    assert r["ipw_from"].startswith("nearest") and "M=20" in r["ipw_from"]
    only_128 = _write(tmp_path, [_record(64, 4096, 4096, 0.1, block_n=128)], "only128.json")
    r = _rows(sm, only_128)[("rtx_5060_ti", 4096, 4096, 64)]
    assert r["warp_instructions_per_weight"] is None and r["predicted_t_issue_us"] == 0
    assert "no sm_120a record" in r["ipw_from"]


def test_count_above_the_budget_is_issue_bound_below_it_dram_bound(sm, tmp_path):
    """4096 x 14336 at M = 1 (block_n 128) with 2.0 warp-instructions per weight, above every
    GPU's budget at 85 % of DRAM (0.60, 0.55, 1.17), is issue-bound: on the RTX 5060 Ti
    4096 x 14336 x 2.0 / 370.4e9 per s = 317.1 us; 14336 x 4096 at M = 1 (block_n 64) with 0.05,
    below them, is DRAM-bound: (14336 x 4096 x 0.5625 + 2 x 4096 + 2 x 14336) B / 403.2 GB/s
    = 81.6 us. The MMA runs the 8-token tile: 2 x 8 x N x K at the bf16 rate."""
    path = _write(tmp_path, [_record(1, 4096, 14336, 2.0, block_n=128),
                             _record(1, 14336, 4096, 0.05, block_n=64)])
    rows = _rows(sm, path)
    for g in GPUS:
        hot, cool = rows[(g, 4096, 14336, 1)], rows[(g, 14336, 4096, 1)]
        assert hot["issue_budget_per_weight_at_85pct_dram"] == pytest.approx(BUDGET_85[g])
        assert 0.05 < BUDGET_85[g] < 2.0
        assert hot["limiter"] == "issue" and cool["limiter"] == "DRAM"
    hot, cool = rows[("rtx_5060_ti", 4096, 14336, 1)], rows[("rtx_5060_ti", 14336, 4096, 1)]
    assert hot["predicted_us"] == pytest.approx(4096 * 14336 * 2.0 / ISSUE_5060 * 1e6)
    t_mem = (14336 * 4096 * 0.5625 + 2 * 4096 + 2 * 14336) / STREAM_5060
    assert cool["predicted_us"] == pytest.approx(t_mem * 1e6)
    assert cool["predicted_dram_fraction"] == pytest.approx(0.9)
    assert cool["predicted_t_mma_us"] == pytest.approx(2 * 8 * 14336 * 4096 / BF16_5060 * 1e6)
    # the ideal bf16 GEMM streams 2 B per weight: 2 / 0.5625 = 3.56x the bytes
    t_b = (2 * 14336 * 4096 + 2 * 4096 + 2 * 14336) / STREAM_5060
    assert cool["predicted_speedup_vs_bf16"] == pytest.approx(t_b / t_mem)


def test_h200_run_calibrates_with_the_sm90_count_of_its_tiles(sm, tmp_path):
    """An H200 run of 4096 x 14336, M = 1 at config_for's tiles (8 x 128, split 8, 2 stages)
    taking 4096 x 14336 x 0.1 / (0.25 x 1.0454e12 per s) = 22.5 us, with an sm_90a count of
    0.1, ran at 25 % issue efficiency; the 5060 Ti's issue ceiling at 0.5 per weight, 79.3 us,
    becomes 317.1 us. At 4096 x 4096, M = 16 (3 stages) no sm_90a record of token tile 16
    exists (the 8-token one does not stand in); a run of the wgmma form, one of the 64-token
    tile split over CTAs (m_split 2) and a row of another label are other kernels: no
    efficiency, no calibrated time."""
    path = _write(tmp_path, [_record(5, 4000, 4096, 0.5, block_n=128),
                             _record(5, 4000, 4096, 0.1, arch="sm_90a", block_n=128),
                             _record(16, 4096, 4096, 0.5, block_n=128)])
    cfg = {"block_n": 128, "split_k": 8, "num_stages": 2, "block_k": 256, "overlap": False,
           "consumers": 1, "bf16_store": False, "mma": "sync", "m_split": 1}
    us = 4096 * 14336 * 0.1 / (0.25 * ISSUE_H200) * 1e6
    with open(os.path.join(tmp_path, "mosaic-sm12x-forms-h200.json"), "w") as f:
        json.dump({"records": [
            {"N": 4096, "K": 14336, "M": 1, "label": "mosaic_sm12x", "median_us": us,
             "config": cfg},
            {"N": 4096, "K": 4096, "M": 16, "label": "mosaic_sm12x", "median_us": us,
             "config": {**cfg, "num_stages": 3}},
            {"N": 14336, "K": 4096, "M": 1, "label": "mosaic_sm12x", "median_us": us,
             "config": {**cfg, "mma": "wgmma"}},
            {"N": 28672, "K": 8192, "M": 1, "label": "mosaic_sm12x", "median_us": us,
             "config": {**cfg, "m_split": 2}},
            {"N": 4096, "K": 4096, "M": 1, "label": "mosaic_wgmma", "median_us": us,
             "config": {**cfg, "block_n": 64}},
        ]}, f)
    measured, source = sm.load_mosaic_measured(str(tmp_path))
    assert source == "mosaic-sm12x-forms-h200.json"
    rows = _rows(sm, path, measured)
    r = rows[("rtx_5060_ti", 4096, 14336, 1)]
    assert r["h200_issue_efficiency"] == pytest.approx(0.25)
    assert r["h200_sm90_warp_instructions_per_weight"] == 0.1
    assert r["issue_calibrated_us"] == pytest.approx(4096 * 14336 * 0.5 / ISSUE_5060 / 0.25 * 1e6)
    for key in ((4096, 4096, 16), (14336, 4096, 1), (28672, 8192, 1), (4096, 4096, 1)):
        r = rows[("rtx_5060_ti", *key)]
        assert r["h200_issue_efficiency"] is None and r["issue_calibrated_us"] is None


def test_a_record_of_the_missing_tiles_is_taken_when_the_file_has_it(sm, tmp_path):
    """The stored file plus a record of M = 16, 4096 x 14336, block_n 128 (token tile 16, as
    config_for there; 0.75, any stored one of those tiles dropped first): that row takes it,
    not the nearest stand-in, and its table row loses the '*'."""
    with open(os.path.join(RESULTS, "mosaic-sync-sm12x-ptxas.json")) as f:
        records = [r for r in json.load(f)["records"] if not (
            r.get("case") and _tile(r["case"]["M"]) == 16
            and r["case"]["config"].get("block_n", 128) == 128)]
    path = _write(tmp_path, [*records, _record(16, 4096, 14336, 0.75, block_n=128,
                                                split_k=8, num_stages=2)])
    rows = _rows(sm, path)
    r = rows[("rtx_5090", 4096, 14336, 16)]
    assert r["warp_instructions_per_weight"] == 0.75
    assert r["ipw_from"].startswith("same token tile") and "M=16, 4096x14336" in r["ipw_from"]
    lines = sm.mosaic_table({"gpus": sm.GPUS, "mosaic_sync_gemm": list(rows.values())})
    (line,) = [ln for ln in lines if ln.startswith("| 4096x14336 | 16 |")]
    assert "| 0.750 |" in line


def _mosaic_section(md: str) -> list[str]:
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("GEMM, W4A16 at M <= 64"))
    body = []
    for ln in lines[start + 4:]:
        if not ln.startswith("|"):
            break
        body.append(ln)
    return [lines[start], lines[start + 2], *body]


def test_table_has_a_row_per_shape_and_m_up_to_64(sm, doc):
    """The Markdown: a captioned section of predictions naming its source, a row per shape and
    M in (1, 16, 64) with the tile, the count, per GPU 'us (limiter, % DRAM, x bf16)', and the
    budgets at 85 % (0.60, 0.55, 1.17 by hand, above)."""
    caption, head, *body = _mosaic_section(sm.table(doc))
    assert "predictions" in caption and "mosaic-sync-sm12x-ptxas.json" in caption
    assert "budget at 85 %" in head
    keys = [tuple(c.strip() for c in ln.split("|")[1:3]) for ln in body]
    assert sorted(keys) == sorted((f"{n}x{k}", str(m)) for n, k in SHAPES for m in (1, 16, 64))
    cell = re.compile(r"^\d+ \([DMI], \d+ %, \d+\.\dx\)$")
    for ln in body:
        cols = [c.strip() for c in ln.split("|")[1:-1]]
        assert re.match(r"^(8|16|64)x(64|128)x256, split \d+, \d st$", cols[2])
        assert all(cell.match(c) for c in cols[4:7]), ln
        assert cols[7] == "0.60, 0.55, 1.17"
