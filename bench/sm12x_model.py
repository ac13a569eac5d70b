"""Predicted time of the SM12x path (the Pallas-Triton GEMM and MoE) on RTX 5090, RTX 5060 Ti
and DGX Spark (GB10), per shape. Every number this writes is a PREDICTION, not a measurement.

What runs on SM 12.x, and so what is modelled: W4A16 ``nvfp4_jax.matmul`` decodes the weights
to bf16 and runs bf16 ``mma.sync`` (the GEMM rows); W4A4 (``input_scale`` given) quantizes x in
one launch and runs ``gemm/fp4mma.py``, the block-scaled FP4 ``mma.sync ...
kind::mxf4nvf4.block_scale`` (``fp4mma.default_mma()`` is "fp4" there; the rows' ``fp4_*``
fields); the Pallas-Triton MoE runs both grouped GEMMs on the FP4 MMA (``MoEConfig.mma``
resolves to "fp4"; the MoE rows, with the bf16-MMA MoE beside them as ``bf16_mma_*``).

At M <= 64 (K % 256 == 0, bf16 activations) ``nvfp4_jax.matmul(backend="auto")`` runs W4A16 on
SM 12.x on another kernel: the Mosaic GPU kernel's ``mma.sync`` form (``MosaicConfig(mma=
"sync")``, the tiles of ``mosaic.config_for(M, N, K, 120)``, the tokens padded to
``mosaic.token_tile(M)``). Its rows are ``mosaic_sync_gemm`` (``mosaic_rows``): the same
roofline with ``block_m`` = the token tile and the main loop's count from the ptxas dump
``mosaic-sync-sm12x-ptxas.json`` (``mosaic_ipw_for``: the sm_120a record of the same token tile
and block_n, the loop count depending on nothing else; else the nearest token tile, said in
``ipw_from``); ``issue_calibrated_us`` there takes the issue efficiency the same form reached on
the H200 (``mosaic_h200_efficiency``, from ``mosaic-sm12x-forms-h200.json`` and
``mosaic-mma-h200.json``). The split-K partials (fp32 ``[split_k, token tile, N]``, summed by
one XLA fusion) are not in the time: ``partials_bytes`` says how many bytes they are. The
``gemm`` rows are the Pallas-Triton kernel at every M (``backend="pallas"``; "auto" at M > 64).

The model, per kernel launch (a roofline with three ceilings; the slowest one wins):

* bytes: NVFP4 weights at 0.5625 B/weight (0.5 for the codes, 1/16 for the E4M3 block scale),
  bf16 activations in (NVFP4, 0.5625 B/element, into the FP4-MMA kernels) and bf16 out; over
  ``DRAM_EFFICIENCY`` x the datasheet DRAM bandwidth;
* MMA: the W4A16 kernels decode to bf16 and run bf16 ``mma.sync`` with fp32 accumulation, the
  tokens padded to the token tile ``block_m`` (swap-AB: tokens in the MMA's N slot); over the
  GPU's dense bf16 tensor rate with fp32 accumulate; the FP4-MMA kernels over the dense FP4
  rate;
* issue: the warp-instructions the kernel's main loop issues per weight, once per token tile,
  over ``ISSUE_PER_SM_CLK`` warp-instructions per SM per clock. Counted in the sm_120a SASS:
  W4A16 by ``bench/sm12x_compile.py`` (``bench/results/gemm-sm12x-compile.json``), the FP4 MMA
  GEMM and MoE kernels by ``bench/sm12x_fp4mma_compile.py`` (``gemm-fp4mma-sm12x-compile.json``,
  ``moe-fp4mma-sm12x-compile.json``; ``fp4_build_ipw`` derives per weight: main-loop
  instructions x num_warps / (weight tiles x block_n x block_k), XLA's Triton build first).
  An FP4 kernel is matched by its exact tiles only; where none of those tiles was compiled the
  row says so (``fp4_ipw_from`` / ``ipw_from``) and has no issue ceiling for that GEMM.

Where the library's config for a shape is ``algo="dequant_dot"`` (prefill) the time is the
dequantization pass (read NVFP4, write bf16) plus a bf16 GEMM at its own roofline. The bf16
baseline is the ideal bf16 GEMM (weights at 2 B/weight at the same efficiency, or the bf16 tensor
rate). The W4A4 time adds the quantize launch (read bf16 x, write NVFP4: DRAM-bound) to the
fp4mma launch; ``fp4_issue_calibrated_us`` is the fp4mma issue ceiling at the H200 W4A16
kernel's achieved issue efficiency (below) where that is known. With a measured H200 proxy run
(``gemm-proxy-h200.json``) each GEMM row also gets ``calibrated_us``: the prediction times
(measured / predicted) of the same kernel on the H200 (the same model with the H200's
figures), i.e. assuming the kernel's shortfall from its roofline carries over from Hopper;
without a proxy run, the Pallas-Triton rows of ``gemm-h200.json`` (prefill) calibrate what
they cover. The H200 streams 4.8 TB/s
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
    {"name": "FP4-MMA main loop", "value": "fp4mma's and the FP4 MoE FC1/FC2 kernels' own "
                                            "sm_120a SASS counts, XLA's Triton first",
     "source": "bench/sm12x_fp4mma_compile.py: bench/results/gemm-fp4mma-sm12x-compile.json "
               "(fp4mma at its three default tiles) and moe-fp4mma-sm12x-compile.json (FC1/FC2 "
               "at T = 8 and 4096); per weight = main-loop instructions x num_warps / (weight "
               "tiles x block_n x block_k); a fully unrolled K loop: whole kernel / k_steps (an "
               "upper bound); tiles not compiled: no count, said in the row"},
    {"name": "W4A4 activations", "value": "one quantize launch + NVFP4 x into fp4mma",
     "source": "nvfp4_jax/gemm/api.py: on an NVIDIA GPU W4A4 quantizes x in one Pallas-Triton "
               "launch (bf16 in, NVFP4 codes + scales out), modelled as DRAM-bound"},
    {"name": "MoE main loop (bf16 MMA)", "value": "the MoE FC1/FC2 kernels' own SASS counts",
     "source": "bench/sm12x_compile.py compiles nvfp4_moe_fc1/fc2 at decode and prefill tiles; "
               "a tile set not compiled takes the nearest counted kernel (ipw_from says which)"},
    {"name": "MoE row tiles", "value": "touched experts + floor(T k / block_m)",
     "source": "assumption: one partly filled row block per touched expert plus the full ones"},
    {"name": "Mosaic mma.sync main loop", "value": "the sm_120a count of the same token tile "
                                                 "and block_n",
     "source": "bench/results/mosaic-sync-sm12x-ptxas.json (ptxas on the dumped PTX of the "
               "Mosaic kernel's mma.sync form): the loop decodes block_n x block_k weights per "
               "step against the token tile, so its count per weight depends on the token tile "
               "and block_n (block_k 256 on SM 12.x), not on N, K or split_k; where no record "
               "has both, the nearest token tile of the same block_n stands in (ipw_from)"},
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
               mma: str = "bf16", padded_m: int | None = None,
               act_bytes: float = 2.0) -> dict:
    """One swap-AB launch over an [N, K] NVFP4 weight and M tokens: the three ceilings (s).

    ``ipw``: main-loop warp-instructions per weight per token tile (None: unknown, no issue
    ceiling); ``mma``: "bf16" (decode + bf16 mma.sync) or "fp4" (block-scaled FP4 MMA);
    ``padded_m``: rows the MMA runs (default: M rounded up to ``block_m``); ``act_bytes``:
    bytes per activation element read (2: bf16; ``BYTES_PER_WEIGHT``: NVFP4 codes + scales)."""
    tiles = math.ceil(m / block_m)
    rows = padded_m if padded_m is not None else tiles * block_m
    nbytes = n * k * BYTES_PER_WEIGHT + act_bytes * m * k + 2 * m * n
    rate = bf16_tflops(gpu) if mma == "bf16" else fp4_tflops(gpu)
    t_mem = nbytes / stream_bps(gpu)
    t_mma = 2.0 * rows * n * k / (rate * 1e12)
    t_issue = tiles * n * k * ipw / issue_per_s(gpu) if ipw is not None else 0.0
    return {"bytes": nbytes, "flops": 2.0 * m * n * k, "t_mem": t_mem, "t_mma": t_mma,
            "t_issue": t_issue}


def issue_efficiency(tiles: int, n: int, k: int, ipw: float, us: float) -> float:
    """The H200's achieved issue efficiency: a launch's main-loop warp-instructions (``tiles``
    token tiles x N x K weights x ``ipw``) over (its measured ``us`` x the H200's issue rate)."""
    return tiles * n * k * ipw / (us * 1e-6 * issue_per_s(GPUS["h200"]))


def issue_calibrated(parts: dict, eff: float) -> float:
    """A roofline's time (s) with its issue ceiling at efficiency ``eff`` (``fused_gemm``'s
    ceilings), against DRAM and the MMA."""
    return max(parts["t_mem"], parts["t_mma"], parts["t_issue"] / eff)


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


def read_json(path: str) -> dict | None:
    """The JSON document at ``path``, or None where there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_sass(path: str, arch: int = 120) -> list[dict]:
    """[{config, per_weight (warp-instructions per weight), n_main_loop, kernel}] from
    gemm-sm12x-compile.json's sm_<arch>a builds (pip Triton, else jaxlib)."""
    doc = read_json(path)
    if doc is None:
        return []
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


#: the FP4-MMA builds, most preferred first: ``xla`` is the Triton XLA bundles (what
#: ``nvfp4_jax.matmul`` and the MoE compile with under JAX), ``pip`` the pip Triton package
FP4_SIDES = ("xla", "pip")
# no "decode": the FP4 MMA takes the codes as they are, whatever a config names for bf16
_FP4_TILE_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "load2d")


def fp4_build_ipw(entry: dict, build: dict) -> tuple[float | None, str]:
    """(warp-instructions per weight per token tile, how) of one FP4-MMA build, derived as
    ``sm12x_compile`` derives it: one main-loop iteration of each of the CTA's ``num_warps``
    warps covers ``weight_tiles`` (2 for a gated FC1: gate and up) x ``block_n`` x ``block_k``
    weights, so per weight = main-loop instructions x num_warps / those weights. Where the
    compiler unrolled the whole K loop (``k_loop`` "unrolled": no loop to count) it is the
    whole kernel's instructions over ``k_steps`` iterations, an upper bound (prologue and
    epilogue included). None where the build has neither."""
    c = entry["config"]
    weights = entry.get("weight_tiles", 1) * c["block_n"] * c["block_k"]
    loop = build.get("main_loop")
    if loop and loop.get("n_instructions"):
        n = loop["n_instructions"]
        return n * c["num_warps"] / weights, (
            f"main loop {n} x {c['num_warps']} warps / {weights} weights")
    if build.get("k_loop") == "unrolled" and entry.get("k_steps") and build.get("n_instructions"):
        n, steps = build["n_instructions"], entry["k_steps"]
        return n * c["num_warps"] / (weights * steps), (
            f"K loop unrolled: whole kernel {n} x {c['num_warps']} warps / ({steps} steps x "
            f"{weights} weights), an upper bound")
    return None, "no main loop counted"


def load_fp4_sass(path: str, arch: int = 120) -> list[dict]:
    """[{kernel, config, moe, by_side: {side: (ipw, how)}}] from an FP4-MMA compile JSON
    (``gemm-fp4mma-sm12x-compile.json`` or ``moe-fp4mma-sm12x-compile.json``, written by
    ``bench/sm12x_fp4mma_compile.py``), the sm_<arch>a builds. A GEMM entry is named by its
    [M, N, K] shape, an MoE entry carries its layer and GEMM (``moe_fp4_<gemm>_<layer>_T<t>``)."""
    doc = read_json(path)
    if doc is None:
        return []
    out = []
    for e in doc.get("kernels", []):
        if "config" not in e:
            continue
        name = e.get("kernel") or "fp4mma_gemm_mnk_{}x{}x{}".format(*e.get("shape", (0, 0, 0)))
        moe = None
        if name.startswith("moe_fp4_"):
            gemm, rest = name[len("moe_fp4_"):].split("_", 1)
            layer, _, t = rest.rpartition("_T")
            moe = {"layer": layer, "gemm": gemm, "T": int(t)}
        by_side = {}
        for side in FP4_SIDES:
            build = e.get(f"{side}_sm{arch}")
            if build and "error" not in build:
                ipw, how = fp4_build_ipw(e, build)
                if ipw is not None:
                    by_side[f"{side}_sm{arch}"] = (ipw, how)
        out.append({"kernel": name, "config": e["config"], "moe": moe, "by_side": by_side})
    return out


def fp4_ipw_for(sass: list[dict], config: dict, moe: dict | None = None
                ) -> tuple[float | None, str, dict]:
    """(warp-instructions per weight, where from, {side: ipw} of the kernel taken) of an
    FP4-MMA kernel config: a counted build of the same tiles (and, for ``moe`` ({"layer",
    "gemm"}), of the same layer and GEMM), a main-loop count before an unrolled one and XLA's
    Triton before pip's (``FP4_SIDES``). No other kernel stands in: where none has these tiles
    the count is None and the reason says so (the row then has no issue ceiling)."""
    if not sass:
        return None, "no FP4 SASS counts (run bench/sm12x_fp4mma_compile.py)", {}
    pool = [s for s in sass if (s["moe"] is None) == (moe is None)
            and (moe is None or (s["moe"]["layer"], s["moe"]["gemm"])
                 == (moe["layer"], moe["gemm"]))
            and all(s["config"].get(kk) == config.get(kk) for kk in _FP4_TILE_KEYS
                    if kk in s["config"] or kk in config)]
    best = None
    for s in pool:
        for side, (ipw, how) in s["by_side"].items():
            rank = (how.startswith("main loop"), side.startswith(FP4_SIDES[0]))
            if best is None or rank > best[0]:
                best = (rank, s, side, ipw, how)
    if best is None:
        tiles = {kk: config.get(kk) for kk in _FP4_TILE_KEYS if kk in config}
        return None, f"no FP4 SASS count for these tiles {tiles}: no issue ceiling", {}
    _, s, side, ipw, how = best
    return ipw, f"same tiles: {s['kernel']} ({side}, {how})", {
        kk: v[0] for kk, v in s["by_side"].items()}


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
    return issue_efficiency(math.ceil(m / cfg["block_m"]), n, k, ipw, measured[(n, k, m)]), ipw


def fp4_w4a4(gpu: dict, m: int, n: int, k: int, cfg: dict, ipw: float | None,
             eff: float | None = None) -> dict:
    """W4A4 on SM 12.x (``nvfp4_jax.matmul`` with ``input_scale``, ``mma="fp4"``): one launch
    quantizes x (reads bf16, writes NVFP4 codes + scales: DRAM-bound), then ``fp4mma`` reads
    the NVFP4 x and weights and runs the block-scaled FP4 MMA at the FP4 tensor rate, tokens
    padded to its ``block_m``, with the issue ceiling of its own SASS count ``ipw``. ``eff``:
    the H200's achieved issue efficiency (``h200_issue_efficiency``) for the issue-calibrated
    time. Times in s: {t_quant, t_mem, t_mma, t_issue, t, limiter, t_issue_calibrated}."""
    t_quant = m * k * (2 + BYTES_PER_WEIGHT) / stream_bps(gpu)
    parts = fused_gemm(gpu, m, n, k, block_m=cfg["block_m"], ipw=ipw, mma="fp4",
                       act_bytes=BYTES_PER_WEIGHT)
    t, lim = combine(parts)
    cal = None
    if eff and ipw is not None:
        cal = t_quant + issue_calibrated(parts, eff)
    return {**parts, "t_quant": t_quant, "t": t_quant + t, "limiter": lim,
            "t_issue_calibrated": cal}


def gemm_rows(gpus: dict, sass: list[dict], measured: dict | None = None,
              sass90: list[dict] | None = None,
              fp4_sass: list[dict] | None = None) -> list[dict]:
    """Per GEMM shape, M and SM12x GPU: the roofline of the SM12x table's config
    (``configs.get_config(..., family="sm12x")``) with its sm_120a count; with an H200 proxy
    run, ``calibrated_us`` (the prediction times the H200's measured / modelled ratio) and
    ``issue_calibrated_us`` (the issue ceiling at the H200 kernel's achieved issue efficiency,
    ``h200_issue_efficiency``, against DRAM and MMA). The ``fp4_*`` fields are the W4A4 path
    (``fp4_w4a4``: ``fp4mma.default_config(M)`` with its FP4 SASS count from ``fp4_sass``)."""
    from nvfp4_jax.gemm import configs
    from nvfp4_jax.gemm.fp4mma import default_config as fp4_config

    rows = []
    for n, k in GEMM_SHAPES:
        for m in GEMM_MS:
            cfg = configs.get_config(m, n, k, family="sm12x").__dict__
            cfg4 = dict(fp4_config(m).__dict__)
            ipw4, ipw4_from, ipw4_sides = fp4_ipw_for(fp4_sass or [], cfg4)
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
                fp4 = fp4_w4a4(gpu, m, n, k, cfg4, ipw4, eff)
                row = {
                    "label": LABEL, "gpu": gname, "N": n, "K": k, "M": m,
                    "path": "pallas W4A16 (decode to bf16, bf16 mma.sync)",
                    "config": cfg, "limiter": lim,
                    "predicted_us": t * 1e6,
                    "predicted_dram_fraction": parts["bytes"] / t / (gpu["dram_gbs"] * 1e9),
                    "predicted_bf16_us": t_b * 1e6,
                    "predicted_speedup_vs_bf16": t_b / t,
                    "warp_instructions_per_weight": ipw, "ipw_from": ipw_from,
                    "issue_budget_per_weight": issue_budget_per_weight(gpu),
                    "fp4_path": "W4A4: quantize x, then fp4mma (block-scaled FP4 mma.sync)",
                    "fp4_config": cfg4, "fp4_warp_instructions_per_weight": ipw4,
                    "fp4_ipw_from": ipw4_from, "fp4_ipw_by_compiler": ipw4_sides,
                    "predicted_fp4_mma_us": fp4["t"] * 1e6, "fp4_mma_limiter": fp4["limiter"],
                    "predicted_fp4_dram_fraction": (fp4["bytes"] + m * k * (2 + BYTES_PER_WEIGHT))
                    / fp4["t"] / (gpu["dram_gbs"] * 1e9),
                    "predicted_fp4_speedup_vs_bf16": t_b / fp4["t"],
                    **{f"predicted_fp4_{kk}_us": fp4[kk] * 1e6
                       for kk in ("t_quant", "t_mem", "t_mma", "t_issue")},
                    "fp4_issue_calibrated_us": (fp4["t_issue_calibrated"] * 1e6
                                                if fp4["t_issue_calibrated"] else None),
                    "calibrated_us": (t * 1e6 * calib) if calib else None,
                    "h200_measured_over_model": calib,
                    "issue_budget_per_weight_at_85pct_dram": issue_budget_per_weight(
                        gpu, ISSUE_GOAL_DRAM_FRACTION),
                    "h200_issue_efficiency": eff,
                    "h200_sm90_warp_instructions_per_weight": ipw90,
                    "issue_calibrated_us": None,
                }
                if eff and ipw is not None and "t_issue" in parts:
                    row["issue_calibrated_us"] = 1e6 * issue_calibrated(parts, eff)
                if "t_mem" in parts:
                    row.update({f"predicted_{kk}_us": parts[kk] * 1e6
                                for kk in ("t_mem", "t_mma", "t_issue")})
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- Mosaic mma.sync

#: compute capability whose ``mosaic.config_for`` tiles the Mosaic rows model (RTX 50xx; the
#: DGX Spark's sm_121 gets the same config: ``for_sm12x`` covers cc 120..129)
MOSAIC_CC = 120
#: ptxas counts of the Mosaic kernel's mma.sync form (``warp_instructions_per_weight`` per
#: dumped kernel and arch, with the case it was dumped at)
MOSAIC_SASS = "mosaic-sync-sm12x-ptxas.json"
#: H200 runs of the mma.sync form, (file, row label), most preferred first: the SM 12.x tiles
#: (``config_for(..., 120)``), then the sm_90 tiles on mma.sync
MOSAIC_H200_RUNS = (("mosaic-sm12x-forms-h200.json", "mosaic_sm12x"),
                    ("mosaic-mma-h200.json", "mosaic_sync"))


def load_mosaic_sass(path: str, arch: str = "sm_120a") -> list[dict]:
    """[{ptx, arch, case, token_tile, block_n, block_k, ipw, registers}] of the Mosaic kernel's
    mma.sync form from a ptxas dump (``mosaic-sync-sm12x-ptxas.json``): the ``arch`` records
    that compiled (rc 0), counted a main loop and name the case they were dumped at ({M, N, K,
    config}: MosaicConfig kwargs, the dataclass defaults for those left out). A record without
    its case says nothing of its tiles and is left out."""
    from nvfp4_jax.gemm.mosaic import MAX_M, MosaicConfig, token_tile

    doc = read_json(path)
    if doc is None:
        return []
    dflt = MosaicConfig()
    out = []
    for r in doc.get("records", []):
        case, ipw = r.get("case"), r.get("warp_instructions_per_weight")
        if r.get("arch") != arch or r.get("rc", 0) != 0 or ipw is None or not case:
            continue
        if not 1 <= case.get("M", 0) <= MAX_M:
            continue
        cfg = case.get("config") or {}
        out.append({"ptx": r.get("ptx"), "arch": arch, "case": case,
                    "token_tile": token_tile(case["M"]),
                    "block_n": cfg.get("block_n", dflt.block_n),
                    "block_k": cfg.get("block_k", dflt.block_k),
                    "ipw": ipw, "registers": r.get("registers")})
    return out


def _record_name(r: dict) -> str:
    c = r["case"]
    return (f"{r['ptx']} {r['arch']} (dumped at M={c['M']}, {c['N']}x{c['K']}: token tile "
            f"{r['token_tile']}, block_n {r['block_n']})")


def mosaic_ipw_for(sass: list[dict], m: int, n: int, k: int, cfg: dict, *,
                   nearest: bool = True) -> tuple[float | None, str, dict | None]:
    """(warp-instructions per weight per token tile, where from, the record) of the Mosaic
    mma.sync kernel at (M, N, K) with the tiles ``cfg`` (``block_n``, ``block_k``): a record of
    the same token tile (``token_tile(M)``), block_n and block_k; among several, the one dumped
    at this very (M, N, K), else the largest count (the count does not depend on N, K or
    split_k, so they differ by the compiler's scheduling alone; the largest is the safe side).
    Without one and with ``nearest``: the record of the same block_n and block_k whose token
    tile is nearest (in steps of ``TOKEN_TILES``; a tie takes the larger count), said in the
    reason. Else (None, why, None): the row has no issue ceiling."""
    from nvfp4_jax.gemm.mosaic import TOKEN_TILES, token_tile

    arch = sass[0]["arch"] if sass else "sm_120a"
    if not sass:
        return None, f"no {arch} Mosaic mma.sync counts ({MOSAIC_SASS}): no issue ceiling", None
    tt, bn, bk = token_tile(m), cfg["block_n"], cfg["block_k"]
    same = [r for r in sass if (r["token_tile"], r["block_n"], r["block_k"]) == (tt, bn, bk)]
    if same:
        r = max(same, key=lambda r: ((r["case"]["M"], r["case"]["N"], r["case"]["K"])
                                     == (m, n, k), r["ipw"]))
        return r["ipw"], f"same token tile and block_n: {_record_name(r)}", r
    near = [r for r in sass if (r["block_n"], r["block_k"]) == (bn, bk)] if nearest else []
    if near:
        at = TOKEN_TILES.index(tt)
        r = min(near, key=lambda r: (abs(TOKEN_TILES.index(r["token_tile"]) - at), -r["ipw"]))
        return r["ipw"], (f"nearest: no {arch} record of token tile {tt} with block_n {bn}; "
                          f"{_record_name(r)} stands in"), r
    return None, (f"no {arch} record of token tile {tt} with block_n {bn} and block_k {bk}: "
                  "no issue ceiling"), None


#: ptxas counts of the Mosaic MoE's grouped GEMMs in the mma.sync form (``bench/mosaic_sm12x.py
#: --moe``: per case, FC1 and FC2 as ``moe(backend="auto")`` ran them with the device taken
#: for SM 12.x)
MOSAIC_MOE_SASS = "mosaic-sync-moe-sm12x-ptxas.json"
#: token counts of the Mosaic MoE rows: decode, and the sizes around
#: ``moe.mosaic.SM12X_ROUTES_PER_EXPERT`` (16 rows per expert: qwen3 T = 256)
MOSAIC_MOE_TOKENS = (1, 8, 16, 64, 256, 512)


def load_mosaic_moe_sass(path: str, arch: str = "sm_120a") -> list[dict]:
    """[{shape, T, gemm, block_m, block_n, block_k, ipw, ptx}] of the Mosaic MoE's grouped
    GEMMs (``MOSAIC_MOE_SASS``): the ``arch`` records that compiled and counted a main loop;
    block_m is the case's token tile (the lowering run's ``lowered_cases``)."""
    doc = read_json(path)
    if doc is None:
        return []
    tiles = {(c["shape"], c["T"]): c.get("block_m") for c in doc.get("lowered_cases", [])}
    out = []
    for r in doc.get("records", []):
        case, ipw = r.get("case") or {}, r.get("warp_instructions_per_weight")
        if r.get("arch") != arch or r.get("rc", 0) != 0 or ipw is None or "shape" not in case:
            continue
        cfg = r.get("config") or {}
        out.append({"shape": case["shape"], "T": case["T"], "gemm": r["gemm"],
                    "block_m": tiles.get((case["shape"], case["T"])),
                    "block_n": cfg.get("block_n"), "block_k": cfg.get("block_k"), "ipw": ipw,
                    "ptx": r.get("ptx")})
    return out


def mosaic_moe_configs(shape: dict, t: int):
    """(block_m, FC1 MosaicConfig, FC2 MosaicConfig) that ``moe(backend="auto")`` runs on
    SM 12.x for ``shape`` (``MOE_SHAPES``) at T tokens: ``moe.mosaic.auto_config``, each GEMM
    in its SM 12.x form (``for_sm12x``) with swizzled_128x4 weight scales (read per step: no
    whole-K buffer)."""
    from nvfp4_jax.gemm.mosaic import for_sm12x
    from nvfp4_jax.moe import mosaic as moe_mosaic

    e, h, i, k = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    r = 2 * i if shape["gated"] else i
    cfg = moe_mosaic.auto_config(t * k, e, hidden=h, rows1=r, inter=i, sm12x=True)
    return cfg.block_m, for_sm12x(cfg.fc1, cfg.block_m), for_sm12x(cfg.fc2, cfg.block_m)


def mosaic_moe_ipw(moe_sass: list[dict], gemm_sass: list[dict], sname: str, t: int, gemm: str,
                   bm: int, cfg: dict) -> tuple[float | None, str]:
    """(warp-instructions per weight per token tile, where from) of one grouped GEMM of the
    Mosaic MoE: its own record (same layer, T and GEMM) if dumped, else a MoE record of the
    same token tile, block_n and block_k (the largest count), else the Mosaic GEMM's
    (``mosaic_ipw_for`` at M = the token tile; the same decode and MMA loop)."""
    tiles = (bm, cfg["block_n"], cfg["block_k"])
    own = [r for r in moe_sass if (r["shape"], r["T"], r["gemm"]) == (sname, t, gemm)
           and (r["block_m"], r["block_n"], r["block_k"]) == tiles]
    if own:
        return own[0]["ipw"], f"this GEMM: {own[0]['ptx']} ({sname} T={t} {gemm})"
    same = [r for r in moe_sass if (r["block_m"], r["block_n"], r["block_k"]) == tiles]
    if same:
        r = max(same, key=lambda r: r["ipw"])
        return r["ipw"], f"same tiles: {r['ptx']} ({r['shape']} T={r['T']} {r['gemm']})"
    ipw, how, _ = mosaic_ipw_for(gemm_sass, bm, 1, 1, cfg)
    return ipw, f"the Mosaic GEMM's count: {how}"


def mosaic_moe_rows(gpus: dict, moe_sass: list[dict], gemm_sass: list[dict],
                    fp4_rows: list[dict]) -> list[dict]:
    """Per MoE layer, T (``MOSAIC_MOE_TOKENS``) and SM12x GPU: the Mosaic MoE with both
    grouped GEMMs in the mma.sync form (``mosaic_moe_configs``; what ``moe(backend="auto")``
    runs on SM 12.x up to ``SM12X_ROUTES_PER_EXPERT`` rows per expert), ``moe_layer`` on the
    bf16 MMA with its sm_120a counts (``mosaic_moe_ipw``), beside the FP4-MMA Pallas-Triton
    MoE of the same layer and T (``moe_rows``' ``fp4_rows``, where it has that T; else
    computed here without issue counts, ``fp4_ipw_from`` says so)."""
    from types import SimpleNamespace

    from nvfp4_jax.moe.configs import default_config
    from nvfp4_jax.moe.mosaic import SM12X_ROUTES_PER_EXPERT, routes_per_expert

    fp4_by = {(r["shape"], r["T"], r["gpu"]): r for r in fp4_rows}
    rows = []
    for sname, s in MOE_SHAPES.items():
        e, h, i, k = s["experts"], s["hidden"], s["inter"], s["top_k"]
        for t in MOSAIC_MOE_TOKENS:
            bm, c1, c2 = mosaic_moe_configs(s, t)
            cfgs = {g: {kk: v for kk, v in c.__dict__.items() if kk != "measured"}
                    for g, c in (("fc1", c1), ("fc2", c2))}
            ns = SimpleNamespace(mma="bf16", **{g: SimpleNamespace(block_m=bm, **c)
                                                for g, c in cfgs.items()})
            per_expert = routes_per_expert(t * k, e)

            def counts(gemm, c, sname=sname, t=t, bm=bm):
                return mosaic_moe_ipw(moe_sass, gemm_sass, sname, t, gemm, bm, c)

            for gname, gpu in gpus.items():
                if gname == "h200":
                    continue
                total = moe_layer(gpu, s, t, ns, counts)
                fp4 = fp4_by.get((sname, t, gname))
                if fp4 is not None:
                    fp4_us, fp4_lim, fp4_from = fp4["predicted_us"], fp4["limiter"], "moe rows"
                else:
                    c4 = default_config(t * k, e, inter=i, hidden=h, gated=s["gated"], mma="fp4")
                    f4 = moe_layer(gpu, s, t, c4, lambda gemm, c: (None, "not counted"))
                    fp4_us, fp4_lim = f4["t"] * 1e6, f4["limiter"]
                    fp4_from = "no FP4 SASS count at these tiles: DRAM and MMA ceilings only"
                rows.append({
                    "label": LABEL, "gpu": gname, "shape": sname, "T": t,
                    "path": "Mosaic MoE, grouped GEMMs in the mma.sync form (decode to bf16, "
                            "bf16 mma.sync)",
                    "routes_per_expert": per_expert,
                    "auto_on_sm12x": ("mosaic" if per_expert <= SM12X_ROUTES_PER_EXPERT
                                      else "pallas"),
                    "block_m": bm, "config": cfgs,
                    "touched_experts": touched_experts(e, k, t),
                    "limiter": total["limiter"], "predicted_us": total["t"] * 1e6,
                    "predicted_dram_fraction": (total["bytes"] / total["t"]
                                                / (gpu["dram_gbs"] * 1e9)),
                    **{f"predicted_{kk}_us": total[kk] * 1e6
                       for kk in ("t_mem", "t_mma", "t_issue")},
                    "warp_instructions_per_weight": total["ipw"], "ipw_from": total["from"],
                    "fp4_mma_moe_predicted_us": fp4_us, "fp4_mma_moe_limiter": fp4_lim,
                    "fp4_ipw_from": fp4_from,
                    "ratio_vs_fp4_mma_moe": total["t"] * 1e6 / fp4_us,
                })
    return rows


def mosaic_moe_table(doc: dict) -> list[str]:
    """The Markdown lines of the Mosaic MoE table (``doc["mosaic_sync_moe"]``)."""
    gnames = [g for g in doc["gpus"] if g != "h200"]
    out = ["", "Routed MoE layer (FC1 + FC2) on SM 12.x, the Mosaic MoE with both grouped GEMMs "
           "in the mma.sync form (decode to bf16, bf16 mma.sync; moe.mosaic.auto_config's tiles "
           "in their for_sm12x form), what moe(backend='auto') runs there up to "
           "moe.mosaic.SM12X_ROUTES_PER_EXPERT routed rows per expert: us (limiter; % of DRAM "
           "bandwidth) and / the FP4-MMA Pallas-Triton MoE's predicted time (the table above; "
           "'*': at this T without its issue count); instr/weight = FC1, FC2 main-loop "
           f"warp-instructions per weight (sm_120a, bench/results/{MOSAIC_MOE_SASS}; '*': "
           "another case's count of the same tiles, or the Mosaic GEMM's, ipw_from in the JSON "
           "says which); auto = the backend moe(backend='auto') picks there", "",
           f"| MoE | T | rows per expert | auto | tiles (block_m; FC1, FC2 block_n / split) | "
           f"instr/weight | {' | '.join(doc['gpus'][g]['name'] for g in gnames)} |",
           "|---|---|---|---|---|---|" + "---|" * len(gnames)]
    lim = {"DRAM": "D", "MMA": "M", "issue": "I"}

    def cell(r: dict) -> str:
        star = "" if r["fp4_ipw_from"] == "moe rows" else "*"
        return (f"{r['predicted_us']:.0f} ({lim[r['limiter']]}, "
                f"{100 * r['predicted_dram_fraction']:.0f} %) / "
                f"{r['fp4_mma_moe_predicted_us']:.0f}{star} ({r['ratio_vs_fp4_mma_moe']:.2f}x)")

    by = {}
    for r in doc.get("mosaic_sync_moe", []):
        by.setdefault((r["shape"], r["T"]), {})[r["gpu"]] = r
    for (shape, t), rs in by.items():
        first = rs[gnames[0]]
        c = first["config"]
        ipws = ", ".join(("none" if v is None else f"{v:.3f}")
                         + ("" if how.startswith("this") else "*")
                         for v, how in zip(first["warp_instructions_per_weight"],
                                           first["ipw_from"]))
        out.append(f"| {shape} | {t} | {first['routes_per_expert']} | {first['auto_on_sm12x']} | "
                   f"{first['block_m']}; {c['fc1']['block_n']} / {c['fc1']['split_k']}, "
                   f"{c['fc2']['block_n']} / {c['fc2']['split_k']} | {ipws} | "
                   + " | ".join(cell(rs[g]) for g in gnames) + " |")
    return out


def load_mosaic_measured(results: str) -> tuple[dict | None, str | None]:
    """({(N, K, M): [{us, config, from}]}, files) of the Mosaic kernel's mma.sync form measured
    on the H200 (``MOSAIC_H200_RUNS``, the preferred file's rows first): rows with a time and
    the config they ran."""
    got, used = {}, []
    for name, label in MOSAIC_H200_RUNS:
        doc = read_json(os.path.join(results, name))
        if doc is None:
            continue
        rows = [r for r in doc.get("records", [])
                if r.get("label") == label and r.get("median_us") and r.get("config")]
        for r in rows:
            got.setdefault((r["N"], r["K"], r["M"]), []).append(
                {"us": r["median_us"], "config": r["config"], "from": f"{name} ({label})"})
        if rows:
            used.append(name)
    return (got, " + ".join(used)) if got else (None, None)


def mosaic_h200_efficiency(sass90: list[dict], measured: dict | None, m: int, n: int, k: int,
                           cfg: dict) -> tuple[float | None, float | None, str]:
    """(achieved issue efficiency, sm_90a warp-instructions per weight, where from) of the
    mma.sync form timed on the H200 at (M, N, K): the sm_90a count of a record with the same
    token tile, block_n and block_k as the run's config, x the weights, over (measured time x
    the H200's issue rate). Runs of ``cfg``'s tiles are taken first, then runs of other tiles
    (the sm_90 table's, on mma.sync), each with its own tiles' count. None where no run has a
    count of its tiles."""
    from nvfp4_jax.gemm.mosaic import MosaicConfig, token_tile

    dflt = MosaicConfig()
    runs = [r for r in (measured or {}).get((n, k, m), [])
            if r["config"].get("mma") == "sync" and r["config"].get("m_split", 1) == 1]
    if not runs:
        return None, None, "no H200 run of the mma.sync form at this shape"

    def same_tiles(run: dict) -> bool:
        return all(run["config"].get(kk, getattr(dflt, kk)) == v for kk, v in cfg.items())

    for run in sorted(runs, key=lambda r: not same_tiles(r)):
        rc = {kk: run["config"].get(kk, getattr(dflt, kk)) for kk in ("block_n", "block_k")}
        ipw90, how, rec = mosaic_ipw_for(sass90, m, n, k, rc, nearest=False)
        if rec is None:
            continue
        eff = issue_efficiency(math.ceil(m / token_tile(m)), n, k, ipw90, run["us"])
        tiles = "these tiles" if same_tiles(run) else f"other tiles {run['config']}"
        return eff, ipw90, f"{run['from']}, {tiles}: {run['us']:.1f} us; {how}"
    return None, None, "no sm_90a record of the H200 run's token tile and block_n"


def mosaic_rows(gpus: dict, sass: list[dict], sass90: list[dict] | None = None,
                measured: dict | None = None) -> list[dict]:
    """Per GEMM shape, M <= 64 and SM12x GPU: the Mosaic kernel's mma.sync form, what
    ``nvfp4_jax.matmul(backend="auto")`` runs for W4A16 there: ``mosaic.config_for(M, N, K,
    120)``'s tiles, the tokens padded to ``token_tile(M)``, the roofline of ``fused_gemm`` on
    the bf16 MMA with the sm_120a count ``mosaic_ipw_for`` picks from ``sass``; with an H200
    run (``measured``, ``sass90``), ``issue_calibrated_us``: the issue ceiling at the
    efficiency that run reached (``mosaic_h200_efficiency``) against DRAM and MMA."""
    from nvfp4_jax.gemm import mosaic

    rows = []
    for n, k in GEMM_SHAPES:
        for m in GEMM_MS:
            if m > mosaic.MAX_M:
                continue
            c = mosaic.config_for(m, n, k, MOSAIC_CC)
            cfg = {kk: v for kk, v in c.__dict__.items() if kk != "measured"}
            tt = mosaic.token_tile(m)
            ipw, ipw_from, _ = mosaic_ipw_for(sass, m, n, k, cfg)
            eff, ipw90, eff_from = mosaic_h200_efficiency(sass90 or [], measured, m, n, k, cfg)
            partials = 0 if c.bf16_store else c.split_k * tt * n * 4
            for gname, gpu in gpus.items():
                if gname == "h200":
                    continue
                parts = fused_gemm(gpu, m, n, k, block_m=tt, ipw=ipw, mma="bf16")
                t, lim = combine(parts)
                t_b = bf16_gemm(gpu, m, n, k)
                cal = None
                if eff and ipw is not None:
                    cal = issue_calibrated(parts, eff)
                rows.append({
                    "label": LABEL, "gpu": gname, "N": n, "K": k, "M": m,
                    "path": "Mosaic GPU W4A16, mma.sync form (decode to bf16, bf16 mma.sync)",
                    "config": cfg, "token_tile": tt, "limiter": lim,
                    "predicted_us": t * 1e6,
                    "predicted_dram_fraction": parts["bytes"] / t / (gpu["dram_gbs"] * 1e9),
                    "predicted_bf16_us": t_b * 1e6,
                    "predicted_speedup_vs_bf16": t_b / t,
                    **{f"predicted_{kk}_us": parts[kk] * 1e6
                       for kk in ("t_mem", "t_mma", "t_issue")},
                    "bytes": parts["bytes"], "partials_bytes": partials,
                    "warp_instructions_per_weight": ipw, "ipw_from": ipw_from,
                    "issue_budget_per_weight_at_85pct_dram": issue_budget_per_weight(
                        gpu, ISSUE_GOAL_DRAM_FRACTION),
                    "h200_issue_efficiency": eff,
                    "h200_sm90_warp_instructions_per_weight": ipw90,
                    "h200_efficiency_from": eff_from,
                    "issue_calibrated_us": cal * 1e6 if cal else None,
                })
    return rows


def touched_experts(e: int, k: int, t: int) -> float:
    """Expected experts hit by T tokens each routed to k distinct of E experts uniformly."""
    return e * (1.0 - (1.0 - k / e) ** t)


def moe_layer(gpu: dict, s: dict, t: int, cfg, counts) -> dict:
    """FC1 + FC2 of one routed MoE layer at T tokens (uniform routing) on ``gpu``: the summed
    ceilings (s) of the two grouped GEMMs, each over the touched experts' weights and
    ``touched + floor(T k / block_m)`` row tiles of ``block_m`` rows. ``cfg``: the
    ``MoEConfig``; on ``cfg.mma`` "fp4" the MMA runs at the FP4 tensor rate and reads NVFP4
    activations (0.5625 B/element), on "bf16" at the bf16 rate from bf16 activations.
    ``counts(gemm, tile_config)`` -> (ipw, where from): a GEMM without a count (None) adds no
    issue time, and its reason stays in ``ipw_from``."""
    e, h, i, k = s["experts"], s["hidden"], s["inter"], s["top_k"]
    r = 2 * i if s["gated"] else i
    fp4 = cfg.mma == "fp4"
    rate = fp4_tflops(gpu) if fp4 else bf16_tflops(gpu)
    act = BYTES_PER_WEIGHT if fp4 else 2.0
    touched = touched_experts(e, k, t)
    total = {"t_mem": 0.0, "t_mma": 0.0, "t_issue": 0.0, "bytes": 0.0, "ipw": [], "from": []}
    # FC1: [R, H] per expert over the routed rows; FC2: [H, I]
    for gemm, c, (n_out, k_in) in (("fc1", cfg.fc1, (r, h)), ("fc2", cfg.fc2, (h, i))):
        tiles = touched + (t * k) // c.block_m  # row tiles over the touched experts
        ipw, how = counts(gemm, dict(c.__dict__))
        total["ipw"].append(ipw)
        total["from"].append(how)
        nbytes = touched * n_out * k_in * BYTES_PER_WEIGHT + t * k * (act * k_in + 2 * n_out)
        total["bytes"] += nbytes
        total["t_mem"] += nbytes / stream_bps(gpu)
        total["t_mma"] += 2.0 * tiles * c.block_m * n_out * k_in / (rate * 1e12)
        total["t_issue"] += (tiles * n_out * k_in * (ipw or 0.0)) / issue_per_s(gpu)
    total["t"], total["limiter"] = combine(total)
    return total


def moe_rows(gpus: dict, sass: list[dict], fp4_sass: list[dict] | None = None) -> list[dict]:
    """Per MoE layer, T and SM12x GPU: the Pallas-Triton MoE with both grouped GEMMs on the
    FP4 MMA (``MoEConfig.mma`` "fp4", what it runs on SM 12.x) with the FP4 MoE kernels' own
    sm_120a counts (``fp4_sass``, ``fp4_ipw_for``); ``bf16_mma_*``: the same layer with
    ``mma="bf16"`` (decode to bf16, bf16 mma.sync; the W4A16 kernels' counts ``sass``)."""
    from nvfp4_jax.moe.configs import default_config

    rows = []
    for sname, s in MOE_SHAPES.items():
        e, h, i, k = s["experts"], s["hidden"], s["inter"], s["top_k"]
        r = 2 * i if s["gated"] else i
        for t in MOE_TOKENS:
            cfg4 = default_config(t * k, e, inter=i, hidden=h, gated=s["gated"], mma="fp4")
            cfg16 = default_config(t * k, e, inter=i, hidden=h, gated=s["gated"], mma="bf16")
            touched = touched_experts(e, k, t)

            def fp4_counts(gemm, c, sname=sname):
                ipw, how, _ = fp4_ipw_for(fp4_sass or [], c, {"layer": sname, "gemm": gemm})
                return ipw, how

            def bf16_counts(gemm, c, sname=sname):
                return ipw_for(sass, c, {"layer": sname, "gemm": gemm})

            for gname, gpu in gpus.items():
                if gname == "h200":
                    continue
                total = moe_layer(gpu, s, t, cfg4, fp4_counts)
                old = moe_layer(gpu, s, t, cfg16, bf16_counts)
                tm = total["t"]
                wb = touched * (r * h + h * i)
                t_b = max(2 * wb / stream_bps(gpu),
                          2.0 * t * k * (r * h + h * i) / (bf16_tflops(gpu) * 1e12))
                rows.append({
                    "label": LABEL, "gpu": gname, "shape": sname, "T": t,
                    "path": "pallas Triton MoE, mma fp4 (NVFP4 activations, block-scaled FP4 "
                            "mma.sync in FC1 and FC2)",
                    "touched_experts": touched, "fc1_block_m": cfg4.fc1.block_m,
                    "fp4_config": {"fc1": dict(cfg4.fc1.__dict__),
                                   "fc2": dict(cfg4.fc2.__dict__)},
                    "limiter": total["limiter"], "predicted_us": tm * 1e6,
                    "predicted_dram_fraction": total["bytes"] / tm / (gpu["dram_gbs"] * 1e9),
                    "predicted_bf16_grouped_us": t_b * 1e6,
                    "predicted_speedup_vs_bf16": t_b / tm,
                    "warp_instructions_per_weight": total["ipw"], "ipw_from": total["from"],
                    "issue_budget_per_weight": issue_budget_per_weight(gpu),
                    **{f"predicted_{kk}_us": total[kk] * 1e6
                       for kk in ("t_mem", "t_mma", "t_issue")},
                    "bf16_mma_path": "pallas Triton MoE, mma bf16 (decode to bf16, bf16 "
                                     "mma.sync)",
                    "bf16_mma_predicted_us": old["t"] * 1e6, "bf16_mma_limiter": old["limiter"],
                    "bf16_mma_warp_instructions_per_weight": old["ipw"],
                    "bf16_mma_ipw_from": old["from"],
                })
    return rows


def load_measured(results: str) -> tuple[dict | None, str | None]:
    """({(N, K, M): us}, files) of the Pallas-Triton W4A16 kernel the sm90 table runs now,
    measured on the H200: rows of the proxy run (``gemm-proxy-h200.json``) and of the decode
    candidates sweep (``gemm-candidates-h200.json``) whose recorded tile config is the table's
    current one for that shape (a time of another kernel would mis-calibrate); rows without a
    recorded config count as the table's. Without either file, the rows of ``gemm-h200.json``
    whose auto backend was Pallas-Triton."""
    from nvfp4_jax.gemm import configs

    def same_kernel(r) -> bool:
        cfg = r.get("config")
        if cfg is None:
            return True
        want = configs.get_config(r["M"], r["N"], r["K"], family="sm90").__dict__
        return {a: b for a, b in cfg.items() if a != "measured"} == {
            a: b for a, b in want.items() if a != "measured"}

    sources = (("gemm-proxy-h200.json", lambda r: r.get("impl") == "nvfp4_w4a16_pallas"),
               ("gemm-candidates-h200.json", lambda r: "config" in r and r.get("config")))
    got, used = {}, []
    for name, keep in sources:
        path = os.path.join(results, name)
        doc = read_json(path)
        if doc is None:
            continue
        rows = {(r["N"], r["K"], r["M"]): r["median_us"] for r in doc["records"]
                if keep(r) and r.get("median_us") and same_kernel(r)}
        if rows:
            got.update(rows)
            used.append(name)
    if got:
        return got, " + ".join(used)
    doc = read_json(os.path.join(results, "gemm-h200.json"))
    if doc is not None:
        got = {(r["N"], r["K"], r["M"]): r["median_us"] for r in doc["records"]
               if r.get("impl") == "nvfp4_w4a16" and r.get("backend") == "pallas"
               and "median_us" in r}
        if got:
            return got, "gemm-h200.json"
    return None, None


def _cell(r: dict) -> str:
    """``us (limiter, % of DRAM bandwidth, x bf16)`` of a row."""
    lim = {"DRAM": "D", "MMA": "M", "issue": "I"}.get(r["limiter"], "deq")
    return (f"{r['predicted_us']:.0f} ({lim}, {100 * r['predicted_dram_fraction']:.0f} %, "
            f"{r['predicted_speedup_vs_bf16']:.1f}x)")


def mosaic_table(doc: dict) -> list[str]:
    """The Markdown lines of the Mosaic mma.sync table (``doc["mosaic_sync_gemm"]``): per shape
    and M <= 64 the tiles, the sm_120a count, per GPU ``us (limiter, % DRAM, x bf16)``, each
    GPU's issue budget at ``ISSUE_GOAL_DRAM_FRACTION`` of DRAM and the H200-calibrated time."""
    gnames = [g for g in doc["gpus"] if g != "h200"]
    names = ", ".join(doc["gpus"][g]["name"] for g in gnames)
    pct = f"{100 * ISSUE_GOAL_DRAM_FRACTION:.0f} %"
    out = ["", "GEMM, W4A16 at M <= 64 on SM 12.x, the path nvfp4_jax.matmul(backend='auto') "
           "runs there: the Mosaic GPU kernel's mma.sync form (decode to bf16, bf16 mma.sync; "
           "tiles of mosaic.config_for(M, N, K, 120)), predictions, not measurements: us "
           "(limiter D = DRAM, M = bf16 MMA, I = issue; % of DRAM bandwidth; x ideal bf16 GEMM); "
           "tile = token tile x block_n x block_k, split_k, stages; instr/weight = the main "
           "loop's warp-instructions per weight per token tile from ptxas on the kernel's "
           f"dumped PTX (sm_120a, bench/results/{MOSAIC_SASS}), the record of the same token "
           "tile and block_n ('*': none has both, the nearest token tile of the same block_n "
           f"stands in, ipw_from in the JSON says which); budget = warp-instructions per weight "
           f"each GPU issues while streaming weights at {pct} of DRAM bandwidth; H200 "
           "efficiency = the same form's sm_90a warp-instructions / (its time measured on the "
           "H200 x the H200's issue rate); calibrated = the issue ceiling at that efficiency "
           "against DRAM and MMA, us, '-' where the H200 efficiency is not known", "",
           "| N x K | M | tile | sm_120a instr/weight | "
           + " | ".join(doc["gpus"][g]["name"] for g in gnames)
           + f" | budget at {pct} ({names}) | H200 efficiency | calibrated ({names}) |",
           "|---|---|---|---|" + "---|" * len(gnames) + "---|---|---|"]
    by = {}
    for r in doc.get("mosaic_sync_gemm", []):
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["gpu"]] = r
    for (n, k, m), rs in by.items():
        first = rs[gnames[0]]
        c, ipw, eff = first["config"], first["warp_instructions_per_weight"], first[
            "h200_issue_efficiency"]
        star = "*" if first["ipw_from"].startswith("nearest") else ""
        out.append(
            f"| {n}x{k} | {m} | {first['token_tile']}x{c['block_n']}x{c['block_k']}, "
            f"split {c['split_k']}, {c['num_stages']} st | "
            + (f"{ipw:.3f}{star}" if ipw is not None else "none") + " | "
            + " | ".join(_cell(rs[g]) for g in gnames) + " | "
            + ", ".join(f"{rs[g]['issue_budget_per_weight_at_85pct_dram']:.2f}" for g in gnames)
            + " | " + (f"{eff:.0%}" if eff is not None else "-") + " | "
            + ", ".join(f"{rs[g]['issue_calibrated_us']:.0f}" if rs[g]["issue_calibrated_us"]
                        else "-" for g in gnames) + " |")
    return out


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

    head = " | ".join(doc["gpus"][g]["name"] for g in gnames)
    def cell4(r: dict) -> str:
        lim = {"DRAM": "D", "MMA": "M", "issue": "I"}[r["fp4_mma_limiter"]]
        return (f"{r['predicted_fp4_mma_us']:.0f} ({lim}, "
                f"{100 * r['predicted_fp4_dram_fraction']:.0f} %, "
                f"{r['predicted_fp4_speedup_vs_bf16']:.1f}x)")

    out += ["", "GEMM, W4A16 Pallas-Triton path (decode to bf16, bf16 mma.sync): us (limiter D = "
            "DRAM, M = bf16 MMA, I = issue, deq = dequantize + bf16 GEMM; % of DRAM bandwidth; "
            "x ideal bf16 GEMM); instr/weight = main-loop warp-instructions per weight "
            "(sm_120a SASS)", "",
            f"| N x K | M | instr/weight | {head} |",
            "|---|---|---|" + "---|" * len(gnames)]
    by = {}
    for r in doc["gemm"]:
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["gpu"]] = r
    by_gemm = by
    for (n, k, m), rs in by.items():
        first = rs[gnames[0]]
        ipw = first["warp_instructions_per_weight"]
        out.append(f"| {n}x{k} | {m} | " + (f"{ipw:.3f}" if ipw is not None else "-") + " | "
                   + " | ".join(_cell(rs[g]) for g in gnames) + " |")
    if doc.get("mosaic_sync_gemm"):
        out += mosaic_table(doc)
    out += ["", "GEMM, W4A4 on SM 12.x (input_scale given: one launch quantizes x, then fp4mma "
            "runs the block-scaled FP4 mma.sync at the FP4 tensor rate): us (limiter D = DRAM, "
            "M = FP4 MMA, I = issue; % of DRAM bandwidth; x ideal bf16 GEMM); the quantize "
            "launch is included; instr/weight = fp4mma's main-loop warp-instructions per weight "
            "(sm_120a SASS of XLA's Triton, bench/results/gemm-fp4mma-sm12x-compile.json); "
            "tile = block_m x block_n x block_k, warps; calibrated = with fp4mma's issue "
            "ceiling at the H200 kernel's achieved issue efficiency (issue table below), us, "
            "'-' where the H200 efficiency is not known", "",
            f"| N x K | M | tile | instr/weight | {head} | calibrated ("
            + ", ".join(doc["gpus"][g]["name"] for g in gnames) + ") |",
            "|---|---|---|---|" + "---|" * len(gnames) + "---|"]
    for (n, k, m), rs in by.items():
        first = rs[gnames[0]]
        ipw, c = first["fp4_warp_instructions_per_weight"], first["fp4_config"]
        out.append(f"| {n}x{k} | {m} | {c['block_m']}x{c['block_n']}x{c['block_k']}, "
                   f"{c['num_warps']} | " + (f"{ipw:.3f}" if ipw is not None else "none") + " | "
                   + " | ".join(cell4(rs[g]) for g in gnames) + " | "
                   + ", ".join(f"{rs[g]['fp4_issue_calibrated_us']:.0f}"
                               if rs[g]["fp4_issue_calibrated_us"] else "-" for g in gnames)
                   + " |")
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
    out += ["", "Routed MoE layer (FC1 + FC2), Pallas-Triton MoE with both grouped GEMMs on the "
            "FP4 MMA (MoEConfig.mma 'fp4', what SM 12.x runs): us (limiter; % of DRAM "
            "bandwidth; x ideal bf16 grouped GEMM); instr/weight = FC1, FC2 main-loop "
            "warp-instructions per weight (sm_120a SASS of XLA's Triton, "
            "bench/results/moe-fp4mma-sm12x-compile.json; 'none': no kernel of these tiles "
            "compiled, so no issue ceiling for that GEMM); bf16 MMA = the same layer with "
            "mma 'bf16' (decode to bf16), us", "",
            f"| MoE | T | touched experts | instr/weight | {head} | bf16 MMA us ("
            + ", ".join(doc["gpus"][g]["name"] for g in gnames) + ") |",
            "|---|---|---|---|" + "---|" * len(gnames) + "---|"]
    by = {}
    for r in doc["moe"]:
        by.setdefault((r["shape"], r["T"]), {})[r["gpu"]] = r
    for (shape, t), rs in by.items():
        ipws = ", ".join(f"{v:.3f}" if v is not None else "none"
                         for v in rs[gnames[0]]["warp_instructions_per_weight"])
        out.append(f"| {shape} | {t} | {rs[gnames[0]]['touched_experts']:.0f} | {ipws} | "
                   + " | ".join(_cell(rs[g]) for g in gnames) + " | "
                   + ", ".join(f"{rs[g]['bf16_mma_predicted_us']:.0f}" for g in gnames) + " |")
    if doc.get("mosaic_sync_moe"):
        out += mosaic_moe_table(doc)
    return "\n".join(out)


def build(results: str) -> dict:
    sass_path = os.path.join(results, "gemm-sm12x-compile.json")
    sass = load_sass(sass_path)
    sass90 = load_sass(sass_path, 90)
    fp4_paths = {g: os.path.join(results, f"{g}-fp4mma-sm12x-compile.json")
                 for g in ("gemm", "moe")}
    fp4_gemm, fp4_moe = (load_fp4_sass(fp4_paths[g]) for g in ("gemm", "moe"))
    measured, measured_from = load_measured(results)
    mosaic_path = os.path.join(results, MOSAIC_SASS)
    mosaic_sass, mosaic_sass90 = (load_mosaic_sass(mosaic_path, a) for a in ("sm_120a", "sm_90a"))
    mosaic_measured, mosaic_measured_from = load_mosaic_measured(results)
    gpus = {g: v for g, v in GPUS.items()}
    moe_rows_ = moe_rows(gpus, sass, fp4_moe)
    moe_path = os.path.join(results, MOSAIC_MOE_SASS)
    derived = {g: {"bf16_fp32acc_dense_tflops": bf16_tflops(v), "fp4_dense_tflops": fp4_tflops(v),
                   "stream_gbs": stream_bps(v) / 1e9,
                   "issue_budget_warp_instr_per_weight": issue_budget_per_weight(v)}
               for g, v in gpus.items()}
    return {
        "label": LABEL,
        "what": "predicted time per shape of the SM12x path (Pallas-Triton GEMM and MoE; the "
                "Mosaic GPU mma.sync GEMM that W4A16 runs at M <= 64); "
                "bench/sm12x_model.py's docstring has the model",
        "gpus": gpus, "derived": derived, "assumptions": ASSUMPTIONS,
        "sass_source": os.path.relpath(sass_path, os.path.dirname(results) or "."),
        "sass_kernels": sass,
        "fp4_sass_sources": {g: os.path.relpath(v, os.path.dirname(results) or ".")
                             for g, v in fp4_paths.items()},
        "fp4_sass_kernels": [{**kk, "by_side": {sd: {"ipw": v[0], "how": v[1]}
                                                for sd, v in kk["by_side"].items()}}
                             for kk in fp4_gemm + fp4_moe],
        "calibration_source": measured_from,
        "gemm": gemm_rows(gpus, sass, measured, sass90, fp4_gemm),
        "moe": moe_rows_,
        "mosaic_sync_sass_source": os.path.relpath(mosaic_path, os.path.dirname(results) or "."),
        "mosaic_sync_sass_records": mosaic_sass,
        "mosaic_sync_calibration_source": mosaic_measured_from,
        "mosaic_sync_gemm": mosaic_rows(gpus, mosaic_sass, mosaic_sass90, mosaic_measured),
        "mosaic_sync_moe_sass_source": os.path.relpath(moe_path, os.path.dirname(results) or "."),
        "mosaic_sync_moe": mosaic_moe_rows(gpus, load_mosaic_moe_sass(moe_path), mosaic_sass,
                                           moe_rows_),
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
