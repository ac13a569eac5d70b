"""Compact NVFP4 decoders: Llama-style dense, Qwen3-MoE and the Nemotron-H hybrid (Mamba2,
attention, MLP, relu2 MoE; ``nemotron_h``), loaded from ModelOpt HF exports.

``load_model(dir)`` -> :class:`Model` (or :class:`NemotronHModel`); ``generate(model,
prompt_ids, n)``; ``prefill`` and ``decode_step`` (jitted) with a :class:`KVCache` (or
:class:`HybridCache`); see ``decoder``, ``nemotron_h`` and ``loader``.
``shard_model(model, mesh)``: tensor and expert parallelism over a mesh axis (``sharding``).
"""

from .decoder import (
    DecoderConfig,
    Generation,
    KVCache,
    Model,
    concat_linears,
    decode_step,
    filter_logits,
    forward,
    fuse_projections,
    generate,
    init_cache,
    prefill,
    sample,
)
from .folding import FoldedBlocks, fold_cutedsl_b12x
from .loader import ARCHITECTURES, config_from_hf, load_model, stderr_progress
from .nemotron_h import HybridCache, NemotronHConfig, NemotronHModel
from .sharding import ShardedModel, shard_model, tp_bytes

__all__ = ["ARCHITECTURES", "DecoderConfig", "FoldedBlocks", "Generation", "HybridCache",
           "KVCache", "Model", "NemotronHConfig", "NemotronHModel", "ShardedModel",
           "concat_linears", "config_from_hf", "decode_step", "filter_logits",
           "fold_cutedsl_b12x", "forward", "fuse_projections", "generate", "init_cache",
           "load_model", "prefill", "sample", "shard_model", "stderr_progress", "tp_bytes"]
