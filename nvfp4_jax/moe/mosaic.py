"""Grouped NVFP4 GEMM for the routed MoE as a Pallas Mosaic GPU kernel (Hopper: TMA + wgmma;
SM 12.x: mma.sync).

The dense kernel of ``gemm/mosaic.py`` (swap-AB, ``plgpu.emit_pipeline`` over K, E2M1 decode in
inline PTX straight into the wgmma A fragment, x K-permuted by ``PERM`` before the kernel,
``wgmma_wait(0)`` after every wgmma) with one expert per block of routed rows:

* inputs: ``x [NB*mt, K]`` bf16, the routed rows already gathered block by block (block ``b``
  owns rows ``[b*mt, (b+1)*mt)``, one expert each, see ``routing.block_routing``) and
  K-permuted (``gemm.mosaic.permute_k_order``); weight codes uint8 ``[E, N, K/2]`` and E4M3 scales uint8
  ``[E, N, K/16]`` (linear layout); ``block_expert`` int32 ``[NB]``; ``num_blocks`` int32 ``[1]``;
* grid ``(cdiv(N, block_n), split, NB)``, output tiles fastest (the CTAs running together share
  a block's x rows in L2, as the Pallas-Triton MoE grid does); a CTA whose block is past
  ``num_blocks`` exits before any copy (no weight traffic: experts without tokens cost a CTA
  launch); else it reads ``e = block_expert[b]`` by a scalar load from GMEM and streams
  ``codes[e, n0:n0+bn, k-range]`` / ``scales[e, ...]`` and its block's x rows by TMA;
* output fp32 partials ``[split, NB*mt, N_pad]``, one row per routed row like x (the swap-AB
  accumulator ``[bn, mt]`` is transposed on its way to SMEM, ``gemm.mosaic.store_tile``), times
  ``2^-7``: multiply by ``POST_SCALE``; rows of blocks past ``num_blocks`` are never written
  (garbage: the caller never reads them).

TMA needs 16-byte rows of the scale tile, so K % 256 == 0, except K % 256 == 128 with N even
(Nemotron's FC2: K = I = 2688, 168-byte scale rows): there a CTA copies its rows' scales for the
whole K once, as pairs of rows (``gemm.mosaic.accumulate_tile``, whole-K scales), and the last
K step reads half past the end of the codes and x (TMA fills zeros). Other K keep FC2 on the
Pallas-Triton kernel (``moe_mosaic`` logs it).

``moe_mosaic`` is the routed MoE layer on top: block routing (``routing.block_routing``, sort-
free at decode sizes; or ``routing_kernel.routing_kernel``), the scales
(``scales.moe_scales_kernel``, or inside the routing kernel's launch), then five launches: the
FC1 operand (gather, quantize, K permutation; ``operand.py``), FC1 (this kernel), the FC1
epilogue (split-K sum, ``* alpha1[e]``, trtllm_cutlass bf16 rounding, activation, bf16 ``h``,
requantization with ``G2[e]``, K permutation; ``epilogue.py``), FC2 (this kernel), the combine
(``* alpha2[e]``, bf16 in trtllm_cutlass, router weight, fp32 top-k sum; ``combine.py``). When
FC2 cannot run here (``check_supported``) it runs on Pallas-Triton
(``pallas_triton.fc2_triton``), with the FC1 epilogue in XLA (the functions of ``xla.py``).
``moe(backend="auto")`` picks ``moe_mosaic`` on sm_90 up to ``MAX_ROUTES`` routed rows and on
SM 12.x up to ``SM12X_ROUTES_PER_EXPERT`` rows per expert (``api.choose_backend``).
``reference=True`` replaces the Mosaic kernel by an XLA emulation with the same inputs and
output layout and runs the Pallas-Triton kernels in interpret mode (CPU tests of the dataflow
around the kernel).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..device import is_sm12x
from ..gemm.mosaic import (  # BLOCK_K: K % 256 for TMA; TOKEN_TILES: rows per block (wgmma N)
    BLOCK_K,
    PERM,
    POST_SCALE,
    SMEM_LIMIT,
    TOKEN_TILES,
    MosaicConfig,
    accumulate_and_store,
    check_config,
    for_sm12x,
    mosaic_kernel,
    pallas_mosaic_gpu,
    reads_swizzled_scales,
    split_steps,
    swizzled_tile_view,
    whole_k_pair_rows,
    whole_k_scale_view,
    whole_k_supported,
    ws_kernel_kw,
)
from ..layouts import unswizzle
from ..quantize import NVFP4Array
from ..triton_ops import cdiv, pow2
from .combine import combine
from .configs import Config
from .configs import default_config as triton_default_config
from .epilogue import fc1_epilogue
from .operand import fc1_operand, token_operand
from .pallas_triton import fc2_triton
from .routing import block_routing, max_blocks
from .routing_kernel import routing_kernel, routing_kernel_fits, routing_operand_kernel
from .scales import moe_scales_kernel
from .weights import intermediate_size, padded_inter, unpad_fc2
from .xla import activate, add_residual, bf16_round, quantized_values, recipe_of, sorted_rows

log = logging.getLogger(__name__)

N_SM = 132  # H200
#: Routed rows per block (the wgmma N slot): the dense kernel's token tiles plus 128 for
#: prefill-sized routings (a 128-row x stage is 64 KB: block_n 64 with 2 stages fits one CTA).
GROUPED_TOKEN_TILES = (*TOKEN_TILES, 128)


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class MosaicMoEConfig:
    """Launch configuration of the Mosaic MoE path (data, see ``AUTO_SM90``).

    block_m: routed rows per routing block (the wgmma N slot: 8, 16, 32, 64 or 128; 16 or more
    when FC2 runs on Pallas-Triton, whose blocks are >= 16 rows).
    fc1 / fc2: ``MosaicConfig`` of the two grouped GEMMs (block_n, split_k, num_stages, block_k).
    fc2_triton: Pallas-Triton tiles for FC2 when its K = I is not a multiple of 256 (None:
    ``configs.default_config``'s).
    routing: "xla" (``routing.block_routing``: ~5 small XLA fusions), "kernel"
    (``routing_kernel.routing_kernel``: the routing and the scales in one Pallas-Triton launch,
    for routings that fit one program, ``routing_kernel_fits``; larger ones use "xla", logged)
    or "fused" (``routing_kernel.routing_operand_kernel``; needs ``skip_padding``: the routing,
    the scales and the FC1 operand in one launch, each program recomputing the small routing in
    registers). The same routing either way; the one-program kernels pay at decode sizes only,
    and which one pays depends on the expert count, so ``AUTO_SM90`` sets it per shape.
    skip_padding: the FC1 operand and FC1 epilogue kernels leave the blocks' padding rows alone
    (no quantization, no reads of their partials, no writes; nothing downstream reads them)
    instead of processing whole blocks: at decode most block rows are padding.
    bf16_partials: in ``trtllm_cutlass`` mode, an unsplit grouped GEMM stores bf16(alpha * acc),
    TensorRT-LLM CUTLASS's bf16 GEMM output, instead of fp32 partials for the next kernel to
    scale and round: the same numbers, half the bytes written and read. Ignored, with a log
    line, in ``b12x`` mode (no rounding there) and for a split GEMM.
    epilogue: "blocks" (one FC1-epilogue program per routing block and column group, masking
    the padding rows with skip_padding) or "routes" (one program per route and column group,
    loading only that route's row, with each route's columns split until
    ``epilogue.EPILOGUE_MIN_PROGRAMS``): the same values; "routes" pays at decode.
    wide_glue: the FC1 operand kernel takes ``operand.operand_rows`` sorted rows per program
    (their routes first, then one [rows, H tile] gather) and the combine
    ``combine.combine_width`` output columns per program instead of one row and 64 columns:
    fewer, larger programs for prefill. The same values (the combine's top-k sum in Triton's
    tree order for its tile shape).
    token_quant: where one encode scale serves all experts (``activation_scale`` "scalar", as in
    ``trtllm_cutlass``), quantize each token's FC1 input once (``operand.token_operand``, T
    rows) and let the FC1 operand kernel only gather the routed rows from it, instead of
    quantizing every route (T * k rows). Bit for bit the same operand; one more launch, so it
    pays for prefill. Per-expert activation scales quantize each route with its expert's
    scale: there it is ignored, logged. Refused with ``routing="fused"`` (which computes the
    operand in the routing launch).
    measured: provenance of a tuning-table entry (shape, time against the alternative, GPU,
    date); not part of the configuration (ignored by ``==`` and ``hash``).

    The encode scales and alphas always come from one Pallas-Triton launch with IEEE divisions
    (``scales.moe_scales_kernel``, or inside the routing kernel's launch).
    """

    block_m: int = 8
    fc1: MosaicConfig = MosaicConfig(block_n=128, split_k=1, num_stages=2)  # noqa: RUF009 - frozen
    fc2: MosaicConfig = MosaicConfig(block_n=128, split_k=1, num_stages=2)  # noqa: RUF009 - frozen
    fc2_triton: Config | None = None
    routing: str = "xla"
    skip_padding: bool = False
    bf16_partials: bool = False
    epilogue: str = "blocks"
    wide_glue: bool = False
    token_quant: bool = False
    measured: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("skip_padding", "bf16_partials", "wide_glue", "token_quant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MosaicMoEConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.routing not in ("xla", "kernel", "fused"):
            raise ValueError(f"MosaicMoEConfig.routing: expected 'xla', 'kernel' or 'fused', "
                             f"got {self.routing!r}")
        if self.epilogue not in ("blocks", "routes"):
            raise ValueError(f"MosaicMoEConfig.epilogue: expected 'blocks' or 'routes', got {self.epilogue!r}")
        if self.routing == "fused" and self.token_quant:
            raise ValueError("MosaicMoEConfig.token_quant: routing='fused' quantizes the FC1 operand "
                             "in the routing launch; use routing='kernel' or 'xla' with token_quant")
        if self.routing == "fused" and not self.skip_padding:
            raise ValueError("MosaicMoEConfig.routing: 'fused' writes only the routed operand rows; "
                             "it needs skip_padding=True")
        if self.block_m not in GROUPED_TOKEN_TILES:
            raise ValueError(f"MosaicMoEConfig.block_m: expected one of {GROUPED_TOKEN_TILES}, "
                             f"got {self.block_m}")
        for name in ("fc1", "fc2"):
            if not isinstance(getattr(self, name), MosaicConfig):
                raise ValueError(f"MosaicMoEConfig.{name}: expected a MosaicConfig, "  # noqa: TRY004
                                 f"got {type(getattr(self, name)).__name__}")
        if self.fc2_triton is not None and not isinstance(self.fc2_triton, Config):
            raise ValueError(f"MosaicMoEConfig.fc2_triton: expected a moe Config, "
                             f"got {type(self.fc2_triton).__name__}")


#: Routed rows (T * top_k) up to which ``moe(backend="auto")`` uses the Mosaic kernels on sm_90:
#: the largest routing measured faster than Pallas-Triton (H200, default configs: nemotron
#: T = 512 / 4096: 1059 / 4592 us vs 1563 / 5258; qwen3 T = 512 / 4096: 315 / 1589 vs 514 /
#: 1715). Beyond nemotron T = 4096 (90112 routes) it is unmeasured.
MAX_ROUTES = 90112

#: Mean routed rows per expert (T * top_k / min(E, T * top_k), the token tile
#: ``default_config`` sizes from) up to which ``moe(backend="auto")`` runs the Mosaic MoE on
#: SM 12.x, its grouped GEMMs on bf16 ``mma.sync`` (``gemm.mosaic.for_sm12x``); above it the
#: Pallas-Triton MoE on the block-scaled FP4 MMA, which has 8x the bf16 tensor rate there.
#: ``SM12X_ROUTES_PER_EXPERT_BASIS`` holds the numbers behind it.
SM12X_ROUTES_PER_EXPERT = 16
SM12X_ROUTES_PER_EXPERT_BASIS = (
    "predicted (bench/sm12x_model.py, the grouped GEMMs' own sm_120a counts 0.112-0.143 "
    "warp-instructions per weight; us on RTX 5090 / 5060 Ti / DGX Spark): up to 16 rows per "
    "expert the layer on bf16 mma.sync is DRAM-bound and within 2 % of the FP4-MMA "
    "Pallas-Triton MoE (qwen3 T=256, 16 rows: 227 / 908 / 1489 vs 222 / 887 / 1456); at 32 "
    "rows it is bf16-MMA-bound on the GeForce cards (qwen3 T=512: 369 / 1631 / 1596 vs 233 / "
    "932 / 1529). Measured, the same source on Hopper, no XLA flags: the Mosaic MoE on "
    "mma.sync 0.98-1.03x the sm_90 Mosaic MoE (H200 T=1/8/64, H100 T=16/32/256), the "
    "Pallas-Triton MoE 1.51-1.66x (H200) and 1.11-1.38x (H100) "
    "(moe-candidates-h200.json, moe-candidates-h100-80gb-hbm3.json)")

_NEMO = (512, 1024, 2688, 2688)  # (E, H, R, I)
_QWEN = (128, 2048, 1536, 768)
_NEMO_CFG = MosaicMoEConfig(block_m=8, fc1=MosaicConfig(block_n=128, split_k=1, num_stages=2),
                            fc2=MosaicConfig(block_n=128, split_k=1, num_stages=2))
#: Measured configs: (E, H, R, I, routes bucket) -> MosaicMoEConfig; anything else gets
#: ``default_config``. Buckets: routes rounded up to a power of two. Each entry's ``measured``:
#: the layer's time with it against the alternatives measured (H200, JAX 0.11.2, in-graph layer
#: time, random routing, median of 3 runs).
AUTO_SM90: dict[tuple[int, int, int, int, int], MosaicMoEConfig] = {
    (*_NEMO, 32): dataclasses.replace(
        _NEMO_CFG, skip_padding=True, routing="fused", epilogue="routes",
        fc2=MosaicConfig(block_n=128, split_k=3, num_stages=2),
        measured="nemotron T=1: 44.7 us vs 45.8 blocks epilogue, 52.4 XLA routing, "
                 "96.6 Pallas-Triton (h200, 2026-11-30)"),
    (*_NEMO, 256): dataclasses.replace(
        _NEMO_CFG, skip_padding=True, routing="kernel", epilogue="routes",
        fc2=MosaicConfig(block_n=128, split_k=2, num_stages=2),
        measured="nemotron T=8: 175.1 us vs 177.6 blocks epilogue, 182.0 XLA routing, "
                 "220.4 fused routes method (h200, 2026-11-30)"),
    (*_NEMO, 2048): dataclasses.replace(
        _NEMO_CFG, bf16_partials=True,
        measured="nemotron T=64: 537.2 us vs 546.6 fp32 partials, 1178.6 Pallas-Triton "
                 "(h200, 2026-11-30)"),
    # FC1 split 4 leaves each CTA two K steps, FC2 split 3 one: every copy issued at once.
    # FC1's overlap (412.8 us) has not run in the grouped kernel under a GPU test
    (*_QWEN, 8): MosaicMoEConfig(
        block_m=8, fc1=MosaicConfig(block_n=64, split_k=4, num_stages=2),
        fc2=MosaicConfig(block_n=64, split_k=3, num_stages=2),
        routing="fused", skip_padding=True, epilogue="routes",
        measured="qwen3 T=1, in the 48-layer decoder, us per step: FC1 435.5 vs 448.8 split 2, "
                 "412.8 split 4 with overlap, 470.7 split 2 with 4 stages; FC2 284.3 vs 306.0 "
                 "split 1, 314.3 split 1 with 3 stages; step 2.6398 vs 2.6585 ms (h100, "
                 "2026-12-07, moe-t1-tiles-select-argmax-ab-h100-80gb-hbm3.json); the layer "
                 "alone: 27.6 us vs 29.4 blocks epilogue, 31.0 block_n 128, 37.1 XLA scales, "
                 "51.9 Pallas-Triton (h200, 2026-11-30)"),
    (*_QWEN, 64): MosaicMoEConfig(
        block_m=8, fc1=MosaicConfig(block_n=64, split_k=1, num_stages=2),
        fc2=MosaicConfig(block_n=64, split_k=1, num_stages=2),
        routing="fused", skip_padding=True, bf16_partials=True, epilogue="routes",
        measured="qwen3 T=8: 69.3 us vs 70.4 blocks epilogue, 74.8 block_n 128, "
                 "143.7 Pallas-Triton (h200, 2026-11-30)"),
    # FC2's K = 768 is three 256-deep steps: with two warpgroups its CTA (200 KB of shared
    # memory) has the SM alone; with one (100 KB) two CTAs share an SM. At nemotron T = 4096
    # (K = 2688, eleven steps) both choices lose, which keeps the default there.
    (*_QWEN, 32768): MosaicMoEConfig(
        block_m=64, fc1=MosaicConfig(block_n=128, num_stages=2, consumers=2),
        fc2=MosaicConfig(block_n=128, num_stages=2, consumers=1),
        bf16_partials=True, wide_glue=True, token_quant=True, skip_padding=True,
        measured="qwen3 T=4096: 1026.9 us vs 1036.1 skip_padding alone, 1041.4 default_config "
                 "(h200, 2026-12-01)"),
}


#: The grouped GEMMs' tiles SM 12.x starts from (before ``for_sm12x``) where they are not the
#: ``AUTO_SM90`` entry's: (E, H, R, I, routes bucket) -> (FC1, FC2). No SM 12.x GPU has measured
#: a tile, and sm_90's measured choices do not carry over unmeasured (SM 12.x fits one CTA of
#: these tiles per SM, without wgmma's asynchronous issue), so these keep the tiles whose
#: sm_120a counts ``bench/results/mosaic-sync-moe-sm12x-ptxas.json`` records.
SM12X_GEMMS: dict[tuple[int, int, int, int, int], tuple[MosaicConfig, MosaicConfig]] = {
    (*_QWEN, 8): (MosaicConfig(block_n=64, split_k=2, num_stages=2),
                  MosaicConfig(block_n=64, split_k=1, num_stages=2)),
}


#: FC2's config in place of the ``AUTO_SM90`` entry's when FC2 is zero-padded along K
#: (``pad_fc2``): with 128-byte aligned code rows the split that pays on the unpadded rows
#: does not.
AUTO_SM90_PADDED_FC2: dict[tuple[int, int, int, int, int], MosaicConfig] = {
    (*_NEMO, 256): MosaicConfig(
        block_n=128, split_k=1, num_stages=2,
        measured="nemotron T=8, FC2 padded: 169.8 us vs 171.5 split 2, 174.8 split 3 "
                 "(h200, 2026-11-30)"),
}


def _bucket(routes: int) -> int:
    return pow2(routes)


def _split_for(tiles: int, steps: int, want: int) -> int:
    """Largest divisor s of ``steps`` with ``tiles * s <= want`` and >= 2 steps per split (or 1)."""
    best = 1
    for s in range(1, steps + 1):
        if steps % s == 0 and steps // s >= 2 and tiles * s <= want:
            best = s
    return best


#: Routed rows from which ``default_config`` picks bf16 products (``bf16_partials``), and from
#: which two compute warpgroups per CTA (consumers=2). H200, us, default -> bf16 / two
#: warpgroups / both: nemotron T = 4096 (90112 routes) 3700 -> 3571 / 3577 / 3448; qwen3 T =
#: 4096 (32768 routes) 1314 -> 1184 / 1261 / 1158; nemotron T = 512 (11264 routes) 1012 -> 977
#: (bf16); qwen3 T = 512 (4096 routes) 290 -> 275 (bf16), 328 (both). Two warpgroups win with
#: 64-row blocks and lose with 32-row ones.
BF16_PARTIALS_ROUTES = 4096
WS_ROUTES = 32768
#: Routed rows from which ``default_config`` picks the wide glue kernels (``wide_glue``). H200,
#: us: nemotron T = 4096 3482.9 -> 3279.3, T = 512 976.9 -> 957.4; qwen3 T = 4096 1159.6 ->
#: 1127.7, T = 512 (4096 routes) 276.1 -> 273.2. Unmeasured between 1408 and 4096 routes.
WIDE_GLUE_ROUTES = 4096
#: Routed rows from which ``default_config`` sets ``token_quant``. H200, us: qwen3 T = 4096
#: 1125.8 -> 1081.4, T = 512 (4096 routes) 271.6 -> 262.9; nemotron T = 4096 3287.7 -> 3211.1,
#: T = 512 951.6 -> 946.6. Below 4096 routes the extra launch weighs more than the saved work.
TOKEN_QUANT_ROUTES = 4096


def routes_per_expert(routes: int, num_experts: int) -> int:
    """Mean routed rows per expert that has any, rounded up: ``routes`` (T * top_k) over
    min(E, routes) experts. ``default_config`` sizes its token tile from it and
    ``api.choose_backend`` compares it with ``SM12X_ROUTES_PER_EXPERT``."""
    return -(-routes // max(1, min(num_experts, routes)))


def default_config(routes: int, num_experts: int, *, hidden: int, rows1: int, inter: int) -> MosaicMoEConfig:
    """Heuristic: blocks of the smallest token tile that holds the mean routed rows per touched
    expert (8 at decode, 16 or more when FC2 falls back to Pallas-Triton, at most 64), 128-row
    weight tiles (64 where 128 would not fit the shared memory), 2 stages (the dense sweep's
    best at small M), split-K until the expected CTAs (blocks x output tiles x split) reach
    about two per SM. bf16 products (``bf16_partials``) from ``BF16_PARTIALS_ROUTES`` routed
    rows on, two compute warpgroups per CTA (where they fit the shared memory) from
    ``WS_ROUTES`` on, the wide glue kernels (``wide_glue``) from ``WIDE_GLUE_ROUTES`` on, each
    token quantized once (``token_quant``, where the activation scale allows) from
    ``TOKEN_QUANT_ROUTES`` on."""
    lo = 8 if mosaic_plan(hidden, inter, n1=rows1, n2=hidden)[1] else 16
    per_expert = routes_per_expert(routes, num_experts)
    bm = next((t for t in TOKEN_TILES if t >= max(lo, per_expert)), TOKEN_TILES[-1])
    blocks = max(min(num_experts, routes), routes // bm)  # expected valid blocks
    ws_ok = routes >= WS_ROUTES
    cfgs = []
    for n, k in ((rows1, hidden), (hidden, inter)):
        whole = k % BLOCK_K != 0
        bn = 128
        if MosaicConfig(block_n=bn, num_stages=2).smem_bytes(bm, whole_k=k if whole else None) > SMEM_LIMIT:
            bn = 64
        split = 1 if whole else _split_for(blocks * cdiv(n, bn), k // BLOCK_K, 2 * N_SM)
        cfg = MosaicConfig(block_n=bn, split_k=split, num_stages=2)
        ws = dataclasses.replace(cfg, consumers=2)
        if ws_ok and bn == 128 and ws.smem_bytes(bm) <= SMEM_LIMIT:
            cfg = ws  # whole-K with linear scales: moe_mosaic drops it to one warpgroup (logged)
        cfgs.append(cfg)
    return MosaicMoEConfig(block_m=bm, fc1=cfgs[0], fc2=cfgs[1], bf16_partials=routes >= BF16_PARTIALS_ROUTES,
                           wide_glue=routes >= WIDE_GLUE_ROUTES,
                           token_quant=routes >= TOKEN_QUANT_ROUTES)


def auto_config(routes: int, num_experts: int, *, hidden: int, rows1: int, inter: int,
                fc2_padded: bool = False, sm12x: bool = False) -> MosaicMoEConfig:
    """The measured config for this layer and routes bucket (``AUTO_SM90``; with
    ``fc2_padded``, FC2 zero-padded along K by ``pad_fc2``, FC2's config from
    ``AUTO_SM90_PADDED_FC2`` where it has one; with ``sm12x``, the grouped GEMMs' tiles from
    ``SM12X_GEMMS`` where it has them, still to be put in their SM 12.x form by
    ``for_sm12x``), else ``default_config``."""
    key = (num_experts, hidden, rows1, inter, _bucket(routes))
    cfg = AUTO_SM90.get(key)
    if cfg is None:
        return default_config(routes, num_experts, hidden=hidden, rows1=rows1, inter=inter)
    if fc2_padded and key in AUTO_SM90_PADDED_FC2:
        cfg = dataclasses.replace(cfg, fc2=AUTO_SM90_PADDED_FC2[key])
    if sm12x and key in SM12X_GEMMS:
        fc1, fc2 = SM12X_GEMMS[key]
        cfg = dataclasses.replace(cfg, fc1=fc1, fc2=fc2)
    return cfg


def supported(k: int, n: int) -> bool:
    """Whether the grouped kernel runs with this K and N: K % 256 == 0, or K % 256 == 128 with
    N even (whole-K scales, ``gemm.mosaic.whole_k_supported``)."""
    return k % BLOCK_K == 0 or whole_k_supported(n, k)


def check_supported(k: int, *, n: int = 2, name: str = "w") -> None:
    """Raise ValueError naming the argument if ``supported(k, n)`` is false."""
    if not supported(k, n):
        raise ValueError(f"{name}: the Mosaic grouped kernel needs K % {BLOCK_K} == 0, or "
                         f"K % {BLOCK_K} == 128 with N even (TMA needs 16-byte rows of scales, "
                         f"or of pairs of them), got N={n}, K={k}")


# ----------------------------------------------------------------------------- kernel


def _build(mt: int, nb: int, n: int, k: int, cfg: MosaicConfig, split: int, name: str,
           swizzled: bool = False, scaled: bool = False, padded: bool = False):
    pl, _ = pallas_mosaic_gpu()
    bn, nc = cfg.block_n, cfg.consumers
    rows = nc * bn  # weight rows per CTA (consumers > 1: warp-specialized, accumulate_tiles_ws)
    n_tiles = cdiv(n, rows)
    steps = split_steps(k, cfg.block_k, split, padded=padded)
    ks = steps * cfg.block_k  # K per split (K % 256 == 128: the last split runs past K)
    # whole-K scales (split == 1, s_gmem is whole_k_scale_view's) unless swizzled (s_gmem is
    # swizzled_tile_view's [E, Np/128, Kp/2, 256]: per-step tiles for any K)
    whole = k % BLOCK_K != 0 and not swizzled

    def nvfp4_moe_mosaic(be_gmem, nb_gmem, x_gmem, c_gmem, s_gmem, *rest):  # kernel name
        # rest: [alpha (scaled)], the output, [the consumers' output tiles (ws scratch)]
        a_gmem = rest[0] if scaled else None
        o_gmem = rest[1 if scaled else 0]
        ni = lax.axis_index("n")
        si = lax.axis_index("s")
        b = lax.axis_index("b")

        @pl.when(b < nb_gmem[0])
        def _():
            e = be_gmem[b]  # scalar load from GMEM (memref.load)
            n0 = ni * rows
            # scaled: the tile is stored as bf16(acc * alpha[e]) (alpha times POST_SCALE, exact;
            # split 1); loaded before the pipeline, so its latency hides behind the first copies
            scale = a_gmem[e] * jnp.float32(POST_SCALE) if scaled else None

            # swizzled scale tiles of the CTA: one [Kp/2, 256] tile, or nc of them (ws); at
            # block_n 64 the 128-row tile holding the CTA's rows, read s_off bytes on
            tiles = (ni // 2 if bn == 64 else ni) if nc == 1 else pl.ds(ni * nc, nc)
            s_off = (ni % 2) * 8 if swizzled and bn == 64 else None

            def sources():
                if swizzled and split == 1:  # whole rows (past K at K % 256 == 128: zeros)
                    return (c_gmem.at[e, pl.ds(n0, rows)], s_gmem.at[e, tiles],
                            x_gmem.at[pl.ds(b * mt, mt)])
                if padded and split == 1:  # whole rows; x is narrower than K (zeros past it)
                    return (c_gmem.at[e, pl.ds(n0, rows)], s_gmem.at[e, pl.ds(n0, rows)],
                            x_gmem.at[pl.ds(b * mt, mt)])
                if swizzled:  # the last split's range may run past K (dynamic start: zeros)
                    return (c_gmem.at[e, pl.ds(n0, rows), pl.ds(si * (ks // 2), ks // 2)],
                            s_gmem.at[e, tiles, pl.ds(si * (ks // 32), ks // 32)],
                            x_gmem.at[pl.ds(b * mt, mt), pl.ds(si * ks, ks)])
                if whole:
                    return (c_gmem.at[e, pl.ds(n0, bn)],
                            s_gmem.at[e, pl.ds(n0 // 2, whole_k_pair_rows(bn, k))],
                            x_gmem.at[pl.ds(b * mt, mt)])
                return (c_gmem.at[e, pl.ds(n0, rows), pl.ds(si * (ks // 2), ks // 2)],
                        s_gmem.at[e, pl.ds(n0, rows), pl.ds(si * (ks // 16), ks // 16)],
                        x_gmem.at[pl.ds(b * mt, mt), pl.ds(si * ks, ks)])

            accumulate_and_store(
                sources,
                lambda w: o_gmem.at[si, pl.ds(b * mt, mt), pl.ds(n0 + w * bn, bn)],
                cfg=cfg,
                m_tile=mt,
                steps=steps,
                scale=scale,
                tiles=rest[-1] if nc > 1 else None,
                whole_k=k if whole else None,
                swizzled=swizzled,
                s_off=s_off,
            )

    nvfp4_moe_mosaic.__name__ = f"nvfp4_moe_mosaic_{name}" if name else "nvfp4_moe_mosaic"
    out_dtype = jnp.bfloat16 if scaled else jnp.float32
    return mosaic_kernel(
        nvfp4_moe_mosaic,
        out_type=jax.ShapeDtypeStruct((split, nb * mt, n_tiles * rows), out_dtype),
        grid=(n_tiles, split, nb),
        grid_names=("n", "s", "b"),
        **ws_kernel_kw(cfg, mt, out_dtype),
    )


def _reference(xp, codes, scales, block_expert, num_blocks, *, mt, n_pad, split, padded=False):
    """XLA emulation of the kernel (same inputs, same output layout and 2^-7 factor; x as wide
    as the codes' K: ``grouped_matmul`` pads it for ``padded`` weights)."""
    from .. import formats as F

    nbm, k = xp.shape
    nb = nbm // mt
    e, n, _ = codes.shape
    lo, hi = codes & 0xF, codes >> 4
    c = jnp.stack([lo, hi], axis=-1).reshape(e, n, k)
    s = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
    w = F.e2m1_decode(c).astype(jnp.float32) * jnp.repeat(s, 16, axis=-1)  # exact
    perm = (np.arange(k) // 128 * 128) + np.tile(PERM, k // 128)
    w = w[..., perm]  # the fragment's K order (x is permuted the same way)
    wb = w[block_expert]  # [NB, N, K]
    xf = xp.astype(jnp.float32)
    kk = k
    if k % (split * 128) or padded:  # uneven splits (swizzled K % 256 == 128, or padded
        # weights): the kernel's split ranges, K padded with zeros to their end
        kk = split_steps(k, BLOCK_K, split, padded=padded) * BLOCK_K * split
        xf = jnp.pad(xf, ((0, 0), (0, kk - k)))
        wb = jnp.pad(wb, ((0, 0), (0, 0), (0, kk - k)))
    xb = xf.reshape(nb, mt, split, kk // split)
    wb = wb.reshape(nb, n, split, kk // split)
    part = jnp.einsum("bnsk,bmsk->sbmn", wb, xb, precision=lax.Precision.HIGHEST)
    part = part * jnp.float32(1.0 / POST_SCALE)
    valid = (jnp.arange(nb) < num_blocks[0])[None, :, None, None]
    part = jnp.where(valid, part, jnp.nan).reshape(split, nb * mt, n)  # skipped blocks: garbage
    return jnp.pad(part, ((0, 0), (0, 0), (0, n_pad - n)), constant_values=jnp.nan)


def grouped_matmul(
    x: jax.Array,
    codes: jax.Array,
    scales: jax.Array,
    block_expert: jax.Array,
    num_blocks: jax.Array,
    *,
    block_m: int,
    config: MosaicConfig | None = None,
    reference: bool = False,
    name: str = "",
    scale_layout: str = "linear",
    alpha: jax.Array | None = None,
) -> jax.Array:
    """Grouped ``x_b @ W[block_expert[b]]^T`` per block of ``block_m`` rows -> fp32 partials
    (or, with ``alpha``, the bf16 products).

    x: bf16 [NB*block_m, K], K-permuted (``gemm.mosaic.permute_k_order``). codes: uint8 [E, N, K/2]. scales:
    uint8 or float8_e4m3fn [E, N, K/16] (``scale_layout="linear"``) or [E, Np*Kp]
    (``"swizzled_128x4"``, flat per expert as ``NVFP4Array`` holds them; block_n 128, or 64
    with one warpgroup: each K step copies the 128-row tile's 2 KB of contiguous scales, and
    K % 256 == 128 needs no whole-K buffer).
    block_expert: int32 [NB] in [0, E).
    num_blocks: int32 [1]. Returns fp32 ``[split, NB*block_m, N_pad]`` (row ``b*block_m + m``:
    row m of block b, as x's rows): sum over axis 0, times
    ``POST_SCALE``, gives the accumulators; blocks ``b >= num_blocks`` and rows past N are
    garbage. K % 256 == 0, or K % 256 == 128 with N even (whole-K scales, split 1: the last
    K step runs half past the end, where TMA reads zeros). Zero-padded weights: codes
    [E, N, Kp/2] and scales for Kp = K rounded up to a multiple of 256 (``moe.pad_fc2``;
    K % 128 == 0): 128-byte aligned code rows, x's missing columns read as zeros, the Kp / 256
    steps split unevenly like K % 256 == 128's, in either scale layout. ``reference``: XLA
    emulation (any device), same layout. ``name``: suffix of the kernel's name (``nvfp4_moe_mosaic_<name>``:
    profiles tell FC1 from FC2).
    alpha: None, or fp32 [E]: the kernel multiplies each block's accumulator by
    ``alpha[block_expert[b]]`` and rounds to bf16 (nearest even) before storing; returns bf16
    ``[1, NB*block_m, N_pad]`` = bf16(alpha * acc), half the bytes of fp32 partials
    (TensorRT-LLM CUTLASS's bf16 GEMM outputs). Needs an unsplit K (split 1).
    Raises ValueError naming the argument for bad dtypes/shapes.
    """
    if block_m not in GROUPED_TOKEN_TILES:
        raise ValueError(f"block_m: expected one of {GROUPED_TOKEN_TILES}, got {block_m}")
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x: expected bfloat16 [NB*block_m, K], got {x.dtype} {x.shape}")
    nbm, k = x.shape
    if nbm % block_m or nbm == 0:
        raise ValueError(f"x: rows ({nbm}) must be a positive multiple of block_m={block_m}")
    nb = nbm // block_m
    if codes.ndim != 3 or codes.dtype != jnp.uint8:
        raise ValueError(f"codes: expected uint8 [E, N, K/2], got {codes.dtype} {codes.shape}")
    e, n, _ = codes.shape
    kc = codes.shape[2] * 2  # the weights' K: x's, or x's zero-padded to a multiple of 256
    padded = kc != k
    if padded and not (kc == padded_inter(k) and k % 128 == 0):
        raise ValueError(f"codes: expected shape {(e, n, k // 2)} for K={k} (or, zero-padded "
                         f"along K, {(e, n, padded_inter(k) // 2)}), got {codes.shape}")
    if scales.dtype not in (jnp.uint8, jnp.float8_e4m3fn):
        raise ValueError(f"scales: expected uint8 or float8_e4m3fn, got {scales.dtype}")
    if scale_layout not in ("linear", "swizzled_128x4"):
        raise ValueError(f"scale_layout: expected 'linear' or 'swizzled_128x4', got {scale_layout!r}")
    swizzled = scale_layout == "swizzled_128x4"
    if swizzled:
        view = swizzled_tile_view(scales, n, kc)  # validates the flat length
        if view.shape[0] != e:
            raise ValueError(f"scales: expected {e} experts, got shape {scales.shape}")
    elif scales.shape != (e, n, kc // 16):
        raise ValueError(f"scales: expected shape {(e, n, kc // 16)}, got {scales.shape}")
    if block_expert.shape != (nb,) or not jnp.issubdtype(block_expert.dtype, jnp.integer):
        raise ValueError(f"block_expert: expected int32 [{nb}], got {block_expert.dtype} {block_expert.shape}")
    if num_blocks.shape != (1,) or not jnp.issubdtype(num_blocks.dtype, jnp.integer):
        raise ValueError(f"num_blocks: expected int32 [1], got {num_blocks.dtype} {num_blocks.shape}")
    if config is not None and not isinstance(config, MosaicConfig):
        raise ValueError(f"config: expected a MosaicConfig, got {type(config).__name__}")
    check_supported(kc, n=n, name="codes")
    cfg = config or MosaicConfig(block_n=128, split_k=1, num_stages=2)
    if cfg.bf16_store:
        raise ValueError("config: MosaicConfig.bf16_store is the dense kernel's; the grouped "
                         "kernel stores bf16 products through MosaicMoEConfig.bf16_partials")
    split = check_config(cfg, kc, block_m, swizzled=swizzled, padded=padded)
    if alpha is not None:
        if alpha.shape != (e,) or alpha.dtype != jnp.float32:
            raise ValueError(f"alpha: expected float32 [{e}], got {alpha.dtype} {alpha.shape}")
        if split != 1:
            raise ValueError(f"config: alpha (bf16 output) needs split_k=1, got {cfg.split_k} "
                             f"(effective split {split})")
    if scales.dtype != jnp.uint8:
        scales = lax.bitcast_convert_type(scales, jnp.uint8)
    be = block_expert.astype(jnp.int32)
    nbk = num_blocks.astype(jnp.int32)
    n_pad = cdiv(n, cfg.block_n * cfg.consumers) * cfg.block_n * cfg.consumers
    if reference:
        lin = unswizzle(scales, n, kc // 16, scale_layout) if swizzled else scales
        xk = jnp.pad(x, ((0, 0), (0, kc - k)))  # padded weights: x's missing columns are zeros
        part = _reference(xk, codes, lin, be, nbk, mt=block_m, n_pad=n_pad, split=split,
                          padded=padded)
        if alpha is None:
            return part
        a = jnp.repeat(alpha[be] * jnp.float32(POST_SCALE), block_m)[None, :, None]
        return (part * a).astype(jnp.bfloat16)
    if swizzled:
        scales = swizzled_tile_view(scales, n, kc)
    elif kc % BLOCK_K:  # whole-K scales: the kernel reads the pair-of-rows view
        scales = whole_k_scale_view(scales)
    operands = (be, nbk, x, codes, scales) + (() if alpha is None else (alpha,))
    return _build(block_m, nb, n, kc, cfg, split, name, swizzled, scaled=alpha is not None,
                  padded=padded)(*operands)


def _reads_swizzled(w: NVFP4Array, cfg: MosaicConfig) -> bool:
    """Whether the grouped kernel reads ``w``'s scales as they are, swizzled_128x4 (per-step
    2 KB tiles; block_n 128, or 64 with one warpgroup: each CTA half of a 128-row tile),
    rather than converted to linear."""
    return w.layout == "swizzled_128x4" and reads_swizzled_scales(cfg)


def _block_rows(part: jax.Array, n: int) -> jax.Array:
    """fp32 partials [split, NB*mt, N_pad] -> accumulators [NB*mt, N] (times POST_SCALE)."""
    return part.sum(axis=0)[:, :n] if part.shape[0] > 1 else part[0, :, :n]


# ----------------------------------------------------------------------------- MoE layer


def mosaic_plan(k1: int, k2: int, *, n1: int = 2, n2: int = 2) -> tuple[bool, bool]:
    """(FC1 on Mosaic, FC2 on Mosaic) for FC1's K = H, N = R and FC2's K = I, N = H: K a
    multiple of 256, or K % 256 == 128 with whole-K scales (``supported``)."""
    return supported(k1, n1), supported(k2, n2)


def moe_mosaic(
    hidden: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    fc1: NVFP4Array,
    fc2: NVFP4Array,
    fc1_input_scale: jax.Array,
    fc2_input_scale: jax.Array,
    *,
    activation: str,
    gate_up_order: str,
    mode: str,
    activation_scale: str,
    config: MosaicMoEConfig | None = None,
    reference: bool = False,
    return_intermediates: bool = False,
    residual: jax.Array | None = None,
    scale_stacks: tuple | None = None,
    layer: jax.Array | None = None,
):
    """Routed MoE with Mosaic GPU grouped GEMMs -> bf16 [T, H] (+ per-route ``h`` [T*k, I]).

    Same arguments and semantics as ``pallas_triton.moe_pallas`` (validated by
    ``nvfp4_jax.moe``); needs H % 256 == 0 (FC1's K). FC2 runs on Pallas-Triton when I is not
    a multiple of 256 and not 128 mod 256 (logged). fc2 may be zero-padded along K
    (``pad_fc2``): the grouped kernel reads its aligned rows as they are. ``reference=True``: the Mosaic kernels are
    replaced by their XLA emulation and the Pallas-Triton ones run in interpret mode (CPU tests).
    ``residual``: None, or bf16 [T, H]: returns ``residual + out`` (bf16, the bits of XLA's add
    of two bf16 arrays), added in the combine launch where FC2 runs on Mosaic, in XLA
    (``xla.add_residual``) after the Pallas-Triton FC2's top-k sum otherwise.
    ``scale_stacks``, ``layer``: None, or together (inside a loop over stacked layers): the
    stacks fp32 [L, E] of (fc1 decode_scale, fc2 decode_scale, fc1_input_scale,
    fc2_input_scale) that this layer's scales are row ``layer`` (int32 scalar) of; the scale
    launch reads them in place (``scales.scales_plan``) instead of a fusion packing the
    layer's slices (a launch each layer).
    """
    if (scale_stacks is None) != (layer is None):
        raise ValueError("scale_stacks, layer: pass both or neither")
    t, k = topk_ids.shape
    e, r, h_dim = fc1.shape
    inter = intermediate_size(r, activation)
    k2 = fc2.shape[2]  # inter, or zero-padded to a multiple of 256 (``pad_fc2``)
    n_routes = t * k
    on1, on2 = mosaic_plan(h_dim, inter, n1=r, n2=h_dim)
    if k2 != inter:
        # padded weights need no whole-K scales; the FC1 epilogue writes 128-column tiles
        on2 = inter % 128 == 0
        if not on2:
            fc2 = unpad_fc2(fc2, inter)
            k2 = inter
    if not on1:
        check_supported(h_dim, n=r, name="fc1")
    auto = config is None
    if auto:
        config = auto_config(n_routes, e, hidden=h_dim, rows1=r, inter=inter, fc2_padded=k2 != inter,
                             sm12x=is_sm12x())
    if not isinstance(config, MosaicMoEConfig):
        raise ValueError(f"config: expected a MosaicMoEConfig, got {type(config).__name__}")  # noqa: TRY004

    def fit(cfg: MosaicConfig, w: NVFP4Array, k_dim: int, name: str) -> MosaicConfig:
        """An auto-picked warp-specialized config that these weights cannot run (linear scales
        with K % 256 == 128: the whole-K buffer has no warp-specialized form) runs with one
        warpgroup instead, logged; a config the caller passed is checked as given."""
        if not auto or cfg.consumers == 1 or k_dim % BLOCK_K == 0 or _reads_swizzled(w, cfg):
            return cfg
        log.info("nvfp4_jax.moe: %s: %s scales with K=%d have no warp-specialized kernel; one "
                 "compute warpgroup (consumers=1) instead of %d", name, w.layout, k_dim, cfg.consumers)
        return dataclasses.replace(cfg, consumers=1)

    cfg1 = fit(config.fc1, fc1, h_dim, "fc1")
    cfg2 = fit(config.fc2, fc2, k2, "fc2") if on2 else config.fc2
    bm = config.block_m
    if is_sm12x():  # the grouped GEMMs' SM 12.x form (mma.sync, 99 KB of shared memory)
        whole1 = None if h_dim % BLOCK_K == 0 or _reads_swizzled(fc1, cfg1) else h_dim
        whole2 = None if k2 % BLOCK_K == 0 or _reads_swizzled(fc2, cfg2) else k2
        cfg1, cfg2 = for_sm12x(cfg1, bm, whole1), for_sm12x(cfg2, bm, whole2)
        log.info("nvfp4_jax.moe: SM 12.x: grouped GEMMs on mma.sync (fc1 %s, fc2 %s)", cfg1, cfg2)
    if not on2:
        if bm < 16:
            raise ValueError(f"config: block_m={bm}; FC2 runs on Pallas-Triton (I={inter} is not a "
                             f"multiple of {BLOCK_K}), which needs block_m >= 16")
        tcfg = config.fc2_triton or triton_default_config(
            n_routes, e, inter=inter, hidden=h_dim, gated=activation == "swiglu").fc2
        tcfg = dataclasses.replace(tcfg, block_m=bm, decode="bits" if reference else tcfg.decode)
        log.info("nvfp4_jax.moe: mosaic FC1, Pallas-Triton FC2 (I=%d, H=%d: no TMA descriptor "
                 "for %d-byte scale rows)", inter, h_dim, inter // 16)
    recipe = recipe_of(mode)

    scale_args = (fc1.decode_scale, fc2.decode_scale, fc1_input_scale, fc2_input_scale)
    if scale_stacks is not None:
        scale_args = tuple(scale_stacks)
    scale_spec = (*scale_args, mode, activation_scale)  # the scale kernels' ``scales``
    sv = None  # (g1, 1/g1, alpha1, g2, 1/g2, alpha2)
    xp = None  # the FC1 operand, when the routing kernel writes it too ("fused")
    if config.routing != "xla" and routing_kernel_fits(
            n_routes, e, bm, top_k=None if config.routing == "fused" else topk_ids.shape[1]):
        if config.routing == "fused":  # routing, scales and the FC1 operand in one launch
            br, sv, xp = routing_operand_kernel(topk_ids, hidden, e, bm, scale_spec, recipe=recipe,
                                                interpret=reference, layer=layer)
        else:  # the routing and the scales in one launch
            br, sv = routing_kernel(topk_ids, e, bm, scales=scale_spec, interpret=reference,
                                    layer=layer)
    else:
        if config.routing != "xla":
            log.info("nvfp4_jax.moe: routing kernel does not fit %d routes x %d experts; XLA "
                     "routing%s", n_routes, e, " and a separate FC1 operand kernel"
                     if config.routing == "fused" else "")
        br = block_routing(topk_ids, e, bm)
    if sv is None:
        sv = moe_scales_kernel(*scale_args, num_experts=e, mode=mode,
                               activation_scale=activation_scale, interpret=reference, layer=layer)
    g1, rg1, a1, g2, rg2, a2 = sv
    em = br.sorted_route.shape[0]
    assert em // bm == max_blocks(n_routes, e, bm)
    meta = (br.block_expert, br.num_blocks)

    def scales_u8(w: NVFP4Array, cfg: MosaicConfig, name: str):
        """(uint8 scales, their layout) as the grouped kernel reads them: swizzled_128x4
        directly (``_reads_swizzled``), anything else as linear scales."""
        if _reads_swizzled(w, cfg):
            return lax.bitcast_convert_type(w.scales, jnp.uint8), "swizzled_128x4"
        if w.layout != "linear":
            log.warning("nvfp4_jax.moe: %s scales in layout %s are converted to linear on every "
                        "call (the Mosaic kernel reads linear, or swizzled_128x4 at block_n 128 "
                        "and at 64 with one compute warpgroup)",
                        name, w.layout)
        return lax.bitcast_convert_type(w.linear_scales(), jnp.uint8), "linear"

    s1u, lay1 = scales_u8(fc1, cfg1, "fc1")

    def products(alpha: jax.Array, cfg: MosaicConfig, k_dim: int, lay: str, name: str,
                 padded: bool = False):
        """alpha for a GEMM that stores bf16(alpha * acc) (``bf16_partials``), else None."""
        if not config.bf16_partials:
            return None
        if mode != "trtllm_cutlass":
            log.info("nvfp4_jax.moe: bf16_partials ignored in mode %s (fp32 partials)", mode)
            return None
        split = check_config(cfg, k_dim, bm, swizzled=lay == "swizzled_128x4", padded=padded)
        if split != 1:
            log.info("nvfp4_jax.moe: bf16_partials: %s runs split-K (%d), fp32 partials", name, split)
            return None
        return alpha.astype(jnp.float32)

    # FC1 operand (gather + quantize + K permutation, one Pallas-Triton launch), FC1 (Mosaic)
    if xp is None:
        per_expert = activation_scale == "per_expert"
        src, pre = hidden, False
        if config.token_quant and per_expert:
            log.info("nvfp4_jax.moe: token_quant ignored with per-expert activation scales "
                     "(each route is quantized with its expert's scale)")
        elif config.token_quant:  # quantize T token rows once, then gather the routed rows
            src = token_operand(hidden, g1, rg1, recipe=recipe, interpret=reference,
                                wide=config.wide_glue)
            pre = True
        xp = fc1_operand(src, br.sorted_route, *meta, g1, rg1, top_k=k, block_m=bm,
                         recipe=recipe, per_expert=per_expert,
                         skip_padding=config.skip_padding, interpret=reference,
                         wide=config.wide_glue, prequantized=pre, num_tokens=hidden.shape[0])
    part1 = grouped_matmul(xp, fc1.codes, s1u, *meta, block_m=bm, config=cfg1,
                           reference=reference, name="fc1", scale_layout=lay1,
                           alpha=products(a1, cfg1, h_dim, lay1, "fc1") if on2 else None)
    if on2:
        # FC1 epilogue (alpha, bf16, activation, requantization, K permutation), FC2 (Mosaic),
        # combine (alpha2, bf16, router weight, top-k sum, residual): one launch each
        if config.epilogue == "routes":  # one program per route: only routed rows, unmasked
            skip = {"route_pos": br.route_pos, "route_expert": topk_ids.reshape(-1)}
        elif config.skip_padding:
            skip = {"sorted_route": br.sorted_route, "n_routes": n_routes}
        else:
            skip = {}
        hvp, hb = fc1_epilogue(part1, *meta, a1, g2, rg2, inter=inter, **skip,
                               activation=activation, gate_up_order=gate_up_order, mode=mode,
                               recipe=recipe, return_h=return_intermediates, interpret=reference)
        s2u, lay2 = scales_u8(fc2, cfg2, "fc2")
        part2 = grouped_matmul(hvp, fc2.codes, s2u, *meta, block_m=bm, config=cfg2,
                               reference=reference, name="fc2", scale_layout=lay2,
                               alpha=products(a2, cfg2, k2, lay2, "fc2", padded=k2 != inter))
        out = combine(part2, br.route_pos, topk_ids, topk_weights, a2, hidden=h_dim,
                      mode=mode, interpret=reference, wide=config.wide_glue, residual=residual)
    else:
        # FC2 on Pallas-Triton (I % 128 != 0): the FC1 epilogue in XLA (the functions of xla.py)
        _, wt, row_expert = sorted_rows(hidden, topk_weights, g1, br.sorted_route,
                                        br.block_expert, top_k=k, block_m=bm, recipe=recipe,
                                        activation_scale=activation_scale)
        u = _block_rows(part1, r) * (a1[row_expert] * jnp.float32(POST_SCALE))[:, None]
        if mode == "trtllm_cutlass":  # GEMM1 output buffer is bf16 in TRT-LLM CUTLASS
            u = bf16_round(u)
        hf = bf16_round(activate(u, activation, gate_up_order))  # bf16 values of h, in fp32
        hb = hf.astype(jnp.bfloat16)  # [EM, I], exact
        hv = quantized_values(hf, g2[row_expert], recipe)  # q * sf, bf16 (exact)
        contrib = fc2_triton(meta + (br.block_expert,), hv[:, 0::2], hv[:, 1::2], fc2, a2, wt, cfg=tcfg, em=em,
                             h_dim=h_dim, inter=inter, mode=mode, interpret=reference)
        out = contrib[br.route_pos].reshape(t, k, h_dim).sum(axis=1).astype(jnp.bfloat16)
        if residual is not None:  # no combine launch here: XLA's bf16 add
            out = add_residual(residual, out)
    if return_intermediates:
        return out, {"h": hb[br.route_pos]}
    return out
