"""The decode/tile candidate sweep of bench/gemm_bench.py (``--candidates``, run on the GPU in
one call) and the compile-time occupancy of bench/sm12x_compile.py: a CPU smoke run of the
sweep, the candidate lists, and the per-SM resource arithmetic."""

from __future__ import annotations

import json
import sys

import pytest
from bench_modules import fresh


def test_candidates_cover_both_families_and_the_issue_shapes():
    gb = fresh("gemm_bench")
    from nvfp4_jax.gemm import configs

    assert set(gb.CAND_SHAPES) == {(28672, 8192), (4096, 14336), (14336, 4096)}
    for n, k in gb.CAND_SHAPES:
        for m in gb.CAND_MS:
            cands = dict(gb.sweep_candidates(m, n, k))
            assert cands["sm90_table"] == configs.get_config(m, n, k, family="sm90")
            assert cands["sm12x_table"] == configs.get_config(m, n, k, family="sm12x")
            assert len(cands) >= 4
            for c in cands.values():
                assert c.block_m >= min(m, 16) and c.algo == "fused"
    labels = [label for label, _ in gb.all_sweep_candidates()]
    assert len(labels) == len(set(labels))


def test_candidates_smoke_run_writes_records(tmp_path, monkeypatch):
    """The --candidates path end to end on CPU (Pallas interpreted, times meaningless): a
    budget that runs out mid-list records the skipped candidates and still times the rest."""
    gb = fresh("gemm_bench")
    argv = ["gemm_bench.py", "--candidates", "--tiny", "--ms", "1", "--repeats", "1",
            "--inner-calls", "1", "--budget-s", "0", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    gb.main()
    [path] = list(tmp_path.glob("gemm-candidates-*.json"))
    doc = json.loads(path.read_text())
    timed = [r for r in doc["records"] if "median_us" in r]
    assert [r["label"] for r in timed] == ["bf16_dot"]
    assert timed[0]["rounds_us"] and timed[0]["x_bf16"] == 1.0
    skipped = [r["label"] for r in doc["records"] if r.get("skipped") == "budget"]
    assert skipped == [label for label, _ in gb.sweep_candidates(1, 256, 256)]


def test_candidates_smoke_run_times_a_kernel(tmp_path, monkeypatch):
    gb = fresh("gemm_bench")
    first = gb.sweep_candidates(16, 256, 256)[:1]
    monkeypatch.setattr(gb, "sweep_candidates", lambda m, n, k: first)
    monkeypatch.setattr(gb, "INNER_CALLS", 1)
    doc = gb.candidates_sweep(str(tmp_path / "c.json"), [(256, 256)], [16], budget_s=600,
                              repeats=2, target_s=0.001)
    rec = {r["label"]: r for r in doc["records"]}
    assert set(rec) == {"bf16_dot", first[0][0]}
    assert len(rec[first[0][0]]["rounds_us"]) == 2 and rec[first[0][0]]["median_us"] > 0
    assert json.loads((tmp_path / "c.json").read_text())["records"] == doc["records"]


@pytest.mark.parametrize(
    "regs,smem,warps,cc,ctas,limit",
    [
        (255, 88064, 4, 90, 2, "registers"),  # 255 -> 256 per thread: 32768 per CTA
        (168, 79872, 4, 120, 1, "shared memory"),  # 80 KB of 100 KB per SM
        (77, 30208, 4, 90, 6, "registers"),  # 80 regs x 128 = 10240 -> 6
        (80, 26112, 4, 120, 3, "shared memory"),  # (26112 + 1024) x 3 <= 102400
        (24, 1024, 8, 120, 6, "threads"),  # 1536 / 256
    ],
)
def test_occupancy_arithmetic(regs, smem, warps, cc, ctas, limit):
    sc = fresh("sm12x_compile")
    occ = sc.occupancy(regs, smem, warps, cc)
    assert (occ["ctas_per_sm"], occ["limited_by"]) == (ctas, limit)
    assert occ["warps_per_scheduler"] == ctas * warps / 4 and occ["fits"]


def test_occupancy_flags_a_cta_over_the_sm120_limit():
    sc = fresh("sm12x_compile")
    assert not sc.occupancy(202, 102400, 8, 120)["fits"]  # 100 KB > 99 KB per CTA
    assert sc.occupancy(202, 102400, 8, 90)["fits"]


def test_sm12x_table_fits_sm120_shared_memory():
    """Every fused SM12x entry's pipeline buffers fit 99 KB per CTA: (num_stages - 1) stages of
    codes, scales and both activation halves (the sm_120a compile's own figure:
    bench/results/gemm-decode-variants.md)."""
    from nvfp4_jax.gemm import configs

    for key, c in configs.TUNED_SM12X.items():
        if c.algo != "fused":
            continue
        stage = c.block_n * c.block_k // 2 + c.block_n * c.block_k // 16 + c.block_m * c.block_k * 2
        assert (c.num_stages - 1) * stage <= 99 * 1024, key


def test_model_issue_calibration_by_h200_efficiency(tmp_path):
    """The H200's achieved issue efficiency (its kernel's sm_90a warp-instructions over the
    measured time x 132 SMs x 4 x 1.98 GHz) scales the SM12x kernel's issue ceiling, worked by
    hand for 4096 x 4096, M = 1 on the RTX 5060 Ti (36 SMs x 4 x 2.572 GHz)."""
    from nvfp4_jax.gemm import configs

    sm = fresh("sm12x_model")
    kernels = []
    for fam, ipw, arch in (("sm90", 0.2, 90), ("sm12x", 0.1, 120)):
        cfg = configs.get_config(1, 4096, 4096, family=fam).__dict__
        kernels.append({"kernel": fam, "config": cfg, f"pip_sm{arch}": {
            "per_weight": {"warp_instructions_per_weight": ipw},
            "main_loop": {"n_instructions": 1}}})
    (tmp_path / "gemm-sm12x-compile.json").write_text(json.dumps({"kernels": kernels}))
    rec = {"impl": "nvfp4_w4a16_pallas", "N": 4096, "K": 4096, "M": 1, "median_us": 40.0}
    (tmp_path / "gemm-proxy-h200.json").write_text(json.dumps({"records": [rec]}))
    doc = sm.build(str(tmp_path))
    rows = {(r["gpu"], r["N"], r["K"], r["M"]): r for r in doc["gemm"]}
    r = rows[("rtx_5060_ti", 4096, 4096, 1)]
    eff = 4096 * 4096 * 0.2 / (40e-6 * 132 * 4 * 1.98e9)
    assert r["h200_issue_efficiency"] == pytest.approx(eff)
    assert r["warp_instructions_per_weight"] == 0.1
    issue_us = 4096 * 4096 * 0.1 / (36 * 4 * 2.572e9) / eff * 1e6  # 56.5 us > DRAM's 23.4
    assert r["issue_calibrated_us"] == pytest.approx(issue_us)
    assert r["issue_budget_per_weight_at_85pct_dram"] == pytest.approx(
        36 * 4 * 2.572e9 / (448e9 * 0.85 / 0.5625))
    assert rows[("rtx_5060_ti", 4096, 4096, 16)]["issue_calibrated_us"] is None  # not measured


def test_mosaic_mma_bench_candidates_and_cpu_smoke_run(tmp_path, monkeypatch):
    """bench/mosaic_mma_bench.py's candidates: the sm_90 config on wgmma and in its mma.sync
    form (the overlap-free wgmma one where the table overlaps), the Pallas-Triton table tiles;
    on the CPU ``candidates_sweep`` times bf16 and Pallas-Triton (interpreted) and records the
    Mosaic kernels' errors without stopping."""
    mb = fresh("mosaic_mma_bench")
    from nvfp4_jax.gemm import configs, mosaic

    for m, n, k in ((1, 28672, 8192), (64, 14336, 4096), (5, 4000, 4096)):
        cands = {label: cfg for label, cfg, _ in mb.candidates(True)(m, n, k)}
        w = mosaic.config_for(m, n, k, 90)
        assert cands["mosaic_wgmma"] == w and cands["mosaic_sync"] == w.sync_form()
        assert cands["mosaic_sync"].mma == "sync" and cands["pallas"] == configs.get_config(m, n, k)
        assert ("mosaic_wgmma_plain" in cands) == (w.overlap or w.consumers > 1)
    monkeypatch.setattr(mb.gb, "INNER_CALLS", 1)
    doc = mb.gb.candidates_sweep(str(tmp_path / "m.json"), [(256, 256)], [16], budget_s=600,
                                 repeats=1, target_s=0.001, candidates=mb.candidates(True))
    rec = {r["label"]: r for r in doc["records"]}
    assert {"bf16_dot", "pallas", "mosaic_wgmma", "mosaic_sync"} <= set(rec)
    assert rec["pallas"]["median_us"] > 0 and "error" in rec["mosaic_sync"]


def test_mosaic_mma_bench_sm12x_candidates_fit_99_kb():
    """``--sm12x``: ``config_for(..., 120)`` first, then every other one-warpgroup mma.sync form
    whose CTA fits SM 12.x's 99 KB at the token tile, each once, K split evenly."""
    mb = fresh("mosaic_mma_bench")
    from nvfp4_jax.gemm import mosaic

    for m, n, k in ((1, 28672, 8192), (16, 4096, 14336), (64, 14336, 4096)):
        cands = mb.sm12x_candidates(m, n, k)
        labels = [label for label, _, _ in cands]
        assert labels[:2] == ["mosaic_wgmma", "mosaic_sm12x"] and len(set(labels)) == len(labels)
        assert cands[1][1] == mosaic.config_for(m, n, k, 120)
        syncs = [cfg for label, cfg, _ in cands[1:]]
        assert len(set(syncs)) == len(syncs) > 2
        for cfg in syncs:
            assert cfg.mma == "sync" and cfg.consumers == 1 and not cfg.overlap
            assert cfg.smem_bytes(mosaic.token_tile(m)) <= mosaic.SM12X_SMEM_LIMIT
            assert k % (cfg.block_k * cfg.split_k) == 0
    # at 64 tokens only block_n 64, block_k 256 and two stages fit (the x stage is 32 KB)
    big = {(c.block_n, c.block_k, c.num_stages) for _, c, _ in mb.sm12x_candidates(64, 28672, 8192)[1:]}
    assert big == {(64, 256, 2)}


def test_mosaic_mma_bench_sm90_tiles_cover_the_table_space():
    """``--sm90-tiles``: ``config_for(..., 90)`` first, then each wgmma form of block_n 64 / 128,
    split_k 1, 2, 4, 8 dividing the K steps, 2 stages, the bf16 store exactly at split 1, and
    overlap only at the 8-token tile; each once."""
    mb = fresh("mosaic_mma_bench")
    from nvfp4_jax.gemm import mosaic

    for m, n, k in ((1, 5120, 2048), (1, 28672, 4096), (16, 6144, 4096)):
        cands = mb.sm90_candidates(m, n, k)
        labels = [label for label, _, _ in cands]
        assert labels[0] == "mosaic_auto" and cands[0][1] == mosaic.config_for(m, n, k, 90)
        cfgs = [cfg for _, cfg, _ in cands]
        assert len(set(labels)) == len(labels) and len(set(cfgs)) == len(cfgs)
        forms = {(c.block_n, c.split_k, c.overlap) for c in cfgs[1:]}
        want = {(bn, s, ov) for bn in (64, 128) for s in (1, 2, 4, 8) for ov in (False, True)
                if (k // 256) % s == 0 and (not ov or mosaic.token_tile(m) == 8)}
        assert forms <= want and len(want - forms) <= 1  # config_for's own form is not repeated
        for c in cfgs[1:]:
            assert c.mma == "wgmma" and c.num_stages == 2 and c.bf16_store == (c.split_k == 1)
