"""End-to-end decoder benchmark: NVFP4 models (``nvfp4_jax.models``) against the same models
in bf16 JAX (``jnp.dot`` linears, ``lax.ragged_dot`` experts), in one run.

Models (random weights built on the device, no checkpoint): a Qwen3-30B-A3B shape (48 layers,
hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, top-8, vocab 151936) and a
Llama-3-8B shape (32 layers, hidden 4096, 32 q / 8 kv heads of 128, MLP 14336, vocab 128256).
NVFP4 weights are random codes and E4M3 block scales with W4A4 input scales (as a ModelOpt
NVFP4 export has them); embeddings, norms, router and LM head are bf16 in both precisions.

Per model and precision: decode tokens/s at each batch (default 1, 8, 32) with a KV cache
holding ``--context`` tokens (one jitted decode step per token, argmax sampling, timed over
``--steps`` steps after a warm-up); prefill tokens/s for one ``--prefill``-token prompt;
device memory in use and weight bytes; at batch 1 the per-token time breakdown (attention,
MoE, dense, other) from steps with one part left out (``models.forward``'s ``ablate``:
attention core, MoE, NVFP4 linears; other = the rest: embedding, norms, LM head, sampling,
launch overhead); the bytes a batch-1 decode step must read (weights used: dense + the top-k
experts of each layer, plus the KV cache) and that read's rate against the HBM copy rate
measured in the same run.

Each model and precision runs in a process of its own (the unrolled runs last, each in its
own too): a model run after another in the same process measured up to 10 % slower per step
(Llama-3-8B 3.77 against 3.43 ms after Qwen3-30B-A3B, H200), and ``peak_bytes_in_use`` never
resets within a process. This process only starts them and merges their JSON (``--in-process``
runs everything here, as each child does).

Usage (H200, under ~8 minutes):  python bench/e2e_bench.py --out "$OUT"
CPU smoke test with tiny shapes:   python bench/e2e_bench.py --tiny --out /tmp/x
Writes OUT/e2e-GPU.json, GPU the children's device (``run_meta.gpu_tag``: e2e-h200.json,
e2e-h100-80gb-hbm3.json; ``--tiny``: OUT/e2e-tiny.json). ``--budget-s`` (default 420) skips
what would start after that many seconds (listed under "skipped").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_meta import gpu_tag, hbm_copy_tbps, run_metadata  # noqa: E402

from nvfp4_jax import NVFP4Array, models, nn  # noqa: E402
from nvfp4_jax.models import DecoderConfig, Model  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, rope_theta=1e6, qk_norm=True,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=5e5),
}
TINY = {
    "qwen3-30b-a3b": dict(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=32, rope_theta=1e6, qk_norm=True,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                          norm_topk_prob=True),
    "llama-3-8b": dict(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, intermediate_size=256, rope_theta=5e5),
}
PRECISIONS = ("nvfp4", "bf16")
#: NVFP4 decode scale and activation input scale of the random weights (weights ~ 1e-2)
DECODE_SCALE = 1.5e-3
INPUT_SCALE = 5.0 / 2688


def config_of(shape: dict) -> DecoderConfig:
    kw = dict(shape)
    if kw.get("num_experts"):
        kw["moe_layers"] = tuple(range(kw["num_layers"]))
    return DecoderConfig(**kw)


# ------------------------------------------------------------------------------------------
# random weights, built on the device one layer at a time (lax.map), never via the host
# ------------------------------------------------------------------------------------------

def _bf16(key, shape, exponent=0x3C00):
    """bf16 values of random sign and mantissa and one binade (2^-7 for the default)."""
    bits = jax.random.bits(key, shape, jnp.uint16)
    return jax.lax.bitcast_convert_type((bits & 0x807F) | exponent, jnp.bfloat16)


def _nvfp4(key, shape):
    """Random NVFP4 [..., N, K]: any E2M1 codes, E4M3 block scales in [0.5, 16)."""
    k1, k2 = jax.random.split(key)
    codes = jax.random.bits(k1, shape[:-1] + (shape[-1] // 2,), jnp.uint8)
    sbytes = jax.random.randint(k2, shape[:-1] + (shape[-1] // 16,), 0x30, 0x60).astype(jnp.uint8)
    scales = jax.lax.bitcast_convert_type(sbytes, jnp.float8_e4m3fn)
    ds = jnp.full(shape[:-2], DECODE_SCALE, jnp.float32)
    return NVFP4Array(codes, scales, ds, tuple(shape), "linear")


def _linear(key, n, k, precision):
    if precision == "bf16":
        return _bf16(key, (n, k))
    return nn.Linear(_nvfp4(key, (n, k)), jnp.float32(INPUT_SCALE))


def _layer(key, cfg: DecoderConfig, precision: str, fuse: bool = True) -> dict:
    """One layer's random weights; ``fuse``: q/k/v and gate/up as one linear each (the layout
    ``models.fuse_projections`` gives a ModelOpt export, whose fused projections share their
    scales, as these random ones do)."""
    ks = jax.random.split(key, 8)
    h, d = cfg.hidden_size, cfg.head_dim
    nh, kvh = cfg.num_heads, cfg.num_kv_heads
    if fuse:
        attn = {"qkv_proj": _linear(ks[0], (nh + 2 * kvh) * d, h, precision)}
    else:
        attn = {"q_proj": _linear(ks[0], nh * d, h, precision),
                "k_proj": _linear(ks[1], kvh * d, h, precision),
                "v_proj": _linear(ks[2], kvh * d, h, precision)}
    attn["o_proj"] = _linear(ks[3], h, nh * d, precision)
    if cfg.qk_norm:
        attn["q_norm"] = jnp.ones((d,), jnp.bfloat16)
        attn["k_norm"] = jnp.ones((d,), jnp.bfloat16)
    layer = {"input_layernorm": jnp.ones((h,), jnp.bfloat16),
             "post_attention_layernorm": jnp.ones((h,), jnp.bfloat16), "self_attn": attn}
    if cfg.moe_layers:
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        router = _bf16(ks[4], (e, h), exponent=0x3E00)  # ~ 2^-3: routing varies by token
        if precision == "bf16":
            layer["moe"] = nn.MoEBF16(router, _bf16(ks[5], (e, 2 * i, h)), _bf16(ks[6], (e, h, i)),
                                      top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        else:
            s = jnp.full((e,), INPUT_SCALE, jnp.float32)
            layer["moe"] = nn.MoE(router, _nvfp4(ks[5], (e, 2 * i, h)), _nvfp4(ks[6], (e, h, i)),
                                  s, s, top_k=cfg.num_experts_per_tok, routing="softmax",
                                  renormalize=cfg.norm_topk_prob, activation="swiglu")
    else:
        m = cfg.intermediate_size
        if fuse:
            layer["mlp"] = {"gate_up_proj": _linear(ks[4], 2 * m, h, precision)}
        else:
            layer["mlp"] = {"gate_proj": _linear(ks[4], m, h, precision),
                            "up_proj": _linear(ks[5], m, h, precision)}
        layer["mlp"]["down_proj"] = _linear(ks[6], h, m, precision)
    return layer


def build_model(cfg: DecoderConfig, precision: str, seed: int = 0, fuse: bool = True) -> Model:
    """A random model of ``cfg`` with all layers stacked for ``lax.scan`` (``fuse``: see
    ``_layer``)."""
    key = jax.random.key(seed)
    kl, ke, kh = jax.random.split(key, 3)
    layer_keys = jax.random.split(kl, cfg.num_layers)
    one = functools.partial(_layer, cfg=cfg, precision=precision, fuse=fuse)
    stacked = jax.jit(lambda ks: jax.lax.map(one, ks))(layer_keys)
    embed = _bf16(ke, (cfg.vocab_size, cfg.hidden_size), exponent=0x3F00)
    head = _bf16(kh, (cfg.vocab_size, cfg.hidden_size))
    model = Model(embed, [stacked], jnp.ones((cfg.hidden_size,), jnp.bfloat16), head, cfg,
                  ("scan",))
    jax.block_until_ready(model)
    return model


#: Nemotron-3-Nano-30B-A3B's architecture (its HF config.json; 52 layers: Mamba2 "M", MoE
#: "E", attention "*"), for the NVFP4 step profile (e2e_profile.py; no bf16 twin is built)
NEMOTRON_H = {
    "nemotron-3-nano": dict(
        vocab_size=131072, hidden_size=2688,
        layer_types=tuple("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
        num_heads=32, num_kv_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, conv_kernel=4, num_experts=128, num_experts_per_tok=6,
        moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
        routed_scaling_factor=2.5),
}
NEMOTRON_H_TINY = {
    "nemotron-3-nano": dict(
        vocab_size=512, hidden_size=128, layer_types=tuple("MEMEM*E" * 2), num_heads=4,
        num_kv_heads=2, head_dim=32, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
        n_groups=2, conv_kernel=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, moe_shared_expert_intermediate_size=128,
        routed_scaling_factor=2.5),
}


def nemotron_h_layer(ks, kind: str, cfg, linear, experts, dense,
                     input_scale: float = INPUT_SCALE) -> dict:
    """One random Nemotron-H layer of ``kind`` from 8 keys ``ks``, its weights made by the
    factories: ``linear(key, n, k)`` an ``nn.Linear`` [N, K], ``experts(key, (E, N, K))`` an
    expert stack, ``dense(key, shape, role)`` the Mamba conv weight ("conv"), the router
    ("router") and its correction bias ("bias"); ``input_scale`` the experts' activation scale;
    norms, biases and the SSM's own parameters are fixed. The benchmark's model and the GPU
    test's (Gaussian weights quantized) share it."""
    h = cfg.hidden_size
    layer = {"norm": jnp.ones((h,), jnp.bfloat16)}
    if kind == "M":
        nh, cdim = cfg.mamba_num_heads, cfg.conv_dim
        dt = jnp.exp(jnp.linspace(np.log(1e-3), np.log(1e-1), nh))
        layer["mamba"] = {
            "in_proj": linear(ks[0], cfg.mamba_inner + cdim + nh, h),
            "out_proj": linear(ks[1], h, cfg.mamba_inner),
            "conv_weight": dense(ks[2], (cdim, cfg.conv_kernel), "conv"),
            "conv_bias": jnp.zeros((cdim,), jnp.bfloat16),
            "A_log": jnp.log(jnp.arange(1, nh + 1, dtype=jnp.float32)).astype(jnp.bfloat16),
            "D": jnp.ones((nh,), jnp.bfloat16),
            "dt_bias": (dt + jnp.log(-jnp.expm1(-dt))).astype(jnp.bfloat16),
            "norm": jnp.ones((cfg.mamba_inner,), jnp.bfloat16)}
    elif kind == "*":
        nq = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        layer["self_attn"] = {"qkv_proj": linear(ks[0], nq, h),
                              "o_proj": linear(ks[1], h, cfg.num_heads * cfg.head_dim)}
    elif kind == "-":
        layer["mlp"] = {"up_proj": linear(ks[0], cfg.intermediate_size, h),
                        "down_proj": linear(ks[1], h, cfg.intermediate_size)}
    else:
        e, i = cfg.num_experts, cfg.moe_intermediate_size
        s = jnp.full((e,), input_scale, jnp.float32)
        routed = nn.MoE(dense(ks[2], (e, h), "router"), experts(ks[0], (e, i, h)),
                        experts(ks[1], (e, h, i)), s, s,
                        correction_bias=dense(ks[3], (e,), "bias"),
                        top_k=cfg.num_experts_per_tok, routing="sigmoid_bias", renormalize=True,
                        routed_scaling_factor=cfg.routed_scaling_factor, activation="relu2")
        m = cfg.moe_shared_expert_intermediate_size
        layer["moe"] = {"routed": routed,
                        "shared": {"up_proj": linear(ks[4], m, h),
                                   "down_proj": linear(ks[5], h, m)}}
    return layer


#: the benchmark's bf16 values by role: (binade exponent bits, dtype)
_NEMOTRON_DENSE = {"conv": (0x3E80, jnp.bfloat16), "router": (0x3E00, jnp.bfloat16),
                   "bias": (0x3D00, jnp.float32)}


def _nemotron_h_layer(key, kind: str, cfg) -> dict:
    """One random NVFP4 Nemotron-H layer of ``kind``: random codes and scales
    (``_nvfp4``), bf16 values of one binade (``_bf16``)."""
    def dense(k, shape, role):
        exponent, dtype = _NEMOTRON_DENSE[role]
        return _bf16(k, shape, exponent=exponent).astype(dtype)

    return nemotron_h_layer(jax.random.split(key, 8), kind, cfg,
                            lambda k, n, kk: _linear(k, n, kk, "nvfp4"), _nvfp4, dense)


def build_nemotron_h(cfg, seed: int = 0):
    """A random NVFP4 ``models.NemotronHModel`` of ``cfg`` (a ``NemotronHConfig``), unrolled
    (one layer dict per layer; ``.stacked()`` scans its repeated units), built on the device
    one layer at a time."""
    key = jax.random.key(seed)
    kl, ke, kh = jax.random.split(key, 3)
    build = {kind: jax.jit(functools.partial(_nemotron_h_layer, kind=kind, cfg=cfg))
             for kind in set(cfg.layer_types)}
    layers = [build[kind](k) for kind, k in
              zip(cfg.layer_types, jax.random.split(kl, cfg.num_layers))]
    embed = _bf16(ke, (cfg.vocab_size, cfg.hidden_size), exponent=0x3F00)
    head = _bf16(kh, (cfg.vocab_size, cfg.hidden_size))
    model = models.NemotronHModel(embed, layers, jnp.ones((cfg.hidden_size,), jnp.bfloat16),
                                  head, cfg)
    jax.block_until_ready(model)
    return model


# ------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------

def _nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


def _memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
            if k in stats}


def _cache(cfg, batch, context, steps):
    c = models.init_cache(cfg, batch, context + steps + 4)
    return dataclasses.replace(c, length=jnp.asarray(context, jnp.int32))


def time_decode(model, batch, context, steps, ablate=frozenset()):
    """Seconds per decode step: the median of 7 runs of ``steps`` steps, after one such run as
    a warm-up (a run of 32 steps at batch 1 lasts about 0.1 s: one host hiccup moves a single
    run by several per cent)."""
    cfg = model.config
    tok = jnp.arange(batch, dtype=jnp.int32) % cfg.vocab_size
    runs = []
    for r in range(8):
        cache = _cache(cfg, batch, context, steps)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        t = tok
        for _ in range(steps):
            logits, cache = models.decode_step(model, t, cache, ablate=ablate)
            t = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        t.block_until_ready()
        if r:
            runs.append((time.perf_counter() - t0) / steps)
        del cache
    return float(np.median(runs))


def time_prefill(model, tokens):
    cfg = model.config
    ids = (jnp.arange(tokens, dtype=jnp.int32) * 7919 % cfg.vocab_size)[None]
    runs = []
    for r in range(3):
        cache = models.init_cache(cfg, 1, tokens)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        logits, cache = models.prefill(model, ids, cache)
        logits.block_until_ready()
        if r:
            runs.append(time.perf_counter() - t0)
        del cache
    return float(np.median(runs))


def decode_read_bytes(model: Model, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight except the experts, the experts a step
    touches (at most ``batch * top_k`` per layer, all of them assumed distinct), the KV cache
    up to ``context`` and the embedding rows."""
    cfg = model.config
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(model.groups):
        keys = jax.tree_util.keystr(path)
        if ".fc1" in keys or ".fc2" in keys:
            share = min(batch * cfg.num_experts_per_tok, cfg.num_experts) / cfg.num_experts
            total += int(leaf.nbytes * share)
        else:
            total += leaf.nbytes
    total += _nbytes(model.norm) + _nbytes(model.lm_head)
    total += batch * cfg.hidden_size * 2
    total += 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * 2
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder ($OUT)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated subset")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--batches", default=None, help="decode batches (default 1,8,32; tiny 1,2)")
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens (default 2048)")
    ap.add_argument("--context", type=int, default=None, help="KV tokens at decode (1024)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32)")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--breakdown-bf16", action="store_true", help="also break down bf16 steps")
    ap.add_argument("--unrolled", action="store_true",
                    help="also time the NVFP4 batch-1 decode with unrolled (unstacked) layers "
                         "(compiles for minutes at full depth)")
    ap.add_argument("--unfused", action="store_true",
                    help="q/k/v and gate/up as separate linears (default: one fused GEMM each)")
    ap.add_argument("--layers", type=int, default=None,
                    help="override the models' layer count (e.g. 4: a quick look at per-layer costs)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--in-process", action="store_true",
                    help="run every model and precision in this process (what each child does)")
    ap.add_argument("--unrolled-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    shapes = TINY if args.tiny else SHAPES
    names = [m for m in args.models.split(",") if m]
    bad = [m for m in names if m not in shapes]
    precs = [p for p in args.precisions.split(",") if p]
    if bad or not names or set(precs) - set(PRECISIONS) or not precs:
        ap.error(f"--models: expected some of {list(shapes)}; --precisions: some of {PRECISIONS}")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers: expected a positive layer count, got {args.layers}")
    batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,8,32")).split(",")]
    os.makedirs(args.out, exist_ok=True)
    stem = "e2e-tiny" if args.tiny else "e2e-h200"
    path = os.path.join(args.out, stem + (f"-layers{args.layers}" if args.layers else "") + ".json")
    if not args.in_process:
        return run_children(args, names, precs, batches, path, t_start)
    prefill_n = args.prefill or (16 if args.tiny else 2048)
    context = args.context or (8 if args.tiny else 1024)
    steps = args.steps or (3 if args.tiny else 32)
    out = {**run_metadata(), "tiny": args.tiny, "backend": jax.default_backend(),
           "settings": {"batches": batches, "prefill": prefill_n, "context": context,
                        "steps": steps, "fused_projections": not args.unfused,
                        "layers": args.layers},
           "records": [], "skipped": []}
    out["hbm_copy_tbps"] = hbm_copy_tbps()

    def over(what):
        if time.perf_counter() - t_start > args.budget_s:
            out["skipped"].append(what)
            return True
        return False

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", file=sys.stderr, flush=True)

    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=2)

    shapes = {k: {**v, "num_layers": args.layers or v["num_layers"]} for k, v in shapes.items()}
    for name in names:
        cfg = config_of(shapes[name])
        for prec in ([] if args.unrolled_only else precs):
            if over(f"{name}/{prec}"):
                continue
            log(f"{name} {prec}: building random weights")
            model = build_model(cfg, prec, fuse=not args.unfused)
            base = {"model": name, "precision": prec}
            mem = {**base, "kind": "memory", "weight_bytes": _nbytes(model), **_memory()}
            out["records"].append(mem)
            for b in batches:
                if over(f"{name}/{prec}/decode b={b}"):
                    continue
                dt = time_decode(model, b, context, steps)
                rec = {**base, "kind": "decode", "batch": b, "context": context,
                       "ms_per_step": dt * 1e3, "tokens_per_s": b / dt,
                       "read_bytes": decode_read_bytes(model, b, context)}
                rec["read_tbps"] = rec["read_bytes"] / dt / 1e12
                rec["read_fraction_of_copy"] = rec["read_tbps"] / out["hbm_copy_tbps"]
                out["records"].append(rec)
                log(f"{name} {prec} decode b={b}: {rec['tokens_per_s']:.1f} tokens/s, "
                    f"{rec['read_tbps']:.2f} TB/s")
                save()
            if not over(f"{name}/{prec}/prefill"):
                dt = time_prefill(model, prefill_n)
                out["records"].append({**base, "kind": "prefill", "tokens": prefill_n,
                                       "ms": dt * 1e3, "tokens_per_s": prefill_n / dt})
                log(f"{name} {prec} prefill {prefill_n}: {prefill_n / dt:.0f} tokens/s")
            want_bd = not args.no_breakdown and (prec == "nvfp4" or args.breakdown_bf16)
            if want_bd and not over(f"{name}/{prec}/breakdown"):
                full = time_decode(model, 1, context, steps)
                parts = {"attention": "attention", "dense": "dense"}
                if cfg.moe_layers:
                    parts["moe"] = "moe"
                ms = {}
                for label, part in parts.items():
                    ms[label] = (full - time_decode(model, 1, context, steps,
                                                    frozenset({part}))) * 1e3
                ms["other"] = full * 1e3 - sum(ms.values())
                out["records"].append({**base, "kind": "breakdown", "batch": 1,
                                       "ms_per_step": full * 1e3, "ms": ms})
                log(f"{name} {prec} breakdown (ms): {ms}")
            mem["after_runs"] = _memory()  # peak_bytes_in_use: weights + caches + activations
            save()
            del model
            gc.collect()
    for name in names:  # last, as the least needed: unrolled layers compile longest
        if "nvfp4" not in precs or not args.unrolled or over(f"{name}/nvfp4/unrolled"):
            continue
        # lax.scan hands each layer a slice of the stacked weights; unrolled layers read their
        # own buffers: the difference shows what the scan costs (e.g. a copy per layer)
        model = build_model(config_of(shapes[name]), "nvfp4", fuse=not args.unfused).unstacked()
        dt = time_decode(model, 1, context, steps)
        out["records"].append({"model": name, "precision": "nvfp4", "kind": "decode_unrolled",
                               "batch": 1, "context": context, "ms_per_step": dt * 1e3,
                               "tokens_per_s": 1 / dt})
        log(f"{name} nvfp4 decode b=1, unrolled layers: {1 / dt:.1f} tokens/s")
        save()
        del model
        gc.collect()
    out["summary"] = summarize(out["records"], names, batches)
    out["wall_s"] = time.perf_counter() - t_start
    save()
    log(f"wrote {path}: {json.dumps(out['summary'])}")
    return 0


def summarize(records, names, batches) -> dict:
    """Per model: NVFP4 / bf16 decode tokens/s at each batch, the batch-1 read fraction."""
    summary = {}
    for name in names:
        rec = {(r["precision"], r.get("batch")): r for r in records
               if r["model"] == name and r["kind"] == "decode"}
        s = {}
        for b in batches:
            if ("nvfp4", b) in rec and ("bf16", b) in rec:
                s[f"decode_speedup_b{b}"] = (rec[("nvfp4", b)]["tokens_per_s"]
                                             / rec[("bf16", b)]["tokens_per_s"])
        if ("nvfp4", 1) in rec:
            s["nvfp4_b1_read_fraction_of_copy"] = rec[("nvfp4", 1)]["read_fraction_of_copy"]
        summary[name] = s
    return summary


def child_argv(args, name: str, prec: str | None, out: str, budget_s: float) -> list[str]:
    """The command line of the child that runs ``name`` in precision ``prec`` (None: its
    unrolled batch-1 decode) in a process of its own."""
    argv = ["--in-process", "--out", out, "--models", name, "--budget-s", f"{budget_s:.1f}"]
    argv += ["--precisions", prec] if prec else ["--precisions", "nvfp4", "--unrolled-only",
                                                 "--unrolled"]
    for flag in ("tiny", "no_breakdown", "breakdown_bf16", "unfused"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    for opt in ("batches", "prefill", "context", "steps", "layers"):
        if getattr(args, opt) is not None:
            argv += ["--" + opt, str(getattr(args, opt))]
    return argv


def run_children(args, names, precs, batches, path, t_start) -> int:
    """Each model and precision (then each model's unrolled decode) in a child process of this
    script with ``--in-process``, one after another within ``--budget-s``; their JSON merged
    into ``path`` (the first child's metadata, every child's records and skips, each record
    with its child's HBM copy rate)."""
    jobs = [(n, p) for n in names for p in precs]
    if args.unrolled and "nvfp4" in precs:
        jobs += [(n, None) for n in names]
    merged, skipped, copy = None, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, prec) in enumerate(jobs):
            label = f"{name}/{prec or 'nvfp4/unrolled'}"
            left = args.budget_s - (time.perf_counter() - t_start)
            if left <= 0:
                skipped.append(label)
                continue
            out = os.path.join(tmp, str(i))
            print(f"[{time.perf_counter() - t_start:7.1f} s] {label}: a process of its own",
                  file=sys.stderr, flush=True)
            r = subprocess.run([sys.executable, os.path.abspath(__file__),
                                *child_argv(args, name, prec, out, left)], check=False)
            child = os.path.join(out, os.path.basename(path))  # the same flags name it alike
            if r.returncode or not os.path.isfile(child):
                skipped.append(f"{label} (exit {r.returncode})")
                continue
            with open(child) as f:
                doc = json.load(f)
            if merged is None:
                merged = {k: v for k, v in doc.items() if k not in ("records", "skipped",
                                                                      "summary", "wall_s")}
                merged["records"] = []
            for rec in doc["records"]:
                rec["hbm_copy_tbps"] = doc["hbm_copy_tbps"]
            merged["records"] += doc["records"]
            skipped += doc["skipped"]
            copy.append(doc["hbm_copy_tbps"])
    if merged is None:
        print(f"e2e_bench: no child process produced results ({skipped})", file=sys.stderr)
        return 1
    merged["hbm_copy_tbps"] = float(np.median(copy))
    merged["processes"] = "one per model and precision (and per unrolled run)"
    merged["skipped"] = skipped
    merged["summary"] = summarize(merged["records"], names, batches)
    merged["wall_s"] = time.perf_counter() - t_start
    if not args.tiny:  # named by the GPU the children ran on ("e2e-h200", "e2e-h100-80gb-hbm3")
        path = os.path.join(os.path.dirname(path), os.path.basename(path).replace(
            "e2e-h200", "e2e-" + gpu_tag(merged.get("gpu") or "h200")))
    with open(path, "w") as f:
        json.dump(merged, f, indent=2)
    print(f"wrote {path}: {json.dumps(merged['summary'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
