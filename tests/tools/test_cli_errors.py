"""The ``nvfp4`` command line refuses bad options and bad files with one line and exit code 2
(never a traceback, never a silently replaced value); ``--help`` states the real defaults;
``--version``; the audit's verdict and plot."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile

import numpy as np
import pytest

import nvfp4_jax
from nvfp4_jax import audit as A
from nvfp4_jax import checkpoint as C
from nvfp4_jax.cli import build_parser, main, version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_line_error(capsys, prefix: str) -> str:
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert "Traceback" not in cap.err
    assert len(lines) == 1 and lines[0].startswith(prefix), cap.err
    return lines[0]


# ---------------------------------------------------------------------------------------
# --version, --help
# ---------------------------------------------------------------------------------------

def test_version_flag_matches_pyproject(capsys):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        want = tomllib.load(f)["project"]["version"]
    assert nvfp4_jax.__version__ == want and version() == want
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"nvfp4 (nvfp4-jax) {want}"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    act = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(act.choices)


def _help(sub: argparse.ArgumentParser, dest: str) -> tuple[object, str]:
    a = next(a for a in sub._actions if a.dest == dest)
    text = sub._get_formatter()._expand_help(a) if a.help else ""
    return a.default, " ".join(text.split())


def test_help_states_every_argparse_default():
    """Each option with a default says it in --help, with the value argparse uses."""
    from nvfp4_jax.crosscheck import BACKENDS, OPS

    ALL = {("crosscheck", "backends"): BACKENDS, ("crosscheck", "ops"): OPS}
    for name, sub in _subparsers().items():
        for a in sub._actions:
            if a.default in (None, False, argparse.SUPPRESS) or not a.option_strings:
                continue
            default, text = _help(sub, a.dest)
            if (name, a.dest) in ALL:  # "default: all" means every one of them
                assert "default: all" in text and default.split(",") == list(ALL[name, a.dest])
                continue
            assert re.search(rf"default:? {re.escape(str(default))}\b", text), (name, a.dest, text)


def test_audit_help_states_the_audit_defaults():
    """The audit's defaults live in nvfp4_jax.audit (they depend on the mode); --help says them."""
    sub = _subparsers()["audit"]
    _, experts = _help(sub, "experts")
    n_all = A.DEFAULT_SHAPE["experts"]
    assert f"default {A.DEFAULT_SUBSET} of the synthetic layer's {n_all}" in experts
    assert f"at most {A.DEFAULT_SHAPE['experts']}" in experts
    assert f"{A.CHECKPOINT_EXPERTS} for a checkpoint" in experts
    _, tokens = _help(sub, "tokens")
    assert f"default {','.join(map(str, A.TOKENS))}" in tokens
    _, top_k = _help(sub, "top_k")
    assert f"default {A.DEFAULT_SHAPE['top_k']} for the synthetic layer" in top_k
    assert f"else {A.CHECKPOINT_TOP_K}" in top_k
    assert A.audit_checkpoint.__kwdefaults__["max_experts"] == A.CHECKPOINT_EXPERTS


# ---------------------------------------------------------------------------------------
# audit options: refused, not replaced
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["--top-k", "0"], "--top-k: expected an integer >= 1"),
    (["--top-k", "-3"], "--top-k: expected an integer >= 1"),
    (["--top-k", "two"], "--top-k: expected an integer >= 1"),
    (["--experts", "0"], "--experts: expected an integer >= 1"),
    (["--seed", "-1"], "--seed: expected an integer >= 0"),
    (["--tokens", "0,2"], "--tokens: expected positive ints"),
])
def test_audit_refuses_bad_option_values(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["audit", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--top-k", "999"], "--top-k 999: expected 1..24"),
    (["--experts", "8"], "--top-k 22: expected 1..8"),  # the synthetic layer's top-22 > 8 experts
    (["--experts", "600"], "--experts 600: the synthetic layer has 512 experts"),
])
def test_audit_default_layer_refuses_inconsistent_options(capsys, argv, needle):
    assert main(["audit", "--no-progress", *argv]) == 2
    assert needle in one_line_error(capsys, "nvfp4 audit: ")


def test_audit_checkpoint_refuses_top_k_above_experts(tmp_path, capsys):
    d = C.write_test_checkpoint(str(tmp_path / "ck"), num_experts=3, hidden_size=32,
                                intermediate_size=16, dense=False)
    assert main(["audit", "--checkpoint", d, "--top-k", "999", "--no-progress"]) == 2
    line = one_line_error(capsys, "nvfp4 audit: ")
    assert "top_k 999: expected 1..3" in line and "model.layers.0.mixer" in line
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_experts_per_tok"] = 4  # the config's top-k, more than the 3 experts
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert main(["audit", "--checkpoint", d, "--no-progress"]) == 2
    assert "num_experts_per_tok 4: expected 1..3" in one_line_error(capsys, "nvfp4 audit: ")


def test_audit_output_paths_checked_before_the_run(tmp_path, capsys):
    bad = str(tmp_path / "no" / "such" / "dir" / "a.json")
    assert main(["audit", "--json", bad, "--no-progress"]) == 2
    assert "--json" in one_line_error(capsys, "nvfp4 audit: ")


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["audit", "--plot", str(tmp_path / "a.png"), "--no-progress"]) == 2
    assert "pip install 'nvfp4-jax[plot]'" in one_line_error(capsys, "nvfp4 audit: ")
    with pytest.raises(ImportError, match=r"nvfp4-jax\[plot\]"):
        A.plot([], str(tmp_path / "b.png"))


def test_checkpoint_without_nvfp4_weights_is_refused(tmp_path, capsys):
    """hf_quant_config.json says NVFP4, the weights are bf16: nothing to audit, exit 2."""
    d = str(tmp_path / "bf16")
    os.makedirs(d)
    C.write_safetensors(os.path.join(d, "model.safetensors"),
                        {"model.layers.0.mlp.up_proj.weight":
                         (np.zeros((4, 8), np.uint16), "BF16")})
    with open(os.path.join(d, "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "NVFP4"}}, f)
    assert main(["audit", "--checkpoint", d, "--no-progress"]) == 2
    line = one_line_error(capsys, "nvfp4 audit: ")
    assert "nothing to audit" in line and "BF16" in line and d in line


def test_damaged_checkpoint_subprocess_exit_2_no_traceback(tmp_path):
    """End to end through the interpreter: exit status 2, one stderr line, no traceback."""
    d = C.write_test_checkpoint(str(tmp_path / "ck"), num_experts=2, hidden_size=32,
                                intermediate_size=16)
    p = os.path.join(d, "model.safetensors")
    with open(p, "r+b") as f:
        f.write((2**40).to_bytes(8, "little"))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "nvfp4_jax.cli", "audit", "--checkpoint", d,
                        "--no-progress"], capture_output=True, text=True, env=env, timeout=300,
                       check=False)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert p in r.stderr and "header too large" in r.stderr


# ---------------------------------------------------------------------------------------
# explain / crosscheck --inputs: .npz files
# ---------------------------------------------------------------------------------------

def _npz_files(tmp_path) -> dict[str, str]:
    good = str(tmp_path / "good.npz")
    np.savez(good, x=np.zeros((2, 32), np.float32), weight_fp4=np.zeros((4, 16), np.uint8),
             weight_sf=np.zeros((4, 2), np.uint8), weight_scale_2=np.float32(1e-4),
             out=np.zeros((2, 4), np.float32))
    raw = open(good, "rb").read()
    files = {"not_zip": b"hello, this is not an npz\n" * 4, "truncated": raw[: len(raw) // 2],
             "npy": None, "pickled": None}
    out = {}
    for k, v in files.items():
        p = str(tmp_path / f"{k}.npz")
        if k == "npy":
            with open(p, "wb") as f:
                np.save(f, np.arange(3))
        elif k == "pickled":
            np.savez(p, x=np.array([{"a": 1}], dtype=object))
        else:
            with open(p, "wb") as f:
                f.write(v)
        out[k] = p
    return out


@pytest.mark.parametrize("kind, needle", [("not_zip", "not an .npz file"),
                                          ("truncated", "damaged or truncated .npz"),
                                          ("npy", "a single .npy array"),
                                          ("pickled", "array 'x' holds Python objects")])
def test_explain_and_crosscheck_name_a_bad_npz(tmp_path, capsys, kind, needle):
    p = _npz_files(tmp_path)[kind]
    assert main(["explain", p]) == 2
    line = one_line_error(capsys, "nvfp4 explain: ")
    assert p in line and needle in line and "pickled (object) data" not in line
    assert main(["crosscheck", "--inputs", p, "--ops", "gemm"]) == 2
    line = one_line_error(capsys, "nvfp4 crosscheck: ")
    assert p in line and needle in line


# ---------------------------------------------------------------------------------------
# the verdict and the plot
# ---------------------------------------------------------------------------------------

def _report(name: str, folded: dict[int, float], *, fixed: float = 0.001, zero: float = 0.01,
            kind: str = "moe") -> A.LayerReport:
    rng = np.random.default_rng(len(name))
    x = 10.0 ** rng.uniform(-3, -1.8, 50)
    st = A.ScaleStats(100, 0.9, zero, 0.14, 1.0, x, rng.uniform(1e-4, 0.5, 50), 0.15)
    errs = {"ours": dict.fromkeys(folded, 0.001), "trtllm_cutlass": dict.fromkeys(folded, 0.0),
            "trtllm_cutedsl_b12x": folded, "flashinfer_fixed": dict.fromkeys(folded, fixed)}
    if kind == "dense":
        return A.LayerReport(name, "dense", {"weight": st})
    return A.LayerReport(name, "moe", {"fc1": st, "fc2": st}, errs, 8, 8, 2)


def test_verdict_names_path_worst_and_typical_layer_and_the_fix():
    # per layer, the median over T < 64 (T = 64 runs CUTLASS in TRT-LLM's b12x module):
    # layer 1 -> 0.08, layer 2 -> 0.30 (worst), layer 3 -> 0.05; typical (median) 0.08
    reps = [_report("model.layers.1.mixer", {1: 0.06, 2: 0.08, 17: 0.10, 64: 0.9}),
            _report("model.layers.2.mixer", {1: 0.30, 2: 0.20, 17: 0.40, 64: 0.0}, zero=0.02),
            _report("model.layers.3.mixer", {1: 0.05, 2: 0.05, 17: 0.05, 64: 0.05}),
            _report("model.layers.0.mlp", {}, kind="dense")]
    v = A.verdict(reps)
    assert v.damaged and v.worst_layer == "model.layers.2.mixer"
    assert v.worst == pytest.approx(0.30) and v.typical == pytest.approx(0.08)
    text = A.format_report(reps, "test").split("Verdict:")[1]
    flat = " ".join(text.split())
    assert "DAMAGED: TRT-LLM CUTEDSL-b12x (folded)" in flat
    assert "30.0% in the worst layer (model.layers.2.mixer)" in flat
    assert "8.0% in the typical one of 3 MoE layers" in flat
    assert "2.00% rounded to 0" in flat and "FlashInfer >= 0.6.17" in flat
    assert "input_global_scale" in flat and "weight_scale_2 as an fp32 alpha" in flat
    j = A.to_json(reps, "test")["verdict"]
    assert j["damaged"] and j["worst_layer"] == "model.layers.2.mixer"


def test_verdict_not_damaged_and_dense_only():
    v = A.verdict([_report("m.layers.0.mixer", {1: 0.004, 2: 0.002})])
    assert not v.damaged and v.worst == pytest.approx(0.003)
    assert "Not damaged" in v.lines[0]
    v = A.verdict([_report("m.layers.0.mlp", {}, kind="dense")])
    assert not v.damaged and v.worst is None and "No MoE layer" in v.lines[0]


def test_short_names_unique_and_readable():
    names = [f"model.layers.{i}.mixer" for i in range(12)] + ["model.layers.3.mixer.shared.up"]
    s = A.short_names(names)
    assert len(set(s)) == len(s) and s[0] == "layers.0.mixer"
    assert s[-1] == "layers.3.mixer.shared.up"
    one = ["nemotron_super_layer1 (synthetic)"]
    assert A.short_names(one) == one


@pytest.mark.parametrize("n_layers", [1, 2, 12])
def test_plot_renders_for_any_number_of_layers(tmp_path, n_layers):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    reps = [_report(f"model.layers.{i}.mixer", {1: 0.3, 2: 0.2, 64: 0.1}) for i in range(n_layers)]
    reps += [_report(f"model.layers.{i}.mlp", {}, kind="dense") for i in range(n_layers)]
    made = []
    orig = plt.subplots

    def spy(*a, **k):
        made.append(orig(*a, **k))
        return made[-1]

    plt.subplots = spy
    try:
        A.plot(reps, str(tmp_path / "p.png"))
    finally:
        plt.subplots = orig
    with open(tmp_path / "p.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    fig, axes = made[0]
    labels = [t.get_text() for t in axes[0, 0].get_legend().get_texts()]
    assert len(labels) == len(set(labels)) and len(labels) <= A.PLOT_MAX_SERIES
    if n_layers > 1:
        ticks = [t.get_text() for t in axes[0, 1].get_xticklabels()]
        assert ticks[0] == "layers.0.mixer"


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_read_npz_every_truncation_and_bit_flip(tmp_path, save):
    """Each damaged .npz ends in a ValueError naming the file, or reads back."""
    from nvfp4_jax.explain import read_npz

    src, p = str(tmp_path / "g.npz"), str(tmp_path / "t.npz")
    save(src, x=np.arange(20.0), y=np.ones((3, 4), np.uint8))
    raw = open(src, "rb").read()
    damaged = [raw[:cut] for cut in range(0, len(raw), 5)]
    for pos in range(0, len(raw), 2):
        b = bytearray(raw)
        b[pos] ^= 1 << (pos % 8)
        damaged.append(bytes(b))
    errors = 0
    for d in damaged:
        with open(p, "wb") as f:
            f.write(d)
        try:
            z = read_npz(p)
        except ValueError as exc:
            assert str(exc).startswith(f"{p}: "), exc
            errors += 1
        else:
            assert set(z) <= {"x", "y"}
    assert errors > len(damaged) // 2


def test_read_npz_refuses_a_huge_declared_shape(tmp_path):
    """An array header claiming 2^40 elements allocates nothing."""
    import io

    from nvfp4_jax.explain import read_npz

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False,
                                               "shape": (2**40,)})
    p = str(tmp_path / "h.npz")
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("x.npy", buf.getvalue() + b"\0" * 64)
    with pytest.raises(ValueError, match=r"declares shape \(1099511627776,\)"):
        read_npz(p)
