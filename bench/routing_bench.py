"""MoE softmax top-k routing: ``moe.select_kernel`` (one Pallas-Triton launch) against XLA's
``routing.select_experts`` plus ``moe``'s finite-row check, in one process.

1. As a model calls it: L = 48 distinct layers' logits [T, 128] and hidden rows [T, 2048] in
   one jitted program, each layer's logits shifted by the previous layer's result (a chain, as
   in a decoder); microseconds per layer at T = 1, 8, 32, 256, 2048, with "none" (the chain
   alone) as the floor.
2. In the model: a Qwen3-30B-A3B-shaped decode step (48 layers, random NVFP4 weights, 1024
   cached tokens) with ``moe``'s routing by the kernel (A) and by XLA (B), interleaved rounds of
   32 steps at batch 1, 8, 32. Each arm is its own function object (jit's trace cache is keyed
   by the function) traced while its routing is set, and its lowered program is checked to hold
   (A) or not hold (B) the kernel.

    python bench/routing_bench.py --out "$OUT"        # $OUT/routing-ab-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e_bench as E  # noqa: E402
from run_meta import gpu_tag, run_metadata  # noqa: E402

import nvfp4_jax.moe.api as moe_api  # noqa: E402
from nvfp4_jax.device import pallas_interpret  # noqa: E402
from nvfp4_jax.models import decoder  # noqa: E402
from nvfp4_jax.moe.routing import select_experts  # noqa: E402
from nvfp4_jax.moe.select_kernel import select_kernel  # noqa: E402


def _median_s(f, *args, n: int = 20) -> float:
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def routing_per_layer(tokens, e: int, k: int, h: int, layers: int) -> dict:
    """Microseconds per layer of each routing, ``layers`` distinct layers in one program."""
    def xla(lg, x):
        ids, w = select_experts(lg, k, routing="softmax", renormalize=True)
        return ids, jnp.where(jnp.isfinite(x).all(-1, keepdims=True), w, jnp.nan)

    def kernel(lg, x):
        return select_kernel(lg, x, k, renormalize=True, interpret=pallas_interpret())

    def none(lg, x):
        return jnp.zeros(lg.shape[:1] + (k,), jnp.int32), lg[:, :k]

    def chained(one):
        def f(lg, x):
            acc = jnp.zeros((lg.shape[1], 1), jnp.float32)
            for i in range(layers):
                ids, w = one(lg[i] + acc, x[i])
                acc = acc + 1e-3 * (w.sum(-1, keepdims=True) + ids[:, :1].astype(jnp.float32))
            return acc
        return jax.jit(f)

    out = {}
    for t in tokens:
        lg = jax.random.normal(jax.random.PRNGKey(t), (layers, t, e), jnp.float32)
        x = jax.random.normal(jax.random.PRNGKey(t + 1), (layers, t, h), jnp.bfloat16)
        out[t] = {name: _median_s(chained(one), lg, x) / layers * 1e6
                  for name, one in (("xla", xla), ("kernel", kernel), ("none", none))}
        print(f"T={t}: us per layer {out[t]}", flush=True)
    return out


def decode_ab(cfg, batches, context: int, rounds: int, steps: int = 32) -> dict:
    model = E.build_model(cfg, "nvfp4")
    real_fits = moe_api.select_fits

    def run(f, b, n):
        c = E._cache(cfg, b, context, 40)
        tok = jnp.arange(b, dtype=jnp.int32)
        jax.block_until_ready(c)
        t0 = time.perf_counter()
        for _ in range(n):
            logits, c = f(model, tok, c)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
        tok.block_until_ready()
        return (time.perf_counter() - t0) / n * 1e3

    def arm(kernel: bool, b: int):
        moe_api.select_fits = real_fits if kernel else (lambda *a: False)
        try:
            f = jax.jit(lambda m, t, c: decoder._decode(m, t, c), donate_argnums=(2,))
            run(f, b, 2)
            c = E._cache(cfg, b, 16, 40)
            text = f.lower(model, jnp.zeros((b,), jnp.int32), c).as_text()
        finally:
            moe_api.select_fits = real_fits
        if ("nvfp4_moe_select" in text) != kernel and not pallas_interpret():
            raise RuntimeError(f"arm kernel={kernel}: the lowered step does not match the arm")
        return f

    out = {}
    for b in batches:
        fns = {"A_kernel": arm(True, b), "B_xla": arm(False, b)}
        ms = {name: [] for name in fns}
        for _ in range(rounds):
            for name, f in fns.items():
                ms[name].append(run(f, b, steps))
        out[b] = {"ms_per_step": ms, "median_ms": {n: float(np.median(v)) for n, v in ms.items()}}
        print(f"b={b}: {out[b]['median_ms']}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    a = p.parse_args(argv)
    shape = (E.TINY if a.tiny else E.SHAPES)["qwen3-30b-a3b"]
    e, k, h = shape["num_experts"], shape["num_experts_per_tok"], shape["hidden_size"]
    layers = 4 if a.tiny else shape["num_layers"]
    doc = {**run_metadata(), "what": __doc__.split("\n\n")[0].replace("\n", " "),
           "settings": {"experts": e, "top_k": k, "hidden": h, "layers": layers,
                        "context": 16 if a.tiny else 1024, "renormalize": True}}
    path = os.path.join(a.out, f"routing-ab-{gpu_tag(jax.devices()[0].device_kind)}.json")
    os.makedirs(a.out, exist_ok=True)
    doc["us_per_layer"] = routing_per_layer((1, 8) if a.tiny else (1, 8, 32, 256, 2048),
                                            e, k, h, layers)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    doc["decode"] = decode_ab(E.config_of(shape), (1, 2) if a.tiny else (1, 8, 32),
                              doc["settings"]["context"], 2 if a.tiny else 3)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
