"""The Pallas-Triton MoE candidate sweep of bench/moe_bench.py (``--candidates``, run on the GPU
in one call): the candidate lists are valid configs, a CPU smoke run writes its records (an
error in one candidate leaves the others timed; the Mosaic reference is skipped with its
reason off sm_90), and every candidate computes the same layer as the default config."""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import moe_bench as mb
import numpy as np
import pytest
from moe_cases import check_against_oracle, make_case

import nvfp4_jax
from nvfp4_jax.gemm.decode import DECODE_MODES, check_tile_config
from nvfp4_jax.moe.configs import MoEConfig, default_config
from nvfp4_jax.moe.pallas_triton import moe_pallas

H200_SMEM = 227 * 1024  # shared memory per block on sm_90


def _stage_bytes(c) -> int:
    """One pipeline stage of a grouped GEMM: weight codes, scale bytes, both bf16 halves of
    the activation rows."""
    return c.block_n * c.block_k // 2 + c.block_n * c.block_k // 16 + c.block_m * c.block_k * 2


@pytest.mark.parametrize("shape", ["qwen3_30b", "nemotron"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_candidates_are_valid_configs(shape, t):
    s = mb.SHAPES[shape]
    gated = s["activation"] == "swiglu"
    cands = mb.moe_sweep_candidates(shape, t)
    labels = [label for label, _ in cands]
    assert len(labels) == len(set(labels)) and len(cands) >= 6
    configs = [c for _, c in cands]
    assert len({(c.fc1, c.fc2, c.mma) for c in configs}) == len(configs)
    lib = default_config(t * s["top_k"], s["experts"], inter=s["inter"], hidden=s["hidden"],
                         gated=gated)
    assert cands[0] == ("default", lib)
    for d in {"asm", "asmm", "asm2m"} - {lib.fc1.decode}:
        assert dict(cands)[f"default_{d}"] == lib.with_decode(d)
    for label, cfg in cands:
        assert isinstance(cfg, MoEConfig), label
        MoEConfig(cfg.fc1, cfg.fc2, cfg.mma)  # the MoE's own checks (equal block_m, mma)
        for c in (cfg.fc1, cfg.fc2):
            check_tile_config(c, ("block_m", "block_n", "block_k", "num_warps"))
            assert c.decode in DECODE_MODES and c.num_stages >= 2, label
            assert (c.num_stages - 1) * _stage_bytes(c) <= H200_SMEM, label
        if gated:  # two accumulators: default_config's register limit
            assert cfg.fc1.block_n <= 64 and cfg.fc1.block_m <= 64, label
        assert cfg.fc1.block_m == 16, label  # T <= 64: decode regime, one expert per 16 rows
        if label.startswith("default_"):
            assert cfg.fc1.decode == cfg.fc2.decode == label.split("_", 1)[1], label
        elif label != "default":  # the label ends with the decode
            assert cfg.fc1.decode == cfg.fc2.decode == label.rsplit("_", 1)[1], label


def test_candidates_smoke_run_records_errors_and_the_reference(tmp_path, monkeypatch):
    """--candidates end to end on CPU (interpret mode, decode "bits", times meaningless): one
    candidate forced to raise is recorded with its error and the others are still timed;
    the Mosaic reference is skipped with its reason, never faked."""
    monkeypatch.setattr(mb, "NROT", 1)
    monkeypatch.setattr(mb, "INNER_ROUNDS", 1)
    cands = mb.moe_sweep_candidates("tiny", 1)
    broken = cands[3][1]  # a tile variant: in interpret mode (decode "bits") the decode-only
    # candidates run the default's config, which must not fail
    real_layer = mb.nvfp4_layer

    def layer(activation, backend="pallas", config=None, **select):
        if config is not None and config == broken.with_decode("bits"):
            raise RuntimeError("injected failure")
        return real_layer(activation, backend, config, **select)

    monkeypatch.setattr(mb, "nvfp4_layer", layer)
    monkeypatch.setattr(mb, "moe_sweep_candidates", lambda shape, t: cands[:4])
    argv = ["moe_bench.py", "--candidates", "--shapes", "tiny", "--tokens", "1", "--repeats",
            "2", "--quick", "--budget-s", "600", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    mb.main()
    [path] = list(tmp_path.glob("moe-candidates-*.json"))
    doc = json.loads(path.read_text())
    for key in ("date", "commit", "gpu", "jax", "records", "repeats"):
        assert key in doc, key
    recs = {r["label"]: r for r in doc["records"]}
    assert list(recs) == ["mosaic"] + [label for label, _ in cands[:4]]
    assert "sm_90" in recs["mosaic"]["skipped"] and "median_us" not in recs["mosaic"]
    bad = recs[cands[3][0]]
    assert "injected failure" in bad["error"] and "median_us" not in bad
    for label, cfg in cands[:4]:
        r = recs[label]
        assert r["shape"] == "tiny" and r["T"] == 1 and r["backend"] == "pallas"
        assert r["fc1"]["block_n"] == cfg.fc1.block_n and r["fc2"]["decode"] == cfg.fc2.decode
        if label == cands[3][0]:
            continue
        assert r["decode_run"] == "bits" and r["ratio_vs_mosaic"] is None
        assert len(r["rounds_us"]) == 2 and r["median_us"] == float(np.median(r["rounds_us"]))
    table = mb.moe_candidates_table(doc)
    assert table.count("| tiny | 1 |") == 3 and "injected failure" in table


def test_budget_stops_compiles_and_records_the_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(mb, "moe_sweep_candidates", lambda shape, t: [("a", MoEConfig())])
    doc = mb.candidates_sweep(str(tmp_path / "c.json"), ["tiny"], [1], budget_s=-1.0,
                              repeats=1)
    assert [(r["label"], r.get("skipped")) for r in doc["records"]][1:] == [("a", "budget")]


def _layer(shape, t):
    """A small layer with the activation of ``shape`` and widths every candidate tile covers
    (K >= 256, N >= 128), oracle form, and its arguments for ``moe_pallas``."""
    act = mb.SHAPES[shape]["activation"]
    case = make_case(np.random.default_rng(t), t=t, h=256, inter=128, e=4, k=2, activation=act)
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    args = (jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(ids, jnp.int32),
            jnp.asarray(wts, jnp.float32), nvfp4_jax.from_oracle(fc1), nvfp4_jax.from_oracle(fc2),
            jnp.asarray(s1, jnp.float32), jnp.asarray(s2, jnp.float32))
    return case, args, act


def _run_candidates(shape, cands, decode=None):
    """(label, out, h) of each (label, MoEConfig) in ``cands`` on the small layer with the
    activation of ``shape``; ``decode`` replaces the candidates' decode (interpret mode runs
    "bits" only)."""
    case, args, act = _layer(shape, 5)
    on_cpu = jax.default_backend() != "gpu"
    outs = []
    for label, cfg in cands:
        fn = functools.partial(moe_pallas, activation=act, gate_up_order="up_gate",
                               mode="trtllm_cutlass", activation_scale="scalar",
                               config=cfg.with_decode(decode) if decode else cfg,
                               interpret=on_cpu, return_intermediates=True)
        out, inter = jax.jit(fn)(*args)
        f = functools.partial(np.asarray, dtype=np.float64)
        outs.append((label, f(out.astype(jnp.float32)), f(inter["h"].astype(jnp.float32))))
    return case, act, outs


@pytest.mark.parametrize("shape,t", [("qwen3_30b", 8), ("nemotron", 1)])
def test_candidates_compute_the_default_layer(shape, t):
    """Every candidate's tiles give the default's output bit for bit (a candidate can never
    be fast and wrong), and the default's is within the oracle's bounds; interpret mode with
    the portable decode "bits" (the GPU test below runs the candidates' own decodes)."""
    case, act, outs = _run_candidates(shape, mb.moe_sweep_candidates(shape, t), decode="bits")
    _, out0, h0 = outs[0]
    check_against_oracle(case, out0, h0, mode="trtllm_cutlass", activation=act)
    for label, out, h in outs[1:]:
        np.testing.assert_array_equal(h, h0, err_msg=label)
        np.testing.assert_array_equal(out, out0, err_msg=label)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("shape", ["qwen3_30b", "nemotron"])
def test_candidates_on_gpu_match_the_oracle_and_the_default(shape):
    """On the GPU, every distinct candidate of T = 1, 8, 64, with its own decode ("asm" /
    "asmm" / "asm2m" inline PTX), is within the oracle's bounds and equal bit for bit to the default
    config's output."""
    cands = {}
    for t in (1, 8, 64):
        for label, cfg in mb.moe_sweep_candidates(shape, t):
            cands.setdefault(cfg, f"{label}@T={t}")
    case, act, outs = _run_candidates(shape, [(label, c) for c, label in cands.items()])
    _, out0, h0 = outs[0]
    for label, out, h in outs:
        check_against_oracle(case, out, h, mode="trtllm_cutlass", activation=act)
        np.testing.assert_array_equal(h, h0, err_msg=label)
        np.testing.assert_array_equal(out, out0, err_msg=label)


def test_mosaic_sync_candidate_is_the_auto_config_on_mma_sync():
    """``--candidates``' ``mosaic_sync`` row: the Mosaic MoE's own config for the layer and T
    as SM 12.x gets it (``SM12X_GEMMS``' tiles where it has them) with both grouped GEMMs in
    their mma.sync form, nothing else changed."""
    from nvfp4_jax.moe import mosaic as moe_mosaic

    for name, t in (("qwen3_30b", 1), ("qwen3_30b", 8), ("nemotron", 8), ("nemotron", 64)):
        s = mb.shape_of(name)
        auto = moe_mosaic.auto_config(t * s["top_k"], s["experts"], hidden=s["hidden"],
                                      rows1=mb.fc1_rows(s), inter=s["inter"], sm12x=True)
        got = mb.mosaic_sync_config(s, t)
        assert (got.fc1, got.fc2) == (auto.fc1.sync_form(), auto.fc2.sync_form())
        assert got.fc1.mma == got.fc2.mma == "sync"
        assert (got.block_m, got.routing, got.epilogue) == (auto.block_m, auto.routing, auto.epilogue)
    assert mb.fc1_rows(mb.shape_of("qwen3_30b")) == 2 * 768 and mb.fc1_rows(mb.shape_of("nemotron")) == 2688
