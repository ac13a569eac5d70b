"""Routed NVFP4 mixture of experts: api.py (public ``moe``), routing.py, xla.py (reference
path), pallas_triton.py (grouped Pallas-Triton kernels), configs.py (tiles)."""

from .api import BACKENDS, moe
from .configs import Config, MoEConfig
from .routing import BlockRouting, block_routing, select_experts

__all__ = ["BACKENDS", "BlockRouting", "Config", "MoEConfig", "block_routing", "moe", "select_experts"]
