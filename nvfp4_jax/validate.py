"""Argument checks shared by ``quantize``, ``matmul`` and ``moe`` (policy: docs/input-policy.md).

Two regimes, chosen per value:

* **concrete** values (numpy arrays, Python scalars, committed ``jax.Array`` s outside
  ``jit``/``vmap``): a bad value raises ``ValueError`` at once, naming the argument, what was
  expected and what was got (for non-finite values: how many and where the first one is);
* **traced** values (inside ``jax.jit``, ``vmap``, ...): under :func:`checked` (or
  :func:`checkified`) the same conditions are emitted as ``checkify.debug_check`` s, and a
  failed check raises ``checkify.JaxRuntimeError`` with the same message. Elsewhere nothing
  is emitted (neither the check nor its operands): a check is
  an effect in the jaxpr, and any effect turns off ``jax.jit``'s C++ dispatch for the whole
  jitted function (every call then runs JAX's Python dispatch: milliseconds of host time per
  decode step). Which of the two a trace gets is part of ``jit``'s cache key
  (``jax.make_user_context``), so a function traced before ``checked`` is traced again under
  it. Unchecked, the library's documented result for bad values applies (non-finite input ->
  NaN output, out-of-range expert ids -> NaN output rows; docs/input-policy.md).

Only shapes, dtypes and scalars are checked on every call; a concrete array's values are read
with one device reduction and one scalar transfer (only outside ``jit``, where every operation
dispatches on its own anyway).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = [
    "FLOAT_DTYPES",
    "check_array",
    "check_dtype",
    "check_finite",
    "check_layer",
    "check_matmul_args",
    "check_moe_args",
    "check_positive_scale",
    "check_topk_ids",
    "checked",
    "checkified",
    "dtype_of",
    "is_concrete",
]

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

#: True while :func:`checked` traces: traced checks are emitted then only. A ``jit`` cache key
#: (a trace made without checks is never reused under ``checked``, nor the other way round).
_CHECKING = jax.make_user_context(False)


def _debug_check(msg: str, make: Callable[[], tuple]) -> None:
    """Under :func:`checked`: ``checkify.debug_check(pred, msg, *fmt_args)`` with
    ``(pred, *fmt_args) = make()``; otherwise nothing, not even the check's operands (an effect
    in every trace would cost each jitted caller its C++ dispatch)."""
    if _CHECKING.value:
        pred, *fmt_args = make()
        checkify.debug_check(pred, msg, *fmt_args)


def is_concrete(*xs: Any) -> bool:
    """True when none of ``xs`` is a JAX tracer (its values can be read on the host)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def dtype_of(x: Any) -> np.dtype:
    """The dtype ``x`` has as given, before any conversion (``jnp.asarray`` turns float64 into
    float32 when x64 is off; error messages must name what the caller passed)."""
    dt = getattr(x, "dtype", None)
    if dt is not None:
        return np.dtype(dt)
    return np.asarray(x).dtype


def check_dtype(name: str, x: Any, allowed: Sequence[Any], hint: str = "",
                error: type[Exception] = TypeError) -> None:
    """Raise ``error`` unless ``x`` (as given) has one of the ``allowed`` dtypes."""
    dt = dtype_of(x)
    if dt not in [np.dtype(a) for a in allowed]:
        names = [np.dtype(a).name for a in allowed]
        names = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
        raise error(f"{name}: expected {names}{hint}, got {dt.name}")


def _first_bad(bad: jax.Array, x: jax.Array) -> str:
    flat = int(jnp.argmax(bad.reshape(-1)))
    idx = tuple(int(i) for i in np.unravel_index(flat, x.shape)) if x.ndim else ()
    val = np.asarray(x.reshape(-1)[flat].astype(jnp.float32))
    return f"first at index {idx}: {val}"


def check_finite(name: str, x: Any) -> None:
    """No NaN or +-Inf in ``x``: ValueError when concrete, a checkify check when traced."""
    if is_concrete(x):
        with jax.ensure_compile_time_eval():  # a concrete array closed over by a jitted function
            xa = jnp.asarray(x)
            if not jnp.issubdtype(xa.dtype, jnp.floating):
                return
            bad = ~jnp.isfinite(xa)
            n = int(jnp.sum(bad))
            if n:
                raise ValueError(f"{name}: expected finite values, got {n} non-finite of "
                                 f"{xa.size} ({_first_bad(bad, xa)})")
        return
    if jnp.issubdtype(x.dtype, jnp.floating):
        _debug_check(f"{name}: expected finite values, got {{}} non-finite",
                     lambda: (jnp.all(jnp.isfinite(x)), jnp.sum(~jnp.isfinite(x))))


def check_positive_scale(name: str, s: Any, *, bounds: tuple[float, float] | None = None) -> None:
    """Every element of ``s`` finite and > 0 (and within ``bounds`` = (lo, hi) when given).
    ValueError when concrete, a checkify check when traced."""
    lo = np.float32(bounds[0] if bounds else 0.0)
    hi = np.float32(bounds[1] if bounds else np.finfo(np.float32).max)
    want = f"a value in [{bounds[0]:.3g}, {bounds[1]:.3g}]" if bounds else "finite and > 0"
    if is_concrete(s):
        try:
            a = np.asarray(s, np.float32)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected a float32 scale ({want}), got "
                             f"{type(s).__name__} {s!r:.40}") from None
        ok = np.isfinite(a) & (a > 0) & (a >= lo) & (a <= hi)
        if not ok.all():
            bad = a[~ok].reshape(-1)
            where = "" if a.ndim == 0 else f" at index {tuple(int(i) for i in np.argwhere(~ok)[0])}"
            raise ValueError(f"{name}: expected {want}, got {bad[0]}{where}")
        return

    def make():
        a = jnp.asarray(s, jnp.float32)
        ok = jnp.isfinite(a) & (a > 0) & (a >= lo) & (a <= hi)
        return jnp.all(ok), jnp.min(a), jnp.max(a)

    _debug_check(f"{name}: expected {want}, got min {{}} max {{}}", make)


def check_topk_ids(topk_ids: Any, num_experts: int) -> None:
    """Expert ids in [0, E): ValueError when concrete, a checkify check when traced."""
    if is_concrete(topk_ids):
        ids = np.asarray(topk_ids)
        bad = (ids < 0) | (ids >= num_experts)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got "
                             f"{int(bad.sum())} outside (first at index {first}: {ids[first]})")
        return
    _debug_check(f"topk_ids: expected expert ids in [0, {num_experts}), got min {{}} max {{}}",
                 lambda: (jnp.all((topk_ids >= 0) & (topk_ids < num_experts)),
                          jnp.min(topk_ids), jnp.max(topk_ids)))


def check_array(name: str, a: Any, *, ndim: int | None = None) -> None:
    """An ``NVFP4Array`` that is consistent (``a.validate()``: shapes, dtypes, layout, K > 0)
    and whose ``decode_scale`` is finite and > 0 and whose block scales hold no NaN."""
    if not (hasattr(a, "validate") and hasattr(a, "codes")):
        what = "an NVFP4Array" + (f" of rank {ndim}" if ndim else "")
        raise TypeError(f"{name}: expected {what}, got {type(a).__name__}")
    if ndim is not None and len(a.shape) != ndim:
        raise ValueError(f"{name}: expected an NVFP4Array of rank {ndim}, got shape {a.shape}")
    try:
        a.validate()
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}.{e}") from None
    check_positive_scale(f"{name}.decode_scale", a.decode_scale)
    scales = a.scales
    if is_concrete(scales):
        with jax.ensure_compile_time_eval():
            n = int(jnp.sum(jnp.isnan(jnp.asarray(scales).astype(jnp.float32))))
        if n:
            raise ValueError(f"{name}.scales: expected E4M3 block scales, got {n} NaN bytes "
                             "(0x7F/0xFF)")
    else:
        _debug_check(f"{name}.scales: expected E4M3 block scales, got NaN bytes",
                     lambda: (~jnp.any(jnp.isnan(scales.astype(jnp.float32))),))


def check_stack(name: str, stack: Any, of: Any, layer: Any, what: str = "an NVFP4Array") -> None:
    """A stack of layers (an NVFP4Array [L, *of.shape]) that ``of`` is layer ``layer`` of,
    and ``layer`` an integer scalar (``matmul``'s ``stack``, ``moe``'s ``stacks``)."""
    dims = tuple(getattr(of, "shape", ("E", "N", "K")))
    shape = getattr(stack, "shape", None)
    if (not hasattr(stack, "codes") or shape is None or len(shape) != len(dims) + 1
            or tuple(shape[1:]) != dims):
        raise ValueError(f"{name}: expected {what} [L, {', '.join(map(str, dims))}], got "
                         + (f"shape {shape}" if shape is not None else type(stack).__name__))
    check_layer(layer)


def check_layer(layer: Any, num_layers: int | None = None) -> None:
    """``layer`` an integer scalar (a layer index into a stack), and with ``num_layers``, when
    concrete, within ``0 .. num_layers - 1``."""
    layer = jnp.asarray(layer)
    if layer.ndim or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer: expected an integer scalar, got {layer.dtype}{layer.shape}")
    if num_layers is not None and is_concrete(layer) and not 0 <= int(layer) < num_layers:
        raise ValueError(f"layer: expected 0 <= layer < L = {num_layers}, got {int(layer)}")


def check_matmul_args(x: Any, w: Any, input_scale: Any) -> None:
    """``matmul``'s arguments: w a consistent 2-D NVFP4Array with K > 0; x (array) bf16/fp16,
    finite; ``input_scale`` finite and > 0. Shapes are checked by ``matmul`` itself."""
    check_array("w", w, ndim=2)
    if not hasattr(x, "validate"):
        check_dtype("x", x, (jnp.bfloat16, jnp.float16), " (or an NVFP4Array)", ValueError)
        check_finite("x", x)
    else:
        check_array("x", x)
    if input_scale is not None:
        check_positive_scale("input_scale", input_scale)


def check_moe_args(hidden: Any, fc1: Any, fc2: Any, fc1_input_scale: Any, fc2_input_scale: Any,
                   topk_ids: Any = None) -> None:
    """``moe``'s values: fc1/fc2 consistent stacks, hidden finite, input scales finite and > 0,
    ``topk_ids`` in [0, E) (shapes and dtypes are checked by ``moe`` itself)."""
    check_array("fc1", fc1, ndim=3)
    check_array("fc2", fc2, ndim=3)
    check_finite("hidden", hidden)
    check_positive_scale("fc1_input_scale", fc1_input_scale)
    check_positive_scale("fc2_input_scale", fc2_input_scale)
    if topk_ids is not None:
        check_topk_ids(topk_ids, fc1.shape[0])


def checkified(fn: Callable[..., Any]) -> Callable[..., tuple[checkify.Error, Any]]:
    """``fn`` under ``checkify`` (user checks) with the library's value checks emitted:
    ``err, out = nvfp4_jax.checkified(f)(*a)``, ``err.throw()`` raising
    ``checkify.JaxRuntimeError`` naming the argument when a check failed. Jittable:
    ``jax.jit(checkified(f))`` compiles once and returns the error as a value (a hot loop
    calls it and throws outside)."""
    cf = checkify.checkify(fn, errors=checkify.user_checks)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _CHECKING(True):  # traces (and jit cache entries) with the checks
            return cf(*args, **kwargs)

    return run


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the library's value checks on, also under ``jit``: ``nvfp4_jax.checked(f)(*a)``
    runs ``f`` under ``checkify`` (user checks) and raises ``checkify.JaxRuntimeError`` naming the
    argument when a check fails; otherwise returns ``f``'s result. ``f`` may be jitted (or
    contain jitted code; its unchecked trace is not reused: the check mode is part of ``jit``'s
    cache key); wrap the jitted function, ``checked(jax.jit(f))``, to keep one compilation."""
    cf = checkified(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        err, out = cf(*args, **kwargs)
        err.throw()
        return out

    return run
