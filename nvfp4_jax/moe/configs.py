"""Tile configurations of the MoE kernels (data, not code): one per regime of routed rows."""

from __future__ import annotations

import dataclasses

from ..device import is_sm90
from ..gemm.decode import check_tile_config
from ..gemm.fp4mma import MMAS, default_mma


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of one grouped-GEMM launch (powers of two).

    block_m: routed rows per block (one expert per block; MMA N slot, swap-AB, >= 16).
    block_n: output features per program (MMA M slot). block_k: K elements per loop step.
    decode: E2M1 decode flavour (``gemm/decode.py``): "asm" on NVIDIA GPUs, "bits" anywhere.
    load2d: load the codes as a 2-D tile instead of ``[BN, BK/16, 8]``.
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "asm"
    load2d: bool = True  # codes as one [BN, BK/2] tile, reshaped in registers: wider loads

    def __post_init__(self) -> None:
        check_tile_config(self, ("block_m", "block_n", "block_k", "num_warps"))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Both launches of one MoE layer; ``fc1.block_m`` and ``fc2.block_m`` must be equal.

    mma: the tensor-core instruction of both grouped GEMMs (``gemm.fp4mma.MMAS``, the words of
    ``matmul(mma=)``): "bf16" (activations as exact bf16 ``q * sf`` values, weights decoded in
    registers), "fp4" (activations as NVFP4 codes + E4M3 scale bytes, both operands into
    ``fp4mma.dot_scaled``: the block-scaled FP4 MMA on SM 12.x, Triton's decomposition
    elsewhere; then block_k >= 64), or None: the device's (``fp4mma.default_mma()``, "fp4" on
    SM 12.x only), as :func:`default_config` sets it."""

    fc1: Config = Config()
    fc2: Config = Config()
    mma: str | None = None

    def __post_init__(self) -> None:
        if self.fc1.block_m != self.fc2.block_m:
            raise ValueError(f"MoEConfig: fc1.block_m ({self.fc1.block_m}) != fc2.block_m ({self.fc2.block_m})")
        if self.mma is not None and self.mma not in MMAS:
            raise ValueError(f"MoEConfig.mma: expected one of {MMAS} or None, got {self.mma!r}")
        if self.mma == "fp4" and min(self.fc1.block_k, self.fc2.block_k) < 64:
            raise ValueError(f"MoEConfig: mma 'fp4' needs block_k >= 64 (the m16n8k64 MMA's K), "
                             f"got fc1 {self.fc1.block_k}, fc2 {self.fc2.block_k}")

    def with_decode(self, decode: str) -> MoEConfig:
        return MoEConfig(dataclasses.replace(self.fc1, decode=decode),
                         dataclasses.replace(self.fc2, decode=decode), self.mma)

    def with_mma(self, mma: str | None) -> MoEConfig:
        """The same tiles on the MMA ``mma`` ("bf16", "fp4" or None: the device's)."""
        return dataclasses.replace(self, mma=mma)

    def resolved_mma(self) -> str:
        """``mma``, or the device's when None."""
        return default_mma() if self.mma is None else self.mma


#: sm_90 decode tiles (BM 16: at most 16 routed rows per expert) of both GEMMs, by whether FC1
#: is gated: the fastest of ``bench/moe_bench.py --candidates`` on the H200 at T = 1, 8, 64
SM90_DECODE = {
    True: Config(16, 64, 256, 4, 3, decode="asm2m"),  # wgmma, 3 stages
    False: Config(16, 32, 256, 2, 4, decode="asmm"),  # twice the programs; mma.sync
}
SM90_DECODE_PROVENANCE = (
    "bench/results/moe-candidates-h200.json (bench/moe_bench.py --candidates): qwen3_30b "
    "(gated) T = 1 / 8 / 64: 43.2 / 110.6 / 228.5 us, 1.66x the Mosaic MoE (BN 64 with 4 "
    "stages: 43.9 / 123.4 / 250.4); nemotron (relu2) 67.2 / 279.0 / 800.1 us, 1.51 / 1.61 / "
    "1.53x (BN 64, 4 warps: 75.5 / 328.6 / 951.8)")


def default_config(num_routes: int, num_experts: int, *, inter: int = 2048, hidden: int = 2048,
                   gated: bool = False, mma: str | None = None) -> MoEConfig:
    """Tiles from the average rows per expert and the launch size (static shapes only); ``mma``
    None: ``gemm.fp4mma.default_mma()`` ("fp4" on SM 12.x GPUs only, "bf16" elsewhere).

    The values follow the dense NVFP4 GEMM's sweep (``gemm.configs.TUNED``: M <= 16 best at
    BN 128, BK 256, 4 warps, 4 stages; M = 256 best at BM 128, BN 64, BK 128, 4 warps, 3
    stages). BN is 128 only for BM <= 32 and when that still gives two programs per SM (132
    SMs); gated FC1 (two accumulators) keeps BN 64 and BM <= 64 to stay within registers.
    Decode ``asmm`` (4-byte packs for mma.sync: SM 8.x / 12.x) off sm_90. On sm_90 the decode
    tiles (BM 16) are measured ones, ``SM90_DECODE`` by whether FC1 is gated; the SM12x rule
    stays unmeasured (no SM12x GPU).
    """
    blocks = max(1, min(num_experts, num_routes))
    rows_per_expert = num_routes / blocks

    sm90 = is_sm90()
    mma = default_mma() if mma is None else mma
    if sm90 and rows_per_expert <= 16:
        tile = SM90_DECODE[gated]
        return MoEConfig(tile, tile, mma)

    def bn_for(n: int, bm: int) -> int:
        return 128 if blocks * -(-n // 128) >= 264 and bm <= 32 else 64

    if rows_per_expert <= 16:  # decode: weight streaming
        bm, bk, warps, stages = 16, 256, 4, 4
    elif rows_per_expert <= 64:
        bm, bk, warps, stages = 32, 128, 4, 3
    else:  # prefill: amortize the decode over more rows
        bm, bk, warps, stages = (64 if gated else 128), 128, 4, 3
    # the bf16 decode by operand layout (gemm/decode.py): 2-byte packs for sm_90's wgmma,
    # 4-byte packs for mma.sync (SM 8.x / 12.x; the FP4 MMA decodes nothing)
    dec = "asm2m" if sm90 else "asmm"
    fc1 = Config(bm, 64 if gated else bn_for(inter, bm), bk, warps, stages, decode=dec)
    fc2 = Config(bm, bn_for(hidden, bm), bk, warps, stages, decode=dec)
    return MoEConfig(fc1, fc2, mma)
