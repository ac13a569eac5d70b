"""Routed NVFP4 mixture of experts.

* api.py: the public ``moe`` and the choice of backend (``choose_backend``);
* routing.py: expert selection and the block routing (XLA); xla.py: the reference path;
* pallas_triton.py: grouped Pallas-Triton kernels with fused epilogues; configs.py: their tiles;
* mosaic.py: grouped Mosaic GPU kernels for Hopper, ``MosaicMoEConfig`` and its tuning table;
* the Mosaic path's Pallas-Triton glue kernels, one concern each: routing_kernel.py (block
  routing in one program), scales.py (encode scales and alphas), operand.py (the FC1 operand),
  epilogue.py (the FC1 epilogue), combine.py (the weighted top-k sum);
* weights.py: ``pad_fc2`` (FC2 weights with 128-byte aligned rows).

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
