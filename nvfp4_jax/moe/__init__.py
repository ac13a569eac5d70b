"""Routed NVFP4 mixture of experts: api.py (public ``moe``), routing.py, xla.py (reference
path), pallas_triton.py (grouped Pallas-Triton kernels, and the kernel choice), mosaic.py
(grouped Mosaic GPU kernels for Hopper at decode sizes), epilogue.py (the Mosaic path's
Pallas-Triton glue: FC1 operand, FC1 epilogue, combine), configs.py (tiles), weights.py
(``pad_fc2``: FC2 weights with 128-byte aligned rows).

The package itself is callable (``nvfp4_jax.moe.moe(...)`` and ``nvfp4_jax.moe(...)`` are the
same function), so a package ``__init__`` can export the subpackage under the function's name
without hiding ``nvfp4_jax.moe.routing`` and friends.
"""

import sys
import types

from .api import BACKENDS, moe
from .configs import Config, MoEConfig
from .routing import BlockRouting, block_routing, select_experts
from .weights import pad_fc2

__all__ = ["BACKENDS", "BlockRouting", "Config", "MoEConfig", "block_routing", "moe", "pad_fc2",
           "select_experts"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return moe(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
