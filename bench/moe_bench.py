"""Routed NVFP4 MoE benchmark on one GPU: ours vs lax.ragged_dot (bf16 weights) vs
dequantize-then-ragged_dot, whole layer (FC1, activation, FC2, weighted top-k sum) from the same
given routing.

Timing is in-graph: one jitted ``fori_loop`` whose every iteration runs ``INNER_ROUNDS`` (4)
rounds of 8 layers back to back (a Python-unrolled round inside an inner loop of static trip
count), one layer per routing (so touched experts differ from layer to layer and the 60 MB L2
cannot keep them), each layer's input depending on the previous output. A loop iteration of
XLA:GPU with a run-time trip count costs a host round trip for its predicate (a static trip
count does not), so 32 layers share one, and the per-layer time is the difference of two loop
lengths: ``(t(1 + n) - t(1)) / (32 n)`` (medians of ``reps`` runs each), which also removes
the call's fixed cost (``measure`` has the rule for slow layers).

Each layer's global scales (the input scales and the weights' ``decode_scale``) depend on the
running activation (``+ 0 * x[0]``, exact at run time; ``per_layer_scales``), as if every
layer had its own. With the same scale arrays for all 8 layers XLA would compute the scale
expressions once and outside the loop (common subexpressions of the 8 layers,
loop-invariant; seen in the CPU HLO), and the per-layer times would leave out their small
fusions. Work that reads only codes and block scales is still common to the 8 layers.

Bytes: touched experts' weights (NVFP4: 0.5625 B/weight; bf16:
2 B/weight), averaged over the 8 routings. FLOPs: 2 * T * k * (R*H + H*I).

Usage: python3 bench/moe_bench.py --out DIR  [--quick]
Writes DIR/moe-h200.json and DIR/moe-h200.png (copy them to bench/results/).
``--candidates``: the Pallas-Triton MoE's tile/decode candidates against the Mosaic MoE
(``candidates_sweep``) -> DIR/moe-candidates-<gpu>.json.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from run_meta import gpu_tag, hbm_copy_tbps, run_metadata

import nvfp4_jax
from nvfp4_jax.moe import pad_fc2
from nvfp4_jax.moe.api import moe
from nvfp4_jax.moe.configs import MoEConfig, default_config
from nvfp4_jax.moe.xla import activate

SHAPES = {
    "nemotron": {"hidden": 1024, "inter": 2688, "experts": 512, "top_k": 22, "activation": "relu2"},
    "qwen3_30b": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "activation": "swiglu"},
}
SMOKE = {"tiny": {"hidden": 64, "inter": 32, "experts": 8, "top_k": 2, "activation": "swiglu"}}  # CPU smoke test
TOKENS = (1, 8, 64, 512, 4096)
ROUTINGS = ("random", "skewed")
NROT = 8
#: recorded with every run: what the timed loop gives each layer (module docstring)
HARNESS = "per-layer global scales; 32 layers per loop round trip; routings as separate arrays"


def fc1_rows(s) -> int:
    """FC1's output rows R of a shape: 2I for SwiGLU (gate and up), I for relu2."""
    return 2 * s["inter"] if s["activation"] == "swiglu" else s["inter"]


def make_weights(key, s):
    e, h, i = s["experts"], s["hidden"], s["inter"]
    r = fc1_rows(s)
    k1, k2 = jax.random.split(key)

    @jax.jit
    def build(k1, k2):
        w1 = (jax.random.normal(k1, (e, r, h), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
        w2 = (jax.random.normal(k2, (e, h, i), jnp.float32) / np.sqrt(i)).astype(jnp.bfloat16)
        # per-expert ModelOpt-style weight_scale_2: one NVFP4Array per stack via vmap-free loop
        d1 = (jnp.max(jnp.abs(w1.astype(jnp.float32)), axis=(1, 2)) / 2688.0)
        d2 = (jnp.max(jnp.abs(w2.astype(jnp.float32)), axis=(1, 2)) / 2688.0)
        return w1, w2, d1, d2

    w1, w2, d1, d2 = build(k1, k2)
    q1 = quantize_stack(w1, d1)
    q2 = quantize_stack(w2, d2)
    return w1, w2, q1, q2


def quantize_stack(w, d):
    qs = jax.jit(jax.vmap(lambda x, dd: nvfp4_jax.quantize(x, "trtllm", decode_scale=dd)))(w, d)
    return nvfp4_jax.NVFP4Array.from_parts(qs.codes, qs.scales, qs.decode_scale, shape=tuple(w.shape))


def make_routing(rng, t, e, k, kind):
    """topk_ids [NROT, T, k] (distinct experts per token; Gumbel top-k) and weights [NROT, T, k]."""
    logp = np.zeros(e) if kind == "random" else -1.2 * np.log1p(np.arange(e))
    g = rng.gumbel(size=(NROT, t, e)) + logp
    ids = np.argsort(-g, axis=-1)[..., :k].astype(np.int32)
    w = rng.random((NROT, t, k)).astype(np.float32) + 0.1
    return ids, (w / w.sum(-1, keepdims=True)).astype(np.float32)


def device_routings(ids, wts):
    """The NROT routings as NROT separate device arrays each (tuples), the form every timed
    layer reads: ``ids[j]`` of a stacked [NROT, T, k] array inside the jitted program is a
    slice that XLA:GPU runs as a device-to-device copy (a Mosaic or Triton custom call cannot
    fuse it), two per layer (ids and weights, ~1 us each on the H200); a model's router
    writes its routing into a buffer of its own, so such copies would be the harness's, not
    the layer's."""
    return (tuple(jnp.asarray(ids[j]) for j in range(NROT)),
            tuple(jnp.asarray(wts[j]) for j in range(NROT)))


def ours_weights(q1, q2, scale_layout: str = "linear", pad: bool = False):
    """(fc1, fc2) as ours runs them in the tools: the weight scales in ``scale_layout`` and,
    with ``pad``, FC2 zero-padded along K (``moe.pad_fc2``; a no-op at I % 256 == 0); made
    once, outside any timed program."""
    if scale_layout != "linear":
        q1, q2 = q1.with_layout(scale_layout), q2.with_layout(scale_layout)
    if pad:
        q2 = pad_fc2(q2)
    return jax.block_until_ready((q1, q2))


def input_scales(s):
    """fp32 [E] FC1 and FC2 input scales (ModelOpt decode form) the tools use for shape ``s``."""
    e = s["experts"]
    s1 = jnp.full((e,), 4.0 / 2688, jnp.float32)
    s2 = jnp.full((e,), (1.0 if s["activation"] == "relu2" else 0.5) / 2688, jnp.float32)
    return s1, s2


def make_hidden(t, h):
    return jax.random.normal(jax.random.PRNGKey(t), (t, h), jnp.float32).astype(jnp.bfloat16)


#: How each NVFP4 impl selects its implementation through ``nvfp4_jax.moe``'s arguments (the
#: one place that names them), and the weight-scale layout it reads without a per-call
#: conversion (None: ``--scale-layout``). ``nvfp4_moe``: the default choice on this GPU (on an
#: H200 the Hopper path: the Mosaic kernels up to ``moe.mosaic.MAX_ROUTES`` routes);
#: ``nvfp4_moe_triton``: the Pallas-Triton kernels, the path SM12x GPUs run;
#: ``nvfp4_moe_mosaic``: the Mosaic GPU kernels (sm_90; SM 12.x in their mma.sync form).
MOE_IMPLS = {
    "nvfp4_moe": ({"backend": "auto"}, None),
    "nvfp4_moe_triton": ({"backend": "pallas"}, "linear"),
    "nvfp4_moe_mosaic": ({"backend": "mosaic"}, "swizzled_128x4"),
}
#: ``--proxy``: the SM12x path (Pallas-Triton MoE) side by side with the Hopper path and bf16
PROXY_IMPLS = ("nvfp4_moe_triton", "nvfp4_moe", "bf16_ragged_dot")


def nvfp4_layer(activation, backend="pallas", config=None, **select):
    """``layer(x, topk_ids, topk_weights, (fc1, fc2, s1, s2))`` through ``nvfp4_jax.moe``
    (weights travel as jit arguments: closing over them would embed GBs of constants).
    ``select``: further arguments of ``moe`` that pick the kernels (``MOE_IMPLS``)."""
    def layer(x, tids, w, p):
        return moe(x, fc1=p[0], fc2=p[1], fc1_input_scale=p[2], fc2_input_scale=p[3],
                   topk_ids=tids, topk_weights=w, activation=activation, backend=backend,
                   config=config, **select)
    return layer


def moe_kernel_used(impl: str, routes: int, hidden: int, experts: int) -> str | None:
    """The kernels an ``nvfp4_moe*`` impl runs on this device ("pallas" or "mosaic"), for the
    record; None where ``nvfp4_jax.moe`` would not run Pallas kernels."""
    from nvfp4_jax.moe.api import choose_backend

    if jax.default_backend() != "gpu":
        return None
    try:
        pick = choose_backend(MOE_IMPLS[impl][0]["backend"], None, routes=routes, hidden=hidden,
                              experts=experts)
    except ValueError:
        return None
    return pick if pick in ("pallas", "mosaic") else None


def chain(x, out):
    """The next layer's input: depends on this layer's output, so layers cannot overlap."""
    return (x.astype(jnp.float32) * 0.5 + out.astype(jnp.float32) * 1e-3).astype(jnp.bfloat16)


def bf16_layer(hidden, ids, wts, w1t, w2t, activation):
    """Whole layer with bf16 weights (pre-transposed [E, H, R] / [E, I, H]) via lax.ragged_dot."""
    t, k = ids.shape
    e = w1t.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    gs = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    x = hidden[order // k]
    u = jax.lax.ragged_dot(x, w1t, gs, preferred_element_type=jnp.float32)
    h = activate(u, activation, "up_gate").astype(jnp.bfloat16)
    d = jax.lax.ragged_dot(h, w2t, gs, preferred_element_type=jnp.float32)
    c = d * wts.reshape(-1)[order][:, None]
    return jnp.zeros_like(c).at[order].set(c).reshape(t, k, -1).sum(1).astype(jnp.bfloat16)


def per_layer_scales(params, dep):
    """NVFP4 layer params ``(fc1, fc2, s1, s2)`` with ``dep`` (0.0 at run time, derived from
    the layer's input) added to every global scale: the same values, but XLA can neither share
    the scale expressions between layers nor hoist them out of the loop."""
    fc1, fc2, s1, s2 = params

    def bump(q):
        return type(q).tree_unflatten((q.shape, q.layout), (q.codes, q.scales, q.decode_scale + dep))

    return bump(fc1), bump(fc2), s1 + dep, s2 + dep


def unrolled_layers(layer, refresh=None):
    """``layers(x, ids, wts, params)``: NROT layers back to back, unrolled in Python (one
    straight-line program), layer j on routing ``ids[j]``, each one's input the previous
    one's output (``chain``). ``refresh(params, dep)``: the params each layer gets
    (``per_layer_scales`` for the NVFP4 layers); ``dep`` is ``0 * x[0]`` of the layer's input."""
    def layers(x, ids, wts, params):
        for j in range(NROT):
            p = params
            if refresh is not None:
                # a float "* 0" is not folded by XLA (NaN), so dep is a run-time value
                p = refresh(params, x.reshape(-1)[0].astype(jnp.float32) * 0.0)
            x = chain(x, layer(x, ids[j], wts[j], p))
        return x
    return layers


#: rounds of the NROT unrolled layers per outer loop iteration (a static inner loop): the
#: outer loop's run-time trip count costs a host round trip per iteration (XLA:GPU copies the
#: predicate to the host; a loop of static trip count does not), so it is shared by
#: NROT * INNER_ROUNDS layers.
INNER_ROUNDS = 4


def timed_loop(layer, refresh=None, inner_rounds: int | None = None):
    """Jitted ``n`` outer iterations (n is a runtime value: one compile), each an inner loop
    of static trip count ``inner_rounds`` (default ``INNER_ROUNDS``) over
    ``unrolled_layers(layer, refresh)``. ``run.layers_per_iter``: layers per outer iteration.

    A ``fori_loop`` over the NROT layers, indexing stacked routings, cost ~8-16 us per layer
    at T = 1 on the H200; the layers are unrolled, and the inner loop only repeats them.
    """
    layers = unrolled_layers(layer, refresh)
    rounds = INNER_ROUNDS if inner_rounds is None else inner_rounds
    if rounds < 1:
        raise ValueError(f"inner_rounds: expected >= 1, got {rounds}")

    def body(i, x, ids, wts, params):  # static trip count: no host round trip inside
        return jax.lax.fori_loop(0, rounds, lambda j, x: layers(x, ids, wts, params), x)

    @jax.jit
    def run(x, ids, wts, n, params):
        return jax.lax.fori_loop(0, n, lambda i, x: body(i, x, ids, wts, params), x)
    run.layers_per_iter = NROT * rounds
    return run


def wall_s(run, hidden, ids, wts, params, n: int, reps: int) -> float:
    """Median wall time (s) of ``reps`` calls of ``run`` with ``n`` outer iterations."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(hidden, ids, wts, n, params).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def measure(run, hidden, ids, wts, params, budget_s=1.0, reps=3):
    """Per-layer device time (us) and the number of layers timed.

    ``(t(1 + n) - t(1)) / (L * n)`` (medians of ``reps`` runs each; L = ``run.layers_per_iter``,
    NROT * INNER_ROUNDS), which removes the call's fixed cost and amortizes the outer loop's
    round trip over L layers. Layers slower than 5 ms (the bf16 baselines at T >= 64) take
    ``t(1) / L`` from one run: the fixed cost (tens of us) is then < 0.1 %, and the difference
    would cost seconds of GPU time.
    """
    per_iter = getattr(run, "layers_per_iter", NROT)

    def t_of(n, r):
        return wall_s(run, hidden, ids, wts, params, n, r)

    run(hidden, ids, wts, 1, params).block_until_ready()  # compile + warm
    t1 = t_of(1, 1)
    if t1 > 5e-3 * per_iter:
        return t1 / per_iter * 1e6, per_iter
    t1 = t_of(1, reps)
    n = int(max(2, min(100, budget_s / reps / max(t1, 1e-6))))
    t2 = t_of(1 + n, reps)
    return max(t2 - t1, 1e-9) / (per_iter * n) * 1e6, per_iter * n


# --------------------------------------------------------------------------- candidates

#: ``--candidates``: the issue-31 shapes and token counts (T <= 64: every block one expert's
#: weight stream, the decode regime of ``moe.configs.default_config``)
CAND_SHAPES = ("qwen3_30b", "nemotron")
CAND_TOKENS = (1, 8, 64)


def shape_of(shape) -> dict:
    """A shape's dict (``SHAPES`` or ``SMOKE``) from its name; a dict is returned as it is."""
    if isinstance(shape, dict):
        return shape
    shapes = {**SHAPES, **SMOKE}
    if shape not in shapes:
        raise ValueError(f"shape: expected one of {tuple(shapes)}, got {shape!r}")
    return shapes[shape]


def moe_sweep_candidates(shape, t: int) -> list[tuple[str, MoEConfig]]:
    """(label, MoEConfig) that ``--candidates`` times for ``shape`` (a name or a ``SHAPES``
    dict) at ``t`` tokens: the library default (``default_config``, what ``moe`` runs with
    ``config=None``), the default with each other bf16 decode (``asm``, ``asmm``, ``asm2m``),
    and tile variants of the ``asm2m`` default: the output tile (BN 64 <-> 128;
    gated FC1 keeps its BN 64, the register limit of its two accumulators), BK 128, 8 warps,
    3 and 5 pipeline stages, BN flipped with 8 warps and with 3 stages, BN 32 for both GEMMs
    (twice the programs at decode; mma.sync instead of wgmma, so also with the ``asmm`` decode
    and with 2 warps); BM 16 where the default's BM is larger. Configs equal to an earlier one are left out; labels are unique."""
    s = shape_of(shape)
    e, h, i, k = s["experts"], s["hidden"], s["inter"], s["top_k"]
    gated = s["activation"] == "swiglu"
    lib = default_config(t * k, e, inter=i, hidden=h, gated=gated)
    base = lib.with_decode("asm2m")

    def flip(bn: int) -> int:
        return 128 if bn == 64 else 64

    def tiles(fc1_bn=None, fc2_bn=None, **kw) -> MoEConfig:
        c1 = dataclasses.replace(base.fc1, block_n=fc1_bn or base.fc1.block_n, **kw)
        c2 = dataclasses.replace(base.fc2, block_n=fc2_bn or base.fc2.block_n, **kw)
        return MoEConfig(c1, c2, base.mma)

    bn1 = base.fc1.block_n if gated else flip(base.fc1.block_n)
    bn2 = flip(base.fc2.block_n)
    variants = [tiles(bn1, bn2), tiles(block_k=128), tiles(num_warps=8), tiles(num_stages=3),
                tiles(num_stages=5), tiles(bn1, bn2, num_warps=8), tiles(bn1, bn2, num_stages=3),
                tiles(32, 32), tiles(32, 32, decode="asmm"), tiles(32, 32, num_warps=2, decode="asmm")]
    if base.fc1.block_m != 16:
        variants.append(tiles(block_m=16))
    out = [("default", lib)] + [(f"default_{d}", lib.with_decode(d))
                                for d in ("asm", "asmm", "asm2m") if d != lib.fc1.decode]
    for cfg in variants:
        c1, c2 = cfg.fc1, cfg.fc2
        label = (f"m{c1.block_m}_n{c1.block_n}-{c2.block_n}_k{c1.block_k}_w{c1.num_warps}"
                 f"_st{c1.num_stages}_{c1.decode}")
        if all(cfg != c for _, c in out) and all(label != lb for lb, _ in out):
            out.append((label, cfg))
    return out


def make_moe_timer(run, hidden, ids, wts, params, *, target_s: float = 0.05, reps: int = 3):
    """Compile ``run`` (a ``timed_loop``) once; return a callable that times one more round
    and returns the per-layer time in us, by ``measure``'s rule: ``(t(1 + n) - t(1)) / (L n)``
    (each t the median of ``reps`` runs; n fixed here from ``target_s``), or ``t(1) / L`` for
    layers slower than 5 ms. Called in turn with other candidates' timers, the rounds see the
    same drift of the GPU."""
    per_iter = getattr(run, "layers_per_iter", NROT)

    def t_of(n, r):
        return wall_s(run, hidden, ids, wts, params, n, r)

    run(hidden, ids, wts, 1, params).block_until_ready()  # compile + warm
    t1 = t_of(1, 1)
    slow = t1 > 5e-3 * per_iter
    n = int(max(2, min(100, target_s / max(t1, 1e-6))))

    def one_round() -> float:
        if slow:
            return t_of(1, 1) / per_iter * 1e6
        a = t_of(1, reps)
        b = t_of(1 + n, reps)
        return max(b - a, 1e-9) / (per_iter * n) * 1e6

    one_round.layers = per_iter if slow else per_iter * n
    return one_round


def candidates_sweep(out_path, shapes, tokens, budget_s, repeats=3, target_s=0.05, labels=None):
    """Time ``moe_sweep_candidates`` (the Pallas-Triton MoE, ``backend="pallas"``, linear
    weight scales) and the Mosaic MoE (``backend="mosaic"``, swizzled scales: sm_90, or SM
    12.x in its mma.sync form; on sm_90 also its tiles with mma.sync, ``mosaic_sync_config``)
    per shape and T on one random routing set, interleaved: every timer is compiled first,
    then ``repeats`` rounds run each timer once in turn; records the median and every round,
    and each candidate's median over the Mosaic one. Compiles stop once
    ``budget_s`` is spent (``"skipped": "budget"``; the compiled ones still run); a candidate
    that raises is recorded with its error and the others go on. Off the GPU the kernels run
    in interpret mode with the portable decode "bits" (recorded as ``decode_run``; times mean
    nothing there). ``labels``: only the candidates so labelled (and the Mosaic MoE). Writes
    ``out_path`` after each T."""
    from nvfp4_jax.device import gpu_compute_capability, is_sm90, on_gpu
    from nvfp4_jax.gemm.mosaic import unavailable

    t0 = time.time()
    doc = {**run_metadata(), "harness": HARNESS, "routing": "random",
           "timing": "in-graph, interleaved rounds (make_moe_timer)", "repeats": repeats,
           "records": []}
    rng = np.random.default_rng(0)
    gpu = on_gpu()
    for sname in shapes:
        s = shape_of(sname)
        e, h, k, act = s["experts"], s["hidden"], s["top_k"], s["activation"]
        _, _, q1, q2 = make_weights(jax.random.PRNGKey(1), s)
        s1, s2 = input_scales(s)
        tri_sel, tri_lay = MOE_IMPLS["nvfp4_moe_triton"]
        mos_sel, mos_lay = MOE_IMPLS["nvfp4_moe_mosaic"]
        p_tri = (*ours_weights(q1, q2, tri_lay), s1, s2)
        mos_ok = gpu and unavailable(gpu_compute_capability()) is None  # SM 12.x: mma.sync
        p_mos = (*ours_weights(q1, q2, mos_lay), s1, s2) if mos_ok else None
        for t in tokens:
            ids, wts = make_routing(rng, t, e, k, "random")
            hidden = make_hidden(t, h)
            ids_d, wts_d = device_routings(ids, wts)
            base = {"shape": sname, "T": t}
            timers, recs = [], []
            todo = [("mosaic", None)] + [(lb, c) for lb, c in moe_sweep_candidates(s, t)
                                         if labels is None or lb in labels]
            if p_mos is not None and is_sm90():  # its tiles with mma.sync (SM 12.x's form)
                todo.append(("mosaic_sync", mosaic_sync_config(s, t)))
            for label, cfg in todo:
                sync = label == "mosaic_sync"
                rec = {**base, "label": label,
                       "backend": "mosaic" if cfg is None or sync else "pallas"}
                if sync:
                    rec.update(fc1=dataclasses.asdict(cfg.fc1), fc2=dataclasses.asdict(cfg.fc2))
                elif cfg is not None:
                    rec.update(fc1=dataclasses.asdict(cfg.fc1), fc2=dataclasses.asdict(cfg.fc2),
                               mma=cfg.resolved_mma())
                    if not gpu:  # the inline-asm decodes need the GPU
                        cfg = cfg.with_decode("bits")
                        rec["decode_run"] = "bits"
                elif p_mos is None:
                    rec["skipped"] = (
                        unavailable(gpu_compute_capability()) if gpu
                        else "no GPU: the Mosaic MoE reference needs an sm_90 or SM 12.x GPU")
                    recs.append(rec)
                    continue
                if time.time() - t0 > budget_s:
                    log(f"mcand: budget spent, {label} at {sname} T={t} not compiled")
                    recs.append({**rec, "skipped": "budget"})
                    continue
                try:
                    if cfg is None or sync:
                        fn, params = nvfp4_layer(act, config=cfg, **mos_sel), p_mos
                    else:
                        fn, params = nvfp4_layer(act, config=cfg, **tri_sel), p_tri
                    run = timed_loop(fn, per_layer_scales)
                    timers.append((rec, make_moe_timer(run, hidden, ids_d, wts_d, params,
                                                       target_s=target_s)))
                except Exception as exc:  # noqa: BLE001 - record and go on with the others
                    log(f"mcand: {label} at {sname} T={t} FAILED {type(exc).__name__}: "
                        f"{str(exc)[:300]}")
                    recs.append({**rec, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            rounds = {id(rec): [] for rec, _ in timers}
            for _ in range(repeats):
                for rec, timer in timers:
                    rounds[id(rec)].append(timer())
            for rec, timer in timers:
                rec.update(median_us=float(np.median(rounds[id(rec)])),
                           rounds_us=rounds[id(rec)], layers_timed=timer.layers)
                recs.append(rec)
            ref = next((r["median_us"] for r in recs
                        if r["label"] == "mosaic" and "median_us" in r), None)
            for rec in recs:
                if "median_us" in rec:
                    rec["ratio_vs_mosaic"] = rec["median_us"] / ref if ref else None
                    log(json.dumps({kk: v for kk, v in rec.items() if kk not in ("fc1", "fc2")}))
            order = {label: j for j, (label, _) in enumerate(todo)}
            doc["records"] += sorted(recs, key=lambda r: order[r["label"]])
            with open(out_path, "w") as f:
                json.dump(doc, f, indent=1)
        del q1, q2, p_tri, p_mos
    return doc


def mosaic_sync_config(shape, t: int):
    """The Mosaic MoE's config for this layer and T as SM 12.x gets it (``moe.mosaic.auto_config``
    with ``sm12x``) with both grouped GEMMs on ``mma.sync`` (one warpgroup, no overlap)."""
    from nvfp4_jax.moe import mosaic as moe_mosaic

    cfg = moe_mosaic.auto_config(t * shape["top_k"], shape["experts"], hidden=shape["hidden"],
                                 rows1=fc1_rows(shape), inter=shape["inter"], sm12x=True)
    return dataclasses.replace(cfg, fc1=cfg.fc1.sync_form(), fc2=cfg.fc2.sync_form(), measured="")


def moe_candidates_table(doc) -> str:
    """Markdown: per shape and T, each timed entry's median us and its ratio to the Mosaic
    MoE, fastest first; then the candidates that were skipped or failed."""
    lines = ["| shape | T | label | BN fc1/fc2 | BK | warps | stages | decode | us | / mosaic |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by, other = {}, []
    for r in doc["records"]:
        if "median_us" in r:
            by.setdefault((r["shape"], r["T"]), []).append(r)
        else:
            why = r.get("skipped") or r.get("error", "?")
            other.append(f"{r['shape']} T={r['T']} {r['label']}: {why}")
    for (shape, t), rs in by.items():
        for r in sorted(rs, key=lambda r: r["median_us"]):
            c1, c2 = r.get("fc1"), r.get("fc2")
            ran = f" (ran {r['decode_run']})" if r.get("decode_run") else ""
            if c1 and "mma" in c1:  # a Mosaic config (mosaic_sync): one warpgroup, PTX decode
                tiles = (f"{c1['block_n']}/{c2['block_n']} | {c1['block_k']} | 4 | "
                         f"{c1['num_stages']} | mosaic ({c1['mma']})")
            else:
                tiles = (f"{c1['block_n']}/{c2['block_n']} | {c1['block_k']} | {c1['num_warps']} | "
                         f"{c1['num_stages']} | {c1['decode']}{ran}" if c1 else "- | - | - | - | -")
            ratio = f"{r['ratio_vs_mosaic']:.2f}" if r.get("ratio_vs_mosaic") else "-"
            lines.append(f"| {shape} | {t} | {r['label']} | {tiles} | {r['median_us']:.1f} | "
                         f"{ratio} |")
    if other:
        lines += ["", "not timed: " + "; ".join(other)]
    return "\n".join(lines)


def log(*a):
    print(*a, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None, help="also: tiny (CPU smoke test); default "
                    + ",".join(SHAPES) + " (--candidates: " + ",".join(CAND_SHAPES) + ")")
    ap.add_argument("--tokens", default=None, help="default " + ",".join(map(str, TOKENS))
                    + " (--candidates: " + ",".join(map(str, CAND_TOKENS)) + ")")
    ap.add_argument("--impls", default="nvfp4_moe,bf16_ragged_dot,dequant_ragged_dot")
    ap.add_argument("--scale-layout", default="swizzled_128x4", choices=("linear", "swizzled_128x4"),
                    help="nvfp4_moe's weight-stack scale layout (prepared once, outside the "
                         "timing, as TensorRT-LLM loads them; the Mosaic kernel reads swizzled "
                         "scales per K step)")
    ap.add_argument("--pad-fc2", action="store_true",
                    help="nvfp4_moe's FC2 stack zero-padded along K (nvfp4_jax.moe.pad_fc2, once, "
                         "outside the timing; a no-op where I %% 256 == 0); bytes and TB/s still "
                         "count the unpadded weights")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="after this many seconds only the nvfp4_moe* impls are measured "
                         "(0: no limit)")
    ap.add_argument("--routings", default=",".join(ROUTINGS))
    ap.add_argument("--proxy", action="store_true",
                    help="the SM12x-proxy rows: " + ",".join(PROXY_IMPLS) + " (unless --impls is "
                         "given), random routing, each NVFP4 impl on the scale layout it reads "
                         "natively -> OUT/moe-proxy-<gpu>.json")
    ap.add_argument("--resume", default="", metavar="PATH",
                    help="skip the rows this results JSON (a directory: its file of this run's "
                         "name, e.g. bench/results) already measured; merge_results.py merges")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the rows that would be measured (JSON lines) and exit")
    ap.add_argument("--candidates", action="store_true",
                    help="time moe_sweep_candidates (Pallas-Triton MoE tiles and decodes) against "
                         "the Mosaic MoE (sm_90, SM 12.x), interleaved rounds, random routing "
                         "(--budget-s caps compiles) -> OUT/moe-candidates-<gpu>.json")
    ap.add_argument("--repeats", type=int, default=3, help="--candidates: interleaved rounds")
    ap.add_argument("--labels", default="",
                    help="--candidates: only these candidate labels (comma-separated; --dry-run "
                         "lists them)")
    args = ap.parse_args()
    if args.candidates:
        shapes = (args.shapes or ",".join(CAND_SHAPES)).split(",")
        tokens = [int(t) for t in (args.tokens or ",".join(map(str, CAND_TOKENS))).split(",")]
        for sname in shapes:
            if sname not in {**SHAPES, **SMOKE}:
                ap.error(f"--shapes: expected names from {(*SHAPES, *SMOKE)}, got {sname!r}")
        if args.dry_run:
            for sname in shapes:
                for t in tokens:
                    for label, c in moe_sweep_candidates(sname, t):
                        print(json.dumps({"shape": sname, "T": t, "label": label,
                                          "fc1": dataclasses.asdict(c.fc1),
                                          "fc2": dataclasses.asdict(c.fc2)}), flush=True)
            return
        os.makedirs(args.out, exist_ok=True)
        tag = gpu_tag(jax.devices()[0].device_kind)
        path = os.path.join(args.out, f"moe-candidates-{tag}.json")
        doc = candidates_sweep(path, shapes, tokens, args.budget_s or float("inf"),
                               repeats=args.repeats, target_s=0.02 if args.quick else 0.05,
                               labels=set(args.labels.split(",")) if args.labels else None)
        log("wrote", path)
        log(moe_candidates_table(doc))
        return
    args.shapes = args.shapes or ",".join(SHAPES)
    args.tokens = args.tokens or ",".join(map(str, TOKENS))
    impl_given = any(a == "--impls" or a.startswith("--impls=") for a in sys.argv[1:])
    if args.proxy:
        if not impl_given:
            args.impls = ",".join(PROXY_IMPLS)
        args.routings = "random"
    known = (*MOE_IMPLS, "bf16_ragged_dot", "dequant_ragged_dot")
    for name in args.impls.split(","):
        if name not in known:
            ap.error(f"--impls: expected names from {known}, got {name!r}")
    for kind in args.routings.split(","):
        if kind not in ROUTINGS:
            ap.error(f"--routings: expected names from {ROUTINGS}, got {kind!r}")
    stem = f"moe-proxy-{gpu_tag(jax.devices()[0].device_kind)}" if args.proxy else "moe-h200"
    skip = frozenset()
    if args.resume:
        from merge_results import measured

        skip = frozenset(measured("moe", args.resume, stem))
    if args.dry_run:
        for row in plan(args.shapes.split(","), [int(t) for t in args.tokens.split(",")],
                        args.routings.split(","), args.impls.split(","), skip):
            print(json.dumps(row), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    records = [{"impl": "hbm_copy", "tbps": hbm_copy_tbps()}]
    print(f"hbm_copy {records[0]['tbps']:.2f} TB/s", flush=True)
    rng = np.random.default_rng(0)
    impls = args.impls.split(",")
    for sname in args.shapes.split(","):
        if not plan([sname], [int(t) for t in args.tokens.split(",")], args.routings.split(","),
                    impls, skip):
            print(f"{sname}: every row already measured (--resume)", flush=True)
            continue
        s = {**SHAPES, **SMOKE}[sname]
        e, h, i, k, act = s["experts"], s["hidden"], s["inter"], s["top_k"], s["activation"]
        r = fc1_rows(s)
        w1, w2, q1, q2 = make_weights(jax.random.PRNGKey(1), s)
        w1t, w2t = jnp.swapaxes(w1, 1, 2), jnp.swapaxes(w2, 1, 2)
        del w1, w2
        s1, s2 = input_scales(s)
        layouts = {}  # scale layout -> (fc1, fc2) prepared once
        layers = {
            "dequant_ragged_dot": (nvfp4_layer(act, "xla"), (q1, q2, s1, s2)),
            "bf16_ragged_dot": (lambda x, tids, w, p, act=act: bf16_layer(x, tids, w, p[0], p[1], act),
                                (w1t, w2t)),
        }
        padded = False
        for name in impls:
            if name in MOE_IMPLS:
                select, native = MOE_IMPLS[name]
                lay = native or args.scale_layout
                if lay not in layouts:
                    layouts[lay] = ours_weights(q1, q2, lay, args.pad_fc2)
                p1, p2 = layouts[lay]
                padded = p2.shape != q2.shape
                layers[name] = (nvfp4_layer(act, **select), (p1, p2, s1, s2))
        runs = {name: timed_loop(fn, per_layer_scales if name != "bf16_ragged_dot" else None)
                for name, (fn, _) in layers.items() if name in impls}
        for t in map(int, args.tokens.split(",")):
            for kind in args.routings.split(","):
                if not plan([sname], [t], [kind], impls, skip):
                    continue
                ids, wts = make_routing(rng, t, e, k, kind)
                touched = np.mean([len(np.unique(ids[j])) for j in range(NROT)])
                hidden = make_hidden(t, h)
                ids_d, wts_d = device_routings(ids, wts)
                flops = 2.0 * t * k * (r * h + h * i)
                for impl in impls:
                    if (impl, sname, kind, t) in skip:
                        continue
                    if (args.budget_s and impl not in MOE_IMPLS
                            and time.time() - t_start > args.budget_s):
                        print(f"{sname} T={t} {kind} {impl}: skipped (bench budget)", flush=True)
                        continue
                    if impl == "dequant_ragged_dot" and kind == "skewed":
                        continue  # dominated by the full dequantization; routing barely matters
                    dense_gb = e * t * k * r * 2 / 1e9  # XLA's GPU ragged_dot materializes [E, M, N]
                    if impl not in MOE_IMPLS and dense_gb > 100:
                        records.append({"impl": impl, "shape": sname, "routing": kind, "T": t, "error": (
                            f"skipped: XLA's ragged_dot lowering asks for ~{dense_gb:.0f} GB "
                            "(E x rows x N bf16)")})
                        continue
                    try:
                        us, n = measure(runs[impl], hidden, ids_d, wts_d, layers[impl][1],
                                        budget_s=0.15 if args.quick else 0.3)
                    except Exception as exc:  # noqa: BLE001 - record and keep going
                        print(f"{sname} T={t} {kind} {impl}: FAILED {type(exc).__name__}: {str(exc)[:300]}",
                              flush=True)
                        records.append({"impl": impl, "shape": sname, "routing": kind, "T": t,
                                            "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                        save(records, args.out, stem)
                        continue
                    bpw = 0.5625 if impl != "bf16_ragged_dot" else 2.0
                    tb = touched * (r * h + h * i) * bpw
                    rec = {"impl": impl, "shape": sname, "routing": kind, "T": t, "median_us": us,
                               "touched_experts": float(touched), "touched_bytes": float(tb),
                               "tbps": tb / us / 1e6, "tflops": flops / us / 1e6, "layers_timed": n}
                    if impl != "bf16_ragged_dot":
                        rec["scale_layout"] = ((MOE_IMPLS[impl][1] or args.scale_layout)
                                               if impl in MOE_IMPLS else "linear")
                    if impl in MOE_IMPLS:
                        rec["kernel"] = moe_kernel_used(impl, t * k, h, e)
                        if padded:
                            rec["fc2_padded"] = True  # K zero-padded to a multiple of 256
                    records.append(rec)
                    save(records, args.out, stem)
                    print(f"{sname:9s} T={t:5d} {kind:6s} {impl:18s} {us:10.1f} us  "
                          f"{rec['tbps']:6.3f} TB/s  {rec['tflops']:7.2f} TFLOP/s  (n={n}, "
                          f"{time.time() - t_start:.0f}s)", flush=True)
        del w1t, w2t, q1, q2, layouts, layers, runs
    save(records, args.out, stem)
    if args.proxy:
        from tables import proxy_moe

        print(proxy_moe({"records": records}), flush=True)
        return
    plot(records, os.path.join(args.out, "moe-h200.png"))
    summary(records)


def plan(shapes, tokens, routings, impls, skip=frozenset()) -> list[dict]:
    """The rows ``main`` measures, in order (``--dry-run``); the skip rules are main's;
    ``skip``: (impl, shape, routing, T) keys already measured (``--resume``)."""
    rows = []
    for sname in shapes:
        for t in tokens:
            for kind in routings:
                for impl in impls:
                    if impl == "dequant_ragged_dot" and kind == "skewed":
                        continue
                    if (impl, sname, kind, t) in skip:
                        continue
                    row = {"impl": impl, "shape": sname, "routing": kind, "T": t}
                    if impl in MOE_IMPLS:
                        row["select"] = MOE_IMPLS[impl][0]
                        row["scale_layout"] = MOE_IMPLS[impl][1] or "--scale-layout"
                    rows.append(row)
    return rows


def save(records, out, stem="moe-h200"):
    doc = {**run_metadata(), "harness": HARNESS, "records": records}
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(doc, f, indent=1)


def plot(records, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, sname in zip(axes, SHAPES):
        for impl, style in (("nvfp4_moe", "o-"), ("bf16_ragged_dot", "s--"), ("dequant_ragged_dot", "^:")):
            for kind in ROUTINGS:
                rs = sorted((r for r in records if r.get("shape") == sname and r["impl"] == impl
                             and r["routing"] == kind and "error" not in r), key=lambda r: r["T"])
                if rs:
                    ax.plot([r["T"] for r in rs], [r["median_us"] for r in rs], style,
                            label=f"{impl} ({kind})", alpha=1.0 if kind == "random" else 0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("layer time (us, median, in-graph)")
        ax.set_title(f"{sname} MoE layer, H200")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(records):
    copy = next(r["tbps"] for r in records if r["impl"] == "hbm_copy")
    print(f"\nsummary (hbm copy {copy:.2f} TB/s):")
    print(f"{'shape':9s} {'T':>5s} {'routing':7s} {'nvfp4 us':>9s} {'TB/s':>6s} {'%copy':>6s} "
          f"{'TFLOP/s':>8s} {'bf16 us':>9s} {'x bf16':>7s} {'deq us':>9s}")
    for r in records:
        if r["impl"] != "nvfp4_moe" or "error" in r:
            continue
        def other(impl, r=r):
            return next((o["median_us"] for o in records
                         if o["impl"] == impl and "error" not in o and o["shape"] == r["shape"]
                         and o["T"] == r["T"] and o["routing"] == r["routing"]), float("nan"))
        b, d = other("bf16_ragged_dot"), other("dequant_ragged_dot")
        print(f"{r['shape']:9s} {r['T']:5d} {r['routing']:7s} {r['median_us']:9.1f} {r['tbps']:6.3f} "
              f"{100 * r['tbps'] / copy:5.1f}% {r['tflops']:8.2f} {b:9.1f} {b / r['median_us']:7.2f} {d:9.1f}")


if __name__ == "__main__":
    main()
