"""The Mosaic GEMM with warp-level ``mma.sync`` (``MosaicConfig(mma="sync")``: the form SM 12.x
can run) against the same tiles with ``wgmma``, the Pallas-Triton kernel (``backend="pallas"``),
and bf16 ``jnp.dot``, W4A16, on this GPU, interleaved rounds of ``gemm_bench.make_timer``
(in-graph, one call per weight copy, copies > 4x L2).

    python bench/mosaic_mma_bench.py --out $OUT [--shapes 28672x8192,...] [--ms 1,16,64]

Writes ``mosaic-mma-<gpu>.json``: per shape and M each impl's median us, its rounds, x bf16,
and the configs. With ``--dump-shape NxK --dump-m M`` it also compiles that one sync kernel
alone first (for ``MOSAIC_GPU_DUMP_TO``: its PTX and SASS)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm_bench as gb  # noqa: E402
from run_meta import gpu_tag, run_metadata  # noqa: E402

from nvfp4_jax.gemm import mosaic  # noqa: E402


def mosaic_fn(cfg):
    def fn(x, w):
        return mosaic.matmul_mosaic(x, w.codes, w.scales, w.decode_scale, config=cfg)

    return fn


def sync_of(cfg: mosaic.MosaicConfig) -> mosaic.MosaicConfig:
    """The same tiles with mma.sync (no overlap, one warpgroup)."""
    return dataclasses.replace(cfg, mma="sync", overlap=False, consumers=1, measured="")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shapes", default="28672x8192,4096x14336,14336x4096")
    p.add_argument("--ms", default="1,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--pallas", action="store_true", help="also time backend='pallas'")
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    ms = [int(v) for v in a.ms.split(",") if v]
    t0 = time.time()
    meta = run_metadata()
    path = os.path.join(a.out, f"mosaic-mma-{gpu_tag(meta.get('gpu') or '')}.json")
    doc = {**meta, "timing": "in-graph, interleaved rounds (gemm_bench.make_timer)",
           "repeats": a.repeats, "records": []}
    for n, k in shapes:
        ws = gb.make_weights(n, k, gb.n_copies(gb.nvfp4_bytes(n, k)))
        cb = gb.n_copies(2 * n * k)
        wb = [nvfp4_dq(w) for w in ws[:cb]]
        wb += [wb[i % len(wb)] * jnp.bfloat16(1 + i) for i in range(len(wb), cb)]
        for m in ms:
            x = gb.make_x(m, k)
            wcfg = mosaic.auto_config(m, n, k) or mosaic.default_config(m, n, k)
            impls = [("bf16_dot", None, gb.impl_bf16_dot, wb),
                     ("mosaic_wgmma", wcfg, mosaic_fn(wcfg), ws),
                     ("mosaic_sync", sync_of(wcfg), mosaic_fn(sync_of(wcfg)), ws)]
            if wcfg.overlap or wcfg.consumers > 1:
                plain = dataclasses.replace(wcfg, overlap=False, consumers=1, measured="")
                impls.append(("mosaic_wgmma_plain", plain, mosaic_fn(plain), ws))
            if a.pallas:
                impls.append(("pallas", None, gb.impl_ours_w4a16(None, "pallas"), ws))
            timers = []
            for label, cfg, fn, wl in impls:
                if time.time() - t0 > a.budget_s:
                    doc["records"].append({"N": n, "K": k, "M": m, "label": label, "skipped": "budget"})
                    continue
                try:
                    timers.append((label, cfg, gb.make_timer(fn, x, wl, target_s=0.01)))
                except Exception as e:  # noqa: BLE001 - record and go on
                    doc["records"].append({"N": n, "K": k, "M": m, "label": label,
                                           "error": repr(e)[:2000]})
                    gb.log(f"{label} {m}x{n}x{k}: {e!r}"[:2000])
            samples = {label: [] for label, _, _ in timers}
            for _ in range(a.repeats):
                for label, _, timer in timers:
                    samples[label].append(timer() * 1e6)
            bf16 = float(np.median(samples["bf16_dot"])) if "bf16_dot" in samples else float("nan")
            for label, cfg, _ in timers:
                us = float(np.median(samples[label]))
                rec = {"N": n, "K": k, "M": m, "label": label, "median_us": us,
                       "rounds_us": samples[label], "x_bf16": bf16 / us}
                if cfg is not None:
                    rec["config"] = {kk: v for kk, v in cfg.__dict__.items() if kk != "measured"}
                doc["records"].append(rec)
                gb.log(json.dumps({kk: v for kk, v in rec.items() if kk != "config"}))
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
        del ws, wb
    print(path)


def nvfp4_dq(w):
    import nvfp4_jax

    return nvfp4_jax.dequantize(w, jnp.bfloat16)


if __name__ == "__main__":
    main()
