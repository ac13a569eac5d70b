"""Correctly rounded fp32 division in XLA on every backend, whatever XLA's flags.

XLA:GPU lowers an fp32 ``divide`` to ``div.full.f32`` (within 2 ulp, not correctly rounded)
unless the process sets ``--xla_backend_extra_options=-nvptx-prec-divf32=2``; at an E2M1
midpoint one ulp flips an FP4 code. :func:`divide` computes the IEEE quotient (round to
nearest even, subnormals, signed zeros, Inf and NaN) without a floating-point division:

* on CPU, XLA's own ``divide`` (IEEE there, except that XLA:CPU flushes subnormal operands
  and results to zero, as in all its fp32 arithmetic), behind an optimization barrier so that
  the algebraic simplifier cannot turn ``x / broadcast(b)`` into ``x * (1/b)``;
* everywhere else (:func:`integer_divide`), a restoring long division of the 24-bit
  significands in uint32 arithmetic, 26 quotient bits plus a sticky bit, rounded to nearest
  even by integer addition (a carry into the exponent field gives the next binade or Inf).

Why integers rather than a Newton step on XLA's quotient: a correction ``q + (a - q*b)/b``
needs the exact residual ``a - q*b``, i.e. an FMA or Dekker's splitting, and XLA:GPU contracts
(or not) ``a*b + c`` as it likes, which breaks the splitting. Integer ops have one meaning on
every backend and no approximate lowering, so the CPU tests of :func:`integer_divide` check
the very arithmetic the GPU runs. Cost: ~130 integer ops per quotient, in one fusion with
its neighbours; the quantization recipes divide once per 16-value block (``trtllm``, ``jax``)
or once per element (``modelopt``, ``b12x``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

#: quotient bits computed: 24 significand bits, a round bit and one more (then the remainder)
QUOTIENT_BITS = 26

_SIGN = 0x80000000
_INF = 0x7F800000
_QNAN = 0x7FC00000
_FRAC = 0x007FFFFF
_HIDDEN = 0x00800000


def _u32(v: int):
    return jnp.uint32(v)


def _split(bits):
    """(biased exponent int32, significand uint32 with the hidden bit at bit 23, zero-or-
    subnormal normalized: exponent 1 - shift) of finite nonzero fp32 bit patterns."""
    e = ((bits >> 23) & 0xFF).astype(jnp.int32)
    f = bits & _u32(_FRAC)
    sub = e == 0
    lz = jnp.where(sub, lax.clz(jnp.where(sub, f, _u32(1))).astype(jnp.int32) - 8, 0)
    m = jnp.where(sub, f << lz.astype(jnp.uint32), f | _u32(_HIDDEN))
    return jnp.where(sub, 1 - lz, e), m


def integer_divide(a, b) -> jax.Array:
    """IEEE-754 fp32 ``a / b`` (round to nearest even) with integer arithmetic only; numpy
    broadcasting; NaN results are the canonical quiet NaN."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    ua = lax.bitcast_convert_type(a, jnp.uint32)
    ub = lax.bitcast_convert_type(b, jnp.uint32)
    sign = (ua ^ ub) & _u32(_SIGN)
    abs_a, abs_b = ua & _u32(~_SIGN & 0xFFFFFFFF), ub & _u32(~_SIGN & 0xFFFFFFFF)
    nan = (abs_a > _INF) | (abs_b > _INF) | ((abs_a == 0) & (abs_b == 0)) | (
        (abs_a == _INF) & (abs_b == _INF))
    inf = (abs_a == _INF) | (abs_b == 0)  # (when not NaN)
    zero = (abs_a == 0) | (abs_b == _INF)

    safe_a = jnp.where(nan | inf | zero, _u32(0x3F800000), abs_a)  # finite nonzero stand-ins
    safe_b = jnp.where(nan | inf | zero, _u32(0x3F800000), abs_b)
    ea, ma = _split(safe_a)
    eb, mb = _split(safe_b)
    small = ma < mb  # the quotient's leading bit: ma / mb in [1, 2) after this shift
    r = jnp.where(small, ma << 1, ma)
    e = ea - eb + 127 - small.astype(jnp.int32)  # biased exponent of the quotient

    q = jnp.zeros_like(r)
    for _ in range(QUOTIENT_BITS):  # r < 2 * mb < 2^25 throughout
        bit = r >= mb
        r = jnp.where(bit, r - mb, r)
        q = (q << 1) | bit.astype(jnp.uint32)
        r = r << 1
    # q = floor(2^25 * ma / mb) in [2^25, 2^26); sticky: a nonzero remainder

    shift = jnp.clip(1 - e, 0, 29).astype(jnp.uint32)  # extra right shift of a subnormal result
    base = jnp.where(e >= 1, (jnp.maximum(e, 1) - 1).astype(jnp.uint32) << 23, _u32(0))
    mant = q >> (shift + 2)
    round_bit = (q >> (shift + 1)) & 1
    sticky = ((q & ((_u32(1) << (shift + 1)) - 1)) != 0) | (r != 0)
    up = (round_bit == 1) & (sticky | ((mant & 1) == 1))
    mag = base + mant + up.astype(jnp.uint32)  # a carry moves into the exponent (or to Inf)
    mag = jnp.where(e >= 255, _u32(_INF), jnp.minimum(mag, _u32(_INF)))

    mag = jnp.where(zero, _u32(0), mag)
    mag = jnp.where(inf, _u32(_INF), mag)
    out = jnp.where(nan, _u32(_QNAN), mag | sign)
    return lax.bitcast_convert_type(out, jnp.float32)


def _xla_divide(a, b):
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return lax.div(a, lax.optimization_barrier(b))


def divide(a, b) -> jax.Array:
    """IEEE fp32 ``a / b`` with numpy broadcasting, the same bits on every backend: XLA's
    ``divide`` on CPU (IEEE there), :func:`integer_divide` on GPUs and anything else."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return lax.platform_dependent(a, b, cpu=_xla_divide, default=integer_divide)
