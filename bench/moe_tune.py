"""Tile sweep of ``nvfp4_jax.moe`` (Pallas) on the GPU: the layer time of each MoEConfig.

Usage: python3 bench/moe_tune.py --out DIR [--cases qwen3_30b:1,nemotron:8] [--budget-s 200]
Times each case's whole layer as moe_bench does (in-graph, NROT layers per loop iteration,
difference of two loop lengths) for the default config and the variants below; writes
DIR/moe-tune.json progressively and prints the best per case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moe_bench import (
    SHAPES,
    SMOKE,
    device_routings,
    input_scales,
    make_hidden,
    make_routing,
    make_weights,
    measure,
    nvfp4_layer,
    per_layer_scales,
    timed_loop,
)

from nvfp4_jax.moe.configs import MoEConfig, default_config


def variants(base: MoEConfig, gated: bool) -> list[MoEConfig]:
    """The default plus single-knob moves on FC1 and FC2 (tile width, depth, K step)."""
    r = dataclasses.replace
    out = [base]
    f1, f2 = base.fc1, base.fc2
    for bn in (32, 64, 128):
        if bn != f1.block_n and not (gated and bn == 128):
            out.append(MoEConfig(r(f1, block_n=bn), f2))
        if bn != f2.block_n:
            out.append(MoEConfig(f1, r(f2, block_n=bn)))
    for bk in (128, 256):
        if bk != f1.block_k:
            out.append(MoEConfig(r(f1, block_k=bk), r(f2, block_k=bk)))
    for st in (2, 3, 4):
        if st != f1.num_stages:
            out.append(MoEConfig(r(f1, num_stages=st), r(f2, num_stages=st)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--cases", default="qwen3_30b:1,nemotron:8,qwen3_30b:64")
    ap.add_argument("--budget-s", type=float, default=200.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_end = time.time() + args.budget_s
    recs = []
    for case in args.cases.split(","):
        sname, t = case.split(":")
        t = int(t)
        s = {**SHAPES, **SMOKE}[sname]
        e, h, i, k, act = s["experts"], s["hidden"], s["inter"], s["top_k"], s["activation"]
        _, _, q1, q2 = make_weights(jax.random.PRNGKey(1), s)
        params = (q1, q2, *input_scales(s))
        ids, wts = make_routing(np.random.default_rng(0), t, e, k, "random")
        ids, wts = device_routings(ids, wts)
        x = make_hidden(t, h)
        base = default_config(t * k, e, inter=i, hidden=h, gated=act == "swiglu")
        for cfg in variants(base, act == "swiglu"):
            if time.time() > t_end:
                print("budget exhausted", flush=True)
                break
            layer = nvfp4_layer(act, "pallas", cfg)
            try:
                us, _n = measure(timed_loop(layer, per_layer_scales), x, ids, wts, params, budget_s=0.1, reps=3)
                rec = {"shape": sname, "T": t, "us": us, "fc1": dataclasses.asdict(cfg.fc1),
                       "fc2": dataclasses.asdict(cfg.fc2), "default": cfg == base}
            except Exception as exc:  # noqa: BLE001 - record and go on
                rec = {"shape": sname, "T": t, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                       "fc1": dataclasses.asdict(cfg.fc1), "fc2": dataclasses.asdict(cfg.fc2)}
            recs.append(rec)
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "moe-tune.json"), "w") as f:
                json.dump(recs, f, indent=1)
    for case in args.cases.split(","):
        sname, t = case.split(":")
        ok = [r for r in recs if r["shape"] == sname and r["T"] == int(t) and "us" in r]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            dflt = next((r["us"] for r in ok if r["default"]), float("nan"))
            print(f"{case}: default {dflt:.1f} us, best {best['us']:.1f} us fc1={best['fc1']} fc2={best['fc2']}")


if __name__ == "__main__":
    main()
