"""The Mosaic GEMM with ``mma.sync`` lowered as for SM 12.x, run on this (sm_90) GPU.

With the compute capability Mosaic GPU's Python lowering reads set to 12.0 (RTX 50xx) or
12.1 (DGX Spark) (``nvfp4_jax.testing.mosaic_lowered_as``), each case is lowered with every
choice SM 12.x would get, compiled for this GPU by Mosaic's C++ and checked against the
oracle (``assert_gemm_close``); ``MOSAIC_GPU_DUMP_TO`` keeps
each kernel's PTX, which ``ptxas -arch=sm_120a / sm_121a`` then assembles on any machine
(``--ptxas DIR``: registers, spills, and with ``cuobjdump`` the main loop's warp-instructions
per weight, for sm_90a as well).

    python bench/mosaic_sm12x.py --out $OUT            # on the GPU
    python bench/mosaic_sm12x.py --ptxas $OUT/ptx-12.0 --out bench/results   # anywhere
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


def weights_per_warp_step(kw: dict) -> int:
    """Weights one warp decodes per pipeline step with MosaicConfig kwargs ``kw``: 16 rows of
    each 64-row block of ``block_n`` x ``block_k``."""
    from nvfp4_jax.gemm.mosaic import MosaicConfig

    cfg = MosaicConfig(**kw)
    return 16 * (cfg.block_n // 64) * cfg.block_k


def run_ptxas(ptx_dir: str, ptxas: str) -> list[dict]:
    """Assemble every dumped PTX for sm_90a, sm_120a and sm_121a: registers, spills, stack, or
    the error; with a ``cuobjdump`` beside ``ptxas`` also the main loop (``sm12x_compile.
    main_loop_stats``: one pipeline step of one warp) and its warp-instructions per weight
    (``weights_per_warp_step``). Mosaic numbers the dumps in compile order, so
    ``nvfp4_w4a16_mosaic_<i>.ptx`` is ``CASES[i]``: each record names its case."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm12x_compile import main_loop_stats

    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    recs = []
    for name in sorted(f for f in os.listdir(ptx_dir) if f.endswith(".ptx")):
        src = open(os.path.join(ptx_dir, name)).read()
        for sm in ("sm_90a", "sm_120a", "sm_121a"):
            path = os.path.join("/tmp", f"{name[:-4]}-{sm}.ptx")
            with open(path, "w") as f:
                f.write(re.sub(r"^\.target\s+\S+", f".target {sm}", src, count=1, flags=re.M))
            r = subprocess.run([ptxas, f"-arch={sm}", "-v", "-o", path[:-4] + ".cubin", path],
                               capture_output=True, text=True, check=False)
            i = int(re.search(r"_(\d+)\.ptx$", name).group(1))
            m, n, k, kw = CASES[i]
            rec = {"ptx": name, "case": {"M": m, "N": n, "K": k, "config": kw}, "arch": sm,
                   "rc": r.returncode}
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
                    rec["main_loop"] = {k: loop[k]
                                        for k in ("n_instructions", "mma", "shared_loads")}
                    rec["main_loop"]["opcodes"] = dict(list(loop["opcodes"].items())[:12])
                    rec["warp_instructions_per_weight"] = (loop["n_instructions"]
                                                           / weights_per_warp_step(kw))
                else:
                    rec["sass"] = (f"cuobjdump: {d.stderr[-200:]}" if d.returncode
                                   else "no loop found")
            recs.append(rec)
    return recs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--ptxas", default="", metavar="DIR", help="assemble the PTX dumped in DIR")
    p.add_argument("--ptxas-bin", default="ptxas")
    p.add_argument("--arch", default="12.0")
    a = p.parse_args()
    if a.ptxas:
        ver = subprocess.run([a.ptxas_bin, "--version"], capture_output=True, text=True).stdout
        # the lowering run's header (date, commit, GPU, versions) where its JSON lies beside
        header = None
        for f in sorted(os.listdir(a.ptxas)):
            if f.startswith("mosaic-sync-lowered-") and f.endswith(".json"):
                with open(os.path.join(a.ptxas, f)) as fh:
                    header = {k: v for k, v in json.load(fh).items() if k != "records"}
                break
        doc = {"ptxas": ver.strip().splitlines()[-1], "lowered": header,
               "records": run_ptxas(a.ptxas, a.ptxas_bin)}
        path = os.path.join(a.out, "mosaic-sync-sm12x-ptxas.json")
    else:
        arch = tuple(int(v) for v in a.arch.split("."))
        doc = run_gpu(a.out, arch)
        path = os.path.join(a.out, f"mosaic-sync-lowered-{a.arch}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
