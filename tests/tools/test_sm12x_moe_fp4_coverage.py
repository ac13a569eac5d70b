"""bench/results/moe-fp4mma-sm12x-compile.json covers every MoE row bench/sm12x_model.py
predicts: for each layer and T of the model's rows, the FC1 and FC2 tiles the library's default
config picks (``MoEConfig.mma="fp4"``) have exactly one compiled kernel that lists that T, with
clean sm_120a and sm_121a builds holding the FP4 OMMA, so no MoE row is left without an issue
ceiling. The tiles come from ``nvfp4_jax.moe.configs.default_config``, not from the compile
tool."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from bench_modules import RESULTS, fresh

COMPILE_JSON = os.path.join(RESULTS, "moe-fp4mma-sm12x-compile.json")

# RTX 5060 Ti: 36 SMs x 4 warp-instructions/clock x 2.572 GHz
ISSUE_5060 = 36 * 4 * 2.572e9


@pytest.fixture(scope="module")
def model():
    return fresh("sm12x_model")


@pytest.fixture(scope="module")
def stored() -> dict:
    with open(COMPILE_JSON) as f:
        return json.load(f)


def _wanted(model) -> list[tuple[str, int, str, dict]]:
    """(layer, T, gemm, tile config) of every MoE GEMM the model predicts."""
    from nvfp4_jax.moe.configs import default_config

    out = []
    for layer, s in model.MOE_SHAPES.items():
        for t in model.MOE_TOKENS:
            cfg = default_config(t * s["top_k"], s["experts"], inter=s["inter"],
                                 hidden=s["hidden"], gated=s["gated"], mma="fp4")
            out += [(layer, t, "fc1", dataclasses.asdict(cfg.fc1)),
                    (layer, t, "fc2", dataclasses.asdict(cfg.fc2))]
    return out


def test_every_predicted_moe_gemm_has_one_compiled_kernel(model, stored):
    """Each (layer, T, GEMM) of the model's rows, T = 1 included, is served by exactly one
    stored kernel of the same tiles whose sm_120a and sm_121a builds compiled to the NVFP4
    block-scaled OMMA and nothing else: XLA's Triton (the model's first choice) always, pip
    Triton's where it ran (sm_121a from pip Triton 3.8 on, as ``check_moe`` has it)."""
    assert set(model.MOE_TOKENS) >= {1, 8, 16, 64}
    pip = stored.get("pip_triton")
    builds = ["xla_sm120", "xla_sm121"] + (["pip_sm120"] if pip else []) + (
        ["pip_sm121"] if pip and tuple(int(v) for v in pip.split(".")[:2]) >= (3, 8) else [])
    missing = []
    for layer, t, gemm, tiles in _wanted(model):
        serving = [e for e in stored["kernels"]
                   if e["kernel"].startswith(f"moe_fp4_{gemm}_{layer}_T")
                   and t in e.get("tokens", ())]
        if len(serving) != 1:
            missing.append(f"{layer} T={t} {gemm}: {len(serving)} kernels serve it")
            continue
        (e,) = serving
        # the FP4 MMA decodes nothing: a config's bf16 decode flavour does not change it
        if ({k: v for k, v in e["config"].items() if k != "decode"}
                != {k: v for k, v in tiles.items() if k != "decode"}):
            missing.append(f"{layer} T={t} {gemm}: compiled {e['config']}, default {tiles}")
        for build in builds:
            r = e.get(build) or {"error": "not built"}
            if "error" in r or not (r["FP4_MMA"] > 0 and r["FP4_MMA"] == r["OMMA"]
                                    and r["HMMA"] == r["QMMA"] == 0):
                missing.append(f"{e['kernel']} {build}: {r.get('error') or r['mma_forms']}")
            elif r["ptx_target"] != f"sm_{build[-3:]}a":
                missing.append(f"{e['kernel']} {build}: PTX target {r['ptx_target']}")
    assert not missing, "\n".join(missing)
    assert stored["fp4_mma_ok"] and not stored["problems"]


def test_compile_tool_covers_the_model_tokens(model):
    """``sm12x_fp4mma_compile --moe`` compiles at the model's T, and its plan gives each (GEMM,
    T) to one kernel of the default tiles at that T."""
    from nvfp4_jax.moe.configs import default_config

    sc = fresh("sm12x_fp4mma_compile")
    assert tuple(sc.MOE_FP4_TOKENS) == tuple(model.MOE_TOKENS)
    for layer in model.MOE_SHAPES.values():
        plan = sc.moe_kernel_plan(layer)
        seen = [(p["gemm"], t) for p in plan for t in p["tokens"]]
        assert sorted(seen) == sorted((g, t) for g in ("fc1", "fc2") for t in model.MOE_TOKENS)
        for p in plan:
            assert p["T"] == min(p["tokens"])
            for t in p["tokens"]:
                cfg = default_config(t * layer["top_k"], layer["experts"], inter=layer["inter"],
                                     hidden=layer["hidden"], gated=layer["gated"], mma="fp4")
                assert getattr(cfg, p["gemm"]) == p["config"]


def test_no_moe_row_lacks_an_issue_ceiling(model):
    """Built from the stored counts, every MoE row has a count for FC1 and FC2 taken from a
    kernel of the same tiles, and the stored Markdown table says 'none' nowhere."""
    doc = model.build(RESULTS)
    assert {(r["shape"], r["T"]) for r in doc["moe"]} == {
        (s, t) for s in model.MOE_SHAPES for t in model.MOE_TOKENS}
    for r in doc["moe"]:
        assert None not in r["warp_instructions_per_weight"], (r["shape"], r["T"], r["ipw_from"])
        assert all(h.startswith("same tiles: moe_fp4_") for h in r["ipw_from"])
    with open(os.path.join(RESULTS, "sm12x-predictions.md")) as f:
        sections = f.read().split("\n\n")
    (section,) = [s for s in sections
                  if s.startswith("Routed MoE layer (FC1 + FC2), Pallas-Triton")]
    table = sections[sections.index(section) + 1]
    moe_rows = [ln for ln in table.splitlines() if ln.startswith(("| qwen3_30b |", "| nemotron |"))]
    assert len(moe_rows) == len(model.MOE_SHAPES) * len(model.MOE_TOKENS)
    assert not [ln for ln in moe_rows if "none" in ln]


def test_t1_fc2_issue_time_uses_its_own_tile(model, stored):
    """qwen3_30b at T = 1 on the RTX 5060 Ti: FC2 runs 16 x 64 x 256 tiles (8 routed rows over
    8 experts), so its count is that kernel's main loop x 4 warps / (64 x 256) weights, not the
    16 x 128 x 256 kernel's of T >= 8; issue time over 8 row tiles of FC1 [1536, 2048] (gate +
    up: 2 x 64 x 256 weights per iteration) and FC2 [2048, 768]."""

    def loop(gemm: str, t: int) -> dict:
        (e,) = [e for e in stored["kernels"]
                if e["kernel"].startswith(f"moe_fp4_{gemm}_qwen3_30b_T") and t in e["tokens"]]
        return e

    fc2_e = loop("fc2", 1)
    assert (fc2_e["config"]["block_n"], fc2_e["config"]["block_k"]) == (64, 256)
    assert 8 not in fc2_e["tokens"]
    fc1 = loop("fc1", 1)["xla_sm120"]["main_loop"]["n_instructions"] * 4 / (2 * 64 * 256)
    fc2 = fc2_e["xla_sm120"]["main_loop"]["n_instructions"] * 4 / (64 * 256)
    doc = model.build(RESULTS)
    (r,) = [r for r in doc["moe"]
            if (r["gpu"], r["shape"], r["T"]) == ("rtx_5060_ti", "qwen3_30b", 1)]
    assert r["warp_instructions_per_weight"] == pytest.approx([fc1, fc2])
    tiles = 8 + 8 // 16
    t_issue = tiles * (1536 * 2048 * fc1 + 2048 * 768 * fc2) / ISSUE_5060
    assert r["predicted_t_issue_us"] == pytest.approx(t_issue * 1e6)
