"""NVFP4 GEMM: public ``matmul`` (api.py), Pallas-Triton kernel (pallas_triton.py), XLA
reference path (xla.py), per-shape tile configs (configs.py), in-kernel decode (decode.py)."""

from .api import matmul, register_sm12x_device_kinds, resolve_backend
from .pallas_triton import Config, dequantize_pallas, matmul_pallas
from .xla import dequantize_xla, matmul_xla

__all__ = [
    "Config",
    "dequantize_pallas",
    "dequantize_xla",
    "matmul",
    "matmul_pallas",
    "matmul_xla",
    "register_sm12x_device_kinds",
    "resolve_backend",
]
