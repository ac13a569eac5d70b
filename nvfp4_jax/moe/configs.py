"""Tile configurations of the MoE kernels (data, not code): one per regime of routed rows."""

from __future__ import annotations

import dataclasses

from ..gemm.decode import DECODE_MODES


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
    load2d: bool = True  # codes as one [BN, BK/2] tile, reshaped in registers (gemm round 1)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Config.{name}: expected a power of two, got {v}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 32:
            raise ValueError(f"Config: need block_m, block_n >= 16 and block_k >= 32, got {self}")
        if self.decode not in DECODE_MODES:
            raise ValueError(f"Config.decode: expected one of {DECODE_MODES}, got {self.decode!r}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Both launches of one MoE layer; ``fc1.block_m`` and ``fc2.block_m`` must be equal."""

    fc1: Config = Config()
    fc2: Config = Config()

    def __post_init__(self) -> None:
        if self.fc1.block_m != self.fc2.block_m:
            raise ValueError(f"MoEConfig: fc1.block_m ({self.fc1.block_m}) != fc2.block_m ({self.fc2.block_m})")

    def with_decode(self, decode: str) -> MoEConfig:
        return MoEConfig(dataclasses.replace(self.fc1, decode=decode), dataclasses.replace(self.fc2, decode=decode))


def default_config(num_routes: int, num_experts: int) -> MoEConfig:
    """Pick tiles from the average rows per expert (bench/NOTES-moe.md records the sweep)."""
    rows_per_expert = num_routes / max(1, min(num_experts, num_routes))
    if rows_per_expert <= 16:  # decode: weight streaming, small tiles, many programs
        return MoEConfig(Config(16, 64, 256, 4, 3), Config(16, 64, 256, 4, 3))
    if rows_per_expert <= 64:
        return MoEConfig(Config(32, 64, 128, 4, 3), Config(32, 64, 128, 4, 3))
    return MoEConfig(Config(64, 128, 64, 8, 3), Config(64, 128, 64, 8, 3))
