"""Tile configurations of the NVFP4 GEMM, per shape bucket: data, autotuned on one H200.

Key: (M bucket, N, K). M is rounded up to the next bucket (16, 64, 256, 1024, 4096; M <= 16
share one: the MMA pads tokens to 16 anyway). Lookup falls back to the nearest tuned (N, K) by
weight size in the same bucket, then to the nearest tuned bucket, then to ``heuristic``.
Numbers that justify each entry are in bench/results/gemm-h200.json and bench/NOTES-gemm.md.
"""

from __future__ import annotations

from .pallas_triton import Config

M_BUCKETS = (16, 64, 256, 1024, 4096)

# From the H200 sweeps (bench/results/gemm-tune-h200.json, round 2, 2026-11-29; in-graph
# medians in the comments). Shapes not listed use the nearest (N, K) of the same bucket.
_SMALL_M = {"block_m": 16, "num_warps": 4, "num_stages": 4, "load2d": True}
TUNED: dict[tuple[int, int, int], Config] = {
    # M <= 16: 104.5 us (bf16 jnp.dot 122-128 us); 16 other configs 105-266 us
    (16, 28672, 8192): Config(block_n=128, block_k=256, split_k=1, **_SMALL_M),
    # M <= 16: 7.9 us in the sweep (bf16 13.5-16 us); split-K 8 fills the 132 SMs
    (16, 4096, 4096): Config(block_n=64, block_k=128, split_k=8, **_SMALL_M),
    # M = 64: 145 us (bf16 123 us); 7 configs 145-408 us
    (64, 28672, 8192): Config(
        block_m=64, block_n=128, block_k=256, split_k=1, num_warps=8, num_stages=3, load2d=True
    ),
    # M = 64, small weights: NOT measured (the round-2 budget ran out); by analogy with the
    # M <= 16 sweep on 4096 x 4096 (split-K needed: 4096/128 tiles leave SMs idle).
    (64, 4096, 4096): Config(
        block_m=64, block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4, load2d=True
    ),
    # M = 256: 297-325 us (bf16 205 us); dequant_dot 398 us
    (256, 28672, 8192): Config(
        block_m=128, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, load2d=True
    ),
    # M = 1024: dequantize once + cuBLAS 833 us vs fused 1381 us; at M = 4096 (round 1)
    # 2.88 ms vs bf16 2.93 ms vs fused 5.5 ms
    (1024, 28672, 8192): Config(algo="dequant_dot"),
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
    # large M: dequantize once, then cuBLAS (measured 1.0x bf16 at M=4096, NOTES-gemm.md)
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
