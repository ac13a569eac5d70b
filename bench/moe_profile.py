"""Where does one MoE layer's time go? Device kernels of ``nvfp4_jax.moe`` from a profiler trace.

Usage: python3 bench/moe_profile.py --out DIR [--cases qwen3_30b:1,nemotron:1,nemotron:8]
[--scale-layout swizzled_128x4] [--pad-fc2] (the weights as ``moe_bench`` times them)
Runs each case's jitted layer (NROT layers back to back, as moe_bench times it) under
``jax.profiler.trace(create_perfetto_trace=True)``, then sums the device events per kernel name
and prints per-layer microseconds: the two Pallas kernels against the XLA glue (routing
preparation, input quantization, gathers, the top-k sum). Writes DIR/moe-profile.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from moe_bench import (
    NROT,
    SHAPES,
    SMOKE,
    device_routings,
    input_scales,
    make_hidden,
    make_routing,
    make_weights,
    nvfp4_layer,
    ours_weights,
    per_layer_scales,
    unrolled_layers,
)


def load_trace(trace_dir: str) -> tuple[list[dict], dict, dict]:
    """The perfetto trace JAX wrote under ``trace_dir``: (its events, process names by pid,
    thread names by (pid, tid))."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    paths += glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"no perfetto trace under {trace_dir}")
    with gzip.open(paths[0]) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    meta = [e for e in events if e.get("ph") == "M" and "args" in e]
    pname = {e["pid"]: e["args"].get("name", "") for e in meta if e.get("name") == "process_name"}
    tname = {(e["pid"], e.get("tid")): e["args"].get("name", "") for e in meta
             if e.get("name") == "thread_name"}
    return events, pname, tname


def device_events(trace: tuple[list[dict], dict, dict]) -> tuple[list[dict], list[str]]:
    """Complete events on the GPU's stream tracks of a ``load_trace`` (a device's
    "XLA Ops"/"XLA Modules" tracks repeat the same time as ops, so only "Stream" tracks count;
    all tracks if none is named so)."""
    events, pname, tname = trace
    gpu = {pid for pid, n in pname.items() if "gpu" in n.lower()}
    streams = {key for key, n in tname.items() if key[0] in gpu and "stream" in n.lower()}
    keep = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu
            and (not streams or (e["pid"], e.get("tid")) in streams)]
    tracks = sorted({f"{pname[p]} / {n}" for (p, _t), n in tname.items() if p in gpu})
    return keep, tracks


def traced_events(step, state, reps: int) -> tuple[list[dict], list[str]]:
    """``state = step(state)`` once to compile and warm up, then ``reps`` times under
    ``jax.profiler.trace``; returns ``device_events`` of that trace (the steps' launches)."""
    jax.block_until_ready(step(state))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(reps):
                state = step(state)
            jax.block_until_ready(state)
        return device_events(load_trace(d))


def kernel_table(evs: list[dict], units: int) -> tuple[list[tuple[float, float, str]], float, float]:
    """Device events -> ([(us per unit, launches per unit, kernel name)], largest first; busy us
    per unit; span us per unit: first start to last end over ``units``)."""
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in evs:
        per[ev["name"]][0] += float(ev.get("dur", 0.0))
        per[ev["name"]][1] += 1
    rows = sorted(((v[0] / units, v[1] / units, name) for name, v in per.items()), reverse=True)
    span = (max(e["ts"] + e.get("dur", 0) for e in evs) - min(e["ts"] for e in evs)) / units if evs else 0.0
    return rows, sum(r[0] for r in rows), span


def profile_case(sname: str, t: int, reps: int, hlo_path: str | None = None, *,
                 scale_layout: str = "linear", padded: bool = False) -> dict:
    s = {**SHAPES, **SMOKE}[sname]
    e, h, _i, k, act = s["experts"], s["hidden"], s["inter"], s["top_k"], s["activation"]
    _, _, q1, q2 = make_weights(jax.random.PRNGKey(1), s)
    q1, q2 = ours_weights(q1, q2, scale_layout, padded)
    ids, wts = make_routing(np.random.default_rng(0), t, e, k, "random")
    ids, wts = device_routings(ids, wts)
    x0 = make_hidden(t, h)
    layer = nvfp4_layer(act, "auto")

    # one call, one trace of NROT layers, each with its own run-time global scales, as timed
    layers = jax.jit(unrolled_layers(layer, per_layer_scales))

    p = (q1, q2, *input_scales(s))
    if hlo_path:  # the optimized HLO (which fusions, copies and custom calls a layer launches)
        with open(hlo_path, "w") as f:
            f.write(layers.lower(x0, ids, wts, p).compile().as_text())
    evs, tracks = traced_events(lambda x: layers(x, ids, wts, p), x0, reps)
    rows, busy, span = kernel_table(evs, reps * NROT)
    print(f"\n{sname} T={t}: {len(evs)} device events, {busy:.1f} us busy / {span:.1f} us span per layer")
    for us, cnt, name in rows[:25]:
        print(f"  {us:8.2f} us  x{cnt:5.2f}  {name[:110]}")
    return {"shape": sname, "T": t, "scale_layout": scale_layout, "fc2_padded": padded,
            "busy_us_per_layer": busy, "span_us_per_layer": span,
            "tracks": tracks[:20],
            "kernels": [{"name": n[:200], "us_per_layer": u, "calls_per_layer": c} for u, c, n in rows[:60]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--cases", default="qwen3_30b:1,nemotron:1,nemotron:8,qwen3_30b:64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hlo", action="store_true", help="write the first case's optimized HLO")
    ap.add_argument("--scale-layout", default="linear", choices=("linear", "swizzled_128x4"))
    ap.add_argument("--pad-fc2", action="store_true", help="FC2 zero-padded along K (moe.pad_fc2)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = []
    for case in args.cases.split(","):
        sname, t = case.split(":")
        try:
            hlo = os.path.join(args.out, f"moe-hlo-{sname}-{t}.txt") if args.hlo and not res else None
            res.append(profile_case(sname, int(t), args.reps, hlo, scale_layout=args.scale_layout,
                                    padded=args.pad_fc2))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{case}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            res.append({"case": case, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
        with open(os.path.join(args.out, "moe-profile.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
