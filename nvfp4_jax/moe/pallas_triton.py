"""Routed NVFP4 MoE as two Pallas-Triton grouped GEMMs (NVIDIA GPUs from sm_89, SM12x included).

Dataflow (shapes: T tokens, k routes each, N = T*k, E experts, H hidden, I intermediate,
R = I or 2I, EM = BM * max_blocks sorted rows, see routing.py):

0. Pallas-Triton: the encode scales and alphas (``scales.moe_scales_kernel``, one program).
1. XLA: ``block_routing`` (routes sorted by expert, padded to BM-row blocks, one expert per
   block). Pallas-Triton (``epilogue.fc1_operand`` in K order, ``div.rn.f32``): the FC1 input
   quantized with the mode's recipe as ``q * sf`` bf16 values (exact) in sorted order; XLA
   splits it into even/odd K columns ``x_even, x_odd [EM, H/2]``.
2. ``_fc1_kernel``, 1-D grid of ``NB * cdiv(I, BN)`` programs, output tiles fastest
   (``_block_and_tile``): program (b, n) exits at once when
   ``b >= num_blocks``; else expert ``e = block_expert[b]``, swap-AB accumulators
   ``[BN, BM]`` over K = H: weight codes ``[BN, BK/16, 8]`` + E4M3 scales are decoded in
   registers (``gemm/decode.py``; the products e2m1*e4m3 are exact bf16) and multiplied with
   the even/odd activation halves (bf16 MMA, fp32 accumulate). For swiglu the program holds
   both the up and the gate tile of the same output columns. Epilogue, all in registers:
   ``* alpha1[e]`` (-> bf16 in trtllm_cutlass), activation in fp32, -> bf16 (``h``),
   requantization of ``h`` with the mode's recipe and ``G2[e]`` (16-column blocks of the
   tile), store ``q * sf`` as even/odd bf16 ``[EM, I/2]`` (the FC2 operand layout).
3. ``_fc2_kernel``, ``NB * cdiv(H, BN)`` programs ordered the same way: the same grouped
   GEMM over K = I, epilogue ``* alpha2[e]`` (-> bf16 in trtllm_cutlass) ``* router_weight``
   (fp32), store fp32 ``[EM, H]`` rows.
4. XLA: gather each route's row, sum over the k routes in fp32, cast to bf16.

On sm_90 ``moe(backend="auto")`` picks ``mosaic.moe_mosaic`` up to ``mosaic.MAX_ROUTES`` routed
rows instead (``api.choose_backend``); it borrows :func:`fc2_triton` where its own FC2 cannot run.

Each block reads its expert's weights once; its activation rows are read from HBM once and
then from L2 by its other output tiles, and consecutive blocks of one expert find the expert's
weight tiles in L2. Divisions in the requantization use ``div.rn.f32`` (IEEE, inline PTX) on
the GPU: Triton lowers ``/`` to the approximate ``div.full.f32``, which would flip FP4 codes
at ties.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..gemm import decode as gemm_decode
from ..gemm.decode import decode_block
from ..gemm.fp4mma import dot_scaled
from ..quantize import NVFP4Array
from ..triton_ops import bf16_rne, cdiv, fc1_activation, quantize_codes, requantize
from .configs import Config, MoEConfig, default_config
from .operand import fc1_operand
from .routing import block_routing
from .scales import moe_scales_kernel
from .weights import intermediate_size, unpad_fc2
from .xla import recipe_of

log = logging.getLogger(__name__)

_DIMS = (((1,), (1,)), ((), ()))


def _grouped_tiles(xe_ref, xo_ref, c_ref, s_ref, e, m0, row0s, n_valid, K: int, cfg: Config):
    """sum_k W[e, row0 + i, k] * x[m0 + j, k] for each row0 in row0s -> list of fp32 [BN, BM]."""
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    BKB, BK2 = BK // 16, BK // 2
    KB = K // 16
    n_mask = jnp.arange(BN) < n_valid

    def body(i, accs):
        kb0 = i * BKB
        kb_mask = (kb0 + jnp.arange(BKB)) < KB
        x_mask = ((kb0 * 8 + jnp.arange(BK2)) < K // 2)[None, :]
        xe = plgpu.load(xe_ref.at[pl.ds(m0, BM), pl.ds(kb0 * 8, BK2)], mask=x_mask, other=0)
        xo = plgpu.load(xo_ref.at[pl.ds(m0, BM), pl.ds(kb0 * 8, BK2)], mask=x_mask, other=0)
        w_mask = n_mask[:, None] & kb_mask[None, :]
        out = []
        for acc, row0 in zip(accs, row0s):
            if cfg.load2d:  # one [BN, BK/2] tile: wider vector loads (-28 % in the dense GEMM)
                codes = plgpu.load(c_ref.at[e, pl.ds(row0, BN), pl.ds(kb0 * 8, BK2)],
                                   mask=n_mask[:, None] & x_mask, other=0).reshape(BN, BKB, 8)
            else:
                codes = plgpu.load(c_ref.at[e, pl.ds(row0, BN), pl.ds(kb0, BKB), :],
                                   mask=w_mask[:, :, None], other=0)
            scales = lax.bitcast_convert_type(  # uint8 bytes: a masked f8 load cannot take other=0
                plgpu.load(s_ref.at[e, pl.ds(row0, BN), pl.ds(kb0, BKB)], mask=w_mask, other=0),
                jnp.float8_e4m3fn)
            w_even, w_odd = decode_block(codes, scales, cfg.decode)[:2]
            acc = acc + lax.dot_general(w_even.reshape(BN, BK2), xe, _DIMS,
                                        preferred_element_type=jnp.float32)
            acc = acc + lax.dot_general(w_odd.reshape(BN, BK2), xo, _DIMS,
                                        preferred_element_type=jnp.float32)
            out.append(acc)
        return tuple(out)

    zero = tuple(jnp.zeros((BN, BM), jnp.float32) for _ in row0s)
    accs = lax.fori_loop(0, cdiv(K, BK), body, zero)
    post = _post_scale(cfg.decode)
    return tuple(a * post for a in accs) if post != 1.0 else accs


def _grouped_tiles_fp4(xc_ref, xs_ref, c_ref, s_ref, e, m0, row0s, n_valid, K: int, cfg: Config):
    """:func:`_grouped_tiles` on the FP4 MMA: the activation rows as NVFP4 codes [EM, K/2] +
    E4M3 scale bytes [EM, K/16], each step one ``fp4mma.dot_scaled`` per weight tile (the block
    scales stay in the MMA). Rows whose activation holds a NaN scale byte (a block that held
    NaN/Inf) come back NaN, whatever the tensor core makes of that byte."""
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    BK2, BKS = BK // 2, BK // 16
    K2, KS = K // 2, K // 16
    n_mask = jnp.arange(BN) < n_valid

    def body(i, carry):
        accs, nan_rows = carry
        k2_live = (i * BK2 + jnp.arange(BK2)) < K2
        ks_live = (i * BKS + jnp.arange(BKS)) < KS
        xc = plgpu.load(xc_ref.at[pl.ds(m0, BM), pl.ds(i * BK2, BK2)], mask=k2_live[None, :],
                        other=0)
        xs = plgpu.load(xs_ref.at[pl.ds(m0, BM), pl.ds(i * BKS, BKS)], mask=ks_live[None, :],
                        other=0)
        nan_rows = jnp.maximum(nan_rows, xs.astype(jnp.int32) & 0x7F)  # 0x7F iff a NaN byte
        out = []
        for acc, row0 in zip(accs, row0s):
            wc = plgpu.load(c_ref.at[e, pl.ds(row0, BN), pl.ds(i * BK2, BK2)],
                            mask=n_mask[:, None] & k2_live[None, :], other=0)
            ws = plgpu.load(s_ref.at[e, pl.ds(row0, BN), pl.ds(i * BKS, BKS)],
                            mask=n_mask[:, None] & ks_live[None, :], other=0)
            out.append(dot_scaled(acc, wc, ws, xc, xs))
        return tuple(out), nan_rows

    zero = tuple(jnp.zeros((BN, BM), jnp.float32) for _ in row0s)
    accs, smax = lax.fori_loop(0, cdiv(K, BK), body, (zero, jnp.zeros((BM, BKS), jnp.int32)))
    nan_rows = jnp.max(smax, axis=1) == 0x7F
    return tuple(jnp.where(nan_rows[None, :], jnp.nan, a) for a in accs)


def _post_scale(decode: str) -> float:
    """Power of two the decode leaves out of the bf16 weights (exact; gemm/decode.py)."""
    return float(gemm_decode.post_scale(decode, jnp.bfloat16))


def _block_and_tile(n_tiles: int):
    """(row block b, output tile n) of this program on the 1-D grid, output tiles fastest.

    Programs that run at the same time then share their row block (its activation rows stay in
    L2 across the block's output tiles) and a few adjacent blocks of one expert share its weight
    tiles. With the row blocks fastest, every output tile would re-read all activation rows
    from HBM: at T = 4096 (nemotron) about 11 GB per GEMM against 0.8 GB of weights.
    """
    pid = pl.program_id(0)
    return pid // n_tiles, pid % n_tiles


def _fc1_kernel(be_ref, nb_ref, bw_ref, xe_ref, xo_ref, c_ref, s_ref, a1_ref, g2_ref, rg2_ref,
                he_ref, ho_ref, *h_ref, cfg: Config, H: int, I: int, activation: str,
                gate_up_order: str, mode: str, exact_asm: bool, fp4: bool = False):
    """fp4: (xe, xo) are the NVFP4 operand (codes, scale bytes) and (he, ho) receive FC2's
    (codes [EM, I/2], scale bytes [EM, I/16]); else even/odd bf16 ``q * sf`` halves.
    be_ref: each block's expert (its alphas and scales); bw_ref: its weights' index in the
    codes and scales (``layer * E +`` the expert for a stack of layers, else the expert)."""
    BM, BN = cfg.block_m, cfg.block_n
    b, n = _block_and_tile(cdiv(I, BN))
    grouped_tiles = _grouped_tiles_fp4 if fp4 else _grouped_tiles

    @pl.when(b < nb_ref[0])
    def _():
        e, ew = be_ref[b], bw_ref[b]
        m0, n0 = b * BM, n * BN
        n_valid = I - n0
        if activation == "swiglu":
            first, second = grouped_tiles(xe_ref, xo_ref, c_ref, s_ref, ew, m0, (n0, I + n0),
                                          n_valid, H, cfg)
        else:
            (first,) = grouped_tiles(xe_ref, xo_ref, c_ref, s_ref, ew, m0, (n0,), n_valid, H,
                                     cfg)
        h = fc1_activation(first, second if activation == "swiglu" else None, a1_ref[e],
                           activation=activation, gate_up_order=gate_up_order, mode=mode,
                           exact_asm=exact_asm)
        col_mask = (n0 + jnp.arange(BN)) < I
        if h_ref:
            plgpu.store(h_ref[0].at[pl.ds(m0, BM), pl.ds(n0, BN)], h.T, mask=col_mask[None, :])
        hb = h.T.astype(jnp.float32).reshape(BM, BN // 16, 16)
        if fp4:  # FC2's NVFP4 operand: the same requantization, as codes and scale bytes
            codes, sb = quantize_codes(hb, g2_ref[e], rg2_ref[e], recipe_of(mode), exact_asm)
            plgpu.store(he_ref.at[pl.ds(m0, BM), pl.ds(n0 // 2, BN // 2)],
                        codes.reshape(BM, BN // 2),
                        mask=((n0 // 2 + jnp.arange(BN // 2)) < I // 2)[None, :])
            plgpu.store(ho_ref.at[pl.ds(m0, BM), pl.ds(n0 // 16, BN // 16)], sb,
                        mask=((n0 // 16 + jnp.arange(BN // 16)) < I // 16)[None, :])
            return
        q = requantize(hb, g2_ref[e], rg2_ref[e], recipe_of(mode), exact_asm)
        ev, od = jnp.split(q.reshape(BM, BN // 2, 2), 2, axis=-1)
        half_mask = ((n0 // 2 + jnp.arange(BN // 2)) < I // 2)[None, :]
        plgpu.store(he_ref.at[pl.ds(m0, BM), pl.ds(n0 // 2, BN // 2)],
                    ev.reshape(BM, BN // 2).astype(jnp.bfloat16), mask=half_mask)
        plgpu.store(ho_ref.at[pl.ds(m0, BM), pl.ds(n0 // 2, BN // 2)],
                    od.reshape(BM, BN // 2).astype(jnp.bfloat16), mask=half_mask)


def _fc2_kernel(be_ref, nb_ref, bw_ref, xe_ref, xo_ref, c_ref, s_ref, a2_ref, w_ref, o_ref, *,
                cfg: Config, H: int, I: int, mode: str, exact_asm: bool, fp4: bool = False):
    BM, BN = cfg.block_m, cfg.block_n
    b, n = _block_and_tile(cdiv(H, BN))
    grouped_tiles = _grouped_tiles_fp4 if fp4 else _grouped_tiles

    @pl.when(b < nb_ref[0])
    def _():
        e = be_ref[b]
        m0, n0 = b * BM, n * BN
        (acc,) = grouped_tiles(xe_ref, xo_ref, c_ref, s_ref, bw_ref[b], m0, (n0,), H - n0, I,
                               cfg)
        d = acc * a2_ref[e]
        if mode == "trtllm_cutlass":  # GEMM2 output is bf16 in TRT-LLM CUTLASS
            d = bf16_rne(d, exact_asm)
        wt = w_ref[pl.ds(m0, BM)]
        contrib = d * wt[None, :]
        col_mask = (n0 + jnp.arange(BN)) < H
        plgpu.store(o_ref.at[pl.ds(m0, BM), pl.ds(n0, BN)], contrib.T, mask=col_mask[None, :])


def fc2_triton(meta, he, ho, fc2: NVFP4Array, a2, wt, *, cfg: Config, em: int, h_dim: int,
               inter: int, mode: str, interpret: bool, fp4: bool = False) -> jax.Array:
    """Pallas-Triton grouped FC2 (+ alpha2, bf16 in trtllm_cutlass, router weight) -> fp32 [EM, H].

    meta: (block_expert [NB], num_blocks [1], block_weight [NB]: each block's index into the
    fc2 codes and scales, see :func:`_fc1_kernel`); fc2: [E, H, I], or a stack of layers
    [L, E, H, I]; he/ho: even/odd K columns of the FC2 operand
    (``q * sf`` bf16 [EM, I/2]), or with ``fp4`` its codes uint8 [EM, I/2] and E4M3 scale
    bytes uint8 [EM, I/16] (FP4 MMA); wt: fp32 router weight per sorted row [EM]."""
    codes, scales = _stack(fc2, cfg, fp4)
    return pl.pallas_call(
        functools.partial(_fc2_kernel, cfg=cfg, H=h_dim, I=inter, mode=mode,
                          exact_asm=not interpret, fp4=fp4),
        out_shape=jax.ShapeDtypeStruct((em, h_dim), jnp.float32),
        grid=(em // cfg.block_m * cdiv(h_dim, cfg.block_n),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nvfp4_moe_fc2",
    )(*meta, he, ho, codes, scales, a2, wt)


def _stack(w: NVFP4Array, cfg: Config, fp4: bool = False):
    """Codes and scale bytes of [E, N, K] experts (or [L, E, N, K]: flattened to L * E)."""
    flat = cfg.load2d or fp4  # the FP4 MMA takes [BN, BK/2] code tiles
    n, k = w.shape[-2:]
    codes = w.codes.reshape(-1, n, k // 2) if flat else w.codes.reshape(-1, n, k // 16, 8)
    scales = w.linear_scales().reshape(-1, n, k // 16)
    return codes, lax.bitcast_convert_type(scales, jnp.uint8)


def moe_pallas(
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
    config: MoEConfig | None = None,
    interpret: bool = False,
    return_intermediates: bool = False,
    layer: jax.Array | None = None,
    input_scale_stacks: tuple | None = None,
):
    """Pallas-Triton MoE -> bf16 [T, H] (and per-route ``h`` [T*k, I] with ``return_intermediates``).

    Arguments as :func:`nvfp4_jax.moe` (validated there); fc1/fc2 scales in the linear layout.
    ``config``: ``MoEConfig`` (tiles) or None (``configs.default_config``). ``interpret``:
    Pallas interpret mode (CPU). ``layer``: None, or an int32 scalar with fc1/fc2 stacks of
    layers [L, E, ...] (linear scales, unpadded fc2): the kernels read layer ``layer``'s
    experts in place; routing, scales and tiles are the layer's (E experts).
    ``input_scale_stacks``: None, or with ``layer`` the stacks fp32 [L, E] that
    fc1/fc2_input_scale are row ``layer`` of: the scale launch then reads the four scale
    vectors in place (the stacks' decode scales too) instead of per-layer slices, which XLA
    would copy into it.
    """
    if input_scale_stacks is not None and layer is None:
        raise ValueError("input_scale_stacks: needs layer (the stacks' row)")
    t, k = topk_ids.shape
    e, r, h_dim = fc1.shape[-3:]
    inter = intermediate_size(r, activation)
    n_routes = t * k
    if layer is None:
        fc2 = unpad_fc2(fc2, inter)  # these kernels read K = I (a padded stack is sliced, logged)
    if config is None:
        config = default_config(n_routes, e, inter=inter, hidden=h_dim, gated=activation == "swiglu")
        if interpret:
            config = config.with_decode("bits")
    c1, c2 = config.fc1, config.fc2
    bm = c1.block_m
    fp4 = config.resolved_mma() == "fp4"
    if fp4 and min(c1.block_k, c2.block_k) < 64:  # (an explicit "fp4" refuses these tiles)
        log.info("nvfp4_jax.moe: MoEConfig.mma None with block_k %d/%d < 64 (the FP4 MMA's K): "
                 "bf16 MMA", c1.block_k, c2.block_k)
        fp4 = False
    if fp4:
        log.info("nvfp4_jax.moe: pallas grouped GEMMs on the FP4 MMA (MoEConfig.mma %r%s)",
                 config.mma, ", interpret mode" if interpret else "")
    exact_asm = not interpret
    recipe = recipe_of(mode)

    # the encode scales, alphas and 1/G2 (the trtllm recipe's) from one launch with IEEE
    # divisions (in XLA they are 11-14 small fusions per layer)
    ds1, ds2 = fc1.decode_scale, fc2.decode_scale  # [E], or with layer the [L, E] stacks
    if input_scale_stacks is not None:  # all four stacks, read in place at the layer
        scale_ops, scale_layer = (ds1, ds2, *input_scale_stacks), layer
    elif layer is None:
        scale_ops, scale_layer = (ds1, ds2, fc1_input_scale, fc2_input_scale), None
    else:  # the decode scales' slices (copied into the launch) with the input scales given
        scale_ops, scale_layer = (ds1[layer], ds2[layer], fc1_input_scale, fc2_input_scale), None
    g1, rg1, a1, g2, rg2, a2 = moe_scales_kernel(
        *scale_ops, num_experts=e, mode=mode, activation_scale=activation_scale,
        interpret=interpret, layer=scale_layer)
    br = block_routing(topk_ids, e, bm)
    em = br.sorted_route.shape[0]
    nb = em // bm
    # the FC1 input quantized in one Pallas-Triton launch (div.rn.f32 whatever XLA's flags)
    xv = fc1_operand(hidden, br.sorted_route, br.block_expert, br.num_blocks, g1, rg1, top_k=k,
                     block_m=bm, recipe=recipe, per_expert=activation_scale == "per_expert",
                     interpret=interpret, permute=False, codes=fp4,
                     kernel_name="nvfp4_moe_fc1_input")
    valid = br.sorted_route < n_routes
    wt = jnp.where(valid, topk_weights.reshape(-1).astype(jnp.float32)[
        jnp.where(valid, br.sorted_route, 0)], 0.0)  # router weight per sorted row
    xe, xo = xv if fp4 else (xv[:, 0::2], xv[:, 1::2])  # fp4: (codes, scale bytes)

    c1c, c1s = _stack(fc1, c1, fp4)
    bw = br.block_expert if layer is None else br.block_expert + layer * e
    meta = (br.block_expert, br.num_blocks, bw)

    out1 = [jax.ShapeDtypeStruct((em, inter // 2), jnp.bfloat16)] * 2
    if fp4:
        out1 = [jax.ShapeDtypeStruct((em, inter // 2), jnp.uint8),
                jax.ShapeDtypeStruct((em, inter // 16), jnp.uint8)]
    if return_intermediates:
        out1.append(jax.ShapeDtypeStruct((em, inter), jnp.bfloat16))
    he_ho = pl.pallas_call(
        functools.partial(_fc1_kernel, cfg=c1, H=h_dim, I=inter, activation=activation,
                          gate_up_order=gate_up_order, mode=mode, exact_asm=exact_asm, fp4=fp4),
        out_shape=tuple(out1),
        grid=(nb * cdiv(inter, c1.block_n),),
        compiler_params=plgpu.CompilerParams(num_warps=c1.num_warps, num_stages=c1.num_stages),
        interpret=interpret,
        name="nvfp4_moe_fc1",
    )(*meta, xe, xo, c1c, c1s, a1, g2, rg2)
    he, ho = he_ho[0], he_ho[1]
    contrib = fc2_triton(meta, he, ho, fc2, a2, wt, cfg=c2, em=em, h_dim=h_dim, inter=inter,
                         mode=mode, interpret=interpret, fp4=fp4)
    out = contrib[br.route_pos].reshape(t, k, h_dim).sum(axis=1).astype(jnp.bfloat16)
    if return_intermediates:
        return out, {"h": he_ho[2][br.route_pos]}
    return out
