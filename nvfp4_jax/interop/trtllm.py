"""TensorRT-LLM's NVFP4 arithmetic re-enacted in numpy (float32 ops in TensorRT-LLM's order).

numpy and ml_dtypes only: this is what ``nvfp4 audit`` and ``nvfp4 crosscheck`` run, so the
main job needs no torch. :mod:`nvfp4_jax.interop.trtllm_torch` holds the same arithmetic in
torch and the live bridge to ``torch.ops.trtllm``; ``tests/test_trtllm_numpy.py`` runs both on
the same inputs under live torch and asserts identical bytes and values.

Sources read (nvfp4-semantics.md sections 2, 3 and 3.4; see :data:`SOURCE`):

* :func:`fp4_quantize` = ``torch.ops.trtllm.fp4_quantize`` / ``cvt_warp_fp16_to_fp4``, the
  default fast-math variant (``SF = G * (vmax * rcp(6))``, ``outScale = rcp(SFn * rcp(G))``)
  and the exact one (``TRTLLM_DISABLE_FP4_QUANT_FAST_MATH``). Bit-exact with ``oracle.quantize``
  recipes ``trtllm_fast`` / ``trtllm`` (``rcp.approx.ftz`` is modelled by the correctly rounded
  reciprocal, as in the oracle). The E4M3 cast is :func:`e4m3_saturating`.
* :func:`nvfp4_gemm` = ``torch.ops.trtllm.nvfp4_gemm``: the dot of exact products accumulated
  in float64 (exact for these operands), rounded once to fp32, times the fp32 alpha, cast.
* MoE weight pipelines from a ModelOpt checkpoint to each backend's runtime tensors
  (:class:`MoERuntime`): :func:`cutlass_moe_weights` (``NVFP4CutlassFusedMoEMethod``),
  :func:`cutedsl_b12x_moe_weights` (``NVFP4CuteDslB12xFusedMoEMethod.transform_weights``: the
  scale *folding* ``E4M3(float(w_sf) * w_scale_2[e])``, :func:`fold_block_scales`) and
  :func:`fixed_moe_weights` (FlashInfer ``input_global_scale``, PR #3932, FlashInfer 0.6.17).
* :func:`moe_forward`: the CUTLASS fused-MoE dataflow; :func:`run_pipeline` also models
  ``CuteDslB12xFusedMoE``'s dispatch: a call with ``m >= 64`` rows
  (:data:`PREFILL_VIA_CUTLASS_THRESHOLD`, prefill) runs CUTLASS on the checkpoint scales, only
  ``m < 64`` (decode) runs b12x on the folded ones.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import ml_dtypes
import numpy as np

from . import LiveUnavailable  # noqa: F401 - the error every live bridge raises (re-exported)

E4M3_MAX = 448.0
E2M1_X_E4M3 = 2688.0
BLOCK = 16
FLT_MAX = float(np.finfo(np.float32).max)
#: the TensorRT-LLM sources re-enacted here (no release number: read at these commits)
SOURCE = ("TensorRT-LLM @2a0ce833 quantization.cuh, @02320c35 quantization.py "
          "(NVFP4CuteDslB12xFusedMoEMethod), @1ce053da fused_moe_cute_dsl_b12x.py")
#: ``CuteDslB12xFusedMoE._PREFILL_VIA_CUTLASS_THRESHOLD`` (TRT-LLM @1ce053da): calls with
#: ``x.shape[0] >= 64`` run the CUTLASS NVFP4 GroupGEMM, smaller ones FlashInfer's b12x kernel
PREFILL_VIA_CUTLASS_THRESHOLD = 64

Pipeline = Literal["trtllm_cutlass", "trtllm_cutedsl_b12x", "flashinfer_fixed"]
PIPELINES: tuple[str, ...] = ("trtllm_cutlass", "trtllm_cutedsl_b12x", "flashinfer_fixed")
OUT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}

_F32 = np.float32
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------
# element formats
# ---------------------------------------------------------------------------------------

def e4m3_saturating(x, *, saturate: bool = True) -> np.ndarray:
    """fp32 -> E4M3 bytes (uint8), RNE with subnormals, as torch's ``.to(float8_e4m3fn)``.

    ``saturate=True`` (default): torch >= 2.12 (pytorch PR #178817; torch 2.13 is what this
    project tests with) and CUDA ``__nv_fp8_e4m3``: finite overflow and +-Inf -> +-448.
    ``saturate=False``: torch < 2.12, whose cast (like ml_dtypes') returns NaN (0x7F) from 464
    up (464 itself ties to 448) and for +-Inf. NaN stays NaN either way.
    """
    x = np.asarray(x, np.float32)
    if saturate:
        x = np.clip(x, -E4M3_MAX, E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_values(b) -> np.ndarray:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> float32 values (exact)."""
    b = np.asarray(b)
    if b.dtype != ml_dtypes.float8_e4m3fn:
        b = b.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return b.astype(np.float32)


_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def e2m1_encode(y) -> np.ndarray:
    """fp32 -> E2M1 codes (uint8 0..15) as PTX ``cvt.rn.satfinite.e2m1x2.f32``.

    RNE with ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4),
    saturating at 6; the sign bit follows the fp32 sign bit. NaN -> code 0.
    """
    y = np.nan_to_num(np.asarray(y, np.float32), nan=0.0, posinf=np.inf, neginf=-np.inf)
    a = np.abs(y)
    code = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0)).astype(np.uint8)
    return code | (np.signbit(y).astype(np.uint8) << 3)


def e2m1_decode(codes) -> np.ndarray:
    """E2M1 codes (uint8, any shape) -> float32 values."""
    return _E2M1_VALUES[np.asarray(codes).astype(np.int64)]


def pack_nibbles(codes) -> np.ndarray:
    """codes [..., K] -> bytes [..., K/2]; element 2j in the low nibble (PTX cvt operand order)."""
    codes = np.asarray(codes, np.uint8)
    return ((codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)).astype(np.uint8)


def unpack_nibbles(packed) -> np.ndarray:
    """bytes [..., K/2] -> codes [..., K] (uint8)."""
    packed = np.asarray(packed, np.uint8)
    out = np.stack([packed & 0xF, packed >> 4], axis=-1)
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def swizzle_128x4(scales) -> np.ndarray:
    """Linear scale bytes [..., M, K/16] -> the flat 128x4 layout ``block_scale_interleave``
    writes."""
    scales = np.asarray(scales)
    if scales.dtype != np.uint8:
        scales = scales.view(np.uint8)
    *lead, m, kv = scales.shape
    mp, kp = -(-m // 128) * 128, -(-kv // 4) * 4
    pad = np.zeros((*lead, mp, kp), np.uint8)
    pad[..., :m, :kv] = scales
    nl = len(lead)
    v = pad.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
    v = v.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    return v.reshape(*lead, mp * kp)


def unswizzle_128x4(flat, m: int, kv: int) -> np.ndarray:
    """Inverse of :func:`swizzle_128x4` -> uint8 [..., m, kv]."""
    flat = np.asarray(flat)
    if flat.dtype != np.uint8:
        flat = flat.view(np.uint8)
    *lead, _ = flat.shape
    mp, kp = -(-m // 128) * 128, -(-kv // 4) * 4
    nl = len(lead)
    v = flat.reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
    v = v.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    return np.ascontiguousarray(v.reshape(*lead, mp, kp)[..., :m, :kv])


# ---------------------------------------------------------------------------------------
# quantizer: cvt_warp_fp16_to_fp4 (quantization.cuh)
# ---------------------------------------------------------------------------------------

def cvt_warp_fp16_to_fp4(
    blocks, global_scale, *, fast_math: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """One NVFP4 block per row: ``blocks [..., 16]`` (bf16/fp16/fp32 values), encode scale G
    (fp32, broadcastable to ``blocks.shape[:-1]``) -> (E4M3 scale bytes [...], codes [..., 16]).
    """
    x = np.asarray(blocks, np.float32)
    vmax = np.abs(x).max(axis=-1)  # exact in the input dtype, then widened
    G = np.asarray(global_scale, np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if fast_math:
            rcp6 = _ONE / _F32(6.0)  # rcp.approx.ftz(6) is correctly rounded
            sf = G * (vmax * rcp6)
            s8 = e4m3_saturating(sf)
            sfn = e4m3_values(s8)
            out_scale = np.where(vmax != 0, _ONE / (sfn * (_ONE / G)), _F32(0.0)).astype(np.float32)
        else:
            c6 = _F32(1.0 / 6.0)
            sf = np.where(vmax == 0, _F32(0.0), vmax * (G * c6)).astype(np.float32)
            s8 = e4m3_saturating(sf)
            sfn = e4m3_values(s8)
            out_scale = np.minimum(_ONE / (sfn * (_ONE / G)), _F32(FLT_MAX)).astype(np.float32)
        y = x * out_scale[..., None]  # overflow -> +-inf -> saturates to 6; 0 * inf -> NaN -> 0
    return s8, e2m1_encode(y)


def fp4_quantize(
    x,
    global_scale,
    *,
    fast_math: bool = True,
    sf_layout: Literal["linear", "swizzled_128x4"] = "linear",
) -> tuple[np.ndarray, np.ndarray]:
    """``torch.ops.trtllm.fp4_quantize(x, G, 16, False, swizzled)`` re-enacted.

    x: [..., K] bf16/fp16/fp32 values (any float dtype; K a multiple of 16). global_scale:
    encode scale G = 2688/amax, fp32 of shape [] / [1] or one per row [M] (``x`` 2-D). Returns
    ``(packed uint8 [..., K/2], scale bytes uint8 [..., K/16])`` (linear), or the flat 128x4
    bytes per matrix.
    """
    x = np.asarray(x)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of {BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    x = x.astype(np.float32)
    G = np.asarray(global_scale, np.float64).astype(np.float32)
    if G.size == 1:
        G = G.reshape(())
    elif x.ndim == 2 and G.shape == (x.shape[0],):
        G = G[:, None]
    else:
        raise ValueError(f"global_scale: expected shape [] / [1] or [{x.shape[0]}], "
                         f"got {tuple(G.shape)}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    s8, codes = cvt_warp_fp16_to_fp4(blocks, G, fast_math=fast_math)
    packed = pack_nibbles(codes.reshape(x.shape))
    if sf_layout == "swizzled_128x4":
        return packed, swizzle_128x4(s8)
    if sf_layout != "linear":
        raise ValueError(f"sf_layout: expected 'linear' or 'swizzled_128x4', got {sf_layout!r}")
    return packed, s8


def fp4_values(packed, scales) -> np.ndarray:
    """``e2m1 * e4m3`` [..., K] as float64 (exact; no global scale). Scales linear [..., K/16]."""
    vals = e2m1_decode(unpack_nibbles(packed)).astype(np.float64)
    sc = e4m3_values(scales).astype(np.float64)
    out = vals.reshape(*vals.shape[:-1], -1, BLOCK) * sc[..., None]
    return out.reshape(vals.shape)


def nvfp4_gemm(
    act_fp4, weight_fp4, act_sf, weight_sf, alpha, out_dtype: str = "bfloat16"
) -> np.ndarray:
    """``torch.ops.trtllm.nvfp4_gemm`` re-enacted: ``out[m, n] = alpha * sum_k a * w``.

    act_fp4 uint8 [M, K/2], weight_fp4 uint8 [N, K/2], act_sf / weight_sf E4M3 bytes [M, K/16] /
    [N, K/16] linear, alpha fp32 = input_scale * weight_scale_2 (decode scales). The dot is
    exact, rounded once to fp32; then ``* alpha`` in fp32 and the cast to ``out_dtype``
    (``"bfloat16"``, ``"float16"`` or ``"float32"``; the array has that dtype).
    """
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {tuple(OUT_DTYPES)}, got {out_dtype!r}")
    a = fp4_values(act_fp4, act_sf)
    w = fp4_values(weight_fp4, weight_sf)
    acc = (a @ w.T).astype(np.float32)
    return (acc * np.float32(alpha)).astype(OUT_DTYPES[out_dtype])


# ---------------------------------------------------------------------------------------
# MoE weight pipelines
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MoERuntime:
    """What a fused-MoE NVFP4 kernel is handed (one layer; numpy).

    fc1_weight uint8 [E, R, H/2] (R = I relu2, 2I swiglu, rows in ``gate_up_order``);
    fc1_scales E4M3 bytes uint8 [E, R, H/16] (linear layout; TRT-LLM interleaves them to 128x4,
    which moves bytes but changes no value); fc1_alpha fp32 [E]; fc1_act_scale: fp32 scalar
    encode scale G1 the FC1 input is quantized with; fc2_* likewise ([E, H, I/2], [E, H, I/16]).
    """

    name: str
    fc1_weight: np.ndarray
    fc1_scales: np.ndarray
    fc1_alpha: np.ndarray
    fc1_act_scale: np.float32
    fc2_weight: np.ndarray
    fc2_scales: np.ndarray
    fc2_alpha: np.ndarray
    fc2_act_scale: np.float32
    activation: str = "relu2"
    gate_up_order: str = "up_gate"


def _stack_parts(w):
    """oracle.NVFP4 stack -> (codes uint8, scale bytes uint8, weight_scale_2 fp32 [E])."""
    codes = np.array(w.codes, np.uint8)
    scales = np.array(w.scales, np.uint8)
    e = w.codes.shape[0]
    ws2 = np.broadcast_to(np.asarray(w.decode_scale, np.float64), (e,)).astype(np.float32)
    return codes, scales, ws2


def _act_encode_scale(input_scale) -> np.float32:
    """``fc31_input_scale = 1 / max_e input_scale`` (fp32; TRT-LLM ``load_quant_scales``)."""
    s = np.asarray(input_scale, np.float64).astype(np.float32).reshape(-1)
    return _ONE / s.max()


def _cutlass_alpha(act_encode, ws2) -> np.ndarray:
    """``fc31_alpha = 1 / (fc31_input_scale * (1 / w_scale_2))`` in fp32
    (``load_expert_fc31_alpha_nvfp4``)."""
    return (_ONE / (np.float32(act_encode) * (_ONE / ws2))).astype(np.float32)


def cutlass_moe_weights(
    fc1, fc2, fc1_input_scale, fc2_input_scale, *, activation: str = "relu2",
    gate_up_order: str = "up_gate",
) -> MoERuntime:
    """``NVFP4CutlassFusedMoEMethod``: checkpoint block scales kept, weight_scale_2 in fp32 alphas.

    fc1/fc2: ``oracle.NVFP4`` stacks as ``oracle.moe`` takes them (decode_scale [E] =
    weight_scale_2); fc1/fc2_input_scale: ModelOpt ``input_scale`` [E] (decode form).
    """
    c1, s1, ws1 = _stack_parts(fc1)
    c2, s2, ws2 = _stack_parts(fc2)
    g1, g2 = _act_encode_scale(fc1_input_scale), _act_encode_scale(fc2_input_scale)
    return MoERuntime("trtllm_cutlass", c1, s1, _cutlass_alpha(g1, ws1), g1,
                      c2, s2, _cutlass_alpha(g2, ws2), g2, activation, gate_up_order)


def fold_block_scales(scales, w_scale_2, *, saturate: bool = True) -> np.ndarray:
    """``(float(w_sf) * w_scale_2[e]).to(float8_e4m3fn)`` (``transform_weights``), per expert.

    scales: E4M3 bytes (uint8 or float8_e4m3fn) [E, ...]; w_scale_2: fp32 [E]. Returns the
    folded E4M3 bytes (uint8, same shape). The product is one fp32 multiply; the cast is torch's
    (:func:`e4m3_saturating`): ``saturate=True`` is torch >= 2.12 (saturating at 448), which
    ``tests/test_trtllm_numpy.py`` checks against live torch 2.13 on overflowing products;
    ``saturate=False`` is torch < 2.12 (NaN from 464 up). The products only exceed 448 when
    ``w_scale_2 > 1`` (weights with amax > 2688).
    """
    s = e4m3_values(scales)
    ws = np.asarray(w_scale_2, np.float64).astype(np.float32).reshape(-1, *([1] * (s.ndim - 1)))
    return e4m3_saturating(s * ws, saturate=saturate)


def cutedsl_b12x_moe_weights(
    fc1, fc2, fc1_input_scale, fc2_input_scale, *, activation: str = "relu2",
    gate_up_order: str = "up_gate",
) -> MoERuntime:
    """``NVFP4CuteDslB12xFusedMoEMethod.transform_weights`` (TRT-LLM @02320c35): the folding path.

    Starting from the CUTLASS runtime tensors: ``w_scale_2 = fc_alpha * fc_input_scale`` (fp32),
    block scales replaced by ``E4M3(float(sf) * w_scale_2[e])``, and ``w_alpha = 1 /
    fc_input_scale`` (the decode activation scale, which FlashInfer's legacy b12x kernel uses
    both to quantize the FC input and to scale the GEMM output). That kernel's decode-form
    activation quantization is modelled by the same CUTLASS quantizer with encode scale
    ``fc_input_scale`` (equal up to fp32 op order); the FC2 input scale is passed the same way
    (assumption: TRT-LLM's post_load_weights was not read). This is the decode (``m < 64``)
    half of the backend only; :func:`run_pipeline` adds the dispatch.
    """
    base = cutlass_moe_weights(fc1, fc2, fc1_input_scale, fc2_input_scale,
                               activation=activation, gate_up_order=gate_up_order)
    e = base.fc1_alpha.shape[0]
    out = {}
    for fc in ("fc1", "fc2"):
        alpha, g = getattr(base, f"{fc}_alpha"), getattr(base, f"{fc}_act_scale")
        w_scale_2 = (alpha * g).astype(np.float32)
        out[f"{fc}_scales"] = fold_block_scales(getattr(base, f"{fc}_scales"), w_scale_2)
        out[f"{fc}_alpha"] = np.full(e, _ONE / g, np.float32)
    return dataclasses.replace(base, name="trtllm_cutedsl_b12x", **out)


def fixed_moe_weights(
    fc1, fc2, fc1_input_scale, fc2_input_scale, *, activation: str = "relu2",
    gate_up_order: str = "up_gate",
) -> MoERuntime:
    """The fix (FlashInfer ``input_global_scale``, PR #3932, FlashInfer 0.6.17; vLLM #48536):
    block scales kept.

    ``w1_alpha = weight_scale_2[e]`` (exact fp32), ``input_global_scale = 1 / fc_input_scale``
    (decode), and the kernel multiplies the GEMM output by ``w1_alpha * input_global_scale``.
    """
    base = cutlass_moe_weights(fc1, fc2, fc1_input_scale, fc2_input_scale,
                               activation=activation, gate_up_order=gate_up_order)
    _, _, ws1 = _stack_parts(fc1)
    _, _, ws2 = _stack_parts(fc2)
    return dataclasses.replace(
        base, name="flashinfer_fixed",
        fc1_alpha=(ws1 * (_ONE / base.fc1_act_scale)).astype(np.float32),
        fc2_alpha=(ws2 * (_ONE / base.fc2_act_scale)).astype(np.float32),
    )


PIPELINE_BUILDERS = {
    "trtllm_cutlass": cutlass_moe_weights,
    "trtllm_cutedsl_b12x": cutedsl_b12x_moe_weights,
    "flashinfer_fixed": fixed_moe_weights,
}


def moe_weights(pipeline: str, fc1, fc2, fc1_input_scale, fc2_input_scale, **kw) -> MoERuntime:
    """Runtime tensors of the named pipeline (one of :data:`PIPELINES`)."""
    if pipeline not in PIPELINE_BUILDERS:
        raise ValueError(f"pipeline: expected one of {PIPELINES}, got {pipeline!r}")
    return PIPELINE_BUILDERS[pipeline](fc1, fc2, fc1_input_scale, fc2_input_scale, **kw)


def cutedsl_b12x_path(m: int) -> str:
    """Which kernel ``CuteDslB12xFusedMoE`` runs for a call with ``m`` rows: ``"cutlass"``
    (prefill, ``m >= 64``: checkpoint block scales) or ``"b12x"`` (decode: folded scales)."""
    return "cutlass" if m >= PREFILL_VIA_CUTLASS_THRESHOLD else "b12x"


# ---------------------------------------------------------------------------------------
# the fused MoE forward (cutlass_fused_moe_kernels dataflow)
# ---------------------------------------------------------------------------------------

def _bf16(v) -> np.ndarray:
    """fp32 -> bf16 (RNE) values, kept as float32."""
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _silu_f32(g: np.ndarray) -> np.ndarray:
    """``g * sigmoid(g)`` evaluated in float64 and rounded once to fp32 (torch's fp32 silu can
    differ by an ulp of fp32; see ``tests/test_trtllm_numpy.py``)."""
    g = g.astype(np.float64)
    with np.errstate(over="ignore"):
        return (g / (1.0 + np.exp(-g))).astype(np.float32)


def _activation(u: np.ndarray, activation: str, gate_up_order: str) -> np.ndarray:
    """fp32 activation of the bf16 GEMM1 output (``doActivationKernel``)."""
    u = np.asarray(u, np.float32)
    if activation == "relu2":
        r = np.maximum(u, _F32(0.0))
        return r * r
    if activation == "swiglu":
        i = u.shape[-1] // 2
        first, second = u[..., :i], u[..., i:]
        up, gate = (first, second) if gate_up_order == "up_gate" else (second, first)
        return _silu_f32(gate) * up
    raise ValueError(f"activation: expected 'relu2' or 'swiglu', got {activation!r}")


def moe_forward(
    hidden,
    topk_ids,
    topk_weights,
    w: MoERuntime,
    *,
    fast_math: bool = True,
    round_gemm_outputs: bool = True,
) -> np.ndarray:
    """One NVFP4 MoE layer in the CUTLASS fused-MoE dataflow -> bf16 values [T, H] (float32 array).

    hidden [T, H] (rounded to bf16 first); topk_ids int [T, k]; topk_weights fp32 [T, k]. Per
    route: quantize the input with ``w.fc1_act_scale`` (fast-math quantizer by default), GEMM1 *
    alpha1[e] (bf16 when ``round_gemm_outputs``, as the CUTLASS GEMM1 output buffer), activation
    in fp32 -> bf16, requantize with ``w.fc2_act_scale``, GEMM2 * alpha2[e] (bf16), ``w * out``
    in fp32, summed over the k routes in route order in fp32 (the finalize kernel's loop), cast
    to bf16 once.
    """
    hidden = _bf16(hidden)
    ids = np.asarray(topk_ids).astype(np.int64)
    t, k = ids.shape
    flat = ids.reshape(-1)
    token = np.repeat(np.arange(t), k)
    x = hidden[token]
    contrib = np.zeros((t * k, hidden.shape[1]), np.float32)
    wts = np.asarray(topk_weights, np.float32).reshape(-1)
    gemm_dtype = "bfloat16" if round_gemm_outputs else "float32"
    for e in np.unique(flat).tolist():
        rows = np.nonzero(flat == e)[0]
        xq, xs = fp4_quantize(x[rows], w.fc1_act_scale, fast_math=fast_math)
        u = nvfp4_gemm(xq, w.fc1_weight[e], xs, w.fc1_scales[e], w.fc1_alpha[e], gemm_dtype)
        h = _bf16(_activation(u.astype(np.float32), w.activation, w.gate_up_order))
        hq, hs = fp4_quantize(h, w.fc2_act_scale, fast_math=fast_math)
        d = nvfp4_gemm(hq, w.fc2_weight[e], hs, w.fc2_scales[e], w.fc2_alpha[e], gemm_dtype)
        contrib[rows] = wts[rows, None] * d.astype(np.float32)
    c = contrib.reshape(t, k, -1)
    acc = c[:, 0].copy()
    for j in range(1, k):
        acc = acc + c[:, j]
    return _bf16(acc)


def run_pipeline(
    pipeline: str, hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale, fc2_input_scale,
    *, activation: str = "relu2", gate_up_order: str = "up_gate", fast_math: bool = True,
    dispatch_m: int | None = None,
) -> np.ndarray:
    """numpy in, numpy out: the named pipeline's MoE output as float64 [T, H] (bf16 values).

    Arguments as ``oracle.moe`` takes them (hidden [T, H] bf16 values as float64).
    ``trtllm_cutedsl_b12x`` dispatches as ``CuteDslB12xFusedMoE`` does on ``dispatch_m`` (the
    rows of the call, default ``T``): ``m >= 64`` runs the CUTLASS pipeline (nothing folded),
    ``m < 64`` the folded b12x one (:func:`cutedsl_b12x_path`). The other pipelines ignore it.
    """
    if pipeline == "trtllm_cutedsl_b12x":
        m = np.asarray(hidden).shape[0] if dispatch_m is None else int(dispatch_m)
        if cutedsl_b12x_path(m) == "cutlass":
            pipeline = "trtllm_cutlass"
    rt = moe_weights(pipeline, fc1, fc2, fc1_input_scale, fc2_input_scale,
                     activation=activation, gate_up_order=gate_up_order)
    out = moe_forward(np.asarray(hidden, np.float32), np.asarray(topk_ids, np.int64),
                      np.asarray(topk_weights, np.float32), rt, fast_math=fast_math)
    return out.astype(np.float64)


def live_available() -> tuple[bool, str]:
    """``(True, device)`` where TensorRT-LLM's NVFP4 ops can run, else ``(False, reason)``
    (:func:`nvfp4_jax.interop.trtllm_torch.live_available`; needs torch)."""
    try:
        from . import trtllm_torch
    except ImportError as exc:
        return False, f"the live TensorRT-LLM ops need torch: {exc}"
    return trtllm_torch.live_available()
