"""The routing's sort at prefill sizes, narrow keys against int32 keys (H200).

``routing.block_routing(method="sort")`` sorts the expert ids as ``routing.sort_keys`` gives
them: uint8 up to 256 experts, uint16 up to 65536 (since session 15; int32 before). XLA:GPU
hands the sort to CUB's radix sort, one pass per key byte, and (its H100 heuristic) takes
every single-row 8-bit sort but 32-bit ones only above ~22000 elements. Session 14's profile
had 4 passes, ~27 us of qwen3's T = 4096 layer. This times, in one process and in-graph
(``gemm_bench.make_timer``): the argsort alone and the whole ``block_routing``, each with the
narrow keys and with int32 keys (``sort_keys`` replaced by the identity while tracing), at
qwen3 (128 experts, top-8) and nemotron (512, top-22) for T = 512 and 4096.

Usage: python bench/sort_probe.py --out DIR [--rounds 3] [--tokens 512,4096]
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
from run_meta import dump_records, patched, time_rounds

from nvfp4_jax.moe import routing

SHAPES = {"qwen3_30b": (128, 8, 64), "nemotron": (512, 22, 64)}  # experts, top-k, block_m


def int32_keys(on: bool):
    """While tracing: ``routing.sort_keys`` as the identity (the int32 keys before session 15)."""
    return patched([(routing, "sort_keys", lambda flat, num_experts: flat)] if on else [])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/sort-probe")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", default="512,4096")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    timers, rows = [], []
    for shape, (e, k, bm) in SHAPES.items():
        for t in (int(v) for v in a.tokens.split(",")):
            ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32))
            for wide in (False, True):
                keys = "int32" if wide else str(routing.sort_keys(ids[:1, :1], e).dtype)

                def argsort(i, w, wide=wide, e=e):
                    flat = i.reshape(-1)
                    return jnp.argsort(flat if wide else routing.sort_keys(flat, e), stable=True)

                def whole(i, w, e=e, bm=bm):
                    r = routing.block_routing(i, e, bm, method="sort")
                    return jnp.concatenate([r.sorted_route, r.block_expert, r.num_blocks, r.route_pos])

                for what, fn in (("argsort", argsort), ("block_routing", whole)):
                    with int32_keys(wide):
                        timers.append(gb.make_timer(fn, ids, [jnp.zeros((1,))], target_s=0.02))
                    rows.append({"shape": shape, "tokens": t, "routes": t * k, "experts": e,
                                 "what": what, "keys": keys, "rounds_us": []})
    time_rounds(timers, rows, a.rounds)
    for r in rows:
        print(f"{r['shape']:10s} T={r['tokens']:5d} N={r['routes']:6d} {r['what']:14s} {r['keys']:6s} "
              f"{r['median_us']:8.2f} us  rounds {min(r['rounds_us']):.2f}-{max(r['rounds_us']):.2f}",
              flush=True)
    dump_records(a.out, "sort-probe-h200.json",
                 "the routing's sort: narrow (routing.sort_keys) vs int32 keys", rows)


if __name__ == "__main__":
    main()
