"""``nvfp4 selftest`` on CPU: it passes and writes its JSON; a broken backend makes it exit 1
and leave an .npz that ``nvfp4 explain`` reads and attributes."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax import attention, cli, explain, selftest


def _only_check_fails(tmp_path, capsys, only: str) -> dict:
    """``nvfp4 selftest --only ONLY`` exits 1; its one check, as the JSON reports it."""
    path = tmp_path / "s.json"
    rc = cli.main(["selftest", "--only", only, "--json", str(path),
                   "--out-dir", str(tmp_path / "fail")])
    assert rc == 1, capsys.readouterr().out
    (c,) = json.loads(path.read_text())["checks"]
    assert c["status"] == "FAIL", c["detail"]
    return c


def test_cpu_selftest_passes_and_writes_the_json(tmp_path, capsys):
    path = tmp_path / "selftest.json"
    rc = cli.main(["selftest", "--json", str(path), "--out-dir", str(tmp_path / "fail"),
                   "--only",
                   "quantize/b12x,matmul/pallas/w4a4,matmul/xla,moe/pallas-triton/trtllm"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    d = json.loads(path.read_text())
    assert d["verdict"] == "PASS"
    for key in ("device_kind", "compute_capability", "driver", "jax", "jaxlib", "triton"):
        assert key in d["device"]
    assert d["device"]["platform"] == "cpu" and d["device"]["compute_capability"] is None
    assert set(d["kernels"]) == {"quantize/b12x", "matmul/pallas/w4a4", "matmul/xla/w4a16",
                                 "matmul/xla/w4a4", "moe/pallas-triton/trtllm_cutlass/relu2"}
    assert all(c["status"] == "PASS" and c["npz"] is None for c in d["checks"])
    assert any("E4M3-subnormal" in c["detail"] and not c["detail"].startswith("byte-exact (0 ")
               for c in d["checks"] if c["kernel"] == "quantize/b12x")
    assert not (tmp_path / "fail").exists()


def test_the_cpu_plan_covers_every_kernel_family(monkeypatch):
    kernels = {k for k, _, _ in selftest.plan(None)}
    assert {"quantize/trtllm", "quantize/modelopt", "quantize/jax", "quantize/b12x",
            "matmul/pallas/w4a16", "matmul/pallas/w4a4", "matmul/xla/w4a16", "matmul/xla/w4a4",
            } <= kernels
    assert {k.split("/")[1] for k in kernels if k.startswith("moe/")
            and k not in ("moe/routing", "moe/norm_router")} == {
        "pallas-triton", "pallas-triton-fp4", "xla"}
    assert "matmul/fp4mma/w4a4" in kernels and {"attention/decode", "attention/qkv"} <= kernels
    assert {"moe/routing", "moe/norm_router", "linear/norm_linear"} <= kernels
    gpu90 = {k for k, _, _ in selftest.plan(90)}
    assert {"attention/decode", "attention/qkv", "moe/routing", "linear/norm_linear"} <= gpu90
    assert "matmul/mosaic/w4a4" in gpu90 and any(k.startswith("moe/mosaic/") for k in gpu90)
    assert "matmul/fp4mma/w4a4" in gpu90  # Triton's decomposed scaled dot on sm_90
    from nvfp4_jax.gemm import mosaic

    monkeypatch.setattr(mosaic, "has_mma_sync", lambda: False)  # JAX 0.10: no plgpu.mma
    sm120 = {k for k, _, _ in selftest.plan(120)}
    assert "matmul/pallas/w4a4" in sm120 and not any("mosaic" in k for k in sm120)
    assert "matmul/fp4mma/w4a4" in sm120 and any("pallas-triton-fp4" in k for k in sm120)
    monkeypatch.setattr(mosaic, "has_mma_sync", lambda: True)  # the mma.sync form
    for cc in (120, 121):
        sm12x = {k for k, _, _ in selftest.plan(cc)}
        assert {"matmul/mosaic/w4a16", "matmul/mosaic/w4a4"} <= sm12x
        assert any(k.startswith("moe/mosaic/") for k in sm12x)
        # what nvfp4 generate runs there, never yet run
        assert {"attention/decode", "attention/qkv", "linear/norm_linear"} <= sm12x
        assert {"moe/routing", "moe/norm_router"} <= sm12x
    sm89 = {k for k, _, _ in selftest.plan(89)}  # no scaled dot in jaxlib's Triton before sm_90
    assert "matmul/pallas/w4a4" in sm89 and not any("fp4" in k for k in sm89)


def test_a_broken_backend_fails_with_an_npz_that_explain_attributes(tmp_path, monkeypatch, capsys):
    api = importlib.import_module("nvfp4_jax.gemm.api")
    real = api.matmul_xla

    def flipped(x, w_codes, w_scales, alpha, **kw):
        """Weight row 5's largest block scale byte with one exponent bit flipped (x2 or /2)."""
        u8 = jax.lax.bitcast_convert_type(w_scales, jnp.uint8)
        j = jnp.argmax(u8[5])
        u8 = u8.at[5, j].set(u8[5, j] ^ jnp.uint8(0x08))
        return real(x, w_codes, jax.lax.bitcast_convert_type(u8, w_scales.dtype), alpha, **kw)

    monkeypatch.setattr(api, "matmul_xla", flipped)
    path = tmp_path / "s.json"
    rc = cli.main(["selftest", "--only", "matmul/xla/w4a16", "--json", str(path),
                   "--out-dir", str(tmp_path / "fail")])
    printed = capsys.readouterr().out
    assert rc == 1, printed
    d = json.loads(path.read_text())
    assert d["verdict"] == "FAIL" and d["kernels"] == {"matmul/xla/w4a16": "FAIL"}
    failed = [c for c in d["checks"] if c["status"] == "FAIL"]
    assert failed and all(c["npz"] and os.path.exists(c["npz"]) for c in failed)
    for c in failed:
        case, out = explain.load_npz(c["npz"])
        e = explain.explain_gemm(case, out)
        assert e.verdict != "correct"
        assert e.localisation["columns"] == "5", e.format()  # output column = the weight row
        if case.shape[0] >= 4:  # enough rows to identify the block: the scale byte is named
            j = int(np.argmax(case.weight.scales[5]))
            named = {(a["operand"], a["index"], a["block"]) for a in e.attribution}
            assert named == {("weight", 5, j)}, e.format()
    assert "FAIL  matmul/xla/w4a16" in printed
    assert cli.main(["explain", failed[0]["npz"], "--out-dtype", "float32"]) == 1
    assert np.isfinite(failed[0]["seconds"])


def test_a_qkv_attention_with_swapped_norms_fails_with_an_npz(tmp_path, monkeypatch, capsys):
    """attention/qkv holds the kernel to the oracle: q normed with k's RMSNorm weight and k
    with q's (a wrong row of the packed norms) fails, and the failure's inputs are saved."""
    real = attention.decode_qkv_attention

    def swapped(qkv, k, v, layer, start, *, q_norm=None, k_norm=None, **kw):
        return real(qkv, k, v, layer, start, q_norm=k_norm, k_norm=q_norm, **kw)

    monkeypatch.setattr(attention, "decode_qkv_attention", swapped)
    c = _only_check_fails(tmp_path, capsys, "attention/qkv")
    assert "new k values off the oracle's" in c["detail"], c["detail"]
    saved = np.load(c["npz"])
    assert {"qkv", "k", "v", "norms", "k_new", "k_lo", "k_hi"} <= set(saved.files)
    assert ((saved["k_new"] < saved["k_lo"]) | (saved["k_new"] > saved["k_hi"])).any()


def test_a_norm_linear_reading_another_layer_fails_with_an_npz(tmp_path, monkeypatch, capsys):
    """linear/norm_linear holds nn.norm_linear to the oracle's interval: the norm weight of
    layer 0 where the scan is at layer 1 fails, and the failure's inputs are saved."""
    from nvfp4_jax import nn

    real = nn.norm_linear

    def first_layer(p, x, norm_weight=None, eps=1e-6, *, layer=None, **kw):
        return real(p, x, norm_weight, eps, layer=None if layer is None else layer * 0, **kw)

    monkeypatch.setattr(nn, "norm_linear", first_layer)
    path = tmp_path / "s.json"
    assert cli.main(["selftest", "--only", "linear/norm_linear", "--json", str(path),
                     "--out-dir", str(tmp_path / "fail")]) == 1, capsys.readouterr().out
    # the CPU's plain composition takes the layer's own Linear (its input scale), not the stacks
    (c,) = [c for c in json.loads(path.read_text())["checks"] if "rmsnorm" in c["shape"]]
    assert c["status"] == "FAIL" and "outside the norm_linear interval" in c["detail"], c
    saved = np.load(c["npz"])
    assert {"x", "norm_weight", "input_scales", "out", "lo", "hi"} <= set(saved.files)
    assert ((saved["out"] < saved["lo"]) | (saved["out"] > saved["hi"])).any()


@pytest.mark.gpu
def test_gpu_selftest_passes_for_every_backend_without_xla_flags(tmp_path):
    """On the GPU, in a process without XLA_FLAGS: every kernel the device runs passes."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    path = tmp_path / "selftest.json"
    p = subprocess.run([sys.executable, "-m", "nvfp4_jax.cli", "selftest", "--json", str(path),
                        "--out-dir", str(tmp_path / "fail")], env=env, capture_output=True,
                       text=True, timeout=1800, check=False)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    d = json.loads(path.read_text())
    assert d["verdict"] == "PASS" and d["device"]["compute_capability"] is not None
    families = {k.split("/")[0] + "/" + k.split("/")[1] for k in d["kernels"]}
    assert {"matmul/pallas", "matmul/xla", "moe/pallas-triton", "moe/xla"} <= families


def test_the_default_gpu_plan_is_small_covers_every_kernel_and_full_adds_shapes():
    """Every kernel of the sm_90 device at a few edge shapes, every (mode, activation) pair
    once per MoE path; --full adds shapes, never kernels; --fuzz sets inputs per compile."""
    quick, full = selftest.plan(90), selftest.plan(90, full=True)
    kq = {k for k, _, _ in quick}
    assert kq == {k for k, _, _ in full}
    assert len(full) > len(quick)
    assert {"matmul/pallas/w4a16", "matmul/pallas/w4a4", "matmul/mosaic/w4a16",
            "matmul/mosaic/w4a4", "matmul/xla/w4a16", "matmul/xla/w4a4"} <= kq
    for path in ("pallas-triton", "pallas-triton-fp4", "mosaic", "xla"):
        assert {tuple(k.split("/")[2:]) for k in kq if k.startswith(f"moe/{path}/")} == {
            (m, a) for m in ("trtllm_cutlass", "b12x") for a in ("relu2", "swiglu")}, path
    gemm = {tuple(map(int, s.split("x"))) for k, s, _ in quick if k == "matmul/pallas/w4a16"}
    assert any(m == 1 for m, _, _ in gemm)  # decode
    assert any(m % 16 and m > 16 for m, _, _ in gemm)  # ragged M beyond one block
    assert any(k % 256 for _, _, k in gemm)  # K not a multiple of 256
    assert {s for k, s, _ in quick if k == "matmul/mosaic/w4a16"}  # Mosaic gets its shapes
    # one compile per check: 53 on sm_90, 3 of them attention (the decoders' q/k/v step with
    # and without q/k norms, and ragged lengths), 2 routing, 2 norm_router, 3 norm_linear
    assert len(quick) <= 53, len(quick)
    assert all(fn.inputs == selftest.FUZZ["gpu"] for _, _, fn in quick)
    assert all(fn.inputs == 5 for _, _, fn in selftest.plan(120, fuzz=5))
    with pytest.raises(ValueError, match="fuzz"):
        selftest.plan(None, fuzz=0)


def test_fuzzed_inputs_share_one_compile_and_the_json_counts_them(tmp_path, capsys):
    """More inputs per check, no more compiles: each check compiles its kernel once."""
    runs = {}
    for fuzz in (1, 3):  # the fuzz=3 run second: helpers compiled by the first stay compiled
        path = tmp_path / f"s{fuzz}.json"
        assert cli.main(["selftest", "--only", "matmul/xla/w4a16", "--fuzz", str(fuzz),
                         "--json", str(path), "--out-dir", str(tmp_path / "f")]) == 0
        runs[fuzz] = json.loads(path.read_text())
    printed = capsys.readouterr().out
    assert "compiles" in printed and "checks, " in printed
    one, three = runs[1], runs[3]
    assert [c["inputs"] for c in three["checks"]] == [3] * len(three["checks"])
    assert three["summary"]["inputs"] == 3 * one["summary"]["inputs"]
    assert all(c["compiles"] >= 1 and c["compile_s"] > 0 for c in one["checks"])
    assert [c["compiles"] for c in three["checks"]] == [1] * len(three["checks"])
    assert three["options"] == {"full": False, "fuzz": 3, "seed": 0, "only": ["matmul/xla/w4a16"],
                                "jobs": 1}
    assert all(c["detail"].startswith("within the oracle's bound on 3 inputs")
               for c in three["checks"])


def test_selftest_refuses_a_fuzz_below_one(capsys):
    assert cli.main(["selftest", "--fuzz", "0"]) == 2
    assert "--fuzz" in capsys.readouterr().err


def test_a_broken_moe_path_fails_against_the_shared_bound_with_an_npz(tmp_path, monkeypatch,
                                                                      capsys):
    """The XLA MoE with its output scaled by 1 + 2^-6 (a few bf16 ulps) fails on the bound
    every path shares; the .npz holds the inputs, the output and the oracle's."""
    api = importlib.import_module("nvfp4_jax.moe.api")
    real = api.moe_xla
    monkeypatch.setattr(api, "moe_xla", lambda *a, **kw: real(*a, **kw) * (1 + 2.0**-6))
    c = _only_check_fails(tmp_path, capsys, "moe/xla/trtllm_cutlass")
    assert c["detail"].startswith("input 0: moe xla:"), c["detail"]
    d = np.load(c["npz"])
    assert {"hidden", "topk_ids", "fc1_codes", "fc2_scales", "out", "oracle_out"} <= set(d.files)
    assert np.allclose(d["out"], d["oracle_out"] * (1 + 2.0**-6), rtol=2.0**-7)


@pytest.mark.parametrize("fault", ["other_layer", "one_key_short"])
def test_a_broken_decode_attention_fails_with_an_npz(tmp_path, monkeypatch, capsys, fault):
    """Reading the stack's other layer, or one key fewer than ``lengths`` (an off-by-one at
    the chunk's end), fails against ``oracle.decode_attention_error_bound``; the .npz holds
    the inputs, the output and the oracle's."""
    attention = importlib.import_module("nvfp4_jax.attention")
    real = attention.decode_attention

    def broken(q, k, v, layer, lengths, *, interpret=False):
        if fault == "other_layer":
            layer = 1 - layer
        else:
            lengths = jnp.maximum(lengths - 1, 1)
        return real(q, k, v, layer, lengths, interpret=interpret)

    monkeypatch.setattr(attention, "decode_attention", broken)
    c = _only_check_fails(tmp_path, capsys, "attention/decode")
    assert "outside the oracle's bound" in c["detail"], c["detail"]
    d = np.load(c["npz"])
    assert {"q", "k", "v", "lengths", "out", "oracle", "bound"} <= set(d.files)
    assert (np.abs(d["out"] - d["oracle"]) > d["bound"]).any()


@pytest.mark.parametrize("fault", ["other_expert", "no_renormalization", "hidden_unchecked"])
def test_a_broken_routing_kernel_fails_with_an_npz(tmp_path, monkeypatch, capsys, fault):
    """Routing a token to the next expert, weights never renormalized, or the hidden rows'
    check skipped each fail ``moe/routing``; the .npz holds the logits and both results."""
    sk = importlib.import_module("nvfp4_jax.moe.select_kernel")
    real = sk.select_kernel

    def broken(logits, hidden, top_k, *, renormalize=False, interpret=False):
        if fault == "no_renormalization":
            renormalize = False
        if fault == "hidden_unchecked":
            hidden = jnp.zeros_like(hidden)
        ids, w = real(logits, hidden, top_k, renormalize=renormalize, interpret=interpret)
        if fault == "other_expert":
            ids = (ids + 1) % logits.shape[1]
        return ids, w

    monkeypatch.setattr(sk, "select_kernel", broken)
    c = _only_check_fails(tmp_path, capsys, "moe/routing")
    want = {"other_expert": "route to other experts", "no_renormalization": "/ bound",
            "hidden_unchecked": "finite weights"}[fault]
    assert want in c["detail"], c["detail"]
    d = np.load(c["npz"])
    assert {"logits", "hidden", "ids", "weights", "oracle_ids", "oracle_weights"} <= set(d.files)


@pytest.mark.parametrize("fault", ["other_layer", "unrounded_logits", "sum_is_x"])
def test_a_broken_norm_router_fails_with_an_npz(tmp_path, monkeypatch, capsys, fault):
    """The norm weight and router read at layer 0 instead of the given layer, logits left
    unrounded to bf16, or the residual add's sum returned as x, fail ``moe/norm_router``; the
    .npz holds the inputs and intervals (or the sums)."""
    from nvfp4_jax import nn

    real = nn.norm_router_kernel

    def broken(x, norm_weight, router, eps, *, layer=None, residual=None, interpret=False):
        if fault == "other_layer":
            layer = jnp.int32(0)
        out = real(x, norm_weight, router, eps, layer=layer, residual=residual,
                   interpret=interpret)
        if fault == "unrounded_logits":
            out = (*out[:-1], out[-1] * (1 + 2.0**-12))
        if fault == "sum_is_x" and residual is not None:
            out = (x, *out[1:])
        return out

    monkeypatch.setattr(nn, "norm_router_kernel", broken)
    c = _only_check_fails(tmp_path, capsys, "moe/norm_router")
    want = {"other_layer": "normed values outside", "unrounded_logits": "logits outside",
            "sum_is_x": "sums x + a not the bf16 add"}[fault]
    assert want in c["detail"], c["detail"]
    d = np.load(c["npz"])
    keys = ({"x", "a", "sum", "want"} if fault == "sum_is_x"
            else {"x", "norm_weight", "router", "h", "logits", "logits_lo", "logits_hi"})
    assert keys <= set(d.files)


def test_jobs_run_checks_at_once_and_report_them_in_plan_order(tmp_path, capsys):
    only = ["--only", "quantize/jax,matmul/xla/w4a4"]
    docs = {}
    for jobs in (1, 3):
        path = tmp_path / f"j{jobs}.json"
        assert cli.main(["selftest", *only, "--jobs", str(jobs), "--json", str(path),
                         "--out-dir", str(tmp_path / "f")]) == 0
        docs[jobs] = json.loads(path.read_text())
    order = [[(c["kernel"], c["shape"]) for c in docs[j]["checks"]] for j in (1, 3)]
    assert order[0] == order[1] and len(order[0]) == 6
    # each thread counts its own compiles: every check sees the one of its kernel
    assert all(c["compiles"] >= 1 for c in docs[3]["checks"])
    assert docs[3]["options"]["jobs"] == 3 and docs[3]["summary"]["wall_s"] > 0
    assert cli.main(["selftest", "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_a_misplaced_o_proj_operand_fails_attention_qkv(tmp_path, monkeypatch, capsys):
    """The attention's last launch writing o_proj's operand in plain K order (not the Mosaic
    GEMM's permutation) fails ``attention/qkv``; the .npz holds the output, the input scale,
    the operand and the oracle's."""
    from nvfp4_jax import attention

    monkeypatch.setattr(attention, "mosaic_columns", lambda cols: cols)
    c = _only_check_fails(tmp_path, capsys, "attention/qkv")
    assert "o_proj's operand" in c["detail"], c["detail"]
    assert {"out", "input_scale", "operand", "oracle"} <= set(np.load(c["npz"]).files)
