"""Run the Mosaic GPU GEMM a few times on one shape, for a profiler (Nsight Compute) to attach.

Usage: ncu -k regex:nvfp4 --launch-count 4 python bench/mosaic_ncu.py [--sm12x] [NxKxM ...]
(each shape runs twice; default 28672x8192x16 28672x8192x64; ``--sm12x``: the tiles and the
``mma.sync`` form SM 12.x runs, ``mosaic.config_for(M, N, K, 120)``, here on sm_90)
(the kernel is named after its body, ``nvfp4_w4a16_mosaic``; an unfiltered ncu spends its
launch count on XLA's autotuning kernels)
Prints nothing but the timing of the eager calls; the profiler reports registers per thread,
occupancy, DRAM throughput and warp stall reasons of the kernel.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.gemm.mosaic import auto_config, config_for, default_config, matmul_mosaic


def run(n: int, k: int, m: int, sm12x: bool = False) -> None:
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(0x30, 0x40, (n, k // 16), dtype=np.uint8))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    cfg = config_for(m, n, k, 120) if sm12x else auto_config(m, n, k) or default_config(m, n, k)
    f = jax.jit(lambda x, c, s: matmul_mosaic(x, c, s, 1.0, config=cfg))
    for _ in range(2):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, codes, scales))
        print(f"{n}x{k} M={m} {cfg}: {1e6 * (time.perf_counter() - t0):.1f} us (host)", flush=True)


def main():
    args = sys.argv[1:]
    sm12x = "--sm12x" in args
    specs = [a for a in args if a != "--sm12x"]
    for spec in specs or ["28672x8192x16", "28672x8192x64"]:
        run(*(int(v) for v in spec.split("x")), sm12x=sm12x)


if __name__ == "__main__":
    main()
