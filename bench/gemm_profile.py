"""Where does one ``nvfp4_jax.matmul`` call's time go? Device kernels from a profiler trace.

Usage: python3 bench/gemm_profile.py --out DIR [--cases 28672x8192x1,28672x8192x16]
Runs the public W4A16 ``matmul`` (backend "auto") over C distinct weight copies in one jitted
program (as gemm_bench times it), plus the bf16 ``jnp.dot`` on the same number of copies, under
``jax.profiler.trace``, and prints per-call microseconds per device kernel: the GEMM kernel
against its glue (x permutation; split-K sum, alpha and cast) and the per-launch
``MemcpyD2D`` of the Mosaic custom call. Writes DIR/gemm-profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gemm_bench import impl_bf16_dot, impl_ours_w4a16, make_weights, make_x, n_copies, nvfp4_bytes
from moe_profile import kernel_table, traced_events
from run_meta import run_metadata

import nvfp4_jax


def profile(fn, x, ws, reps: int) -> dict:
    @jax.jit
    def prog(x, ws):
        outs = []
        for w in ws:  # unrolled: each copy one call, chained through a zero-valued dependency
            out = fn(x, w)
            outs.append(out)
            x = x + (out.reshape(-1)[0].astype(jnp.float32) * 0.0).astype(x.dtype)
        return x, outs

    evs, _tracks = traced_events(lambda x: prog(x, ws)[0], x, reps)
    if not evs:
        raise RuntimeError("no GPU stream events in the trace (this tool profiles a GPU)")
    rows, busy, span = kernel_table(evs, reps * len(ws))
    return {"busy_us_per_call": busy, "span_us_per_call": span,
            "kernels": [{"name": n[:160], "us_per_call": u, "calls_per_call": c} for u, c, n in rows[:20]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--cases", default="28672x8192x1,28672x8192x16,28672x8192x64,4096x14336x16")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = []
    for case in args.cases.split(","):
        n, k, m = (int(v) for v in case.split("x"))
        copies = n_copies(nvfp4_bytes(n, k))
        ws = make_weights(n, k, copies)
        x = make_x(m, k)
        for impl, fn, wl in (
            ("nvfp4_w4a16", impl_ours_w4a16(backend="auto"), ws),
            ("bf16_dot", impl_bf16_dot, [nvfp4_jax.dequantize(w, jnp.bfloat16) for w in ws[:copies // 2 or 1]]),
        ):
            try:
                r = profile(fn, x, wl, args.reps)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{case} {impl}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                res.append({"case": case, "impl": impl, "error": str(exc)[:300]})
                continue
            r.update(case=case, impl=impl, N=n, K=k, M=m, copies=len(wl))
            res.append(r)
            print(f"\n{case} {impl}: {r['busy_us_per_call']:.1f} us busy / {r['span_us_per_call']:.1f} us span per call",
                  flush=True)
            for kr in r["kernels"][:8]:
                print(f"  {kr['us_per_call']:8.2f} us  x{kr['calls_per_call']:4.2f}  {kr['name'][:100]}", flush=True)
        with open(os.path.join(args.out, "gemm-profile.json"), "w") as f:
            json.dump({**run_metadata(), "what": f"gemm profile: {args.cases}", "records": res}, f, indent=1)


if __name__ == "__main__":
    main()
