"""NVFP4 quantization recipes: each one reproduces one system's order of fp32 operations.

Every recipe maps a tensor ``x[..., K]`` (K a multiple of 16; values given as float64 that
hold float32-representable numbers, e.g. bf16 inputs) and a per-tensor global scale to

* ``codes``  uint8 [..., K/2]: two E2M1 codes per byte, element 2j in the low nibble;
* ``scales`` uint8 [..., K/16]: E4M3 block-scale bytes, linear (row-major) layout;
* ``decode_scale``: the fp32 per-tensor decode scale ``D`` (ModelOpt ``weight_scale_2`` /
  ``input_scale``), so that ``x ~= e2m1(code) * e4m3(scale) * D``.

Global scales come in two conventions, always named as such:

* ``decode_scale`` ``D = amax / (6 * 448)``: what a ModelOpt checkpoint stores, torchao's
  ``per_tensor_scale``, JAX's ``global_scale``;
* ``encode_scale`` ``G = (6 * 448) / amax``: what TensorRT-LLM / FlashInfer / b12x quantization
  kernels take.

Each recipe has a native convention (``RECIPES[name].native``). Passing the other one is
allowed and converted the way the named system's loader does it, with one correctly rounded
fp32 reciprocal; the conversion is part of the result (``decode_scale`` of an encode-native
recipe is the ``D`` you passed, or ``fp32(1/G)``).

Recipes (source: the peers' code):

``trtllm``
    TensorRT-LLM / FlashInfer ``cvt_warp_fp16_to_fp4`` with fast math disabled (the
    "TE-matching" exact variant): ``SF = vmax * (G * fp32(1/6))`` (0 for a zero block),
    byte = E4M3 saturating RNE, ``outScale = min(1 / (SFn * (1/G)), FLT_MAX)`` with IEEE
    divisions, ``y = x * outScale``, E2M1 RNE saturating; the sign bit follows the fp32 sign
    (hardware ``cvt``).
``trtllm_fast``
    The default fast-math variant: ``SF = G * (vmax * rcp(6))``,
    ``outScale = rcp(SFn * rcp(G))`` (0 for a zero block). ``rcp`` is ``rcp.approx.ftz.f32``
    on the GPU; here it is the correctly rounded reciprocal, which differs by 1 ulp for ~13 %
    of inputs, so this recipe is an *approximation* of the kernel: scale bytes agree, codes can
    differ only where ``x * outScale`` is within an ulp of an E2M1 midpoint. When the scale
    underflows to 0, ``outScale = +Inf`` and ``0 * Inf`` is NaN, which ``cvt.rn.satfinite``
    turns into code 0 here (documented assumption; its dequantized value is 0 either way).
``modelopt``
    ModelOpt 0.47 ``NVFP4QTensor``: ``sf = vmax / (6 * D)``, zero -> 1.0, clamp to
    [2^-9, 448], E4M3; ``y = x / (SFn * D)``; E2M1 RNE with the sign from ``y < 0`` (so -0.0
    gives code 0, tiny negatives code 8 unless the fp32 quotient underflows to -0.0).
``jax``
    ``jax._src.cudnn.scaled_matmul_stablehlo.quantize`` (mode nvfp4) as XLA executes it: the
    source reads ``x' = x / D``, ``s = E4M3(clip(max|x'| / 6, 0, 448))``, ``y = x' / s``, but
    XLA rewrites each division by a broadcast into a multiply by an fp32 reciprocal, so
    ``x' = x * (1/D)``, ``s = E4M3(clip(max|x'| * (1/6), 0, 448))``, ``y = x' * (1/s)``;
    clip to [-6, 6], XLA E2M1 convert (NaN -> code 8). A zero-scale block gives codes +-6
    (x * inf) or 8 (0 * inf): dequantizes to 0.
``jax_div``
    The same source taken literally, with true IEEE divisions ``x / D``, ``amax / 6``,
    ``x' / s``: what XLA:GPU computes when its f32 division is IEEE
    (``XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2``; by default XLA:GPU uses
    ``div.full.f32``, within 2 ulp, which no CPU oracle reproduces bit for bit).
``torchao``
    torchao 0.18 ``nvfp4_quantize`` (two-level): ``bs = vmax / 6``,
    ``s = E4M3(clamp(bs / D, 2^-6, 448))`` (never subnormal), ``y = x * ((1/D) / s)``.
``b12x``
    b12x's reference ``_quantize_vec_to_fp4_dequant`` in ``direct_division`` mode:
    ``sf = E4M3(min((vmax * G) / 6, 448))``, ``y = x / max(sf / G, 1e-30)``; negatives that
    round to 0 are stored as +0 (b12x packers).
``b12x_grouped``
    b12x 1.5.1's pure-torch activation quantizer ``quantize_grouped_nvfp4_torch``:
    ``s = E4M3(G * (vmax / 6))`` (saturating cast, no clamp), ``outScale = 1 / (s * (1/G))``
    with 1/0 -> 0, ``y = clip(x * outScale, +-6)``, RNE; negatives that round to 0 -> +0.
``flashinfer_reference``
    FlashInfer's pure-torch trace reference ``_nvfp4_quantize_reference``:
    ``s = E4M3((vmax / 6) * G)`` (saturating cast, torch >= 2.12), zero scale -> 1 for the
    division, ``y = x * G / s``, E2M1 by nearest-value with **ties toward zero**
    (0.75->0.5, 1.75->1.5, 3.5->3), sign from ``x < 0``.
``compressed_tensors``
    compressed-tensors 0.20: ``s = G * (vmax / 6)`` clamped to +-448, E4M3, a zero scale
    stored as 0.125 (0x20); ``y = x / (s / G)`` (the stored 0.125 for zero-scale blocks);
    E2M1 RNE; the sign bit is set iff ``y < 0`` (``round(|y|) * torch.sign(y)``): -0.0 is
    stored as +0, negatives that round to 0 as -0 (code 8).
``exact``
    Float64 throughout, no intermediate fp32 rounding: ``s = E4M3(vmax / (6 * D))``
    saturating, ``y = x / (s * D)``, E2M1 RNE; zero-scale blocks get code 0; the sign bit is
    set only for non-zero codes. The mathematical definition the others approximate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .formats import (
    E2M1_MAGNITUDES,
    E4M3_MAX,
    FLT_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    f32,
    f32_div,
    f32_mul,
    f32_rcp,
    is_f32_representable,
    pack_nibbles,
    unpack_nibbles,
)

BLOCK = 16
E2M1_X_E4M3 = 6.0 * 448.0  # 2688
FP32_TINY = 2.0**-126  # smallest normal fp32 number
#: global scales are normal fp32 numbers in [2^-117, 2^117]: then every product of an E4M3
#: block scale (>= 2^-9) and the global scale is a normal fp32 number too, so a device that
#: flushes subnormals (XLA:CPU) computes the same bits (docs/input-policy.md)
SCALE_RANGE = (2.0**-117, 2.0**117)
#: a tensor with ``max|x|`` below this (2^-105, ~2.5e-32; an all-zero one included) quantizes
#: with global scale 1.0: zero codes and scales (or the recipe's zero-block values), and
#: dequantizes to zeros; ``amax/2688`` would leave ``SCALE_RANGE``
TINY_AMAX = 2.0**-105

GlobalKind = Literal["encode", "decode"]


@dataclass(frozen=True)
class NVFP4:
    """An NVFP4 tensor in the oracle (numpy).

    codes:        uint8 [..., K/2], element 2j in the low nibble.
    scales:       uint8 [..., K/16], E4M3 bytes, linear layout.
    decode_scale: float64 holding an fp32 value, shape () or ``codes.shape[:-2]`` (one per
                  matrix of a stack, e.g. per expert).
    """

    codes: np.ndarray
    scales: np.ndarray
    decode_scale: np.ndarray

    def __post_init__(self) -> None:
        c, s = np.asarray(self.codes), np.asarray(self.scales)
        if c.dtype != np.uint8:
            raise TypeError(f"codes: expected uint8 [..., K/2], got dtype {c.dtype}")
        if s.dtype != np.uint8:
            raise TypeError(f"scales: expected uint8 E4M3 bytes [..., K/16], got dtype {s.dtype}")
        if c.shape[:-1] != s.shape[:-1] or c.shape[-1] != 8 * s.shape[-1]:
            raise ValueError(
                f"scales: expected shape {c.shape[:-1] + (c.shape[-1] // 8,)} for codes of shape "
                f"{c.shape} (one scale per 16 values, linear layout), got {s.shape}"
            )
        d = np.asarray(self.decode_scale, dtype=np.float64)
        if d.shape not in ((), c.shape[:-2]):
            raise ValueError(
                f"decode_scale: expected shape () or {c.shape[:-2]}, got {d.shape}"
            )
        object.__setattr__(self, "decode_scale", d)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape [..., K]."""
        return self.codes.shape[:-1] + (2 * self.codes.shape[-1],)

    def values(self) -> np.ndarray:
        """E2M1 values times E4M3 block scales, without the global scale (float64, exact)."""
        return dequantize(self, include_decode_scale=False)


@dataclass(frozen=True)
class Recipe:
    name: str
    native: GlobalKind
    fn: Callable[[np.ndarray, np.ndarray, float], tuple[np.ndarray, np.ndarray]]
    needs_f32_input: bool = True


# ---------------------------------------------------------------------------------------
# recipes: fn(xb [..., nb, 16] float64, vmax [..., nb], g) -> (scale bytes [..., nb],
# codes [..., nb, 16] (0..15)); g is the recipe's native global scale (fp32 value)
# ---------------------------------------------------------------------------------------

def _trtllm_exact(xb, vmax, G):
    c6 = f32(1.0 / 6.0)
    sf = np.where(vmax == 0, 0.0, f32_mul(vmax, f32_mul(G, c6)))
    s8 = e4m3_encode(sf, "saturate")
    sfn = e4m3_decode(s8)
    den = f32_mul(sfn, f32_rcp(G))
    out_scale = np.minimum(f32_rcp(den), FLT_MAX)
    y = _f32_mul_overflow(xb, out_scale[..., None])
    return s8, e2m1_encode(y)


def _trtllm_fast(xb, vmax, G):
    sf = f32_mul(G, f32_mul(vmax, f32_rcp(6.0)))
    s8 = e4m3_encode(sf, "saturate")
    sfn = e4m3_decode(s8)
    out_scale = np.where(vmax != 0, f32_rcp(f32_mul(sfn, f32_rcp(G))), 0.0)
    with np.errstate(invalid="ignore"):
        y = _f32_mul_overflow(xb, out_scale[..., None])
    # 0 * Inf = NaN (scale underflow): assumed to convert to code 0 (see module doc)
    y = np.where(np.isnan(y), 0.0, y)
    return s8, e2m1_encode(y)


def _modelopt(xb, vmax, D):
    sf = f32_div(vmax, f32_mul(6.0, D))
    sf = np.where(sf == 0, 1.0, sf)
    sf = np.clip(sf, 2.0**-9, E4M3_MAX)
    s8 = e4m3_encode(sf, "saturate")
    y = f32_div(xb, f32_mul(e4m3_decode(s8), D)[..., None])
    # _cast_fp4 takes the sign from the scaled value (``weight < 0`` after the division):
    # -0.0 and negatives whose quotient underflows to -0.0 give code 0
    code = e2m1_encode(np.abs(y)) | ((y < 0).astype(np.uint8) << 3)
    return s8, code


def _jax(xb, vmax, D):
    # The source divides (x / gs, amax / 6, x / s), but every divisor is a broadcast, and
    # XLA's algebraic simplifier rewrites ``a / broadcast(b)`` into ``a * broadcast(1 / b)``
    # (seen in the compiled HLO of jax 0.10.2 on CPU). What runs is three fp32
    # reciprocal-multiplies; 1/0 = inf, so x * inf = +-inf and 0 * inf = NaN as with division.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x2 = f32_mul(xb, f32_rcp(D))
        amax = np.max(np.abs(x2), axis=-1)
        s = np.clip(f32_mul(amax, f32_rcp(6.0)), 0.0, E4M3_MAX)
        s8 = e4m3_encode(s, "nan")
        y = f32_mul(x2, f32_rcp(e4m3_decode(s8))[..., None])
    y = np.clip(y, -6.0, 6.0)  # NaN stays NaN
    return s8, e2m1_encode(y, nan="neg_zero")


def _jax_div(xb, vmax, D):
    # the source of jax's quantize taken literally (true IEEE divisions): what XLA:GPU runs
    # when f32 division is IEEE (XLA_FLAGS=--xla_backend_extra_options=-nvptx-prec-divf32=2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x2 = f32_div(xb, D)
        amax = np.max(np.abs(x2), axis=-1)
        s8 = e4m3_encode(np.clip(f32_div(amax, 6.0), 0.0, E4M3_MAX), "nan")
        y = f32_div(x2, e4m3_decode(s8)[..., None])
    return s8, e2m1_encode(np.clip(y, -6.0, 6.0), nan="neg_zero")


def _torchao(xb, vmax, D):
    bs = f32_div(vmax, 6.0)
    s = np.clip(f32_div(bs, D), 2.0**-6, E4M3_MAX)
    s8 = e4m3_encode(s, "saturate")
    rscale = f32_div(f32_rcp(D), e4m3_decode(s8))
    y = np.clip(f32_mul(xb, rscale[..., None]), -6.0, 6.0)
    return s8, e2m1_encode(y)


def _b12x(xb, vmax, G):
    sf = np.minimum(f32_div(f32_mul(vmax, G), 6.0), E4M3_MAX)
    s8 = e4m3_encode(sf, "saturate")
    den = np.maximum(f32_div(e4m3_decode(s8), G), 1e-30)
    y = f32_div(xb, den[..., None])
    return s8, e2m1_encode(y, negative_zero="never")


def _b12x_grouped(xb, vmax, G):
    sf = f32_mul(G, f32_div(vmax, 6.0))
    s8 = e4m3_encode(sf, "saturate")  # no clamp in b12x: relies on torch >= 2.12 saturating
    den = f32_mul(e4m3_decode(s8), f32_rcp(G))
    with np.errstate(divide="ignore", over="ignore"):
        out_scale = np.where(den == 0, 0.0, f32_rcp(den))  # _reciprocal_or_zero_torch
        y = np.clip(f32_mul(xb, out_scale[..., None]), -6.0, 6.0)
    return s8, e2m1_encode(y, negative_zero="never")


def _flashinfer_reference(xb, vmax, G):
    s = f32_mul(f32_div(vmax, 6.0), G)
    s8 = e4m3_encode(s, "saturate")
    sd = e4m3_decode(s8)
    sd = np.where(sd == 0, 1.0, sd)
    with np.errstate(over="ignore", invalid="ignore"):
        y = f32_div(f32_mul(xb, G), sd[..., None])
        mag = np.abs(y)
        # nearest table value by fp32 |mag - v| (no clamp), ties to the smaller magnitude
        # (argmin picks the first). For |y| >= 2^27 or inf every difference rounds to the
        # same value and the code becomes 0, as in torch.
        diffs = np.abs(f32(mag[..., None] - E2M1_MAGNITUDES))
    idx = np.argmin(diffs, axis=-1).astype(np.uint8)
    return s8, idx | ((y < 0).astype(np.uint8) << 3)


def _compressed_tensors(xb, vmax, G):
    s = np.clip(f32_mul(G, f32_div(vmax, 6.0)), -E4M3_MAX, E4M3_MAX)
    s8 = e4m3_encode(s, "saturate")
    s8 = np.where(s8 == 0, np.uint8(0x20), s8).astype(np.uint8)  # zero scale -> 0.125
    y = np.clip(f32_div(xb, f32_div(e4m3_decode(s8), G)[..., None]), -6.0, 6.0)
    # cast_to_fp4 (CPU) returns round(|y|) * torch.sign(y) and the packer takes signbit:
    # negatives that round to 0 give -0.0 (code 8); -0.0 itself has sign(-0.0) = +0 (code 0)
    return s8, e2m1_encode(np.abs(y)) | ((y < 0).astype(np.uint8) << 3)


def _exact(xb, vmax, D):
    s8 = e4m3_encode(vmax / (6.0 * D), "saturate")
    sd = e4m3_decode(s8) * D
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(sd[..., None] == 0, 0.0, xb / sd[..., None])
    return s8, e2m1_encode(y, negative_zero="never")


def _f32_mul_overflow(a, b):
    with np.errstate(over="ignore"):
        return f32_mul(a, b)  # overflow to +-inf, which E2M1 saturates to +-6


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe("trtllm", "encode", _trtllm_exact),
        Recipe("trtllm_fast", "encode", _trtllm_fast),
        Recipe("modelopt", "decode", _modelopt),
        Recipe("jax", "decode", _jax),
        Recipe("jax_div", "decode", _jax_div),
        Recipe("torchao", "decode", _torchao),
        Recipe("b12x", "encode", _b12x),
        Recipe("b12x_grouped", "encode", _b12x_grouped),
        Recipe("flashinfer_reference", "encode", _flashinfer_reference),
        Recipe("compressed_tensors", "encode", _compressed_tensors),
        Recipe("exact", "decode", _exact, needs_f32_input=False),
    ]
}


def decode_scale_from_amax(amax: float) -> float:
    """ModelOpt/torchao per-tensor decode scale ``fp32(amax / 2688)``."""
    return float(f32_div(f32(amax), E2M1_X_E4M3))


def encode_scale_from_amax(amax: float) -> float:
    """TensorRT-LLM per-tensor encode scale ``fp32(2688 / amax)``."""
    return float(f32_div(E2M1_X_E4M3, f32(amax)))


def _check_scalar_scale(name: str, v) -> float:
    a = np.asarray(v, dtype=np.float64)
    if a.shape != ():
        raise ValueError(f"{name}: expected a scalar fp32 global scale, got shape {a.shape}")
    v = float(a)
    if not np.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: expected a positive finite fp32 value, got {v}")
    if not SCALE_RANGE[0] <= v <= SCALE_RANGE[1]:
        raise ValueError(f"{name}: expected a value in [2^-117, 2^117] (docs/input-policy.md), "
                         f"got {v}")
    if float(f32(v)) != v:
        raise ValueError(f"{name}: expected an fp32-representable value, got {v!r}")
    return v


def quantize(
    x: np.ndarray,
    recipe: str = "trtllm",
    *,
    encode_scale: float | None = None,
    decode_scale: float | None = None,
) -> NVFP4:
    """Quantize ``x[..., K]`` to NVFP4 with the named recipe (see the module docstring).

    Exactly one of ``encode_scale`` (G) and ``decode_scale`` (D) may be given (an fp32 value
    in ``SCALE_RANGE`` = [2^-117, 2^117]); with neither, the global scale comes from
    ``max|x|`` in the recipe's native convention (``fp32(amax/2688)`` or
    ``fp32(2688/amax)``), and is 1.0 when ``max|x| < TINY_AMAX`` (an all-zero tensor: zero
    codes, dequantizes to zeros).

    Degenerate input (docs/input-policy.md): NaN/Inf raise ValueError (count and first index);
    for the recipes that model fp32 kernels, fp32 subnormal inputs are read as signed zero, as
    XLA:CPU reads them (and as ``nvfp4_jax.quantize`` does on every device).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {recipe!r}")
    rec = RECIPES[recipe]
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"x: expected a floating array, got dtype {x.dtype}")
    x = x.astype(np.float64)
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of {BLOCK}, got shape {x.shape}")
    if x.shape[-1] == 0:
        raise ValueError(f"x: last dimension must be a positive multiple of {BLOCK}, got shape "
                         f"{x.shape}")
    bad = ~np.isfinite(x)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"x: expected finite values, got {int(bad.sum())} non-finite of "
                         f"{x.size} (first at index {first}: {x[first]}); NVFP4 quantization "
                         "needs finite inputs, no NaN or Inf")
    if rec.needs_f32_input and not is_f32_representable(x):
        raise ValueError(
            f"x: recipe {recipe!r} models fp32 kernels; values must be float32-representable "
            "(e.g. bf16 or fp32 inputs)"
        )
    if rec.needs_f32_input:
        x = np.where(np.abs(x) < FP32_TINY, x * 0.0, x)  # subnormals read as signed zero
    if encode_scale is not None and decode_scale is not None:
        raise ValueError("pass only one of encode_scale (G = 2688/amax) and decode_scale (D = amax/2688)")
    if encode_scale is None and decode_scale is None:
        amax = float(np.max(np.abs(x))) if x.size else 0.0
        if amax < TINY_AMAX:  # all zeros, or no normal fp32 global scale: 1.0
            decode_scale = 1.0
        elif rec.native == "decode":
            decode_scale = decode_scale_from_amax(amax)
        else:
            encode_scale = encode_scale_from_amax(amax)
    if encode_scale is not None:
        G = _check_scalar_scale("encode_scale", encode_scale)
        D = float(f32_rcp(G))
    else:
        D = _check_scalar_scale("decode_scale", decode_scale)
        G = float(f32_rcp(D))
    g = G if rec.native == "encode" else D

    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))
    vmax = np.max(np.abs(xb), axis=-1)
    s8, codes = rec.fn(xb, vmax, g)
    codes = codes.reshape(x.shape)
    return NVFP4(pack_nibbles(codes), np.asarray(s8, dtype=np.uint8), np.float64(D))


def dequantize(t: NVFP4, include_decode_scale: bool = True) -> np.ndarray:
    """float64 [..., K] = e2m1(code) * e4m3(scale) [* decode_scale]; the first product is exact."""
    vals = e2m1_decode(unpack_nibbles(t.codes))
    sc = e4m3_decode(t.scales)
    out = (vals.reshape(vals.shape[:-1] + (-1, BLOCK)) * sc[..., None]).reshape(vals.shape)
    if include_decode_scale:
        d = np.asarray(t.decode_scale, dtype=np.float64)
        out = out * d.reshape(d.shape + (1,) * (out.ndim - d.ndim))
    return out


def codes_of(t: NVFP4) -> np.ndarray:
    """Unpacked E2M1 codes [..., K] (uint8)."""
    return unpack_nibbles(t.codes)
