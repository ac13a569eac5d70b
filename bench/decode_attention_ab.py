"""A batch-1 decode step's attention three ways, interleaved in one process: XLA's attention on
a slice of the KV cache (A); the q/k norms, RoPE and cache writes in XLA ops, then
``nvfp4_jax.attention.decode_attention`` reading the stacked cache in place (B); all of it in
``nvfp4_jax.attention.decode_qkv_attention``'s two launches (C, what the decoders run). Full
depth, 1024 cached tokens, rounds of 32 steps (the first round dropped).

    python bench/decode_attention_ab.py --out "$OUT"      # $OUT/decode-attention-ab-<gpu>.json

Also reports the first step's logits difference of A and B against C (``--w4a16``: all
W4A16, to see the attention's rounding alone, without FP4 code flips of W4A4 activations).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from nvfp4_jax import attention, nn  # noqa: E402
from nvfp4_jax.models import decoder  # noqa: E402


def xla_prologue(qkv, k_cache, v_cache, layer, start, *, num_heads, q_norm, k_norm, eps, rope,
                 interpret):
    """Arm B: ``decode_qkv_attention``'s first launch as the decoders' XLA ops (q/k RMSNorm,
    RoPE, ``dynamic_update_slice`` into the caches), then ``decode_attention``."""
    b, (kvh, d) = qkv.shape[0], k_cache.shape[3:]
    q, k, v = jnp.split(qkv[:, None], [num_heads * d, (num_heads + kvh) * d], axis=-1)
    q, k, v = q.reshape(b, 1, num_heads, d), k.reshape(b, 1, kvh, d), v.reshape(b, 1, kvh, d)
    if q_norm is not None:
        q, k = nn.rms_norm(q, q_norm, eps), nn.rms_norm(k, k_norm, eps)
    if rope is not None:
        tables = (rope[0][:, None], rope[1][:, None])
        q, k = decoder.apply_rope(q, tables), decoder.apply_rope(k, tables)
    at = (jnp.asarray(layer, jnp.int32), 0, start, 0, 0)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k[None], at)
    v_cache = jax.lax.dynamic_update_slice(v_cache, v[None], at)
    lengths = jnp.full((b,), start + 1, jnp.int32)
    o = attention.decode_attention(q[:, 0], k_cache, v_cache, layer, lengths, interpret=interpret)
    return o, k_cache, v_cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default=",".join(E.SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="default: the model's own depth")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--w4a16", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    args = ap.parse_args(argv)
    real, real_qkv = decoder.runs_kernel, decoder.decode_qkv_attention
    arms = {"A_xla": (lambda *a: False, real_qkv), "B_xla_prologue": (real, xla_prologue),
            "C_qkv_kernel": (real, real_qkv)}
    out = {**run_metadata(), "what": __doc__.split("\n\n")[0].replace("\n", " "),
           "settings": vars(args), "ms_per_step": {}, "median_ms": {}, "logits_max_rel_diff": {}}
    for name in args.models.split(","):
        shape = dict((E.TINY if args.tiny else E.SHAPES)[name])
        if args.layers:
            shape["num_layers"] = args.layers
        cfg = E.config_of(shape)
        model = E.build_model(cfg, "nvfp4")
        tok = jnp.zeros((1,), jnp.int32)
        fns, first = {}, {}
        for label, (rk, qkv_fn) in arms.items():
            # read when the step is traced, below
            decoder.runs_kernel, decoder.decode_qkv_attention = rk, qkv_fn
            w4a4 = not args.w4a16
            f = jax.jit(lambda m, t, c, w4a4=w4a4: decoder._decode(m, t, c, w4a4=w4a4),
                        donate_argnums=2)  # a function of its own: a trace of its own
            c0 = E._cache(cfg, 1, 1024, 32)
            rng = np.random.default_rng(0)  # both arms: the same keys and values in every slot
            c0 = dataclasses.replace(
                c0, k=jnp.asarray(rng.standard_normal(c0.k.shape, np.float32), jnp.bfloat16),
                v=jnp.asarray(rng.standard_normal(c0.v.shape, np.float32), jnp.bfloat16))
            first[label] = np.asarray(f(model, tok, c0)[0], np.float32)
            fns[label] = f
        decoder.runs_kernel, decoder.decode_qkv_attention = real, real_qkv
        c = first["C_qkv_kernel"]
        out["logits_max_rel_diff"][name] = {
            label: float(np.abs(first[label] - c).max() / np.abs(c).max())
            for label in ("A_xla", "B_xla_prologue")}
        times = {label: [] for label in fns}
        for r in range(args.rounds + 1):
            for label, f in fns.items():
                cache = E._cache(cfg, 1, 1024, 32)
                jax.block_until_ready(cache)
                t0, t = time.perf_counter(), tok
                for _ in range(32):
                    lg, cache = f(model, t, cache)
                    t = jnp.argmax(lg, axis=-1).astype(jnp.int32)
                t.block_until_ready()
                if r:
                    times[label].append((time.perf_counter() - t0) / 32 * 1e3)
        out["ms_per_step"][name] = times
        out["median_ms"][name] = {k: float(np.median(v)) for k, v in times.items()}
        print(name, {k: [round(x, 3) for x in v] for k, v in times.items()},
              "logits max rel diff", out["logits_max_rel_diff"][name], flush=True)
        del model, fns
    os.makedirs(args.out, exist_ok=True)
    tag = "tiny" if args.tiny else gpu_tag(jax.devices()[0].device_kind)
    path = os.path.join(args.out, f"decode-attention-ab-{tag}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
