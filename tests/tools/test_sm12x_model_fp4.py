"""bench/sm12x_model.py on the FP4 MMA: the W4A4 GEMM rows (quantize launch + fp4mma) and the
MoE rows (both grouped GEMMs on the FP4 MMA) take their issue ceilings from the FP4 kernels'
own sm_120a SASS counts in bench/results/{gemm,moe}-fp4mma-sm12x-compile.json. Each expected
value is worked by hand here from a stored instruction count and the GPUs' datasheet figures."""

from __future__ import annotations

import json
import os

import pytest
from bench_modules import RESULTS, fresh

# RTX 5060 Ti: 36 SMs x 4 warp-instructions/clock x 2.572 GHz; 448 GB/s x 0.9; FP4 759 / 2
ISSUE_5060 = 36 * 4 * 2.572e9
STREAM_5060 = 448e9 * 0.9
FP4_5060 = 759e12 / 2


def _stored(name: str) -> list[dict]:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)["kernels"]


@pytest.fixture(scope="module")
def doc():
    return fresh("sm12x_model").build(RESULTS)


def _gemm_loop(shape: list[int]) -> int:
    """Main-loop instructions of fp4mma's XLA-Triton sm_120a build compiled at ``shape``."""
    (e,) = [e for e in _stored("gemm-fp4mma-sm12x-compile.json") if e["shape"] == shape]
    return e["xla_sm120"]["main_loop"]["n_instructions"]


def _moe_entry(gemm: str, layer: str, t: int) -> dict:
    """The stored MoE kernel of ``gemm`` and ``layer`` that serves T = ``t``."""
    (e,) = [e for e in _stored("moe-fp4mma-sm12x-compile.json")
            if e["kernel"].startswith(f"moe_fp4_{gemm}_{layer}_T") and t in e["tokens"]]
    return e


def _moe_loop(gemm: str, layer: str, t: int) -> int:
    return _moe_entry(gemm, layer, t)["xla_sm120"]["main_loop"]["n_instructions"]


def test_w4a4_decode_row_uses_the_fp4mma_count(doc):
    """4096 x 4096, M = 1 on the RTX 5060 Ti: fp4mma's M <= 16 tile (16 x 64 x 256, 4 warps),
    compiled at [1, 4096, 4096]: per weight = loop x 4 warps / (64 x 256) weights; one token
    tile streams every weight once. Bytes: weights and x at 0.5625 B, out bf16; the quantize
    launch reads 2 B and writes 0.5625 B per x element; MMA: 16 padded rows at the FP4 rate."""
    ipw = _gemm_loop([1, 4096, 4096]) * 4 / (64 * 256)
    rows = {(r["gpu"], r["N"], r["K"], r["M"]): r for r in doc["gemm"]}
    r = rows[("rtx_5060_ti", 4096, 4096, 1)]
    assert r["fp4_config"]["block_m"] == 16 and r["fp4_config"]["block_k"] == 256
    assert r["fp4_warp_instructions_per_weight"] == pytest.approx(ipw)
    assert "xla_sm120" in r["fp4_ipw_from"]
    t_issue = 4096 * 4096 * ipw / ISSUE_5060
    t_mem = (4096 * 4096 * 0.5625 + 4096 * 0.5625 + 2 * 4096) / STREAM_5060
    t_mma = 2 * 16 * 4096 * 4096 / FP4_5060
    t_quant = 4096 * (2 + 0.5625) / STREAM_5060
    assert r["predicted_fp4_t_issue_us"] == pytest.approx(t_issue * 1e6)
    assert r["predicted_fp4_t_mma_us"] == pytest.approx(t_mma * 1e6)
    assert r["predicted_fp4_mma_us"] == pytest.approx((t_quant + max(t_mem, t_mma, t_issue)) * 1e6)
    assert r["fp4_mma_limiter"] == "DRAM"


def test_w4a4_prefill_row_uses_the_large_tile_count(doc):
    """28672 x 8192, M = 4096: fp4mma's 128 x 128 x 128 tile (8 warps), compiled at
    [512, 4096, 4096]; 32 token tiles each issue the whole weight's loop again."""
    ipw = _gemm_loop([512, 4096, 4096]) * 8 / (128 * 128)
    rows = {(r["gpu"], r["N"], r["K"], r["M"]): r for r in doc["gemm"]}
    r = rows[("rtx_5060_ti", 28672, 8192, 4096)]
    assert r["fp4_warp_instructions_per_weight"] == pytest.approx(ipw)
    assert r["predicted_fp4_t_issue_us"] == pytest.approx(
        32 * 28672 * 8192 * ipw / ISSUE_5060 * 1e6)
    assert r["predicted_fp4_t_mma_us"] == pytest.approx(
        2 * 4096 * 28672 * 8192 / FP4_5060 * 1e6)
    # the W4A16 row of the same shape stays on its own (bf16-MMA) path
    assert "bf16 mma.sync" in r["path"] and r["warp_instructions_per_weight"] != r[
        "fp4_warp_instructions_per_weight"]


def test_moe_rows_run_both_gemms_on_the_fp4_counts(doc):
    """qwen3_30b (H 2048, I 768, gated, 128 experts, top 8) at T = 8 on the RTX 5060 Ti: FC1
    (gate + up tiles: 2 x 64 x 256 weights per loop iteration) and FC2 (128 x 256) take the
    counts of the moe_fp4_* kernels that serve T = 8; row tiles = touched experts + floor(64 /
    16)."""
    fc1 = _moe_loop("fc1", "qwen3_30b", 8) * 4 / (2 * 64 * 256)
    fc2 = _moe_loop("fc2", "qwen3_30b", 8) * 4 / (128 * 256)
    rows = {(r["gpu"], r["shape"], r["T"]): r for r in doc["moe"]}
    r = rows[("rtx_5060_ti", "qwen3_30b", 8)]
    assert r["warp_instructions_per_weight"] == pytest.approx([fc1, fc2])
    touched = 128 * (1 - (1 - 8 / 128) ** 8)
    tiles = touched + 64 // 16
    t_issue = tiles * (1536 * 2048 * fc1 + 2048 * 768 * fc2) / ISSUE_5060
    t_mma = 2 * tiles * 16 * (1536 * 2048 + 2048 * 768) / FP4_5060
    assert r["predicted_t_issue_us"] == pytest.approx(t_issue * 1e6)
    assert r["predicted_t_mma_us"] == pytest.approx(t_mma * 1e6)
    assert "fp4" in r["path"] and r["bf16_mma_predicted_us"] > 0


def test_moe_tiles_nobody_compiled_have_no_count_and_say_so():
    """Without the FC2 kernel of T = 1 (16 x 64 x 256 tiles) in the counts, qwen3_30b's T = 1
    FC2 gets no stand-in count (not the 16 x 128 x 256 kernel's) and no issue time, and says
    which tiles are missing."""
    from nvfp4_jax.moe.configs import default_config

    sm = fresh("sm12x_model")
    kept = [s for s in sm.load_fp4_sass(os.path.join(RESULTS, "moe-fp4mma-sm12x-compile.json"))
            if s["moe"] != {"layer": "qwen3_30b", "gemm": "fc2", "T": 1}]
    cfg = default_config(8, 128, inter=768, hidden=2048, gated=True, mma="fp4")
    assert cfg.fc2.block_n == 64 and cfg.fc2.block_k == 256
    ipw, how, _ = sm.fp4_ipw_for(kept, dict(cfg.fc2.__dict__),
                                 {"layer": "qwen3_30b", "gemm": "fc2"})
    assert ipw is None and "no FP4 SASS count" in how and "'block_n': 64" in how

    def counts(gemm, c):
        return sm.fp4_ipw_for(kept, c, {"layer": "qwen3_30b", "gemm": gemm})[:2]

    total = sm.moe_layer(sm.GPUS["rtx_5060_ti"], sm.MOE_SHAPES["qwen3_30b"], 1, cfg, counts)
    assert total["ipw"][1] is None and "no FP4 SASS count" in total["from"][1]
    fc1 = _moe_loop("fc1", "qwen3_30b", 1) * 4 / (2 * 64 * 256)
    tiles = 8 + 8 // 16  # T = 1 touches exactly top_k experts
    assert total["t_issue"] == pytest.approx(tiles * 1536 * 2048 * fc1 / ISSUE_5060)


def test_unrolled_k_loop_counts_the_whole_kernel_per_step():
    """pip Triton unrolled nemotron FC1 at T <= 64 (4 K steps, no loop): per weight = the whole
    kernel's instructions x 4 warps / (4 steps x 128 x 256 weights)."""
    sm = fresh("sm12x_model")
    e = _moe_entry("fc1", "nemotron", 8)
    assert e["pip_sm120"]["k_loop"] == "unrolled"
    ipw, how = sm.fp4_build_ipw(e, e["pip_sm120"])
    assert ipw == pytest.approx(e["pip_sm120"]["n_instructions"] * 4 / (4 * 128 * 256))
    assert "upper bound" in how
