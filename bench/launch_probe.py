"""Where does the ~1 us device-to-device copy next to every Mosaic GPU launch come from?

Profiles (``jax.profiler``, GPU stream events) jitted chains of trivial kernels: Mosaic GPU
kernels that copy ``n`` separate [8, 256] bf16 inputs through shared memory with TMA (``n``
load descriptors + ``n`` store descriptors, passed to the launch as a by-value array of
128-byte descriptors), a Mosaic kernel with no TMA at all (a scalar GMEM load and store), and
a Pallas-Triton copy as the control. Each chain is ``CALLS`` calls, each call's output feeding
the next; the table gives, per call, every device event's time and count. If ``memcpy32_post``
(the copy seen in the MoE and GEMM profiles, two per MoE layer) follows every Mosaic launch
whatever its descriptors, it is the Mosaic runtime's; if its count or size follows the
descriptors, fewer descriptors (fewer distinct refs/slices) remove it.

Usage (GPU): python bench/launch_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_profile import kernel_table, traced_events
from run_meta import run_metadata

from nvfp4_jax.gemm.mosaic import _pallas_mosaic_gpu, mosaic_kernel

CALLS = 16
SHAPE = (8, 256)


def tma_copy(n: int):
    """Mosaic kernel: n inputs [8, 256] bf16 -> n outputs, each through SMEM by TMA."""
    pl, plgpu = _pallas_mosaic_gpu()

    def body(*refs):
        ins, outs = refs[:n], refs[n:]

        def scope(smem, barrier):
            for i in range(n):
                plgpu.copy_gmem_to_smem(ins[i], smem.at[i], barrier)
                plgpu.barrier_wait(barrier)
            plgpu.commit_smem()
            for i in range(n):
                plgpu.copy_smem_to_gmem(smem.at[i], outs[i])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.SMEM((n, *SHAPE), jnp.bfloat16), plgpu.Barrier(num_arrivals=1))

    body.__name__ = f"probe_tma{n}"
    out = tuple(jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16) for _ in range(n))
    return mosaic_kernel(body, out_type=out, grid=(1,), grid_names=("b",))


def scalar_copy():
    """Mosaic kernel without TMA: one int32 read from GMEM and written back plus one (lane
    semantics: a scalar GMEM store)."""
    _, _plgpu = _pallas_mosaic_gpu()

    def probe_scalar(x_gmem, o_gmem):
        o_gmem[0] = x_gmem[0] + 1

    return mosaic_kernel(probe_scalar, out_type=jax.ShapeDtypeStruct((1,), jnp.int32),
                         grid=(1,), grid_names=("b",), semantics="lane")


def triton_copy(interpret: bool = False):
    """Pallas-Triton control: the same [8, 256] copy."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu_tr

    def probe_triton(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(probe_triton, out_shape=jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16),
                          interpret=interpret, name="probe_triton",
                          compiler_params=plgpu_tr.CompilerParams(num_warps=4, num_stages=1))


def cases() -> dict:
    """name -> (initial state, step: state -> state of CALLS chained calls)."""
    x = jnp.ones(SHAPE, jnp.bfloat16)
    out = {}
    for n in (1, 4, 16):
        k = tma_copy(n)

        def chain(xs, k=k):
            for _ in range(CALLS):
                xs = k(*xs)
            return xs

        out[f"mosaic_tma{n}"] = (tuple(x + i for i in range(n)), jax.jit(chain))
    ks = scalar_copy()

    def chain_s(v):
        for _ in range(CALLS):
            v = ks(v)
        return v

    out["mosaic_no_tma"] = (jnp.zeros((1,), jnp.int32), jax.jit(chain_s))
    kt = triton_copy()

    def chain_t(v):
        for _ in range(CALLS):
            v = kt(v)
        return v

    out["triton"] = (x, jax.jit(chain_t))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    recs = []
    for name, (state, step) in cases().items():
        try:
            evs, _ = traced_events(step, state, args.reps)
            rows, busy, span = kernel_table(evs, args.reps * CALLS)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            recs.append({"case": name, "error": str(exc)[:300]})
            continue
        recs.append({"case": name, "busy_us_per_call": busy, "span_us_per_call": span,
                     "events": [{"name": n[:120], "us_per_call": u, "per_call": c} for u, c, n in rows]})
        print(f"{name}: busy {busy:.2f} us, span {span:.2f} us per call", flush=True)
        for u, c, n in rows[:6]:
            print(f"   {u:7.2f} us  x{c:4.2f}  {n[:90]}", flush=True)
    with open(os.path.join(args.out, "launch-probe-h200.json"), "w") as f:
        json.dump({**run_metadata(), "what": "per-launch device events of trivial Mosaic kernels",
                   "calls_per_chain": CALLS, "records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
