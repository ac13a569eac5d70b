"""The ``mma.sync`` rate of this GPU: bf16 ``mma.sync.m16n8k16`` with fp32 accumulators, from
registers only (no memory traffic in the loop), in the warp layout of the Mosaic GEMM's SM 12.x
form (``MosaicConfig(mma="sync")``: one warpgroup per CTA, each warp 16 rows of a 64-row block,
all 64 tokens; 8 independent accumulator tiles per warp, as at M = 64).

On Hopper ``mma.sync`` is the legacy path beside ``wgmma``; its rate is the ceiling the SM 12.x
form's M = 64 tiles are held against on the proxy (docs/performance.md). Prints one JSON line per
CTA count (1, 2 and ``--ctas-per-sm`` per SM) and writes ``mma-sync-peak-<gpu>.json`` under
``--out``.

    python bench/mma_sync_peak.py --out $OUT [--iters 2000] [--ctas-per-sm 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from run_meta import gpu_tag, run_metadata  # noqa: E402

from nvfp4_jax.gemm.mosaic import mosaic_kernel, pallas_mosaic_gpu, store_tile  # noqa: E402

ROWS, DEPTH, TOKENS = 64, 128, 64  # one warpgroup's operands: A [64, 128], B [128, 64]


def peak(iters: int, ctas: int) -> dict:
    _, plgpu = pallas_mosaic_gpu()

    def mma_sync_peak(seed_gmem, o_gmem):
        i = lax.axis_index("c")
        s = seed_gmem[0]
        a = plgpu.layout_cast(jnp.full((ROWS, DEPTH), s, jnp.bfloat16),
                              plgpu.Layout.MMA_LHS(jnp.bfloat16))
        b = plgpu.layout_cast(jnp.full((DEPTH, TOKENS), s, jnp.bfloat16),
                              plgpu.Layout.MMA_RHS(jnp.bfloat16))
        zero = plgpu.layout_cast(jnp.full((ROWS, TOKENS), 0, jnp.float32),
                                 plgpu.Layout.MMA_ACC(jnp.bfloat16))
        acc = lax.fori_loop(0, iters, lambda _, acc: plgpu.mma(acc, a, b), zero)
        store_tile(acc, o_gmem.at[i])

    out = jax.ShapeDtypeStruct((ctas, TOKENS, ROWS), jnp.float32)
    f = jax.jit(mosaic_kernel(mma_sync_peak, out_type=out, grid=(ctas,), grid_names=("c",)))
    seed = jnp.full((1,), 2.0**-10, jnp.bfloat16)
    o = jax.block_until_ready(f(seed))
    expect = float(iters * DEPTH * 2.0**-20)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(seed))
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    warps = ctas * 4
    hmma = warps * iters * (DEPTH // 16) * (TOKENS // 8)  # m16n8k16 per warp per iteration
    flops = hmma * 16 * 8 * 16 * 2
    got = float(o[0, 0, 0])
    return {"iters": iters, "ctas": ctas, "median_s": t, "hmma": hmma, "tflops": flops / t / 1e12,
            "result": got, "expected": expect, "result_ok": abs(got - expect) <= 1e-3 * expect}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--ctas-per-sm", type=int, default=4)
    args = ap.parse_args()
    sms = jax.devices()[0].core_count
    recs = [peak(args.iters, c * sms) for c in sorted({1, 2, args.ctas_per_sm})]
    for r in recs:
        r["sms"] = sms
        r["hmma_per_smsp_cycle_at_1.98GHz"] = r["hmma"] / (sms * 4) / (r["median_s"] * 1.98e9)
        print(json.dumps(r), flush=True)
    meta = run_metadata()
    with open(os.path.join(args.out, f"mma-sync-peak-{gpu_tag(jax.devices()[0].device_kind)}.json"),
              "w") as fh:
        json.dump({**meta, "records": recs}, fh, indent=1)


if __name__ == "__main__":
    main()
