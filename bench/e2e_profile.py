"""Where does a decoder's batch-1 step go? Device kernels of ``models.decode_step`` from a
profiler trace, stacked layers (``lax.scan``) against unrolled ones.

Usage: python3 bench/e2e_profile.py --out DIR [--models llama-3-8b,qwen3-30b-a3b,nemotron-3-nano]
[--layers 4] [--layouts scan,unrolled] [--steps 8] [--context 1024] [--backend auto] [--tiny]
[--hlo]

For each model and layout: the random NVFP4 model of ``e2e_bench.build_model`` (or
``build_nemotron_h``, whose "scan" layout is ``stacked()``: its repeated layer units scanned;
``--layers`` overrides the depth, for Nemotron-H the first layers of its pattern),
``--steps`` greedy decode steps at batch 1 under ``jax.profiler.trace`` after a warm-up, and
per step: the wall time, the device time summed over kernels ("busy"), of it the time in
copy kernels (memcpy and pure dynamic-slice fusions: weights copied out of a stack, which
reading stacks in place avoids), first kernel start to last kernel end ("span"), kernel
launches, and the kernels by device time; before the trace, the untraced wall time per step
and the host time until each step's call returns (the median of 5 runs, each from the same
cached length). Busy against span says whether time goes
to kernels or to gaps between them; span against wall whether the host keeps up. Writes
DIR/e2e-profile.json. Without a GPU the trace holds no device events: the records say so and
carry the wall time only. Models profiled one after another in one process are not
independent (a model after another measured up to 10 % slower, ``e2e_bench.py``'s
docstring): for numbers to compare, profile one model per process (``--models NAME``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import e2e_bench  # noqa: E402
from moe_profile import device_events, kernel_table, load_trace  # noqa: E402
from run_meta import run_metadata  # noqa: E402

from nvfp4_jax import models  # noqa: E402

LAYOUTS = ("scan", "unrolled")


#: kernels that only copy: XLA's memcpy thunks and its pure dynamic-slice fusions (a scanned
#: layer's weights copied for a kernel that cannot take the slice in place)
COPY_KERNEL = re.compile(r"^(memcpy\w*|MemcpyD2D|loop_dynamic_slice_fusion(_\d+)?)$")


def copies_us(rows) -> float:
    """Device us per step in copy kernels (``COPY_KERNEL``) of a ``kernel_table``."""
    return sum(us for us, _, name in rows if COPY_KERNEL.match(name))


def host_events(trace: tuple[list[dict], dict, dict], steps: int, top: int = 25) -> list[dict]:
    """The host side of a ``load_trace``: complete events off the GPU's tracks (XLA's thunks,
    the runtime's launches; not Python's frames), by name, ms per step summed over threads,
    largest first (nested events count in each of their parents' names too: a table of where
    host time goes, not a sum)."""
    events, pname, _ = trace
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if (e.get("ph") == "X" and "gpu" not in pname.get(e.get("pid"), "").lower()
                and not str(e.get("name", "")).startswith("$")):  # not the Python tracer's
            name = re.sub(r"\d+", "#", str(e.get("name", "")))[:120]
            per[name][0] += float(e.get("dur", 0.0))
            per[name][1] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n, "ms_per_step": v[0] / 1e3 / steps, "calls_per_step": v[1] / steps}
            for n, v in rows]


def profile_decode(model, context: int, steps: int, backend: str = "auto",
                   hlo_path: str | None = None) -> dict:
    """``steps`` batch-1 greedy decode steps of ``model`` under the profiler (after two warm-up
    steps): wall ms per step, the device kernels and the host events per step. ``hlo_path``:
    also write the step's optimized HLO there."""
    cfg = model.config
    cache = models.init_cache(cfg, 1, context + steps + 4)  # ``context`` tokens already cached
    cache = dataclasses.replace(cache, length=jnp.asarray(context, jnp.int32))
    tok = jnp.zeros((1,), jnp.int32)

    def step(tok, cache):
        logits, cache = models.decode_step(model, tok, cache, backend=backend)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    def run(n, tok, cache):
        """n steps: (tok, cache, wall s per step, host s per step until each call returns)."""
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(n):
            t1 = time.perf_counter()
            tok, cache = step(tok, cache)
            host += time.perf_counter() - t1
        jax.block_until_ready((tok, cache))
        return tok, cache, (time.perf_counter() - t0) / n, host / n

    tok, cache, _, _ = run(2, tok, cache)  # warm-up
    if hlo_path:
        with open(hlo_path, "w") as f:
            # the model an argument, as decode_step takes it (closed over, its weights would be
            # constants of another program)
            lowered = models.decode_step.lower(model, tok, cache, backend=backend)
            f.write(lowered.compile().as_text())
    # untraced: the wall time per step, and the host's share of it (dispatch is asynchronous,
    # so host ~= wall means the host, not the GPU, sets the pace); the median of 5 runs (one
    # run of 64 batch-1 steps lasts 0.2 s: single runs of one tree measured 3.24 and 5.04 ms)
    runs = []
    for _ in range(5):  # each run from ``context`` cached tokens
        cache = dataclasses.replace(cache, length=jnp.asarray(context, jnp.int32))
        tok, cache, untraced, host = run(steps, tok, cache)
        runs.append((untraced, host))
    untraced, host = sorted(runs)[len(runs) // 2]
    cache = dataclasses.replace(cache, length=jnp.asarray(context, jnp.int32))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            tok, cache, wall, _ = run(steps, tok, cache)
        trace = load_trace(d)
    evs, tracks = device_events(trace)
    host_rows = host_events(trace, steps)
    rows, busy, span = kernel_table(evs, steps)
    rec = {"untraced_wall_ms_per_step": untraced * 1e3, "host_ms_per_step": host * 1e3,
           "untraced_runs_ms_per_step": [r[0] * 1e3 for r in runs],
           "wall_ms_per_step": wall * 1e3, "device_events": len(evs), "tracks": tracks[:20],
           "host_events": host_rows}
    if not evs:
        rec["note"] = f"no GPU device events in the trace ({jax.default_backend()} backend)"
        return rec
    rec.update({"busy_ms_per_step": busy / 1e3, "span_ms_per_step": span / 1e3,
                "copies_ms_per_step": copies_us(rows) / 1e3,
                "launches_per_step": sum(c for _, c, _ in rows),
                "kernels": [{"name": n[:200], "us_per_step": u, "calls_per_step": c}
                            for u, c, n in rows[:60]]})
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="llama-3-8b,qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4, help="layers per model (0: full depth)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--backend", default="auto", choices=("auto", "mosaic", "pallas", "xla"),
                    help="kernels of the NVFP4 linears and MoE (models.decode_step's backend; "
                         "pallas: the SM12x path)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--hlo", action="store_true",
                    help="also write each step's optimized HLO: OUT/e2e-hlo-MODEL-LAYOUT.txt")
    args = ap.parse_args(argv)
    shapes = e2e_bench.TINY if args.tiny else e2e_bench.SHAPES
    hybrid = e2e_bench.NEMOTRON_H_TINY if args.tiny else e2e_bench.NEMOTRON_H
    shapes = {**shapes, **hybrid}
    names = [m for m in args.models.split(",") if m]
    layouts = [x for x in args.layouts.split(",") if x]
    if not names or set(names) - set(shapes):
        ap.error(f"--models: expected some of {list(shapes)}, got {args.models!r}")
    if not layouts or set(layouts) - set(LAYOUTS):
        ap.error(f"--layouts: expected some of {list(LAYOUTS)}, got {args.layouts!r}")
    if args.layers < 0 or args.steps < 1 or args.context < 1:
        ap.error("--layers: expected >= 0; --steps and --context: expected >= 1")
    os.makedirs(args.out, exist_ok=True)
    doc = {**run_metadata(), "backend": jax.default_backend(),
           "settings": {"layers": args.layers, "steps": args.steps, "context": args.context,
                        "batch": 1, "backend": args.backend, "tiny": args.tiny}, "records": []}
    path = os.path.join(args.out, "e2e-profile.json")
    for name in names:
        if name in hybrid:
            shape = dict(shapes[name])
            if args.layers:
                shape["layer_types"] = shape["layer_types"][:args.layers]
            model = e2e_bench.build_nemotron_h(models.NemotronHConfig(**shape))
        else:
            shape = {**shapes[name], **({"num_layers": args.layers} if args.layers else {})}
            model = e2e_bench.build_model(e2e_bench.config_of(shape), "nvfp4")
        depth = model.config.num_layers
        for layout in layouts:
            if layout == "unrolled":
                m = model.unstacked()
            else:
                m = model.stacked() if name in hybrid else model
            rec = {"model": name, "layout": layout, "layers": depth,
                   **({"segments": list(m.segments)} if getattr(m, "segments", None) else {}),
                   **profile_decode(m, args.context, args.steps, args.backend,
                                     os.path.join(args.out, f"e2e-hlo-{name}-{layout}.txt")
                                     if args.hlo else None)}
            doc["records"].append(rec)
            print(f"{name} {layout} ({depth} layers): untraced "
                  f"{rec['untraced_wall_ms_per_step']:.3f} ms wall ({rec['host_ms_per_step']:.3f} "
                  f"until the call returns); traced {rec['wall_ms_per_step']:.3f} ms wall"
                  + (f", {rec['busy_ms_per_step']:.3f} busy ({rec['copies_ms_per_step']:.3f} in "
                     f"copies), {rec['span_ms_per_step']:.3f} span, "
                     f"{rec['launches_per_step']:.0f} launches per step" if "kernels" in rec
                     else f" ({rec['note']})"), flush=True)
            for k in rec.get("kernels", [])[:12]:
                print(f"    {k['us_per_step']:9.1f} us x{k['calls_per_step']:5.1f}  "
                      f"{k['name'][:100]}", flush=True)
            for h in rec.get("host_events", [])[:8]:
                print(f"    host {h['ms_per_step']:8.3f} ms x{h['calls_per_step']:6.1f}  "
                      f"{h['name'][:90]}", flush=True)
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
            del m
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
