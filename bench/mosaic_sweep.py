"""Mosaic GPU NVFP4 kernel: config sweep vs the Pallas-Triton kernel and bf16 jnp.dot (H200).

Usage (on the GPU machine): python bench/mosaic_sweep.py --out DIR [--budget-s 200] [--plan P]
P: 'NxK:m1,m2;NxK:m3'. Timing: gemm_bench.time_per_call (in-graph, distinct weight copies).
Each Mosaic config is also checked against the XLA backend (max |diff| / max |ref|).
Writes DIR/mosaic-sweep-h200.json (one row per (shape, M, impl, config)).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gemm_bench as gb
import jax.numpy as jnp
import numpy as np

import nvfp4_jax
from nvfp4_jax.gemm import configs
from nvfp4_jax.gemm.mosaic import MosaicConfig, default_config, matmul_mosaic

PLAN = "28672x8192:1,16,64;4096x4096:16,64;14336x4096:16;4096x14336:16"


def mosaic_fn(cfg):
    def fn(x, w):
        return matmul_mosaic(x, w.codes, w.scales, w.decode_scale, config=cfg)

    return fn


def candidates(m, n, k):
    d = default_config(m, n, k)
    c = [d]
    for bn, st, sp in [(64, 4, 2 * d.split_k), (128, 6, d.split_k), (64, 6, d.split_k)]:
        cfg = MosaicConfig(block_n=bn, split_k=sp, num_stages=st)
        if cfg not in c:
            c.append(cfg)
    return c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--plan", default=PLAN)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "mosaic-sweep-h200.json")
    t0 = time.time()
    rows = []
    for part in a.plan.split(";"):
        shp, mss = part.split(":")
        n, k = (int(v) for v in shp.split("x"))
        copies = gb.n_copies(gb.nvfp4_bytes(n, k))
        ws = gb.make_weights(n, k, copies)
        cb = gb.n_copies(2 * n * k)
        wb = [nvfp4_jax.dequantize(w, jnp.bfloat16) for w in ws[:cb]]
        wb += [wb[i % len(wb)] * jnp.bfloat16(1 + i) for i in range(len(wb), cb)]
        for m in (int(v) for v in mss.split(",")):
            x = gb.make_x(m, k)
            ref = np.asarray(nvfp4_jax.gemm.matmul(x, ws[0], backend="xla"), np.float32)
            impls = [] if os.environ.get("SWEEP_SKIP_BASE") else [
                ("bf16_dot", gb.impl_bf16_dot, wb, 2 * n * k, None),
                ("pallas", gb.impl_ours_w4a16(), ws, gb.nvfp4_bytes(n, k),
                 configs.get_config(m, n, k).__dict__),
            ]
            for cfg in candidates(m, n, k):
                impls.append(("mosaic", mosaic_fn(cfg), ws, gb.nvfp4_bytes(n, k), cfg))
            for name, fn, wl, wbytes, cfg in impls:
                if time.time() - t0 > a.budget_s:
                    break
                row = {"impl": name, "N": n, "K": k, "M": m,
                       "config": cfg.__dict__ if isinstance(cfg, MosaicConfig) else cfg}
                try:
                    if name == "mosaic":
                        got = np.asarray(fn(x, ws[0]), np.float32)
                        row["rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                    t = gb.time_per_call(fn, x, wl, target_s=0.01)
                    row.update(median_us=t * 1e6, weight_tbps=wbytes / t / 1e12)
                except Exception as e:  # noqa: BLE001 - record and continue the sweep
                    row["error"] = repr(e)[:600]
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(path, "w") as f:
                    json.dump(rows, f, indent=0)
            del x
        del ws, wb
    print("elapsed", time.time() - t0)


if __name__ == "__main__":
    main()
