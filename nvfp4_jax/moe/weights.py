"""FC2 weights zero-padded along K: 128-byte aligned code rows for the grouped Mosaic kernel.

An intermediate size I with I % 256 == 128 (Nemotron's 2688) gives FC2 code rows of I/2 bytes,
64 bytes off a 128-byte line every other row, and a last K step that runs half past the end.
On the H200 the grouped kernel alone ran 10 % faster on weights zero-padded to the next
multiple of 256 (5 % more bytes).
:func:`pad_fc2` makes that copy once, at load time; ``nvfp4_jax.moe`` takes either form.
The padded columns multiply the FC2 operand's missing columns (read as zeros) or are sliced
off (backends other than the Mosaic kernel, which then copy the weights on every call,
logged), so they must decode to finite values: :func:`pad_fc2` writes zero codes and zero
scales.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from ..gemm.mosaic import BLOCK_K as PAD_MULTIPLE  # the grouped kernel's K step
from ..layouts import swizzle
from ..quantize import NVFP4Array

log = logging.getLogger("nvfp4_jax")


def intermediate_size(rows1: int, activation: str) -> int:
    """The intermediate size I of an FC1 stack with ``rows1`` rows: 2I rows for swiglu
    ([up; gate] or [gate; up]), I for relu2. FC2's K is I, or ``padded_inter(I)``."""
    return rows1 // 2 if activation == "swiglu" else rows1


def padded_inter(inter: int) -> int:
    """The K of zero-padded FC2 weights for intermediate size ``inter``: the next multiple of 256."""
    return -(-inter // PAD_MULTIPLE) * PAD_MULTIPLE


def pad_fc2(fc2: NVFP4Array) -> NVFP4Array:
    """FC2 stack [E, H, I] -> [E, H, Ip] zero-padded along K (Ip = :func:`padded_inter`),
    scales in the same layout; unchanged when I % 256 == 0. The same layer for
    ``nvfp4_jax.moe``; the Mosaic path reads it faster where I % 256 != 0.

    fc2: ``NVFP4Array`` of logical shape [E, H, I] (codes uint8 [E, H, I/2], float8_e4m3fn
    scales, decode_scale [E]). Returns an ``NVFP4Array`` [E, H, Ip]: zero codes (+0.0) and zero
    scales in the new columns, decode_scale unchanged."""
    if not isinstance(fc2, NVFP4Array) or len(fc2.shape) != 3:
        raise ValueError(f"fc2: expected an NVFP4Array stack [E, H, I], got "
                         f"{getattr(fc2, 'shape', type(fc2).__name__)}")
    e, h, inter = fc2.shape
    kp = padded_inter(inter)
    if kp == inter:
        return fc2
    codes = jnp.pad(fc2.codes, ((0, 0), (0, 0), (0, (kp - inter) // 2)))
    lin = jnp.pad(fc2.linear_scales(), ((0, 0), (0, 0), (0, (kp - inter) // 16)))
    scales = lin if fc2.layout == "linear" else swizzle(lin, fc2.layout)
    return NVFP4Array.from_parts(codes, scales, fc2.decode_scale, layout=fc2.layout,
                                 shape=(e, h, kp))


def unpad_fc2(fc2: NVFP4Array, inter: int) -> NVFP4Array:
    """The first ``inter`` columns of a padded FC2 stack (a copy of the weights, logged), for
    the kernels that read FC2 with K = I exactly."""
    e, h, kp = fc2.shape
    if kp == inter:
        return fc2
    log.info("nvfp4_jax.moe: fc2 zero-padded to K=%d: this path reads K=%d, so the weights are "
             "sliced (copied) on every call; pass unpadded fc2 here", kp, inter)
    lin = fc2.linear_scales()[..., : inter // 16]
    scales = lin if fc2.layout == "linear" else swizzle(lin, fc2.layout)
    return NVFP4Array.from_parts(fc2.codes[..., : inter // 2], scales, fc2.decode_scale,
                                 layout=fc2.layout, shape=(e, h, inter))
