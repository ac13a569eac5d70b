"""Tile configurations of the NVFP4 GEMM, per shape bucket: data, autotuned on one H200.

Key: (M bucket, N, K). M is rounded up to the next bucket (16, 64, 256, 1024, 4096; M <= 16
share one: the MMA pads tokens to 16 anyway). Lookup falls back to the nearest tuned (N, K) by
weight size in the same bucket, then to the nearest tuned bucket, then to ``heuristic``.
Each entry's ``measured`` field holds the numbers that justify it (in-graph medians on the
H200, against bf16 ``jnp.dot`` and the other configs swept).
"""

from __future__ import annotations

from .pallas_triton import Config

M_BUCKETS = (16, 64, 256, 1024, 4096)

# Shapes not listed use the nearest (N, K) of the same bucket.
_SMALL_M = {"block_m": 16, "num_warps": 4, "num_stages": 4, "load2d": True}
TUNED: dict[tuple[int, int, int], Config] = {
    (16, 28672, 8192): Config(
        block_n=128, block_k=256, split_k=1, **_SMALL_M,
        measured="104.5 us vs bf16 122-128, 16 other configs 105-266 (h200, 2026-11-29)"),
    # split-K 8 fills the 132 SMs
    (16, 4096, 4096): Config(
        block_n=64, block_k=128, split_k=8, **_SMALL_M,
        measured="7.9 us vs bf16 13.5-16 (h200, 2026-11-29)"),
    (64, 28672, 8192): Config(
        block_m=64, block_n=128, block_k=256, split_k=1, num_warps=8, num_stages=3, load2d=True,
        measured="145 us vs bf16 123, 7 other configs 145-408 (h200, 2026-11-29)"),
    # by analogy with the M <= 16 sweep on 4096 x 4096 (4096/128 tiles leave SMs idle
    # without split-K)
    (64, 4096, 4096): Config(
        block_m=64, block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4, load2d=True,
        measured="unmeasured"),
    (256, 28672, 8192): Config(
        block_m=128, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, load2d=True,
        measured="297-325 us vs bf16 205, dequant_dot 398 (h200, 2026-11-29)"),
    (1024, 28672, 8192): Config(
        algo="dequant_dot",
        measured="M=1024: 833 us vs fused 1381; M=4096: 2.88 ms vs bf16 2.93, fused 5.5 "
                 "(h200, 2026-11-29)"),
}


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def heuristic(m: int, n: int, k: int) -> Config:
    """Untuned fallback: swap-AB small tiles + split-K for small M, big tiles for large M."""
    if m <= 16:
        tiles = -(-n // 64)
        split = 1
        while tiles * split < 264 and split < 8 and k // (256 * split * 2) >= 2:
            split *= 2
        return Config(block_m=16, block_n=64, block_k=256, split_k=split, num_warps=4, num_stages=4)
    if m <= 64:
        return Config(block_m=64, block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=4)
    if m <= 256:
        return Config(block_m=64, block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3)
    # large M: dequantize once, then cuBLAS (as fast as bf16 at M = 4096, TUNED's last entry)
    return Config(
        block_m=128,
        block_n=128,
        block_k=64,
        split_k=1,
        num_warps=8,
        num_stages=3,
        algo="dequant_dot",
    )


def get_config(m: int, n: int, k: int) -> Config:
    """The tuned Config for this shape, else the nearest tuned (N, K) in the same M bucket."""
    b = m_bucket(m)
    if (b, n, k) in TUNED:
        return TUNED[(b, n, k)]
    if not TUNED:
        return heuristic(m, n, k)
    i = M_BUCKETS.index(b)
    nearest_b = min({bb for (bb, _, _) in TUNED}, key=lambda bb: abs(M_BUCKETS.index(bb) - i))
    same_m = [(abs(nn * kk - n * k), (bb, nn, kk)) for (bb, nn, kk) in TUNED if bb == nearest_b]
    return TUNED[min(same_m)[1]]
