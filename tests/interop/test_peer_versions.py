"""Peer behaviour is a fact about a version: the cross-check names the version each backend ran
at, and the audit's CUTEDSL-b12x semantics follow TensorRT-LLM's m >= 64 CUTLASS dispatch."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from nvfp4_jax import audit as A
from nvfp4_jax import checkpoint as C
from nvfp4_jax import crosscheck
from nvfp4_jax.cli import main
from nvfp4_jax.interop import trtllm


def test_backend_versions_come_from_the_installed_distributions():
    jax_v = importlib.metadata.version("jax")
    assert crosscheck.backend_version("jax_xla").startswith(f"jax {jax_v}, jaxlib ")
    assert crosscheck.backend_version("trtllm_reenacted") == f"re-enacted ({trtllm.SOURCE})"
    assert "TensorRT-LLM @" in trtllm.SOURCE
    try:
        fi = importlib.metadata.version("flashinfer-python")
        assert crosscheck.backend_version("flashinfer_reference") == f"flashinfer-python {fi}"
    except importlib.metadata.PackageNotFoundError:
        want = "flashinfer-python not installed"
        assert crosscheck.backend_version("flashinfer_reference") == want
    with pytest.raises(ValueError, match="backend"):
        crosscheck.backend_version("cublas")


def test_crosscheck_table_and_json_name_versions(tmp_path, capsys):
    out = str(tmp_path / "cc.json")
    assert main(["crosscheck", "--cases", "1", "--m", "4", "--n", "64", "--k", "64", "--ops",
                 "quantize", "--backends", "jax,trtllm_reenacted", "--json", out]) == 0
    text = capsys.readouterr().out
    assert "versions:" in text and f"re-enacted ({trtllm.SOURCE})" in text
    rows = json.load(open(out))
    assert {r["backend"]: r["version"] for r in rows} == {
        b: crosscheck.backend_version(b) for b in ("jax", "trtllm_reenacted")}


def test_audit_cutedsl_b12x_folds_decode_calls_only(tmp_path):
    """T < 64 runs the folded b12x kernel (tens of percent off); T = 64 is prefill and runs
    CUTLASS on the checkpoint scales: the same output as the CUTLASS semantics."""
    d = C.write_test_checkpoint(str(tmp_path), num_experts=4, hidden_size=64, intermediate_size=32,
                                sigma=0.01, dense=False)
    layer = next(C.load(d).layers())
    for batched in (True, False):
        e = A.moe_errors(layer, tokens=(3, 64), top_k=2, seed=1, batched=batched,
                         semantics=("trtllm_cutlass", "trtllm_cutedsl_b12x"))
        assert e["trtllm_cutedsl_b12x"][3] > 0.05
        assert e["trtllm_cutedsl_b12x"][64] == e["trtllm_cutlass"][64] < 2e-3
    reps = [A.audit_moe_layer(layer, top_k=2, tokens=(1,), semantics=("trtllm_cutedsl_b12x",))]
    txt = A.format_report(reps, d)
    assert "runs CUTLASS for m >= 64 rows" in txt
    j = A.to_json(reps, d)
    assert j["reenacted"] == f"re-enacted ({trtllm.SOURCE})"
    assert "T >= 64" in j["cutedsl_b12x_dispatch"]
