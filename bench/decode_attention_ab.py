"""A batch-1 decode step with XLA's attention on a slice of the KV cache (A) against
``nvfp4_jax.attention.decode_attention`` reading the stacked cache in place (B), interleaved
in one process: full depth, 1024 cached tokens, rounds of 32 steps (the first round dropped).

    python bench/decode_attention_ab.py --out "$OUT"      # $OUT/decode-attention-ab-h200.json

Also reports the first step's logits difference between A and B (``--w4a16``: both W4A16, to
see the attention's rounding alone, without FP4 code flips of W4A4 activations).
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
from run_meta import run_metadata  # noqa: E402

from nvfp4_jax.models import decoder  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default=",".join(E.SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="default: the model's own depth")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--w4a16", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    args = ap.parse_args(argv)
    real = decoder.runs_kernel
    out = {**run_metadata(), "what": __doc__.split("\n\n")[0].replace("\n", " "),
           "settings": vars(args), "ms_per_step": {}, "logits_max_rel_diff": {}}
    for name in args.models.split(","):
        shape = dict((E.TINY if args.tiny else E.SHAPES)[name])
        if args.layers:
            shape["num_layers"] = args.layers
        cfg = E.config_of(shape)
        model = E.build_model(cfg, "nvfp4")
        tok = jnp.zeros((1,), jnp.int32)
        fns, first = {}, {}
        for label, rk in (("A_xla", lambda *a: False), ("B_kernel", real)):
            decoder.runs_kernel = rk  # read when the step is traced, below
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
        decoder.runs_kernel = real
        a, b = first["A_xla"], first["B_kernel"]
        out["logits_max_rel_diff"][name] = float(np.abs(a - b).max() / np.abs(a).max())
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
        print(name, {k: [round(x, 3) for x in v] for k, v in times.items()},
              "logits max rel diff", out["logits_max_rel_diff"][name], flush=True)
        del model, fns
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode-attention-ab-" + ("tiny" if args.tiny else "h200")
                        + ".json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
