"""Where does the ~1 us device-to-device copy next to every Mosaic GPU launch come from?

Profiles (``jax.profiler``, GPU stream events) jitted chains of trivial kernels: Mosaic GPU
kernels that copy ``n`` separate [8, 256] bf16 inputs through shared memory with TMA (``n``
load descriptors + ``n`` store descriptors, passed to the launch as a by-value array of
128-byte descriptors), a Mosaic kernel with no TMA at all (a scalar GMEM load and store), and
a Pallas-Triton copy as the control; then the MoE's grouped kernel itself at qwen3's FC1
decode size, with its int32 block lists as jit parameters and as a Triton kernel's outputs
(as the MoE layer's routing makes them). Each chain is ``CALLS`` calls, each call's output feeding
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

from nvfp4_jax.gemm.mosaic import mosaic_kernel, pallas_mosaic_gpu

CALLS = 16
SHAPE = (8, 256)


def tma_copy(n: int):
    """Mosaic kernel: n inputs [8, 256] bf16 -> n outputs, each through SMEM by TMA."""
    pl, plgpu = pallas_mosaic_gpu()

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
    """Mosaic kernel without TMA: one int32 read from GMEM and written back plus one."""

    def probe_scalar(x_gmem, o_gmem):
        o_gmem[0] = x_gmem[0] + 1

    return mosaic_kernel(probe_scalar, out_type=jax.ShapeDtypeStruct((1,), jnp.int32),
                         grid=(1,), grid_names=("b",))


def triton_copy(interpret: bool = False):
    """Pallas-Triton control: the same [8, 256] copy."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu_tr

    def probe_triton(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(probe_triton, out_shape=jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16),
                          interpret=interpret, name="probe_triton",
                          compiler_params=plgpu_tr.CompilerParams(num_warps=4, num_stages=1))


#: The grouped MoE kernel at qwen3's FC1 decode size (T = 1: 8 routes, 8 experts, 8-row blocks)
GROUPED = {"e": 8, "n": 1536, "k": 2048, "block_m": 8}


def grouped_inputs():
    """(x, codes, scales, block_expert, num_blocks) of ``GROUPED``: random codes, scales in
    E4M3's normal range, one block per expert."""
    e, n, k, bm = GROUPED["e"], GROUPED["n"], GROUPED["k"], GROUPED["block_m"]
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(key[0], (e * bm, k), jnp.float32).astype(jnp.bfloat16)
    codes = jax.random.randint(key[1], (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(key[2], (e, n, k // 16), 0x30, 0x40, jnp.int32).astype(jnp.uint8)
    return x, codes, scales, jnp.arange(e, dtype=jnp.int32), jnp.full((1,), e, jnp.int32)


def grouped_step(after_triton: bool):
    """CALLS grouped-kernel launches chained through x (a zero-valued XLA add between them).
    ``after_triton``: block_expert and num_blocks come from a Pallas-Triton kernel in the
    same program before every launch, as the MoE layer's routing kernel makes them."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu_tr

    from nvfp4_jax.moe.mosaic import MosaicConfig, grouped_matmul

    cfg = MosaicConfig(block_n=64, split_k=1, num_stages=2)

    def probe_routing(be_ref, nb_ref, be_out, nb_out):
        be_out[...] = be_ref[...]
        nb_out[...] = nb_ref[...]

    e = GROUPED["e"]
    route = pl.pallas_call(
        probe_routing, name="probe_routing",
        out_shape=(jax.ShapeDtypeStruct((e,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)),
        compiler_params=plgpu_tr.CompilerParams(num_warps=1, num_stages=1))

    def chain(state):
        x, codes, scales, be, nb = state
        for _ in range(CALLS):
            b, n = route(be, nb) if after_triton else (be, nb)
            part = grouped_matmul(x, codes, scales, b, n, block_m=GROUPED["block_m"], config=cfg,
                                  name="probe")
            x = x + (part[0, 0, 0] * 0.0).astype(x.dtype)
        return x, codes, scales, be, nb

    return jax.jit(chain)


def chained(kernel, unpack: bool = False):
    """jit of ``CALLS`` chained calls of ``kernel`` (``unpack``: the state is a tuple of its
    arguments, and its outputs are the next call's)."""
    def chain(state):
        for _ in range(CALLS):
            state = kernel(*state) if unpack else kernel(state)
        return state

    return jax.jit(chain)


def cases() -> dict:
    """name -> (initial state, step: state -> state of CALLS chained calls)."""
    x = jnp.ones(SHAPE, jnp.bfloat16)
    g = grouped_inputs()
    out = {"grouped": (g, grouped_step(False)), "grouped_after_triton": (g, grouped_step(True))}
    for n in (1, 4, 16):
        out[f"mosaic_tma{n}"] = (tuple(x + i for i in range(n)), chained(tma_copy(n), unpack=True))
    out["mosaic_no_tma"] = (jnp.zeros((1,), jnp.int32), chained(scalar_copy()))
    out["triton"] = (x, chained(triton_copy()))
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
