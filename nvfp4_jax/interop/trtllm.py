"""TensorRT-LLM's NVFP4 arithmetic re-enacted in torch (runs on CPU), and a live bridge.

Re-enactment (float32 torch ops in TensorRT-LLM's order, read from its quantization and fused-MoE
kernels):

* :func:`fp4_quantize` = ``torch.ops.trtllm.fp4_quantize`` / ``cvt_warp_fp16_to_fp4``, both
  the default fast-math variant (``SF = G * (vmax * rcp(6))``, ``outScale = rcp(SFn * rcp(G))``)
  and the exact one (``TRTLLM_DISABLE_FP4_QUANT_FAST_MATH``: ``SF = vmax * (G * (1/6))``,
  ``outScale = min(1 / (SFn * (1/G)), FLT_MAX)``). Bit-exact with ``oracle.quantize`` recipes
  ``trtllm_fast`` / ``trtllm`` (``rcp.approx.ftz`` is modelled by the correctly rounded
  reciprocal, as in the oracle). The E4M3 cast is :func:`e4m3_saturating`: clamp, then cast,
  so torch < 2.12 (NaN above 464) and torch >= 2.12 (saturating) give the same bytes.
* :func:`nvfp4_gemm` = ``torch.ops.trtllm.nvfp4_gemm``: ``alpha * sum_k a * w`` with the dot
  accumulated exactly (float64 of exact products, then one rounding to fp32), times the fp32
  alpha, cast to the output dtype. A tensor-core fp32 accumulator differs from it within
  ``oracle.gemm_error_bound``.
* MoE weight pipelines, from a ModelOpt checkpoint (stacks as ``oracle.moe`` takes them) to the
  runtime tensors of each backend (:class:`MoERuntime`):

  - :func:`cutlass_moe_weights` (``NVFP4CutlassFusedMoEMethod``): block scales kept,
    ``fc31_input_scale = 1 / max_e input_scale`` (encode), per-expert
    ``fc31_alpha = 1 / (fc31_input_scale * (1 / w_scale_2))``; same for fc2;
  - :func:`cutedsl_b12x_moe_weights` (``NVFP4CuteDslB12xFusedMoEMethod.transform_weights``):
    ``w_scale_2 = fc_alpha * fc_input_scale`` (fp32),
    ``w_sf_fp8 = (float(w_sf) * w_scale_2[e]).to(float8_e4m3fn)`` -- the scale *folding*
    that underflows into E4M3 subnormals (TRT-LLM #21461) -- then ``alpha = 1 / fc_input_scale``;
  - :func:`fixed_moe_weights` (FlashInfer ``input_global_scale``, PR #3932): block scales
    kept, ``weight_scale_2`` carried in the fp32 alpha ``w_alpha * input_global_scale``.

* :func:`moe_forward`: the CUTLASS fused-MoE dataflow on any :class:`MoERuntime`: quantize the
  input with the scalar encode scale, GEMM1 x alpha1 -> bf16, activation in fp32 -> bf16,
  requantize, GEMM2 x alpha2 -> bf16, top-k weighted sum in fp32, cast to bf16.

Live bridge: :func:`live_available` says whether ``tensorrt_llm`` imports and the GPU has FP4
tensor cores (SM 10.x / 12.x); :func:`live_fp4_quantize`, :func:`live_nvfp4_gemm` and
:func:`live_fused_moe` call the real ops and raise :class:`LiveUnavailable` with the precise
reason otherwise. Nothing here reports a live result without having run the op.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Literal

import numpy as np
import torch

from . import LiveUnavailable  # the error every live bridge raises (re-exported)

E4M3_MAX = 448.0
E2M1_X_E4M3 = 2688.0
BLOCK = 16
FLT_MAX = float(np.finfo(np.float32).max)

Pipeline = Literal["trtllm_cutlass", "trtllm_cutedsl_b12x", "flashinfer_fixed"]
PIPELINES: tuple[str, ...] = ("trtllm_cutlass", "trtllm_cutedsl_b12x", "flashinfer_fixed")


# ---------------------------------------------------------------------------------------
# element formats
# ---------------------------------------------------------------------------------------

def e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, RNE with subnormals, saturating at +-448 (CUDA ``__nv_fp8_e4m3``).

    The clamp makes the result independent of the torch version (torch < 2.12 returns NaN
    above 464, torch >= 2.12 saturates). NaN stays NaN.
    """
    x = x.to(torch.float32)
    return torch.clamp(x, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8 0..15) as PTX ``cvt.rn.satfinite.e2m1x2.f32``.

    RNE with ties to even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4),
    saturating at 6; the sign bit follows the fp32 sign bit. NaN -> code 0 (the oracle's
    assumption for ``0 * Inf`` in the fast path; dequantizes to 0 either way).
    """
    y = torch.nan_to_num(y.to(torch.float32), nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    a = y.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0)).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, any shape) -> float32 values."""
    return _E2M1_VALUES[codes.to(torch.int64)]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] -> bytes [..., K/2]; element 2j in the low nibble (PTX cvt operand order)."""
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> codes [..., K] (uint8)."""
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear scales [..., M, K/16] -> the flat 128x4 layout ``block_scale_interleave`` writes."""
    *lead, m, kv = scales.shape
    mp, kp = -(-m // 128) * 128, -(-kv // 4) * 4
    pad = torch.zeros(*lead, mp, kp, dtype=torch.uint8)
    pad[..., :m, :kv] = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    nl = len(lead)
    v = pad.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
    v = v.permute(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    return v.reshape(*lead, mp * kp)


def unswizzle_128x4(flat: torch.Tensor, m: int, kv: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4` -> uint8 [..., m, kv]."""
    flat = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    *lead, _ = flat.shape
    mp, kp = -(-m // 128) * 128, -(-kv // 4) * 4
    nl = len(lead)
    v = flat.reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
    v = v.permute(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    return v.reshape(*lead, mp, kp)[..., :m, :kv].contiguous()


# ---------------------------------------------------------------------------------------
# quantizer: cvt_warp_fp16_to_fp4 (quantization.cuh)
# ---------------------------------------------------------------------------------------

def _f32(v) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float32)


def cvt_warp_fp16_to_fp4(
    blocks: torch.Tensor, global_scale: torch.Tensor, *, fast_math: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One NVFP4 block per row: ``blocks [..., 16]`` (bf16/fp16/fp32), encode scale G (fp32,
    broadcastable to ``blocks.shape[:-1]``) -> (E4M3 scale [...] float8_e4m3fn, codes [..., 16] uint8).
    """
    vmax = blocks.abs().amax(dim=-1).to(torch.float32)  # exact in the input dtype, then widened
    x = blocks.to(torch.float32)
    G = _f32(global_scale)
    one = _f32(1.0)
    if fast_math:
        rcp6 = one / _f32(6.0)  # rcp.approx.ftz(6) is correctly rounded
        sf = G * (vmax * rcp6)
        s8 = e4m3_saturating(sf)
        sfn = s8.to(torch.float32)
        out_scale = torch.where(vmax != 0, one / (sfn * (one / G)), _f32(0.0))
    else:
        c6 = _f32(1.0 / 6.0)
        sf = torch.where(vmax == 0, _f32(0.0), vmax * (G * c6))
        s8 = e4m3_saturating(sf)
        sfn = s8.to(torch.float32)
        out_scale = torch.clamp(one / (sfn * (one / G)), max=FLT_MAX)
    y = x * out_scale[..., None]  # overflow -> +-inf -> saturates to 6; 0 * inf -> NaN -> 0
    return s8, e2m1_encode(y)


def fp4_quantize(
    x: torch.Tensor,
    global_scale,
    *,
    fast_math: bool = True,
    sf_layout: Literal["linear", "swizzled_128x4"] = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.trtllm.fp4_quantize(x, G, 16, False, swizzled)`` re-enacted.

    x: [..., K] bf16/fp16/fp32, K a multiple of 16. global_scale: encode scale G = 2688/amax,
    fp32 of shape [] / [1] or one per row [M] (``x`` 2-D). Returns ``(packed uint8 [..., K/2],
    scales float8_e4m3fn [..., K/16])`` (linear), or flat uint8 128x4 bytes per matrix.
    """
    if x.shape[-1] % BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of {BLOCK}, got shape {tuple(x.shape)}")
    G = _f32(global_scale)
    if G.numel() == 1:
        G = G.reshape(())
    elif x.ndim == 2 and G.shape == (x.shape[0],):
        G = G[:, None]
    else:
        raise ValueError(f"global_scale: expected shape [] / [1] or [{x.shape[0]}], got {tuple(G.shape)}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    s8, codes = cvt_warp_fp16_to_fp4(blocks, G, fast_math=fast_math)
    packed = pack_nibbles(codes.reshape(x.shape))
    if sf_layout == "swizzled_128x4":
        return packed, swizzle_128x4(s8)
    if sf_layout != "linear":
        raise ValueError(f"sf_layout: expected 'linear' or 'swizzled_128x4', got {sf_layout!r}")
    return packed, s8


def fp4_values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``e2m1 * e4m3`` [..., K] as float64 (exact; no global scale). Scales linear [..., K/16]."""
    vals = e2m1_decode(unpack_nibbles(packed)).to(torch.float64)
    sc = scales.view(torch.float8_e4m3fn) if scales.dtype == torch.uint8 else scales
    sc = sc.to(torch.float64)
    out = vals.reshape(*vals.shape[:-1], -1, BLOCK) * sc[..., None]
    return out.reshape(vals.shape)


def nvfp4_gemm(
    act_fp4: torch.Tensor,
    weight_fp4: torch.Tensor,
    act_sf: torch.Tensor,
    weight_sf: torch.Tensor,
    alpha,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``torch.ops.trtllm.nvfp4_gemm`` re-enacted: ``out[m, n] = alpha * sum_k a * w``.

    act_fp4 uint8 [M, K/2], weight_fp4 uint8 [N, K/2], act_sf / weight_sf float8_e4m3fn (or uint8
    bytes) [M, K/16] / [N, K/16] linear, alpha fp32 = input_scale * weight_scale_2 (decode
    scales). The dot is exact, rounded once to fp32; then ``* alpha`` in fp32 and the cast.
    """
    a = fp4_values(act_fp4, act_sf)
    w = fp4_values(weight_fp4, weight_sf)
    acc = (a @ w.T).to(torch.float32)
    return (acc * _f32(alpha)).to(out_dtype)


# ---------------------------------------------------------------------------------------
# MoE weight pipelines
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MoERuntime:
    """What a fused-MoE NVFP4 kernel is handed (one layer; torch tensors, CPU).

    fc1_weight uint8 [E, R, H/2] (R = I relu2, 2I swiglu, rows in ``gate_up_order``);
    fc1_scales float8_e4m3fn [E, R, H/16] (linear layout; TRT-LLM interleaves them to 128x4,
    which moves bytes but changes no value); fc1_alpha fp32 [E]; fc1_act_scale: fp32 scalar
    encode scale G1 the FC1 input is quantized with; fc2_* likewise ([E, H, I/2], [E, H, I/16]).
    """

    name: str
    fc1_weight: torch.Tensor
    fc1_scales: torch.Tensor
    fc1_alpha: torch.Tensor
    fc1_act_scale: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_scales: torch.Tensor
    fc2_alpha: torch.Tensor
    fc2_act_scale: torch.Tensor
    activation: str = "relu2"
    gate_up_order: str = "up_gate"


def _stack_parts(w):
    """oracle.NVFP4 stack -> (codes uint8 tensor, scales e4m3 tensor, weight_scale_2 fp32 [E])."""
    codes = torch.from_numpy(np.array(w.codes))
    scales = torch.from_numpy(np.array(w.scales)).view(torch.float8_e4m3fn)
    e = w.codes.shape[0]
    ws2 = torch.from_numpy(np.broadcast_to(np.asarray(w.decode_scale, np.float64), (e,)).copy()).float()
    return codes, scales, ws2


def _act_encode_scale(input_scale) -> torch.Tensor:
    """``fc31_input_scale = 1 / max_e input_scale`` (fp32; TRT-LLM ``load_quant_scales``)."""
    s = torch.as_tensor(np.asarray(input_scale, np.float64), dtype=torch.float32).reshape(-1)
    return _f32(1.0) / s.max()


def _cutlass_alpha(act_encode: torch.Tensor, ws2: torch.Tensor) -> torch.Tensor:
    """``fc31_alpha = 1 / (fc31_input_scale * (1 / w_scale_2))`` in fp32 (``load_expert_fc31_alpha_nvfp4``)."""
    one = _f32(1.0)
    return one / (act_encode * (one / ws2))


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


def fold_block_scales(scales: torch.Tensor, w_scale_2: torch.Tensor) -> torch.Tensor:
    """``(float(w_sf) * w_scale_2[e]).to(float8_e4m3fn)`` (``transform_weights``), per expert.

    scales: float8_e4m3fn [E, ...]; w_scale_2: fp32 [E]. The torch cast of the source saturates
    only on torch >= 2.12; products here are <= 448 * w_scale_2, far below the edge.
    """
    bcast = w_scale_2.to(torch.float32).view(-1, *([1] * (scales.dim() - 1)))
    return e4m3_saturating(scales.to(torch.float32) * bcast)


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
    (assumption: TRT-LLM's post_load_weights was not read).
    """
    base = cutlass_moe_weights(fc1, fc2, fc1_input_scale, fc2_input_scale,
                               activation=activation, gate_up_order=gate_up_order)
    e = base.fc1_alpha.shape[0]
    out = {}
    for fc in ("fc1", "fc2"):
        alpha, g = getattr(base, f"{fc}_alpha"), getattr(base, f"{fc}_act_scale")
        w_scale_2 = (alpha * g).to(torch.float32)
        out[f"{fc}_scales"] = fold_block_scales(getattr(base, f"{fc}_scales"), w_scale_2)
        out[f"{fc}_alpha"] = (_f32(1.0) / g).expand(e).clone()
    return dataclasses.replace(base, name="trtllm_cutedsl_b12x", **out)


def fixed_moe_weights(
    fc1, fc2, fc1_input_scale, fc2_input_scale, *, activation: str = "relu2",
    gate_up_order: str = "up_gate",
) -> MoERuntime:
    """The fix (FlashInfer ``input_global_scale``, PR #3932; vLLM #48536): block scales kept.

    ``w1_alpha = weight_scale_2[e]`` (exact fp32), ``input_global_scale = 1 / fc_input_scale``
    (decode), and the kernel multiplies the GEMM output by ``w1_alpha * input_global_scale``.
    """
    base = cutlass_moe_weights(fc1, fc2, fc1_input_scale, fc2_input_scale,
                               activation=activation, gate_up_order=gate_up_order)
    _, _, ws1 = _stack_parts(fc1)
    _, _, ws2 = _stack_parts(fc2)
    one = _f32(1.0)
    return dataclasses.replace(
        base, name="flashinfer_fixed",
        fc1_alpha=ws1 * (one / base.fc1_act_scale), fc2_alpha=ws2 * (one / base.fc2_act_scale),
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


# ---------------------------------------------------------------------------------------
# the fused MoE forward (cutlass_fused_moe_kernels dataflow)
# ---------------------------------------------------------------------------------------

def _activation(u: torch.Tensor, activation: str, gate_up_order: str) -> torch.Tensor:
    """fp32 activation of the bf16 GEMM1 output (``doActivationKernel``)."""
    u = u.to(torch.float32)
    if activation == "relu2":
        r = torch.relu(u)
        return r * r
    if activation == "swiglu":
        i = u.shape[-1] // 2
        first, second = u[..., :i], u[..., i:]
        up, gate = (first, second) if gate_up_order == "up_gate" else (second, first)
        return torch.nn.functional.silu(gate) * up
    raise ValueError(f"activation: expected 'relu2' or 'swiglu', got {activation!r}")


def moe_forward(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: MoERuntime,
    *,
    fast_math: bool = True,
    round_gemm_outputs: bool = True,
) -> torch.Tensor:
    """One NVFP4 MoE layer in the CUTLASS fused-MoE dataflow -> bf16 [T, H].

    hidden bf16 [T, H]; topk_ids int [T, k]; topk_weights fp32 [T, k]. Per route: quantize the
    input with ``w.fc1_act_scale`` (fast-math quantizer by default), GEMM1 * alpha1[e] (bf16
    when ``round_gemm_outputs``, as the CUTLASS GEMM1 output buffer; the b12x kernels keep fp32),
    activation in fp32 -> bf16, requantize with ``w.fc2_act_scale``, GEMM2 * alpha2[e] (bf16),
    ``sum_k w * out`` in fp32, cast to bf16 once.
    """
    hidden = hidden.to(torch.bfloat16)
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).to(torch.int64)
    token = torch.arange(t).repeat_interleave(k)
    x = hidden[token]
    contrib = torch.zeros(t * k, hidden.shape[1], dtype=torch.float32)
    wts = topk_weights.to(torch.float32).reshape(-1)
    for e in torch.unique(ids).tolist():
        rows = torch.nonzero(ids == e).reshape(-1)
        xq, xs = fp4_quantize(x[rows], w.fc1_act_scale, fast_math=fast_math)
        u = nvfp4_gemm(xq, w.fc1_weight[e], xs, w.fc1_scales[e], w.fc1_alpha[e],
                       torch.bfloat16 if round_gemm_outputs else torch.float32)
        h = _activation(u, w.activation, w.gate_up_order).to(torch.bfloat16)
        hq, hs = fp4_quantize(h, w.fc2_act_scale, fast_math=fast_math)
        d = nvfp4_gemm(hq, w.fc2_weight[e], hs, w.fc2_scales[e], w.fc2_alpha[e],
                       torch.bfloat16 if round_gemm_outputs else torch.float32)
        contrib[rows] = wts[rows, None] * d.to(torch.float32)
    return contrib.reshape(t, k, -1).sum(dim=1).to(torch.bfloat16)


def run_pipeline(
    pipeline: str, hidden, topk_ids, topk_weights, fc1, fc2, fc1_input_scale, fc2_input_scale,
    *, activation: str = "relu2", gate_up_order: str = "up_gate", fast_math: bool = True,
) -> np.ndarray:
    """numpy in, numpy out: the named pipeline's MoE output as float64 [T, H] (bf16 values).

    Arguments as ``oracle.moe`` takes them (hidden [T, H] bf16 values as float64).
    """
    rt = moe_weights(pipeline, fc1, fc2, fc1_input_scale, fc2_input_scale,
                     activation=activation, gate_up_order=gate_up_order)
    out = moe_forward(torch.from_numpy(np.asarray(hidden, np.float32)),
                      torch.from_numpy(np.asarray(topk_ids, np.int64)),
                      torch.from_numpy(np.asarray(topk_weights, np.float32)), rt,
                      fast_math=fast_math)
    return out.to(torch.float64).numpy()


# ---------------------------------------------------------------------------------------
# live bridge
# ---------------------------------------------------------------------------------------

def live_available() -> tuple[bool, str]:
    """``(True, device)`` where TensorRT-LLM's NVFP4 ops can run, else ``(False, reason)``."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return False, ("tensorrt_llm is not installed (PyPI only has a wheel stub that downloads "
                       "from NVIDIA's index; see cpu-peers.md 2.7)")
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA device; TensorRT-LLM ops are CUDA-only"
    major, minor = torch.cuda.get_device_capability()
    if major not in (10, 11, 12):
        return False, (f"GPU {torch.cuda.get_device_name()} is SM {major}.{minor}; NVFP4 tensor "
                       "cores need SM 10.x or 12.x")
    try:
        importlib.import_module("tensorrt_llm")
    except Exception as exc:  # noqa: BLE001 - report whatever broke the import
        return False, f"import tensorrt_llm failed: {type(exc).__name__}: {exc}"
    if not hasattr(torch.ops, "trtllm") or not hasattr(torch.ops.trtllm, "fp4_quantize"):
        return False, "tensorrt_llm imported but torch.ops.trtllm.fp4_quantize is not registered"
    return True, f"{torch.cuda.get_device_name()} (SM {major}.{minor})"


def _require_live() -> None:
    ok, why = live_available()
    if not ok:
        raise LiveUnavailable(why)


def live_fp4_quantize(x: torch.Tensor, global_scale, *, swizzled: bool = False):
    """Run ``torch.ops.trtllm.fp4_quantize`` on the GPU; returns CPU (packed uint8, scale bytes uint8)."""
    _require_live()
    g = _f32(global_scale).reshape(1).cuda()
    q, s = torch.ops.trtllm.fp4_quantize(x.cuda(), g, BLOCK, False, swizzled)
    return q.view(torch.uint8).cpu(), s.view(torch.uint8).cpu()


def live_nvfp4_gemm(act_fp4, weight_fp4, act_sf_128x4, weight_sf_128x4, alpha,
                    out_dtype=torch.bfloat16) -> torch.Tensor:
    """Run ``torch.ops.trtllm.nvfp4_gemm`` (scales in the 128x4 layout, uint8); returns CPU."""
    _require_live()
    dev = lambda t: t.cuda()
    out = torch.ops.trtllm.nvfp4_gemm(dev(act_fp4), dev(weight_fp4), dev(act_sf_128x4),
                                      dev(weight_sf_128x4), _f32(alpha).reshape(1).cuda(), out_dtype)
    return out.cpu()


def live_fused_moe(hidden: torch.Tensor, topk_ids, topk_weights, w: MoERuntime) -> torch.Tensor:
    """Run ``torch.ops.trtllm.fused_moe`` (CUTLASS backend) on a :class:`MoERuntime`; returns CPU bf16.

    Weight scales are interleaved to 128x4 per expert as ``block_scale_interleave`` does.
    """
    _require_live()
    e, r, _ = w.fc1_weight.shape
    h = w.fc2_weight.shape[1]
    fc1_sf = swizzle_128x4(w.fc1_scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    fc2_sf = swizzle_128x4(w.fc2_scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    quant_scales = [w.fc1_act_scale.reshape(1).cuda(), fc1_sf.reshape(e, -1).view(torch.int32).cuda(),
                    w.fc1_alpha.cuda(), w.fc2_act_scale.reshape(1).cuda(),
                    fc2_sf.reshape(e, -1).view(torch.int32).cuda(), w.fc2_alpha.cuda()]
    out = torch.ops.trtllm.fused_moe(
        hidden.cuda().to(torch.bfloat16), topk_ids.cuda().to(torch.int32),
        topk_weights.cuda().to(torch.float32),
        w.fc1_weight.reshape(e, r, -1).view(torch.int64).cuda(), None,
        w.fc2_weight.reshape(e, h, -1).view(torch.int64).cuda(), None,
        torch.bfloat16, quant_scales=quant_scales,
    )
    return (out[0] if isinstance(out, (list, tuple)) else out).cpu()
