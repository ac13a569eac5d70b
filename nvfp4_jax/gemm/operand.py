"""The W4A4 activation operand of the Pallas-Triton kernels: one launch, IEEE divisions
whatever XLA's flags.

``matmul(x, w, input_scale=s)`` quantizes x with the ``trtllm`` recipe (``G = fp32(1/s)``,
``sf = vmax * (G * fp32(1/6))``, ``y = x * min(1 / (E4M3(sf) * fp32(1/G)), FLT_MAX)``) and feeds
the dequantized values ``e2m1(y) * E4M3(sf)`` (exact in bf16) to a W4A16 kernel. In XLA a plain
``/`` lowers to ``div.full.f32`` on NVIDIA GPUs (within 2 ulp, not correctly rounded), which
flips FP4 codes at E2M1 midpoints unless ``--xla_backend_extra_options=-nvptx-prec-divf32=2`` is
set (``nvfp4 crosscheck`` on the H200 without it: 18-31 of 16384 activation codes differ
from TensorRT-LLM's exact quantizer, and 15-20 % of the W4A4 outputs leave the oracle's
bound). :func:`w4a4_operand` computes the operand in one kernel with ``div.rn.f32`` (inline
PTX): byte-identical to ``oracle.quantize(x, "trtllm", encode_scale=fp32(1/s))``.
:func:`w4a4_codes` is the same kernel writing the NVFP4 operand itself (codes and E4M3 scale
bytes) for the FP4-MMA GEMM (``fp4mma.gemm_fp4mma``, the W4A4 default on SM 12.x GPUs). The
Mosaic kernels take ``quantize``'s operand from ``api.matmul`` (XLA ops with
``division.divide``, which XLA fuses with x's producer), and :func:`mosaic_w4a4_operand`'s
from ``api.matmul_w4a4_prologue``: the operand padded and permuted for them, RMSNorm'd first
if asked, with the norm weight and input scale read in place from a scan's stacks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..triton_ops import bf16_rne, div_rn, quantize_codes, requantize, row_tile

#: most activation elements one program quantizes (fp32 registers: 32 per thread at 4 warps)
PROGRAM_ELEMS = 4096


def _kernel(s_ref, x_ref, o_ref, *so_ref, m: int, bm: int, bk: int, exact_asm: bool):
    r0 = pl.program_id(0) * bm
    k0 = pl.program_id(1) * bk
    s = s_ref[...].reshape(1, 1)  # a [1, 1] tile: Triton's inline asm takes tensors, not scalars
    g = div_rn(1.0, s, exact_asm)  # G = fp32(1 / input_scale), IEEE
    rg = div_rn(1.0, g, exact_asm)  # fp32(1 / G), the recipe's
    rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    cols = k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    live = rows < m  # rows past M (the last block's) load row M - 1 and are not stored
    x = plgpu.load(x_ref.at[jnp.minimum(rows, m - 1), cols]).astype(jnp.float32)
    if so_ref:  # the NVFP4 operand itself: codes [bm, bk/2] and E4M3 scale bytes [bm, bk/16]
        codes, sb = quantize_codes(x.reshape(bm, bk // 16, 16), g, rg, "trtllm", exact_asm)
        c2 = k0 // 2 + lax.broadcasted_iota(jnp.int32, (1, bk // 2), 1)
        cs = k0 // 16 + lax.broadcasted_iota(jnp.int32, (1, bk // 16), 1)
        plgpu.store(o_ref.at[rows, c2], codes.reshape(bm, bk // 2), mask=live)
        plgpu.store(so_ref[0].at[rows, cs], sb, mask=live)
        return
    q = requantize(x.reshape(bm, bk // 16, 16), g, rg, "trtllm", exact_asm).reshape(bm, bk)
    plgpu.store(o_ref.at[rows, cols], q.astype(jnp.bfloat16), mask=live)


def w4a4_operand(x: jax.Array, input_scale: jax.Array, *, interpret: bool = False) -> jax.Array:
    """bf16 [M, K]: ``x`` [M, K] (bf16/fp16, K % 16 == 0) quantized with the ``trtllm`` recipe
    and encode scale ``fp32(1/input_scale)`` (input_scale: fp32 scalar or [1], ModelOpt decode
    form) and dequantized without the global scale (``e2m1 * e4m3``, exact in bf16).
    ``interpret``: Pallas interpret mode (CPU tests; the divisions are then XLA's, exact on
    CPU)."""
    x = jnp.asarray(x)
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x: expected bf16/fp16 [M, K], got {x.dtype} {x.shape}")
    m, k = x.shape
    if k % 16:
        raise ValueError(f"x: K must be a multiple of 16, got {k}")
    s = jnp.asarray(input_scale, jnp.float32).reshape(-1)
    if s.shape != (1,):
        raise ValueError(f"input_scale: expected an fp32 scalar, got shape {jnp.shape(input_scale)}")
    bk = row_tile(k)
    bm = max(1, min(8, PROGRAM_ELEMS // bk))
    kern = functools.partial(_kernel, m=m, bm=bm, bk=bk, exact_asm=not interpret)
    return pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((m, k), jnp.bfloat16), grid=(pl.cdiv(m, bm), k // bk),
        interpret=interpret, name="nvfp4_w4a4_operand",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(s, x)


def _mosaic_kernel(l_ref, s_ref, x_ref, *refs, m: int, bm: int, bk: int, n_layers: int,
                  eps: float, norm: bool, exact_asm: bool):
    """Program (i, j): rows i*bm.. and columns j*bk.. of the Mosaic operand; with ``norm``
    (bk = K) each row RMSNorm'd first, with ``nn.rms_norm``'s rounding points."""
    w_ref, o_ref = refs if norm else (None, refs[0])
    layer = jnp.minimum(jnp.maximum(l_ref[0], 0), n_layers - 1)
    r0 = pl.program_id(0) * bm
    k0 = pl.program_id(1) * bk
    s = plgpu.load(s_ref.at[pl.ds(layer, 1)]).reshape(1, 1)
    rows = r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    cols = k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    live = rows < m
    x = plgpu.load(x_ref.at[jnp.minimum(rows, m - 1), cols]).astype(jnp.float32)
    if norm:  # y = bf16(x * rsqrt(mean(x^2) + eps)), h = bf16(w * y); the sum in its own order
        # the weight loaded before the sum (a load after a reduction's barrier waits for it)
        w = plgpu.load(w_ref.at[layer, cols]).astype(jnp.float32)
        inv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) * (1.0 / bk) + eps)
        x = bf16_rne(w * bf16_rne(x * inv, exact_asm), exact_asm)
    q = operand_values(x, s, exact_asm)
    plgpu.store(o_ref.at[rows, mosaic_columns(cols)], jnp.where(live, q, 0.0).astype(jnp.bfloat16))


def operand_values(x, input_scale, exact_asm: bool):
    """Inside a Pallas-Triton kernel: x fp32 [R, C] (bf16 values, C % 16 == 0, blocks of 16
    along C) -> the W4A4 operand's values fp32 [R, C], ``e2m1 * E4M3(sf)`` of the ``trtllm``
    recipe with encode scale ``G = fp32(1 / input_scale)`` (``input_scale`` fp32 [1, 1]; IEEE
    divisions on the GPU): what :func:`w4a4_operand` and :func:`mosaic_w4a4_operand` store."""
    g = div_rn(1.0, input_scale, exact_asm)  # G = fp32(1 / input_scale), IEEE
    rg = div_rn(1.0, g, exact_asm)  # fp32(1 / G), the recipe's
    r, c = x.shape
    return requantize(x.reshape(r, c // 16, 16), g, rg, "trtllm", exact_asm).reshape(r, c)


def mosaic_columns(cols):
    """Column indices (int32, any shape) of K -> their positions in the Mosaic kernel's operand
    (``mosaic.permute_x``, within 128-groups): element 32c + 8w + 4l + j goes to position
    32w + 8j + 2c + l."""
    e = cols & 127
    return (cols - e) + (((e >> 3) & 3) << 5) + ((e & 3) << 3) + ((e >> 5) << 1) + ((e >> 2) & 1)


def scale_and_layer(input_scale, layer) -> tuple[jax.Array, jax.Array]:
    """A W4A4 operand kernel's scale operands, checked: (layer int32 [1], input scales fp32
    [L]) from ``input_scale`` an fp32 scalar (``layer`` None; L = 1, layer 0) or the fp32 [L]
    stack of a scan's layers with ``layer`` an int32 scalar (which the kernels clamp into
    [0, L)). ValueError naming ``input_scale`` or ``layer`` otherwise."""
    s = jnp.asarray(input_scale, jnp.float32)
    if layer is None:
        if s.size != 1:
            raise ValueError("input_scale: expected an fp32 scalar, got shape "
                             f"{jnp.shape(input_scale)}")
        s = s.reshape(1)
    elif s.ndim != 1:
        raise ValueError(f"input_scale: expected the fp32 [L] stack with layer given, got shape "
                         f"{s.shape}")
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32)
    if lay.size != 1:
        raise ValueError(f"layer: expected an int32 scalar, got shape {lay.shape}")
    return lay.reshape(1), s


#: the most K an RMSNorm'd operand row may have (one program holds the row: 64 fp32 a thread)
NORM_MAX_K = 8192


def mosaic_w4a4_operand(x: jax.Array, input_scale: jax.Array, rows: int, *,
                        layer: jax.Array | int | None = None,
                        norm_weight: jax.Array | None = None, eps: float = 1e-6,
                        interpret: bool = False) -> jax.Array:
    """The Mosaic GEMM's W4A4 operand in one launch: bf16 [rows, K], the ``trtllm``
    quantization of ``x`` [M, K] (bf16 or fp16, M <= rows, K % 128 == 0) with encode scale
    ``fp32(1/input_scale)``, dequantized without the global scale (``e2m1 * e4m3``, exact in
    bf16; :func:`w4a4_operand`'s values), in rows 0..M-1, zeros below, K permuted within
    128-groups as ``mosaic.permute_x`` lays it out (``rows``: the kernel's token tile,
    ``mosaic.token_tile(M)``), for ``mosaic.matmul_mosaic_permuted``.

    norm_weight: None, or RMSNorm x first: bf16 [K] (``nn.rms_norm(x, norm_weight, eps)``'s
    rounding points, its fp32 sum of squares in another order; K a power of two <=
    ``NORM_MAX_K``). layer: None (input_scale an fp32 scalar, norm_weight [K]), or an int32
    scalar inside a scan over stacked layers: input_scale fp32 [L] and norm_weight bf16 [L, K]
    are then the stacks, read in place at ``layer`` (clamped into [0, L)): a Pallas-Triton
    kernel gets a copy of each scanned per-layer slice it takes, about 1.5 us a launch on
    the H100 (bench/results/w4a4-operand-ab-h100-80gb-hbm3.json). ``interpret``: Pallas
    interpret mode (CPU tests; the divisions are then XLA's, exact)."""
    x = jnp.asarray(x)
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16) or (
            norm_weight is not None and x.dtype != jnp.bfloat16):
        raise ValueError(f"x: expected bf16 [M, K] (or fp16 without norm_weight), got {x.dtype} "
                         f"{x.shape}")
    m, k = x.shape
    if k % 128 or k == 0:
        raise ValueError(f"x: K must be a positive multiple of 128, got {k}")
    if not m <= rows:
        raise ValueError(f"rows: expected at least M = {m} rows, got {rows}")
    lay, s = scale_and_layer(input_scale, layer)
    n_layers = s.shape[0]
    operands = [lay, s, x]
    norm = norm_weight is not None
    if norm:
        wn = jnp.asarray(norm_weight)
        want = (k,) if layer is None else (n_layers, k)
        if wn.shape != want or wn.dtype != jnp.bfloat16:
            raise ValueError(f"norm_weight: expected bf16 {list(want)}, got {wn.dtype} {wn.shape}")
        if k & (k - 1) or k > NORM_MAX_K:
            raise ValueError(f"x: an RMSNorm'd operand needs K a power of two <= {NORM_MAX_K}, "
                             f"got {k}")
        operands.append(wn.reshape(n_layers, k))
        bk = k
    else:
        bk = row_tile(k)
    bm = max(1, min(8, PROGRAM_ELEMS // bk))
    kern = functools.partial(_mosaic_kernel, m=m, bm=bm, bk=bk, n_layers=n_layers,
                             eps=float(eps), norm=norm, exact_asm=not interpret)
    return pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
        grid=(pl.cdiv(rows, bm), k // bk), interpret=interpret,
        name="nvfp4_mosaic_w4a4_operand",
        compiler_params=plgpu.CompilerParams(num_warps=8 if bm * bk > PROGRAM_ELEMS else 4,
                                             num_stages=1),
    )(*operands)


def w4a4_codes(x: jax.Array, input_scale: jax.Array, *,
               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The W4A4 activation as the NVFP4 operand of the FP4 MMA (``fp4mma.gemm_fp4mma``): ``x``
    [M, K] (bf16/fp16, K % 16 == 0) quantized in one Pallas-Triton launch with the recipe and
    IEEE divisions of :func:`w4a4_operand` (``triton_ops.quantize_codes``), byte-identical to
    ``oracle.quantize(x, "trtllm", encode_scale=fp32(1/input_scale))``.

    Returns (codes uint8 [M, K/2], element 2j in the low nibble; E4M3 scale bytes uint8
    [M, K/16], linear layout). A block holding NaN/Inf gets scale byte 0x7F (NaN).
    ``interpret``: Pallas interpret mode (CPU tests; the divisions are then XLA's, exact)."""
    x = jnp.asarray(x)
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x: expected bf16/fp16 [M, K], got {x.dtype} {x.shape}")
    m, k = x.shape
    if k % 16 or k == 0:
        raise ValueError(f"x: K must be a positive multiple of 16, got {k}")
    s = jnp.asarray(input_scale, jnp.float32).reshape(-1)
    if s.shape != (1,):
        raise ValueError("input_scale: expected an fp32 scalar, got shape "
                         f"{jnp.shape(input_scale)}")
    bk = row_tile(k)
    bm = max(1, min(8, PROGRAM_ELEMS // bk))
    kern = functools.partial(_kernel, m=m, bm=bm, bk=bk, exact_asm=not interpret)
    codes, scales = pl.pallas_call(
        kern, out_shape=(jax.ShapeDtypeStruct((m, k // 2), jnp.uint8),
                         jax.ShapeDtypeStruct((m, k // 16), jnp.uint8)),
        grid=(pl.cdiv(m, bm), k // bk), interpret=interpret, name="nvfp4_w4a4_codes",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(s, x)
    return codes, scales
