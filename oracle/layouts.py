"""Block-scale layouts: linear, swizzled 128x4 and swizzled 8x4, with their padding.

Scales of a matrix ``[M, K]`` form ``S[M, Kv]`` with ``Kv = K/16``.

* ``linear``: row-major ``[M, Kv]``, no padding.
* ``swizzled_128x4`` (cuBLAS/CUTLASS/cuDNN "F8_128x4"): pad rows to a multiple of 128 and
  columns to a multiple of 4 with zero bytes, view as ``[Mp/128, 4, 32, Kp/4, 4]`` (row
  ``m = 128*i + 32*j + r``), permute to ``[Mp/128, Kp/4, 32, 4, 4]`` and flatten. Byte offset
  ``(m//128)*Kp*128 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4``.
* ``swizzled_8x4`` (small-M activations): pad rows to 8 and columns to 4, view as
  ``[Mp/8, 8, Kp/4, 4]``, permute to ``[Mp/8, Kp/4, 8, 4]``.

Swizzled scales are returned as a flat uint8 vector per matrix (leading batch dims kept):
``[..., Mp*Kp]``. Undoing a swizzle needs the logical ``(M, Kv)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Layout = Literal["linear", "swizzled_128x4", "swizzled_8x4"]
LAYOUTS: tuple[str, ...] = ("linear", "swizzled_128x4", "swizzled_8x4")
_ROW_TILE = {"swizzled_128x4": 128, "swizzled_8x4": 8}


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def padded_shape(rows: int, cols: int, layout: Layout) -> tuple[int, int]:
    """(rows, cols) of the padded scale matrix a layout stores."""
    if layout == "linear":
        return rows, cols
    if layout not in _ROW_TILE:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return _ceil(rows, _ROW_TILE[layout]), _ceil(cols, 4)


def swizzle(scales: np.ndarray, layout: Layout) -> np.ndarray:
    """Linear scales ``[..., M, Kv]`` -> bytes in ``layout`` (``[..., Mp*Kp]``; linear: a copy)."""
    s = np.asarray(scales)
    if s.ndim < 2:
        raise ValueError(f"scales: expected [..., M, K/16], got shape {s.shape}")
    if layout == "linear":
        return s.copy()
    *lead, m, kv = s.shape
    mp, kp = padded_shape(m, kv, layout)
    pad = np.zeros((*lead, mp, kp), dtype=s.dtype)
    pad[..., :m, :kv] = s
    nl = len(lead)
    if layout == "swizzled_128x4":
        v = pad.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
        v = v.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    else:
        v = pad.reshape(*lead, mp // 8, 8, kp // 4, 4)
        v = v.transpose(*range(nl), nl, nl + 2, nl + 1, nl + 3)
    return np.ascontiguousarray(v).reshape(*lead, mp * kp)


def unswizzle(buf: np.ndarray, rows: int, cols: int, layout: Layout) -> np.ndarray:
    """Inverse of :func:`swizzle`: bytes ``[..., Mp*Kp]`` -> linear ``[..., rows, cols]``."""
    b = np.asarray(buf)
    if layout == "linear":
        if b.shape[-2:] != (rows, cols):
            raise ValueError(f"scales: expected [..., {rows}, {cols}] for linear layout, got {b.shape}")
        return b.copy()
    mp, kp = padded_shape(rows, cols, layout)
    if b.shape[-1] != mp * kp:
        raise ValueError(
            f"scales: expected last dimension {mp * kp} (= {mp} x {kp} padded) for {layout} "
            f"scales of a [{rows}, {cols}] scale matrix, got shape {b.shape}"
        )
    lead = b.shape[:-1]
    nl = len(lead)
    if layout == "swizzled_128x4":
        v = b.reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
        v = v.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    else:
        v = b.reshape(*lead, mp // 8, kp // 4, 8, 4)
        v = v.transpose(*range(nl), nl, nl + 2, nl + 1, nl + 3)
    return np.ascontiguousarray(v).reshape(*lead, mp, kp)[..., :rows, :cols]


def offset_128x4(m: int, k: int, cols: int) -> int:
    """Byte offset of scale (m, k) in the 128x4 layout (TRT-LLM ``get_sf_out_offset_128x4``)."""
    kp = _ceil(cols, 4)
    return (m // 128) * kp * 128 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def offset_8x4(m: int, k: int, cols: int) -> int:
    """Byte offset of scale (m, k) in the 8x4 layout (TRT-LLM ``get_sf_out_offset_8x4``)."""
    kp = _ceil(cols, 4)
    return (m // 8) * kp * 8 + (k // 4) * 32 + (m % 8) * 4 + k % 4
