"""``nvfp4_jax.explain`` / ``nvfp4 explain``: a wrong GEMM output is localised and its fault named.

The wrong outputs come from real backends with the fault injected into their operands (the
XLA backend through ``explain.demo_output``; TensorRT-LLM's re-enacted ``nvfp4_gemm``), never
from the hypothesis code under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from nvfp4_jax import crosscheck, explain
from nvfp4_jax.cli import main

#: fault injected by demo_output -> the hypothesis that must explain it
NAMED = {
    "weight_sf_layout": "weight_sf_layout",
    "weight_nibbles": "weight_nibbles",
    "weight_scale_folded": "weight_scale_folded",
    "alpha": "alpha",
    "split_k": "split_k2_missing_0",
}


@pytest.fixture(scope="module")
def case():
    return explain.demo_case(seed=3)


def test_a_correct_output_is_correct(case):
    e = explain.explain_gemm(case, explain.demo_output(case, "none"))
    assert e.verdict == "correct" and e.bad == 0 and e.attribution == []


@pytest.mark.parametrize("fault", sorted(NAMED))
def test_each_known_fault_is_named(case, fault):
    e = explain.explain_gemm(case, explain.demo_output(case, fault))
    assert e.verdict == "explained", e.format()
    assert e.best.name == NAMED[fault] and e.best.match == 1.0
    assert e.bad > 0 and e.oracle_match < 1.0


def test_missing_weight_scale_2_is_recognised_as_such(case):
    e = explain.explain_gemm(case, explain.demo_output(case, "alpha"))
    assert "weight_scale_2 missing from alpha" in e.best.meaning


def test_one_corrupted_scale_byte_is_attributed_to_its_block(case):
    out = explain.demo_output(case, "scale_byte")  # weight scale (3, 5) one E4M3 exponent up: x2
    e = explain.explain_gemm(case, out)
    assert e.verdict == "localised", e.format()
    cols = [a for a in e.attribution if a["axis"] == "column"]
    assert [(a["index"], a["block"]) for a in cols] == [(3, 5)]
    assert cols[0]["factor"] == pytest.approx(1.0, rel=1e-3)  # the block counts twice
    assert cols[0]["scale_byte"] == int(case.weight.scales[3, 5])
    # the rows hit are wrong only in column 3: no activation block explains a whole row
    assert [a for a in e.attribution if a["axis"] == "row"] == []


def test_an_error_that_is_no_block_multiple_is_not_attributed(case):
    out = explain.demo_output(case, "none")
    rng = np.random.default_rng(1)
    out[:, 7] += rng.standard_normal(out.shape[0]) * np.abs(out[:, 7]).max()  # noise in one column
    e = explain.explain_gemm(case, out)
    assert e.localisation["columns"] == "7"
    assert e.attribution == [] and e.verdict == "unexplained", e.format()


def test_an_unwritten_tile_is_localised(case):
    e = explain.explain_gemm(case, explain.demo_output(case, "unwritten_tile"))
    assert e.verdict == "localised"
    assert e.localisation["nan"] == 8 * 64
    assert "[0:8, 128:192]" in e.localisation["tiles"]
    assert e.localisation["rows"] == "0-7" and e.localisation["columns"] == "128-191"


def test_garbage_is_not_explained(case):
    """No hypothesis claims an output it does not reproduce."""
    m, n, _ = case.shape
    out = np.random.default_rng(0).standard_normal((m, n))
    e = explain.explain_gemm(case, out)
    assert e.verdict == "unexplained" and e.bad > 0.9 * e.total


def test_a_transposed_output_is_recognised(case):
    out = explain.demo_output(case, "none").T
    e = explain.explain_gemm(case, out)
    assert e.localisation["transposed"] and e.verdict == "correct"


@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), magnitude=st.integers(0, len(crosscheck.MAGNITUDES) - 1),
       fault=st.sampled_from(sorted(NAMED)))
def test_property_faults_are_named_at_every_magnitude(seed, magnitude, fault):
    """Over weight blocks spanning E4M3's subnormals and activation scales 1e-3..1e3, each
    injected fault is named (a local break of the hypothesis code, e.g. the nibble swap,
    makes this fail)."""
    c = crosscheck.make_case(seed, magnitude=magnitude)
    e = explain.explain_gemm(c, explain.demo_output(c, fault))
    assert e.verdict == "explained", e.format()
    assert e.best.name == NAMED[fault]


def test_nvfp4_gemm_form_activation_scales_in_the_wrong_layout():
    """TensorRT-LLM's op form: the activation scales were quantized swizzled (as fp4_quantize
    returns them for nvfp4_gemm) but the GEMM read them as linear."""
    from nvfp4_jax.interop import trtllm

    c = crosscheck.make_case(7)
    g = float(oracle.f32(1.0 / c.input_scale))
    act, act_sf = trtllm.fp4_quantize(c.x, g, fast_math=False, sf_layout="swizzled_128x4")
    m, kv = c.x.shape[0], c.x.shape[1] // 16
    wrong = act_sf.reshape(-1)[: m * kv].reshape(m, kv)
    w_codes, w_sf = c.weight.codes, c.weight.scales
    alpha = c.alpha
    out = trtllm.nvfp4_gemm(act, w_codes, wrong, w_sf, alpha, "float32").astype(np.float64)
    gc = explain.GemmCase.from_nvfp4_gemm(act, act_sf.reshape(-1), c.weight.codes, c.weight.scales,
                                          alpha, out_dtype="float32")
    assert gc.act_sf_layout == "swizzled_128x4" and gc.mode == "w4a4_prequantized"
    e = explain.explain_gemm(gc, out)
    assert e.verdict == "explained" and e.best.name == "act_sf_layout", e.format()
    good = trtllm.nvfp4_gemm(act, w_codes, trtllm.unswizzle_128x4(act_sf, m, kv), w_sf, alpha,
                             "float32").astype(np.float64)
    assert explain.explain_gemm(gc, good).verdict == "correct"


def test_npz_round_trip_and_cli(tmp_path, capsys):
    path = str(tmp_path / "call.npz")
    assert main(["explain", "--demo", "weight_nibbles", "--save", path, "--json", str(tmp_path / "e.json")]) == 1
    text = capsys.readouterr().out
    assert "verdict: explained by weight_nibbles" in text
    assert json.loads((tmp_path / "e.json").read_text())["best"]["name"] == "weight_nibbles"
    case, _ = explain.load_npz(path)
    assert case.weight_sf_layout == "swizzled_128x4" and case.mode == "w4a4"
    assert main(["explain", path]) == 1
    assert "verdict: explained by weight_nibbles" in capsys.readouterr().out
    assert main(["explain", "--demo", "none"]) == 0
    assert "verdict: correct" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["explain"], "give FILE.npz or --demo FAULT"),
    (["explain", "missing.npz"], "missing.npz"),
    (["explain", "--save", "x.npz", "f.npz"], "--save goes with --demo"),
])
def test_cli_errors_name_the_problem(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_operands_are_refused_with_the_argument_named(tmp_path, capsys):
    case = explain.demo_case()
    with pytest.raises(TypeError, match="weight_fp4: expected uint8"):
        explain.GemmCase.from_linear(case.x, case.weight.codes.astype(np.int8), case.weight.scales, 1.0)
    with pytest.raises(ValueError, match=r"weight_sf: expected linear scales \[256, 32\]"):
        explain.GemmCase.from_linear(case.x, case.weight.codes, case.weight.scales[:, :8], 1.0,
                                     weight_sf_layout="linear")
    with pytest.raises(ValueError, match=r"out: expected \[16, 256\]"):
        explain.explain_gemm(case, np.zeros((3, 3)))
    path = str(tmp_path / "partial.npz")
    np.savez(path, x=case.x, weight_fp4=case.weight.codes, out=np.zeros((16, 256)))
    assert main(["explain", path]) == 2
    assert "missing ['weight_sf', 'weight_scale_2']" in capsys.readouterr().err
