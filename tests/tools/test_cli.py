"""``nvfp4 audit`` end to end: on a tiny ModelOpt checkpoint (in-process) and on the default layer
(subprocess, the README quick start with a smaller expert subset and fewer token counts)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from nvfp4_jax import checkpoint as C
from nvfp4_jax.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_audit_checkpoint_writes_table_json_and_png(tmp_path, capsys):
    d = C.write_test_checkpoint(str(tmp_path / "ck"), num_layers=1, num_experts=3, sigma=0.01,
                                activation="swiglu", naming="w123")
    js, png = str(tmp_path / "a.json"), str(tmp_path / "a.png")
    assert main(["audit", "--checkpoint", d, "--json", js, "--plot", png, "--tokens", "1,2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "TRT-LLM CUTEDSL-b12x (folded)" in out and "model.layers.0.mixer" in out
    with open(js) as f:
        rep = json.load(f)
    moe = next(x for x in rep["layers"] if x["kind"] == "moe")
    err = moe["moe_rel_output_error"]
    assert err["trtllm_cutedsl_b12x"]["2"] > 0.05 > err["ours"]["2"]
    assert moe["scales"]["fc1"]["subnormal_share"] > 0.9
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_audit_errors_are_reported(tmp_path, capsys):
    assert main(["audit", "--checkpoint", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_default_audit_subprocess_reproduces_issue_shape(tmp_path):
    """The quick start: folded path off by tens of percent, ours at bf16 rounding level."""
    js = str(tmp_path / "d.json")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "nvfp4_jax.cli", "audit", "--experts", "22", "--tokens", "1,17",
           "--json", js, "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "subset of 22 experts" in r.stdout and "512 experts" in r.stdout
    with open(js) as f:
        rep = json.load(f)["layers"][0]
    fc1 = rep["scales"]["fc1"]
    assert fc1["subnormal_share"] > 0.95 and 0.002 < fc1["zero_share"] < 0.03
    e = rep["moe_rel_output_error"]
    assert all(e["trtllm_cutedsl_b12x"][t] > 0.05 for t in ("1", "17"))
    assert all(e["ours"][t] < 2.0**-8 for t in ("1", "17"))
    assert re.search(r"ours \(nvfp4_jax\.moe\)\s+\d", r.stdout)
    if shutil.which("nvfp4"):  # the console script declared in pyproject.toml
        h = subprocess.run(["nvfp4", "audit", "--help"], capture_output=True, text=True, env=env,
                           check=False)
        assert h.returncode == 0 and "--checkpoint" in h.stdout


def test_progress_bar_falls_back_to_stderr(monkeypatch, capsys):
    from nvfp4_jax.audit import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    bar = Progress(4, "nvfp4 audit")
    for i in range(4):
        bar.update(f"step {i}")
    bar.close()
    err = capsys.readouterr().err
    assert "[" + "#" * 30 + "] 4/4" in err and "step 3" in err


def test_every_subcommand_help_renders(capsys):
    """argparse formats help strings with %: a bare % in one crashes --help."""
    import pytest

    from nvfp4_jax.cli import main

    for cmd in ("audit", "crosscheck", "explain"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        assert f"usage: nvfp4 {cmd}" in capsys.readouterr().out
