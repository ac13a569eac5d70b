"""Block-scale layouts in JAX: linear, swizzled 128x4 and 8x4 (definitions in ``oracle.layouts``).

Swizzled scales are flat per matrix: ``[..., Mp*Kp]`` bytes (or E4M3 values), Mp/Kp padded
with zeros. These are pure reshapes/transposes: jittable and bit-exact with the oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from oracle.layouts import LAYOUTS, Layout, padded_shape

__all__ = ["LAYOUTS", "Layout", "padded_shape", "swizzle", "unswizzle"]


def swizzle(scales: jax.Array, layout: Layout) -> jax.Array:
    """Linear ``[..., M, Kv]`` -> ``layout`` (flat ``[..., Mp*Kp]``; linear: unchanged)."""
    if layout == "linear":
        return scales
    *lead, m, kv = scales.shape
    mp, kp = padded_shape(m, kv, layout)
    pad = [(0, 0)] * len(lead) + [(0, mp - m), (0, kp - kv)]
    s = jnp.pad(scales, pad)
    nl = len(lead)
    if layout == "swizzled_128x4":
        s = s.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
        s = s.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    else:
        s = s.reshape(*lead, mp // 8, 8, kp // 4, 4)
        s = s.transpose(*range(nl), nl, nl + 2, nl + 1, nl + 3)
    return s.reshape(*lead, mp * kp)


def unswizzle(buf: jax.Array, rows: int, cols: int, layout: Layout) -> jax.Array:
    """Inverse of :func:`swizzle`: ``[..., Mp*Kp]`` -> linear ``[..., rows, cols]``."""
    if layout == "linear":
        return buf
    mp, kp = padded_shape(rows, cols, layout)
    if buf.shape[-1] != mp * kp:
        raise ValueError(
            f"scales: expected last dimension {mp * kp} for {layout} scales of a "
            f"[{rows}, {cols}] scale matrix, got shape {buf.shape}"
        )
    lead = buf.shape[:-1]
    nl = len(lead)
    if layout == "swizzled_128x4":
        s = buf.reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
        s = s.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    else:
        s = buf.reshape(*lead, mp // 8, kp // 4, 8, 4)
        s = s.transpose(*range(nl), nl, nl + 2, nl + 1, nl + 3)
    return s.reshape(*lead, mp, kp)[..., :rows, :cols]
