"""NVFP4 GEMM benchmark on one GPU: ours (W4A16, W4A4) vs bf16 jnp.dot, scaled_matmul, XLA.

Usage (on the GPU machine):
    python bench/gemm_bench.py --out DIR                 # records -> DIR/gemm-h200.json + .png
    python bench/gemm_bench.py --tune --out DIR          # config sweep -> DIR/gemm-tune-h200.json
    python bench/gemm_bench.py --check --out DIR         # quick correctness on the GPU

Timing is in-graph: one jitted program runs ``R`` iterations of a ``fori_loop`` whose body
is an inner ``fori_loop`` of ``U`` rounds (a static trip count), each round calling the
implementation once per weight copy (``C`` distinct copies, together > 4x the 60 MB L2, so
every call streams its weights from HBM). The per-call time is
``(T(R2) - T(R1)) / ((R2 - R1) * U * C)``, host time of whole programs (medians of 3), so
dispatch and compile are excluded and back-to-back launch gaps are included, as in a real model.
Why the inner loop: ``R`` is a run-time value, and XLA:GPU runs a while loop of unknown trip
count by copying the predicate to the host and waiting for it every iteration (``WhileThunk``;
a loop of known trip count runs its body without that round trip). With one round per
iteration (``U = 1``) every call would carry 1/C of a host round trip (C = 2 at 28672x8192);
``U = ceil(64 / C)`` (``--inner-calls``) leaves 1/64 of it.
Each iteration's activation depends on the previous iteration's output (``x + 0*out[0]``), so
XLA can neither hoist nor merge the calls. Our NVFP4 calls each get their own activation
(``per_call_x``: ``x + 0*out[0]*(c+1)`` for copy c) where they prepare x in XLA (W4A16 on the
Mosaic path: pad and K permutation; W4A4: quantization), so that work runs once per call, as
with a model's distinct layers (shared, XLA would prepare x once for the C calls of an
iteration and leave a ~0.7-0.9 us prep out of every other call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
from run_meta import gpu_tag, run_metadata

import nvfp4_jax
from nvfp4_jax.gemm import api, configs
from nvfp4_jax.gemm.pallas_triton import Config, matmul_pallas

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]
MS = [1, 16, 64, 256, 1024, 4096]
L2_BYTES = 60e6
PEAK_TBPS = 4.8
PEAK_TFLOPS = 990.0


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- timing


#: calls per outer loop iteration, i.e. per host round trip of the loop predicate (see above)
INNER_CALLS = 64


def time_per_call(fn, x, ws, *, target_s: float = 0.03, per_call_x: bool = False) -> float:
    """Median per-call device time (s) of ``fn(x, w)`` over the weight copies ``ws``.

    ``per_call_x``: give each call its own activation (so XLA cannot share work done on x,
    e.g. the W4A4 activation quantization, between calls; the perturbation fuses into it).
    """
    return make_timer(fn, x, ws, target_s=target_s, per_call_x=per_call_x)()


def inner_rounds(copies: int, inner_calls: int | None = None) -> int:
    """Rounds over the ``copies`` weight copies per outer loop iteration: ``inner_calls``
    (default ``INNER_CALLS``) calls or more."""
    calls = INNER_CALLS if inner_calls is None else inner_calls
    if calls < 1:
        raise ValueError(f"inner_calls: expected >= 1, got {calls}")
    return -(-calls // copies)


def make_timer(fn, x, ws, *, target_s: float = 0.03, per_call_x: bool = False,
               inner_calls: int | None = None):
    """Compile once; return a callable that times one more round (see ``time_per_call``).

    Calling it several times, interleaved with other impls' timers, separates a real
    difference from the GPU's drift between rounds.
    ``inner_calls``: calls per host round trip of the outer loop (module docstring).
    """
    f = timed_program(fn, x, ws, per_call_x=per_call_x, inner_calls=inner_calls)
    rounds = f.rounds

    def run(r):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, ws, r))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    jax.block_until_ready(f(x, ws, 1))  # compile + warm

    def one_round() -> float:
        t1 = run(1)
        n = int(min(60, max(2, math.ceil(target_s / max(t1, 1e-6)))))
        t2 = run(1 + n)
        return max(t2 - t1, 1e-9) / (n * rounds * len(ws))

    return one_round


def timed_program(fn, x, ws, *, per_call_x: bool = False, inner_calls: int | None = None):
    """The jitted program ``make_timer`` times: ``f(x, ws, r)`` runs ``r`` (a run-time value)
    outer iterations of ``f.rounds`` rounds (a static inner loop) of one call per copy."""
    rounds = inner_rounds(len(ws), inner_calls)

    def prog(x, ws, r):
        def one_round(i, outs):
            # data dependency on the previous round (a float "* 0" is not folded by XLA)
            dep = outs[0].reshape(-1)[0].astype(jnp.float32) * 0.0
            if per_call_x:
                return tuple(fn(x + (dep * (c + 1)).astype(x.dtype), w) for c, w in enumerate(ws))
            xd = x + dep.astype(x.dtype)
            return tuple(fn(xd, w) for w in ws)

        def body(i, outs):  # static trip count: no host round trip between these rounds
            return jax.lax.fori_loop(0, rounds, one_round, outs)

        init = tuple(jax.eval_shape(fn, x, w) for w in ws)
        init = tuple(jnp.zeros(s.shape, s.dtype) for s in init)
        return jax.lax.fori_loop(0, r, body, init)

    f = jax.jit(prog)
    f.rounds = rounds
    return f


def n_copies(bytes_per_copy: float) -> int:
    return int(min(16, max(2, math.ceil(4 * L2_BYTES / bytes_per_copy))))


# --------------------------------------------------------------------------- data


def make_weights(n, k, copies, seed=0):
    """``copies`` distinct NVFP4 weights [N, K] (random bytes, scales spread over 2^-9..2^2)."""
    key = jax.random.PRNGKey(seed)
    out = []
    for c in range(copies):
        k1, k2, key = jax.random.split(key, 3)
        codes = jax.random.randint(k1, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        # E4M3 bytes 0x08..0x47 (2^-6..2^1 normal range plus a few subnormal-edge values)
        sb = jax.random.randint(k2, (n, k // 16), 0x04, 0x48, jnp.int32).astype(jnp.uint8)
        scales = jax.lax.bitcast_convert_type(sb, jnp.float8_e4m3fn)
        out.append(nvfp4_jax.NVFP4Array(codes, scales, jnp.float32(1.0 / 2688), (n, k), "linear"))
    return out


def make_x(m, k, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (m, k), jnp.float32).astype(jnp.bfloat16)


# --------------------------------------------------------------------------- impls


def impl_ours_w4a16(cfg=None, backend="pallas"):
    def fn(x, w):
        return nvfp4_jax.gemm.matmul(x, w, backend=backend, config=cfg)

    return fn


def impl_ours_w4a4(cfg=None, backend="pallas"):
    def fn(x, w):
        return nvfp4_jax.gemm.matmul(
            x, w, input_scale=jnp.float32(0.01), backend=backend, config=cfg
        )

    return fn


def auto_backend(m, n, k):
    """The backend nvfp4_jax.gemm.matmul(backend="auto") runs for a bf16 [m, k] x [n, k]^T."""
    return api.auto_impl(m, n, k)


def backend_config(backend, m, n, k):
    from nvfp4_jax.gemm import mosaic

    if backend == "mosaic":
        from nvfp4_jax.device import gpu_compute_capability

        return mosaic.config_for(m, n, k, gpu_compute_capability()).__dict__
    if backend == "xla":
        return None
    return configs.get_config(m, n, k).__dict__


def impl_xla_dequant_dot(x, w):
    wd = nvfp4_jax.dequantize(w, jnp.bfloat16)  # LUT decode, fused by XLA
    return jnp.dot(x, wd.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def impl_bf16_dot(x, wb):
    return jnp.dot(x, wb.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def impl_scaled_matmul(x, xq_and_w, w):
    xq, xs = xq_and_w
    wq, ws = w
    # tie the (pre-quantized) activation to the loop counter carried in x: a tiny op on scales
    xs = (xs.astype(jnp.float32) + x[0, 0].astype(jnp.float32) * 0).astype(xs.dtype)
    out = jax.nn.scaled_matmul(
        xq[None], wq[None], xs[None], ws[None], preferred_element_type=jnp.bfloat16
    )
    return out[0]


def nvfp4_bytes(n, k):
    return n * k * 0.5625


def record(impl, n, k, m, t, wbytes, extra=None):
    xbytes = m * k * 2
    obytes = m * n * 2
    rec = {
        "impl": impl,
        "N": n,
        "K": k,
        "M": m,
        "median_us": t * 1e6,
        "tbps": (wbytes + xbytes + obytes) / t / 1e12,
        "weight_tbps": wbytes / t / 1e12,
        "tflops": 2.0 * m * n * k / t / 1e12,
    }
    if extra:
        rec.update(extra)
    return rec


# --------------------------------------------------------------------------- correctness


def check(out_dir):
    """GPU correctness smoke test: exhaustive decode and ragged GEMMs vs the oracle."""
    import oracle
    from nvfp4_jax.gemm.pallas_triton import dequantize_pallas

    res = {}
    rng = np.random.default_rng(0)
    # every byte value x every scale byte (incl. subnormal scales), asm and bits
    codes = np.tile(np.arange(256, dtype=np.uint8), (128, 1))  # [128, 256] -> K = 512
    sb = np.arange(1, 127, dtype=np.uint8)  # all finite positive E4M3 (skip 0x7F NaN)
    scales = np.resize(sb, (128, 32)).astype(np.uint8)
    t = oracle.NVFP4(codes, scales, np.float64(1.0))
    ref = oracle.dequantize(t, include_decode_scale=False)
    for mode in ("asm", "asmm", "asm2m", "asm16", "bits"):
        wd = dequantize_pallas(jnp.asarray(codes), jnp.asarray(scales), config=Config(decode=mode))
        res[f"dequant_exhaustive_{mode}"] = bool(np.array_equal(np.asarray(wd, np.float64), ref))
    for m, n, k in [(1, 200, 528), (37, 130, 4112), (300, 333, 1040)]:
        x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
        xb = jnp.asarray(x).astype(jnp.bfloat16)
        wf = rng.standard_normal((n, k)) * np.exp(rng.uniform(-4, 4, (n, k // 16))).repeat(16, 1)
        wo = oracle.quantize(wf.astype(np.float32), "trtllm")
        ref = oracle.gemm_w4a16(np.asarray(xb, np.float64), wo)
        bound = oracle.gemm_error_bound(
            np.abs(np.asarray(xb, np.float64)),
            np.abs(oracle.dequantize(wo, include_decode_scale=False)),
            float(wo.decode_scale),
            ref,
            out_u=2.0**-24,
            splits=8,
        )
        for cfg in [
            Config(block_k=256, split_k=4),
            Config(block_m=32, block_n=128, block_k=128, load2d=True),
            Config(block_m=64, block_n=64, block_k=64, decode="bits", split_k=2),
            Config(block_m=16, block_n=64, block_k=256, decode="asm16", load2d=True),
            Config(block_m=16, block_n=128, block_k=128, decode="asm2m", load2d=True),
            Config(block_m=16, block_n=128, block_k=128, decode="asmm", load2d=True),
        ]:
            out = matmul_pallas(
                xb,
                jnp.asarray(wo.codes),
                jnp.asarray(wo.scales),
                np.float32(wo.decode_scale),
                out_dtype=jnp.float32,
                config=cfg,
            )
            out = np.asarray(out, np.float64)
            ok = bool(np.all(np.isfinite(out)) and np.all(np.abs(out - ref) <= bound))
            res[
                f"gemm_{m}x{n}x{k}_{cfg.block_m}_{cfg.block_n}_{cfg.block_k}_{cfg.decode}"
                f"_{int(cfg.load2d)}"
            ] = ok
    log(json.dumps(res, indent=1))
    with open(os.path.join(out_dir, "gemm-check-h200.json"), "w") as f:
        json.dump(res, f, indent=1)
    return all(res.values())


# --------------------------------------------------------------------------- tuning


def split_for(n, k, bn, bk, target_ctas=264):
    tiles = -(-n // bn)
    kt = -(-k // bk)
    s = 1
    while tiles * s < target_ctas and s * 2 <= kt // 2:
        s *= 2
    return s


def candidates(m, n, k):
    """Sweep space per M bucket of ``--tune`` (Pallas-Triton configs)."""
    C = Config
    if m <= 16:
        c = [C(16, 64, 256, 1, 4, 4, decode="asm16", load2d=True)]
        for bn, bk, w, st in [
            (64, 256, 4, 4),
            (128, 256, 4, 4),
            (128, 256, 8, 4),
            (64, 512, 4, 4),
            (64, 128, 4, 4),
            (32, 256, 4, 4),
            (64, 256, 4, 3),
            (128, 128, 4, 4),
            (256, 128, 8, 3),
        ]:
            for split in sorted({1, split_for(n, k, bn, bk)}):
                c.append(C(16, bn, bk, split, w, st, load2d=True))
        return c
    if m <= 64:
        return [
            C(64, 64, 256, 1, 4, 4, load2d=True),
            C(64, 128, 256, 1, 8, 3, load2d=True),
            C(64, 64, 128, 1, 4, 4, load2d=True),
            C(32, 64, 256, 1, 4, 4, load2d=True),
            C(64, 128, 128, 1, 4, 4, load2d=True),
            C(64, 128, 256, 1, 8, 4, load2d=True),
        ]
    if m <= 256:
        return [
            C(128, 64, 128, 1, 4, 3, load2d=True),
            C(128, 128, 64, 1, 8, 3, load2d=True),
            C(64, 128, 128, 1, 4, 3, load2d=True),
            C(128, 128, 128, 1, 8, 3, load2d=True),
            C(128, 128, 64, 1, 8, 3, algo="dequant_dot"),
        ]
    return [
        C(128, 128, 64, 1, 8, 3, load2d=True),
        C(128, 256, 64, 1, 8, 3, load2d=True),
        C(128, 128, 64, 1, 8, 3, algo="dequant_dot"),
    ]


def tune(out_dir, shapes, ms, budget_s, prev_rows=()):
    t_start = time.time()
    rows = list(prev_rows)
    n_prev = len(rows)
    path = os.path.join(out_dir, "gemm-tune-h200.json")
    for n, k in shapes:
        copies = n_copies(nvfp4_bytes(n, k))
        ws = make_weights(n, k, copies)
        for m in ms:
            x = make_x(m, k)
            for cfg in candidates(m, n, k):
                if time.time() - t_start > budget_s:
                    log("tune: budget exhausted")
                    break
                try:
                    t = time_per_call(impl_ours_w4a16(cfg), x, ws, target_s=0.01)
                    row = {
                        "N": n,
                        "K": k,
                        "M": m,
                        "config": cfg.__dict__,
                        "median_us": t * 1e6,
                        "weight_tbps": nvfp4_bytes(n, k) / t / 1e12,
                    }
                except Exception as e:  # noqa: BLE001 - record and continue the sweep
                    row = {"N": n, "K": k, "M": m, "config": cfg.__dict__, "error": repr(e)[:300]}
                rows.append(row)
                log(json.dumps(row))
                with open(path, "w") as f:
                    json.dump(rows, f)
            del x
        del ws
    return rows[n_prev:]


# --------------------------------------------------------------------------- candidates

#: ``--candidates``: the issue-31 shapes and token counts (M <= 16 and M = 64 buckets)
CAND_SHAPES = [(28672, 8192), (4096, 14336), (14336, 4096)]
CAND_MS = [1, 16, 64]


def sweep_candidates(m, n, k) -> list[tuple[str, Config]]:
    """(label, Config) timed by ``--candidates`` at one shape: the library's sm_90 and sm_12x
    table entries, the sm_90 entry with the ``asm2m`` decode where it has another, and tiles
    around the sm_90 winner (BK 256-512: BK 128 tiles ran 1.6-1.8x slower at M = 1 and 16,
    gemm-candidates-h200.json of 2026-12-01/02), with more resident warps (8) or deeper
    pipelines."""
    import dataclasses

    lib = configs.get_config(m, n, k, family="sm90")
    out = [("sm90_table", lib), ("sm12x_table", configs.get_config(m, n, k, family="sm12x"))]
    if lib.algo == "fused" and lib.decode != "asm2m":
        out.append(("sm90_table_asm2m", dataclasses.replace(lib, decode="asm2m", measured="")))
    if m <= 16:
        tiles = [(128, 256, 8, 4), (64, 512, 4, 3), (128, 512, 8, 3), (64, 256, 4, 4),
                 (64, 512, 8, 4)]
        # split-K up to 8 (the XLA sum of [split_k, M, N] fp32 partials grows with it)
        out += [(f"m16_n{bn}_k{bk}_w{w}_st{st}_asm2m",
                 Config(16, bn, bk, min(8, split_for(n, k, bn, bk)), w, st, decode="asm2m",
                        load2d=True))
                for bn, bk, w, st in tiles]
    elif m <= 64:
        tiles = [(128, 128, 8, 3), (64, 128, 4, 3), (64, 256, 4, 3), (128, 256, 8, 3)]
        out += [(f"m64_n{bn}_k{bk}_w{w}_st{st}_asm2m",
                 Config(64, bn, bk, 1, w, st, decode="asm2m", load2d=True))
                for bn, bk, w, st in tiles]
    return out


def all_sweep_candidates() -> list[tuple[str, Config]]:
    """Every (label, Config) ``--candidates`` times, over CAND_SHAPES x CAND_MS."""
    return [(f"{label}@{m}x{n}x{k}", c) for n, k in CAND_SHAPES for m in CAND_MS
            for label, c in sweep_candidates(m, n, k)]


def candidates_sweep(out_path, shapes, ms, budget_s, repeats=3, target_s=0.01, candidates=None):
    """Time ``sweep_candidates`` and bf16 ``jnp.dot`` per shape and M, interleaved: every
    timer is compiled first, then ``repeats`` rounds run each timer once in turn (the GPU's
    drift hits all alike); records the median and every round. Compiles stop when
    ``budget_s`` is spent (the compiled ones still run). Writes ``out_path`` after each M.
    ``candidates(m, n, k)``: other (label, config, fn(x, w)) to time instead, ``config`` a
    dataclass of NVFP4 tiles (default: ``sweep_candidates`` through ``impl_ours_w4a16``)."""
    t0 = time.time()
    meta = run_metadata()
    doc = {**meta, "timing": "in-graph, interleaved rounds (make_timer)", "repeats": repeats,
           "records": []}
    if candidates is None:
        def candidates(m, n, k):
            return [(label, cfg, impl_ours_w4a16(cfg)) for label, cfg in sweep_candidates(m, n, k)]
    for n, k in shapes:
        ws = make_weights(n, k, n_copies(nvfp4_bytes(n, k)))
        cb = n_copies(2 * n * k)
        wb = [nvfp4_jax.dequantize(w, jnp.bfloat16) for w in ws[:cb]]
        wb += [wb[i % len(wb)] * jnp.bfloat16(1 + i) for i in range(len(wb), cb)]
        for m in ms:
            x = make_x(m, k)
            timers = [("bf16_dot", None, make_timer(impl_bf16_dot, x, wb, target_s=target_s))]
            for label, cfg, fn in candidates(m, n, k):
                if time.time() - t0 > budget_s:
                    log(f"candidates: budget spent, {label} at {m}x{n}x{k} not compiled")
                    doc["records"].append({"N": n, "K": k, "M": m, "label": label,
                                           "skipped": "budget"})
                    continue
                try:
                    timers.append((label, cfg, make_timer(fn, x, ws, target_s=target_s)))
                except Exception as e:  # noqa: BLE001 - record and go on with the others
                    doc["records"].append({"N": n, "K": k, "M": m, "label": label,
                                           "config": cfg.__dict__, "error": repr(e)[:300]})
            samples = {label: [] for label, _, _ in timers}
            for _ in range(repeats):
                for label, _, timer in timers:
                    samples[label].append(timer() * 1e6)
            bf16_us = float(np.median(samples["bf16_dot"]))
            for label, cfg, _ in timers:
                us = float(np.median(samples[label]))
                rec = {"N": n, "K": k, "M": m, "label": label, "median_us": us,
                       "rounds_us": samples[label], "x_bf16": bf16_us / us,
                       "weight_tbps": (2 * n * k if cfg is None else nvfp4_bytes(n, k)) / us
                       / 1e6}
                if cfg is not None:
                    rec["config"] = cfg.__dict__
                doc["records"].append(rec)
                log(json.dumps({kk: v for kk, v in rec.items() if kk != "config"}))
            with open(out_path, "w") as f:
                json.dump(doc, f, indent=1)
            del x
        del ws, wb
    return doc


def candidates_table(doc) -> str:
    """Per shape and M: each candidate's median us and x bf16, best first."""
    lines = ["N K M | label | us | x bf16"]
    by = {}
    for r in doc["records"]:
        if "median_us" in r:
            by.setdefault((r["N"], r["K"], r["M"]), []).append(r)
    for key, rs in by.items():
        for r in sorted(rs, key=lambda r: r["median_us"]):
            lines.append(f"{key[0]} {key[1]} {key[2]} | {r['label']} | {r['median_us']:.1f} | "
                         f"{r['x_bf16']:.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- benchmark


#: impls timed by default (``nvfp4_w4a16`` / ``nvfp4_w4a4``: ``backend="auto"``, the Hopper
#: path on an H200: the Mosaic kernel where ``mosaic.AUTO_SM90`` lists the bucket, else
#: Pallas-Triton; the record says which ran)
DEFAULT_IMPLS = ("nvfp4_w4a16", "nvfp4_w4a4", "bf16_dot", "xla_dequant_dot", "scaled_matmul")
#: explicit backends, ``nvfp4_<w4a16|w4a4>_<backend>`` (``backend=`` of ``nvfp4_jax.matmul``)
EXTRA_IMPLS = ("nvfp4_w4a16_mosaic", "nvfp4_w4a16_pallas", "nvfp4_w4a4_mosaic", "nvfp4_w4a4_pallas")
ALL_IMPLS = DEFAULT_IMPLS + EXTRA_IMPLS

#: ``--proxy``: the SM12x path (Pallas-Triton, ``backend="pallas"``: what RTX 50xx and DGX Spark
#: run) measured on this GPU side by side with bf16 cuBLAS and the Hopper path (``auto``)
PROXY_IMPLS = ("nvfp4_w4a16_pallas", "nvfp4_w4a4_pallas", "nvfp4_w4a16", "bf16_dot")
PROXY_SHAPES = [(28672, 8192), (4096, 14336), (14336, 4096)]
PROXY_MS = [1, 16, 64, 256, 1024, 4096]
#: ``--tiny``: a CPU smoke run of the harness (Pallas in interpret mode; nothing is timed
#: that means anything)
TINY_SHAPES = [(256, 256)]
TINY_MS = [1, 16]


def impl_backend(name: str) -> str:
    """The ``backend=`` an ``nvfp4_*`` impl name asks ``nvfp4_jax.matmul`` for."""
    parts = name.split("_")
    return parts[2] if len(parts) == 3 else "auto"


def plan(shapes, ms, impls, skip=frozenset()) -> list[dict]:
    """The rows ``bench`` measures, in order (``--dry-run`` prints them); ``skip``: (impl, N,
    K, M) keys already measured (``--resume``)."""
    rows = []
    for n, k in shapes:
        for m in ms:
            for name in impls:
                if (name, n, k, m) in skip:
                    continue
                row = {"impl": name, "N": n, "K": k, "M": m}
                if name.startswith("nvfp4"):
                    row["backend_requested"] = impl_backend(name)
                rows.append(row)
    return rows


def bench(out_dir, shapes, ms, budget_s, extra_impls=(), impls=None, on_record=None,
          skip=frozenset()):
    """Time ``impls`` (default ``DEFAULT_IMPLS``, then ``extra_impls``) per shape and M;
    ``on_record(records)`` after each one (to save partial runs); ``skip``: (impl, N, K, M)
    keys already measured (``--resume``: no weights built, nothing compiled for them)."""
    impls_wanted = list(impls if impls is not None else DEFAULT_IMPLS) + [
        v for v in extra_impls if impls is None or v not in impls]
    t_start = time.time()
    records = []
    for n, k in shapes:
        if not plan([(n, k)], ms, impls_wanted, skip):
            continue
        if time.time() - t_start > budget_s:
            log("bench: budget exhausted")
            break
        c4 = n_copies(nvfp4_bytes(n, k))
        ws = make_weights(n, k, c4)
        cb = n_copies(2 * n * k)
        wb = [nvfp4_jax.dequantize(w, jnp.bfloat16) for w in ws[:cb]]
        wb += [wb[i % len(wb)] * jnp.bfloat16(1 + i) for i in range(len(wb), cb)]
        # scaled_matmul operands: NVFP4 as (float4_e2m1fn values, e4m3 scales [*, K/16])
        has_f4 = hasattr(jnp, "float4_e2m1fn") and "scaled_matmul" in impls_wanted
        wsm = []
        for w in ws[: max(2, c4 // 2)] if has_f4 else []:
            wv = nvfp4_jax.dequantize(w, jnp.float32, include_decode_scale=False)
            s = w.scales.astype(jnp.float32)
            wf4 = jnp.where(s[..., None] > 0, wv.reshape(n, k // 16, 16) / s[..., None], 0)
            wsm.append((wf4.reshape(n, k).astype(jnp.float4_e2m1fn), w.scales))
        for m in ms:
            if time.time() - t_start > budget_s:
                log("bench: budget exhausted")
                break
            if not plan([(n, k)], [m], impls_wanted, skip):
                continue
            x = make_x(m, k)
            auto = auto_backend(m, n, k)
            impls = []
            for name in impls_wanted:
                if (name, n, k, m) in skip:
                    continue
                if name.startswith("nvfp4"):  # nvfp4_w4a16 / nvfp4_w4a4 [_backend]
                    make = impl_ours_w4a4 if "_w4a4" in name else impl_ours_w4a16
                    impls.append((name, make(backend=impl_backend(name)), x, ws, nvfp4_bytes(n, k)))
                elif name == "bf16_dot":
                    impls.append((name, impl_bf16_dot, x, wb, 2 * n * k))
                elif name == "xla_dequant_dot":
                    impls.append((name, impl_xla_dequant_dot, x, ws[: max(2, c4 // 2)],
                                  nvfp4_bytes(n, k)))
            if has_f4 and ("scaled_matmul", n, k, m) not in skip:
                xq = nvfp4_jax.quantize(x, "trtllm")
                xv = nvfp4_jax.dequantize(xq, jnp.float32, include_decode_scale=False)
                xf4 = (xv / jnp.repeat(xq.scales.astype(jnp.float32), 16, -1)).astype(
                    jnp.float4_e2m1fn
                )
                impls.append(
                    (
                        "scaled_matmul",
                        lambda xx, w, _xq=(xf4, xq.scales): impl_scaled_matmul(xx, _xq, w),
                        x,
                        wsm,
                        nvfp4_bytes(n, k),
                    )
                )
            for name, fn, xx, wlist, wbytes in impls:
                try:
                    # own x per call where the call prepares x in XLA (W4A4 quantization, the
                    # Mosaic path's pad and permutation; the perturbation fuses into it); a
                    # cuBLAS or Pallas-Triton call reads x as it is: nothing to share, and a
                    # perturbation there would be a pass over x of its own
                    t = time_per_call(fn, xx, wlist, per_call_x="_w4a4" in name or (
                        name.startswith("nvfp4") and (name.endswith("mosaic") or auto == "mosaic")))
                    extra = None
                    if name.startswith("nvfp4"):
                        be = auto if impl_backend(name) == "auto" else impl_backend(name)
                        if be == "mosaic":  # the api falls back to pallas where it must (logged)
                            be = api._pick_mosaic("mosaic", "mosaic", m, n, k, jnp.bfloat16)
                        extra = {"backend": be, "config": backend_config(be, m, n, k)}
                    rec = record(name, n, k, m, t, wbytes, extra)
                except Exception as e:  # noqa: BLE001
                    rec = {"impl": name, "N": n, "K": k, "M": m, "error": repr(e)[:300]}
                records.append(rec)
                log(json.dumps(rec))
                if on_record is not None:
                    on_record(records)
            del x
        del ws, wb, wsm
    return records


#: ``--quantize-division``: activation sizes (M, K) and recipes (``trtllm``: one division per
#: 16-value block; ``modelopt``: one per element)
QDIV_SIZES = [(1, 4096), (16, 8192), (256, 8192), (4096, 8192), (4096, 14336)]
QDIV_RECIPES = ("trtllm", "modelopt")


def plain_divide(a, b):
    """XLA's own fp32 division (``div.full.f32`` on an NVIDIA GPU without the IEEE flag: not
    correctly rounded), for ``quantize_division`` only."""
    return jnp.asarray(a, jnp.float32) / jnp.asarray(b, jnp.float32)


def quantize_division(sizes, recipes) -> list[dict]:
    """Per-call time of ``nvfp4_jax.quantize`` with its exact division (``division.divide``,
    integer long division on a GPU) against the same recipe traced with XLA's plain division
    (``plain_divide`` in place of ``division.divide``): what exactness costs."""
    from nvfp4_jax import division

    exact = division.divide
    records = []
    for m, k in sizes:
        copies = n_copies(2 * m * k)
        xs = [make_x(m, k, seed=10 + c) for c in range(copies)]
        for recipe in recipes:
            for impl, div in (("quantize_exact_div", exact), ("quantize_xla_div", plain_divide)):
                division.divide = div  # read at trace time by nvfp4_jax.quantize
                try:
                    t = time_per_call(lambda xd, xc, r=recipe: nvfp4_jax.quantize(
                        xc + xd[:1, :1] * 0, r).codes, xs[0], xs)
                    rec = {"impl": impl, "recipe": recipe, "M": m, "K": k, "median_us": t * 1e6,
                           "gbps": (2 * m * k + m * k * 9 / 16) / t / 1e9}
                except Exception as e:  # noqa: BLE001 - record and keep going
                    rec = {"impl": impl, "recipe": recipe, "M": m, "K": k, "error": repr(e)[:300]}
                finally:
                    division.divide = exact
                records.append(rec)
                log(json.dumps(rec))
    return records


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["N"], r["K"]) for r in records})
    impls = sorted({r["impl"] for r in records})
    fig, axes = plt.subplots(2, len(shapes), figsize=(5 * len(shapes), 8), squeeze=False)
    for j, (n, k) in enumerate(shapes):
        for impl in impls:
            rs = sorted(
                [
                    r
                    for r in records
                    if r["impl"] == impl and (r["N"], r["K"]) == (n, k) and "median_us" in r
                ],
                key=lambda r: r["M"],
            )
            if not rs:
                continue
            axes[0, j].plot([r["M"] for r in rs], [r["tbps"] for r in rs], "o-", label=impl)
            axes[1, j].plot([r["M"] for r in rs], [r["tflops"] for r in rs], "o-", label=impl)
        axes[0, j].axhline(PEAK_TBPS, color="k", ls="--", label="HBM 4.8 TB/s")
        axes[1, j].axhline(PEAK_TFLOPS, color="k", ls="--", label="bf16 990 TFLOP/s")
        mm = np.array(MS, float)
        axes[1, j].plot(
            mm,
            np.minimum(
                PEAK_TFLOPS,
                2 * mm * n * k * PEAK_TBPS * 1e12 / (nvfp4_bytes(n, k) + 2 * mm * (n + k)) / 1e12,
            ),
            "k:",
            label="NVFP4 roofline",
        )
        for i in range(2):
            axes[i, j].set_xscale("log", base=2)
            axes[i, j].set_xlabel("M")
            axes[i, j].set_title(f"N={n} K={k}")
        axes[1, j].set_yscale("log")
        axes[0, j].set_ylabel("achieved TB/s (bytes moved / time)")
        axes[1, j].set_ylabel("TFLOP/s")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--budget-s", type=float, default=200)
    p.add_argument("--shapes", default="")
    p.add_argument("--ms", default="")
    p.add_argument("--plan", default="", help="tune plan 'NxK:m1,m2;NxK:m3' (overrides shapes/ms)")
    p.add_argument(
        "--then-bench",
        action="store_true",
        help="after --tune, put the best configs into configs.TUNED and run the bench",
    )
    p.add_argument("--bench-budget-s", type=float, default=150)
    p.add_argument(
        "--impls",
        default="",
        help=f"extra comma-separated impls timed side by side: {','.join(EXTRA_IMPLS)} "
        "(with --proxy or --only: the impls, from all of " + ",".join(ALL_IMPLS) + ")",
    )
    p.add_argument("--only", action="store_true",
                   help="time only the --impls (not the default set)")
    p.add_argument(
        "--proxy",
        action="store_true",
        help="the SM12x-proxy rows: Pallas-Triton W4A16/W4A4 (backend='pallas'), the Hopper "
        f"path (auto) and bf16 jnp.dot ({','.join(PROXY_IMPLS)}) on "
        + ",".join(f"{n}x{k}" for n, k in PROXY_SHAPES)
        + f", M = {','.join(map(str, PROXY_MS))} -> OUT/gemm-proxy-<gpu>.json",
    )
    p.add_argument(
        "--candidates",
        action="store_true",
        help="time sweep_candidates (decode/tile candidates, both GPU families' tables) against "
        "bf16 jnp.dot, interleaved, on " + ",".join(f"{n}x{k}" for n, k in CAND_SHAPES)
        + f", M = {','.join(map(str, CAND_MS))} (--budget-s caps compiles) -> "
        "OUT/gemm-candidates-<gpu>.json",
    )
    p.add_argument("--repeats", type=int, default=3, help="--candidates: interleaved rounds")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: a 256x256 weight, M = 1, 16 (times mean nothing)")
    p.add_argument("--quantize-division", action="store_true",
                   help="time nvfp4_jax.quantize with its exact division vs XLA's plain one "
                        f"({','.join(QDIV_RECIPES)}; M x K = "
                        + ",".join(f"{m}x{k}" for m, k in QDIV_SIZES)
                        + ") -> OUT/quantize-division-<gpu>.json")
    p.add_argument("--resume", default="", metavar="PATH",
                   help="skip the rows this results JSON (a directory: its file of this run's "
                        "name, e.g. bench/results) already measured; merge_results.py merges")
    p.add_argument("--dry-run", action="store_true",
                   help="print the rows that would be measured (JSON lines) and exit")
    p.add_argument("--inner-calls", type=int, default=INNER_CALLS,
                   help="calls per outer loop iteration (host round trip); 1: one round per iteration")
    a = p.parse_args()
    globals()["INNER_CALLS"] = a.inner_calls
    extra = [v for v in a.impls.split(",") if v]
    for v in extra:
        allowed = ALL_IMPLS if (a.proxy or a.only) else EXTRA_IMPLS
        if v not in allowed:
            p.error(f"--impls: expected names from {allowed}, got {v!r}")
    if a.only and not extra:
        p.error("--only: name the impls with --impls")
    default_shapes, default_ms = (PROXY_SHAPES, PROXY_MS) if a.proxy else (SHAPES, MS)
    if a.tiny:
        default_shapes, default_ms = TINY_SHAPES, TINY_MS
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    shapes = shapes or default_shapes
    ms = [int(v) for v in a.ms.split(",") if v] or default_ms
    impls = None  # DEFAULT_IMPLS + extra
    if a.proxy or a.only:
        impls, extra = (extra or list(PROXY_IMPLS)), []
    if a.candidates:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
        ms = [int(v) for v in a.ms.split(",") if v]
        if a.tiny:
            shapes, ms = shapes or TINY_SHAPES, ms or TINY_MS
        shapes, ms = shapes or CAND_SHAPES, ms or CAND_MS
        if a.dry_run:
            for n, k in shapes:
                for m in ms:
                    for label, c in sweep_candidates(m, n, k):
                        log(json.dumps({"N": n, "K": k, "M": m, "label": label,
                                        "config": c.__dict__}))
            return
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"gemm-candidates-{gpu_tag(run_metadata()['gpu'])}.json")
        doc = candidates_sweep(path, shapes, ms, a.budget_s, repeats=a.repeats,
                               target_s=0.001 if a.tiny else 0.01)
        log("wrote", path)
        log(candidates_table(doc))
        return
    skip = frozenset()
    if a.resume:
        from merge_results import measured

        tag = gpu_tag(jax.devices()[0].device_kind)
        stem = f"gemm-proxy-{tag}" if a.proxy else "gemm-h200"
        skip = frozenset(measured("gemm", a.resume, stem))
    if a.dry_run:
        for row in plan(shapes, ms, list(impls if impls is not None else DEFAULT_IMPLS) + extra,
                        skip):
            log(json.dumps(row))
        return
    os.makedirs(a.out, exist_ok=True)
    dev = jax.devices()[0]
    log("device:", dev.device_kind, "jax", jax.__version__)
    if a.check:
        check(a.out)
    if a.quantize_division:
        meta = run_metadata()
        sizes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
        doc = {**meta, "timing": "in-graph fori_loop as the GEMM rows; codes returned",
               "records": quantize_division(sizes or QDIV_SIZES, QDIV_RECIPES)}
        path = os.path.join(a.out, f"quantize-division-{gpu_tag(meta['gpu'])}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        log("wrote", path)
        return
    if a.tune:
        if a.plan:
            t0 = time.time()
            rows = []
            for part in a.plan.split(";"):
                shp, mss = part.split(":")
                left = a.budget_s - (time.time() - t0)
                rows += tune(
                    a.out,
                    [tuple(int(v) for v in shp.split("x"))],
                    [int(v) for v in mss.split(",")],
                    left,
                    rows,
                )
        else:
            rows = tune(a.out, shapes, ms, a.budget_s)
        if not a.then_bench:
            return
        best = {}
        for r in rows:
            if "median_us" not in r:
                continue
            key = (configs.m_bucket(r["M"]), r["N"], r["K"])
            if key not in best or r["median_us"] < best[key][0]:
                best[key] = (r["median_us"], Config(**r["config"]))
        configs.TUNED.update({k: v[1] for k, v in best.items()})
        log("TUNED =", {k: v[1] for k, v in best.items()})
        a.budget_s = a.bench_budget_s
    if a.check:
        return
    meta = run_metadata()
    stem = "gemm-proxy-" + gpu_tag(meta["gpu"]) if a.proxy else "gemm-h200"
    if a.tiny:
        stem = "gemm-tiny-" + gpu_tag(meta["gpu"])

    def save(records):
        doc = {
            **meta,
            "timing": "in-graph fori_loop over distinct weight copies, (T(R2)-T(R1))/calls, "
                      f"{INNER_CALLS}+ calls per host round trip of the loop predicate",
            "records": records,
        }
        with open(os.path.join(a.out, stem + ".json"), "w") as f:
            json.dump(doc, f, indent=1)
        return doc

    records = bench(a.out, shapes, ms, a.budget_s, extra, impls, on_record=save, skip=skip)
    doc = save(records)
    log("wrote", os.path.join(a.out, stem + ".json"))
    if a.proxy or a.tiny:
        from tables import proxy_gemm

        log(proxy_gemm(doc))
        return
    plot(records, os.path.join(a.out, "gemm-h200.png"))
    # short table last: ratio vs bf16 per shape / M
    by = {(r["impl"], r["N"], r["K"], r["M"]): r.get("median_us") for r in records}
    log("N K M | w4a16 us | w4a4 us | bf16 us | x bf16 (w4a16) | scaled_mm us | xla us")
    for n, k in shapes:
        for m in ms:
            b = by.get(("bf16_dot", n, k, m))
            o = by.get(("nvfp4_w4a16", n, k, m))
            log(
                n,
                k,
                m,
                o and round(o, 1),
                by.get(("nvfp4_w4a4", n, k, m)) and round(by[("nvfp4_w4a4", n, k, m)], 1),
                b and round(b, 1),
                (b and o) and round(b / o, 2),
                by.get(("scaled_matmul", n, k, m)),
                by.get(("xla_dequant_dot", n, k, m)),
            )


if __name__ == "__main__":
    main()
