"""Public routed NVFP4 MoE: ``nvfp4_jax.moe(...)``; validation and the choice of backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import validate
from ..quantize import NVFP4Array
from .configs import MoEConfig
from .mosaic import MosaicMoEConfig
from .pallas_triton import KERNELS
from .routing import ROUTINGS, select_experts
from .weights import intermediate_size, padded_inter, unpad_fc2
from .xla import ACTIVATION_SCALES, ACTIVATIONS, GATE_UP_ORDERS, MODES, moe_xla

BACKENDS = ("auto", "pallas", "xla")


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _check(hidden, fc1, fc2, s1, s2, activation, gate_up_order, mode, backend, activation_scale):
    if hidden.ndim != 2:
        raise ValueError(f"hidden: expected [T, H], got shape {hidden.shape}")
    if hidden.dtype != jnp.bfloat16:
        raise TypeError(f"hidden: expected bfloat16, got {hidden.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_order not in GATE_UP_ORDERS:
        raise ValueError(f"gate_up_order: expected one of {GATE_UP_ORDERS}, got {gate_up_order!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if activation_scale not in ACTIVATION_SCALES:
        raise ValueError(f"activation_scale: expected one of {ACTIVATION_SCALES}, got {activation_scale!r}")
    if mode == "trtllm_cutlass" and activation_scale != "scalar":
        raise ValueError("activation_scale: trtllm_cutlass uses one scalar activation scale per layer ('scalar')")
    for name, w in (("fc1", fc1), ("fc2", fc2)):
        if not isinstance(w, NVFP4Array):
            raise TypeError(f"{name}: expected an NVFP4Array stack, got {type(w).__name__}")
        if len(w.shape) != 3:
            raise ValueError(f"{name}: expected a stack [E, N, K], got logical shape {w.shape}")
        w.validate()
        if tuple(w.decode_scale.shape) != (w.shape[0],):
            raise ValueError(f"{name}: expected decode_scale [E={w.shape[0]}] (weight_scale_2 per "
                             f"expert), got shape {w.decode_scale.shape}")
    e, r, h = fc1.shape
    if h != hidden.shape[1]:
        raise ValueError(f"fc1: expected K = H = {hidden.shape[1]}, got shape {fc1.shape}")
    inter = intermediate_size(r, activation)
    if activation == "swiglu" and r % 2:
        raise ValueError(f"fc1: swiglu needs an even number of rows [up; gate], got {r}")
    if fc2.shape not in ((e, h, inter), (e, h, padded_inter(inter))):
        padded = "" if padded_inter(inter) == inter else (
            f", or {(e, h, padded_inter(inter))} zero-padded along K by moe.pad_fc2")
        raise ValueError(f"fc2: expected shape {(e, h, inter)} ([E, H, I] for {activation}"
                         f"{padded}), got {fc2.shape}")
    if inter % 32:
        raise ValueError(f"fc2: intermediate size must be a multiple of 32, got {inter}")
    for name, s in (("fc1_input_scale", s1), ("fc2_input_scale", s2)):
        if s.dtype != jnp.float32 or s.shape not in ((e,), ()):
            raise ValueError(f"{name}: expected float32 [E={e}] (ModelOpt input_scale, decode form), "
                             f"got {s.dtype} {s.shape}")
    return e, inter


def moe(
    hidden: jax.Array,
    *,
    fc1: NVFP4Array,
    fc2: NVFP4Array,
    fc1_input_scale: jax.Array,
    fc2_input_scale: jax.Array,
    router_logits: jax.Array | None = None,
    topk_ids: jax.Array | None = None,
    topk_weights: jax.Array | None = None,
    top_k: int | None = None,
    routing: str = "softmax",
    renormalize: bool = False,
    correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
    activation: str = "relu2",
    gate_up_order: str = "up_gate",
    mode: str = "trtllm_cutlass",
    activation_scale: str | None = None,
    backend: str = "auto",
    config: MoEConfig | MosaicMoEConfig | None = None,
    kernel: str = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """Routed NVFP4 mixture-of-experts layer -> bf16 [T, H]. Jittable for any T; no host sync.

    hidden: bf16 [T, H]. fc1: NVFP4Array [E, R, H] (R = I for relu2, 2I for swiglu: rows
    [up; gate] for ``gate_up_order="up_gate"`` (TRT-LLM/b12x), [gate; up] for "gate_up"
    (vLLM)); decode_scale [E] = weight_scale_2. fc2: NVFP4Array [E, H, I], or [E, H, Ip]
    zero-padded along K to Ip = I rounded up to a multiple of 256 (``moe.pad_fc2``, done once
    at load time: 128-byte aligned rows for the Mosaic kernel; the same layer; other kernels
    slice it back on every call, logged). fc1/fc2_input_scale:
    float32 [E] ModelOpt input_scale (decode form). Routing: either ``router_logits`` [T, E]
    with ``top_k`` and ``routing`` ("softmax" or "sigmoid_bias", see
    ``routing.select_experts``), or ``topk_ids`` int [T, k] with ``topk_weights`` [T, k].
    ``mode``: "trtllm_cutlass" or "b12x" (arithmetic of ``oracle.moe``); ``activation_scale``:
    "scalar" (default for trtllm_cutlass, the only choice there) or "per_expert" (default for
    b12x). ``backend``: "pallas" (Pallas-Triton kernels; ``interpret=True`` runs them on CPU),
    "xla", or "auto" (pallas on a GPU, else xla). ``kernel`` (pallas backend only): "triton"
    (Pallas-Triton grouped GEMMs, fused epilogues), "mosaic" (Pallas Mosaic GPU grouped GEMMs,
    Hopper only, H % 256 == 0; FC2 stays on Pallas-Triton when I % 256 is neither 0 nor 128;
    operand, epilogue and combine as Pallas-Triton kernels; with ``interpret`` an XLA emulation
    of the grouped GEMMs) or "auto" (mosaic on an sm_90 GPU when
    T*k <= ``moe.mosaic.MAX_ROUTES``, no Pallas-Triton ``config`` was given and H % 256 == 0,
    else triton; logged). ``config``: ``MoEConfig`` (Pallas-Triton tiles) or
    ``moe.mosaic.MosaicMoEConfig`` (Mosaic tiles), None for the defaults.

    Bad values (docs/input-policy.md): a concrete non-finite ``hidden``, ``topk_ids`` outside
    [0, E), input scales not finite and > 0, or inconsistent ``fc1``/``fc2`` raise; traced, they
    are checked under :func:`nvfp4_jax.checked`, and unchecked the affected tokens' output rows
    are NaN.
    """
    hidden = jnp.asarray(hidden)
    if activation_scale is None:
        activation_scale = "scalar" if mode == "trtllm_cutlass" else "per_expert"
    s1 = jnp.asarray(fc1_input_scale)
    s2 = jnp.asarray(fc2_input_scale)
    e, inter = _check(hidden, fc1, fc2, s1, s2, activation, gate_up_order, mode, backend,
                      activation_scale)
    validate.check_moe_args(hidden, fc1, fc2, s1, s2, topk_ids)
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    s1, s2 = jnp.broadcast_to(s1, (e,)), jnp.broadcast_to(s2, (e,))
    if router_logits is not None:
        if topk_ids is not None or topk_weights is not None:
            raise ValueError("router_logits: pass either router_logits (+ top_k) or topk_ids + topk_weights, not both")
        if top_k is None or not 0 < top_k <= e:
            raise ValueError(f"top_k: expected an int in [1, {e}] with router_logits, got {top_k}")
        if router_logits.shape != (hidden.shape[0], e):
            raise ValueError(f"router_logits: expected shape {(hidden.shape[0], e)}, got {router_logits.shape}")
        if routing not in ROUTINGS:
            raise ValueError(f"routing: expected one of {ROUTINGS}, got {routing!r}")
        topk_ids, topk_weights = select_experts(
            router_logits, top_k, routing=routing, renormalize=renormalize,
            correction_bias=correction_bias, routed_scaling_factor=routed_scaling_factor)
    else:
        if topk_ids is None or topk_weights is None:
            raise ValueError("topk_ids: pass topk_ids and topk_weights, or router_logits with top_k")
        topk_ids, topk_weights = jnp.asarray(topk_ids), jnp.asarray(topk_weights)
        if topk_ids.ndim != 2 or topk_ids.shape[0] != hidden.shape[0] or not jnp.issubdtype(topk_ids.dtype, jnp.integer):
            raise ValueError(f"topk_ids: expected integer [T={hidden.shape[0]}, k], got {topk_ids.dtype} {topk_ids.shape}")
        if topk_weights.shape != topk_ids.shape or not jnp.issubdtype(topk_weights.dtype, jnp.floating):
            raise ValueError(f"topk_weights: expected float [{topk_ids.shape}], got {topk_weights.dtype} {topk_weights.shape}")
        if top_k is not None and top_k != topk_ids.shape[1]:
            raise ValueError(f"top_k: {top_k} does not match topk_ids.shape[1] = {topk_ids.shape[1]}")
        # ids outside [0, E) (traced, unchecked): NaN output rows, never a silently dropped route
        valid = (topk_ids >= 0) & (topk_ids < e)
        topk_ids = jnp.where(valid, topk_ids, 0).astype(topk_ids.dtype)
        topk_weights = jnp.where(valid, topk_weights, jnp.nan).astype(topk_weights.dtype)
    kw = {"activation": activation, "gate_up_order": gate_up_order, "mode": mode,
          "activation_scale": activation_scale}
    if backend == "auto":
        backend = "pallas" if _on_gpu() else "xla"
    if backend == "xla":
        return moe_xla(hidden, topk_ids, topk_weights, fc1, unpad_fc2(fc2, inter), s1, s2, **kw)
    from .pallas_triton import moe_pallas

    if interpret is None:
        interpret = not _on_gpu()
    return moe_pallas(hidden, topk_ids, topk_weights, fc1, fc2, s1, s2, config=config,
                      kernel=kernel, interpret=interpret, **kw)
