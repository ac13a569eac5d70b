"""Public routed NVFP4 MoE: ``nvfp4_jax.moe(...)``; validation and the choice of backend.

Backends (``backend=``, the same words as ``nvfp4_jax.matmul``):

* ``"xla"``: the plain-XLA reference path (xla.py), any device;
* ``"pallas"``: Pallas-Triton grouped GEMMs with fused epilogues (pallas_triton.py), any NVIDIA
  GPU from sm_89; off the GPU the kernels run in Pallas interpret mode (CPU tests). Their MMA
  is ``MoEConfig.mma`` (the words of ``matmul(mma=)``): "fp4" (NVFP4 activations into the
  block-scaled FP4 MMA) by default on SM 12.x GPUs only, "bf16" elsewhere; a ``MoEConfig``
  with ``mma="fp4"`` forces it anywhere (decomposed by Triton on sm_90), ``mma="bf16"`` the
  bf16 MMA;
* ``"mosaic"``: Pallas Mosaic GPU grouped GEMMs with Pallas-Triton glue kernels (mosaic.py),
  sm_90, or SM 12.x with ``plgpu.mma`` (JAX >= 0.11: the grouped GEMMs on ``mma.sync``,
  ``gemm.mosaic.for_sm12x``), H % 256 == 0; off the GPU an XLA emulation of the grouped GEMMs
  with the glue kernels in interpret mode (CPU tests);
* ``"auto"``: "mosaic" on sm_90 up to ``mosaic.MAX_ROUTES`` routed rows (measured faster
  there) and on SM 12.x with ``plgpu.mma`` up to ``mosaic.SM12X_ROUTES_PER_EXPERT`` routed rows
  per expert (decode: bf16 ``mma.sync`` is DRAM-bound there like the FP4 MMA, and the Mosaic
  MoE's launches cost less), unless a Pallas-Triton ``MoEConfig`` is given; "pallas" on other
  GPUs and beyond those sizes (on SM 12.x the FP4 MMA); "xla" off the GPU. The choice is logged
  (``choose_backend``).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from .. import validate
from ..device import gpu_compute_capability, is_sm12x, is_sm90, on_gpu, pallas_interpret
from ..gemm.mosaic import unavailable as mosaic_unavailable
from ..quantize import NVFP4Array
from .configs import MoEConfig
from .mosaic import (
    BLOCK_K,
    MAX_ROUTES,
    SM12X_ROUTES_PER_EXPERT,
    MosaicMoEConfig,
    check_supported,
    moe_mosaic,
    routes_per_expert,
)
from .pallas_triton import moe_pallas
from .routing import ROUTINGS, select_experts
from .select_kernel import select_fits, select_kernel
from .weights import intermediate_size, padded_inter, unpad_fc2
from .xla import ACTIVATION_SCALES, ACTIVATIONS, GATE_UP_ORDERS, MODES, add_residual, moe_xla

log = logging.getLogger(__name__)

BACKENDS = ("auto", "mosaic", "pallas", "xla")


def choose_backend(backend: str, config, *, routes: int, hidden: int, experts: int) -> str:
    """"mosaic", "pallas" or "xla" for ``moe`` with ``routes`` = T * top_k routed rows over
    ``experts`` experts of hidden size ``hidden`` (the choice of "auto" is logged).

    "auto": "xla" off the GPU; on a GPU "mosaic" when ``config`` is None or a
    ``MosaicMoEConfig``, H % 256 == 0 and either the GPU is sm_90 and ``routes <=
    mosaic.MAX_ROUTES``, or it is SM 12.x, the Mosaic kernels run there (``plgpu.mma``, JAX >=
    0.11) and the mean routed rows per expert ``routes / min(experts, routes)`` are at most
    ``mosaic.SM12X_ROUTES_PER_EXPERT``; else "pallas". An explicit backend is checked against
    ``config`` and the device ("mosaic" off the GPU runs the kernels' XLA emulation, for CPU
    tests); raises ValueError naming the argument when it cannot run.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "mosaic":
        if isinstance(config, MoEConfig):
            raise ValueError("config: backend='mosaic' takes a MosaicMoEConfig (or None), got a "
                             "Pallas-Triton MoEConfig")
        check_supported(hidden, name="fc1")
        if on_gpu() and (why := mosaic_unavailable(gpu_compute_capability())) is not None:
            raise ValueError(f"backend: 'mosaic' needs an sm_90 (Hopper) GPU, or SM 12.x with "
                             f"plgpu.mma (JAX >= 0.11) ({why}); off the GPU it runs the "
                             "kernels' XLA emulation")
        return "mosaic"
    if backend in ("pallas", "xla"):
        if isinstance(config, MosaicMoEConfig):
            raise ValueError(f"config: backend={backend!r} takes a MoEConfig (or None), got a "
                             "MosaicMoEConfig")
        return backend
    if not on_gpu():
        why, pick = "no GPU", "xla"
    elif isinstance(config, MoEConfig):
        why, pick = "explicit Pallas-Triton MoEConfig", "pallas"
    elif hidden % BLOCK_K:
        why, pick = f"H = {hidden} is not a multiple of {BLOCK_K}", "pallas"
    elif is_sm90():
        if routes > MAX_ROUTES:
            why, pick = f"T*k = {routes} routes > mosaic.MAX_ROUTES = {MAX_ROUTES}", "pallas"
        else:
            log.info("nvfp4_jax.moe: backend auto -> mosaic (sm_90, %d routes <= %d)", routes,
                     MAX_ROUTES)
            return "mosaic"
    elif is_sm12x():
        cc = gpu_compute_capability()
        per_expert = routes_per_expert(routes, experts)
        if (why := mosaic_unavailable(cc)) is not None:
            pick = "pallas"
        elif per_expert > SM12X_ROUTES_PER_EXPERT:
            pick = "pallas"
            why = (f"sm_{cc}: {per_expert} routed rows per expert > mosaic."
                   f"SM12X_ROUTES_PER_EXPERT = {SM12X_ROUTES_PER_EXPERT}: the FP4 MMA")
        else:
            log.info("nvfp4_jax.moe: backend auto -> mosaic (sm_%d, grouped GEMMs on mma.sync: "
                     "%d routed rows per expert <= %d)", cc, per_expert, SM12X_ROUTES_PER_EXPERT)
            return "mosaic"
    else:
        why, pick = "neither an sm_90 nor an SM 12.x GPU", "pallas"
    if isinstance(config, MosaicMoEConfig) and pick != "xla":
        raise ValueError(  # noqa: TRY004 - not a type error: the device or shape rules it out
            f"config: a MosaicMoEConfig was given but the Mosaic kernels cannot run ({why})")
    log.info("nvfp4_jax.moe: backend auto -> %s (%s)", pick, why)
    return pick


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
    stacks: tuple | None = None,
    layer: jax.Array | None = None,
    residual: jax.Array | None = None,
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
    Softmax routing on the kernel backends runs as one launch (``select_kernel``: the
    experts of the k largest logits, ``oracle.select_experts``; weights within
    ``oracle.select_experts_error_bound``, as XLA's path).
    ``mode``: "trtllm_cutlass" or "b12x" (arithmetic of ``oracle.moe``); ``activation_scale``:
    "scalar" (default for trtllm_cutlass, the only choice there) or "per_expert" (default for
    b12x). ``backend``: "auto", "mosaic", "pallas" or "xla" (module docstring; "mosaic": FC2
    stays on Pallas-Triton when I % 256 is neither 0 nor 128). Off the GPU the Pallas kernels
    run in interpret mode. ``config``: ``MoEConfig`` (Pallas-Triton tiles) or
    ``moe.mosaic.MosaicMoEConfig`` (Mosaic tiles), None for the defaults.
    ``stacks``, ``layer``: None, or together: fc1 and fc2 are layer ``layer`` (an int32
    scalar) of ``stacks`` = (fc1 stack [L, E, R, H], fc2 stack [L, E, H, I]), a scan over
    stacked layers, optionally followed by the fc1_input_scale and fc2_input_scale stacks
    fp32 [L, E] (or [L]) that the input scales are row ``layer`` of. The Pallas-Triton kernels
    then read layer ``layer``'s experts in place (linear scales, unpadded fc2; else fc1/fc2,
    logged): XLA copies a per-layer slice of a stack whole into every Pallas-Triton kernel
    that reads it, on every step of the scan. The Mosaic kernels and XLA take fc1/fc2
    (uncopied there); XLA drops the form left unused. With the input scale stacks, the launch
    that computes the scales (on both kernel paths) reads the four scale vectors in place
    too.
    ``residual``: None, or bf16 [T, H]: returns residual + the layer output, bf16 (as XLA adds
    two bf16 arrays: both widened to fp32, added, rounded to nearest even); the Mosaic path
    adds it in its combine launch (in XLA where its FC2 runs on Pallas-Triton), the others in
    XLA (``xla.add_residual``). A decoder's ``x + moe(h)`` is ``moe(h, residual=x)``.

    Bad values (docs/input-policy.md): a concrete non-finite ``hidden``, ``topk_ids`` outside
    [0, E), input scales not finite and > 0, or inconsistent ``fc1``/``fc2`` raise; traced, they
    are checked under :func:`nvfp4_jax.checked`, and unchecked the affected tokens' output rows
    are NaN.
    """
    hidden = jnp.asarray(hidden)
    if (stacks is None) != (layer is None):
        raise ValueError("stacks, layer: pass both (fc1/fc2 are layer `layer` of `stacks`) or "
                         "neither")
    if stacks is not None:
        if not isinstance(stacks, (tuple, list)) or len(stacks) not in (2, 4):
            raise ValueError("stacks: expected (fc1 stack, fc2 stack) or (fc1 stack, fc2 stack, "
                             "fc1_input_scale stack, fc2_input_scale stack)")
        for name, w, st in (("fc1", fc1, stacks[0]), ("fc2", fc2, stacks[1])):
            validate.check_stack("stacks", st, w, layer, what=f"the {name} stack, an NVFP4Array")
        _check_input_scale_stacks(stacks, fc1)
    if activation_scale is None:
        activation_scale = "scalar" if mode == "trtllm_cutlass" else "per_expert"
    s1 = jnp.asarray(fc1_input_scale)
    s2 = jnp.asarray(fc2_input_scale)
    e, inter = _check(hidden, fc1, fc2, s1, s2, activation, gate_up_order, mode, backend,
                      activation_scale)
    validate.check_moe_args(hidden, fc1, fc2, s1, s2, topk_ids)
    if residual is not None:
        residual = jnp.asarray(residual)
        if residual.shape != hidden.shape or residual.dtype != jnp.bfloat16:
            raise ValueError(f"residual: expected bfloat16 {tuple(hidden.shape)} (hidden's shape "
                             f"[T, H]), got {residual.dtype} {tuple(residual.shape)}")
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
        backend = choose_backend(backend, config, routes=hidden.shape[0] * top_k,
                                 hidden=hidden.shape[1], experts=e)
        in_kernel = (routing == "softmax" and backend != "xla" and select_fits(e, top_k)
                     and hidden.shape[0] > 0)
        if in_kernel:  # softmax, top-k, renormalization and the finite-row check: one launch
            topk_ids, topk_weights = select_kernel(router_logits, hidden, top_k,
                                                   renormalize=renormalize,
                                                   interpret=pallas_interpret())
        else:
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
        backend = choose_backend(backend, config, routes=topk_ids.size, hidden=hidden.shape[1],
                                 experts=e)
        in_kernel = False
    if not in_kernel:
        # a token whose hidden row holds NaN/Inf gets NaN router weights, so its output row is
        # NaN on every backend whatever a kernel's arithmetic makes of the non-finite values
        # (docs/input-policy.md); one fused reduction over hidden (select_kernel: in its launch)
        finite = jnp.isfinite(hidden).all(axis=-1, keepdims=True)
        topk_weights = jnp.where(finite, topk_weights, jnp.nan).astype(topk_weights.dtype)
    kw = {"activation": activation, "gate_up_order": gate_up_order, "mode": mode,
          "activation_scale": activation_scale}
    if backend == "xla":
        out = moe_xla(hidden, topk_ids, topk_weights, fc1, unpad_fc2(fc2, inter), s1, s2, **kw)
        return out if residual is None else add_residual(residual, out)
    interpret = pallas_interpret()
    if backend == "mosaic":
        if interpret:
            log.info("nvfp4_jax.moe: backend mosaic off the GPU -> XLA emulation of the kernels")
        scale_stacks = None
        if stacks is not None and len(stacks) == 4:  # the scale launch reads them in place
            scale_stacks = (stacks[0].decode_scale, stacks[1].decode_scale, *stacks[2:])
        return moe_mosaic(hidden, topk_ids, topk_weights, fc1, fc2, s1, s2, config=config,
                          reference=interpret, residual=residual, scale_stacks=scale_stacks,
                          layer=None if scale_stacks is None else layer, **kw)
    if stacks is not None:
        inter = intermediate_size(fc1.shape[1], activation)
        if all(w.layout == "linear" for w in stacks[:2]) and stacks[1].shape[-1] == inter:
            fc1, fc2 = stacks[:2]
        else:
            log.info("nvfp4_jax.moe: a stack with swizzled scales or padded fc2: the kernels "
                     "read fc1/fc2, the layer's slice (inside a scan a copy on every call)")
            layer = None
    in_stacks = tuple(stacks[2:]) if layer is not None and len(stacks) == 4 else None
    out = moe_pallas(hidden, topk_ids, topk_weights, fc1, fc2, s1, s2, config=config,
                     interpret=interpret, layer=layer, input_scale_stacks=in_stacks, **kw)
    return out if residual is None else add_residual(residual, out)


def _check_input_scale_stacks(stacks, fc1) -> None:
    """``moe``'s optional input scale stacks: float [L, E] or [L], L the fc1 stack's."""
    n_layers, e = stacks[0].shape[0], fc1.shape[0]
    for name, st in zip(("fc1_input_scale", "fc2_input_scale"), stacks[2:]):
        shape = jnp.shape(st)
        if (not jnp.issubdtype(jnp.result_type(st), jnp.floating) or not 1 <= len(shape) <= 2
                or shape[0] != n_layers or shape[1:] not in ((), (1,), (e,))):
            raise ValueError(f"stacks: expected the {name} stack, float [L={n_layers}, E={e}] or "
                             f"[{n_layers}], got {jnp.result_type(st)}{shape}")
