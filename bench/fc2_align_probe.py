"""Is nemotron's FC2 slow per byte because its weight rows are not 128-byte aligned? (H200)

Nemotron's FC2 (N = 1024, K = 2688: 1344-byte code rows, 64 bytes off a 128-byte line every
other row) ran 88 us against FC1's 72 us for the same bytes at T = 8 (session 11 profile).
This times the grouped Mosaic kernel alone on nemotron-T=8-like blocks (149 blocks of 8 rows,
one distinct expert each, of 512) at K = 2560, 2816 and 3072 (aligned rows; 10, 11 and 12 K steps)
and 2688 (the real one), and FC1's shape (N = 2688, K = 1024) for reference. Reports us and
weight TB/s (codes + scales of the touched experts). The data are random codes and block
scales; only the time is of interest.

Usage: python bench/fc2_align_probe.py --out DIR [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gemm_bench as gb
import jax.numpy as jnp
import numpy as np
from run_meta import run_metadata

from nvfp4_jax.gemm.mosaic import MosaicConfig
from nvfp4_jax.layouts import swizzle
from nvfp4_jax.moe.mosaic import grouped_matmul

E, NB, BM = 512, 149, 8


def case(n: int, k: int, split: int, rng, reference: bool = False):
    codes = jnp.asarray(rng.integers(0, 256, (E, n, k // 2), dtype=np.uint8))
    lin = jnp.asarray(rng.integers(0x30, 0x40, (E, n, k // 16), dtype=np.uint8))
    scales = swizzle(lin, "swizzled_128x4")
    x = jnp.asarray(rng.standard_normal((NB * BM, k)), jnp.bfloat16)
    be = jnp.asarray(rng.choice(E, NB, replace=False).astype(np.int32))
    nb = jnp.asarray([NB], jnp.int32)
    cfg = MosaicConfig(block_n=128, split_k=split, num_stages=2)

    def fn(x, w):
        return grouped_matmul(x, w[0], w[1], be, nb, block_m=BM, config=cfg, reference=reference,
                              scale_layout="swizzled_128x4", name="probe")

    touched = NB * n * (k // 2 + k // 16)
    return fn, x, (codes, scales), touched


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/fc2-align")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    plan = [("fc2 K=2560", 1024, 2560, 2), ("fc2 K=2688", 1024, 2688, 2),
            ("fc2 K=2688 split1", 1024, 2688, 1), ("fc2 K=2816 split1", 1024, 2816, 1),
            ("fc2 K=3072", 1024, 3072, 2), ("fc1 N=2688 K=1024", 2688, 1024, 1)]
    timers, rows = [], []
    for name, n, k, split in plan:
        fn, x, w, touched = case(n, k, split, rng)
        timers.append(gb.make_timer(fn, x, [w], target_s=0.05))
        rows.append({"case": name, "N": n, "K": k, "split_k": split, "touched_bytes": touched,
                     "rounds_us": []})
        del w
    for _ in range(a.rounds):
        for t, r in zip(timers, rows):
            r["rounds_us"].append(t() * 1e6)
    for r in rows:
        r["median_us"] = float(np.median(r["rounds_us"]))
        r["tbps"] = r["touched_bytes"] / r["median_us"] / 1e6
        print(f"{r['case']:22s} {r['median_us']:7.1f} us  {r['tbps']:.2f} TB/s  "
              f"rounds {min(r['rounds_us']):.1f}-{max(r['rounds_us']):.1f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fc2-align-probe-h200.json"), "w") as f:
        json.dump({**run_metadata(), "what": "grouped kernel alone, row alignment", "records": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
