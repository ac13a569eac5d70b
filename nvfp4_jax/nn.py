"""Building blocks for NVFP4 models in JAX: plain functions over parameter pytrees.

* :class:`Linear` + :func:`linear`: one NVFP4 linear, W4A16 (bf16 activations) or W4A4 when
  it holds an ``input_scale`` (TensorRT-LLM semantics: the activation is quantized with the
  ``trtllm`` recipe and encode scale ``1/input_scale``; ``nvfp4_jax.matmul``).
* :class:`MoE` + :func:`moe_block`: a routed mixture of experts: a bf16 router, softmax (or
  sigmoid-and-bias) top-k, and the experts on ``nvfp4_jax.moe`` (W4A4, TensorRT-LLM CUTLASS
  arithmetic: one activation scale per layer, the max of the experts' ``input_scale``).
* :func:`rms_norm`; :func:`norm_linear` (an RMSNorm then a linear, one launch before the GEMM
  where the Mosaic kernel runs W4A4 at decode); :func:`norm_router` (a MoE layer's RMSNorm and
  router logits, one launch at decode on a GPU); expert stacks are quantized with
  :func:`nvfp4_jax.quantize_experts`.

The parameter classes are registered pytrees (arrays are leaves, configuration is static), so
they pass through ``jax.jit``, ``jax.lax.scan`` over stacked layers, and ``jax.device_put``
with shardings.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from . import moe as moe_pkg
from .device import gpu_compute_capability, is_sm90, on_gpu, pallas_interpret
from .gemm.api import matmul, matmul_w4a4_operand, matmul_w4a4_prologue, prologue_applies
from .gemm.mosaic import token_tile
from .gemm.mosaic import unavailable as mosaic_unavailable
from .moe.norm_router import norm_router_fits, norm_router_kernel
from .moe.xla import add_residual
from .quantize import NVFP4Array

log = logging.getLogger(__name__)

BACKENDS = ("auto", "mosaic", "pallas", "xla")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Linear:
    """An NVFP4 linear ``y = x @ W^T``.

    w: NVFP4Array [N, K] (linear scale layout; decode_scale = ModelOpt ``weight_scale_2``).
    input_scale: float32 scalar (ModelOpt ``input_scale``, decode form amax/2688) for W4A4, or
    None for W4A16. stack, layer: None, or inside a scan over stacked layers the whole stack
    [L, N, K] that ``w`` is layer ``layer`` (int32 scalar) of (``matmul``'s ``stack`` and
    ``layer``: the Pallas-Triton kernels read it in place; :func:`join_stacks` sets them).
    """

    w: NVFP4Array
    input_scale: jax.Array | None = None
    stack: NVFP4Array | None = None
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """Logical ``(N, K)``."""
        return self.w.shape[-2], self.w.shape[-1]


def linear(p: Linear | jax.Array, x: jax.Array, *, backend: str = "auto",
           w4a4: bool = True) -> jax.Array:
    """``x [..., K]`` (bf16) -> bf16 ``[..., N]`` with fp32 accumulation.

    ``p``: a :class:`Linear` (NVFP4: W4A4 when ``p.input_scale`` is set and ``w4a4`` is True,
    else W4A16; ``backend`` as in ``nvfp4_jax.matmul``), or a bf16 weight array [N, K] (a layer
    the checkpoint left unquantized: ``jnp.dot`` with fp32 accumulation).
    """
    if not isinstance(p, Linear):
        w = jnp.asarray(p)
        if w.ndim != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"p: expected a Linear or a weight [N, K={x.shape[-1]}], "
                             f"got {w.shape}")
        y = jax.lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y.astype(jnp.bfloat16)
    s = p.input_scale if w4a4 else None
    return matmul(x, p.w, input_scale=s, backend=backend, stack=p.stack, layer=p.layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoE:
    """A routed NVFP4 MoE layer (SwiGLU or relu2 experts).

    router: bf16 [E, H] (kept in bf16, as ModelOpt exports it) or float32 [E, H] (Nemotron-H's
    fp32 gate, :func:`router_logits`); fc1: NVFP4Array [E, R, H]
    (R = 2I rows [up; gate] for swiglu, I for relu2), decode_scale [E]; fc2: NVFP4Array
    [E, H, I]; fc1_input_scale, fc2_input_scale: float32 [E] (ModelOpt ``input_scale``).
    correction_bias: float32 [E] for ``routing="sigmoid_bias"``, else None. Static: top_k,
    routing ("softmax" | "sigmoid_bias"), renormalize (Qwen3's ``norm_topk_prob``),
    routed_scaling_factor, activation ("swiglu" | "relu2").

    stacks, layer: None, or inside a scan over stacked layers the whole expert stacks
    (fc1 [n, E, R, H], fc2 [n, E, H, I], fc1_input_scale [n, E], fc2_input_scale [n, E]) that
    this layer's are row ``layer`` (int32 scalar) of (``nvfp4_jax.moe``'s ``stacks`` and
    ``layer``: the Pallas-Triton kernels read them in place, and the launch that computes the
    scales reads the scale stacks in place on every kernel path; :func:`join_stacks` sets
    them).
    """

    router: jax.Array
    fc1: NVFP4Array
    fc2: NVFP4Array
    fc1_input_scale: jax.Array
    fc2_input_scale: jax.Array
    correction_bias: jax.Array | None = None
    stacks: tuple | None = None
    layer: jax.Array | None = None
    top_k: int = dataclasses.field(default=2, metadata={"static": True})
    routing: str = dataclasses.field(default="softmax", metadata={"static": True})
    renormalize: bool = dataclasses.field(default=True, metadata={"static": True})
    routed_scaling_factor: float = dataclasses.field(default=1.0, metadata={"static": True})
    activation: str = dataclasses.field(default="swiglu", metadata={"static": True})


def router_logits(p: MoE | MoEBF16, x: jax.Array) -> jax.Array:
    """bf16 router ``x [T, H] @ router^T`` -> float32 [T, E] (fp32 accumulation, rounded to bf16
    as a bf16 ``nn.Linear`` rounds it). A float32 router (Nemotron-H keeps its gate in fp32)
    gives the fp32 product of fp32(x) and the router, unrounded, as HF computes it."""
    return _router_product(p.router, x)


def _router_product(router: jax.Array, x: jax.Array) -> jax.Array:
    if jnp.ndim(router) != 2 or jnp.ndim(x) != 2 or router.shape[1] != x.shape[1]:
        raise ValueError(f"router: expected [E, H] with x's H = {x.shape[-1]} (x [T, H]), got "
                         f"router {jnp.shape(router)} and x {jnp.shape(x)}")
    if router.dtype == jnp.float32:
        return jax.lax.dot_general(x.astype(jnp.float32), router, (((1,), (1,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
    y = jax.lax.dot_general(x, router, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16).astype(jnp.float32)


def norm_router(x: jax.Array, norm_weight: jax.Array, router: jax.Array, eps: float = 1e-6, *,
                layer: jax.Array | None = None,
                backend: str = "auto") -> tuple[jax.Array, jax.Array]:
    """A MoE layer's input: ``h = rms_norm(x, norm_weight, eps)`` and its router logits, as
    :func:`router_logits` computes them. x bf16 [..., H] -> (h bf16 [..., H], logits float32
    [..., E]).

    norm_weight bf16 [H] and router [E, H] (bf16, or float32 as :func:`router_logits` takes
    it); with ``layer`` (an int32 scalar, inside a loop over stacked layers) the stacks bf16
    [L, H] and [L, E, H], at row ``layer``. On a GPU (``backend`` other than "xla"; "pallas"
    also off the GPU, interpreted) with a bf16 router, at most 64 tokens and H a power of two
    <= 8192 (``moe.norm_router.norm_router_fits``), one Pallas-Triton launch reads x and the
    stacks in place (``moe.norm_router.norm_router_kernel``): the fp32 sum of squares and the
    logits' fp32 sums in another order than XLA's, which can move a bf16 rounding by an ulp (h
    within ``oracle.norm_rope_interval``; the logits within
    ``oracle.router_logits_interval``). In XLA these are three launches at decode, and a
    per-layer slice handed to a Pallas-Triton kernel is a copy of its own. Elsewhere the
    composition on x's own shape (XLA:CPU's sum of squares over [T, H] and over [B, T, H]
    need not round alike), the stacks sliced at ``layer``; where a kernel backend was asked
    for, the log says why."""
    return _norm_router(x, norm_weight, router, eps, layer, backend, None)


def add_norm_router(x: jax.Array, a: jax.Array, norm_weight: jax.Array, router: jax.Array,
                    eps: float = 1e-6, *, layer: jax.Array | None = None,
                    backend: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`norm_router` of the residual stream ``s = x + a``: x, a bf16 [..., H] (a
    decoder's residual and its attention output) -> (s bf16 [..., H], h bf16 [..., H], logits
    float32 [..., E]), s the bits of adding the two bf16 arrays (``moe.xla.add_residual``: a
    rounded to bf16 even where XLA would fuse the add with a's producer). Where
    :func:`norm_router` runs its kernel, the add is in the same launch
    (``norm_router_kernel(residual=)``; in XLA it is a launch of its own); elsewhere the add,
    then :func:`norm_router`. The other arguments as :func:`norm_router`'s."""
    x, a = jnp.asarray(x), jnp.asarray(a)
    if a.shape != x.shape or a.dtype != x.dtype:
        raise ValueError(f"a: expected {x.dtype} {list(x.shape)} (x's), got {a.dtype} "
                         f"{list(a.shape)}")
    return _norm_router(x, norm_weight, router, eps, layer, backend, a)


def _norm_router(x, norm_weight, router, eps, layer, backend, a):
    """:func:`norm_router` (``a`` None: returns (h, logits)) and :func:`add_norm_router`
    (returns (x + a, h, logits))."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"x: expected [..., H], got shape {x.shape}")
    stacked = layer is not None
    if jnp.ndim(router) != (3 if stacked else 2):
        raise ValueError(f"router: expected {'[L, E, H]' if stacked else '[E, H]'}"
                         f"{' with layer given' if stacked else ''}, got shape {jnp.shape(router)}")
    if jnp.ndim(norm_weight) != (2 if stacked else 1):
        raise ValueError(f"norm_weight: expected {'[L, H]' if stacked else '[H]'}"
                         f"{' with layer given' if stacked else ''}, got shape "
                         f"{jnp.shape(norm_weight)}")
    hd, e = x.shape[-1], router.shape[-2]
    if router.shape[-1] != hd or norm_weight.shape[-1] != hd:
        raise ValueError(f"router, norm_weight: expected H = {hd} (x's last axis), got "
                         f"{jnp.shape(router)} and {jnp.shape(norm_weight)}")
    x2 = x.reshape(-1, hd)
    if backend == "pallas" or (backend != "xla" and on_gpu()):
        why = norm_router_fits(x2.shape[0], hd, e, router.dtype)
        if why is None and (x.dtype != jnp.bfloat16 or norm_weight.dtype != jnp.bfloat16):
            why = f"{x.dtype} x and a {norm_weight.dtype} norm weight (bf16 only)"
        if why is None:
            out = norm_router_kernel(x2, norm_weight, router, eps, layer=layer,
                                     residual=None if a is None else a.reshape(-1, hd),
                                     interpret=pallas_interpret())
            shapes = (x.shape,) * (len(out) - 1) + (x.shape[:-1] + (e,),)
            return tuple(v.reshape(sh) for v, sh in zip(out, shapes))
        log.info("nvfp4_jax.nn.norm_router: the kernel does not take %s; XLA's norm and router",
                 why)
    # the add of the two arrays as materialized (moe.xla.add_residual: inside one fusion XLA
    # may add the fp32 value ``a`` was rounded from)
    s = x if a is None else add_residual(x, a)
    if stacked:
        norm_weight, router = norm_weight[layer], router[layer]
    h = rms_norm(s, norm_weight, eps)
    logits = _router_product(router, h.reshape(-1, hd)).reshape(x.shape[:-1] + (e,))
    return (h, logits) if a is None else (s, h, logits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEBF16:
    """The bf16 counterpart of :class:`MoE` (a baseline): router bf16 [E, H], fc1 bf16
    [E, 2I, H] (rows [up; gate]), fc2 bf16 [E, H, I]; softmax top-k routing; SwiGLU."""

    router: jax.Array
    fc1: jax.Array
    fc2: jax.Array
    top_k: int = dataclasses.field(default=2, metadata={"static": True})
    renormalize: bool = dataclasses.field(default=True, metadata={"static": True})


def moe_block_bf16(p: MoEBF16, x: jax.Array) -> jax.Array:
    """``x [T, H]`` bf16 -> bf16 [T, H] with bf16 weights: routes sorted by expert,
    ``lax.ragged_dot`` for both GEMMs (fp32 accumulation), SwiGLU, weighted top-k sum."""
    t = x.shape[0]
    e = p.fc1.shape[0]
    logits = router_logits(p, x)
    probs = jax.nn.softmax(logits, axis=-1)
    w, ids = jax.lax.top_k(probs, p.top_k)
    if p.renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // p.top_k]
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    u = jax.lax.ragged_dot(xs, jnp.swapaxes(p.fc1, 1, 2), sizes,
                           preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    i = u.shape[-1] // 2
    up, gate = u[:, :i].astype(jnp.float32), u[:, i:].astype(jnp.float32)
    h = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
    d = jax.lax.ragged_dot(h, jnp.swapaxes(p.fc2, 1, 2), sizes,
                           preferred_element_type=jnp.float32)
    d = d * w.reshape(-1)[order][:, None]
    out = jnp.zeros((t * p.top_k, d.shape[-1]), jnp.float32).at[order].set(d)
    return out.reshape(t, p.top_k, -1).sum(axis=1).astype(jnp.bfloat16)


def moe_block(p: MoE | MoEBF16, x: jax.Array, *, backend: str = "auto",
              logits: jax.Array | None = None, residual: jax.Array | None = None) -> jax.Array:
    """``x [T, H]`` bf16 -> bf16 [T, H]: route, then ``nvfp4_jax.moe`` (mode trtllm_cutlass),
    or :func:`moe_block_bf16` for a :class:`MoEBF16`.

    ``backend``: "auto" | "mosaic" | "pallas" | "xla", as ``nvfp4_jax.moe`` takes it.
    ``logits``: None, or x's router logits float32 [T, E] made already (by
    :func:`norm_router`); None: :func:`router_logits` of ``p`` and x.
    ``residual``: None, or bf16 [T, H]: returns ``residual +`` the block's output (a decoder
    layer's ``x + moe(h)``), as ``nvfp4_jax.moe(residual=)`` adds it (in the combine launch on
    the Mosaic path); for a :class:`MoEBF16` an XLA add.
    """
    if x.ndim != 2:
        raise ValueError(f"x: expected [T, H], got shape {x.shape}")
    if isinstance(p, MoEBF16):
        out = moe_block_bf16(p, x)
        return out if residual is None else residual + out
    if logits is None:
        logits = router_logits(p, x)
    elif jnp.shape(logits) != (x.shape[0], p.router.shape[-2]):
        raise ValueError(f"logits: expected the router logits [T={x.shape[0]}, "
                         f"E={p.router.shape[-2]}], got shape {jnp.shape(logits)}")
    return moe_pkg.moe(x, fc1=p.fc1, fc2=p.fc2, fc1_input_scale=p.fc1_input_scale,
                       fc2_input_scale=p.fc2_input_scale, router_logits=logits, top_k=p.top_k,
                       routing=p.routing, renormalize=p.renormalize,
                       correction_bias=p.correction_bias,
                       routed_scaling_factor=p.routed_scaling_factor, activation=p.activation,
                       gate_up_order="up_gate", mode="trtllm_cutlass", backend=backend,
                       stacks=p.stacks, layer=p.layer, residual=residual)


def _is_stacked_param(v) -> bool:
    return isinstance(v, (Linear, MoE))


def stacks_read_in_place(backend: str, kind: str = "linear") -> bool:
    """Whether the NVFP4 kernels that ``backend`` picks for ``kind`` ("linear" or "moe") are
    the Pallas-Triton ones, which read a layer of a weight stack in place: ``"pallas"``; for
    ``"auto"`` on a GPU other than sm_90, the MoE and the linears, except on SM12x with
    ``plgpu.mma`` (JAX >= 0.11), where decode-sized linears and MoE layers run the Mosaic
    kernels' mma.sync form (prefill-sized linears the Pallas-Triton kernels, on scanned
    slices; a stacked MoE gets its stacks from the decoders on every path, :func:`moe_stacks`,
    so its Pallas-Triton kernels read them in place there too).
    A scan over stacked layers then closes over the weight
    stacks (:func:`strip_stacks`, :func:`weight_stacks`, :func:`join_stacks`): XLA copies a
    per-layer slice of a stack whole into every Pallas-Triton kernel that reads it, on every
    step (the Qwen3-30B-A3B decode step on that path: 14.2 ms, 8.4 of them copies;
    docs/models.md). The Mosaic kernels and XLA's dots take scanned slices uncopied, and there
    the scan keeps them."""
    if kind not in ("linear", "moe"):
        raise ValueError(f"kind: expected 'linear' or 'moe', got {kind!r}")
    if backend == "pallas":
        return True
    if backend != "auto" or not on_gpu() or is_sm90():
        return False
    return mosaic_unavailable(gpu_compute_capability()) is not None


def weight_stacks(stacked) -> list:
    """The NVFP4 weight stacks of a pytree of stacked layers (leading axis n): every
    :class:`Linear`'s ``w`` and every :class:`MoE`'s (fc1, fc2, fc1_input_scale,
    fc2_input_scale), in tree order, for a scan's body to close over and hand to
    :func:`join_stacks`."""
    return [v.w if isinstance(v, Linear) else moe_stacks(v)
            for v in jax.tree_util.tree_leaves(stacked, is_leaf=_is_stacked_param)
            if _is_stacked_param(v)]


def moe_stacks(stacked: MoE) -> tuple:
    """A stacked :class:`MoE`'s (fc1, fc2, fc1_input_scale, fc2_input_scale) stacks, leading
    axis n: its ``stacks`` inside a loop over the layers."""
    return (stacked.fc1, stacked.fc2, stacked.fc1_input_scale, stacked.fc2_input_scale)


def strip_stacks(stacked, *, linears: bool = True, moe: bool = True):
    """The pytree of stacked layers without its NVFP4 weights (:class:`Linear` ``w``,
    :class:`MoE` fc1/fc2 set to None; only the linears' or only the MoEs' with ``moe`` or
    ``linears`` False): what a scan slices per layer when its body closes over the
    :func:`weight_stacks`. Weights left in stay scanned slices (:func:`join_stacks` keeps
    them), for the kernels that take slices."""

    def strip(v):
        if isinstance(v, Linear) and linears:
            return dataclasses.replace(v, w=None)
        if isinstance(v, MoE) and moe:
            return dataclasses.replace(v, fc1=None, fc2=None)
        return v

    return jax.tree_util.tree_map(strip, stacked, is_leaf=_is_stacked_param)


def join_stacks(p, stacks: list, layer: jax.Array):
    """Inside a scan body: layer ``layer``'s params ``p`` (the scan's slice of the tree
    :func:`weight_stacks` read, or of its :func:`strip_stacks`) with each :class:`Linear` and
    :class:`MoE` given the whole weight stacks and ``layer``; weights stripped from ``p`` come
    back as slices of the stacks (for shapes and for the kernels that take slices; unused,
    XLA drops them)."""
    it = iter(stacks)

    def cut(w):
        return jax.tree_util.tree_map(lambda a: a[layer], w)

    def put(v):
        if isinstance(v, Linear):
            st = next(it)
            return dataclasses.replace(v, w=cut(st) if v.w is None else v.w, stack=st,
                                       layer=layer)
        if isinstance(v, MoE):
            st = next(it)
            fc1 = cut(st[0]) if v.fc1 is None else v.fc1
            fc2 = cut(st[1]) if v.fc2 is None else v.fc2
            return dataclasses.replace(v, fc1=fc1, fc2=fc2, stacks=st, layer=layer)
        return v

    return jax.tree_util.tree_map(put, p, is_leaf=_is_stacked_param)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in fp32, as HF's Llama/Qwen3 RMSNorm: ``x [..., D]`` ->
    ``weight * (x / rms(x))`` in x's dtype (weight bf16 [D])."""
    if jnp.shape(weight) != x.shape[-1:]:
        raise ValueError(f"weight: expected [D] with x's last dimension D = {x.shape[-1]}, got "
                         f"shape {jnp.shape(weight)}")
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def norm_linear(p: Linear | jax.Array, x: jax.Array, norm_weight: jax.Array | None = None,
                eps: float = 1e-6, *, backend: str = "auto", w4a4: bool = True,
                layer: jax.Array | None = None,
                input_scales: jax.Array | None = None) -> jax.Array:
    """``linear(p, rms_norm(x, norm_weight, eps))``; without ``norm_weight``, ``linear(p, x)``.
    x bf16 [..., K] -> bf16 [..., N].

    layer, input_scales: None, or inside a scan over stacked layers the layer's index (int32
    scalar) into the stacks: ``norm_weight`` is then the bf16 [L, K] stack of the layers'
    norm weights and ``input_scales`` the fp32 [L] stack of ``p.input_scale`` (``p`` itself
    the layer's slice). Where the Mosaic kernel runs this W4A4 linear (``gemm.prologue_applies``:
    Hopper and SM 12.x with ``plgpu.mma``, M <= 64) one Pallas-Triton launch reads x and the
    stacks in place, norms x (the fp32 sum of squares in another order than XLA's, which can
    move a bf16 rounding by an ulp) and quantizes, pads and permutes it for the GEMM
    (``gemm.matmul_w4a4_prologue``): in XLA the norm and the quantizer are four launches
    (three without the norm), and a per-layer slice handed to a Pallas-Triton kernel is a copy
    of its own. Elsewhere the composition, the stacks sliced at ``layer``.
    """
    stacked = layer is not None
    if stacked and norm_weight is not None and jnp.ndim(norm_weight) != 2:
        raise ValueError(f"norm_weight: expected the bf16 [L, K] stack with layer given, got "
                         f"shape {jnp.shape(norm_weight)}")
    if isinstance(p, Linear) and p.input_scale is not None and w4a4 and x.dtype == jnp.bfloat16:
        n, k = p.shape
        lead = tuple(x.shape[:-1])
        m = 1
        for d in lead:
            m *= d
        scales = input_scales if stacked else p.input_scale
        if (scales is not None and x.shape[-1] == k and m >= 1
                and prologue_applies(m, n, k, backend, norm=norm_weight is not None)):
            out = matmul_w4a4_prologue(x.reshape(m, k), p.w, scales, layer=layer,
                                       norm_weight=norm_weight, eps=eps)
            return out.reshape(lead + (n,))
    if norm_weight is not None:
        w = norm_weight[layer] if stacked else norm_weight
        x = rms_norm(x, w, eps)
    if callable(p) and not isinstance(p, Linear):  # a parallel share (models.sharding)
        return p(x, backend=backend, w4a4=w4a4)
    return linear(p, x, backend=backend, w4a4=w4a4)


def w4a4_operand_rows(p: Linear | jax.Array, m: int, *, backend: str = "auto",
                      w4a4: bool = True) -> int | None:
    """Where :func:`norm_linear` without a norm runs this W4A4 linear on M = ``m`` tokens as
    the Mosaic GEMM of a separately made operand (``gemm.prologue_applies``), the operand's
    rows (the GEMM's token tile), which another launch may write instead
    (``attention.decode_qkv_attention(w4a4_operand=)``) for :func:`linear_on_operand`; else
    None."""
    if not (isinstance(p, Linear) and p.input_scale is not None and w4a4):
        return None
    n, k = p.shape
    return token_tile(m) if prologue_applies(m, n, k, backend) else None


def linear_on_operand(p: Linear, xp: jax.Array, m: int, *, layer: jax.Array | None = None,
                      input_scales: jax.Array | None = None) -> jax.Array:
    """:func:`norm_linear` (no norm) of the M = ``m`` tokens whose W4A4 Mosaic operand ``xp``
    bf16 [:func:`w4a4_operand_rows`, K] is already made for ``p.input_scale`` (or, with
    ``layer``, for the fp32 [L] stack ``input_scales`` at ``layer``): bf16 [m, N]
    (``gemm.matmul_w4a4_operand``)."""
    if not isinstance(p, Linear) or p.input_scale is None:
        raise ValueError("p: expected a W4A4 Linear (with input_scale)")
    scales = p.input_scale if layer is None else input_scales
    if scales is None:
        raise ValueError("input_scales: expected the fp32 [L] stack with layer given")
    return matmul_w4a4_operand(xp, m, p.w, scales, layer=layer)
