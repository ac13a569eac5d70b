"""Routed NVFP4 MoE as two Pallas-Triton grouped GEMMs (H200 now, SM12x later).

Dataflow (shapes: T tokens, k routes each, N = T*k, E experts, H hidden, I intermediate,
R = I or 2I, EM = BM * max_blocks sorted rows, see routing.py):

0. Pallas-Triton: the encode scales and alphas (``epilogue.moe_scales_kernel``, one program).
1. XLA: ``block_routing`` (routes sorted by expert, padded to BM-row blocks, one expert per
   block); FC1 input quantized with the mode's recipe as ``q * sf`` bf16 values (exact),
   gathered into sorted order and split into even/odd K columns ``x_even, x_odd [EM, H/2]``.
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

On sm_90 up to ``mosaic.MAX_ROUTES`` routed rows ``moe_pallas`` runs ``mosaic.moe_mosaic`` instead (``kernel="auto"``,
see ``choose_kernel``): Mosaic GPU grouped GEMMs, with the operand, epilogue and combine as
Pallas-Triton kernels of their own (``epilogue.py``).

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

from ..gemm import decode as _decode
from ..gemm.decode import decode_block
from ..quantize import NVFP4Array
from ..quantize import _div as _ieee_div
from .configs import Config, MoEConfig, default_config
from .routing import block_routing
from .weights import intermediate_size, unpad_fc2
from .xla import recipe_of, sorted_rows

log = logging.getLogger(__name__)

_FLT_MAX = 3.4028234663852886e38
_DIMS = (((1,), (1,)), ((), ()))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _div_rn(a, b, exact_asm: bool):
    """IEEE round-to-nearest fp32 division (Triton's ``/`` is approximate on NVIDIA GPUs)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    if not exact_asm:  # interpret mode: XLA would turn a division by a broadcast into a * (1/b)
        return _ieee_div(a, b)
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _e4m3(v):
    """fp32 v >= 0 -> nearest E4M3 value (RNE, subnormals down to 2^-9), saturating at 448.

    Integer/float arithmetic only (Pallas-Triton has no int->f8 cast and the f32->f8 cast's
    rounding is the backend's): the quantum at v's exponent (clamped to E4M3's minimum normal
    exponent -6) is 2^(e-3); y = v / quantum < 16 is exact and is rounded to an integer, ties
    to even, with integer ops (an ``(y + 2^23) - 2^23`` trick would be folded away by XLA in
    interpret mode).
    """
    v = jnp.minimum(v, 448.0)
    e = ((lax.bitcast_convert_type(v, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32) - 127
    q = jnp.maximum(e, -6) - 3
    quantum = lax.bitcast_convert_type(((q + 127) << 23).astype(jnp.uint32), jnp.float32)
    inv = lax.bitcast_convert_type(((127 - q) << 23).astype(jnp.uint32), jnp.float32)
    y = v * inv
    n = y.astype(jnp.int32)  # truncation; y >= 0
    frac = y - n.astype(jnp.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))
    return (n + up.astype(jnp.int32)).astype(jnp.float32) * quantum


def _e2m1_magnitude(a):
    """|y| -> nearest E2M1 magnitude, ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), saturating."""
    f = lambda c: c.astype(jnp.float32)
    half = f(a > 0.25) + f(a >= 0.75) + f(a > 1.25) + f(a >= 1.75)
    return 0.5 * half + f(a > 2.5) + f(a >= 3.5) + 2.0 * f(a > 5.0)


def _requantize(hb, g, rg, recipe: str, exact_asm: bool):
    """hb fp32 [BM, nb, 16] (bf16 values), encode scale g, rg = IEEE 1/g -> q*sf fp32 [BM, nb, 16].

    The recipes' fp32 op order (oracle.quantize): trtllm ``sf = vmax*(G*fp32(1/6))``,
    ``y = x * min(1/(sf8*(1/G)), FLT_MAX)``; b12x ``sf = (vmax*G)/6``, ``y = x / max(sf8/G, 1e-30)``.
    """
    vmax = jnp.max(jnp.abs(hb), axis=-1)
    if recipe == "trtllm":
        sf = jnp.where(vmax == 0, 0.0, vmax * (g * jnp.float32(1.0 / 6.0)))
        s = _e4m3(sf)
        out_scale = jnp.minimum(_div_rn(1.0, s * rg, exact_asm), _FLT_MAX)
        y = hb * out_scale[..., None]
    else:
        s = _e4m3(jnp.minimum(_div_rn(vmax * g, 6.0, exact_asm), 448.0))
        den = jnp.maximum(_div_rn(s, g, exact_asm), 1e-30)
        y = _div_rn(hb, jnp.broadcast_to(den[..., None], hb.shape), exact_asm)
    mag = _e2m1_magnitude(jnp.abs(y))
    # a block holding NaN/Inf dequantizes to NaN (docs/input-policy.md); the flag is reduced
    # from 0/1 values because a GPU max reduction may drop NaN
    nonfinite = jnp.max(jnp.where(jnp.abs(hb) <= _FLT_MAX, 0.0, 1.0), axis=-1)
    s = jnp.where(nonfinite > 0, jnp.nan, s)
    return jnp.where(y < 0, -mag, mag) * s[..., None]


def bf16_rne(v, exact_asm: bool):
    """fp32 -> nearest bf16 value, kept in fp32, inside a kernel: the convert pair on the GPU
    (Triton emits both conversions); ``lax.reduce_precision`` in interpret mode
    (``exact_asm`` False), where XLA's excess-precision simplifier may drop a convert pair."""
    if exact_asm:
        return v.astype(jnp.bfloat16).astype(jnp.float32)
    return lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)


def fc1_activation(first, second, alpha, *, activation: str, gate_up_order: str, mode: str,
                   exact_asm: bool = True):
    """FC1 epilogue in registers: accumulators fp32 [BN, BM] (the two halves' tiles for swiglu,
    ``second`` None for relu2) ``* alpha`` (-> bf16 in trtllm_cutlass), activation in fp32 ->
    ``h`` bf16 [BN, BM]. ``exact_asm`` False: interpret mode (see ``bf16_rne``). ``alpha``
    None: the accumulators are already bf16(alpha * acc) (trtllm_cutlass products stored by
    the GEMM, ``mosaic.grouped_matmul(alpha=...)``), in fp32."""

    def scaled(acc):
        if alpha is None:
            return acc
        u = acc * alpha
        if mode == "trtllm_cutlass":  # GEMM1 output buffer is bf16 in TRT-LLM CUTLASS
            u = bf16_rne(u, exact_asm)
        return u

    if activation == "relu2":
        r = jnp.maximum(scaled(first), 0.0)
        return (r * r).astype(jnp.bfloat16)
    up, gate = (first, second) if gate_up_order == "up_gate" else (second, first)
    up, gate = scaled(up), scaled(gate)
    return (gate / (1.0 + jnp.exp(-gate)) * up).astype(jnp.bfloat16)


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
            if cfg.load2d:  # one [BN, BK/2] tile: wider vector loads (gemm NOTES round 1: -28 %)
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
    accs = lax.fori_loop(0, _cdiv(K, BK), body, zero)
    post = _post_scale(cfg.decode)
    return tuple(a * post for a in accs) if post != 1.0 else accs


def _post_scale(decode: str) -> float:
    """Power of two the decode leaves out of the bf16 weights (exact; gemm/decode.py)."""
    fn = getattr(_decode, "post_scale", None)
    return float(fn(decode, jnp.bfloat16)) if fn is not None else 1.0


def _block_and_tile(n_tiles: int):
    """(row block b, output tile n) of this program on the 1-D grid, output tiles fastest.

    Programs that run at the same time then share their row block (its activation rows stay in
    L2 across the block's output tiles) and a few adjacent blocks of one expert share its weight
    tiles. With the row blocks fastest (the first version), every output tile re-read all
    activation rows from HBM: at T = 4096 (nemotron) about 11 GB per GEMM against 0.8 GB of
    weights (bench/NOTES-moe.md).
    """
    pid = pl.program_id(0)
    return pid // n_tiles, pid % n_tiles


def _fc1_kernel(be_ref, nb_ref, xe_ref, xo_ref, c_ref, s_ref, a1_ref, g2_ref, rg2_ref,
                he_ref, ho_ref, *h_ref, cfg: Config, H: int, I: int, activation: str,
                gate_up_order: str, mode: str, exact_asm: bool):
    BM, BN = cfg.block_m, cfg.block_n
    b, n = _block_and_tile(_cdiv(I, BN))

    @pl.when(b < nb_ref[0])
    def _():
        e = be_ref[b]
        m0, n0 = b * BM, n * BN
        n_valid = I - n0
        if activation == "swiglu":
            first, second = _grouped_tiles(xe_ref, xo_ref, c_ref, s_ref, e, m0, (n0, I + n0),
                                           n_valid, H, cfg)
        else:
            (first,) = _grouped_tiles(xe_ref, xo_ref, c_ref, s_ref, e, m0, (n0,), n_valid, H, cfg)
        h = fc1_activation(first, second if activation == "swiglu" else None, a1_ref[e],
                           activation=activation, gate_up_order=gate_up_order, mode=mode,
                           exact_asm=exact_asm)
        col_mask = (n0 + jnp.arange(BN)) < I
        if h_ref:
            plgpu.store(h_ref[0].at[pl.ds(m0, BM), pl.ds(n0, BN)], h.T, mask=col_mask[None, :])
        hb = h.T.astype(jnp.float32).reshape(BM, BN // 16, 16)
        q = _requantize(hb, g2_ref[e], rg2_ref[e], recipe_of(mode), exact_asm)
        ev, od = jnp.split(q.reshape(BM, BN // 2, 2), 2, axis=-1)
        half_mask = ((n0 // 2 + jnp.arange(BN // 2)) < I // 2)[None, :]
        plgpu.store(he_ref.at[pl.ds(m0, BM), pl.ds(n0 // 2, BN // 2)],
                    ev.reshape(BM, BN // 2).astype(jnp.bfloat16), mask=half_mask)
        plgpu.store(ho_ref.at[pl.ds(m0, BM), pl.ds(n0 // 2, BN // 2)],
                    od.reshape(BM, BN // 2).astype(jnp.bfloat16), mask=half_mask)


def _fc2_kernel(be_ref, nb_ref, xe_ref, xo_ref, c_ref, s_ref, a2_ref, w_ref, o_ref, *,
                cfg: Config, H: int, I: int, mode: str, exact_asm: bool):
    BM, BN = cfg.block_m, cfg.block_n
    b, n = _block_and_tile(_cdiv(H, BN))

    @pl.when(b < nb_ref[0])
    def _():
        e = be_ref[b]
        m0, n0 = b * BM, n * BN
        (acc,) = _grouped_tiles(xe_ref, xo_ref, c_ref, s_ref, e, m0, (n0,), H - n0, I, cfg)
        d = acc * a2_ref[e]
        if mode == "trtllm_cutlass":  # GEMM2 output is bf16 in TRT-LLM CUTLASS
            d = bf16_rne(d, exact_asm)
        wt = w_ref[pl.ds(m0, BM)]
        contrib = d * wt[None, :]
        col_mask = (n0 + jnp.arange(BN)) < H
        plgpu.store(o_ref.at[pl.ds(m0, BM), pl.ds(n0, BN)], contrib.T, mask=col_mask[None, :])


KERNELS = ("auto", "triton", "mosaic")


def _is_sm90() -> bool:
    from ..gemm.api import _gpu_compute_capability

    return _gpu_compute_capability() == 90


def choose_kernel(kernel: str, config, *, routes: int, hidden: int, interpret: bool) -> str:
    """"triton" or "mosaic" for ``moe_pallas`` (the choice of "auto" is logged).

    "auto": "mosaic" when ``config`` is None or a ``MosaicMoEConfig``, not interpreting, on an
    sm_90 GPU, with ``routes <= mosaic.MAX_ROUTES`` and H % 256 == 0; a ``MoEConfig`` (Pallas-
    Triton tiles) or anything else gives "triton". "mosaic" / "triton" are taken as asked
    ("mosaic" with ``interpret`` runs the kernels' XLA emulation, for CPU tests).
    """
    from . import mosaic as _mosaic

    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if kernel == "mosaic":
        if isinstance(config, MoEConfig):
            raise ValueError("config: kernel='mosaic' takes a MosaicMoEConfig (or None), got a "
                             "Pallas-Triton MoEConfig")
        _mosaic.check_supported(hidden, name="fc1")
        if not interpret and not _is_sm90():
            raise ValueError("kernel: 'mosaic' needs an sm_90 (Hopper) GPU (or interpret=True, "
                             "which runs the kernels' XLA emulation)")
        return "mosaic"
    if kernel == "triton":
        if isinstance(config, _mosaic.MosaicMoEConfig):
            raise ValueError("config: kernel='triton' takes a MoEConfig (or None), got a MosaicMoEConfig")
        return "triton"
    if isinstance(config, MoEConfig):
        why = "explicit Pallas-Triton MoEConfig"
    elif interpret:
        why = "interpret mode"
    elif not _is_sm90():
        why = "not an sm_90 GPU"
    elif routes > _mosaic.MAX_ROUTES:
        why = f"T*k = {routes} routes > mosaic.MAX_ROUTES = {_mosaic.MAX_ROUTES}"
    elif hidden % _mosaic.BLOCK_K:
        why = f"H = {hidden} is not a multiple of {_mosaic.BLOCK_K}"
    else:
        log.info("nvfp4_jax.moe: kernel auto -> mosaic (sm_90, %d routes <= %d)", routes,
                 _mosaic.MAX_ROUTES)
        return "mosaic"
    if isinstance(config, _mosaic.MosaicMoEConfig):
        raise ValueError(  # noqa: TRY004 - not a type error: the device or shape rules it out
            f"config: a MosaicMoEConfig was given but the Mosaic kernels cannot run ({why})")
    log.info("nvfp4_jax.moe: kernel auto -> triton (%s)", why)
    return "triton"


def fc2_triton(meta, he, ho, fc2: NVFP4Array, a2, wt, *, cfg: Config, em: int, h_dim: int,
               inter: int, mode: str, interpret: bool) -> jax.Array:
    """Pallas-Triton grouped FC2 (+ alpha2, bf16 in trtllm_cutlass, router weight) -> fp32 [EM, H].

    meta: (block_expert [NB], num_blocks [1]); he/ho: even/odd K columns of the FC2 operand
    (``q * sf`` bf16 [EM, I/2]); wt: fp32 router weight per sorted row [EM]."""
    codes, scales = _stack(fc2, cfg)
    return pl.pallas_call(
        functools.partial(_fc2_kernel, cfg=cfg, H=h_dim, I=inter, mode=mode, exact_asm=not interpret),
        out_shape=jax.ShapeDtypeStruct((em, h_dim), jnp.float32),
        grid=(em // cfg.block_m * _cdiv(h_dim, cfg.block_n),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="nvfp4_moe_fc2",
    )(*meta, he, ho, codes, scales, a2, wt)


def _stack(w: NVFP4Array, cfg: Config):
    codes = w.codes if cfg.load2d else w.codes.reshape(w.shape[0], w.shape[1], w.shape[2] // 16, 8)
    return codes, lax.bitcast_convert_type(w.linear_scales(), jnp.uint8)


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
    config=None,
    kernel: str = "auto",
    interpret: bool = False,
    return_intermediates: bool = False,
):
    """Pallas MoE -> bf16 [T, H] (and per-route ``h`` [T*k, I] with ``return_intermediates``).

    Arguments as :func:`nvfp4_jax.moe` (validated there); fc1/fc2 scales in the linear layout.
    ``kernel`` (see ``choose_kernel``): "triton" (the Pallas-Triton kernels of this module),
    "mosaic" (``mosaic.moe_mosaic``: Mosaic GPU grouped GEMMs on Hopper, FC2 on Pallas-Triton
    when I % 256 is neither 0 nor 128) or "auto" (mosaic on sm_90 up to ``mosaic.MAX_ROUTES`` routed rows; logged).
    ``config``: ``MoEConfig`` (Pallas-Triton tiles), ``mosaic.MosaicMoEConfig`` or None (defaults).
    """
    t, k = topk_ids.shape
    e, r, h_dim = fc1.shape
    inter = intermediate_size(r, activation)
    n_routes = t * k
    if choose_kernel(kernel, config, routes=n_routes, hidden=h_dim, interpret=interpret) == "mosaic":
        from .mosaic import moe_mosaic

        if interpret:
            log.info("nvfp4_jax.moe: kernel mosaic in interpret mode -> XLA emulation of the kernels")
        return moe_mosaic(hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale,
                          fc2_input_scale, activation=activation, gate_up_order=gate_up_order,
                          mode=mode, activation_scale=activation_scale, config=config,
                          reference=interpret, return_intermediates=return_intermediates)
    fc2 = unpad_fc2(fc2, inter)  # these kernels read K = I (a padded stack is sliced, logged)
    if config is None:
        config = default_config(n_routes, e, inter=inter, hidden=h_dim, gated=activation == "swiglu")
        if interpret:
            config = config.with_decode("bits")
    c1, c2 = config.fc1, config.fc2
    bm = c1.block_m
    exact_asm = not interpret
    recipe = recipe_of(mode)

    # the encode scales, alphas and 1/G2 (the trtllm recipe's) from one launch with IEEE
    # divisions (``epilogue.moe_scales_kernel``; in XLA they were 11-14 small fusions per layer)
    from .epilogue import moe_scales_kernel  # epilogue imports this module: a local import

    g1, _, a1, g2, rg2, a2 = moe_scales_kernel(
        fc1.decode_scale, fc2.decode_scale, fc1_input_scale, fc2_input_scale, num_experts=e,
        mode=mode, activation_scale=activation_scale, interpret=interpret)
    br = block_routing(topk_ids, e, bm)
    em = br.sorted_route.shape[0]
    nb = em // bm
    xv, wt, _ = sorted_rows(hidden, topk_weights, g1, br.sorted_route, br.block_expert, top_k=k,
                            block_m=bm, recipe=recipe, activation_scale=activation_scale)
    xe, xo = xv[:, 0::2], xv[:, 1::2]

    c1c, c1s = _stack(fc1, c1)
    meta = (br.block_expert, br.num_blocks)

    out1 = [jax.ShapeDtypeStruct((em, inter // 2), jnp.bfloat16)] * 2
    if return_intermediates:
        out1.append(jax.ShapeDtypeStruct((em, inter), jnp.bfloat16))
    he_ho = pl.pallas_call(
        functools.partial(_fc1_kernel, cfg=c1, H=h_dim, I=inter, activation=activation,
                          gate_up_order=gate_up_order, mode=mode, exact_asm=exact_asm),
        out_shape=tuple(out1),
        grid=(nb * _cdiv(inter, c1.block_n),),
        compiler_params=plgpu.CompilerParams(num_warps=c1.num_warps, num_stages=c1.num_stages),
        interpret=interpret,
        name="nvfp4_moe_fc1",
    )(*meta, xe, xo, c1c, c1s, a1, g2, rg2)
    he, ho = he_ho[0], he_ho[1]
    contrib = fc2_triton(meta, he, ho, fc2, a2, wt, cfg=c2, em=em, h_dim=h_dim, inter=inter,
                         mode=mode, interpret=interpret)
    out = contrib[br.route_pos].reshape(t, k, h_dim).sum(axis=1).astype(jnp.bfloat16)
    if return_intermediates:
        return out, {"h": he_ho[2][br.route_pos]}
    return out
