"""NVFP4 GEMM: public ``matmul`` and the choice of backend (api.py), XLA reference path (xla.py),
Pallas-Triton kernel (pallas_triton.py) with its per-shape tile configs (configs.py), Pallas
Mosaic GPU kernel for Hopper with its tuning table (mosaic.py), in-kernel E2M1 decode
(decode.py), the W4A4 activation operand kernel (operand.py)."""

from .api import (
    matmul,
    matmul_w4a4_operand,
    matmul_w4a4_prologue,
    prologue_applies,
    register_sm12x_device_kinds,
    resolve_backend,
)
from .pallas_triton import Config, dequantize_pallas, matmul_pallas
from .xla import dequantize_xla, matmul_xla

__all__ = [
    "Config",
    "dequantize_pallas",
    "dequantize_xla",
    "matmul",
    "matmul_pallas",
    "matmul_w4a4_operand",
    "matmul_w4a4_prologue",
    "matmul_xla",
    "prologue_applies",
    "register_sm12x_device_kinds",
    "resolve_backend",
]
