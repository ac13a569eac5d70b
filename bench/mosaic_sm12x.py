"""The Mosaic GEMM with ``mma.sync`` lowered as for SM 12.x, run on this (sm_90) GPU.

With the compute capability Mosaic GPU's Python lowering reads set to 12.0 (RTX 50xx) or
12.1 (DGX Spark) (``nvfp4_jax.testing.mosaic_lowered_as``), each case is lowered with every
choice SM 12.x would get, compiled for this GPU by Mosaic's C++ and checked against the
oracle (``assert_gemm_close``); ``MOSAIC_GPU_DUMP_TO`` keeps
each kernel's PTX, which ``ptxas -arch=sm_120a / sm_121a`` then assembles on any machine
(``--ptxas DIR``: registers, spills, and with ``cuobjdump`` the main loop's warp-instructions
per weight, for sm_90a as well). ``--moe``: the same for the MoE layers of ``MOE_CASES``
through ``nvfp4_jax.moe(backend="auto")`` with the device taken for SM 12.x (the backend auto
picks there and both grouped GEMMs' PTX).

    python bench/mosaic_sm12x.py --out $OUT [--moe]            # on the GPU
    python bench/mosaic_sm12x.py --ptxas $OUT/ptx-12.0 --out bench/results   # anywhere
    python bench/mosaic_sm12x.py --moe --ptxas $OUT/ptx-moe-12.0 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

CASES = [  # (M, N, K, MosaicConfig kwargs): decode tiles of the sm_90 table, ragged shapes
    (1, 28672, 8192, dict(block_n=64, split_k=4, num_stages=2)),
    (16, 14336, 4096, dict(block_n=64, split_k=8, num_stages=2)),
    (5, 4000, 4096, dict(block_n=128, split_k=4, num_stages=3)),
    (37, 3000, 1024, dict(block_n=64, split_k=1, num_stages=2, bf16_store=True)),
    # the tiles config_for(M, N, K, 120) gives SM 12.x at M = 64 and at M = 16, block_n 128
    (64, 28672, 8192, dict(block_n=64, split_k=1, num_stages=2, bf16_store=True)),
    (16, 4096, 14336, dict(block_n=128, split_k=8, num_stages=2)),
]


def run_gpu(out_dir: str, arch: tuple[int, int]) -> dict:
    dump = os.path.join(out_dir, f"ptx-{arch[0]}.{arch[1]}")
    os.makedirs(dump, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_TO"] = dump  # read when each kernel compiles
    import jax.numpy as jnp
    import numpy as np

    import oracle
    from nvfp4_jax.gemm.mosaic import MosaicConfig, matmul_mosaic
    from nvfp4_jax.testing import assert_gemm_close, mosaic_lowered_as

    rng = np.random.default_rng(0)
    recs = []
    for m, n, k, kw in CASES:
        cfg = MosaicConfig(mma="sync", **kw)
        mag = np.exp2(rng.uniform(-14, 5, (n, k // 16))).repeat(16, 1)
        wo = oracle.quantize((rng.standard_normal((n, k)) * mag).astype(np.float32), "trtllm")
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)).astype(jnp.bfloat16)
        rec = {"M": m, "N": n, "K": k, "config": kw, "arch_lowered": f"{arch[0]}.{arch[1]}"}
        try:
            with mosaic_lowered_as(arch):
                out = matmul_mosaic(x, jnp.asarray(wo.codes), jnp.asarray(wo.scales),
                                    np.float32(wo.decode_scale), out_dtype=jnp.float32,
                                    config=cfg)
            assert_gemm_close(np.asarray(out), np.asarray(x, np.float32), wo, out_dtype="float32",
                              splits=16)
            rec["oracle"] = "within bound"
        except Exception as e:  # noqa: BLE001 - recorded
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from run_meta import run_metadata

    return {**run_metadata(), "records": recs}


#: MoE layers (``moe_bench.SHAPES``) at decode T: ``nvfp4_jax.moe(backend="auto")`` as SM 12.x
#: runs it, the Mosaic MoE in its mma.sync form; the oracle checks T <= ORACLE_MAX_T (the
#: touched experts' float64 weights; the GPU tests check the form at small E).
MOE_CASES = [("qwen3_30b", 1), ("qwen3_30b", 8), ("qwen3_30b", 64), ("qwen3_30b", 256),
             ("nemotron", 1), ("nemotron", 8), ("nemotron", 64)]
ORACLE_MAX_T = 8


def run_gpu_moe(out_dir: str, arch: tuple[int, int]) -> dict:
    """Each ``MOE_CASES`` layer through ``nvfp4_jax.moe(backend="auto")`` with the device
    taken for SM 12.x (``choose_backend`` and ``moe_mosaic`` see compute capability 12.x) and
    Mosaic lowering as ``arch``: the backend auto picks, the two grouped GEMMs' configs as
    ``for_sm12x`` converts them (FC1 first), the oracle check (touched experts only, T <=
    ``ORACLE_MAX_T``); each case's PTX under ``ptx-moe-<arch>/<shape>_T<T>/`` (FC1 compiles
    first: its ``nvfp4_moe_mosaic_<i>.ptx`` has the lower i)."""
    import dataclasses
    import logging

    import jax
    import jax.numpy as jnp
    import numpy as np
    from moe_bench import (
        SHAPES,
        fc1_rows,
        input_scales,
        make_hidden,
        make_routing,
        make_weights,
        ours_weights,
    )

    import nvfp4_jax
    import oracle
    from nvfp4_jax.gemm import mosaic as gemm_mosaic
    from nvfp4_jax.moe import api
    from nvfp4_jax.moe import mosaic as moe_mosaic_mod
    from nvfp4_jax.testing import assert_moe_close, mosaic_lowered_as

    def touched(w, used):  # the oracle's form of experts ``used`` of stack ``w``
        o = nvfp4_jax.to_oracle(w)
        d = np.broadcast_to(o.decode_scale, (o.codes.shape[0],))
        return oracle.NVFP4(o.codes[used], o.scales[used], d[used])

    cc = 10 * arch[0] + arch[1]
    api.is_sm90, api.is_sm12x = (lambda: False), (lambda: True)
    api.gpu_compute_capability = lambda: cc
    moe_mosaic_mod.is_sm12x = gemm_mosaic.is_sm12x = lambda: True
    converted = []
    for_sm12x = moe_mosaic_mod.for_sm12x

    def spy(cfg, m_tile, whole_k=None):
        out = for_sm12x(cfg, m_tile, whole_k)
        converted.append((m_tile, out))
        return out

    moe_mosaic_mod.for_sm12x = spy
    picks = []

    class Picks(logging.Handler):
        def emit(self, record):
            picks.append(record.getMessage())

    logging.getLogger("nvfp4_jax.moe.api").addHandler(Picks())
    logging.getLogger("nvfp4_jax.moe.api").setLevel(logging.INFO)
    rng = np.random.default_rng(0)
    recs, weights = [], {}
    for sname, t in MOE_CASES:
        s = SHAPES[sname]
        e, h, k, act = s["experts"], s["hidden"], s["top_k"], s["activation"]
        if sname not in weights:
            weights.clear()
            _, _, q1, q2 = make_weights(jax.random.PRNGKey(1), s)
            weights[sname] = ours_weights(q1, q2, "swizzled_128x4")
        fc1, fc2 = weights[sname]
        s1, s2 = input_scales(s)
        ids, wts = (a[0] for a in make_routing(rng, t, e, k, "random"))
        x = make_hidden(t, h)
        rec = {"shape": sname, "T": t, "E": e, "H": h, "R": fc1_rows(s), "I": s["inter"],
               "top_k": k, "arch_lowered": f"{arch[0]}.{arch[1]}"}
        dump = os.path.join(out_dir, f"ptx-moe-{arch[0]}.{arch[1]}", f"{sname}_T{t}")
        os.makedirs(dump, exist_ok=True)
        os.environ["MOSAIC_GPU_DUMP_TO"] = dump
        converted.clear()
        picks.clear()
        try:
            with mosaic_lowered_as(arch):
                out = jax.jit(lambda x, f1, f2, a1, a2, i, w, act=act: nvfp4_jax.moe(
                    x, fc1=f1, fc2=f2, fc1_input_scale=a1, fc2_input_scale=a2, topk_ids=i,
                    topk_weights=w, activation=act))(
                    x, fc1, fc2, s1, s2, jnp.asarray(ids), jnp.asarray(wts))
                out = np.asarray(out.astype(jnp.float32))
            rec["auto"] = next((m for m in picks if "backend auto" in m), None)
            rec["block_m"] = converted[0][0]
            rec["fc1_config"], rec["fc2_config"] = (
                {kk: v for kk, v in dataclasses.asdict(c).items() if kk != "measured"}
                for _, c in converted[:2])
            if t <= ORACLE_MAX_T:  # the oracle on the touched experts, ids renumbered
                used, local = np.unique(ids, return_inverse=True)
                assert_moe_close(out, np.asarray(x, np.float32), local.reshape(ids.shape), wts,
                                 touched(fc1, used), touched(fc2, used), np.asarray(s1)[used],
                                 np.asarray(s2)[used],
                                 activation=act, mode="trtllm_cutlass",
                                 label=f"{sname} T={t} sm_{cc}")
                rec["oracle"] = f"within bound ({len(used)} touched experts)"
            else:
                finite = bool(np.isfinite(out).all())
                rec["oracle"] = f"not checked (T > {ORACLE_MAX_T}); finite: {finite}"
        except Exception as exc:  # noqa: BLE001 - recorded
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    from run_meta import run_metadata

    return {**run_metadata(), "records": recs}


def weights_per_warp_step(kw: dict) -> int:
    """Weights one warp decodes per pipeline step with MosaicConfig kwargs ``kw``: 16 rows of
    each 64-row block of ``block_n`` x ``block_k``."""
    from nvfp4_jax.gemm.mosaic import MosaicConfig

    cfg = MosaicConfig(**kw)
    return 16 * (cfg.block_n // 64) * cfg.block_k


def assemble(src: str, name: str, sm: str, ptxas: str, kw: dict) -> dict:
    """One dumped PTX (text ``src``, file ``name``) assembled for ``sm`` with ``ptxas``:
    registers, spills, stack, or the error; with a ``cuobjdump`` beside ``ptxas`` also the
    main loop (``sm12x_compile.main_loop_stats``: one pipeline step of one warp) and its
    warp-instructions per weight (``weights_per_warp_step`` of MosaicConfig kwargs ``kw``)."""
    from sm12x_compile import main_loop_stats

    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    path = os.path.join("/tmp", f"{name[:-4]}-{sm}.ptx")
    with open(path, "w") as f:
        f.write(re.sub(r"^\.target\s+\S+", f".target {sm}", src, count=1, flags=re.M))
    r = subprocess.run([ptxas, f"-arch={sm}", "-v", "-o", path[:-4] + ".cubin", path],
                       capture_output=True, text=True, check=False)
    rec = {"ptx": name, "arch": sm, "rc": r.returncode}
    info = r.stdout + r.stderr
    for key, pat in (("registers", r"Used (\d+) registers"),
                     ("spill_stores", r"(\d+) bytes spill stores"),
                     ("stack_bytes", r"(\d+) bytes stack frame")):
        mm = re.search(pat, info)
        if mm:
            rec[key] = int(mm.group(1))
    if r.returncode:
        rec["error"] = info[-600:]
    elif os.path.exists(cuobjdump):
        d = subprocess.run([cuobjdump, "-sass", path[:-4] + ".cubin"], capture_output=True,
                           text=True, check=False)
        loop = main_loop_stats(d.stdout) if d.returncode == 0 else None
        if loop:
            rec["main_loop"] = {k: loop[k] for k in ("n_instructions", "mma", "shared_loads")}
            rec["main_loop"]["opcodes"] = dict(list(loop["opcodes"].items())[:12])
            rec["warp_instructions_per_weight"] = loop["n_instructions"] / weights_per_warp_step(kw)
        else:
            rec["sass"] = f"cuobjdump: {d.stderr[-200:]}" if d.returncode else "no loop found"
    return rec


ARCHS = ("sm_90a", "sm_120a", "sm_121a")


def run_ptxas(ptx_dir: str, ptxas: str) -> list[dict]:
    """Every dumped GEMM PTX assembled for ``ARCHS`` (``assemble``). Mosaic numbers the dumps
    in compile order, so ``nvfp4_w4a16_mosaic_<i>.ptx`` is ``CASES[i]``: each record names its
    case."""
    recs = []
    for name in sorted(f for f in os.listdir(ptx_dir) if f.endswith(".ptx")):
        with open(os.path.join(ptx_dir, name)) as f:
            src = f.read()
        m, n, k, kw = CASES[int(re.search(r"_(\d+)\.ptx$", name).group(1))]
        for sm in ARCHS:
            recs.append({**assemble(src, name, sm, ptxas, kw),
                         "case": {"M": m, "N": n, "K": k, "config": kw}})
    return recs


def run_ptxas_moe(ptx_dir: str, ptxas: str, lowered: list[dict]) -> list[dict]:
    """The MoE cases' grouped-GEMM PTX (``run_gpu_moe``: ``<shape>_T<T>/`` per case, FC1's
    kernel compiled first, its name ``nvfp4_moe_mosaic_fc1_<i>``) assembled for ``ARCHS``, each
    with its GEMM's config from the lowering run's records (``lowered``)."""
    recs = []
    for case in lowered:
        sub = os.path.join(ptx_dir, f"{case['shape']}_T{case['T']}")
        if "error" in case or not os.path.isdir(sub):
            continue
        names = sorted((f for f in os.listdir(sub) if f.endswith(".ptx")),
                       key=lambda f: int(re.search(r"_(\d+)\.ptx$", f).group(1)))
        for order, name in zip(("fc1", "fc2"), names):
            gemm = next((g for g in ("fc1", "fc2") if f"_{g}_" in name), order)
            kw = {kk: case[f"{gemm}_config"][kk] for kk in ("block_n", "block_k")}
            with open(os.path.join(sub, name)) as f:
                src = f.read()
            for sm in ARCHS:
                recs.append({**assemble(src, name, sm, ptxas, kw),
                             "case": {kk: case[kk] for kk in ("shape", "T", "E", "H", "R", "I",
                                                              "top_k")},
                             "gemm": gemm, "config": case[f"{gemm}_config"]})
    return recs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--ptxas", default="", metavar="DIR", help="assemble the PTX dumped in DIR")
    p.add_argument("--ptxas-bin", default="ptxas")
    p.add_argument("--arch", default="12.0")
    p.add_argument("--moe", action="store_true", help="the MoE layers of MOE_CASES instead")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if a.ptxas:
        ver = subprocess.run([a.ptxas_bin, "--version"], capture_output=True, text=True).stdout
        # the lowering run's JSON (date, commit, GPU, versions; the MoE cases' configs) beside
        stem = "mosaic-sync-moe-lowered-" if a.moe else "mosaic-sync-lowered-"
        lowered = {}
        for f in sorted(os.listdir(a.ptxas)):
            if f.startswith(stem) and f.endswith(".json"):
                with open(os.path.join(a.ptxas, f)) as fh:
                    lowered = json.load(fh)
                break
        header = {k: v for k, v in lowered.items() if k != "records"} or None
        recs = (run_ptxas_moe(a.ptxas, a.ptxas_bin, lowered.get("records", [])) if a.moe
                else run_ptxas(a.ptxas, a.ptxas_bin))
        doc = {"ptxas": ver.strip().splitlines()[-1], "lowered": header, "records": recs}
        if a.moe:
            doc["lowered_cases"] = lowered.get("records", [])
        path = os.path.join(a.out, f"mosaic-sync-{'moe-' if a.moe else ''}sm12x-ptxas.json")
    else:
        arch = tuple(int(v) for v in a.arch.split("."))
        doc = (run_gpu_moe if a.moe else run_gpu)(a.out, arch)
        path = os.path.join(a.out, f"mosaic-sync-{'moe-' if a.moe else ''}lowered-{a.arch}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
