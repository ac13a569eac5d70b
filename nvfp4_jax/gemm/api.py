"""Public NVFP4 GEMM: ``matmul(x, w)`` = ``x @ dequantize(w)^T``, W4A16 or W4A4.

Backends (``backend=``):

* ``"pallas"``: the Pallas-Triton kernel (pallas_triton.py) on an NVIDIA GPU with compute
  capability >= 8.9 (the kernel converts E4M3 scales in registers); on CPU it runs in Pallas
  interpret mode (slow, for tests);
* ``"xla"``: exact dequantize, then ``jnp.dot`` with fp32 accumulation (xla.py), any device;
* ``"mosaic"``: the Mosaic GPU kernel (mosaic.py, M <= 64, K % 256 == 0, bf16 activations):
  wgmma on sm_90; on SM 12.x (RTX 50xx, DGX Spark) the same kernel on warp-level
  ``mma.sync`` (``MosaicConfig(mma="sync")``, JAX >= 0.11); other shapes or devices fall back to
  ``"pallas"`` (logged);
* ``"auto"``: ``"pallas"`` on a supported NVIDIA GPU, else ``"xla"``; on sm_90 and SM 12.x
  every shape the Mosaic kernel runs (M <= 64, K % 256 == 0, bf16 x: W4A16, and W4A4 on the
  bf16 MMA) uses ``"mosaic"`` (faster than Pallas-Triton at every shape measured on the H200,
  in both forms), with the tiles of ``mosaic.config_for``. The choice is logged.

W4A4 on the Pallas backend multiplies on one of two MMAs (``mma=``, ``fp4mma.MMAS``):
``"fp4"``, the block-scaled FP4 MMA (``fp4mma.gemm_fp4mma`` on the codes and E4M3 scale bytes
that ``operand.w4a4_codes`` writes), the default on SM 12.x GPUs (RTX 50xx, DGX Spark), where
it runs at 8x the bf16 MMA rate at every M (bench/sm12x_model.py); or ``"bf16"``, the
default everywhere else (the H200 keeps Mosaic / the bf16-MMA Pallas kernel). So
``backend="pallas"`` on SM 12.x means the FP4 MMA; ``mma="bf16"`` (or a Pallas-Triton
``Config``) forces the bf16 MMA there, ``mma="fp4"`` (or an ``Fp4MmaConfig``) forces the FP4
kernel anywhere (Triton decomposes it into bf16 MMAs on sm_90; interpret mode on CPU).

W4A4 numerics (TensorRT-LLM ``nvfp4_gemm``): x is quantized with the ``trtllm`` recipe and
encode scale ``G = fp32(1/input_scale)``; ``alpha = fp32(input_scale * weight_scale_2)``. The
dequantized activation ``e2m1 * e4m3`` is exact in bf16, so feeding it to the W4A16 kernel with
fp32 accumulation gives the same numbers as an FP4 x FP4 MMA with fp32 accumulation. On an
NVIDIA GPU the ``"pallas"`` backend quantizes x in one Pallas-Triton launch with IEEE
divisions (``operand.w4a4_operand``); the ``"mosaic"`` and ``"xla"`` backends use ``quantize``
(XLA ops, its divisions ``division.divide``: exact on every backend, flags or not), which XLA
fuses with x's producer: in a decode step that is one kernel fewer per linear than the
Pallas-Triton operand and its input-scale slice (Llama-3-8B on the H200: 3.43 against 3.56 ms
per step, docs/models.md). Either way the activation codes are the oracle's.
:func:`matmul_w4a4_prologue` is the decoders' form at decode (``nn.norm_linear``): one
Pallas-Triton launch makes the Mosaic kernel's operand, RMSNorm'd if asked, reading the layer's
norm weight and input scale in place from their stacks inside a scan.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from .. import validate
from ..device import gpu_compute_capability, is_sm12x, pallas_interpret, sm12x
from ..division import divide
from ..quantize import NVFP4Array, dequantize, quantize
from . import configs, mosaic
from .fp4mma import MMAS, Fp4MmaConfig, gemm_fp4mma
from .operand import NORM_MAX_K, mosaic_w4a4_operand, w4a4_codes, w4a4_operand
from .pallas_triton import Config, matmul_pallas
from .xla import matmul_xla

log = logging.getLogger(__name__)

BACKENDS = ("auto", "mosaic", "pallas", "xla")
_MIN_CC = 89  # float8_e4m3fn -> f32 conversion in Triton needs sm_89+


def register_sm12x_device_kinds(
    device_kind: str | None = None, compute_capability: int | None = None
) -> bool:
    """Teach JAX >= 0.11's Pallas-Triton GPU table about GeForce RTX 50xx (SM 12.0).

    ``jax._src.pallas.triton.gpu_info`` maps ``device_kind`` strings to a compute capability
    and has no entry for "NVIDIA GeForce RTX 50xx", so lowering fails with "No supported GPU
    devices found". Registers the kind (only when that module exists and the kind is unknown).
    Returns True when an entry was added.
    """
    try:
        from jax._src.pallas.triton import gpu_info  # jax >= 0.11 only
    except ImportError:
        return False
    registry = getattr(gpu_info, "registry", None)
    info_cls = getattr(gpu_info, "GpuInfo", None)
    custom_cls = getattr(gpu_info, "CustomGpuTargetConfig", None)  # some 0.11.x snapshots
    if registry is None or (info_cls is None and custom_cls is None):
        return False
    if device_kind is None:
        try:
            dev = jax.devices()[0]
        except RuntimeError:
            return False
        if dev.platform != "gpu":
            return False
        device_kind = dev.device_kind
    if "RTX 50" not in device_kind:
        return False
    known = device_kind in registry
    lookup = getattr(gpu_info, "gpu_version_from_device_kind", None)
    if lookup is not None:
        try:
            known = known or lookup(device_kind) is not None
        except Exception as e:  # noqa: BLE001 - an unknown kind may raise instead of returning None
            log.debug("gpu_version_from_device_kind(%r) raised %r", device_kind, e)
    if known:
        return False
    cc = compute_capability or 120
    arch = f"{cc // 10}.{cc % 10}"
    if info_cls is not None:
        registry[device_kind] = lambda: info_cls(
            gpu_version=None, arch_name=arch, compute_capability=cc
        )
    else:
        registry[device_kind] = lambda: custom_cls("CUDA", device_kind, arch, cc, 0, 0)
    log.info(
        "nvfp4_jax.gemm: registered %r as compute capability %s for Pallas-Triton",
        device_kind,
        arch,
    )
    return True


def resolve_backend(backend: str) -> str:
    """Map ``backend`` to "mosaic", "pallas" or "xla" (logging the choice of "auto"; "auto"
    never returns "mosaic" here: that choice depends on the shape, see ``matmul``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    cc = gpu_compute_capability()
    if cc is not None and cc >= _MIN_CC:
        register_sm12x_device_kinds()
        log.info("nvfp4_jax.matmul: backend auto -> pallas (NVIDIA GPU, sm_%d)", cc)
        return "pallas"
    log.info(
        "nvfp4_jax.matmul: backend auto -> xla (%s)",
        "no NVIDIA GPU" if cc is None else f"sm_{cc} < sm_{_MIN_CC}",
    )
    return "xla"


def _pick_mosaic(backend: str, impl: str, m: int, n: int, k: int, x_dtype,
                 config=None) -> str:
    """"mosaic" where it applies: explicitly asked for (else fall back to "pallas", logged), or
    "auto" on sm_90 and on SM 12.x (with ``plgpu.mma``: JAX >= 0.11) for every shape the
    kernel runs (M <= 64, K % 256 == 0, bf16 activations), with ``mosaic.config_for``'s
    tiles, unless a Pallas-Triton ``config`` was given (its tiles are what the caller asked
    for). Otherwise ``impl`` unchanged; an SM 12.x GPU without ``plgpu.mma`` says so (logged)."""
    cc = gpu_compute_capability()
    if backend == "auto":
        if impl != "pallas" or x_dtype != jnp.bfloat16 or isinstance(config, Config):
            return impl
        if cc != 90 and not sm12x(cc):
            return impl
        try:
            mosaic.check_supported(m, n, k)
        except ValueError:
            return impl
        why = mosaic.unavailable(cc)
        if why is not None:
            log.info("nvfp4_jax.matmul: backend auto -> pallas (%s)", why)
            return impl
        tiles = "tuned" if mosaic.auto_config(m, n, k) is not None else "default_config tiles"
        log.info("nvfp4_jax.matmul: backend auto -> mosaic (sm_%d%s, M=%d N=%d K=%d, %s)",
                 cc, "" if cc == 90 else ", mma.sync", m, n, k, tiles)
        return "mosaic"
    if impl != "mosaic":
        return impl
    try:
        why = mosaic.unavailable(cc)
        if why is not None:
            raise ValueError(f"backend: {why}")
        if x_dtype != jnp.bfloat16:
            raise ValueError(f"x: the Mosaic kernel takes bfloat16 activations, got {x_dtype}")
        mosaic.check_supported(m, n, k)
    except ValueError as e:
        log.warning("nvfp4_jax.matmul: backend mosaic -> pallas fallback (%s)", e)
        return "pallas"
    return "mosaic"


def auto_impl(m: int, n: int, k: int, x_dtype=jnp.bfloat16) -> str:
    """The kernel family ``matmul(backend="auto")`` runs here for an [M, K] x [N, K]^T with
    ``x_dtype`` activations on the bf16 MMA: "mosaic", "pallas" or "xla" (benchmarks record it)."""
    return _pick_mosaic("auto", resolve_backend("auto"), m, n, k, x_dtype)


def _pick_mma(backend: str, impl: str, w4a4: bool, mma: str | None, config) -> str:
    """"fp4" (``fp4mma.gemm_fp4mma``) or "bf16" (the other kernels) for this call.

    Explicit: ``mma``, else the type of ``config`` (an ``Fp4MmaConfig`` means "fp4", a
    Pallas-Triton ``Config`` "bf16"); "fp4" then runs wherever asked (interpret mode off the
    GPU, Triton's decomposition on sm_90). Default: "fp4" for W4A4 on the Pallas backend
    (``backend`` "auto" or "pallas") of an SM 12.x GPU (logged), "bf16" everywhere else."""
    if mma is not None and mma not in MMAS:
        raise ValueError(f"mma: expected one of {MMAS} or None, got {mma!r}")
    if config is not None and not isinstance(config, (Config, Fp4MmaConfig)):
        raise ValueError(
            f"config: expected a Config, an Fp4MmaConfig or None, got {type(config).__name__}")
    implied = {Config: "bf16", Fp4MmaConfig: "fp4"}.get(type(config))
    if mma is not None and implied is not None and mma != implied:
        raise ValueError(f"config: a {type(config).__name__} is for mma={implied!r}, got "
                         f"mma={mma!r}")
    want = mma or implied
    if want == "fp4":
        if not w4a4:
            raise ValueError("mma: 'fp4' multiplies FP4 activations: W4A4 (input_scale given, "
                             "or x an NVFP4Array)")
        if backend in ("mosaic", "xla"):
            raise ValueError(f"mma: 'fp4' runs on the Pallas backend ('pallas' or 'auto'), got "
                             f"backend={backend!r}")
        if impl != "pallas":
            log.info("nvfp4_jax.matmul: mma fp4 -> the Pallas FP4-MMA kernel (interpret mode "
                     "off the GPU)")
        return "fp4"
    if want is None and w4a4 and impl == "pallas" and is_sm12x():
        log.info("nvfp4_jax.matmul: W4A4 on backend %s -> FP4 MMA (SM 12.x: block-scaled FP4 "
                 "tensor cores, fp4mma.gemm_fp4mma)", backend)
        return "fp4"
    return "bf16"


def _check_weight(w) -> None:
    if not isinstance(w, NVFP4Array):
        raise ValueError(f"w: expected an NVFP4Array [N, K], got {type(w).__name__}")  # noqa: TRY004
    if len(w.shape) != 2:
        raise ValueError(f"w: expected a 2-D NVFP4Array [N, K], got shape {w.shape}")
    if w.codes.dtype != jnp.uint8:
        raise ValueError(f"w.codes: expected uint8, got {w.codes.dtype}")
    if w.scales.dtype not in (jnp.float8_e4m3fn, jnp.uint8):
        raise ValueError(f"w.scales: expected float8_e4m3fn, got {w.scales.dtype}")
    if jnp.ndim(w.decode_scale) != 0:
        raise ValueError(
            f"w.decode_scale: expected a scalar, got shape {jnp.shape(w.decode_scale)}"
        )


def _check_stack(w: NVFP4Array, stack, layer):
    """``stack`` when the Pallas-Triton kernels can read ``w`` in place from it, else None."""
    if (stack is None) != (layer is None):
        raise ValueError("stack, layer: pass both (w is layer `layer` of `stack`) or neither")
    if stack is None:
        return None
    validate.check_stack("stack", stack, w, layer)
    if stack.layout != "linear":
        log.info("nvfp4_jax.matmul: a stack with %s scales: the kernels read w, the layer's "
                 "slice (inside a scan a copy on every call)", stack.layout)
        return None
    return stack


def matmul(
    x,
    w: NVFP4Array,
    *,
    input_scale=None,
    out_dtype=jnp.bfloat16,
    backend: str = "auto",
    config: Config | Fp4MmaConfig | None = None,
    mma: str | None = None,
    stack: NVFP4Array | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """NVFP4 GEMM ``out[..., N] = x[..., K] @ W[N, K]^T`` with fp32 accumulation.

    x: bf16/fp16 ``[..., K]`` (W4A16, or W4A4 when ``input_scale`` is given), or an
    :class:`NVFP4Array` ``[..., K]`` (W4A4, alpha = x.decode_scale * w.decode_scale).
    w: NVFP4Array ``[N, K]`` (swizzled scales are unswizzled on every call, with a warning:
    convert once with ``w.with_layout("linear")``).
    input_scale: ModelOpt ``input_scale`` (decode form, amax/2688, fp32 scalar) -> W4A4.
    out_dtype: bf16 (default), fp16 or fp32. Returns out_dtype ``[..., N]``. Jittable.
    backend: "auto", "pallas", "mosaic" or "xla" (module docstring). config: tiles of the
    Pallas kernel that runs (``pallas_triton.Config`` or ``fp4mma.Fp4MmaConfig``), None for
    the defaults. mma: "fp4" or "bf16" (``fp4mma.MMAS``), the tensor-core instruction of W4A4
    on the Pallas backend; None: "fp4" on SM 12.x GPUs, "bf16" elsewhere (``_pick_mma``).
    stack, layer: None, or together: ``w`` is layer ``layer`` (an int32 scalar) of ``stack``
    (NVFP4Array [L, N, K], linear scales; a scan over stacked layers). The Pallas-Triton
    kernels then read the stack in place: XLA copies a per-layer slice of a stack whole into
    every Pallas-Triton kernel that reads it, on every step of the scan (the Mosaic kernel and
    XLA take ``w``, the slice, uncopied, and XLA drops whichever form goes unused).
    Bad values (docs/input-policy.md): concrete non-finite ``x``, a non-positive
    ``input_scale`` or an inconsistent ``w`` raise ValueError/TypeError; traced, they are
    checked under :func:`nvfp4_jax.checked`, and unchecked a non-finite x gives non-finite
    (W4A4: NaN) output rows.
    """
    _check_weight(w)
    stack = _check_stack(w, stack, layer)
    n, k = w.shape
    if k % 16:
        raise ValueError(f"w: K must be a multiple of 16, got shape {w.shape}")
    validate.check_matmul_args(x, w, input_scale)
    if jnp.dtype(out_dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    impl = resolve_backend(backend)
    if w.layout != "linear":
        log.warning("nvfp4_jax.matmul: w's %s scales are converted to linear on every call "
                    "(an XLA transpose of N*K/16 bytes); pass w.with_layout('linear') once",
                    w.layout)
    w_scales = w.linear_scales() if w.layout != "linear" else w.scales
    w_decode = jnp.asarray(w.decode_scale, jnp.float32)
    # what the Pallas-Triton kernels read: the stack in place, or w
    wc, ws, wl = (w.codes, w_scales, None) if stack is None else (stack.codes, stack.scales, layer)

    s_in = None  # W4A4 on the fly: x is quantized below, where the backend is known
    x_nv = None  # W4A4 with x already NVFP4
    if isinstance(x, NVFP4Array):  # W4A4 with a pre-quantized activation
        if input_scale is not None:
            raise ValueError("input_scale: must be None when x is already an NVFP4Array")
        if x.shape[-1] != k:
            raise ValueError(f"x: K mismatch, x has K={x.shape[-1]}, w has K={k}")
        if jnp.ndim(x.decode_scale) != 0:
            raise ValueError("x.decode_scale: expected a scalar (one per activation tensor)")
        x_nv, x_op = x, None  # dequantized below for the kernels that take values
        alpha = jnp.asarray(x.decode_scale, jnp.float32) * w_decode
    else:
        x = jnp.asarray(x)
        if x.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"x: expected bfloat16 or float16 (or an NVFP4Array), got {x.dtype}")
        if x.ndim < 1 or x.shape[-1] != k:
            raise ValueError(f"x: K mismatch, x has shape {x.shape}, w has K={k}")
        if input_scale is None:
            x_op, alpha = x, w_decode
        else:
            s_in = jnp.asarray(input_scale, jnp.float32)
            if s_in.ndim != 0:
                raise ValueError(f"input_scale: expected an fp32 scalar, got shape {s_in.shape}")
            x_op = x
            alpha = s_in * w_decode

    lead = tuple(x.shape[:-1])
    m = int(np.prod(lead, dtype=np.int64))
    if m == 0:
        return jnp.zeros(lead + (n,), out_dtype)
    w4a4 = s_in is not None
    if _pick_mma(backend, impl, w4a4 or x_nv is not None, mma, config) == "fp4":
        if x_nv is not None:  # the activation's own codes and scales
            xc = x_nv.codes.reshape(m, k // 2)
            xs = x_nv.linear_scales().reshape(m, k // 16)
        else:  # one kernel, IEEE divisions whatever XLA's flags
            xc, xs = w4a4_codes(x.reshape(m, k), s_in, interpret=pallas_interpret())
        out = gemm_fp4mma(xc, xs, wc, ws, alpha, out_dtype=out_dtype, config=config,
                          interpret=pallas_interpret(), layer=wl)
        return out.reshape(lead + (n,))
    if x_op is None:
        x_op = dequantize(x_nv, jnp.bfloat16, include_decode_scale=False)  # exact
    x2 = x_op.reshape(m, k)
    # the W4A4 operand is bf16 whatever x's dtype (e2m1 * e4m3 values)
    impl = _pick_mosaic(backend, impl, m, n, k, jnp.bfloat16 if w4a4 else x2.dtype, config)
    if impl == "mosaic":
        mcfg = mosaic.config_for(m, n, k, gpu_compute_capability())
        if w4a4:  # XLA's quantizer, fused with x's producer (IEEE divisions: division.divide)
            xq = quantize(x2, "trtllm", encode_scale=divide(1.0, s_in))
            x2 = dequantize(xq, jnp.bfloat16, include_decode_scale=False)  # exact
        out = mosaic.matmul_mosaic(x2, w.codes, w_scales, alpha, out_dtype=out_dtype, config=mcfg)
        return out.reshape(lead + (n,))
    interpret = pallas_interpret()  # the Pallas-Triton kernels' mode here
    if w4a4:
        if impl == "pallas" and not interpret:
            x2 = w4a4_operand(x2, s_in)  # one kernel, IEEE divisions whatever XLA's flags
        else:  # XLA's quantizer (IEEE divisions on every backend: division.divide)
            xq = quantize(x2, "trtllm", encode_scale=divide(1.0, s_in))
            x2 = dequantize(xq, jnp.bfloat16, include_decode_scale=False)  # exact
    if impl == "xla":
        out = matmul_xla(x2, w.codes, w_scales, alpha, out_dtype=out_dtype)
    else:
        cfg = config or configs.get_config(m, n, k)
        if interpret:
            cfg = Config(**{**cfg.__dict__, "decode": "bits"})
        out = matmul_pallas(x2, wc, ws, alpha, out_dtype=out_dtype, config=cfg,
                            interpret=interpret, layer=wl)
    return out.reshape(lead + (n,))


def prologue_applies(m: int, n: int, k: int, backend: str = "auto", *,
                     norm: bool = False) -> bool:
    """Whether :func:`matmul_w4a4_prologue` can run here: on a GPU where ``matmul(backend=...)``
    runs this W4A4 [M, K] x [N, K]^T (bf16 x) on the Mosaic kernel (M <= 64); with ``norm``,
    K a power of two <= ``operand.NORM_MAX_K``."""
    if pallas_interpret() or (norm and (k & (k - 1) or k > NORM_MAX_K)):
        return False
    if backend not in BACKENDS or backend == "xla":
        return False
    impl = "pallas" if backend == "auto" and gpu_compute_capability() else backend
    return _pick_mosaic(backend, impl, m, n, k, jnp.bfloat16) == "mosaic"


def matmul_w4a4_prologue(x: jax.Array, w: NVFP4Array, input_scale: jax.Array, *,
                         layer: jax.Array | int | None = None,
                         norm_weight: jax.Array | None = None, eps: float = 1e-6,
                         out_dtype=jnp.bfloat16) -> jax.Array:
    """W4A4 ``matmul(x, w, input_scale=s)`` on the Mosaic kernel, x's operand made in one
    Pallas-Triton launch (``operand.mosaic_w4a4_operand``: quantized with IEEE divisions,
    zero-padded, permuted), optionally RMSNorm'd first: ``matmul(nn.rms_norm(x, norm_weight,
    eps), w, input_scale=s)``, the norm's fp32 sum of squares in another order.

    x: bf16 [M, K], M <= 64; w: NVFP4Array [N, K] (linear scales). layer: None (input_scale
    an fp32 scalar, norm_weight bf16 [K]), or an int32 scalar inside a scan over stacked
    layers: input_scale fp32 [L] and norm_weight bf16 [L, K] are the stacks, which the launch
    reads in place (a per-layer slice would be copied for it on every step). Where
    :func:`prologue_applies` says so; ValueError elsewhere. Returns out_dtype [M, N]."""
    _check_weight(w)
    x = jnp.asarray(x)
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"x: expected bf16 [M, K], got {x.dtype} {x.shape}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape != (n, k):
        raise ValueError(f"x: K mismatch, x has shape {x.shape}, w has shape {w.shape}")
    if not prologue_applies(m, n, k, "mosaic", norm=norm_weight is not None):
        raise ValueError(f"x: the Mosaic W4A4 prologue does not run M={m} N={n} K={k} here "
                         "(prologue_applies)")
    xp = mosaic_w4a4_operand(x, input_scale, mosaic.token_tile(m), layer=layer,
                             norm_weight=norm_weight, eps=eps)
    return _w4a4_on_operand(xp, m, w, input_scale, layer, out_dtype)


def matmul_w4a4_operand(xp: jax.Array, m: int, w: NVFP4Array, input_scale: jax.Array, *,
                        layer: jax.Array | int | None = None,
                        out_dtype=jnp.bfloat16) -> jax.Array:
    """The Mosaic GEMM of :func:`matmul_w4a4_prologue` on an operand another launch made:
    ``xp`` bf16 [mosaic.token_tile(m), K], ``operand.mosaic_w4a4_operand``'s layout and
    values for the same ``input_scale`` and ``layer`` (``attention.decode_qkv_attention``
    writes it for ``o_proj``). m: the tokens (M <= 64); w, input_scale, layer as
    :func:`matmul_w4a4_prologue`'s. Where :func:`prologue_applies` says so; ValueError
    elsewhere. Returns out_dtype [m, N]."""
    _check_weight(w)
    xp = jnp.asarray(xp)
    n, k = w.shape
    if not isinstance(m, int) or not 1 <= m <= mosaic.MAX_M:
        raise ValueError(f"m: expected an int in 1..{mosaic.MAX_M}, got {m!r}")
    if xp.ndim != 2 or xp.dtype != jnp.bfloat16 or xp.shape != (mosaic.token_tile(m), k):
        raise ValueError(f"xp: expected bf16 [{mosaic.token_tile(m)}, K={k}] for m={m}, got "
                         f"{xp.dtype} {xp.shape}")
    if not prologue_applies(m, n, k, "mosaic"):
        raise ValueError(f"xp: the Mosaic W4A4 GEMM does not run M={m} N={n} K={k} here "
                         "(prologue_applies)")
    return _w4a4_on_operand(xp, m, w, input_scale, layer, out_dtype)


def _w4a4_on_operand(xp, m, w, input_scale, layer, out_dtype):
    n, k = w.shape
    s = jnp.asarray(input_scale, jnp.float32)
    s_layer = s.reshape(()) if layer is None else jnp.take(s, jnp.asarray(layer, jnp.int32),
                                                           mode="clip")
    w_scales = w.linear_scales() if w.layout != "linear" else w.scales
    alpha = s_layer * jnp.asarray(w.decode_scale, jnp.float32)
    mcfg = mosaic.config_for(m, n, k, gpu_compute_capability())
    return mosaic.matmul_mosaic_permuted(xp, m, w.codes, w_scales, alpha, out_dtype=out_dtype,
                                         config=mcfg)
