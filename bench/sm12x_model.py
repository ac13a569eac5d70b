"""Predicted time of the SM12x path (the Pallas-Triton GEMM and MoE) on RTX 5090, RTX 5060 Ti
and DGX Spark (GB10), per shape. Every number this writes is a PREDICTION, not a measurement.

The model, per kernel launch (a roofline with three ceilings; the slowest one wins):

* bytes: NVFP4 weights at 0.5625 B/weight (0.5 for the codes, 1/16 for the E4M3 block scale),
  bf16 activations in and out; over ``DRAM_EFFICIENCY`` x the datasheet DRAM bandwidth;
* MMA: the W4A16 kernels decode to bf16 and run bf16 ``mma.sync`` with fp32 accumulation, the
  tokens padded to the token tile ``block_m`` (swap-AB: tokens in the MMA's N slot); over the
  GPU's dense bf16 tensor rate with fp32 accumulate;
* issue: the warp-instructions the kernel's main loop issues per weight (counted in the sm_120a
  SASS by ``bench/sm12x_compile.py``, ``bench/results/gemm-sm12x-compile.json``), once per token
  tile, over ``ISSUE_PER_SM_CLK`` warp-instructions per SM per clock.

Where the library's config for a shape is ``algo="dequant_dot"`` (prefill) the time is the
dequantization pass (read NVFP4, write bf16) plus a bf16 GEMM at its own roofline. The bf16
baseline is the ideal bf16 GEMM (weights at 2 B/weight at the same efficiency, or the bf16 tensor
rate). The FP4-MMA rows are what the W4A4 path reaches once it runs ``mma.sync ...
kind::mxf4nvf4.block_scale`` (FP4 x FP4 at the FP4 tensor rate); no SASS for it is counted yet,
so they have no issue ceiling. With a measured H200 proxy run (``gemm-proxy-h200.json``) each
GEMM row also gets ``calibrated_us``: the prediction times (measured / predicted) of the same
kernel on the H200 (the same model with the H200's figures), i.e. assuming the kernel's
shortfall from its roofline carries over from Hopper; without a proxy run, the Pallas-Triton
rows of ``gemm-h200.json`` (prefill) calibrate what they cover. The H200 streams 4.8 TB/s
through 132 SMs: its issue budget is ~0.14 warp-instructions per weight against 0.5-1.1 on
the SM12x GPUs, so where the H200 run is issue-bound the calibrated time is a pessimistic bound.

Usage: python bench/sm12x_model.py [--out bench/results] [--table]
-> OUT/sm12x-predictions.json and OUT/sm12x-predictions.md. Runs on CPU (no GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LABEL = "prediction"
BYTES_PER_WEIGHT = 0.5625  # 0.5 (E2M1 codes) + 1/16 (one E4M3 scale per 16 weights)

#: The GPUs, as data. Derived rates: FP4 dense = NVIDIA's sparse "AI TOPS" / 2; bf16 with fp32
#: accumulate = SMs x boost clock x BF16_FP32ACC_FLOP_PER_SM_CLK.
GPUS = {
    "rtx_5090": {
        "name": "GeForce RTX 5090", "arch": "sm_120", "sms": 170, "boost_ghz": 2.407,
        "dram_gbs": 1792.0, "fp4_sparse_tflops": 3352.0,
        "sources": [
            "170 SMs, 2407 MHz boost, 1792 GB/s, 3352 FP4 (sparse) / 838 FP16 (sparse, FP16 "
            "accumulate): NVIDIA's published RTX 5090 specifications as tabulated in Linux "
            "Format, May 2025 ('Nvidia GeForce RTX 5090', J. Walton), "
            "https://pocketmags.com/linux-format-magazine/may-2025/articles/"
            "nvidia-geforce-rtx-5090",
            "1792 GB/s, 170 SMs, 3352 AI TOPS: "
            "https://www.spheron.network/blog/nvidia-rtx-5090-specs/",
        ],
    },
    "rtx_5060_ti": {
        "name": "GeForce RTX 5060 Ti", "arch": "sm_120", "sms": 36, "boost_ghz": 2.572,
        "dram_gbs": 448.0, "fp4_sparse_tflops": 759.0,
        "sources": [
            "36 SMs, 128-bit GDDR7 at 28 Gbps = 448 GB/s, 2572 MHz boost: "
            "https://tomshardware.com/pc-components/gpus/nvidia-rtx-5060-ti-final-specs-and-"
            "launch-day-allegedly-leaked and "
            "https://cputronic.com/gpu/compare/nvidia-geforce-rtx-5060-ti-16-gb-vs-nvidia-"
            "geforce-rtx-2060-super",
            "759 AI TOPS (FP4, sparse): NVIDIA RTX 5060 Ti product specifications",
            "measured on an RTX 5060 Ti (sm_120, 36 SMs, ~2.57 GHz): BF16 with FP32 accumulate "
            "47.0 TFLOP/s, NVFP4 341.9 TFLOP/s (https://github.com/QuantumDrizzy/BLACKWALL): "
            "matches 512 and ~90 % of 4096 FLOP/SM/clock",
        ],
    },
    "dgx_spark_gb10": {
        "name": "DGX Spark (GB10)", "arch": "sm_121", "sms": 48, "boost_ghz": 2.52,
        "dram_gbs": 273.0, "fp4_sparse_tflops": 1000.0,
        "sources": [
            "6144 CUDA cores (48 SMs of 128), 1 PFLOP FP4 with sparsity, 128 GB LPDDR5X at "
            "273 GB/s: NVIDIA DGX Spark product page figures, as collected in "
            "https://ai-infrastructure.net/dgx-spark/ and https://dgx-spark.warehack.ing/hardware/",
            "clock: not published; 2.52 GHz is derived from NVIDIA's 31 TFLOPS FP32 (Hot Chips "
            "2025, https://afnnews.qaasid.com/145463) / (6144 cores x 2 FLOP); 500 TFLOPS dense "
            "FP4 / (48 SMs x 4096) gives 2.54 GHz",
            "bf16 rate: assumed as on sm_120 (FP32 accumulate at half the FP16-accumulate rate)",
        ],
    },
    "h200": {
        "name": "H200 (the proxy)", "arch": "sm_90", "sms": 132, "boost_ghz": 1.98,
        "dram_gbs": 4800.0, "fp4_sparse_tflops": None, "bf16_dense_tflops": 989.0,
        "sources": ["NVIDIA H200 datasheet: 4.8 TB/s, 989 TFLOPS dense BF16; 132 SMs "
                    "(/work/shared/docs/h200-baseline.md, pallas-gpu.md section 6.0)"],
    },
}

#: dense bf16 MMA with fp32 accumulate per SM per clock on sm_120/sm_121 (GeForce and RTX PRO
#: Blackwell run FP32 accumulate at half the FP16-accumulate rate)
BF16_FP32ACC_FLOP_PER_SM_CLK = 512
#: the fraction of datasheet DRAM bandwidth a streaming kernel reaches
DRAM_EFFICIENCY = 0.9
#: warp-instructions issued per SM per clock (4 sub-partitions, one warp scheduler each)
ISSUE_PER_SM_CLK = 4
#: issue 31's goal: the decode GEMM streams weights at 85 % of DRAM bandwidth; the per-weight
#: instruction budget at that rate is the number a kernel's main loop must stay under
ISSUE_GOAL_DRAM_FRACTION = 0.85

ASSUMPTIONS = [
    {"name": "DRAM_EFFICIENCY", "value": DRAM_EFFICIENCY,
     "source": "assumption; the H200 copy kernel reaches 4.26 of 4.8 TB/s (0.89, "
               "/work/shared/docs/h200-baseline.md); GDDR7 and LPDDR5X not measured here"},
    {"name": "BF16_FP32ACC_FLOP_PER_SM_CLK", "value": BF16_FP32ACC_FLOP_PER_SM_CLK,
     "source": "RTX 5090: 838 TFLOPS FP16 sparse with FP16 accumulate = 419 dense = 170 SMs x "
               "2.407 GHz x 1024; FP32 accumulate at half rate (209.5 TFLOPS), confirmed by "
               "the RTX 5060 Ti measurement of 47.0 TFLOP/s (36 x 2.572 GHz x 512 = 47.4)"},
    {"name": "FP4 dense rate", "value": "fp4_sparse_tflops / 2",
     "source": "NVIDIA quotes FP4 'AI TOPS' with 2:4 sparsity; 1676 TFLOPS dense on the RTX "
               "5090 = 170 x 2.407 GHz x 4096"},
    {"name": "ISSUE_PER_SM_CLK", "value": ISSUE_PER_SM_CLK,
     "source": "four SM sub-partitions with one warp scheduler each, issuing one "
               "warp-instruction per clock (NVIDIA RTX Blackwell and Hopper SM diagrams)"},
    {"name": "sm_121 SASS", "value": "the sm_120a counts",
     "source": "bench/results/gemm-sm12x-compile.json: identical instruction counts for "
               "sm_120a and sm_121a builds of every kernel"},
    {"name": "MoE main loop", "value": "the MoE FC1/FC2 kernels' own SASS counts",
     "source": "bench/sm12x_compile.py compiles nvfp4_moe_fc1/fc2 at decode and prefill tiles; "
               "a tile set not compiled takes the nearest counted kernel (ipw_from says which)"},
    {"name": "MoE row tiles", "value": "touched experts + floor(T k / block_m)",
     "source": "assumption: one partly filled row block per touched expert plus the full ones"},
    {"name": "MoE routing", "value": "uniform random top-k",
     "source": "touched experts = E (1 - (1 - k/E)^T), as moe_bench's random routing"},
]

#: GEMM shapes (gemm_bench) and token counts
GEMM_SHAPES = ((28672, 8192), (4096, 14336), (14336, 4096), (4096, 4096))
GEMM_MS = (1, 16, 64, 4096)
MOE_SHAPES = {
    "qwen3_30b": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "gated": True},
    "nemotron": {"hidden": 1024, "inter": 2688, "experts": 512, "top_k": 22, "gated": False},
}
MOE_TOKENS = (1, 8, 16, 64, 4096)


def bf16_tflops(gpu: dict) -> float:
    if gpu.get("bf16_dense_tflops"):
        return gpu["bf16_dense_tflops"]
    return gpu["sms"] * gpu["boost_ghz"] * BF16_FP32ACC_FLOP_PER_SM_CLK / 1e3


def fp4_tflops(gpu: dict) -> float | None:
    return gpu["fp4_sparse_tflops"] / 2 if gpu.get("fp4_sparse_tflops") else None


def stream_bps(gpu: dict) -> float:
    """Bytes per second a streaming kernel reaches (datasheet x ``DRAM_EFFICIENCY``)."""
    return gpu["dram_gbs"] * 1e9 * DRAM_EFFICIENCY


def issue_per_s(gpu: dict) -> float:
    """Warp-instructions per second, the whole GPU."""
    return gpu["sms"] * ISSUE_PER_SM_CLK * gpu["boost_ghz"] * 1e9


def issue_budget_per_weight(gpu: dict, dram_fraction: float | None = None) -> float:
    """Warp-instructions per NVFP4 weight the GPU can issue while streaming weights at
    ``stream_bps`` (or at ``dram_fraction`` of the datasheet bandwidth): above it a kernel is
    issue-bound before it is bandwidth-bound."""
    bps = stream_bps(gpu) if dram_fraction is None else gpu["dram_gbs"] * 1e9 * dram_fraction
    return issue_per_s(gpu) / (bps / BYTES_PER_WEIGHT)


def fused_gemm(gpu: dict, m: int, n: int, k: int, *, block_m: int, ipw: float | None,
               mma: str = "bf16", padded_m: int | None = None) -> dict:
    """One swap-AB launch over an [N, K] NVFP4 weight and M tokens: the three ceilings (s).

    ``ipw``: main-loop warp-instructions per weight per token tile (None: unknown, no issue
    ceiling); ``mma``: "bf16" (decode + bf16 mma.sync) or "fp4" (block-scaled FP4 MMA);
    ``padded_m``: rows the MMA runs (default: M rounded up to ``block_m``)."""
    tiles = math.ceil(m / block_m)
    rows = padded_m if padded_m is not None else tiles * block_m
    nbytes = n * k * BYTES_PER_WEIGHT + 2 * m * k + 2 * m * n
    rate = bf16_tflops(gpu) if mma == "bf16" else fp4_tflops(gpu)
    t_mem = nbytes / stream_bps(gpu)
    t_mma = 2.0 * rows * n * k / (rate * 1e12)
    t_issue = tiles * n * k * ipw / issue_per_s(gpu) if ipw is not None else 0.0
    return {"bytes": nbytes, "flops": 2.0 * m * n * k, "t_mem": t_mem, "t_mma": t_mma,
            "t_issue": t_issue}


def combine(parts: dict) -> tuple[float, str]:
    """(time, limiter) of a roofline: the slowest ceiling."""
    name = max(("t_mem", "t_mma", "t_issue"), key=lambda key: parts[key])
    return parts[name], {"t_mem": "DRAM", "t_mma": "MMA", "t_issue": "issue"}[name]


def bf16_gemm(gpu: dict, m: int, n: int, k: int) -> float:
    """The ideal bf16 GEMM (cuBLAS-like): 2 B/weight streamed, or the bf16 tensor rate (s)."""
    nbytes = 2 * n * k + 2 * m * k + 2 * m * n
    return max(nbytes / stream_bps(gpu), 2.0 * m * n * k / (bf16_tflops(gpu) * 1e12))


def dequant_then_bf16(gpu: dict, m: int, n: int, k: int) -> float:
    """``algo="dequant_dot"``: dequantize (read NVFP4, write bf16) then the bf16 GEMM (s)."""
    return n * k * (BYTES_PER_WEIGHT + 2) / stream_bps(gpu) + bf16_gemm(gpu, m, n, k)


# --------------------------------------------------------------------------- SASS counts


def load_sass(path: str, arch: int = 120) -> list[dict]:
    """[{config, per_weight (warp-instructions per weight), n_main_loop, kernel}] from
    gemm-sm12x-compile.json's sm_<arch>a builds (pip Triton, else jaxlib)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        doc = json.load(f)
    out = []
    for e in doc.get("kernels", []):
        for side in (f"pip_sm{arch}", f"jaxlib_sm{arch}"):
            pw = (e.get(side) or {}).get("per_weight")
            if pw:
                out.append({"kernel": e["kernel"], "config": e["config"], "side": side,
                            "ipw": pw["warp_instructions_per_weight"],
                            "main_loop": e[side]["main_loop"]["n_instructions"],
                            "moe": e.get("moe")})
                break
    return out


_TILE_KEYS = ("block_m", "block_n", "block_k", "num_warps", "decode", "load2d")


def ipw_for(sass: list[dict], config: dict, moe: dict | None = None) -> tuple[float | None, str]:
    """(warp-instructions per weight, where from) for a kernel config: the counted kernel of
    the same config, else the same tiles, else the largest count (an upper bound). ``moe``
    ({"layer", "gemm"}): an MoE grouped GEMM, matched among the MoE kernels of that layer and
    GEMM first, then among the MoE kernels, then among all."""
    if not sass:
        return None, "no SASS counts (run bench/sm12x_compile.py)"
    pools = [sass]
    if moe is not None:
        moes = [s for s in sass if s.get("moe")]
        pools = [[s for s in moes if s["moe"]["layer"] == moe["layer"]
                  and s["moe"]["gemm"] == moe["gemm"]], moes, sass]
    for pool in pools:
        exact = tuple(kk for kk in config if kk != "measured")  # provenance, not the kernel
        for keys, how in ((exact, "this config"), (_TILE_KEYS, "same tiles"),
                          (("block_n", "block_k", "num_warps"), "same BN/BK/warps")):
            same = [s for s in pool if all(s["config"].get(kk) == config.get(kk) for kk in keys)]
            if same:
                return same[0]["ipw"], f"{how}: {same[0]['kernel']} ({same[0]['side']})"
    worst = max(sass, key=lambda s: s["ipw"])
    return worst["ipw"], f"upper bound: {worst['kernel']} (largest count)"


# --------------------------------------------------------------------------- rows


def h200_issue_efficiency(sass90: list[dict], measured: dict | None, m: int, n: int,
                          k: int) -> tuple[float | None, float | None]:
    """(achieved issue efficiency, sm_90a warp-instructions per weight) of the kernel the H200
    proxy run timed at this shape (the sm90 table's config): its main loop's warp-instructions
    over (measured time x the H200's issue rate). None where it was not measured or counted."""
    from nvfp4_jax.gemm import configs

    cfg = configs.get_config(m, n, k, family="sm90").__dict__
    if not measured or (n, k, m) not in measured or cfg.get("algo") != "fused" or not sass90:
        return None, None
    ipw, how = ipw_for(sass90, cfg)
    if not how.startswith("this config"):
        return None, None
    instr = math.ceil(m / cfg["block_m"]) * n * k * ipw
    return instr / (measured[(n, k, m)] * 1e-6 * issue_per_s(GPUS["h200"])), ipw


def gemm_rows(gpus: dict, sass: list[dict], measured: dict | None = None,
              sass90: list[dict] | None = None) -> list[dict]:
    """Per GEMM shape, M and SM12x GPU: the roofline of the SM12x table's config
    (``configs.get_config(..., family="sm12x")``) with its sm_120a count; with an H200 proxy
    run, ``calibrated_us`` (the prediction times the H200's measured / modelled ratio) and
    ``issue_calibrated_us`` (the issue ceiling at the H200 kernel's achieved issue efficiency,
    ``h200_issue_efficiency``, against DRAM and MMA)."""
    from nvfp4_jax.gemm import configs

    rows = []
    for n, k in GEMM_SHAPES:
        for m in GEMM_MS:
            cfg = configs.get_config(m, n, k, family="sm12x").__dict__
            ipw, ipw_from = ipw_for(sass, cfg)
            if cfg.get("algo") == "dequant_dot":  # no fused kernel: XLA dequantizes, cuBLAS
                ipw, ipw_from = None, "algo dequant_dot (no fused kernel)"
            eff, ipw90 = h200_issue_efficiency(sass90 or [], measured, m, n, k)
            calib = None
            if measured and (n, k, m) in measured:
                h = GPUS["h200"]
                if cfg.get("algo") == "dequant_dot":
                    t_h = dequant_then_bf16(h, m, n, k)
                else:
                    t_h, _ = combine(fused_gemm(h, m, n, k, block_m=cfg["block_m"], ipw=ipw))
                calib = measured[(n, k, m)] / (t_h * 1e6)
            for gname, gpu in gpus.items():
                if gname == "h200":
                    continue
                t_b = bf16_gemm(gpu, m, n, k)
                if cfg.get("algo") == "dequant_dot":
                    t, lim = dequant_then_bf16(gpu, m, n, k), "dequant + bf16 GEMM"
                    parts = {"bytes": n * k * (BYTES_PER_WEIGHT + 2) + 2 * n * k + 2 * m * (n + k)}
                else:
                    parts = fused_gemm(gpu, m, n, k, block_m=cfg["block_m"], ipw=ipw)
                    t, lim = combine(parts)
                fp4 = fused_gemm(gpu, m, n, k, block_m=8, ipw=None, mma="fp4",
                                 padded_m=max(8, math.ceil(m / 8) * 8))
                t4, lim4 = combine(fp4)
                row = {
                    "label": LABEL, "gpu": gname, "N": n, "K": k, "M": m,
                    "path": "pallas W4A16/W4A4 (decode to bf16, bf16 mma.sync)",
                    "config": cfg, "limiter": lim,
                    "predicted_us": t * 1e6,
                    "predicted_dram_fraction": parts["bytes"] / t / (gpu["dram_gbs"] * 1e9),
                    "predicted_bf16_us": t_b * 1e6,
                    "predicted_speedup_vs_bf16": t_b / t,
                    "warp_instructions_per_weight": ipw, "ipw_from": ipw_from,
                    "issue_budget_per_weight": issue_budget_per_weight(gpu),
                    "predicted_fp4_mma_us": t4 * 1e6, "fp4_mma_limiter": lim4,
                    "calibrated_us": (t * 1e6 * calib) if calib else None,
                    "h200_measured_over_model": calib,
                    "issue_budget_per_weight_at_85pct_dram": issue_budget_per_weight(
                        gpu, ISSUE_GOAL_DRAM_FRACTION),
                    "h200_issue_efficiency": eff,
                    "h200_sm90_warp_instructions_per_weight": ipw90,
                    "issue_calibrated_us": None,
                }
                if eff and ipw is not None and "t_issue" in parts:
                    row["issue_calibrated_us"] = 1e6 * max(
                        parts["t_mem"], parts["t_mma"], parts["t_issue"] / eff)
                if "t_mem" in parts:
                    row.update({f"predicted_{kk}_us": parts[kk] * 1e6
                                for kk in ("t_mem", "t_mma", "t_issue")})
                rows.append(row)
    return rows


def touched_experts(e: int, k: int, t: int) -> float:
    """Expected experts hit by T tokens each routed to k distinct of E experts uniformly."""
    return e * (1.0 - (1.0 - k / e) ** t)


def moe_rows(gpus: dict, sass: list[dict]) -> list[dict]:
    from nvfp4_jax.moe.configs import default_config

    rows = []
    for sname, s in MOE_SHAPES.items():
        e, h, i, k = s["experts"], s["hidden"], s["inter"], s["top_k"]
        r = 2 * i if s["gated"] else i
        for t in MOE_TOKENS:
            cfg = default_config(t * k, e, inter=i, hidden=h, gated=s["gated"])
            touched = touched_experts(e, k, t)
            for gname, gpu in gpus.items():
                if gname == "h200":
                    continue
                total = {"t_mem": 0.0, "t_mma": 0.0, "t_issue": 0.0, "bytes": 0.0}
                ipws, froms = [], []
                # FC1: [R, H] per expert over the routed rows; FC2: [H, I]
                for gemm, c, (n_out, k_in) in (("fc1", cfg.fc1, (r, h)), ("fc2", cfg.fc2, (h, i))):
                    tiles = touched + (t * k) // c.block_m  # row tiles over the touched experts
                    ipw, how = ipw_for(sass, dict(c.__dict__), {"layer": sname, "gemm": gemm})
                    ipws.append(ipw)
                    froms.append(how)
                    w = touched * n_out * k_in
                    nbytes = w * BYTES_PER_WEIGHT + 2 * t * k * (n_out + k_in)
                    total["bytes"] += nbytes
                    total["t_mem"] += nbytes / stream_bps(gpu)
                    total["t_mma"] += 2.0 * tiles * c.block_m * n_out * k_in / (
                        bf16_tflops(gpu) * 1e12)
                    total["t_issue"] += (tiles * n_out * k_in * (ipw or 0.0)) / issue_per_s(gpu)
                tm, lim = combine(total)
                wb = touched * (r * h + h * i)
                t_b = max(2 * wb / stream_bps(gpu),
                          2.0 * t * k * (r * h + h * i) / (bf16_tflops(gpu) * 1e12))
                rows.append({
                    "label": LABEL, "gpu": gname, "shape": sname, "T": t,
                    "path": "pallas Triton MoE (decode to bf16, bf16 mma.sync)",
                    "touched_experts": touched, "fc1_block_m": cfg.fc1.block_m,
                    "limiter": lim, "predicted_us": tm * 1e6,
                    "predicted_dram_fraction": total["bytes"] / tm / (gpu["dram_gbs"] * 1e9),
                    "predicted_bf16_grouped_us": t_b * 1e6,
                    "predicted_speedup_vs_bf16": t_b / tm,
                    "warp_instructions_per_weight": ipws, "ipw_from": froms,
                    "issue_budget_per_weight": issue_budget_per_weight(gpu),
                    **{f"predicted_{kk}_us": total[kk] * 1e6
                       for kk in ("t_mem", "t_mma", "t_issue")},
                })
    return rows


def load_measured(results: str) -> tuple[dict | None, str | None]:
    """({(N, K, M): us}, file) of the Pallas-Triton W4A16 rows measured on the H200: the proxy
    run (``gemm-proxy-h200.json``) if there is one, else the rows of ``gemm-h200.json`` whose
    auto backend was Pallas-Triton."""
    for name, keep in (("gemm-proxy-h200.json", lambda r: r.get("impl") == "nvfp4_w4a16_pallas"),
                       ("gemm-h200.json", lambda r: r.get("impl") == "nvfp4_w4a16"
                        and r.get("backend") == "pallas")):
        path = os.path.join(results, name)
        if os.path.exists(path):
            with open(path) as f:
                doc = json.load(f)
            got = {(r["N"], r["K"], r["M"]): r["median_us"] for r in doc["records"]
                   if keep(r) and "median_us" in r}
            if got:
                return got, name
    return None, None


def table(doc: dict) -> str:
    """Small Markdown tables for the docs: the GPUs, then per shape and M (T) the predicted
    time per GPU as ``us (limiter, % of DRAM bandwidth, x bf16)``."""
    gnames = [g for g in doc["gpus"] if g != "h200"]
    out = ["All numbers are predictions (bench/sm12x_model.py), not measurements.", "",
           "| GPU | SMs | boost GHz | DRAM GB/s | bf16 (fp32 acc) TFLOPS | FP4 dense TFLOPS "
           "| issue budget, warp-instr per weight at 90 % DRAM |", "|---|---|---|---|---|---|---|"]
    for g in [*gnames, "h200"]:
        v, d = doc["gpus"][g], doc["derived"][g]
        fp4 = f"{d['fp4_dense_tflops']:.0f}" if d["fp4_dense_tflops"] else "-"
        out.append(f"| {v['name']} | {v['sms']} | {v['boost_ghz']} | {v['dram_gbs']:.0f} | "
                   f"{d['bf16_fp32acc_dense_tflops']:.0f} | {fp4} | "
                   f"{d['issue_budget_warp_instr_per_weight']:.2f} |")

    def cell(r: dict) -> str:
        lim = {"DRAM": "D", "MMA": "M", "issue": "I"}.get(r["limiter"], "deq")
        return (f"{r['predicted_us']:.0f} ({lim}, {100 * r['predicted_dram_fraction']:.0f} %, "
                f"{r['predicted_speedup_vs_bf16']:.1f}x)")

    head = " | ".join(doc["gpus"][g]["name"] for g in gnames)
    out += ["", "GEMM, W4A16/W4A4 Pallas-Triton path: us (limiter D = DRAM, M = bf16 MMA, I = "
            "issue, deq = dequantize + bf16 GEMM; % of DRAM bandwidth; x ideal bf16 GEMM); "
            "instr/weight = main-loop warp-instructions per weight (sm_120a SASS); FP4 MMA = "
            "the W4A4 path with block-scaled FP4 mma.sync", "",
            f"| N x K | M | instr/weight | {head} | FP4 MMA us "
            f"({doc['gpus'][gnames[0]]['name']}) |",
            "|---|---|---|" + "---|" * len(gnames) + "---|"]
    by = {}
    for r in doc["gemm"]:
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["gpu"]] = r
    by_gemm = by
    for (n, k, m), rs in by.items():
        first = rs[gnames[0]]
        ipw = first["warp_instructions_per_weight"]
        out.append(f"| {n}x{k} | {m} | " + (f"{ipw:.3f}" if ipw is not None else "-") + " | "
                   + " | ".join(cell(rs[g]) for g in gnames)
                   + f" | {first['predicted_fp4_mma_us']:.0f} |")
    out += ["", "Issue budget (issue 31 goal 1): main-loop warp-instructions per weight of the "
            "SM12x table's kernel (sm_120a SASS) against each GPU's budget at 85 % of DRAM "
            "bandwidth; H200 efficiency = the sm90 kernel's sm_90a warp-instructions / (its "
            "time measured on the H200 x the H200's issue rate); calibrated = the issue ceiling "
            "at that efficiency against DRAM and MMA: us (x ideal bf16 GEMM)", "",
            "| N x K | M | SM12x instr/weight | H200 sm_90a instr/weight | H200 issue efficiency "
            "| " + " | ".join(f"{doc['gpus'][g]['name']} budget at 85 % | calibrated"
                              for g in gnames) + " |",
            "|---|---|---|---|---|" + "---|---|" * len(gnames)]
    for (n, k, m), rs in by_gemm.items():
        first = rs[gnames[0]]
        if first["warp_instructions_per_weight"] is None:
            continue

        def num(v, fmt):
            return format(v, fmt) if v is not None else "-"

        cells = []
        for g in gnames:
            r = rs[g]
            cal = r["issue_calibrated_us"]
            cells += [f"{r['issue_budget_per_weight_at_85pct_dram']:.2f}",
                      f"{cal:.0f} ({r['predicted_bf16_us'] / cal:.1f}x)" if cal else "-"]
        out.append(f"| {n}x{k} | {m} | {first['warp_instructions_per_weight']:.3f} | "
                   f"{num(first['h200_sm90_warp_instructions_per_weight'], '.3f')} | "
                   f"{num(first['h200_issue_efficiency'], '.0%')} | " + " | ".join(cells) + " |")
    out += ["", "Routed MoE layer (FC1 + FC2, Triton MoE path; x ideal bf16 grouped GEMM)", "",
            f"| MoE | T | touched experts | {head} |", "|---|---|---|" + "---|" * len(gnames)]
    by = {}
    for r in doc["moe"]:
        by.setdefault((r["shape"], r["T"]), {})[r["gpu"]] = r
    for (shape, t), rs in by.items():
        out.append(f"| {shape} | {t} | {rs[gnames[0]]['touched_experts']:.0f} | "
                   + " | ".join(cell(rs[g]) for g in gnames) + " |")
    return "\n".join(out)


def build(results: str) -> dict:
    sass_path = os.path.join(results, "gemm-sm12x-compile.json")
    sass = load_sass(sass_path)
    sass90 = load_sass(sass_path, 90)
    measured, measured_from = load_measured(results)
    gpus = {g: v for g, v in GPUS.items()}
    derived = {g: {"bf16_fp32acc_dense_tflops": bf16_tflops(v), "fp4_dense_tflops": fp4_tflops(v),
                   "stream_gbs": stream_bps(v) / 1e9,
                   "issue_budget_warp_instr_per_weight": issue_budget_per_weight(v)}
               for g, v in gpus.items()}
    return {
        "label": LABEL,
        "what": "predicted time per shape of the SM12x path (Pallas-Triton GEMM and MoE); "
                "bench/sm12x_model.py's docstring has the model",
        "gpus": gpus, "derived": derived, "assumptions": ASSUMPTIONS,
        "sass_source": os.path.relpath(sass_path, os.path.dirname(results) or "."),
        "sass_kernels": sass,
        "calibration_source": measured_from,
        "gemm": gemm_rows(gpus, sass, measured, sass90),
        "moe": moe_rows(gpus, sass),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"))
    p.add_argument("--results", default=None, help="where the SASS counts and proxy runs are "
                   "(default: --out)")
    p.add_argument("--table", action="store_true", help="print the Markdown table")
    a = p.parse_args()
    doc = build(a.results or a.out)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sm12x-predictions.json"), "w") as f:
        json.dump(doc, f, indent=1)
    md = table(doc)
    with open(os.path.join(a.out, "sm12x-predictions.md"), "w") as f:
        f.write(md + "\n")
    if a.table:
        print(md)


if __name__ == "__main__":
    main()
