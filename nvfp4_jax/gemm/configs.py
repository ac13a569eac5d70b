"""Tile configurations of the NVFP4 GEMM, per GPU family and shape bucket: data.

Two families, two tables: ``"sm90"`` (``TUNED``: autotuned on one H200) and ``"sm12x"``
(``TUNED_SM12X``: RTX 50xx / RTX PRO Blackwell, DGX Spark). The families differ in what a
config costs: sm_120 has 100 KB of shared memory per SM (99 KB per CTA) against the H200's
228 KB, 1536 resident threads per SM against 2048, and Triton lays the decoded operand out for
``mma.sync`` (4 consecutive bytes per thread) instead of ``wgmma`` (2), so the decode grouping
differs too (decode.py: ``asmm`` vs ``asm2m``). An H200-tuned tile can fail to launch on SM12x
(shared memory) or leave one warp per scheduler there.

Key: (M bucket, N, K). M is rounded up to the next bucket (16, 64, 256, 1024, 4096; M <= 16
share one: the MMA pads tokens to 16 anyway). Lookup falls back to the nearest tuned (N, K) by
weight size in the same bucket, then to the nearest tuned bucket, then to ``heuristic``.
Each entry's ``measured`` field holds the numbers that justify it (in-graph medians on the
H200, against bf16 ``jnp.dot`` and the other configs swept), or for the SM12x table the
compile-time figures it was chosen by (no SM12x GPU has timed it).
"""

from __future__ import annotations

from ..device import is_sm12x
from .pallas_triton import Config

M_BUCKETS = (16, 64, 256, 1024, 4096)

# Shapes not listed use the nearest (N, K) of the same bucket.
_SMALL_M = {"block_m": 16, "num_warps": 4, "num_stages": 4, "load2d": True}
TUNED: dict[tuple[int, int, int], Config] = {
    (16, 28672, 8192): Config(
        block_n=128, block_k=256, split_k=1, **_SMALL_M, decode="asm2m",
        measured="M=1: 73.1 us vs bf16 113.5, decode asm2 (shifts) 84.4, bn 64 st 3 83.6, 4 other "
                 "tiles 121-137 (h200, 2026-12-02, gemm-candidates-h200.json)"),
    (16, 14336, 4096): Config(
        block_n=64, block_k=256, split_k=2, block_m=16, num_warps=4, num_stages=3, load2d=True,
        decode="asm2m",
        measured="M=1: 25.1 us vs bf16 43.0, decode asm2 (shifts) 25.4, 4 other tiles 27-39 "
                 "(h200, 2026-12-02, gemm-candidates-h200.json)"),
    # split-K 8 fills the 132 SMs
    (16, 4096, 4096): Config(
        block_n=64, block_k=128, split_k=8, **_SMALL_M, decode="asm2m",
        measured="7.9 us vs bf16 13.5-16 (h200, 2026-11-29, decode asm); decode asm2m by its "
                 "wins at the two swept shapes"),
    # the 4096x4096 tiles (same weight count as 14336x4096, whose tiles it would pick as the
    # nearest entry otherwise)
    (16, 4096, 14336): Config(
        block_m=16, block_n=64, block_k=512, split_k=8, num_warps=4, num_stages=3, load2d=True,
        decode="asm2m",
        measured="M=1: 24.2 us vs bf16 34.2, BN 64 BK 128 st 4 (the 4096x4096 tiles) 31.3, "
                 "BN 128 BK 256 8 warps 25.5, 3 other tiles 27-54 (h200, 2026-12-02, "
                 "gemm-candidates-h200.json)"),
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


# SM12x: every entry fits 99 KB of shared memory with >= 2 resident CTAs per SM where the
# sm_120a compile allows it (pip Triton 3.6, bench/sm12x_compile.py --variants: registers,
# shared memory, main-loop instructions; bench/results/gemm-decode-variants.md). Predicted,
# not measured: no SM12x GPU has run them.
_SM12X_SMALL_M = {"block_m": 16, "num_warps": 4, "num_stages": 3, "load2d": True,
                  "decode": "asmm"}
TUNED_SM12X: dict[tuple[int, int, int], Config] = {
    # split-K 2: 448 CTAs keep the RTX 5090's 170 SMs x 3 resident CTAs busy
    (16, 28672, 8192): Config(
        block_n=128, block_k=128, split_k=2, **_SM12X_SMALL_M,
        measured="predicted: sm_120a 566 instr/step with decode asmm (597 asm, 699 asm2m), "
                 "127 regs, 26 KB, 3 CTAs/SM (the sm90 entry: 78 KB, 1 CTA/SM)"),
    (16, 4096, 4096): Config(
        block_n=64, block_k=128, split_k=8, **_SM12X_SMALL_M,
        measured="predicted: sm_120a 320 instr/step with decode asmm (334 asm), 74 regs, "
                 "17 KB, 5 CTAs/SM"),
    (64, 28672, 8192): Config(
        block_m=64, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3, load2d=True,
        decode="asmm",
        measured="predicted: sm_120a 586 instr/step with decode asmm (594 asm), 168 regs, 41 KB, "
                 "2 CTAs/SM (the sm90 entry needs 100 KB: over the 99 KB per CTA, it cannot "
                 "launch)"),
    (64, 4096, 4096): Config(
        block_m=64, block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=3, load2d=True,
        decode="asmm",
        measured="predicted: sm_120a 565 instr/step with decode asmm (582 asm), 162 regs, 41 KB, "
                 "2 CTAs/SM (the sm90 entry: 62 KB, 1 CTA/SM)"),
    (256, 28672, 8192): TUNED[(256, 28672, 8192)],
    (1024, 28672, 8192): TUNED[(1024, 28672, 8192)],
}

#: the tables by GPU family (``device_family()``)
TUNED_BY_FAMILY = {"sm90": TUNED, "sm12x": TUNED_SM12X}


def device_family() -> str:
    """The config family of the default device: ``"sm12x"`` on SM 12.x, else ``"sm90"`` (the
    H200-tuned table also serves CPU interpret mode and other GPUs)."""
    return "sm12x" if is_sm12x() else "sm90"


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


def get_config(m: int, n: int, k: int, family: str | None = None) -> Config:
    """The tuned Config for this shape, else the nearest tuned (N, K) in the same M bucket.

    family: ``"sm90"`` or ``"sm12x"`` (``TUNED_BY_FAMILY``); None: the default device's
    (``device_family()``)."""
    fam = device_family() if family is None else family
    if fam not in TUNED_BY_FAMILY:
        raise ValueError(f"family: expected one of {sorted(TUNED_BY_FAMILY)}, got {fam!r}")
    table = TUNED_BY_FAMILY[fam]
    b = m_bucket(m)
    if (b, n, k) in table:
        return table[(b, n, k)]
    if not table:
        return heuristic(m, n, k)
    i = M_BUCKETS.index(b)
    nearest_b = min({bb for (bb, _, _) in table}, key=lambda bb: abs(M_BUCKETS.index(bb) - i))
    same_m = [(abs(nn * kk - n * k), (bb, nn, kk)) for (bb, nn, kk) in table if bb == nearest_b]
    return table[min(same_m)[1]]
