"""Run the MoE layer (public ``nvfp4_jax.moe``, backend pallas, kernel auto) a few times on one
routing, for Nsight Compute to attach.

Usage: ncu -k regex:nvfp4_moe --launch-skip 6 --launch-count 6 python bench/moe_ncu.py [shape:T ...]
(default nemotron:8; each case runs three layers, eagerly, on the same routing: skip the first
layer's six kernels, profile the second's; a layer with the XLA routing or a separate scales
launch has another count). Prints the host time of each call only; the profiler reports
registers, occupancy, DRAM throughput and warp stall reasons per kernel (routing + scales,
operand gather, FC1, FC1 epilogue, FC2, combine). ``MOE_SCALE_LAYOUT`` (default linear) and
``MOE_PAD_FC2=1`` set the weights as ``moe_bench --scale-layout / --pad-fc2`` does, so the
layer picks the bench's configs.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import numpy as np
from moe_bench import (
    SHAPES,
    input_scales,
    make_hidden,
    make_routing,
    make_weights,
    nvfp4_layer,
    ours_weights,
)


def run(sname: str, t: int) -> None:
    s = SHAPES[sname]
    _w1, _w2, q1, q2 = make_weights(jax.random.PRNGKey(1), s)
    del _w1, _w2
    q1, q2 = ours_weights(q1, q2, os.environ.get("MOE_SCALE_LAYOUT", "linear"),
                          bool(os.environ.get("MOE_PAD_FC2")))
    ids, wts = make_routing(np.random.default_rng(0), t, s["experts"], s["top_k"], "random")
    params = (q1, q2, *input_scales(s))
    f = jax.jit(nvfp4_layer(s["activation"], "auto"))
    x = make_hidden(t, s["hidden"])
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, ids[0], wts[0], params))
        print(f"{sname} T={t}: {1e6 * (time.perf_counter() - t0):.1f} us (host)", flush=True)


def main():
    for spec in sys.argv[1:] or ["nemotron:8"]:
        name, t = spec.split(":")
        run(name, int(t))


if __name__ == "__main__":
    main()
