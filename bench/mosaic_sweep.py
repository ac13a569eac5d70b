"""Mosaic GPU NVFP4 kernel: config sweep vs the Pallas-Triton kernel and bf16 jnp.dot (H200).

Usage (on the GPU machine): python bench/mosaic_sweep.py --out DIR [--budget-s 200] [--plan P]
P: 'NxK:m1,m2;NxK:m3'. Timing: gemm_bench.make_timer (in-graph, distinct weight copies), --rounds interleaved.
Each Mosaic config is also checked against the XLA backend (max |diff| / max |ref|).
Writes DIR/mosaic-sweep-h200.json: the run's date, commit, GPU and versions, and "records", one
per (shape, M, impl, config) (rounds 4-7 under bench/results are bare lists of records).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gemm_bench as gb
import jax.numpy as jnp
import numpy as np
from run_meta import run_metadata

import nvfp4_jax
from nvfp4_jax.gemm import configs
from nvfp4_jax.gemm.mosaic import (
    MosaicConfig,
    auto_config,
    check_config,
    default_config,
    matmul_mosaic,
    token_tile,
)

PLAN = "28672x8192:16,64;4096x14336:16,64;14336x4096:16,64;4096x4096:16,64"
SMEM_PER_SM = 228 * 1024  # H200 (sm_90): shared memory per SM; 1 KB of it reserved per CTA
N_SM = 132


def mosaic_fn(cfg):
    def fn(x, w):
        return matmul_mosaic(x, w.codes, w.scales, w.decode_scale, config=cfg)

    return fn


def candidates(m, n, k, cap=10, cap_512=2):
    """Configs worth timing: the default, the committed "auto" entry, then the best-scored of
    all (block_n, block_k, stages, split) by a wave model: CTAs per SM from shared memory,
    wave efficiency (CTAs / slots over its ceiling) times the weight rows in flight per SM."""
    mt = token_tile(m)
    fixed = [default_config(m, n, k)]
    if auto_config(m, n, k) is not None:
        fixed.append(auto_config(m, n, k))
    scored = []
    for bn in (64, 128):
        for bk in (256, 512):
            if k % bk:
                continue
            steps = k // bk
            for st in (2, 3, 4, 6):
                for sp in (1, 2, 4, 8):
                    if steps % sp or steps // sp < 2:
                        continue
                    cfg = MosaicConfig(block_n=bn, split_k=sp, num_stages=st, block_k=bk)
                    smem = cfg.smem_bytes(mt)
                    if smem > 200 * 1024:
                        continue
                    occ = min(SMEM_PER_SM // (smem + 1024), 8)
                    waves = -(-n // bn) * sp / (N_SM * occ)
                    score = waves / math.ceil(waves) * min(1.0, occ * bn / 256)
                    scored.append((score, cfg))
    scored.sort(key=lambda t: -t[0])
    out = list(dict.fromkeys(fixed))
    for _, cfg in scored:
        if len(out) >= cap:
            break
        if cfg not in out:
            out.append(cfg)
    out += [c for _, c in scored if c.block_k == 512 and c not in out][:cap_512]
    return out


def variants(m, n, k, spec):
    """Configs from ``spec`` ('base;field=v,field=v;...'), each the case's auto (else default)
    config with the named fields replaced; ones that cannot run (shared memory, block_k) are
    dropped with a message."""
    base = auto_config(m, n, k) or default_config(m, n, k)
    out = []
    for part in spec.split(";"):
        kw = {}
        for item in filter(None, part.split(",")):
            if item == "base":
                continue
            key, val = item.split("=")
            kind = type(getattr(base, key))  # the field's type: bool as 0/1, int, str as given
            kw[key] = bool(int(val)) if kind is bool else kind(val)
        cfg = dataclasses.replace(base, **kw)
        try:
            check_config(cfg, k, token_tile(m))
        except ValueError as e:
            print(f"skip {cfg}: {e}", flush=True)
            continue
        out.append(cfg)
    return list(dict.fromkeys(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--plan", default=PLAN)
    p.add_argument("--variants", default="",
                   help="instead of the wave-model candidates: variants of each case's auto (or "
                        "default) config, e.g. 'base;overlap=1;block_k=512,overlap=1'")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds per impl, interleaved over the case's impls; the row's "
                        "median_us is their median, rounds_us all of them")
    p.add_argument("--target-s", type=float, default=0.05,
                   help="seconds of looped calls per timing (longer: less spread; round 6 saw "
                        "+-30 %% outliers at 0.01)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "mosaic-sweep-h200.json")
    t0 = time.time()
    rows = []
    meta = {**run_metadata(), "what": f"mosaic GEMM config sweep: plan {a.plan!r}, variants {a.variants!r}"}
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
                # the public API with backend="auto" (what gemm_bench times), same process
                ("api_auto", lambda x, w: nvfp4_jax.matmul(x, w), ws, gb.nvfp4_bytes(n, k), None),
            ]
            for cfg in (variants(m, n, k, a.variants) if a.variants else candidates(m, n, k)):
                impls.append(("mosaic", mosaic_fn(cfg), ws, gb.nvfp4_bytes(n, k), cfg))
            timed = []  # (row, timer, bytes) of each impl that compiled
            for name, fn, wl, wbytes, cfg in impls:
                if time.time() - t0 > a.budget_s:
                    break
                row = {"impl": name, "N": n, "K": k, "M": m,
                       "config": cfg.__dict__ if isinstance(cfg, MosaicConfig) else cfg}
                try:
                    if name == "mosaic":
                        got = np.asarray(fn(x, wl[0]), np.float32)
                        row["rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                    timed.append((row, gb.make_timer(fn, x, wl, target_s=a.target_s,
                                                       per_call_x=name in ("mosaic", "api_auto")), wbytes))
                except Exception as e:  # noqa: BLE001 - record and continue the sweep
                    row["error"] = repr(e)[:600]
                    rows.append(row)
            # rounds interleaved over the impls: drift between rounds hits all of them alike
            rounds = {id(row): [] for row, _, _ in timed}
            for r in range(a.rounds):
                if r and time.time() - t0 > a.budget_s:
                    break
                for row, timer, _ in timed:
                    rounds[id(row)].append(timer() * 1e6)
            for row, _, wbytes in timed:  # round 0 always runs
                us = rounds[id(row)]
                t = float(np.median(us))
                row.update(median_us=t, weight_tbps=wbytes / t / 1e6, rounds_us=us)
                rows.append(row)
                print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump({**meta, "records": rows}, f, indent=0)
            del x
        del ws, wb
    print("elapsed", time.time() - t0)
    summarize(rows)


def summarize(rows):
    """One line per row, fastest first within each (N, K, M): us, TB/s, error, config."""
    cases = sorted({(r["N"], r["K"], r["M"]) for r in rows})
    for case in cases:
        print(f"--- {case[0]}x{case[1]} M={case[2]}")
        rs = [r for r in rows if (r["N"], r["K"], r["M"]) == case]
        for r in sorted(rs, key=lambda r: r.get("median_us", 1e9)):
            c = r.get("config") or {}
            desc = "/".join(str(v) for v in c.values()) if r["impl"] == "mosaic" else ""
            spread = r.get("rounds_us") or []
            spread = f"[{min(spread):.1f}-{max(spread):.1f}]" if len(spread) > 1 else ""
            print(f"{r['impl']:9s} {r.get('median_us', float('nan')):8.1f} us {spread:13s} "
                  f"{r.get('weight_tbps', float('nan')):5.2f} TB/s err {r.get('rel_err', 0):.1e} "
                  f"{desc} {r.get('error', '')[:80]}")


if __name__ == "__main__":
    main()
