"""Mosaic GPU grouped-GEMM MoE vs the Pallas-Triton MoE at decode sizes, same process (H200).

Usage: python3 bench/moe_mosaic_probe.py --out DIR [--budget-s 120] [--shapes nemotron,qwen3_30b]
       [--tokens 1,8,64] [--sweep] [--configs bm64,bm64_bn64,bm32_s3]
Times the whole layer with moe_bench's harness (``timed_loop`` / ``measure``: in-graph, NROT
layers with different random routings per loop iteration, difference of two loop lengths) for
``kernel="triton"`` and ``kernel="mosaic"`` (default config, ``moe.mosaic.auto_config``), then,
with ``--sweep`` and while the budget lasts, Mosaic config variants (block_n, stages, split_k,
block_m, block_k). Each Mosaic config's output is compared with the Triton path's, or with
``--no-triton`` with the Mosaic default's (``rel_diff`` = max |diff| / max |ref|, ``diff_vs``
names the reference; all are within the oracle bounds, so this is a sanity check only; 0 means
the same bits, expected where only launches differ, not where split-K regroups the sums;
before session 11 the --no-triton runs printed "diff 0" without any reference). Bytes: touched
experts' NVFP4 weights (0.5625 B/weight), averaged over the NROT routings.
``--configs``: named Mosaic configs measured on every case after the defaults (before the
sweep): ``_``-joined knobs applied to both GEMMs of the case's default config: ``bm<N>``
(block_m), ``bn<N>`` (block_n), ``s<N>`` (stages), ``k<N>`` (split_k, where K allows it),
``ov`` (overlap), ``bk512``, ``c<N>`` (consumers: warp-specialized GEMM); prefixed
``f1``/``f2``, to one GEMM only; ``rk``: the one-launch routing kernel
(``MosaicMoEConfig.routing="kernel"``); ``sp``: ``skip_padding``; ``bf``: ``bf16_partials``;
``fr``: ``routing="fused"``; ``er``: ``epilogue="routes"``;
``gw``: ``wide_glue``; ``tq``: ``token_quant``; ``ew``: the FC1 epilogue's block programs
load whole blocks (no row split: ``epilogue.EPILOGUE_LOADED_ELEMS`` unbounded while tracing);
``pf``: the same config on FC2
weights zero-padded along K (``nvfp4_jax.moe.pad_fc2``, made outside the timed loop).
With ``--swizzled`` the named configs run on the swizzled weights. ``--swizzled``: the default
config again with the weights' scales in ``swizzled_128x4`` (read per step by the kernel; no
whole-K buffer for K % 256 == 128).
Writes DIR/moe-mosaic-probe-h200.json progressively.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_bench import (
    HARNESS,
    NROT,
    SHAPES,
    device_routings,
    input_scales,
    make_hidden,
    make_routing,
    make_weights,
    measure,
    per_layer_scales,
    timed_loop,
)
from run_meta import patched, run_metadata

from nvfp4_jax.gemm.mosaic import MosaicConfig
from nvfp4_jax.moe import epilogue, operand, pad_fc2, routing_kernel
from nvfp4_jax.moe.api import moe
from nvfp4_jax.moe.mosaic import MosaicMoEConfig, auto_config

SMOKE = {"smoke": {"hidden": 256, "inter": 256, "experts": 8, "top_k": 2, "activation": "swiglu"}}


def layer_fn(activation, kernel, config=None):
    def layer(x, tids, w, p):
        return moe(x, fc1=p[0], fc2=p[1], fc1_input_scale=p[2], fc2_input_scale=p[3],
                   topk_ids=tids, topk_weights=w, activation=activation,
                   backend={"triton": "pallas"}.get(kernel, kernel), config=config)
    return layer


def _mc(c: MosaicConfig, **kw) -> MosaicConfig:
    return dataclasses.replace(c, **kw)


def variants(base: MosaicMoEConfig, hidden: int, inter: int) -> list[tuple[str, MosaicMoEConfig]]:
    """Single-knob moves around the default, applied to both Mosaic GEMMs (where valid), or to
    one of them (``gemms``)."""
    out = []

    def add(name, gemms=("fc1", "fc2"), **kw):
        def ok(k):
            if k % 256 == 128:  # whole-K scales: block_k 256, split 1
                return not {"block_k", "split_k"} & set(kw)
            return k % 256 == 0 and k % kw.get("block_k", 256) == 0

        f1 = _mc(base.fc1, **kw) if ok(hidden) and "fc1" in gemms else base.fc1
        f2 = _mc(base.fc2, **kw) if ok(inter) and "fc2" in gemms else base.fc2
        out.append((name, dataclasses.replace(base, fc1=f1, fc2=f2)))

    add("fc2_bn64", gemms=("fc2",), block_n=64)  # FC2 (N = H) has the fewest CTAs at small T
    add("stages3", num_stages=3)
    add("stages4", num_stages=4)
    add("bn64", block_n=64)
    add("split_x2", split_k=base.fc1.split_k * 2)
    add("split_x4", split_k=base.fc1.split_k * 4)
    if base.fc1.split_k > 1:
        add("split1", split_k=1)
    add("bk512_stages2", block_k=512)
    add("overlap", overlap=True)
    if base.block_m == 8:
        out.append(("bm16", dataclasses.replace(base, block_m=16)))
    return out


#: --configs knobs that set a MosaicMoEConfig field of the whole layer
LAYER_KNOBS = {
    "rk": ("routing", "kernel"),  # the one-launch routing kernel
    "sp": ("skip_padding", True),  # skip the blocks' padding rows in the FC1 operand and epilogue
    "bf": ("bf16_partials", True),  # unsplit GEMMs store bf16(alpha * acc) (trtllm_cutlass)
    "fr": ("routing", "fused"),  # routing, scales and FC1 operand in one launch (with sk, sp)
    "er": ("epilogue", "routes"),  # the FC1 epilogue one program per route
    "gw": ("wide_glue", True),  # FC1 operand and combine in fewer, larger programs
    "tq": ("token_quant", True),  # each token's FC1 input quantized once, routed rows gathered
}


def weight_knobs(name: str) -> tuple[bool, str]:
    """(pad FC2's weights, the config knobs left): knob ``pf`` times the layer on FC2 weights
    zero-padded along K (``nvfp4_jax.moe.pad_fc2``: 128-byte aligned rows), same config."""
    knobs = name.split("_")
    return "pf" in knobs, "_".join(k for k in knobs if k != "pf")


#: --configs knobs that set a module constant while the case is traced (bench-only A/B of
#: a choice that is not a config field): ``ew``: the FC1 epilogue's block programs load whole
#: blocks (no row split, ``epilogue.EPILOGUE_LOADED_ELEMS`` unbounded: before session 15);
#: ``e4k``: they load at most 4096 partials (half of the default's); ``te64``: the wide glue's
#: threads hold up to 64 elements (``operand.WIDE_THREAD_ELEMS``: more gathered rows per
#: FC1-operand program, wider combine programs)
TRACE_KNOBS = {"ew": (epilogue, "EPILOGUE_LOADED_ELEMS", 1 << 40),
               "e4k": (epilogue, "EPILOGUE_LOADED_ELEMS", 4096),
               "te64": (operand, "WIDE_THREAD_ELEMS", 64)}


def trace_knobs(name: str) -> tuple[list, str]:
    """([(module, attribute, value)] to set while tracing, the config knobs left)."""
    knobs = name.split("_")
    return ([TRACE_KNOBS[k] for k in knobs if k in TRACE_KNOBS],
            "_".join(k for k in knobs if k not in TRACE_KNOBS))



def named_config(name: str, base: MosaicMoEConfig, hidden: int, inter: int) -> MosaicMoEConfig:
    """``bm64_bn64_s3`` -> ``base`` with block_m 64, block_n 64 and 3 stages (see --configs);
    a knob prefixed ``f1`` / ``f2`` (``f2k3``) applies to that GEMM only."""
    top, gemm = {}, {"fc1": {}, "fc2": {}}
    for knob in name.split("_"):
        if knob in LAYER_KNOBS:
            field, value = LAYER_KNOBS[knob]
            top[field] = value
            continue
        m = re.fullmatch(r"(f[12])?(?:(bm|bn|s|k|bk|c)(\d+)|(ov))", knob)
        if m is None:
            raise ValueError(f"--configs: unknown knob {knob!r} in {name!r}")
        which = [m.group(1).replace("f", "fc")] if m.group(1) else ["fc1", "fc2"]
        if m.group(4):
            for w in which:
                gemm[w]["overlap"] = True
            continue
        key, v = m.group(2), int(m.group(3))
        if key == "bm":
            top["block_m"] = v
            continue
        for w in which:
            gemm[w][{"bn": "block_n", "s": "num_stages", "k": "split_k", "bk": "block_k",
                     "c": "consumers"}[key]] = v

    def apply(c: MosaicConfig, kw: dict, k: int) -> MosaicConfig:
        kw = dict(kw)
        if k % 256:  # block_k 256 (split_k: uneven with swizzled scales, else ignored)
            kw.pop("block_k", None)
        return _mc(c, **kw)

    if top.get("token_quant") and "routing" not in top and base.routing == "fused":
        top["routing"] = "kernel"  # "fused" quantizes the operand in its launch
    return dataclasses.replace(base, **top, fc1=apply(base.fc1, gemm["fc1"], hidden),
                               fc2=apply(base.fc2, gemm["fc2"], inter))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shapes", default="nemotron,qwen3_30b")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-tokens", default="1,8")
    ap.add_argument("--configs", default="", help="named configs, e.g. bm64,bm64_bn64 (see above)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Pallas-Triton reference")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timing rounds: after the first, every measured layer is timed again, "
                         "round robin (drift hits all alike); median_us is the median, rounds_us all")
    ap.add_argument("--swizzled", action="store_true",
                    help="also time the Mosaic default with both weight stacks' scales in "
                         "swizzled_128x4 (variant 'swizzled')")
    ap.add_argument("--routes-method", action="store_true",
                    help="routing kernels over more than 128 experts (nemotron) take the routes "
                         "method at any size it takes (moe.routing_kernel.ROUTES_AUTO_MAX raised to "
                         "ROUTING_ROUTES_MAX; else: up to ROUTES_AUTO_MAX routes, XLA routing above)")
    ap.add_argument("--prefer-routes", action="store_true",
                    help="routing kernels over <= 128 experts (qwen3) take the routes method where it "
                         "fits (moe.routing_kernel.ROUTING_EXPERTS_MAX set to 0 for the run; the fused "
                         "launch at qwen3 T = 8: 64 vs 128 registers, ~1.4K vs ~3.0K SASS "
                         "instructions, ptxas sm_90)")
    ap.add_argument("--routing-warps", type=int, default=0,
                    help="the routing kernels' warp count for every method and size "
                         "(moe.routing_kernel.ROUTING_WARPS; 0: routing_warps's defaults)")
    args = ap.parse_args()
    if args.routing_warps:
        routing_kernel.ROUTING_WARPS.update({(m, 1 << i): args.routing_warps
                                       for m in ("experts", "routes", "tokens") for i in range(13)})
    if args.prefer_routes:
        routing_kernel.ROUTING_EXPERTS_MAX = 0
    if args.routes_method:
        routing_kernel.ROUTES_AUTO_MAX = routing_kernel.ROUTING_ROUTES_MAX
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    rng = np.random.default_rng(0)
    doc = {**run_metadata(), "what": "moe mosaic probe", "harness": HARNESS,
           "routes_method": args.routes_method,
           "prefer_routes": args.prefer_routes, "routing_warps": args.routing_warps, "records": []}
    recs = doc["records"]
    path = os.path.join(args.out, "moe-mosaic-probe-h200.json")

    def save():
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    cases = []  # (sname, t, prepared)
    for sname in args.shapes.split(","):
        s = {**SHAPES, **SMOKE}[sname]
        e, h, i, k, act = s["experts"], s["hidden"], s["inter"], s["top_k"], s["activation"]
        r = 2 * i if act == "swiglu" else i
        _w1, _w2, q1, q2 = make_weights(jax.random.PRNGKey(1), s)
        del _w1, _w2
        s1, s2 = input_scales(s)
        params = (q1, q2, s1, s2)
        for t in map(int, args.tokens.split(",")):
            ids, wts = make_routing(rng, t, e, k, "random")
            touched = float(np.mean([len(np.unique(ids[j])) for j in range(NROT)]))
            tb = touched * (r * h + h * i) * 0.5625
            cases.append((sname, t, s, params, make_hidden(t, h), *device_routings(ids, wts),
                          touched, tb))

    def run_one(sname, t, s, params, hidden, ids, wts, touched, tb, kernel, name, cfg, ref=None,
                ref_name="triton", auto=False):
        act = s["activation"]
        # auto: the API picks (config=None; cfg is what it looks up, recorded), so an auto
        # config that these weights cannot run falls back as in a model (logged), not refused
        lay = layer_fn(act, kernel, None if auto else cfg)
        rec = {"shape": sname, "T": t, "kernel": kernel, "variant": name,
               "config": repr(cfg) if cfg is not None else None, "touched_experts": touched,
               "touched_bytes": tb}
        try:
            out = np.asarray(jax.jit(lay)(hidden, ids[0], wts[0], params).astype(jnp.float32))
            run = timed_loop(lay, per_layer_scales)
            us, n = measure(run, hidden, ids, wts, params, budget_s=0.25)
            rec.update({"median_us": us, "tbps": tb / us / 1e6, "layers_timed": n, "rounds_us": [us]})
            timers.append((rec, lambda: measure(run, hidden, ids, wts, params, budget_s=0.25)[0]))
            if ref is not None:  # max |out - ref| / max |ref| (0: the same bits)
                rec["diff_vs"] = ref_name
                rec["rel_diff"] = float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))
            if not np.all(np.isfinite(out)):
                rec["nonfinite"] = True
        except Exception as exc:  # noqa: BLE001 - record and go on
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            out = None
        recs.append(rec)
        save()
        print(f"{sname:9s} T={t:3d} {kernel:6s} {name:14s} "
              + (f"{rec['median_us']:8.1f} us {rec['tbps']:5.2f} TB/s "
                 + (f"diff vs {rec['diff_vs']} {rec['rel_diff']:.2e}" if "diff_vs" in rec else "(no reference)")
                 if "error" not in rec else rec["error"][:300])
              + f"  ({time.time() - t0:.0f}s)", flush=True)
        return out

    timers = []  # (record, re-time it) of every layer measured, for --rounds
    refs = {}
    ref_name = collections.defaultdict(lambda: "triton")
    for c in cases:  # priority 1: triton vs mosaic default, every case
        sname, t, s = c[0], c[1], c[2]
        if time.time() - t0 > args.budget_s:
            print(f"budget: skipped {sname} T={t}", flush=True)
            continue
        if not args.no_triton:
            refs[(sname, t)] = run_one(*c, "triton", "default", None)
        # what the API picks (AUTO_SM90) for "default" (linear weights) and "swizzled", and the
        # base of the named configs
        shape_kw = {"hidden": s["hidden"], "inter": s["inter"],
                    "rows1": (2 if s["activation"] == "swiglu" else 1) * s["inter"]}
        cfg = auto_config(t * s["top_k"], s["experts"], **shape_kw)
        out = run_one(*c, "mosaic", "default", cfg,
                      ref=refs.get((sname, t)), auto=True)
        if (sname, t) not in refs and out is not None:  # no Pallas-Triton layer: the variants'
            refs[(sname, t)] = out  # outputs are compared with the Mosaic default's
            ref_name[(sname, t)] = "mosaic default"
        if args.swizzled:
            q1, q2, s1, s2 = c[3]
            sw = (q1.with_layout("swizzled_128x4"), q2.with_layout("swizzled_128x4"), s1, s2)
            run_one(*c[:3], sw, *c[4:], "mosaic", "swizzled", cfg, ref=refs.get((sname, t)),
                    ref_name=ref_name[(sname, t)], auto=True)
        for name in filter(None, args.configs.split(",")):
            if time.time() - t0 > args.budget_s:
                print(f"budget: skipped {sname} T={t} {name}", flush=True)
                break
            cc = (*c[:3], sw, *c[4:]) if args.swizzled else c
            pad, cname = weight_knobs(name)
            patches, cname = trace_knobs(cname)
            base = cfg
            if pad:  # FC2 weights zero-padded along K (moe.pad_fc2), prepared outside the loop;
                # the base is what the API picks for them (AUTO_SM90_PADDED_FC2)
                q1, q2, s1, s2 = cc[3]
                cc = (*cc[:3], (q1, pad_fc2(q2), s1, s2), *cc[4:])
                base = auto_config(t * s["top_k"], s["experts"], **shape_kw, fc2_padded=True)
            with patched(patches):  # the case compiles in run_one (later rounds reuse it)
                run_one(*cc, "mosaic", name, named_config(cname, base, s["hidden"], s["inter"]) if cname else base,
                        ref=refs.get((sname, t)), ref_name=ref_name[(sname, t)])
    if args.sweep:  # priority 2: variants, round robin over the cases
        sweep_t = set(map(int, args.sweep_tokens.split(",")))
        plans = []
        for c in cases:
            sname, t, s = c[0], c[1], c[2]
            if t not in sweep_t:
                continue
            base = auto_config(t * s["top_k"], s["experts"], hidden=s["hidden"],
                               rows1=(2 if s["activation"] == "swiglu" else 1) * s["inter"], inter=s["inter"])
            plans.append((c, variants(base, s["hidden"], s["inter"])))
        for j in range(max((len(v) for _, v in plans), default=0)):
            for c, vs in plans:
                if j >= len(vs):
                    continue
                if time.time() - t0 > args.budget_s:
                    break
                name, cfg = vs[j]
                run_one(*c, "mosaic", name, cfg, ref=refs.get((c[0], c[1])), ref_name=ref_name[(c[0], c[1])])
    for r in range(1, args.rounds):  # the compiled loops are still there: timing only
        if time.time() - t0 > args.budget_s:
            print(f"budget: {r} timing rounds of {args.rounds}", flush=True)
            break
        for rec, again in timers:
            rec["rounds_us"].append(again())
            rec["median_us"] = float(np.median(rec["rounds_us"]))
            rec["tbps"] = rec["touched_bytes"] / rec["median_us"] / 1e6
        save()
    if args.rounds > 1:
        for rec, _ in timers:
            us = rec["rounds_us"]
            print(f"{rec['shape']:9s} T={rec['T']:3d} {rec['kernel']:6s} {rec['variant']:14s} "
                  f"{rec['median_us']:8.1f} us  rounds {min(us):.1f}-{max(us):.1f}", flush=True)
    doc["elapsed_s"] = time.time() - t0
    save()
    print("\nsummary (us; mosaic best of the variants measured):")
    for c in cases:
        sname, t = c[0], c[1]
        rs = [r for r in recs if r["shape"] == sname and r["T"] == t and "error" not in r]
        tri = [r for r in rs if r["kernel"] == "triton"]
        mos = sorted((r for r in rs if r["kernel"] == "mosaic"), key=lambda r: r["median_us"])
        if tri and mos:
            d = next((r for r in mos if r["variant"] == "default"), mos[0])
            print(f"{sname:9s} T={t:3d} triton {tri[0]['median_us']:7.1f}  mosaic default "
                  f"{d['median_us']:7.1f}  best {mos[0]['median_us']:7.1f} ({mos[0]['variant']})  "
                  f"{tri[0]['median_us'] / mos[0]['median_us']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
