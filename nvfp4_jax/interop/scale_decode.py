"""The E4M3 scale decode inside b12x's and FlashInfer's SM12x NVFP4 quantizers, by peer version.

Both quantize a block as: scale byte ``s8 = E4M3(min(vmax * G / 6, 448))`` (``cvt.rn.satfinite``,
stored as is), then the values with ``x / (decode(s8) / G)``. The tensor core later decodes the
stored byte correctly; the quantizer decodes it with its own helper (``fp8_e4m3_to_f32``,
``fp8_e4m3_to_f32_and_rcp``), and until the fix that helper was wrong for subnormal bytes:

* ``"pre_fix"`` (b12x <= 1.3.0, e.g. ``local-inference-lab/b12x@36bce2c1:b12x/_lib/intrinsics.py``,
  version 1.2.6; FlashInfer < 0.6.17): PTX ``ex2.approx(e - 7) * fma(m, 0.125, 1.0)`` for every
  exponent field e, with the sign applied and only the all-zero word mapped to 0. For e = 0 that
  is the *normal* formula ``2^-7 * (1 + m/8)`` instead of ``m * 2^-9``: byte 0x01 decodes as
  0.0087890625 instead of 0.001953125 (4.5x), 0x07 as 0.0146484375 instead of 0.013671875
  (1.07x); 0x80 as -2^-7 and 0x7F (NaN) as 480. The quantizer then divides by a scale up to
  4.5x too large, so a block whose scale is an E4M3 subnormal gets codes up to 4.5x too small
  (and, below the E2M1 rounding threshold, zeros), while its stored scale byte is right.
* ``"native"`` (b12x >= 1.5.0 after PR #388, merged 2026-09-17; FlashInfer >= 0.6.17 after
  PR #3932): ``cvt.rn.f16x2.e4m3x2`` then f16 -> f32, exact for every byte.

Versions: b12x wheels 1.3.0 (old decode) and 1.5.0 / 1.5.1 (native) were read; the fix lies
between them (:data:`FIXED_IN`). FlashInfer's fix release 0.6.17 is as vLLM PR #48536 states it
("flashinfer-ai/flashinfer#3932, which shipped in FlashInfer v0.6.17"); the installed 0.7.2.post1
(``flashinfer/cute_dsl/fp4_common.py``) decodes natively. numpy + ml_dtypes only.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

import oracle
from oracle.formats import e2m1_encode, e4m3_decode, e4m3_encode, f32_div, f32_mul, pack_nibbles

Decoder = Literal["native", "pre_fix"]
DECODERS: tuple[str, ...] = ("native", "pre_fix")
#: peer -> (first release with the native decode, the fix, last release read with the old one)
FIXED_IN: dict[str, tuple[str, str, str]] = {
    "b12x": ("1.5.0", "b12x PR #388", "1.3.0"),
    "flashinfer-python": ("0.6.17", "FlashInfer PR #3932", "0.6.16 (not read; per vLLM PR #48536)"),
}
E4M3_MAX = 448.0
BLOCK = 16


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if digits != part:  # 1.5.0rc1, 0.7.2.post1: the release part ends here
            break
    return tuple(out)


def decoder_for(peer: str, version: str) -> Decoder:
    """The scale decode ``peer`` at ``version`` runs: ``"pre_fix"`` before its fix release
    (:data:`FIXED_IN`), ``"native"`` from it on. peer: ``"b12x"`` or ``"flashinfer-python"``."""
    if peer not in FIXED_IN:
        raise ValueError(f"peer: expected one of {tuple(FIXED_IN)}, got {peer!r}")
    v = _version_tuple(str(version))
    if not v:
        raise ValueError(f"version: expected a release number such as '1.5.1', got {version!r}")
    return "native" if v >= _version_tuple(FIXED_IN[peer][0]) else "pre_fix"


def decode(scale_bytes, decoder: Decoder = "native") -> np.ndarray:
    """E4M3 bytes (uint8, any shape) -> the float64 value the quantizer's helper computes
    (fp32-representable; exact in both modes: ``ex2.approx`` of an integer is a power of two)."""
    b = np.asarray(scale_bytes, np.uint8)
    if decoder == "native":
        return e4m3_decode(b)
    if decoder != "pre_fix":
        raise ValueError(f"decoder: expected one of {DECODERS}, got {decoder!r}")
    e = ((b >> 3) & 0xF).astype(np.float64)
    m = (b & 0x7).astype(np.float64)
    v = np.exp2(e - 7.0) * (1.0 + m * 0.125)
    v = np.where((b & 0x80) != 0, -v, v)
    return np.where(b == 0, 0.0, v)


def quantize(x, encode_scale: float, *, decoder: Decoder = "native") -> oracle.NVFP4:
    """b12x's device NVFP4 quantizer with the named scale decode -> ``oracle.NVFP4``
    (decode_scale 1/G, so ``oracle.dequantize`` gives x back).

    x: [..., K] bf16/fp32 values (float array, K a multiple of 16); encode_scale: G =
    2688/amax (fp32). Per block (fp32 ops, b12x ``direct_division``): ``s8 =
    E4M3(min(vmax * G / 6, 448))``, ``y = x / max(decode(s8) / G, 1e-30)``, E2M1 RNE (+0 for
    values that round to zero). With ``decoder="native"`` this is ``oracle.quantize(x,
    "b12x", encode_scale=G)`` byte for byte.
    """
    x = np.asarray(x, np.float64)
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of {BLOCK}, got shape {x.shape}")
    g = float(np.float32(encode_scale))
    if not np.isfinite(g) or g <= 0:
        raise ValueError("encode_scale: expected a positive finite fp32 value, "
                         f"got {encode_scale!r}")
    xb = x.reshape(*x.shape[:-1], -1, BLOCK)
    vmax = np.abs(xb).max(axis=-1)
    sf = np.minimum(f32_div(f32_mul(vmax, g), 6.0), E4M3_MAX)
    s8 = e4m3_encode(sf, "saturate")
    den = np.maximum(f32_div(decode(s8, decoder), g), 1e-30)
    y = f32_div(xb, den[..., None])
    codes = e2m1_encode(y, negative_zero="never").reshape(x.shape)
    return oracle.NVFP4(pack_nibbles(codes), s8, np.float64(f32_div(1.0, g)))
