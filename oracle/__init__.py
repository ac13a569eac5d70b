"""The exact NVFP4 oracle: numpy float64 and Python integers only (never imports jax or torch).

Every NVFP4 operation nvfp4-jax ships is defined here: E2M1/E4M3 coding, the quantization
recipes of each major system, scale layouts, GEMM and routed MoE with its softmax top-k
routing; and the decode attention the models run beside them (float64, each with its fp32
kernel's error bound).
"""

from .attention import (
    decode_attention,
    decode_attention_error_bound,
    decode_qkv_attention_error_bound,
    norm_rope_interval,
)
from .formats import (
    E2M1_VALUES,
    bf16_round,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e4m3_round,
    f32,
    pack_nibbles,
    unpack_nibbles,
)
from .gemm import exact_dot_int, gemm_error_bound, gemm_w4a4, gemm_w4a16, scaled_integers
from .layouts import LAYOUTS, padded_shape, swizzle, unswizzle
from .moe import MOE_MODES, MoETrace, moe, moe_scales, moe_trace
from .quantize import (
    NVFP4,
    RECIPES,
    codes_of,
    decode_scale_from_amax,
    dequantize,
    encode_scale_from_amax,
    quantize,
)
from .routing import router_logits_interval, select_experts, select_experts_error_bound

__all__ = [
    "E2M1_VALUES", "LAYOUTS", "NVFP4", "RECIPES", "bf16_round", "codes_of",
    "decode_attention", "decode_attention_error_bound", "decode_qkv_attention_error_bound",
    "norm_rope_interval", "decode_scale_from_amax", "dequantize",
    "e2m1_decode", "e2m1_encode", "e4m3_decode", "e4m3_encode", "e4m3_round",
    "encode_scale_from_amax", "exact_dot_int", "f32",
    "gemm_error_bound", "gemm_w4a4", "gemm_w4a16", "pack_nibbles", "padded_shape", "quantize",
    "scaled_integers", "swizzle", "unpack_nibbles", "unswizzle",
]
__all__ += ["MOE_MODES", "MoETrace", "moe", "moe_scales", "moe_trace", "router_logits_interval",
            "select_experts", "select_experts_error_bound"]
