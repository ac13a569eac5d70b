"""NVFP4 W4A16 GEMM for small M as a Pallas Mosaic GPU kernel (Hopper: TMA + wgmma; SM 12.x:
TMA + warp-level mma.sync, ``MosaicConfig(mma="sync")``).

``out[M, N] = alpha * x[M, K] @ W[N, K]^T`` with ``W[n, k] = e2m1(code) * e4m3(scale[n, k//16])``,
x bf16, fp32 accumulation: the same numbers as ``pallas_triton.matmul_pallas``.

Kernel (``_kernel``), one screen:

* swap-AB: weights in the wgmma M slot (``block_n`` rows per CTA, in 64-row wgmma blocks), the
  M tokens (padded to ``mt`` in {8, 16, 32, 64}) in the N slot; grid ``(cdiv(N, block_n),
  split_k)``, one warpgroup per CTA, several CTAs per SM;
* ``plgpu.emit_pipeline`` over K (``block_k`` = 256 per step, ``num_stages`` TMA stages): codes
  uint8 ``[block_n, 128]``, scales uint8 ``[block_n, 16]``, x ``[mt, 256]`` bf16 (swizzled);
* decode in registers (``plgpu.inline_mgpu``, PTX): each thread reads 16 code bytes (one 32-bit
  word per wgmma k-chunk) per row it owns, and turns each word (8 nibbles) into four bf16x2
  registers of the wgmma A fragment with ``and, mul.lo (two shifts at once), and`` per register
  (bf16 placement ``sign -> bit 15, e1 e0 m -> bits 8..6``: ``e2m1 * 2^-126``, decode.py) and one
  ``fma.rn.bf16x2`` with the block scale as bf16 ``e4m3 * 2^119``; the product is
  ``e2m1 * e4m3 * 2^-7`` exactly, and 2^7 is folded into alpha;
* the A fragment's K order is a fixed permutation of the weight's K order (``PERM``, within
  every 128 elements), chosen so that each thread's 16 contiguous code bytes fill its fragment
  registers; x is permuted the same way outside the kernel (one small XLA transpose);
* two wgmmas (K = 128 each) per step against the x tile in SMEM (B = x^T);
* output: fp32 partials ``[split_k, mt, N_pad]``, token-major: the accumulator is transposed
  on its way to SMEM (``store_tile``) and written by TMA; XLA sums the splits, multiplies by
  alpha and casts (one small fusion, no transpose).

Supported shapes: M <= 64, K % 256 == 0 (TMA needs 16-byte rows of scales), any N (TMA
zero-fills rows past N; the padded output rows are dropped). Anything else raises ValueError
(``api.py`` then falls back to the Pallas-Triton kernel).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..device import is_sm12x, sm12x

log = logging.getLogger(__name__)

MAX_M = 64
TOKEN_TILES = (8, 16, 32, 64)
BLOCK_K = 256  # smallest K per pipeline step (scales tile = 16 bytes per row: the TMA minimum)
BLOCK_KS = (256, 512)
SMEM_LIMIT = 227 * 1024  # shared memory one CTA may use on sm_90
SM12X_SMEM_LIMIT = 99 * 1024  # ... on SM 12.x (RTX 50xx, DGX Spark)
MMAS = ("wgmma", "sync")  # MosaicConfig.mma
POST_SCALE = 2.0**7  # the decode hands wgmma e2m1 * e4m3 * 2^-7 (see module docstring)

# K permutation within each 128-element group: fragment column p = 32w + 8j + 2c + l holds
# weight element e = 32c + 8w + 4l + j (c = thread's column quad, w = word, j = nibble pair,
# l = lane of the bf16x2 register). PERM[p] = e.
PERM = (
    np.arange(128).reshape(4, 4, 2, 4)  # e laid out as [c, w, l, j]
    .transpose(1, 3, 0, 2)  # -> [w, j, c, l] = p order
    .reshape(128)
)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Launch configuration of the Mosaic GPU kernel.

    block_n: weight rows per CTA (64 or 128: one or two 64-row wgmma blocks, one warpgroup).
    split_k: K ranges run by separate CTAs (fp32 partials summed in XLA); reduced to a divisor
    of the number of K steps. num_stages: TMA pipeline depth. block_k: K elements per pipeline
    step (256 or 512: two or four 128-deep wgmmas per step; K must be a multiple of it).
    overlap: issue the next 128-deep group's decode while the previous wgmma runs
    (``wgmma_wait(1)`` within a step, ``wgmma_wait(0)`` at the step's end, before the pipeline
    releases the stage).
    consumers: 1 (one warpgroup per CTA) or 2..3: a warp-specialized CTA (``accumulate_tiles_ws``)
    with ``consumers`` compute warpgroups of ``block_n`` weight rows each, sharing every x stage,
    and a producer warpgroup that issues the TMA copies. Dense and grouped kernels; K % 256 ==
    0 or swizzled_128x4 scales (no whole-K buffer).
    mma: "wgmma" (Hopper) or "sync": Ampere-style ``mma.sync.m16n8k16`` per warp (each warp
    its 16 rows of every 64-row block), x read from the swizzled stage into the MMA's B
    registers (``_x_fragment_fn``), the accumulator a loop carry; no wgmma, so the same kernel
    source is the one SM 12.x (RTX 50xx, DGX Spark: TMA and ``mma.sync``, no wgmma) can run.
    One warpgroup, no overlap; needs ``plgpu.mma`` (JAX >= 0.11).
    bf16_store: dense kernel, split_k 1, bf16 output: the kernel multiplies its accumulator by
    alpha and stores bf16 (the same fp32 multiply and round to nearest even as the XLA
    epilogue it replaces, one launch and half the output bytes fewer); elsewhere (a split, an
    fp16/fp32 output) fp32 partials and the XLA epilogue, logged. The grouped kernel refuses it
    (``MosaicMoEConfig.bf16_partials`` is its form).
    measured: provenance of a tuning-table entry (shape, time against the alternatives, GPU,
    date); not part of the configuration (ignored by ``==`` and ``hash``).
    """

    block_n: int = 128
    split_k: int = 1
    num_stages: int = 4
    block_k: int = 256
    overlap: bool = False
    consumers: int = 1
    bf16_store: bool = False
    mma: str = "wgmma"
    measured: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.block_n not in (64, 128):
            raise ValueError(f"MosaicConfig.block_n: expected 64 or 128, got {self.block_n}")
        if self.split_k < 1:
            raise ValueError(f"MosaicConfig.split_k: expected >= 1, got {self.split_k}")
        if not 2 <= self.num_stages <= 8:
            raise ValueError(f"MosaicConfig.num_stages: expected 2..8, got {self.num_stages}")
        if self.block_k not in BLOCK_KS:
            raise ValueError(f"MosaicConfig.block_k: expected one of {BLOCK_KS}, got {self.block_k}")
        for name in ("overlap", "bf16_store"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MosaicConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.mma not in MMAS:
            raise ValueError(f"MosaicConfig.mma: expected one of {MMAS}, got {self.mma!r}")
        if self.mma == "sync" and (self.consumers != 1 or self.overlap):
            raise ValueError("MosaicConfig.mma: 'sync' runs one warpgroup without overlap, got "
                             f"consumers={self.consumers}, overlap={self.overlap}")
        if self.consumers not in (1, 2, 3):
            # 4 compute warpgroups hang on the H200. By arithmetic: 5 warpgroups (640 threads)
            # launch with 96 registers per thread (65536 / 640 rounded down to a multiple of 8),
            # 480 per thread slot in all, but emit_pipeline_warp_specialized hands out 512
            # (producer 40, consumers 4 x 112 = 488): their setmaxnreg.inc waits on the CTA's
            # register pool forever. 2 and 3 consumers fit exactly (3 x 168 = 504 >= 40 + 2 x
            # 232; 4 x 128 = 512 >= 40 + 3 x 152)
            raise ValueError(f"MosaicConfig.consumers: expected 1..3, got {self.consumers}")

    def sync_form(self) -> MosaicConfig:
        """The same tiles with ``mma="sync"`` (one warpgroup, no overlap; no provenance)."""
        return dataclasses.replace(self, mma="sync", overlap=False, consumers=1, measured="")

    def smem_bytes(self, m_tile: int, whole_k: int | None = None) -> int:
        """Shared memory of one CTA: the larger of the pipeline stages (codes, scales, x) and
        the fp32 output tile, which ``store_tile`` allocates in a scope after the pipeline's
        (Mosaic's scoped SMEM is a stack, so the two reuse the same bytes); with whole-K scales
        (``accumulate_tile``) the scales are one buffer of ``whole_k_pair_rows`` x 2*K/16
        bytes instead of a tile per stage. consumers > 1: every stage holds ``consumers`` weight
        tiles and one x tile, and the output tiles (one per consumer) are kernel-level scratch,
        not reused."""
        if self.consumers > 1:
            w = self.consumers * self.block_n * (self.block_k // 2 + self.block_k // 16)
            stage = w + m_tile * self.block_k * 2
            return self.num_stages * stage + self.consumers * self.block_n * m_tile * 4
        stage = self.block_n * self.block_k // 2 + m_tile * self.block_k * 2
        if whole_k is None:
            stage += self.block_n * self.block_k // 16
            extra = 0
        else:
            extra = whole_k_pair_rows(self.block_n, whole_k) * 2 * (whole_k // 16)
        return max(self.num_stages * stage + extra, self.block_n * m_tile * 4)


#: Shapes where backend="auto" picks this kernel on sm_90: (M bucket, N, K) -> config, the bucket
#: 16 (M <= 16) or 64 (M <= 64) as configs.m_bucket, or 8 (M <= 8, looked up first, where the
#: 8-token tile has a different best config). Only buckets measured faster than the
#: Pallas-Triton config are listed. ``measured``: in-graph medians of a config sweep (H200, JAX
#: 0.11.2; the sweep script, bench/mosaic_sweep.py, is no longer in the tree: `git log --
#: bench/mosaic_sweep.py`), this config / Pallas-Triton / bf16 jnp.dot, and the runner-up. Two
#: stages win almost everywhere: a smaller SMEM footprint (more CTAs per SM) beats depth.
AUTO_SM90: dict[tuple[int, int, int], MosaicConfig] = {
    (16, 28672, 8192): MosaicConfig(
        block_n=64, split_k=4, num_stages=2,
        measured="54.1 / 101.5 / 133.9 us; 4 stages 62.6 (h200, 2026-11-29)"),
    # block_n 128 fits two CTAs per SM: the output tile reuses the stage buffers
    (64, 28672, 8192): MosaicConfig(
        block_n=128, split_k=1, num_stages=2, bf16_store=True,
        measured="82.0 / 154.2 / 127.5 us; fp32 store 82.5, two warpgroups 83.4, "
                 "both 88.4 (h200, 2026-11-30)"),
    (64, 4096, 4096): MosaicConfig(
        block_n=64, split_k=4, num_stages=2,
        measured="11.1 / 20.7 / 15.8 us; block_n 128 12.4 (h200, 2026-11-29)"),
    (16, 4096, 14336): MosaicConfig(
        block_n=128, split_k=8, num_stages=2,
        measured="13.5 / 36.9 / 39.3 us; next config 17.4 (h200, 2026-11-29)"),
    (64, 4096, 14336): MosaicConfig(
        block_n=64, split_k=4, num_stages=2,
        measured="23.1 / 49.2 / 46.0 us (h200, 2026-11-29)"),
    (16, 14336, 4096): MosaicConfig(
        block_n=64, split_k=8, num_stages=2,
        measured="17.5 / 38.2 / 42.4 us (h200, 2026-11-29)"),
    (64, 14336, 4096): MosaicConfig(
        block_n=64, split_k=1, num_stages=2, bf16_store=True,
        measured="23.1 / 63.1 / 43.5 us; fp32 store 26.4 (h200, 2026-11-30)"),
    # at ~10 us a call is ~3 launches and moves by up to 2x between runs
    (16, 4096, 4096): MosaicConfig(
        block_n=128, split_k=8, num_stages=3,
        measured="5.6 / 15.3 / 12.5 us; seven other configs 8.2-9.1 (h200, 2026-11-29)"),
    # overlap pays only at the 8-token tile on these two shapes: at M = 16 it loses or ties
    # (51.2 vs 50.3; 16.3 vs 16.5 us), on 14336x4096 at both M (15.1 vs 14.8; 18.5 vs 17.1)
    (8, 28672, 8192): MosaicConfig(
        block_n=64, split_k=4, num_stages=2, overlap=True,
        measured="43.9 us vs 45.0 without overlap (h200, 2026-12-01)"),
    (8, 4096, 14336): MosaicConfig(
        block_n=128, split_k=8, num_stages=2, overlap=True,
        measured="15.4 us vs 15.9 without overlap (h200, 2026-12-01)"),
    # Qwen3-30B-A3B's fused q/k/v; split 8 (6.5 us alone, one K step per CTA) has not been
    # measured in the decoder, where the epilogue then sums 8 partials
    (8, 5120, 2048): MosaicConfig(
        block_n=64, split_k=4, num_stages=2,
        measured="6.8 us vs 7.9 default_config (block_n 128, split 4), 7.5 split 2, 8.8 "
                 "split 1 with the bf16 store, 11.4 block_n 128 split 1; bf16 dot 11.6 "
                 "(h100, 2026-12-05, mosaic-sm90-tiles-h100-80gb-hbm3.json)"),
    # Qwen3-30B-A3B's o_proj and Llama-3-8B's: block_n 64 beats default_config's 128 at the
    # 8-token tile (with overlap 6.45 and 7.99 us: within the rounds' spread)
    (8, 2048, 4096): MosaicConfig(
        block_n=64, split_k=8, num_stages=2,
        measured="6.56 us vs 7.60 default_config (block_n 128, split 8), 6.88 split 4, 8.47 "
                 "split 2; bf16 dot 7.01 (h100, 2026-12-07, "
                 "mosaic-sm90-tiles-h100-80gb-hbm3.json)"),
    (8, 4096, 4096): MosaicConfig(
        block_n=64, split_k=8, num_stages=2,
        measured="7.61 us vs 8.55 the M <= 16 entry (block_n 128, split 8, 3 stages), 8.06 "
                 "split 4, 9.07 block_n 128 split 4; bf16 dot 15.69 (h100, 2026-12-07, "
                 "mosaic-sm90-tiles-h100-80gb-hbm3.json)"),
}


def auto_config(m: int, n: int, k: int) -> MosaicConfig | None:
    """The measured config if "auto" should use this kernel for (M, N, K), else None."""
    if m > MAX_M:
        return None
    if m <= 8 and (8, n, k) in AUTO_SM90:
        return AUTO_SM90[(8, n, k)]
    b = 16 if m <= 16 else 64
    return AUTO_SM90.get((b, n, k))


def has_mma_sync() -> bool:
    """Whether this JAX's Pallas Mosaic GPU has warp-level MMA (``plgpu.mma``, JAX >= 0.11):
    what ``mma="sync"`` needs, so what the Mosaic kernels need on SM 12.x."""
    _, plgpu = pallas_mosaic_gpu()
    return hasattr(plgpu, "mma")


def unavailable(cc: int | None) -> str | None:
    """Why the Mosaic kernels cannot run on compute capability ``cc`` (90 for 9.0), or None if
    they can: sm_90 (wgmma), SM 12.x with ``plgpu.mma`` (JAX >= 0.11; the ``mma="sync"``
    form)."""
    if cc == 90:
        return None
    if sm12x(cc):
        return None if has_mma_sync() else (
            f"sm_{cc}: the Mosaic kernels' SM 12.x form needs plgpu.mma (JAX >= 0.11), this is "
            f"JAX {jax.__version__}")
    found = "no NVIDIA GPU" if cc is None else f"sm_{cc}"
    return f"the Mosaic kernels need an sm_90 or SM 12.x GPU, found {found}"


def smem_limit() -> int:
    """Shared memory one CTA may use on the default device: 99 KB on SM 12.x, else sm_90's."""
    return SM12X_SMEM_LIMIT if is_sm12x() else SMEM_LIMIT


def for_sm12x(cfg: MosaicConfig, m_tile: int, whole_k: int | None = None) -> MosaicConfig:
    """``cfg`` in the form SM 12.x runs: ``mma="sync"``, one warpgroup, no overlap, within
    ``SM12X_SMEM_LIMIT`` (fewer stages down to 2, then block_k 256, then block_n 64). The
    tiles stay the sm_90 table's otherwise: no SM 12.x GPU has measured its own."""
    c = cfg.sync_form()
    while c.smem_bytes(m_tile, whole_k) > SM12X_SMEM_LIMIT:
        if c.num_stages > 2:
            c = dataclasses.replace(c, num_stages=c.num_stages - 1)
        elif c.block_k > BLOCK_K:
            c = dataclasses.replace(c, block_k=BLOCK_K)
        elif c.block_n > 64:
            c = dataclasses.replace(c, block_n=64)
        else:
            break
    return c


def config_for(m: int, n: int, k: int, cc: int | None) -> MosaicConfig:
    """The config ``matmul``'s Mosaic backend runs for (M, N, K) on compute capability ``cc``:
    ``auto_config``, else ``default_config``; on SM 12.x (cc 120..129) that config
    ``for_sm12x``."""
    cfg = auto_config(m, n, k) or default_config(m, n, k)
    if sm12x(cc):
        return for_sm12x(cfg, token_tile(m))
    return cfg


def default_config(m: int, n: int, k: int) -> MosaicConfig:
    """Heuristic for unmeasured shapes: two stages (the sweep's best almost everywhere), >= 256
    CTAs (split-K for small N, keeping >= 2 steps per CTA), 64-row tiles for 64-token tiles."""
    mt = token_tile(m)
    bn = 128 if mt <= 32 else 64
    tiles = -(-n // bn)
    steps = k // BLOCK_K
    split = 1
    while tiles * split < 256 and split * 4 <= steps and steps % (split * 2) == 0:
        split *= 2
    return MosaicConfig(block_n=bn, split_k=split, num_stages=2)


def token_tile(m: int) -> int:
    for t in TOKEN_TILES:
        if m <= t:
            return t
    raise ValueError(f"x: the Mosaic kernel handles M <= {MAX_M} tokens, got M={m}")


def check_supported(m: int, n: int, k: int) -> None:
    """Raise ValueError (naming the argument) if the Mosaic kernel cannot run this shape."""
    if m < 1 or m > MAX_M:
        raise ValueError(f"x: the Mosaic kernel handles 1 <= M <= {MAX_M} tokens, got M={m}")
    if k % BLOCK_K:
        raise ValueError(f"w: the Mosaic kernel needs K % {BLOCK_K} == 0, got K={k}")
    if n < 1:
        raise ValueError(f"w: expected N >= 1, got N={n}")


def permute_k_order(v: jax.Array) -> jax.Array:
    """[..., K] (K % 128 == 0) -> K permuted within 128-groups as the wgmma A fragment: position
    32w + 8j + 2c + l holds element 32c + 8w + 4l + j (``PERM``). Reshapes and a transpose
    only, so Pallas kernels call it too (the MoE glue kernels)."""
    *lead, k = v.shape
    r = len(lead)
    v = v.reshape(*lead, k // 128, 4, 4, 2, 4)  # [..., g, c, w, l, j]
    v = jnp.transpose(v, (*range(r), r, r + 2, r + 4, r + 1, r + 3))  # [..., g, w, j, c, l]
    return v.reshape(*lead, k)


def permute_x(x: jax.Array, mt: int) -> jax.Array:
    """x [M, K] -> [mt, K] bf16: zero-padded tokens, K permuted within 128-groups (``PERM``)."""
    return jnp.pad(permute_k_order(x), ((0, mt - x.shape[0]), (0, 0)))


# ----------------------------------------------------------------------------- decode (PTX)

_DECODE_WORD = """
{
.reg .b32 t, u;
and.b32 t, $4, 0x000F000F;
mul.lo.u32 t, t, 4160;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 $0, t, $5, $6;
and.b32 t, $4, 0x00F000F0;
mul.lo.u32 t, t, 260;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 $1, t, $5, $6;
shr.b32 u, $4, 8;
and.b32 t, u, 0x000F000F;
mul.lo.u32 t, t, 4160;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 $2, t, $5, $6;
and.b32 t, u, 0x00F000F0;
mul.lo.u32 t, t, 260;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 $3, t, $5, $6;
}
"""
# word q (nibble i at bits 4i) -> R_j = bf16x2(nibble j, nibble j+4) * S, j = 0..3.
# (q & 0x000F000F) * 4160 = (y << 12) + (y << 6): sign lands at bit 15, e1 e0 m at bits 8..6 (no
# overlap, no carry); 260 = 2^8 + 2^2 does the same for nibbles at bits 4..7; shr 8 for j = 2, 3.

_SCALE_PAIR = """
{
.reg .b32 t, s, c1, c2;
mov.b32 c1, 0x7B807B80;
mov.b32 c2, 0x7B007B00;
prmt.b32 t, $1, $2, $3;
shl.b32 s, t, 8;
shl.b32 t, t, 4;
and.b32 s, s, 0x80008000;
and.b32 t, t, 0x07F007F0;
or.b32 t, t, s;
fma.rn.bf16x2 t, t, c1, $4;
fma.rn.bf16x2 $0, t, c2, $4;
}
"""
# two E4M3 bytes (picked by the runtime selector $3 from the 8 bytes {$2, $1}) -> bf16x2
# (s0, s1) * 2^119: the raw placement (byte & 0x7F) << 4 with the sign at bit 15 is
# e4m3 * 2^-120 (subnormals included, 0 stays 0), then * 2^120 and * 2^119 (both exact;
# bf16 2^120 = 0x7B80, 2^119 = 0x7B00).


def _byte_ptr(ptr, byte_off):
    """``ptr`` (an LLVM pointer into shared memory) advanced by ``byte_off`` bytes (an i32
    value), in the pointer's own address space: the address every inline_mgpu load here reads."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    i64 = ir.IntegerType.get_signless(64)
    return llvm.inttoptr(ptr.type, llvm.add(llvm.ptrtoint(i64, ptr), arith.extui(i64, byte_off),
                                            overflow_flags=llvm.IntegerOverflowFlags.none))


def _decode_fn(block_n: int, g: int, block_k: int = BLOCK_K, scale_stride: int | None = None,
               swizzled: bool = False, sync: bool = False):
    """inline_mgpu body: (codes_smem [block_n, block_k/2] u8, scales_smem [block_n, block_k/16]
    u8) -> the bf16 WGMMA-layout fragment [block_n, 128] of 128-deep K group ``g`` of the step.
    scale_stride: whole-K scale mode (``accumulate_tile``): the scales ref points at the step's
    first scale byte of row 0 and rows are ``scale_stride`` (= K/16, a multiple of 8) bytes
    apart; each (row, group) reads its 8 bytes with one 8-byte load.
    swizzled: the step's scales are block_k/64 contiguous 512-byte blocks of the
    ``swizzled_128x4`` layout: block c holds scale columns 4c..4c+3 of all 128 rows, row r's 4
    bytes at (r % 32) * 16 + (r // 32) * 4; each (row, group) reads two words. With block_n 64
    the rows are the tile's first 64 (r // 32 < 2); the CTA of its last 64 passes the scales
    ref 8 bytes further on (``_step_mma``'s ``s_off``)."""
    if swizzled and (block_n not in (64, 128) or scale_stride is not None):
        raise ValueError("swizzled scales need block_n 64 or 128 and per-step scale tiles")
    cstride = block_k // 2  # bytes per row of the code tile
    sstride = block_k // 16 if scale_stride is None else scale_stride
    if not 0 <= g < block_k // 128:
        raise ValueError(f"g: expected 0 <= g < {block_k // 128}, got {g}")
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental import mosaic as _mosaic  # noqa: F401
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    def body(_launch_ctx, codes_ref, scales_ref):
        i32 = ir.IntegerType.get_signless(32)
        bf16 = ir.BF16Type.get()
        v4i32 = ir.VectorType.get((4,), i32)
        v2bf16 = ir.VectorType.get((2,), bf16)

        def c32(v):
            return arith.constant(i32, ir.IntegerAttr.get(i32, v))

        tid = arith.remui(utils.thread_idx(), c32(128))
        warp = arith.divui(tid, c32(32))
        lane = arith.remui(tid, c32(32))
        r = arith.divui(lane, c32(4))
        cq = arith.remui(lane, c32(4))
        # prmt selector (nibble i picks byte i): byte0 <- 2c, byte2 <- 2c + 1 (1, 3: don't care)
        sel = arith.addi(arith.muli(cq, c32(0x0202)), c32(0x0100))
        neg_zero = c32(0x80008000 - (1 << 32))  # -0.0 in both bf16 lanes (as signed i32)
        cptr = utils.memref_ptr(codes_ref)
        sptr = utils.memref_ptr(scales_ref)

        def ld(ptr, byte_off, ty, align):
            return llvm.load(ty, _byte_ptr(ptr, byte_off), alignment=align)

        nblk = block_n // 64
        regs = np.empty((nblk, 16, 1, 1, 2, 1, 1, 1, 1), dtype=object)
        for rb in range(nblk):
            for h in range(2):
                row = arith.addi(
                    arith.addi(arith.muli(warp, c32(16)), r), c32(64 * rb + 8 * h)
                )
                if swizzled:  # blocks 2g and 2g + 1: columns 8g..8g+3 and 8g+4..8g+7
                    soff = arith.addi(
                        arith.muli(arith.remui(row, c32(32)), c32(16)),
                        arith.addi(arith.muli(arith.divui(row, c32(32)), c32(4)), c32(1024 * g)),
                    )
                    sw = [ld(sptr, soff, i32, 4), ld(sptr, arith.addi(soff, c32(512)), i32, 4)]
                    gl = 0
                elif scale_stride is None:
                    # the 16 scale bytes holding group g's 8 (two groups per 16 bytes)
                    soff = arith.addi(arith.muli(row, c32(sstride)), c32(16 * (g // 2)))
                    srow = ld(sptr, soff, v4i32, 16)
                    sw = [llvm.extractelement(srow, c32(i)) for i in range(4)]
                    gl = g % 2
                else:  # group g's 8 bytes (8-byte aligned: K/16 % 8 == 0)
                    soff = arith.addi(arith.muli(row, c32(sstride)), c32(8 * g))
                    srow = ld(sptr, soff, ir.VectorType.get((2,), i32), 8)
                    sw = [llvm.extractelement(srow, c32(i)) for i in range(2)]
                    gl = 0
                cbase = arith.addi(arith.muli(row, c32(cstride)), arith.muli(cq, c32(16)))
                pair = llvm.inline_asm(
                    i32, [sw[2 * gl], sw[2 * gl + 1], sel, neg_zero], _SCALE_PAIR, "=r,r,r,r,r"
                )
                s_a = utils.prmt(pair, pair, c32(0x1010))  # block 2c in both lanes
                s_b = utils.prmt(pair, pair, c32(0x3232))  # block 2c + 1
                words = ld(cptr, arith.addi(cbase, c32(64 * g)), v4i32, 16)
                for w in range(4):
                    q = llvm.extractelement(words, c32(w))
                    out = llvm.inline_asm(
                        llvm.StructType.get_literal([i32] * 4),
                        [q, s_a if w < 2 else s_b, neg_zero],
                        _DECODE_WORD,
                        "=r,=r,=r,=r,r,r,r",
                    )
                    for j in range(4):  # fragment column tile 4w + j (see PERM)
                        v = llvm.extractvalue(i32, out, [j])
                        regs[rb, 4 * w + j, 0, 0, h, 0, 0, 0, 0] = utils.bitcast(v, v2bf16)
        if sync:  # column tile kt of 8 -> [16-deep chunk kt // 2, half kt % 2]
            from jax.experimental.mosaic import gpu as mgpu

            layout = mgpu.MMALayouts(bf16).lhs
            shape = layout.registers_shape((block_n, 128))
            regs = regs.reshape(nblk, 8, 2, 2).reshape(shape)
            return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)
        return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return body


def _x_fragment_fn(m_tile: int, block_k: int, g: int):
    """inline_mgpu body (``mma="sync"``): the x stage [m_tile, block_k] bf16 (K-permuted by
    ``PERM`` like the A fragment's columns; as TMA writes it for ``_x_spec``: [m_tile/8,
    block_k/64] tiles of 8 x 64 elements, 1 KB each, the 16-byte chunk c of row r at chunk
    c ^ r) -> the B operand [128, m_tile] = x^T of 128-deep group ``g`` in ``MMALayouts.rhs``
    (every warp holds all of it). The B register of 16-deep chunk kc, 8-token tile nt and half h
    is the 8 x 8 matrix of chunk c = 2 (kc % 4) + h of the tile's 8 rows, lane 4r + t holding
    row r's word t: ``ldmatrix``'s layout. One ``ldmatrix.x4`` per chunk pair (2p, 2p + 1) and
    tile loads chunks 4 (p % 2) .. 4 (p % 2) + 3, lane 8i + r addressing row r of chunk
    4 (p % 2) + i: 4 registers per instruction, against one 32-bit load each. The swizzle
    puts the 8 rows of a matrix in 8 different 16-byte bank groups (no bank conflicts)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, nvvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    tiles_k = block_k // 64

    def body(_launch_ctx, x_ref):
        i32 = ir.IntegerType.get_signless(32)
        bf16 = ir.BF16Type.get()
        v2bf16 = ir.VectorType.get((2,), bf16)

        def c32(v):
            return arith.constant(i32, ir.IntegerAttr.get(i32, v))

        lane = arith.remui(utils.thread_idx(), c32(32))
        r = arith.remui(lane, c32(8))  # the matrix row this lane addresses
        mat = arith.divui(lane, c32(8))  # and which of the instruction's 4 matrices
        # row r of chunk 4q + mat sits at chunk (4q + mat) ^ r of the tile row
        row_off = [
            arith.addi(arith.muli(r, c32(128)),
                       arith.muli(arith.xori(arith.addi(mat, c32(4 * q)), r), c32(16)))
            for q in range(2)
        ]
        xptr = utils.memref_ptr(x_ref)
        shape = ir.Attribute.parse("#nvvm.ld_st_matrix_shape<m=8, n=8>")
        layout = mgpu.MMALayouts(bf16).rhs
        regs = np.empty((8, m_tile // 8, 2), dtype=object)
        for p in range(4):
            for nt in range(m_tile // 8):
                tile = 1024 * (nt * tiles_k + 2 * g + p // 2)
                ptr = _byte_ptr(xptr, arith.addi(row_off[p % 2], c32(tile)))
                quad = nvvm.ldmatrix(ptr, num=4, layout=nvvm.MMALayout.row, shape=shape,
                                     elt_type=nvvm.LdStMatrixEltType.B16)
                for i in range(4):  # matrix i: chunk kc = 2p + i // 2, half i % 2
                    v = llvm.extractvalue(i32, quad, [i])
                    regs[2 * p + i // 2, nt, i % 2] = utils.bitcast(v, v2bf16)
        regs = regs.reshape(layout.registers_shape((128, m_tile)))
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return body


# ----------------------------------------------------------------------------- kernel


def reads_swizzled_scales(cfg: MosaicConfig) -> bool:
    """Whether a kernel with this config can read ``swizzled_128x4`` scales per step: block_n
    128, or 64 with one compute warpgroup (each CTA half of a 128-row tile)."""
    return cfg.block_n == 128 or (cfg.block_n == 64 and cfg.consumers == 1)


def check_config(cfg: MosaicConfig, k: int, m_tile: int, *, swizzled: bool = False,
                 padded: bool = False) -> int:
    """Raise ValueError naming ``config`` if ``cfg`` cannot run with this K and token tile
    (``block_k`` must divide K, or K % 256 == 128 with block_k 256: whole-K scales; the CTA's
    shared memory must fit). Returns the split-K actually used: the largest divisor of the
    number of K steps not above ``cfg.split_k`` (1 with whole-K scales). ``swizzled``:
    ``swizzled_128x4`` scales, read per step (block_n 128, or 64 with one warpgroup; no
    whole-K buffer); with
    K % 256 == 128 the (K + 128) / 256 steps then split unevenly (``split_steps``): the
    largest split up to ``cfg.split_k`` that leaves no split empty. ``padded``: K is the
    weights' zero-padded K (the grouped kernel's x is narrower, its missing columns read as
    zeros), whose K / block_k steps split unevenly the same way, whatever the scale layout."""
    if swizzled and not reads_swizzled_scales(cfg):
        raise ValueError(f"config: swizzled_128x4 scales need block_n=128 (or 64 with one "
                         f"compute warpgroup), got block_n={cfg.block_n}, consumers={cfg.consumers}")
    whole = k % BLOCK_K == 128
    if cfg.consumers > 1 and whole and not swizzled:
        raise ValueError(f"config: consumers={cfg.consumers} needs K % {BLOCK_K} == 0 or "
                         f"swizzled_128x4 scales (no whole-K scale buffer), got K={k}")
    if whole and cfg.block_k != BLOCK_K:
        raise ValueError(f"config: K={k} (K % {BLOCK_K} == 128) needs block_k={BLOCK_K}, "
                         f"got {cfg.block_k}")
    if not whole and k % cfg.block_k:
        raise ValueError(f"config: block_k={cfg.block_k} does not divide K={k}")
    smem = cfg.smem_bytes(m_tile, whole_k=k if whole and not swizzled else None)
    if smem > smem_limit():
        raise ValueError(
            f"config: {cfg} needs {smem} bytes of shared memory with a {m_tile}-row token tile, "
            f"more than the {smem_limit()} a CTA can have here; use fewer stages or consumers, "
            f"block_n 64 or block_k 256"
        )
    if whole and not swizzled:
        return 1
    if whole or padded:
        total = split_steps(k, cfg.block_k, 1)
        return -(-total // split_steps(k, cfg.block_k, min(cfg.split_k, total), padded=padded))
    steps = k // cfg.block_k
    return max(s for s in range(1, min(cfg.split_k, steps) + 1) if steps % s == 0)


def split_steps(k: int, block_k: int, split: int, *, padded: bool = False) -> int:
    """K steps per split-K CTA: K / block_k / split; for K % 256 == 128 (swizzled scales,
    block_k 256) ceil((K + 128) / 256 / split), and for ``padded`` weights (``check_config``)
    ceil(K / block_k / split): the last split's range running past K (TMA reads zeros there,
    for codes, scales and x alike)."""
    if k % block_k == 0:
        return -(-(k // block_k) // split) if padded else k // block_k // split
    total = (k + BLOCK_K // 2) // BLOCK_K
    return -(-total // split)


def pallas_mosaic_gpu():
    """(pl, plgpu), with pallas_call's Mosaic GPU lowering registered."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    try:  # jax 0.11 registers pallas_call's Mosaic GPU lowering rule only on this import
        from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    except ImportError:  # pragma: no cover - other jax versions
        pass
    return pl, plgpu


#: Whole-K scale mode (K % 256 == 128, e.g. Nemotron's FC2 with K = 2688): the scale rows
#: (K/16 bytes: 8 mod 16) cannot be tiled by TMA, whose global strides are multiples of 16
#: bytes. Pairs of rows (2*K/16 bytes, a multiple of 16) can: a CTA copies all its rows'
#: scales at once through the contiguous view [N/2, 2*K/16 / chunk, chunk] (``chunk``: the
#: largest multiple of 16 up to 256, TMA's box limit, dividing 2*K/16) and the decoder reads
#: them as [rows, K/16] bytes.


def whole_k_chunk(k: int) -> int:
    """Bytes per innermost box row of the whole-K scale view (see above)."""
    row2 = 2 * (k // 16)
    return max(c for c in range(16, 257, 16) if row2 % c == 0)


def whole_k_scale_view(scales: jax.Array) -> jax.Array:
    """uint8 [..., N, K/16] -> the view [..., N/2, 2*K/16 / chunk, chunk] (a free reshape)."""
    *lead, n, ks = scales.shape
    c = whole_k_chunk(16 * ks)
    return scales.reshape(*lead, n // 2, 2 * ks // c, c)


def whole_k_pair_rows(block_n: int, k: int) -> int:
    """Pair rows a CTA copies in whole-K scale mode: block_n/2 plus at least one more (the
    last step's padding group reads up to 8 bytes past the tile's last row), rounded so that
    the copy is a multiple of 128 bytes (Mosaic's copy_gmem_to_smem requirement)."""
    p = block_n // 2 + 1
    while p * 2 * (k // 16) % 128:
        p += 1
    return p


def swizzled_tile_view(scales: jax.Array, n: int, k: int) -> jax.Array:
    """``swizzled_128x4`` scales flat ``[..., Np*Kp]`` of an [N, K] weight -> the per-tile view
    ``[..., Np/128, Kp/2, 256]`` (a free reshape): tile t's scale columns 4c..4c+3 are the 512
    bytes at rows 2c, 2c + 1 (TMA boxes are at most 256 elements wide)."""
    from oracle.layouts import padded_shape

    np_, kp = padded_shape(n, k // 16, "swizzled_128x4")
    if scales.shape[-1] != np_ * kp:
        raise ValueError(f"scales: expected swizzled_128x4 scales with last dimension {np_ * kp} "
                         f"for an [{n}, {k}] weight, got {scales.shape}")
    return scales.reshape(*scales.shape[:-1], np_ // 128, kp // 2, 256)


def whole_k_supported(n: int, k: int) -> bool:
    """K % 256 == 128 (so 2*K/16 % 16 == 0) with N even: whole-K scales."""
    return k % BLOCK_K == 128 and n % 2 == 0


def _x_spec(m_tile: int, block_k: int):
    """The pipeline's x tile [m_tile, block_k] bf16, 128-byte swizzled (the wgmma B operand;
    with ``mma="sync"`` read into registers by ``_x_fragment_fn``)."""
    _, plgpu = pallas_mosaic_gpu()
    return plgpu.BlockSpec((m_tile, block_k), lambda i: (0, i), transforms=x_transforms(plgpu))


def x_transforms(plgpu):
    """The x stage's SMEM transforms: tiles of 8 x 64 bf16 (128-byte rows), 128-byte swizzle."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _step_mma(cfg: MosaicConfig, *, scale_stride: int | None = None, swizzled: bool = False,
              m_tile: int | None = None):
    """One pipeline step's work for one warpgroup, shared by ``accumulate_tile`` and
    ``accumulate_tiles_ws``: ``mma(acc_ref, codes_smem, scales_smem, x_smem)`` decodes each
    128-deep group of the step (``_decode_fn``) and runs its wgmma against x. With
    ``cfg.mma == "sync"`` (``m_tile`` given): ``mma(acc, ...) -> acc``, the accumulator a
    value (``MMA_ACC`` layout, the same registers as ``WGMMA``) and x^T loaded into the B
    registers per group (``_x_fragment_fn``)."""
    pl, plgpu = pallas_mosaic_gpu()
    bn, bk = cfg.block_n, cfg.block_k
    groups = bk // 128
    sync = cfg.mma == "sync"
    if sync and not has_mma_sync():
        raise ValueError(f"config: mma='sync' needs plgpu.mma (JAX >= 0.11), this is JAX "
                         f"{jax.__version__}")
    a_layout = plgpu.Layout.MMA_LHS(jnp.bfloat16) if sync else plgpu.Layout.WGMMA
    decode = [
        plgpu.inline_mgpu(
            arg_types=(plgpu.RefType(), plgpu.RefType()),
            return_type=plgpu.ShapeDtypeStruct((bn, 128), jnp.bfloat16, layout=a_layout),
        )(_decode_fn(bn, g, bk, scale_stride=scale_stride, swizzled=swizzled, sync=sync))
        for g in range(groups)
    ]

    def scale_view(s_smem, s_off):
        # s_off (swizzled, block_n 64): the bytes of the 128-row scale tile's second half of
        # rows start s_off = 8 bytes on (r // 32 = 2, 3 instead of 0, 1)
        return s_smem if s_off is None else s_smem.at[:, pl.ds(s_off, s_smem.shape[1] - 8)]

    if sync:
        x_frag = [
            plgpu.inline_mgpu(  # the x stage as _x_spec allocates it
                arg_types=(plgpu.RefType(x_transforms(plgpu)),),
                return_type=plgpu.ShapeDtypeStruct((128, m_tile), jnp.bfloat16,
                                                   layout=plgpu.Layout.MMA_RHS(jnp.bfloat16)),
            )(_x_fragment_fn(m_tile, bk, g))
            for g in range(groups)
        ]

        def mma_sync(acc, c_smem, s_smem, x_smem, s_off=None):
            s_smem = scale_view(s_smem, s_off)
            for g in range(groups):  # synchronous: the stage is free once the body returns
                acc = plgpu.mma(acc, decode[g](c_smem, s_smem), x_frag[g](x_smem))
            return acc

        return mma_sync

    def mma(acc_ref, c_smem, s_smem, x_smem, s_off=None):
        s_smem = scale_view(s_smem, s_off)
        for g in range(groups):
            a = decode[g](c_smem, s_smem)
            plgpu.wgmma(acc_ref, a, x_smem.at[:, pl.ds(128 * g, 128)].T)
            # wgmma reads its A registers and the x stage asynchronously. Without overlap,
            # wait here: the next decode then cannot touch registers an in-flight wgmma
            # reads. With overlap, at most one wgmma stays in flight while the next group
            # decodes (ptxas sees the wgmma's register operands in the inline PTX; the GPU
            # tests check the results). Either way nothing is in flight at the step's end,
            # so the pipeline may release the stage then (delay_release = 0): a wgmma left in
            # flight across the release would read an x stage already overwritten.
            plgpu.wgmma_wait(1 if cfg.overlap and g + 1 < groups else 0)

    return mma


def accumulate_tile(sources, *, cfg: MosaicConfig, m_tile: int, steps: int,
                    whole_k: int | None = None, swizzled: bool = False, s_off=None):
    """Kernel-body building block (dense and grouped kernels): stream ``steps`` K steps of one
    weight tile through the TMA pipeline, decode in registers and wgmma. ``sources()`` returns
    the GMEM refs (codes [block_n, steps*block_k/2] u8, scales [block_n, steps*block_k/16] u8,
    x [m_tile, steps*block_k] bf16); it is called inside the accumulator's scope, where the
    kernels sliced them before they shared this code. Returns the fp32 accumulator
    [block_n, m_tile] (times 2^-7, see POST_SCALE).

    whole_k=K (K % 256 == 128, block_k 256): codes [block_n, K/2] and x [m_tile, K] are read
    in ``steps = (K + 128) / 256`` steps, the last one half past the end (TMA fills zeros), and
    the scales come as ``whole_k_scale_view`` rows [whole_k_pair_rows, ., chunk]: one copy
    per CTA, before the pipeline. The extra pair rows (the next tile's, or zeros past N) keep
    the last step's padding group reading finite scale bytes, which multiply zero codes and x.

    swizzled=True (block_n 128): the scales are the CTA's 128-row tile of ``swizzled_128x4``
    scales viewed as [Kp/2, 256] bytes (``swizzled_tile_view``): each step copies its
    block_k/32 rows (2 KB at block_k 256, contiguous), K % 256 == 128 included (the half step's
    missing blocks read as zeros), with no whole-K buffer. block_n 64: the same 128-row tile
    (twice the scale bytes the CTA needs, 1/8 of its code bytes more), ``s_off`` = 0 or 8 for
    the CTA of its first or last 64 rows.
    """
    pl, plgpu = pallas_mosaic_gpu()
    bn, bk = cfg.block_n, cfg.block_k
    if whole_k is not None and (bk != BLOCK_K or whole_k % BLOCK_K != 128):
        raise ValueError(f"config: whole-K scales need block_k={BLOCK_K} and K % 256 == 128, "
                         f"got block_k={bk}, K={whole_k}")
    if swizzled:  # block_n 64 or 128: check_config and the decode (_decode_fn) require it
        whole_k = None  # per-step tiles whatever K % 256
    sstride = None if whole_k is None else whole_k // 16
    chunk = None if whole_k is None else whole_k_chunk(whole_k)
    sync = cfg.mma == "sync"
    mma = _step_mma(cfg, scale_stride=sstride, swizzled=swizzled, m_tile=m_tile)

    def acc_scope(*scratch):
        acc_ref = None if sync else scratch[0]
        s_all, barrier = scratch[0 if sync else 1:] or (None, None)
        if whole_k is None:
            c_src, s_src, x_src = sources()
        else:  # all the CTA's scales, once: issued before the pipeline, awaited in its first step
            c_src, s_whole, x_src = sources()
            s_src = None
            plgpu.copy_gmem_to_smem(s_whole, s_all, barrier)

        def step(idx, c_smem, *rest):
            if sync:
                *rest, acc = rest
            if whole_k is None:
                s_smem, x_smem = rest
            else:
                (x_smem,) = rest

                @pl.when(idx[0] == 0)  # the pipeline's first copies are in flight by now
                def _():
                    plgpu.barrier_wait(barrier)

                off = idx[0] * 16  # the step's 16 scale bytes within every row
                s_smem = s_all.at[:, pl.ds(off // chunk, 1), pl.ds(off % chunk, 16)]
            if sync:
                return mma(acc, c_smem, s_smem, x_smem, s_off)
            mma(acc_ref, c_smem, s_smem, x_smem, s_off)

        specs = [plgpu.BlockSpec((bn, bk // 2), lambda i: (0, i))]
        if swizzled:
            specs.append(plgpu.BlockSpec((bk // 32, 256), lambda i: (i, 0)))
        elif whole_k is None:
            specs.append(plgpu.BlockSpec((bn, bk // 16), lambda i: (0, i)))
        specs.append(_x_spec(m_tile, bk))
        operands = [a for a in (c_src, s_src, x_src) if a is not None]
        if sync:
            zero = plgpu.layout_cast(jnp.full((bn, m_tile), 0, jnp.float32),
                                     plgpu.Layout.MMA_ACC(jnp.bfloat16))
            return plgpu.emit_pipeline(
                step, grid=(steps,), in_specs=specs, max_concurrent_steps=cfg.num_stages,
                init_carry=zero,
            )(*operands)
        plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=specs, max_concurrent_steps=cfg.num_stages,
        )(*operands)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    scratch = [] if sync else [plgpu.ACC((bn, m_tile), jnp.float32)]
    if whole_k is not None:
        scratch += [plgpu.SMEM((whole_k_pair_rows(bn, whole_k), 2 * (whole_k // 16) // chunk, chunk),
                               jnp.uint8),
                    plgpu.Barrier(num_arrivals=1)]
    return pl.run_scoped(acc_scope, *scratch)


def accumulate_tiles_ws(sources, finish, *, cfg: MosaicConfig, m_tile: int, steps: int,
                        swizzled: bool = False) -> None:
    """Kernel-body building block, warp-specialized (``cfg.consumers`` compute warpgroups plus
    one producer warpgroup; the kernel runs with ``num_threads=consumers + 1``,
    ``thread_name="wg"``). ``sources()`` returns the GMEM refs of the CTA's
    ``consumers * block_n`` weight rows (codes [rows, steps*block_k/2] u8, scales
    [rows, steps*block_k/16] u8) and x [m_tile, steps*block_k] bf16. Each stage holds all the
    rows' codes and scales and one x tile; compute warpgroup w decodes rows
    [w*block_n, (w+1)*block_n) and runs its wgmmas against the shared x tile, so x crosses
    L2 -> SMEM once per ``consumers`` weight tiles. The producer warpgroup only issues TMA
    copies (40 registers). ``finish(acc, w)`` runs in compute warpgroup w with its fp32
    accumulator [block_n, m_tile] (times 2^-7, see POST_SCALE).

    swizzled=True (block_n 128, grouped kernel): the scales ref is the CTA's ``consumers``
    128-row tiles of ``swizzled_128x4`` scales, [consumers, Kp/2, 256] (``swizzled_tile_view``
    rows), and each step copies block_k/32 rows of each; K % 256 == 128 works as in
    ``accumulate_tile`` (the last step's missing half reads zeros)."""
    pl, plgpu = pallas_mosaic_gpu()
    bn, bk, nc = cfg.block_n, cfg.block_k, cfg.consumers
    mma = _step_mma(cfg, swizzled=swizzled)

    def body(_idx, c_smem, s_smem, x_smem, acc):
        w = lax.axis_index("wg")
        c = c_smem.at[pl.ds(w * bn, bn)]
        sc = s_smem.at[w] if swizzled else s_smem.at[pl.ds(w * bn, bn)]
        # nothing in flight when the body returns (_step_mma): the pipeline then counts this
        # warpgroup's use of the stage as consumed
        return pl.run_state(lambda acc_ref: mma(acc_ref, c, sc, x_smem))(plgpu.ACC.init(acc))

    def compute_context(eval_pipeline):
        zero = plgpu.layout_cast(jnp.full((bn, m_tile), 0, jnp.float32), plgpu.Layout.WGMMA)
        finish(eval_pipeline(zero), lax.axis_index("wg"))

    c_src, s_src, x_src = sources()
    plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((nc * bn, bk // 2), lambda i: (0, i)),
            plgpu.BlockSpec((nc, bk // 32, 256), lambda i: (0, i, 0)) if swizzled
            else plgpu.BlockSpec((nc * bn, bk // 16), lambda i: (0, i)),
            _x_spec(m_tile, bk),
        ],
        wg_axis="wg",
        num_compute_wgs=nc,
        max_concurrent_steps=cfg.num_stages,
        compute_context=compute_context,
    )(c_src, s_src, x_src)


def accumulate_and_store(sources, dst, *, cfg: MosaicConfig, m_tile: int, steps: int,
                         scale=None, tiles=None, whole_k: int | None = None,
                         swizzled: bool = False, s_off=None) -> None:
    """Kernel-body building block (dense and grouped kernels): the CTA's ``consumers *
    block_n`` weight rows accumulated (``accumulate_tile``, or ``accumulate_tiles_ws`` for
    consumers > 1) and stored (``store_tile`` / ``write_tile``, bf16(acc * scale) if ``scale``).
    ``dst(w)``: the GMEM ref [m_tile, block_n] of warpgroup w's rows (w = 0 with one
    warpgroup); ``tiles``: the warp-specialized kernel's SMEM scratch [consumers, m_tile,
    block_n] (``ws_kernel_kw``)."""
    if cfg.consumers == 1:
        acc = accumulate_tile(sources, cfg=cfg, m_tile=m_tile, steps=steps, whole_k=whole_k,
                              swizzled=swizzled, s_off=s_off)
        store_tile(acc, dst(0), scale=scale)
        return

    def finish(acc, w):  # compute warpgroup w: its [m_tile, block_n] slice of the output
        write_tile(tiles.at[w], acc, dst(w), scale=scale)

    accumulate_tiles_ws(sources, finish, cfg=cfg, m_tile=m_tile, steps=steps, swizzled=swizzled)


def ws_kernel_kw(cfg: MosaicConfig, m_tile: int, dtype) -> dict:
    """``mosaic_kernel`` arguments for ``cfg``: with more than one warpgroup the consumers'
    output tiles (SMEM scratch [consumers, m_tile, block_n] of the output dtype, the last
    kernel operand) and ``consumers + 1`` warpgroups; none with one."""
    if cfg.consumers == 1:
        return {}
    _, plgpu = pallas_mosaic_gpu()
    return {"scratch": [plgpu.SMEM((cfg.consumers, m_tile, cfg.block_n), dtype)],
            "num_threads": cfg.consumers + 1}


def store_tile(acc, o_dst, *, scale=None) -> None:
    """Kernel-body building block: the fp32 accumulator [block_n, m_tile] -> an SMEM tile
    [m_tile, block_n] (transposed: one shuffle and permute per register pair, the
    WGMMA_TRANSPOSED layout) -> GMEM ref [m_tile, block_n] by TMA. The partials come out
    token-major, so the consumers read contiguous rows and no XLA transpose runs.

    The SMEM tile is allocated here, in a scope that starts after ``accumulate_tile``'s has
    ended (all its TMA copies consumed, all wgmmas waited for): it reuses the pipeline's bytes,
    so a CTA needs max(stages, output tile) of SMEM, not their sum (``smem_bytes``). At a
    64-token tile that is what lets two 128-row CTAs share an SM.

    scale: None, or an fp32 scalar: the tile is stored as acc * scale (one fp32 multiply) in
    ``o_dst``'s dtype: bf16 (one round to nearest even; half the bytes of fp32 partials, for
    consumers whose first step is exactly that rounding: TensorRT-LLM's bf16 GEMM outputs) or
    fp32.
    """
    pl, plgpu = pallas_mosaic_gpu()
    bn, mt = acc.shape
    pl.run_scoped(lambda o_smem: write_tile(o_smem, acc, o_dst, scale=scale),
                  plgpu.SMEM((mt, bn), o_dst.dtype))


def write_tile(o_smem, acc, o_dst, *, scale=None) -> None:
    """The fp32 accumulator [block_n, m_tile] (times ``scale`` if given, in ``o_smem``'s dtype)
    -> SMEM tile ``o_smem`` [m_tile, block_n] (transposed: the WGMMA_TRANSPOSED layout) ->
    GMEM ``o_dst`` by TMA, issued and awaited by the calling warpgroup."""
    _, plgpu = pallas_mosaic_gpu()
    if scale is not None:
        acc = acc * scale
    if acc.dtype != o_smem.dtype:
        acc = acc.astype(o_smem.dtype)
    o_smem.T[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_dst)
    plgpu.wait_smem_to_gmem(0)


def mosaic_kernel(body, *, out_type, grid, grid_names, scratch=None, num_threads=None):
    """``plgpu.kernel`` across JAX versions (``out_type``/``scratch_types`` in JAX >= 0.10.2,
    ``out_shape``/``scratch_shapes`` before). Without ``scratch`` there is no kernel-level
    scratch: the body allocates its SMEM in scopes (``accumulate_tile``, ``store_tile``).
    ``num_threads``: warpgroups per CTA (warp-specialized kernels; axis name "wg"). Lowered
    with JAX's default Mosaic semantics. Named after ``body``."""
    _, plgpu = pallas_mosaic_gpu()
    params = inspect.signature(plgpu.kernel).parameters
    new_api = "out_type" in params and "scratch_types" in params
    kw = {"out_type" if new_api else "out_shape": out_type}
    if scratch is not None:
        kw["scratch_types" if new_api else "scratch_shapes"] = scratch
    if num_threads is not None:
        kw.update(num_threads=num_threads, thread_name="wg")
    return plgpu.kernel(body, grid=grid, grid_names=grid_names, **kw)


def _k_range_sources(x_gmem, c_gmem, s_gmem, n0, rows: int, si, ks: int):
    """The dense kernels' ``sources`` for ``accumulate_tile``: weight rows [n0, n0 + rows) and
    K range ``si`` of length ``ks`` (codes, scales, x)."""
    pl, _ = pallas_mosaic_gpu()

    def sources():
        return (c_gmem.at[pl.ds(n0, rows), pl.ds(si * (ks // 2), ks // 2)],
                s_gmem.at[pl.ds(n0, rows), pl.ds(si * (ks // 16), ks // 16)],
                x_gmem.at[:, pl.ds(si * ks, ks)])

    return sources


def _build(m_tile: int, n: int, k: int, cfg: MosaicConfig, split: int, scaled: bool = False):
    """The dense kernel: CTA tiles of ``consumers * block_n`` weight rows (one warpgroup,
    ``accumulate_tile``; or ``consumers`` compute warpgroups, ``accumulate_tiles_ws``).
    Operands (x, codes, scales[, alpha fp32 [1] if ``scaled``]); output [split, m_tile, N
    padded to whole CTA tiles]: fp32 partials, or bf16(acc * alpha * POST_SCALE) if ``scaled``
    (split 1: the finished output, no XLA epilogue)."""
    pl, _ = pallas_mosaic_gpu()
    bn, nc = cfg.block_n, cfg.consumers
    rows = nc * bn
    n_tiles = -(-n // rows)
    ks = k // split
    steps = ks // cfg.block_k
    assert not scaled or split == 1

    def nvfp4_w4a16_mosaic(x_gmem, c_gmem, s_gmem, *rest):  # the kernel's name
        # rest: [alpha (scaled)], the output, [the consumers' output tiles (ws scratch)]
        o_gmem = rest[1 if scaled else 0]
        ni = lax.axis_index("n")
        si = lax.axis_index("s")
        n0 = ni * rows
        # loaded before the pipeline, so its latency hides behind the first copies
        scale = rest[0][0] * jnp.float32(POST_SCALE) if scaled else None
        sources = _k_range_sources(x_gmem, c_gmem, s_gmem, n0, rows, si, ks)
        accumulate_and_store(sources, lambda w: o_gmem.at[si, :, pl.ds(n0 + w * bn, bn)],
                             cfg=cfg, m_tile=m_tile, steps=steps, scale=scale,
                             tiles=rest[-1] if nc > 1 else None)

    if nc > 1:
        nvfp4_w4a16_mosaic.__name__ = "nvfp4_w4a16_mosaic_ws"
    dtype = jnp.bfloat16 if scaled else jnp.float32
    out_type = jax.ShapeDtypeStruct((split, m_tile, n_tiles * rows), dtype)

    def make(out):
        return mosaic_kernel(nvfp4_w4a16_mosaic, out_type=out, grid=(n_tiles, split),
                             grid_names=("n", "s"), **ws_kernel_kw(cfg, m_tile, dtype))

    return make, out_type


def matmul_mosaic(
    x: jax.Array,
    w_codes: jax.Array,
    w_scales: jax.Array,
    alpha: jax.Array | float,
    *,
    out_dtype=jnp.bfloat16,
    config: MosaicConfig | None = None,
    poison: bool = False,
) -> jax.Array:
    """``alpha * x @ W^T`` with fp32 accumulation (Hopper, M <= 64).

    x: bf16 [M, K], 1 <= M <= 64. w_codes: uint8 [N, K/2] (element 2j in the low nibble of byte
    j). w_scales: E4M3 [N, K/16] as float8_e4m3fn or raw uint8, linear layout. K % 256 == 0.
    alpha: fp32 scalar. out_dtype: bf16, fp16 or fp32. Returns out_dtype [M, N].
    config: MosaicConfig (None: ``default_config``). poison: tests only, eager calls: frees a
    NaN-filled buffer of the output's size just before the call so that a tile the kernel
    skips most likely reads NaN (best effort: ``plgpu.kernel`` cannot alias an input).
    Raises ValueError naming the argument for unsupported dtypes or shapes.
    """
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x: expected a 2-D [M, K] array, got shape {x.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x: expected bfloat16, got {x.dtype}")
    m, k = x.shape
    if w_codes.ndim != 2 or w_codes.dtype != jnp.uint8:
        raise ValueError(f"w_codes: expected uint8 [N, K/2], got {w_codes.dtype} {w_codes.shape}")
    n = w_codes.shape[0]
    if w_codes.shape != (n, k // 2) or k % 2:
        raise ValueError(f"w_codes: expected shape {(n, k // 2)} for K={k}, got {w_codes.shape}")
    if w_scales.dtype not in (jnp.float8_e4m3fn, jnp.uint8):
        raise ValueError(f"w_scales: expected float8_e4m3fn or uint8, got {w_scales.dtype}")
    if w_scales.shape != (n, k // 16):
        raise ValueError(f"w_scales: expected shape {(n, k // 16)}, got {w_scales.shape}")
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    if config is not None and not isinstance(config, MosaicConfig):
        raise ValueError(f"config: expected a MosaicConfig, got {type(config).__name__}")
    alpha = jnp.asarray(alpha, jnp.float32)
    if alpha.size != 1:
        raise ValueError(f"alpha: expected an fp32 scalar, got shape {alpha.shape}")
    check_supported(m, n, k)
    return matmul_mosaic_permuted(permute_x(x, token_tile(m)), m, w_codes, w_scales, alpha,
                                  out_dtype=out_dtype, config=config, poison=poison)


def matmul_mosaic_permuted(
    xp: jax.Array,
    m: int,
    w_codes: jax.Array,
    w_scales: jax.Array,
    alpha: jax.Array | float,
    *,
    out_dtype=jnp.bfloat16,
    config: MosaicConfig | None = None,
    poison: bool = False,
) -> jax.Array:
    """:func:`matmul_mosaic` on x already in the kernel's layout: ``xp`` bf16 [token_tile(m),
    K], :func:`permute_x` of the M = ``m`` tokens (``gemm.operand.mosaic_w4a4_operand`` writes
    it in one launch). The other arguments and the result as :func:`matmul_mosaic`'s, whose
    checks the weights and alpha are assumed to have passed."""
    mt, k = xp.shape
    n = w_codes.shape[0]
    if xp.dtype != jnp.bfloat16 or mt != token_tile(m):
        raise ValueError(f"xp: expected bf16 [{token_tile(m)}, K] for M={m}, got {xp.dtype} "
                         f"{xp.shape}")
    alpha = jnp.asarray(alpha, jnp.float32)
    cfg = config or default_config(m, n, k)
    split = check_config(cfg, k, mt)
    if w_scales.dtype != jnp.uint8:
        w_scales = lax.bitcast_convert_type(w_scales, jnp.uint8)
    # bf16_store: the kernel stores bf16(acc * alpha * POST_SCALE), the same fp32 multiply and
    # round to nearest even as the XLA epilogue, one launch fewer
    scaled = cfg.bf16_store and split == 1 and jnp.dtype(out_dtype) == jnp.bfloat16
    if cfg.bf16_store and not scaled:
        log.info("nvfp4_jax.gemm: bf16_store needs split_k 1 and a bf16 output (split %d, %s): "
                 "fp32 partials and the XLA epilogue", split, jnp.dtype(out_dtype).name)
    make, out_type = _build(mt, n, k, cfg, split, scaled=scaled)
    if poison and not isinstance(xp, jax.core.Tracer):
        # best effort (plgpu.kernel has no input_output_aliases): free a NaN buffer of the
        # output's size just before the call, so the allocator tends to hand that memory to
        # the kernel's output and a skipped tile reads NaN (or stale data from another call)
        jax.block_until_ready(jnp.full(out_type.shape, jnp.nan, out_type.dtype)).delete()
    if scaled:  # the kernel's output is the finished product
        out = make(out_type)(xp, w_codes, w_scales, alpha.reshape(1))[0, :m, :n]
        return out.astype(out_dtype)
    part = make(out_type)(xp, w_codes, w_scales)  # [split, mt, N_pad] fp32
    out = part.sum(axis=0)[:m, :n] * (alpha * POST_SCALE)
    return out.astype(out_dtype)
