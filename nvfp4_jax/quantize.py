"""The NVFP4 array type and jittable quantization recipes (bit-exact with ``oracle.quantize``).

``NVFP4Array`` is a JAX pytree holding

* ``codes``        uint8 [..., K/2]: E2M1 codes, element 2j in the low nibble;
* ``scales``       float8_e4m3fn: one UE4M3 scale per 16 values; ``[..., K/16]`` in the
                   ``linear`` layout, or flat ``[..., Mp*Kp]`` per matrix in ``swizzled_128x4``
                   / ``swizzled_8x4`` (``oracle.layouts`` defines them);
* ``decode_scale`` float32, shape ``()`` or ``shape[:-2]`` (one per matrix of a stack, e.g. per
                   expert): ModelOpt's ``weight_scale_2`` / ``input_scale`` (amax/2688);

and static metadata ``shape`` (logical ``[..., K]``) and ``layout``.
``x ~= e2m1(code) * e4m3(scale) * decode_scale``.

Recipes here: ``trtllm`` (TensorRT-LLM exact / fast-math-disabled variant), ``modelopt``,
``jax`` and ``b12x`` (direct division); see ``oracle.quantize`` for the arithmetic of each.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import division
from . import formats as F
from . import validate as V
from .layouts import LAYOUTS, padded_shape, swizzle, unswizzle

BLOCK = 16
JAX_RECIPES = ("trtllm", "modelopt", "jax", "b12x")
_FLT_MAX = float(np.finfo(np.float32).max)
#: smallest normal fp32 number: smaller inputs (subnormals) are read as signed zero
FP32_TINY = 2.0**-126
#: global scales are fp32 values in [2^-117, 2^117] (``oracle.quantize.SCALE_RANGE``)
SCALE_RANGE = (2.0**-117, 2.0**117)
#: ``max|x|`` below 2^-105 (all-zero included): global scale 1.0, dequantizes to zeros
TINY_AMAX = 2.0**-105


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """NVFP4 tensor (see module docstring). Build with :func:`quantize` or :meth:`from_parts`."""

    codes: Any
    scales: Any
    decode_scale: Any
    shape: tuple[int, ...]
    layout: str = "linear"

    # -- pytree ---------------------------------------------------------------------------
    def tree_flatten(self):
        return (self.codes, self.scales, self.decode_scale), (self.shape, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        for name, val in zip(("codes", "scales", "decode_scale"), children):
            object.__setattr__(obj, name, val)
        object.__setattr__(obj, "shape", _batched_shape(aux[0], children[0]))
        object.__setattr__(obj, "layout", aux[1])
        return obj

    # -- construction and validation ------------------------------------------------------
    @classmethod
    def from_parts(
        cls,
        codes,
        scales,
        decode_scale,
        *,
        layout: str = "linear",
        shape: tuple[int, ...] | None = None,
    ) -> NVFP4Array:
        """Wrap existing arrays, validating dtypes, shapes and layout.

        ``scales`` must be ``float8_e4m3fn``: raw uint8 bytes are rejected rather than guessed
        (a numeric cast of the bytes would be garbage; view them with
        ``jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn)``).
        """
        codes = jnp.asarray(codes)
        scales = jnp.asarray(scales)
        decode_scale = jnp.asarray(decode_scale)
        if shape is None:
            shape = tuple(codes.shape[:-1]) + (2 * codes.shape[-1],)
        obj = cls(codes, scales, decode_scale, tuple(int(s) for s in shape), layout)
        obj.validate()
        return obj

    def validate(self) -> NVFP4Array:
        """Raise ValueError/TypeError naming the field if anything is inconsistent."""
        shape, layout = self.shape, self.layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if len(shape) < 1 or shape[-1] % BLOCK or shape[-1] == 0:
            raise ValueError(f"shape: last dimension K must be a positive multiple of {BLOCK}, "
                             f"got {shape}")
        if self.codes.dtype != jnp.uint8:
            raise TypeError(f"codes: expected uint8 (two E2M1 codes per byte), got {self.codes.dtype}")
        want = shape[:-1] + (shape[-1] // 2,)
        if tuple(self.codes.shape) != want:
            raise ValueError(f"codes: expected shape {want} for logical shape {shape}, got {self.codes.shape}")
        if self.scales.dtype != jnp.float8_e4m3fn:
            hint = (
                " (raw bytes? view them with lax.bitcast_convert_type(s, jnp.float8_e4m3fn); "
                "a numeric cast would reinterpret them)" if self.scales.dtype == jnp.uint8 else ""
            )
            raise TypeError(f"scales: expected float8_e4m3fn, got {self.scales.dtype}{hint}")
        rows = int(np.prod(shape[-2:-1])) if len(shape) >= 2 else 1
        kv = shape[-1] // BLOCK
        if layout == "linear":
            want_s = shape[:-1] + (kv,)
        else:
            if len(shape) < 2:
                raise ValueError(f"layout: {layout} needs a matrix (rank >= 2), got shape {shape}")
            mp, kp = padded_shape(rows, kv, layout)
            want_s = shape[:-2] + (mp * kp,)
        if tuple(self.scales.shape) != want_s:
            raise ValueError(
                f"scales: expected shape {want_s} for layout {layout!r} and logical shape "
                f"{shape}, got {self.scales.shape}"
            )
        ds = tuple(self.decode_scale.shape)
        if ds not in ((), shape[:-2]):
            raise ValueError(f"decode_scale: expected shape () or {shape[:-2]}, got {ds}")
        if self.decode_scale.dtype != jnp.float32:
            raise TypeError(f"decode_scale: expected float32, got {self.decode_scale.dtype}")
        return self

    # -- conveniences ----------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def linear_scales(self) -> jax.Array:
        """Scales in the linear layout ``[..., K/16]`` (float8_e4m3fn)."""
        if self.layout == "linear":
            return self.scales
        rows = self.shape[-2]
        return unswizzle(self.scales, rows, self.shape[-1] // BLOCK, self.layout)

    def with_layout(self, layout: str) -> NVFP4Array:
        """The same tensor with its scales in ``layout`` (padding written as zero scales)."""
        if layout == self.layout:
            return self
        s = self.linear_scales()
        if layout != "linear":
            s = swizzle(s, layout)
        return NVFP4Array.from_parts(self.codes, s, self.decode_scale, layout=layout, shape=self.shape)

    def __repr__(self) -> str:
        return f"NVFP4Array(shape={self.shape}, layout={self.layout!r})"


def _batched_shape(shape: tuple[int, ...], codes: Any) -> tuple[int, ...]:
    """The logical shape for ``codes`` when a transformation (``vmap``'s output, ``scan``'s or
    ``vmap``'s per-slice input, ``tree.map`` slicing) added or removed leading dimensions of the
    leaves: leading dimensions follow ``codes``; anything else keeps ``shape`` (and ``validate``
    reports the mismatch)."""
    cs = getattr(codes, "shape", None)
    if not isinstance(cs, tuple) or not shape or len(cs) == len(shape):
        return shape
    inner = shape[:-1] + (shape[-1] // 2,)
    if len(cs) > len(shape) and tuple(cs[len(cs) - len(inner):]) == inner:
        return tuple(int(d) for d in cs[: len(cs) - len(inner)]) + tuple(shape)
    if 0 < len(cs) < len(shape) and tuple(cs) == inner[len(inner) - len(cs):]:
        return tuple(shape[len(shape) - len(cs):])
    return shape


# ---------------------------------------------------------------------------------------
# recipes (each: xb [..., nb, 16] f32, vmax [..., nb] f32, g f32 -> (scale f32 values, codes))
# ---------------------------------------------------------------------------------------

def _div(a, b):
    """IEEE fp32 ``a / b`` with numpy broadcasting, as the oracle computes it, on every backend
    whatever XLA's flags (``division.divide``: XLA's divide behind an optimization barrier on
    CPU, where XLA would otherwise rewrite ``x / broadcast(b)`` into ``x * (1/b)``; integer
    long division on GPUs, where XLA's divide is ``div.full.f32``)."""
    return division.divide(a, b)


def _rcp(b):
    """Correctly rounded fp32 ``1 / b`` (a true division, never rewritten)."""
    return _div(jnp.float32(1.0), b)


def _trtllm(xb, vmax, G):
    c6 = jnp.float32(1.0 / 6.0)
    sf = jnp.where(vmax == 0, 0.0, vmax * (G * c6))
    s = F.e4m3_round(sf, "saturate")
    den = s * _rcp(G)
    out_scale = jnp.minimum(_rcp(den), _FLT_MAX)
    y = xb * out_scale[..., None]
    return s, F.e2m1_encode(y)


def _modelopt(xb, vmax, D):
    sf = _div(vmax, jnp.float32(6.0) * D)
    sf = jnp.where(sf == 0, 1.0, sf)
    sf = jnp.clip(sf, 2.0**-9, 448.0)
    s = F.e4m3_round(sf, "saturate")
    y = _div(xb, (s * D)[..., None])
    # ModelOpt _cast_fp4: sign from the scaled value (y < 0), so -0.0 -> code 0
    code = F.e2m1_encode(jnp.abs(y)) | ((y < 0).astype(jnp.uint8) << 3)
    return s, code


def _jax(xb, vmax, D):
    # what XLA runs for jax's quantize: each division by a broadcast is a reciprocal-multiply
    x2 = xb * _rcp(D)
    amax = jnp.max(jnp.abs(x2), axis=-1)
    s = F.e4m3_round(jnp.clip(amax * _rcp(jnp.float32(6.0)), 0.0, 448.0), "nan")
    y = jnp.clip(x2 * _rcp(s)[..., None], -6.0, 6.0)
    return s, F.e2m1_encode(y, nan_code=8)


def _b12x(xb, vmax, G):
    sf = jnp.minimum(_div(vmax * G, jnp.float32(6.0)), 448.0)
    s = F.e4m3_round(sf, "saturate")
    den = jnp.maximum(_div(s, G), jnp.float32(1e-30))
    y = _div(xb, den[..., None])
    return s, F.e2m1_encode(y, negative_zero="never")


def _nan_scale_if_nonfinite(fn):
    """The recipe ``fn`` with a NaN block scale for every block holding a NaN or +-Inf, so its
    values dequantize to NaN (a peer kernel saturates Inf to a finite code; here non-finite input
    stays visible: docs/input-policy.md)."""

    @functools.wraps(fn)
    def run(xb, vmax, g):
        s, codes = fn(xb, vmax, g)
        return jnp.where(vmax <= _FLT_MAX, s, jnp.nan), codes

    return run


_FNS = {"trtllm": (_nan_scale_if_nonfinite(_trtllm), "encode"),
        "modelopt": (_nan_scale_if_nonfinite(_modelopt), "decode"),
        "jax": (_nan_scale_if_nonfinite(_jax), "decode"),
        "b12x": (_nan_scale_if_nonfinite(_b12x), "encode")}


def ieee_div(a, b) -> jax.Array:
    """IEEE fp32 ``a / b`` with numpy broadcasting, never rewritten into a reciprocal-multiply,
    on every backend without XLA flags (the recipes' division, ``division.divide``)."""
    return _div(a, b)


def quantize_blocks(xb, vmax, scale, recipe: str):
    """One recipe's fp32 arithmetic on 16-value blocks: ``xb`` fp32 [..., nb, 16], ``vmax`` fp32
    [..., nb] (each block's max |x|), ``scale`` fp32 (the recipe's global scale: encode form for
    trtllm/b12x, decode form for modelopt/jax) -> (E4M3 block scales as fp32 [..., nb], E2M1
    codes uint8 [..., nb, 16]), bit-exact with ``oracle.quantize``."""
    return _FNS[recipe][0](xb, vmax, scale)


def _scalar(name: str, v) -> jax.Array:
    if jnp.ndim(v) != 0:
        raise ValueError(f"{name}: expected a scalar float32 global scale, got shape "
                         f"{jnp.shape(v)}")
    V.check_positive_scale(name, v, bounds=SCALE_RANGE)
    return jnp.asarray(v, jnp.float32)


def _check_x(x, layout: str):
    V.check_dtype("x", x, V.FLOAT_DTYPES)
    x = jnp.asarray(x)
    if x.ndim < 1 or x.shape[-1] % BLOCK or x.shape[-1] == 0:
        raise ValueError(f"x: last dimension must be a positive multiple of {BLOCK}, got shape "
                         f"{x.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if layout != "linear" and x.ndim < 2:
        raise ValueError(f"layout: {layout} needs x of rank >= 2, got shape {x.shape}")
    V.check_finite("x", x)
    return x


def quantize(
    x: jax.Array,
    recipe: str = "trtllm",
    *,
    encode_scale=None,
    decode_scale=None,
    layout: str = "linear",
) -> NVFP4Array:
    """Quantize ``x[..., K]`` (bf16/fp16/fp32; K a positive multiple of 16) to an NVFP4Array.

    Exactly one of ``encode_scale`` (G = 2688/amax, what TensorRT-LLM kernels take) and
    ``decode_scale`` (D = amax/2688, what ModelOpt checkpoints store) may be given (an fp32
    scalar in ``SCALE_RANGE`` = [2^-117, 2^117]); the other is derived with one fp32
    reciprocal. With neither, it follows from ``max|x|`` (``fp32(amax/2688)`` or
    ``fp32(2688/amax)`` in the recipe's native convention); an all-zero tensor (or one with
    ``max|x| < TINY_AMAX``) gets ``1.0`` and dequantizes to zeros. fp32 subnormal inputs are
    read as signed zero. Jittable;
    bit-exact with ``oracle.quantize(x, recipe, ...)`` on CPU and on GPUs, with or without
    XLA's division flag (``device.IEEE_DIV_FLAG``): every division is ``division.divide``.

    Non-finite input (docs/input-policy.md): a concrete ``x`` holding NaN/Inf raises ValueError;
    a traced one gives NaN block scales for its blocks and a NaN ``decode_scale`` (under
    :func:`nvfp4_jax.checked` it raises). ``jax.vmap(quantize)`` gives a stacked array with one
    decode scale per slice (what :func:`quantize_experts` returns for a stack of experts).
    """
    if recipe not in _FNS:
        raise ValueError(f"recipe: expected one of {JAX_RECIPES} (the oracle has more), got {recipe!r}")
    x = _check_x(x, layout)
    if encode_scale is not None and decode_scale is not None:
        raise ValueError("pass only one of encode_scale (G = 2688/amax) and decode_scale (D = amax/2688)")
    if encode_scale is not None:
        encode_scale = _scalar("encode_scale", encode_scale)
    if decode_scale is not None:
        decode_scale = _scalar("decode_scale", decode_scale)
    return _quantize(x, recipe, encode_scale, decode_scale, layout)


def _quantize(x, recipe, encode_scale, decode_scale, layout) -> NVFP4Array:
    fn, native = _FNS[recipe]
    xf = x.astype(jnp.float32)
    # subnormals read as signed zero on every device (XLA:CPU flushes them; the oracle does too)
    xf = jnp.where(jnp.abs(xf) < FP32_TINY, xf * 0.0, xf)
    xb = xf.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))
    vmax = jnp.max(jnp.abs(xb), axis=-1)
    amax = jnp.max(vmax)  # NaN or Inf when x holds a non-finite value
    if encode_scale is None and decode_scale is None:
        tiny = amax < TINY_AMAX  # all zeros (or no normal fp32 global scale): 1.0
        if native == "decode":
            decode_scale = jnp.where(tiny, jnp.float32(1.0), _div(amax, jnp.float32(2688.0)))
        else:
            encode_scale = jnp.where(tiny, jnp.float32(1.0), _div(jnp.float32(2688.0), amax))
    if encode_scale is not None:
        G = jnp.asarray(encode_scale, jnp.float32)
        D = _rcp(G)
    else:
        D = jnp.asarray(decode_scale, jnp.float32)
        G = _rcp(D)
    g = G if native == "encode" else D
    s, codes = fn(xb, vmax, g)
    D = jnp.where(amax <= _FLT_MAX, D, jnp.nan)  # non-finite input: a visibly NaN tensor
    codes = F.pack_nibbles(codes.reshape(x.shape))
    scales = s.astype(jnp.float8_e4m3fn)  # exact: s is already an E4M3 value
    if layout != "linear":
        scales = swizzle(scales, layout)
    return NVFP4Array(codes, scales, D, tuple(x.shape), layout)


def quantize_experts(w: jax.Array, recipe: str = "modelopt", *,
                     layout: str = "linear") -> NVFP4Array:
    """Quantize a stack of expert weights ``w`` [E, N, K] (bf16/fp16/fp32, K a positive multiple
    of 16) with one global scale per expert, as a ModelOpt MoE checkpoint stores them.

    Returns an :class:`NVFP4Array` of logical shape [E, N, K]: codes uint8 [E, N, K/2], scales
    float8_e4m3fn [E, N, K/16] (``layout="linear"``) and ``decode_scale`` float32 [E] (each
    expert's ``weight_scale_2 = fp32(amax_e/2688)``, 1.0 for an all-zero expert): what
    :func:`nvfp4_jax.moe` takes as ``fc1``/``fc2``. Expert ``e`` is bit-exact with
    ``oracle.quantize(w[e], recipe)``. Jittable; the same as ``jax.vmap(quantize)`` over experts.
    """
    if recipe not in _FNS:
        raise ValueError(f"recipe: expected one of {JAX_RECIPES} (the oracle has more), "
                         f"got {recipe!r}")
    if jnp.ndim(w) != 3:
        raise ValueError(f"w: expected a stack of experts [E, N, K], got shape {jnp.shape(w)}")
    w = _check_x(w, layout)
    return jax.vmap(lambda we: _quantize(we, recipe, None, None, layout))(w)


def _check_array(a) -> None:
    """ValueError naming ``a`` unless it is an :class:`NVFP4Array`."""
    if not isinstance(a, NVFP4Array):
        raise ValueError(f"a: expected an NVFP4Array (nvfp4_jax.quantize's), got "  # noqa: TRY004
                         f"{type(a).__name__}")


def dequantize(a: NVFP4Array, dtype=jnp.float32, *, include_decode_scale: bool = True) -> jax.Array:
    """``e2m1 * e4m3 [* decode_scale]`` as ``dtype`` [..., K].

    Without the decode scale, the values are exact in bf16 (<= 6 significant bits)."""
    _check_array(a)
    vals = F.e2m1_decode(F.unpack_nibbles(a.codes))
    sc = F.e4m3_to_f32(a.linear_scales())
    out = (vals.reshape(vals.shape[:-1] + (-1, BLOCK)) * sc[..., None]).reshape(vals.shape)
    if include_decode_scale:
        d = jnp.asarray(a.decode_scale, jnp.float32)
        out = out * d.reshape(d.shape + (1,) * (out.ndim - d.ndim))
    return out.astype(dtype)


def from_oracle(t, layout: str = "linear") -> NVFP4Array:
    """An :class:`NVFP4Array` holding the bytes of an ``oracle.NVFP4``."""
    codes = jnp.asarray(t.codes)
    scales = jax.lax.bitcast_convert_type(jnp.asarray(t.scales), jnp.float8_e4m3fn)
    a = NVFP4Array.from_parts(codes, scales, jnp.asarray(t.decode_scale, jnp.float32))
    return a.with_layout(layout)


def to_oracle(a: NVFP4Array):
    """The ``oracle.NVFP4`` holding the bytes of ``a`` (linear layout)."""
    import oracle

    _check_array(a)
    s = np.asarray(F.e4m3_bytes(a.linear_scales()))
    return oracle.NVFP4(np.asarray(a.codes), s, np.asarray(a.decode_scale, np.float64))
