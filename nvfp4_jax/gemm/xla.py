"""Plain-XLA NVFP4 GEMM: dequantize W exactly, then ``jnp.dot`` with fp32 accumulation.

The reference path of this package (runs on any backend, CPU included) and the shape every
kernel in ``pallas_triton.py`` must agree with. The decode is the same bit trick as the kernel
(decode.py, "bits" mode), written with element-wise ops that XLA fuses into one pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .decode import decode_block


def dequantize_xla(w_codes: jax.Array, w_scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """codes uint8 [..., K/2], scales e4m3 (float8_e4m3fn or uint8 bytes) [..., K/16]
    -> ``e2m1 * e4m3`` [..., K] in ``dtype`` (bf16/fp16/fp32, exact; no decode scale)."""
    if w_scales.dtype == jnp.uint8:
        w_scales = lax.bitcast_convert_type(w_scales, jnp.float8_e4m3fn)
    lead = w_codes.shape[:-1]
    k2 = w_codes.shape[-1]
    codes = w_codes.reshape(lead + (k2 // 8, 8))
    even, odd, _ = decode_block(codes, w_scales, "bits", jnp.float32)
    w = jnp.stack([even, odd], axis=-1)
    return w.reshape(lead + (2 * k2,)).astype(dtype)


def matmul_xla(
    x: jax.Array, w_codes: jax.Array, w_scales: jax.Array, alpha, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """``alpha * x[M, K] @ W[N, K]^T``, fp32 accumulation; x bf16/fp16 (operands stay exact)."""
    op_dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    w = dequantize_xla(w_codes, w_scales, op_dtype)
    acc = lax.dot_general(
        x.astype(op_dtype), w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    return (acc * jnp.asarray(alpha, jnp.float32)).astype(out_dtype)
