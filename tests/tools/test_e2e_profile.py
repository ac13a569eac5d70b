"""bench/e2e_profile.py: runs on the CPU (where the trace holds no GPU events and the records
say so instead of reporting kernel times), refuses bad arguments, and sums device events per
decode step."""

from __future__ import annotations

import json

import e2e_profile
import moe_profile
import pytest


def test_cpu_run_writes_both_layouts_and_says_there_are_no_device_events(tmp_path):
    assert e2e_profile.main(["--tiny", "--out", str(tmp_path), "--models", "llama-3-8b",
                             "--layers", "2", "--steps", "2", "--context", "8"]) == 0
    doc = json.loads((tmp_path / "e2e-profile.json").read_text())
    assert doc["commit"] and doc["jax"] and doc["settings"]["layers"] == 2
    recs = {r["layout"]: r for r in doc["records"]}
    assert set(recs) == {"scan", "unrolled"}
    for r in recs.values():
        assert r["model"] == "llama-3-8b" and r["layers"] == 2 and r["wall_ms_per_step"] > 0
        # the untraced step and the host's share of it (until each call returned)
        assert 0 < r["host_ms_per_step"] <= r["untraced_wall_ms_per_step"]
        assert r["device_events"] == 0 and "no GPU device events" in r["note"]
        assert "kernels" not in r and "busy_ms_per_step" not in r  # nothing made up


@pytest.mark.parametrize("argv, what", [
    (["--models", "gpt-2"], "--models"), (["--layouts", "ring"], "--layouts"),
    (["--steps", "0"], "--steps")])
def test_bad_arguments_name_the_option(tmp_path, capsys, argv, what):
    with pytest.raises(SystemExit):
        e2e_profile.main(["--tiny", "--out", str(tmp_path), *argv])
    assert what in capsys.readouterr().err


def test_kernel_table_sums_device_time_per_step():
    evs = [{"name": "gemm", "ts": 0.0, "dur": 30.0}, {"name": "norm", "ts": 40.0, "dur": 5.0},
           {"name": "gemm", "ts": 100.0, "dur": 30.0}, {"name": "norm", "ts": 140.0, "dur": 5.0}]
    rows, busy, span = moe_profile.kernel_table(evs, 2)  # two steps
    assert rows == [(30.0, 1.0, "gemm"), (5.0, 1.0, "norm")]
    assert busy == 35.0 and span == 72.5  # (145 - 0) / 2: gaps count in the span only


def test_nemotron_h_runs_unrolled_and_with_its_units_scanned(tmp_path):
    """The hybrid model's "scan" layout is ``stacked()``: its record names the segments, which
    cover the tiny pattern "MEMEM*E" x 2 (14 layers) as one unit repeated twice."""
    assert e2e_profile.main(["--tiny", "--out", str(tmp_path), "--models", "nemotron-3-nano",
                             "--layers", "0", "--steps", "1", "--context", "4"]) == 0
    doc = json.loads((tmp_path / "e2e-profile.json").read_text())
    recs = {r["layout"]: r for r in doc["records"]}
    assert set(recs) == {"scan", "unrolled"} and "segments" not in recs["unrolled"]
    segs = recs["scan"]["segments"]
    assert segs == [[7, 2]] and recs["scan"]["layers"] == recs["unrolled"]["layers"] == 14
    assert all(r["wall_ms_per_step"] > 0 for r in recs.values())


def test_copy_kernels_are_memcpys_and_pure_dynamic_slices():
    rows = [(100.0, 2.0, "memcpy128"), (5.0, 1.0, "memcpy32_post"), (7.0, 1.0, "MemcpyD2D"),
            (40.0, 1.0, "loop_dynamic_slice_fusion_5"), (3.0, 1.0, "loop_dynamic_slice_fusion"),
            (50.0, 1.0, "loop_dynamic_slice_multiply_fusion_9"), (60.0, 1.0, "nvfp4_gemm")]
    assert e2e_profile.copies_us(rows) == 155.0
