"""bench/e2e_bench.py runs end to end on the CPU with tiny shapes and writes its JSON."""

from __future__ import annotations

import json

import pytest
from bench_modules import fresh


def test_e2e_bench_tiny(tmp_path):
    bench = fresh("e2e_bench")
    assert bench.main(["--tiny", "--out", str(tmp_path), "--models", "qwen3-30b-a3b", "--in-process",
                       "--batches", "1", "--steps", "2", "--prefill", "16", "--unrolled"]) == 0
    res = json.loads((tmp_path / "e2e-tiny.json").read_text())
    assert res["tiny"] and res["commit"] and res["jax"] and not res["skipped"]
    kinds = {(r["precision"], r["kind"]) for r in res["records"]}
    for prec in ("nvfp4", "bf16"):
        assert {(prec, "memory"), (prec, "decode"), (prec, "prefill")} <= kinds
    assert ("nvfp4", "breakdown") in kinds and ("nvfp4", "decode_unrolled") in kinds
    dec = {r["precision"]: r for r in res["records"] if r["kind"] == "decode"}
    # NVFP4 weights take about 0.56 B per weight against bf16's 2 (experts dominate)
    mem = {r["precision"]: r["weight_bytes"] for r in res["records"] if r["kind"] == "memory"}
    assert mem["nvfp4"] < 0.6 * mem["bf16"]
    assert dec["nvfp4"]["read_bytes"] < dec["bf16"]["read_bytes"]
    assert all(r["tokens_per_s"] > 0 for r in dec.values())
    bd = next(r for r in res["records"] if r["kind"] == "breakdown")
    assert set(bd["ms"]) == {"attention", "dense", "moe", "other"}
    assert abs(sum(bd["ms"].values()) - bd["ms_per_step"]) < 1e-6 * max(1.0, bd["ms_per_step"])
    assert "decode_speedup_b1" in res["summary"]["qwen3-30b-a3b"]
    # the README table is printed from the JSON (python bench/tables.py e2e)
    tables = fresh("tables")
    text = tables.e2e(res)
    row = next(ln for ln in text.splitlines() if ln.startswith("| qwen3-30b-a3b | nvfp4 |"))
    assert f"{dec['nvfp4']['tokens_per_s']:.1f}" in row
    assert f"| {bd['ms_per_step']:.2f} |" in text


def test_e2e_bench_runs_each_model_and_precision_in_a_process_of_its_own(tmp_path, monkeypatch):
    """Without ``--in-process`` the bench starts one child per model and precision, then one
    per unrolled run (each with ``--in-process``), and merges their JSON: every record, each
    with its child's copy rate, the summary over all of them."""
    bench = fresh("e2e_bench")
    calls = []
    real = bench.subprocess.run

    def spy(cmd, **kw):
        calls.append(cmd[2:])
        return real(cmd, **kw)

    monkeypatch.setattr(bench.subprocess, "run", spy)
    assert bench.main(["--tiny", "--out", str(tmp_path), "--batches", "1", "--steps", "2",
                       "--models", "llama-3-8b", "--precisions", "nvfp4,bf16",
                       "--layers", "1", "--prefill", "16", "--no-breakdown", "--unrolled"]) == 0
    jobs = [(c[c.index("--models") + 1], c[c.index("--precisions") + 1], "--unrolled-only" in c)
            for c in calls]
    assert jobs == [("llama-3-8b", "nvfp4", False), ("llama-3-8b", "bf16", False),
                    ("llama-3-8b", "nvfp4", True)]
    assert all("--in-process" in c and "--no-breakdown" in c and c[c.index("--layers") + 1] == "1"
               for c in calls)
    res = json.loads((tmp_path / "e2e-tiny-layers1.json").read_text())
    assert res["processes"] and res["tiny"] and res["commit"] and not res["skipped"]
    kinds = {(r["model"], r["precision"], r["kind"]) for r in res["records"]}
    assert {("llama-3-8b", p, "decode") for p in ("nvfp4", "bf16")} <= kinds
    assert ("llama-3-8b", "nvfp4", "decode_unrolled") in kinds
    assert "decode_speedup_b1" in res["summary"]["llama-3-8b"]
    assert all(r["hbm_copy_tbps"] > 0 for r in res["records"])


def test_e2e_bench_rejects_a_bad_layer_count(tmp_path, capsys):
    bench = fresh("e2e_bench")
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--out", str(tmp_path), "--layers", "0"])
    assert "--layers: expected a positive layer count, got 0" in capsys.readouterr().err


def test_e2e_table_shows_a_peak_only_where_it_is_the_models_own():
    """peak_bytes_in_use never resets in a process: a model whose peak does not exceed an
    earlier model's gets "-" (its own peak is unknown), one that exceeds them gets its value."""
    tables = fresh("tables")
    gib = 2**30

    def mem(model, prec, peak):
        return {"model": model, "precision": prec, "kind": "memory", "weight_bytes": gib,
                "after_runs": {"peak_bytes_in_use": int(peak * gib)}}

    doc = {"settings": {"batches": [1], "prefill": 16},
           "records": [mem("a", "nvfp4", 3.0), mem("a", "bf16", 7.0), mem("b", "nvfp4", 7.0),
                       mem("b", "bf16", 9.5)]}
    lines = tables.e2e(doc).splitlines()
    col = [c.strip() for c in lines[0].split("|")].index("own peak GiB")
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): ln.split("|")[col].strip()
            for ln in lines if ln.startswith(("| a |", "| b |"))}
    assert rows == {("a", "nvfp4"): "3.0", ("a", "bf16"): "7.0", ("b", "nvfp4"): "-",
                    ("b", "bf16"): "9.5"}
    # each in a process of its own (e2e_bench's default): every peak is the model's own
    lines = tables.e2e({**doc, "processes": "one per model and precision"}).splitlines()
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): ln.split("|")[col].strip()
            for ln in lines if ln.startswith(("| a |", "| b |"))}
    assert rows[("b", "nvfp4")] == "7.0"


def test_decode_attention_ab_tiny(tmp_path):
    """bench/decode_attention_ab.py on tiny shapes: the three arms timed, their logits compared."""
    ab = fresh("decode_attention_ab")
    assert ab.main(["--tiny", "--out", str(tmp_path), "--models", "llama-3-8b", "--rounds", "1",
                    "--w4a16"]) == 0
    res = json.loads((tmp_path / "decode-attention-ab-tiny.json").read_text())
    t = res["ms_per_step"]["llama-3-8b"]
    arms = ("A_xla", "B_xla_prologue", "C_qkv_kernel")
    assert sorted(t) == sorted(arms) and all(len(t[a]) == 1 and t[a][0] > 0 for a in arms)
    # on the CPU every arm runs XLA's attention (the kernels run on GPUs): identical logits
    assert res["logits_max_rel_diff"]["llama-3-8b"] == {"A_xla": 0.0, "B_xla_prologue": 0.0}
