"""Expert-parallel NVFP4 MoE layer time on 1, 2, 4 GPUs (``nvfp4_jax.parallel.moe_ep``).

For each shape (bench/moe_bench.py's Nemotron and Qwen3-30B-A3B), token count T and device
count D: the layer time of ``moe_ep`` on a D-device mesh (experts split over D, tokens split
over D), the single-device ``nvfp4_jax.moe`` time (the baseline), the scaling efficiency
``t(moe, 1 GPU) / (D * t(moe_ep, D GPUs))``, and the bytes each device sends per layer
(``parallel.ep_bytes``: the implemented all-gather scheme plus the routing) against the NVLink
bandwidth (``--link-gbps``, per direction per GPU; H200 NVLink 4: 450 GB/s): ``link_us`` is
the time those bytes take on the link alone, ``link_frac`` its share of the layer time.

Timing: one jitted ``fori_loop`` of ``LAYERS`` (8) layers, each layer's input depending on the
previous output (``moe_bench.chain``), median of ``--reps`` calls after a warm-up, divided by
``LAYERS`` (the call's fixed cost is shared by the 8 layers). Routing: random (Gumbel top-k,
distinct experts per token). ``--capacity-factor`` (default 2.0) sets the rows each device
computes (``parallel.ep_capacity``); a route past it would make its token's row NaN, which the
run records (``nan_rows``; 0 expected for random routing). ``--capacity-factor 0``: no limit
(T*k rows per device, exact for any routing, D times the expert work).

GPU run (a machine with 4 GPUs):
    python3 bench/parallel_bench.py --out DIR
CPU dry run (tiny shapes on 4 host devices):
    python3 bench/parallel_bench.py --out /tmp/par --cpu-devices 4 --shapes tiny --tokens 8,32
Writes DIR/moe-ep-<gpu>.json (date, commit, GPU, versions).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="nemotron,qwen3_30b")
    ap.add_argument("--tokens", default="64,512,4096")
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--capacity-factor", type=float, default=2.0)
    ap.add_argument("--link-gbps", type=float, default=450.0,
                    help="NVLink bandwidth per direction per GPU, GB/s (H200: 450)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="dry run on this many host CPU devices (sets XLA_FLAGS before JAX starts)")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}")
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from moe_bench import (  # noqa: E402
    SHAPES,
    SMOKE,
    chain,
    input_scales,
    make_hidden,
    make_routing,
    make_weights,
)
from run_meta import run_metadata  # noqa: E402

import nvfp4_jax as nj  # noqa: E402
from nvfp4_jax import parallel as par  # noqa: E402

LAYERS = 8


def time_layer(layer, x, params, reps: int) -> float:
    """Seconds per layer: a jitted loop of LAYERS chained layers ``layer(y, params)``, median
    of ``reps`` calls (weights and routing travel as jit arguments, not as constants)."""
    @jax.jit
    def run(x, params):
        return jax.lax.fori_loop(0, LAYERS, lambda i, y: chain(y, layer(y, params)), x)

    out = run(x, params).block_until_ready()  # compile + warm
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run(x, params).block_until_ready()
        ts.append(time.perf_counter() - t0)
    del out
    return float(np.median(ts)) / LAYERS


def bench_shape(name, s, tokens, devices, args) -> list[dict]:
    rows = []
    _, _, q1, q2 = make_weights(jax.random.PRNGKey(0), s)
    s1, s2 = input_scales(s)
    e, k, act = s["experts"], s["top_k"], s["activation"]
    rng = np.random.default_rng(0)
    for t in tokens:
        ids, wts = make_routing(rng, t, e, k, "random")
        ids, wts = jnp.asarray(ids[0]), jnp.asarray(wts[0])
        x = make_hidden(t, s["hidden"])
        def single(y, p):
            return nj.moe(y, fc1=p[0], fc2=p[1], fc1_input_scale=p[2], fc2_input_scale=p[3],
                          topk_ids=p[4], topk_weights=p[5], activation=act, backend=args.backend)

        t_single = time_layer(single, x, (q1, q2, s1, s2, ids, wts), args.reps)
        for d in devices:
            if d > len(jax.devices()) or e % d or t % d:
                rows.append({"shape": name, "T": t, "devices": d,
                             "skipped": f"{len(jax.devices())} devices, E={e}, T={t}"})
                continue
            mesh = par.mesh_1d(d, "ep")
            f1, f2 = par.shard_experts(q1, mesh), par.shard_experts(q2, mesh)
            cf = args.capacity_factor
            cap = None if cf <= 0 else par.ep_capacity(t, k, d, cf)
            def ep(y, p, mesh=mesh, cap=cap):
                return par.moe_ep(y, fc1=p[0], fc2=p[1], fc1_input_scale=p[2],
                                  fc2_input_scale=p[3], topk_ids=p[4], topk_weights=p[5],
                                  mesh=mesh, activation=act, backend=args.backend, capacity=cap)

            params = (f1, f2, s1, s2, ids, wts)
            out = jax.jit(ep)(x, params)
            nan_rows = int(jnp.sum(jnp.any(jnp.isnan(out.astype(jnp.float32)), axis=1)))
            t_ep = time_layer(ep, x, params, args.reps)
            limited = cap is not None and cap < t * k
            b = par.ep_bytes(t, s["hidden"], k, e, d, capacity_limited=limited)
            sent = b["all_gather"] + b["routing"]
            link_us = sent / (args.link_gbps * 1e9) * 1e6
            row = {"shape": name, "T": t, "devices": d, "capacity": cap,
                   "moe_1gpu_us": t_single * 1e6, "moe_ep_us": t_ep * 1e6,
                   "scaling_efficiency": t_single / (d * t_ep),
                   "bytes_sent_per_device": sent, "bytes_by_scheme": b,
                   "link_us": link_us, "link_frac": link_us / (t_ep * 1e6), "nan_rows": nan_rows}
            rows.append(row)
            print(f"{name:10s} T={t:5d} D={d}: moe {t_single * 1e6:9.1f} us, moe_ep "
                  f"{t_ep * 1e6:9.1f} us, eff {row['scaling_efficiency']:.2f}, "
                  f"{sent / 1e6:.3f} MB sent ({link_us:.1f} us at {args.link_gbps:g} GB/s), "
                  f"nan rows {nan_rows}", flush=True)
    return rows


def main(args) -> None:
    shapes = {**SHAPES, **SMOKE}
    names = [n for n in args.shapes.split(",") if n]
    for n in names:
        if n not in shapes:
            raise SystemExit(f"--shapes: unknown shape {n!r}; known: {sorted(shapes)}")
    tokens = [int(v) for v in args.tokens.split(",") if v]
    devices = [int(v) for v in args.devices.split(",") if v]
    res = {**run_metadata(), "devices_available": len(jax.devices()),
           "platform": jax.default_backend(), "link_gbps": args.link_gbps,
           "capacity_factor": args.capacity_factor, "backend": args.backend,
           "layers_per_call": LAYERS, "results": []}
    for n in names:
        res["results"] += bench_shape(n, shapes[n], tokens, devices, args)
    os.makedirs(args.out, exist_ok=True)
    gpu = res["gpu"].lower().replace("nvidia ", "").replace(" ", "-")
    kind = "cpu" if res["platform"] == "cpu" else gpu
    path = os.path.join(args.out, f"moe-ep-{kind}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main(ARGS)
