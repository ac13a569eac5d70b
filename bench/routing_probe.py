"""Why is the routing kernel's "routes" method slow at nemotron T = 8? (H200)

Session 12's probe: routing="kernel" with the routes method cost ~39 us more than the XLA
routing at nemotron T = 8 (176 routes over 512 experts) while it saved ~5 us at T = 1 (22
routes). This times the routing alone, in-graph: ``block_routing`` (XLA) against
``routing_kernel`` (each method and warp count given: "routes", and "tokens", written after
that measurement) and the fused routing + FC1 operand launch (routes method), at T = 1, 2,
4, 8 and 16 tokens of 22 routes each. Until session 14 the timing loop cost a host round
trip (~15-25 us on the H200) per call here (one "weight copy"), so only differences between
rows of one T meant anything; since then ``gemm_bench.make_timer`` shares one round trip
among 64 calls and the rows are the calls' own times.

Usage: python bench/routing_probe.py --out DIR [--rounds 3] [--tokens 1,2,4,8,16]
       [--methods routes,tokens] [--warps 2,4,8,16] [--no-fused]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gemm_bench as gb
import jax.numpy as jnp
import numpy as np
from run_meta import dump_records, time_rounds

from nvfp4_jax import triton_ops
from nvfp4_jax.moe import routing_kernel as ep
from nvfp4_jax.moe.mosaic import recipe_of
from nvfp4_jax.moe.routing import block_routing

E, K, BM, H = 512, 22, 8, 1024


def flat(r) -> jnp.ndarray:
    """All of a BlockRouting's arrays in one (so nothing is dead code)."""
    return jnp.concatenate([a.reshape(-1) for a in (r.sorted_route, r.block_expert, r.num_blocks,
                                                     r.route_pos)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/routing-probe")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--warps", default="2,4,8,16")
    p.add_argument("--methods", default="routes")
    p.add_argument("--no-fused", action="store_true")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    ones = jnp.ones((E,), jnp.float32)
    scales = (ones * 2e-5, ones * 3e-5, ones[:1] * 0.5, ones[:1] * 0.25, "trtllm_cutlass", "scalar")
    timers, rows = [], []
    for t in (int(v) for v in a.tokens.split(",")):
        ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(t)]).astype(np.int32))
        hidden = jnp.asarray(rng.standard_normal((t, H)), jnp.bfloat16)
        plan = [("xla block_routing", None, lambda i, w: flat(block_routing(i, E, BM)))]
        np_ = triton_ops.pow2(t * K)
        for method in a.methods.split(","):
            for nw in (int(v) for v in a.warps.split(",")):
                def rk(i, w, nw=nw, np_=np_, method=method):
                    ep.ROUTING_WARPS[(method, np_)] = nw
                    return flat(ep.routing_kernel(i, E, BM, method=method))
                plan.append((f"{method} kernel {nw}w", nw, rk))

        def fused(i, w, hidden=hidden):
            r, _, xp = ep.routing_operand_kernel(i, hidden, E, BM, scales, recipe=recipe_of("trtllm_cutlass"),
                                                  method="routes")
            return jnp.concatenate([flat(r).astype(jnp.float32), xp[:8].reshape(-1).astype(jnp.float32)])
        if not a.no_fused:
            plan.append(("fused routing+operand", None, fused))
        for name, nw, fn in plan:
            try:
                timers.append(gb.make_timer(fn, ids, [jnp.zeros((1,))], target_s=0.02))
            except Exception as e:  # noqa: BLE001 (a warp count that does not compile: say so)
                print(f"T={t:3d} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"tokens": t, "routes": t * K, "case": name, "warps": nw, "rounds_us": []})
        ep.ROUTING_WARPS.clear()
    time_rounds(timers, rows, a.rounds)
    for r in rows:
        print(f"T={r['tokens']:3d} N={r['routes']:4d} {r['case']:24s} {r['median_us']:7.2f} us  "
              f"rounds {min(r['rounds_us']):.2f}-{max(r['rounds_us']):.2f}", flush=True)
    dump_records(a.out, "routing-probe-h200.json", "routing alone: XLA vs the routes-method kernel", rows)


if __name__ == "__main__":
    main()
