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

``--model NAMES`` (e.g. ``qwen3-30b-a3b,llama-3-8b``, bench/e2e_bench.py's shapes and random
NVFP4 weights) times whole decoders instead: the model on one device (the baseline, an
unsharded ``models.Model``) and ``models.shard_model(model, mesh, row_parallel=...)`` on each
D > 1 of ``--devices``: decode ms per step and tokens/s at each ``--batches`` with a KV cache
of ``--context`` tokens (bench/e2e_bench.py's ``time_decode``: the jitted ``decode_step``,
argmax), prefill tokens/s for one ``--prefill``-token prompt, the scaling efficiency
``t(1 GPU) / (D * t(D GPUs))``, the bytes each device sends per step
(``models.tp_bytes``) and their time on the link, and NaN logits (a route past the MoE
capacity, ``--capacity-factor``; none expected). ``--shapes tiny``: e2e_bench's tiny shapes
with 4 kv heads (so 4 devices split them).

GPU run (a machine with 4 GPUs; one model per command keeps each under ~10 minutes,
``--budget-s`` skips, and records, what would start later):
    python3 bench/parallel_bench.py --out DIR
    python3 bench/parallel_bench.py --out DIR --model qwen3-30b-a3b
    python3 bench/parallel_bench.py --out DIR --model llama-3-8b
CPU dry run (tiny shapes on 4 host devices):
    python3 bench/parallel_bench.py --out /tmp/par --cpu-devices 4 --shapes tiny --tokens 8,32
    python3 bench/parallel_bench.py --out /tmp/par --cpu-devices 4 --shapes tiny \
        --model qwen3-30b-a3b --devices 1,4 --batches 2
Writes DIR/moe-ep-<gpu>.json, or with --model DIR/model-tp-<gpu>-<model>.json ("models" for
several; date, commit, GPU, versions).
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
    ap.add_argument("--model", default="",
                    help="time whole decoders (bench/e2e_bench.py shapes), comma-separated")
    ap.add_argument("--row-parallel", default="psum", help="models.shard_model's row_parallel")
    ap.add_argument("--batches", default=None, help="--model decode batches (default 1,8,32)")
    ap.add_argument("--prefill", type=int, default=None, help="--model prompt tokens (2048)")
    ap.add_argument("--context", type=int, default=None, help="--model KV tokens (1024)")
    ap.add_argument("--steps", type=int, default=None, help="--model timed decode steps (32)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="--model: skip what would start after this many seconds")
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


def bench_models(args) -> dict:
    """``--model``: decode and prefill of sharded decoders (module docstring)."""
    import e2e_bench as e2e

    from nvfp4_jax import models

    tiny = args.shapes == "tiny"
    shapes = ({n: dict(v, num_kv_heads=4) for n, v in e2e.TINY.items()} if tiny
              else e2e.SHAPES)
    names = [n for n in args.model.split(",") if n]
    for n in names:
        if n not in shapes:
            raise SystemExit(f"--model: unknown model {n!r}; known: {sorted(shapes)}")
    devices = [int(v) for v in args.devices.split(",") if v]
    batches = [int(b) for b in (args.batches or ("1,2" if tiny else "1,8,32")).split(",")]
    prefill_n = args.prefill or (16 if tiny else 2048)
    context = args.context or (8 if tiny else 1024)
    steps = args.steps or (3 if tiny else 32)
    cf = args.capacity_factor if args.capacity_factor > 0 else None
    rows = []
    t_start = time.perf_counter()
    for name in names:
        cfg = e2e.config_of(shapes[name])
        model = e2e.build_model(cfg, "nvfp4")
        base = {}
        for d in devices:
            row = {"model": name, "devices": d, "row_parallel": args.row_parallel,
                   "moe_capacity_factor": cf}
            if d > len(jax.devices()):
                rows.append({**row, "skipped": f"{len(jax.devices())} devices"})
                continue
            if time.perf_counter() - t_start > args.budget_s:
                rows.append({**row, "skipped": f"--budget-s {args.budget_s:g} spent"})
                continue
            try:
                m = model if d == 1 else models.shard_model(
                    model, par.mesh_1d(d, "tp"), row_parallel=args.row_parallel,
                    moe_capacity_factor=cf)
            except ValueError as e:
                rows.append({**row, "skipped": str(e)})
                continue
            ids = (jnp.arange(prefill_n, dtype=jnp.int32) * 7919 % cfg.vocab_size)[None]
            # a NaN MoE row (a route past the capacity) reaches the last position's logits
            # through the next layer's attention, or is the last token's own row
            logits, _ = models.prefill(m, ids, models.init_cache(cfg, 1, prefill_n))
            row["nan_last_logits"] = bool(jnp.any(jnp.isnan(logits)))
            t_pre = e2e.time_prefill(m, prefill_n)
            row["prefill"] = {"tokens": prefill_n, "ms": t_pre * 1e3,
                              "tokens_per_s": prefill_n / t_pre}
            b_pre = models.tp_bytes(cfg, prefill_n, d, args.row_parallel)["total"]
            row["prefill"]["bytes_sent_per_device"] = b_pre
            row["prefill"]["link_ms"] = b_pre / (args.link_gbps * 1e9) * 1e3
            row["decode"] = []
            for b in batches:
                dt = e2e.time_decode(m, b, context, steps)
                sent = models.tp_bytes(cfg, b, d, args.row_parallel)["total"]
                rec = {"batch": b, "context": context, "ms_per_step": dt * 1e3,
                       "tokens_per_s": b / dt, "bytes_sent_per_device": sent,
                       "link_us": sent / (args.link_gbps * 1e9) * 1e6}
                if (b, "decode") in base:
                    rec["scaling_efficiency"] = base[(b, "decode")] / (d * dt)
                elif d == 1:
                    base[(b, "decode")] = dt
                row["decode"].append(rec)
                print(f"{name} D={d} decode b={b}: {dt * 1e3:.2f} ms/step, "
                      f"{b / dt:.1f} tokens/s, {sent / 1e3:.1f} kB sent", flush=True)
            if "prefill" in base:
                row["prefill"]["scaling_efficiency"] = base["prefill"] / (d * t_pre)
            elif d == 1:
                base["prefill"] = t_pre
            print(f"{name} D={d} prefill {prefill_n}: {prefill_n / t_pre:.0f} tokens/s, "
                  f"NaN logits {row['nan_last_logits']}", flush=True)
            rows.append(row)
            del m
        del model
    return {"settings": {"batches": batches, "prefill": prefill_n, "context": context,
                         "steps": steps, "tiny": tiny}, "results": rows}


def main(args) -> None:
    if args.model:
        res = {**run_metadata(), "devices_available": len(jax.devices()),
               "platform": jax.default_backend(), "link_gbps": args.link_gbps,
               **bench_models(args)}
        os.makedirs(args.out, exist_ok=True)
        gpu = res["gpu"].lower().replace("nvidia ", "").replace(" ", "-")
        kind = "cpu" if res["platform"] == "cpu" else gpu
        names = sorted({r["model"] for r in res["results"]})
        tag = names[0] if len(names) == 1 else "models"
        path = os.path.join(args.out, f"model-tp-{kind}-{tag}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", path)
        return
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
