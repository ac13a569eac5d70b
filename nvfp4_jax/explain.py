"""Explain a wrong NVFP4 GEMM output: where it is wrong, and which known fault reproduces it.

``nvfp4 explain FILE.npz`` (or :func:`explain_gemm`) takes the operands one GEMM call received
and the output it returned, compares the output with the exact oracle under the derived
fp32-accumulation bound (``oracle.gemm_error_bound``), and, when it is wrong:

1. **localises** the wrong elements: how many, which rows (tokens) and columns (output
   features), whether they form aligned tiles (an unwritten or poisoned output tile), NaN,
   Inf and exact zeros;
2. **tests hypotheses**: each is the oracle recomputed with one known fault injected into the
   operands, and it explains the output where the output lies within that candidate's own
   bound everywhere. The faults are those that have shipped or that a kernel author hits
   first: the output off by a scalar (an alpha without ``weight_scale_2`` or the input scale,
   or with it twice); weight (or activation) scale bytes read in the other layout (linear
   vs ``swizzled_128x4``); nibbles in the other order; the sign bit of E2M1 ignored; scale
   bytes decoded as UE8M0 (MXFP4's) instead of E4M3; ``weight_scale_2`` folded into the E4M3
   block scales (TensorRT-LLM's CUTEDSL-b12x MoE path, #21461: products fall into E4M3
   subnormals); one split-K partial missing, or only one present; W4A4 run as W4A16; the
   input scale used as the encode scale; the fast-math TensorRT-LLM quantizer; activations
   quantized by b12x's / FlashInfer's SM12x quantizer before their E4M3-subnormal decode fix
   (``nvfp4_jax.interop.scale_decode``: such blocks come out up to 4.5x too small);
3. **attributes** a column's (row's) error to one 16-value K block where the error is a
   multiple of that block's contribution across all rows (columns): one weight (activation)
   scale byte read wrong.

Two call forms (keys of the ``.npz``; scale bytes as uint8):

* ``nvfp4_gemm`` (TensorRT-LLM's op): ``act_fp4`` uint8 [M, K/2], ``act_sf`` [M, K/16] (or
  the flat ``swizzled_128x4`` bytes), ``weight_fp4`` uint8 [N, K/2], ``weight_sf`` [N, K/16]
  (or flat swizzled), ``alpha`` (fp32: input_scale * weight_scale_2);
* linear layer: ``x`` [M, K] (bf16/fp16 values, any float dtype), ``weight_fp4``,
  ``weight_sf``, ``weight_scale_2`` and, for W4A4 (TensorRT-LLM linear semantics: ``x``
  quantized with the ``trtllm`` recipe and ``G = 1 / input_scale``), ``input_scale``;

plus ``out`` [M, N] (any float dtype). A 2-D scale array is the linear layout; a 1-D one is
``swizzled_128x4`` (``weight_sf_layout`` / ``act_sf_layout`` may say so explicitly). Only the
oracle (numpy) runs here: nothing needs a GPU, JAX or torch.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
import zipfile
import zlib

import numpy as np

import oracle
from oracle.formats import bf16_round, e2m1_decode, e4m3_decode, e4m3_encode, f32, unpack_nibbles
from oracle.layouts import padded_shape, swizzle, unswizzle

from .interop import scale_decode

BLOCK = 16
OUT_DTYPES = ("bfloat16", "float16", "float32")
_OUT_U = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}
SCALE_LAYOUTS = ("linear", "swizzled_128x4")


# ---------------------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GemmCase:
    """The operands of one NVFP4 GEMM call, as the backend received them.

    weight: ``oracle.NVFP4`` [N, K] (linear scales; ``decode_scale`` = weight_scale_2 in the
    linear-layer form, 1.0 in the ``nvfp4_gemm`` form). Exactly one of ``x`` (float64 [M, K]
    holding bf16/fp16 values: W4A16, or W4A4 quantized on the fly when ``input_scale`` is set)
    and ``act`` (``oracle.NVFP4`` [M, K], prequantized, decode_scale 1.0). ``alpha``: the fp32
    factor applied to the dot (``input_scale * weight_scale_2``, or ``weight_scale_2`` for
    W4A16). ``*_sf_layout``: the layout the caller's scale bytes were in. ``splits``: split-K
    partials the backend adds after its fp32 accumulation (widens the bound).
    """

    weight: oracle.NVFP4
    alpha: float
    x: np.ndarray | None = None
    act: oracle.NVFP4 | None = None
    input_scale: float | None = None
    weight_scale_2: float | None = None
    out_dtype: str = "bfloat16"
    weight_sf_layout: str = "linear"
    act_sf_layout: str = "linear"
    splits: int = 1

    def __post_init__(self) -> None:
        if (self.x is None) == (self.act is None):
            raise ValueError("GemmCase: give exactly one of x (float [M, K]) and act (NVFP4 [M, K])")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype: expected one of {OUT_DTYPES}, got {self.out_dtype!r}")
        for name in ("weight_sf_layout", "act_sf_layout"):
            if getattr(self, name) not in SCALE_LAYOUTS:
                raise ValueError(f"{name}: expected one of {SCALE_LAYOUTS}, got {getattr(self, name)!r}")
        k = self.weight.codes.shape[-1] * 2
        k_act = self.x.shape[-1] if self.x is not None else self.act.codes.shape[-1] * 2
        if self.weight.codes.ndim != 2 or k_act != k:
            raise ValueError(f"GemmCase: weight must be [N, K] and the activation [M, K] with the same K; "
                             f"got weight codes {self.weight.codes.shape}, activation K {k_act}")
        if self.splits < 1:
            raise ValueError(f"splits: expected >= 1, got {self.splits}")

    @property
    def mode(self) -> str:
        """``w4a16``, ``w4a4`` (quantized on the fly) or ``w4a4_prequantized``."""
        if self.act is not None:
            return "w4a4_prequantized"
        return "w4a16" if self.input_scale is None else "w4a4"

    @property
    def shape(self) -> tuple[int, int, int]:
        m = self.x.shape[0] if self.x is not None else self.act.codes.shape[0]
        n, k2 = self.weight.codes.shape
        return m, n, 2 * k2

    @classmethod
    def from_linear(cls, x, weight_fp4, weight_sf, weight_scale_2, input_scale=None, *,
                    weight_sf_layout: str | None = None, out_dtype: str = "bfloat16",
                    splits: int = 1) -> GemmCase:
        """The linear-layer form: W4A16 without ``input_scale``, W4A4 with it (ModelOpt decode
        form; TensorRT-LLM quantizes x with ``G = 1 / input_scale``)."""
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating) or x.ndim != 2:
            raise ValueError(f"x: expected a float [M, K] array, got {x.dtype} {x.shape}")
        codes = _u8(weight_fp4, "weight_fp4")
        layout, s = _linear_scales(weight_sf, codes.shape[0], codes.shape[1] // 8, weight_sf_layout, "weight_sf")
        ws2 = float(f32(weight_scale_2))
        w = oracle.NVFP4(codes, s, ws2)
        alpha = ws2 if input_scale is None else float(f32(float(f32(input_scale)) * ws2))
        return cls(weight=w, alpha=alpha, x=x.astype(np.float64),
                   input_scale=None if input_scale is None else float(f32(input_scale)),
                   weight_scale_2=ws2, out_dtype=out_dtype, weight_sf_layout=layout, splits=splits)

    @classmethod
    def from_nvfp4_gemm(cls, act_fp4, act_sf, weight_fp4, weight_sf, alpha, *,
                        act_sf_layout: str | None = None, weight_sf_layout: str | None = None,
                        out_dtype: str = "bfloat16", splits: int = 1) -> GemmCase:
        """TensorRT-LLM's ``nvfp4_gemm(act_fp4, weight_fp4, act_sf, weight_sf, alpha)`` form."""
        a_codes, w_codes = _u8(act_fp4, "act_fp4"), _u8(weight_fp4, "weight_fp4")
        a_layout, a_s = _linear_scales(act_sf, a_codes.shape[0], a_codes.shape[1] // 8, act_sf_layout, "act_sf")
        w_layout, w_s = _linear_scales(weight_sf, w_codes.shape[0], w_codes.shape[1] // 8, weight_sf_layout,
                                       "weight_sf")
        return cls(weight=oracle.NVFP4(w_codes, w_s, 1.0), act=oracle.NVFP4(a_codes, a_s, 1.0),
                   alpha=float(f32(alpha)), out_dtype=out_dtype, weight_sf_layout=w_layout,
                   act_sf_layout=a_layout, splits=splits)


def _u8(a, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.uint8:
        hint = " (float8 bytes: view them as uint8 first)" if "float8" in str(a.dtype) else ""
        raise TypeError(f"{name}: expected uint8 bytes, got dtype {a.dtype}{hint}")
    if name.endswith("fp4") and a.ndim != 2:
        raise ValueError(f"{name}: expected packed codes [rows, K/2], got shape {a.shape}")
    return a


def _linear_scales(sf, rows: int, cols: int, layout: str | None, name: str) -> tuple[str, np.ndarray]:
    """(the layout the bytes were in, linear scales [rows, cols])."""
    sf = _u8(sf, name)
    if layout is None:
        layout = "linear" if sf.ndim == 2 and sf.shape == (rows, cols) else "swizzled_128x4"
    if layout not in SCALE_LAYOUTS:
        raise ValueError(f"{name}_layout: expected one of {SCALE_LAYOUTS}, got {layout!r}")
    if layout == "linear":
        if sf.shape != (rows, cols):
            raise ValueError(f"{name}: expected linear scales [{rows}, {cols}] (one per 16 values) or the flat "
                             f"swizzled_128x4 bytes, got shape {sf.shape}")
        return layout, sf
    return layout, unswizzle(sf.reshape(-1), rows, cols, "swizzled_128x4")


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, read without pickle (``allow_pickle=False``).

    Raises FileNotFoundError for a missing file and ValueError naming ``path`` for anything that
    is not a readable ``.npz`` (a zip of ``.npy`` arrays): another format, a truncated or damaged
    archive, an object (pickled) array.
    """
    with open(path, "rb") as f:
        head = f.read(6)
    if head[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
        what = "a single .npy array" if head == b"\x93NUMPY" else f"it starts with {head!r}"
        raise ValueError(f"{path}: not an .npz file (a zip archive of .npy arrays, as np.savez "
                         f"writes); {what}")
    try:
        with zipfile.ZipFile(path) as zf:  # each array's declared size against what the zip holds
            for info in zf.infolist():
                with zf.open(info) as fp:
                    ver = np.lib.format.read_magic(fp)
                    read = (np.lib.format.read_array_header_1_0 if ver == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(fp)
                if dtype.hasobject:
                    raise ValueError(f"{path}: array {info.filename.removesuffix('.npy')!r} holds "
                                     "Python objects (pickled data, not read: allow_pickle=False); "
                                     "save numeric arrays")
                if math.prod(shape) * dtype.itemsize > info.file_size:
                    raise ValueError(f"{path}: array {info.filename!r} declares shape {shape} "
                                     f"{dtype}, more than the {info.file_size} bytes it holds")
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError,
            RuntimeError, KeyError, TypeError, struct.error) as exc:
        if str(exc).startswith(f"{path}: "):
            raise
        msg = f"{path}: damaged or truncated .npz ({type(exc).__name__}: {exc})"
        raise ValueError(msg) from None


def load_npz(path: str, *, out_key: str = "out", out_dtype: str = "bfloat16",
             splits: int = 1) -> tuple[GemmCase, np.ndarray]:
    """(case, output) from an ``.npz`` in either form (module docstring)."""
    z = read_npz(path)
    if out_key not in z:
        raise ValueError(f"{path}: no output array {out_key!r} (keys: {sorted(z)})")
    out = np.asarray(z[out_key], dtype=np.float64)
    return load_npz_case(path, out_dtype=out_dtype, splits=splits), out


def load_npz_case(path: str, *, out_dtype: str = "bfloat16", splits: int = 1) -> GemmCase:
    """The call (operands only) from an ``.npz`` in either form (module docstring)."""
    d = read_npz(path)
    lay = {k: str(d[k]) for k in ("weight_sf_layout", "act_sf_layout") if k in d}
    if "act_fp4" in d:
        missing = [k for k in ("act_sf", "weight_fp4", "weight_sf", "alpha") if k not in d]
        if missing:
            raise ValueError(f"{path}: the nvfp4_gemm form needs act_fp4, act_sf, weight_fp4, weight_sf, alpha; "
                             f"missing {missing}")
        case = GemmCase.from_nvfp4_gemm(d["act_fp4"], d["act_sf"], d["weight_fp4"], d["weight_sf"],
                                        float(d["alpha"]), act_sf_layout=lay.get("act_sf_layout"),
                                        weight_sf_layout=lay.get("weight_sf_layout"), out_dtype=out_dtype,
                                        splits=splits)
    elif "x" in d:
        missing = [k for k in ("weight_fp4", "weight_sf", "weight_scale_2") if k not in d]
        if missing:
            raise ValueError(f"{path}: the linear form needs x, weight_fp4, weight_sf, weight_scale_2 "
                             f"[, input_scale]; missing {missing}")
        case = GemmCase.from_linear(d["x"], d["weight_fp4"], d["weight_sf"], float(d["weight_scale_2"]),
                                    float(d["input_scale"]) if "input_scale" in d else None,
                                    weight_sf_layout=lay.get("weight_sf_layout"), out_dtype=out_dtype,
                                    splits=splits)
    else:
        raise ValueError(f"{path}: expected act_fp4 (nvfp4_gemm form) or x (linear form); keys: {sorted(d)}")
    return case


def save_npz(path: str, case: GemmCase, out=None) -> None:
    """Write ``case`` (and ``out``) in the form :func:`load_npz` reads, scales in their layouts."""
    d: dict[str, np.ndarray] = {}
    d["weight_fp4"] = case.weight.codes
    d["weight_sf"] = swizzle(case.weight.scales, case.weight_sf_layout)
    d["weight_sf_layout"] = np.array(case.weight_sf_layout)
    if case.act is not None:
        d["act_fp4"] = case.act.codes
        d["act_sf"] = swizzle(case.act.scales, case.act_sf_layout)
        d["act_sf_layout"] = np.array(case.act_sf_layout)
        d["alpha"] = np.float32(case.alpha)
    else:
        d["x"] = case.x.astype(np.float32)
        d["weight_scale_2"] = np.float32(case.weight_scale_2)
        if case.input_scale is not None:
            d["input_scale"] = np.float32(case.input_scale)
    if out is not None:
        d["out"] = np.asarray(out, dtype=np.float32)
    np.savez(path, **d)


# ---------------------------------------------------------------------------------------
# Oracle values under a fault
# ---------------------------------------------------------------------------------------

def _values(t: oracle.NVFP4) -> np.ndarray:
    return oracle.dequantize(t, include_decode_scale=False)


def _values_with(codes: np.ndarray, scales_f64: np.ndarray) -> np.ndarray:
    """E2M1 codes (packed) times arbitrary float64 block scales [rows, K/16]."""
    v = e2m1_decode(unpack_nibbles(codes)).astype(np.float64)
    return (v.reshape(*v.shape[:-1], -1, BLOCK) * scales_f64[..., None]).reshape(v.shape)


def _swap_nibbles(codes: np.ndarray) -> np.ndarray:
    return ((codes >> 4) | (codes << 4)).astype(np.uint8)


def _other_layout(scales: np.ndarray, layout: str) -> np.ndarray:
    """Linear scales [rows, cols] as a backend sees them when it reads the caller's bytes
    (stored in ``layout``) as the other layout."""
    rows, cols = scales.shape
    if layout == "linear":  # linear bytes read as swizzled_128x4
        mp, kp = padded_shape(rows, cols, "swizzled_128x4")
        flat = np.zeros(mp * kp, np.uint8)
        raw = scales.reshape(-1)
        flat[: min(raw.size, flat.size)] = raw[: flat.size]
        return unswizzle(flat, rows, cols, "swizzled_128x4")
    raw = swizzle(scales, "swizzled_128x4").reshape(-1)  # swizzled bytes read as linear
    return raw[: rows * cols].reshape(rows, cols)


@dataclasses.dataclass(frozen=True)
class _Operands:
    a: np.ndarray  # [M, K] values the dot sees (activation; no global scale)
    w: np.ndarray  # [N, K]
    alpha: float
    act: oracle.NVFP4 | None = None  # the quantized activation behind ``a`` (None: W4A16)


def _base(case: GemmCase) -> _Operands:
    w = _values(case.weight)
    if case.mode == "w4a16":
        return _Operands(case.x, w, case.alpha)
    act = case.act
    if case.mode == "w4a4":
        act = oracle.quantize(case.x, "trtllm", encode_scale=float(f32(1.0 / case.input_scale)))
    return _Operands(_values(act), w, case.alpha, act)


def _byte_faults(role: str, label: str, t: oracle.NVFP4, layout: str, put) -> list[tuple[str, str, _Operands]]:
    """An operand's scale bytes read in the other layout, and its codes with the nibbles
    swapped; ``put(codes, scales)`` -> the operands with this one replaced."""
    other = "swizzled_128x4" if layout == "linear" else "linear"
    return [(f"{role}_sf_layout", f"the {label} scale bytes ({layout}) were read as {other}",
             put(t.codes, _other_layout(t.scales, layout))),
            (f"{role}_nibbles", f"the {label} codes were read with the nibbles swapped (element 2j in the high nibble)",
             put(_swap_nibbles(t.codes), t.scales))]


def _hypotheses(case: GemmCase, base: _Operands) -> list[tuple[str, str, _Operands]]:
    """(name, what it means, operands) of each fault that applies to ``case``."""
    w = case.weight

    def weights(codes, scales):
        return dataclasses.replace(base, w=_values(oracle.NVFP4(codes, scales, 1.0)))

    def acts(codes, scales):
        return dataclasses.replace(base, a=_values(oracle.NVFP4(codes, scales, 1.0)))

    out = _byte_faults("weight", "weight", w, case.weight_sf_layout, weights)
    out.append(("weight_e2m1_unsigned", "the weights' E2M1 sign bits were ignored",
                weights((w.codes & 0x77).astype(np.uint8), w.scales)))
    ue8m0 = np.exp2(w.scales.astype(np.float64) - 127.0)
    out.append(("weight_sf_ue8m0", "the weight scale bytes were decoded as UE8M0 (MXFP4's 2^(b-127)) instead of E4M3",
                dataclasses.replace(base, w=_values_with(w.codes, ue8m0))))
    if case.weight_scale_2 is not None:
        ws2 = case.weight_scale_2
        folded = e4m3_encode(e4m3_decode(w.scales) * ws2)
        meaning = (f"weight_scale_2 ({ws2:.4g}) was folded into the E4M3 block scales and dropped from alpha "
                   "(TensorRT-LLM's CUTEDSL-b12x MoE path, #21461)")
        out.append(("weight_scale_folded", meaning,
                    dataclasses.replace(base, w=_values(oracle.NVFP4(w.codes, folded, 1.0)),
                                        alpha=float(f32(base.alpha / ws2)))))
    if case.act is not None:
        out += _byte_faults("act", "activation", case.act, case.act_sf_layout, acts)
    if case.mode == "w4a4":
        s = case.input_scale
        meaning = "the activations were not quantized (W4A16 arithmetic; alpha = input_scale * weight_scale_2 kept)"
        out.append(("w4a4_as_w4a16", meaning, dataclasses.replace(base, a=case.x)))
        enc = oracle.quantize(case.x, "trtllm", encode_scale=float(f32(s)))
        meaning = "the input scale was used as the encode scale G (it is the ModelOpt decode scale: G = 1 / input_scale)"
        out.append(("input_scale_as_encode", meaning, dataclasses.replace(base, a=_values(enc))))
        fast = oracle.quantize(case.x, "trtllm_fast", encode_scale=float(f32(1.0 / s)))
        meaning = "the activations came from TensorRT-LLM's fast-math quantizer (rcp.approx; a legitimate variant)"
        out.append(("trtllm_fast_quantizer", meaning, dataclasses.replace(base, a=_values(fast))))
        old = scale_decode.quantize(case.x, float(f32(1.0 / s)), decoder="pre_fix")
        if np.any((old.scales > 0) & (old.scales < 8)):  # only subnormal scale bytes decode wrong
            meaning = ("the activations were quantized dividing by a wrongly decoded "
                       "E4M3-subnormal block scale (2^-7 (1 + m/8) instead of m 2^-9, up to 4.5x; "
                       "b12x <= 1.3.0 before PR #388, FlashInfer < 0.6.17 before PR #3932), "
                       "the stored scale byte right")
            out.append(("act_sf_subnormal_decode", meaning,
                        dataclasses.replace(base, a=_values(old))))
    return out


def _split_bounds(k: int, s: int) -> list[int]:
    unit = 256 if k % 256 == 0 and k // 256 >= s else BLOCK
    steps = k // unit
    return [unit * round(steps * i / s) for i in range(s + 1)]


# ---------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Hypothesis:
    name: str
    meaning: str
    match: float  # share of outputs within this candidate's bound


@dataclasses.dataclass
class Explanation:
    """What :func:`explain_gemm` found. ``verdict``: "correct", "explained" (``best`` reproduces
    every output within its bound), "localised" (no hypothesis does, but every wrong column or
    row is one K block's contribution off by a factor: ``attribution`` names the scale bytes)
    or "unexplained"."""

    mode: str
    shape: tuple[int, int, int]
    verdict: str
    reason: str
    bad: int
    total: int
    worst: dict  # the element of largest |out - oracle| / bound
    margin: float  # that largest ratio (<= 1: correct; inf: a NaN or Inf output)
    best: Hypothesis | None
    oracle_match: float
    hypotheses: list[Hypothesis]
    localisation: dict
    attribution: list[dict]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=float)

    def format(self) -> str:
        m, n, k = self.shape
        head = f"NVFP4 GEMM [{m} x {k}] @ [{n} x {k}]^T ({self.mode}): {self.bad} of {self.total} outputs"
        lines = [head + " outside the derived bound"]
        if self.verdict == "correct":
            lines.append("verdict: correct (every output within the fp32-accumulation bound of the exact oracle)")
            return "\n".join(lines)
        wv = self.worst
        lines.append(f"worst: [{wv['m']}, {wv['n']}] output {wv['out']:.6g}, oracle {wv['oracle']:.6g}, "
                     f"bound {wv['bound']:.3g}")
        loc = self.localisation
        lines.append(f"where: rows {loc['rows']}; columns {loc['columns']}")
        for key in ("nan", "inf", "zero"):
            if loc[key]:
                lines.append(f"  {loc[key]} {key.upper() if key != 'zero' else 'exact zeros where the oracle is not'}")
        if loc.get("tiles"):
            lines.append(f"  the wrong outputs are whole aligned tiles: {loc['tiles']}")
        if self.verdict == "explained":
            lines.append(f"verdict: explained by {self.reason} (every output within that candidate's bound)")
        elif self.verdict == "localised":
            lines.append(f"verdict: localised to {self.reason}")
        else:
            lines.append("verdict: unexplained by the known faults")
        better = [h for h in self.hypotheses if h.match > self.oracle_match]
        lines.append(f"hypotheses reproducing more outputs than the oracle ({100 * self.oracle_match:.2f} %):"
                     + ("" if better else " none"))
        for h in better[:8]:
            lines.append(f"  {100 * h.match:6.2f} %  {h.name}: {h.meaning}")
        for a in self.attribution:
            lines.append(f"  {a['axis']} {a['index']}: the error is {a['factor']:+.4g} x K block {a['block']}'s "
                         f"contribution (K {16 * a['block']}..{16 * a['block'] + 15}; {a['operand']} scale byte "
                         f"0x{a['scale_byte']:02x} = {a['scale']:.4g}; as if it were {a['as_if']:.4g})")
        return "\n".join(lines)


def _ranges(idx: np.ndarray) -> str:
    """'0-7, 12, 64-127' for sorted indices."""
    if idx.size == 0:
        return "none"
    parts, start, prev = [], int(idx[0]), int(idx[0])
    for i in map(int, idx[1:]):
        if i != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = i
        prev = i
    parts.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(parts[:12]) + (f", ... ({len(parts)} ranges)" if len(parts) > 12 else "")


def _tiles(bad: np.ndarray) -> str | None:
    """The largest aligned tile [tm, tn] (tm, tn in 8..128) in which ``bad`` is constant, if
    the bad set is a union of such tiles (and not the whole output)."""
    m, n = bad.shape
    if bad.all() or not bad.any():
        return None
    for tm in (128, 64, 32, 16, 8):
        for tn in (128, 64, 32, 16, 8):
            if m % tm or n % tn:
                continue
            t = bad.reshape(m // tm, tm, n // tn, tn)
            if (t.all(axis=(1, 3)) == t.any(axis=(1, 3))).all():
                hit = np.argwhere(t.any(axis=(1, 3)))
                shown = ", ".join(f"[{i * tm}:{(i + 1) * tm}, {j * tn}:{(j + 1) * tn}]" for i, j in hit[:6])
                more = f" and {len(hit) - 6} more" if len(hit) > 6 else ""
                return f"{len(hit)} tile(s) of {tm} x {tn}: {shown}{more}"
    return None


def _attribute(out, ref, bound, ops: _Operands, case: GemmCase, bad: np.ndarray, limit: int = 8) -> list[dict]:
    """Columns (rows) whose error is one K block's contribution times a factor, consistently
    over all rows (columns): one weight (activation) scale byte read wrong."""
    m, n, k = case.shape
    nb = k // BLOCK
    res = []
    a_b = ops.a.reshape(m, nb, BLOCK)
    w_b = ops.w.reshape(n, nb, BLOCK)
    d = np.where(np.isfinite(out), out - ref, np.nan)
    act = ops.act
    for axis, count, size in (("column", bad.sum(0), m), ("row", bad.sum(1), n)):
        if size < 4 or (axis == "row" and act is None):
            # a block's factor is not identifiable from fewer than 4 outputs; W4A16 rows have
            # no activation scales to blame
            continue
        for i in np.argsort(-count)[:limit]:
            if count[i] == 0:
                break
            if axis == "column":
                contrib = ops.alpha * np.einsum("mbk,bk->mb", a_b, w_b[i])  # [M, nb]
                di, bi = d[:, i], bound[:, i]
            else:
                contrib = ops.alpha * np.einsum("bk,nbk->nb", a_b[i], w_b)  # [N, nb]
                di, bi = d[i], bound[i]
            if not np.isfinite(di).all():
                continue
            den = (contrib * contrib).sum(0)
            r = np.where(den > 0, contrib.T @ di / np.where(den > 0, den, 1.0), 0.0)
            resid = np.abs(di[:, None] - contrib * r[None, :])
            # the fitted term must bring every output of the line within its bound and account
            # for the error where the line is wrong
            wrong = bad[:, i] if axis == "column" else bad[i]
            fits = (resid <= bi[:, None]).all(0) & (np.abs(contrib * r[None, :])[wrong] > bi[wrong, None]).all(0)
            if not fits.any():
                continue
            j = int(np.flatnonzero(fits)[np.argmin(resid.sum(0)[fits])])
            operand = "weight" if axis == "column" else "activation"
            src = case.weight if axis == "column" else act
            byte = int(src.scales[i, j])
            scale = float(e4m3_decode(np.uint8(byte)))
            res.append({"axis": axis, "index": int(i), "block": j, "factor": float(r[j]), "operand": operand,
                        "scale_byte": byte, "scale": scale, "as_if": scale * (1.0 + float(r[j]))})
    return res


def explain_gemm(case: GemmCase, out) -> Explanation:
    """Compare ``out`` [M, N] with the oracle under the derived bound and explain it (module
    docstring). ``out`` may also be [N, M] (reported as a transposed output). The reference
    and every candidate are float64 dots of the exact operand values (``e2m1 * e4m3``,
    bf16 activations) times alpha: their rounding error (~K * 2^-53 relative) is far below
    ``oracle.gemm_error_bound``'s fp32 term, so they stand in for ``oracle.gemm_w4a4``'s
    integer-exact sums at a fraction of the cost."""
    m, n, k = case.shape
    out = np.asarray(out, dtype=np.float64)
    transposed = out.shape == (n, m) and m != n
    if transposed:
        out = out.T
    if out.shape != (m, n):
        raise ValueError(f"out: expected [{m}, {n}] (M x N of the operands), got {out.shape}")
    out_u = _OUT_U[case.out_dtype]
    base = _base(case)

    def candidate(ops: _Operands):
        c = ops.alpha * (ops.a @ ops.w.T)
        b = oracle.gemm_error_bound(np.abs(ops.a), np.abs(ops.w), ops.alpha, c, out_u=out_u, splits=case.splits)
        return c, b

    def match(c, b) -> float:
        return float(np.mean(np.abs(out - c) <= b))  # NaN never matches

    ref, bound = candidate(base)
    bad = ~(np.abs(out - ref) <= bound)
    ratio = np.where(np.isfinite(out), np.abs(out - ref) / bound, np.inf)  # > 1 exactly where bad
    wm, wn = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    worst = {"m": int(wm), "n": int(wn), "out": float(out[wm, wn]), "oracle": float(ref[wm, wn]),
             "bound": float(bound[wm, wn])}
    nbad = int(bad.sum())
    loc = {"rows": _ranges(np.flatnonzero(bad.any(1))), "columns": _ranges(np.flatnonzero(bad.any(0))),
           "nan": int(np.isnan(out).sum()), "inf": int(np.isinf(out).sum()),
           "zero": int(((out == 0) & bad).sum()), "tiles": _tiles(bad), "transposed": transposed}
    if nbad == 0:
        return Explanation(case.mode, (m, n, k), "correct", "every output within the fp32-accumulation bound of "
                           "the exact oracle", 0, out.size, worst, float(ratio.max()), None, 1.0, [], loc, [])

    hyps: list[Hypothesis] = []
    if transposed:
        hyps.append(Hypothesis("transposed", "the output is [N, M]: transposed", match(ref, bound)))
    finite = np.isfinite(out)
    den = float((ref[finite] ** 2).sum())
    if den > 0:
        c = float((ref[finite] * out[finite]).sum() / den)
        if abs(c - 1.0) > 1e-3 and c != 0:
            hyps.append(Hypothesis("alpha", f"the output is the oracle times {c:.6g}{_factor_meaning(c, case)}",
                                   match(c * ref, abs(c) * bound)))
    for name, meaning, ops in _hypotheses(case, base):
        hyps.append(Hypothesis(name, meaning, match(*candidate(ops))))
    for s in (2, 3, 4, 8):
        bounds = _split_bounds(k, s)
        if len(set(bounds)) != s + 1:
            continue
        parts = [candidate(_Operands(base.a[:, lo:hi], base.w[:, lo:hi], base.alpha)) for lo, hi in itertools.pairwise(bounds)]
        for i, (c_i, b_i) in enumerate(parts):
            rng = f"K {bounds[i]}..{bounds[i + 1] - 1}"
            hyps.append(Hypothesis(f"split_k{s}_only_{i}", f"only split-K partial {i} of {s} ({rng}) reached the "
                                   "output", match(c_i, b_i)))
            hyps.append(Hypothesis(f"split_k{s}_missing_{i}", f"split-K partial {i} of {s} ({rng}) is missing from "
                                   "the sum", match(ref - c_i, bound)))
    hyps.sort(key=lambda h: -h.match)
    best = hyps[0] if hyps and hyps[0].match == 1.0 else None
    attribution = [] if best is not None else _attribute(out, ref, bound, base, case, bad)
    if best:
        verdict, reason = "explained", f"{best.name}: {best.meaning}"
    else:
        verdict = "unexplained"
        closest = hyps[0] if hyps else None
        reason = "no known fault reproduces it" + (
            f" (closest: {closest.name}, {100 * closest.match:.1f} % of outputs)" if closest else "")
    if best is None and attribution:
        # every wrong output lies in an attributed column (row) whose whole error is that block's
        cols = {a["index"] for a in attribution if a["axis"] == "column"}
        rows = {a["index"] for a in attribution if a["axis"] == "row"}
        if all(j in cols for j in np.flatnonzero(bad.any(0))) or all(i in rows for i in np.flatnonzero(bad.any(1))):
            verdict = "localised"
            reason = ("single scale bytes: every wrong output is one K block's contribution off by a factor "
                      "(listed below)")
    if best is None and verdict == "unexplained" and loc["tiles"]:
        junk = (~np.isfinite(out) | (out == 0))[bad].all()
        verdict = "localised"
        reason = (f"whole output tiles ({loc['tiles']})" + (
            ", holding NaN, Inf or zeros: tiles the kernel did not write, or wrote from the wrong place"
            if junk else ": a tile-level fault (wrong operand tile, wrong expert or block)"))
    oracle_match = float(1.0 - nbad / out.size)
    return Explanation(case.mode, (m, n, k), verdict, reason, nbad, out.size, worst, float(ratio.max()),
                       best if best else (hyps[0] if hyps else None), oracle_match, hyps, loc, attribution)


def _factor_meaning(c: float, case: GemmCase) -> str:
    """' (= 1 / weight_scale_2: ...)' when ``c`` is a known factor within 0.1 %."""
    named: list[tuple[float, str]] = []  # the most specific first (W4A16: alpha is weight_scale_2)
    if case.weight_scale_2:
        named += [(1.0 / case.weight_scale_2, "weight_scale_2 missing from alpha"),
                  (case.weight_scale_2, "weight_scale_2 applied twice")]
    if case.input_scale:
        named += [(1.0 / case.input_scale, "input_scale missing from alpha"),
                  (case.input_scale, "input_scale applied twice"),
                  (1.0 / case.input_scale**2, "the encode and decode scales confused")]
    named += [(case.alpha, "alpha applied twice"), (1.0 / case.alpha, "alpha not applied")]
    for v, what in named:
        if v and abs(c / v - 1.0) < 1e-3:
            return f" (= {what})"
    e = np.log2(abs(c))
    if abs(e - round(e)) < 1e-6:
        return f" (= 2^{round(e)}{', negated' if c < 0 else ''})"
    return ""


# ---------------------------------------------------------------------------------------
# Demonstrations: a real backend's output with one fault injected
# ---------------------------------------------------------------------------------------

DEMO_FAULTS = ("none", "weight_sf_layout", "weight_nibbles", "weight_scale_folded", "alpha",
               "split_k", "scale_byte", "unwritten_tile")


def spread_case(seed: int, m: int, n: int, k: int, *, decades: tuple[float, float],
                x_scale: float) -> GemmCase:
    """A linear-layer W4A4 call: ModelOpt-quantized weights whose 16-value blocks are spread
    log-uniformly over ``decades`` (powers of ten; five decades put some block scales into
    E4M3's subnormals), bf16 activations ~ N(0, x_scale^2), ``input_scale = amax / 2688``,
    weight scales stored ``swizzled_128x4`` as TensorRT-LLM passes them."""
    if k % BLOCK or m < 1 or n < 1:
        raise ValueError(f"shape: expected M, N >= 1 and K a multiple of 16, got M={m}, N={n}, K={k}")
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(*decades, size=(n, k // BLOCK, 1))
    w = (rng.standard_normal((n, k // BLOCK, BLOCK)) * mag).reshape(n, k).astype(np.float32).astype(np.float64)
    q = oracle.quantize(w, "modelopt")
    x = bf16_round(rng.standard_normal((m, k)) * x_scale)  # bf16 activations, as a layer gets them
    amax = float(np.abs(x).max())
    return GemmCase.from_linear(x, q.codes, swizzle(q.scales, "swizzled_128x4").reshape(-1), float(q.decode_scale),
                                input_scale=float(f32(amax / 2688.0)), weight_sf_layout="swizzled_128x4")


def demo_case(seed: int = 0, m: int = 16, n: int = 256, k: int = 512) -> GemmCase:
    """The ``--demo`` call: :func:`spread_case` with weight blocks over 1e-4.5..1e-1.5
    (``weight_scale_2`` ~ 1e-4..1e-3) and activations of scale 2."""
    return spread_case(seed, m, n, k, decades=(-4.5, -1.5), x_scale=2.0)


def demo_output(case: GemmCase, fault: str) -> np.ndarray:
    """``case``'s output from ``nvfp4_jax.matmul`` (XLA backend) with ``fault`` injected into
    its operands or output; independent of the hypothesis code above."""
    import jax.numpy as jnp

    from . import gemm
    from .quantize import NVFP4Array

    if fault not in DEMO_FAULTS:
        raise ValueError(f"fault: expected one of {DEMO_FAULTS}, got {fault!r}")
    w = case.weight
    codes, scales, ws2 = w.codes, w.scales, case.weight_scale_2
    alpha_scale = 1.0
    if fault == "weight_nibbles":
        codes = ((codes >> 4) | (codes << 4)).astype(np.uint8)
    if fault == "scale_byte":
        scales = scales.copy()
        scales[3, 5] = np.uint8(min(int(scales[3, 5]) + 8, 0x7E))  # one byte off by a power of two
    if fault == "weight_scale_folded":
        scales = e4m3_encode(e4m3_decode(scales) * ws2)
        ws2 = 1.0
    if fault == "alpha":
        alpha_scale = 1.0 / case.weight_scale_2
    layout = "linear"
    raw = scales
    if fault == "weight_sf_layout":  # the swizzled bytes handed over as if linear
        raw = swizzle(scales, "swizzled_128x4").reshape(-1)[: scales.size].reshape(scales.shape)
    arr = NVFP4Array.from_parts(jnp.asarray(codes), jnp.asarray(raw).view(jnp.float8_e4m3fn),
                                jnp.asarray(ws2, jnp.float32), layout=layout)
    x = jnp.asarray(case.x, jnp.bfloat16)
    run = lambda xx, ww: gemm.api.matmul(xx, ww, input_scale=case.input_scale, out_dtype=jnp.float32, backend="xla")
    if fault == "split_k":
        half = case.shape[2] // 2
        left = NVFP4Array.from_parts(jnp.asarray(codes[:, half // 2:]), jnp.asarray(raw[:, half // 16:]).view(jnp.float8_e4m3fn),
                                     jnp.asarray(ws2, jnp.float32))
        return np.asarray(run(x[:, half:], left), np.float64)  # the first half's partial is lost
    out = np.asarray(run(x, arr), np.float64) * alpha_scale
    if fault == "unwritten_tile":
        out[:8, 128:192] = np.nan
    return out
