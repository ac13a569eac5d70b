"""Tensor- and expert-parallel decoders (models.shard_model) on 1, 2, 4 and 8 CPU devices.

As tests/parallel/test_parallel.py: the sharded checks need
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, so one subprocess
(this file run as a script) runs every check and prints one JSON object.

The model: random NVFP4 parameters built here, two layers (a dense SwiGLU layer and a
Qwen3-MoE layer with q/k norms), 8 q and 8 kv heads of 16, hidden 64, MLP 128, 8 experts of
32 (top-2, renormalized), vocabulary 128; W4A4 and W4A16 linears, a bf16 o_proj (a layer a
checkpoint left unquantized) and an NVFP4 LM head. Two variants: block scales in E4M3's
normal range, and all E4M3 subnormals (bytes 0x01..0x07). Properties, against the same
model on one device (``models.prefill`` / ``decode_step``):

* ``row_parallel="gather"`` on D = 4, 8: the prefill logits [B, T, V], the KV cache
  after 32 greedy decode steps, and those steps' logits (hence the 32 tokens) bit for bit
  (every dot is the single-device dot; the expert-parallel combine adds each token's routes
  in the single-device order);
* ``row_parallel="psum"`` on D = 1 and 2, the same bit for bit: at D = 2 each row-parallel
  output is the fp32 sum of two K-half partials, which the single-device dot need not
  reproduce in general (it adds K terms in its own order); it does here, and the check
  holds the code to it (a wrong split, a missing or doubled partial, or a misplaced alpha
  breaks it);
* ``row_parallel="psum"`` on more devices changes only the fp32 order of the row-parallel
  reductions; checked per layer: the dense layer's NVFP4 row-parallel linears (o_proj W4A4,
  down_proj W4A16) through ``parallel.row_parallel_matmul`` (the model's psum path) on 8
  devices lie within ``oracle.gemm_error_bound`` of the exact GEMM, and within the sum of
  the two bounds of the single-device linear (tests/parallel/test_parallel.py checks the
  same on 2 and 4 devices); the rest of the layer is the sharding the checks above prove
  bit for bit. (At these sizes the fp32 sums happen to be exact, so the sharded outputs are
  identical; the detail reports it.)
* a mesh axis that does not divide heads, kv heads, experts, MLP width (16-value blocks per
  device for psum) or vocabulary raises a ValueError naming ``mesh`` and the field;
* with ``moe_capacity_factor``, exactly the tokens with a route past a device's capacity
  get NaN logits; the others equal the single-device logits bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from host_devices import (
    ROOT,
    assert_check,
    bits_equal,
    expect_value_errors,
    main,
    recorder,
    run_module,
)

VARIANTS = ("normal", "subnormal")
GATHER_D = (4, 8)
PSUM_EXACT_D = (1, 2)
PSUM_BOUND_D = (8,)
B, T_PROMPT, STEPS = 2, 5, 32


def check_names() -> list[str]:
    names = []
    for v in VARIANTS:
        names.append(f"scales_{v}")
        names += [f"gather_{v}_d{d}" for d in GATHER_D]
        names += [f"psum_{v}_d{d}" for d in PSUM_EXACT_D]
        names += [f"psum_rows_{v}_d{d}" for d in PSUM_BOUND_D]
    names += ["tokens_vary", "placement_d4", "errors", "moe_capacity_nan_d4", "gpu_body_d2"]
    return names


# ----------------------------------------------------------------------------- worker


def build_model(variant: str, seed: int = 0):
    """The random two-layer model of the module docstring (unrolled layers: the two differ)."""
    import jax
    import jax.numpy as jnp

    from nvfp4_jax import NVFP4Array, nn
    from nvfp4_jax.models import DecoderConfig, Model

    cfg = DecoderConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=8,
                        num_kv_heads=8, head_dim=16, intermediate_size=128, qk_norm=True,
                        moe_layers=(1,), num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1e4)
    rng = np.random.default_rng(seed)
    lo, hi, ds = (0x30, 0x48, 2.0**-7) if variant == "normal" else (0x01, 0x08, 2.0)

    def nvfp4(shape):
        codes = rng.integers(0, 256, shape[:-1] + (shape[-1] // 2,), dtype=np.uint8)
        sb = rng.integers(lo, hi, shape[:-1] + (shape[-1] // 16,), dtype=np.uint8)
        scales = jax.lax.bitcast_convert_type(jnp.asarray(sb), jnp.float8_e4m3fn)
        dec = rng.uniform(0.5, 1.0, shape[:-2]).astype(np.float32) * ds
        return NVFP4Array(jnp.asarray(codes), scales, jnp.asarray(dec), tuple(shape), "linear")

    def lin(n, k, w4a4=True):
        return nn.Linear(nvfp4((n, k)), jnp.float32(4.0 / 2688) if w4a4 else None)

    def bf16(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)

    h, d, nh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    norm = lambda n: jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.bfloat16)  # noqa: E731
    dense = {"input_layernorm": norm(h), "post_attention_layernorm": norm(h),
             "self_attn": {"q_proj": lin(nh * d, h), "k_proj": lin(kvh * d, h),
                           "v_proj": lin(kvh * d, h, w4a4=False), "o_proj": lin(h, nh * d),
                           "q_norm": norm(d), "k_norm": norm(d)},
             "mlp": {"gate_proj": lin(128, h), "up_proj": lin(128, h),
                     "down_proj": lin(h, 128, w4a4=False)}}
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    moe = nn.MoE(bf16(e, h, scale=0.3), nvfp4((e, 2 * i, h)), nvfp4((e, h, i)),
                 jnp.asarray(rng.uniform(2, 5, e) / 2688, jnp.float32),
                 jnp.asarray(rng.uniform(1, 3, e) / 2688, jnp.float32), top_k=2,
                 routing="softmax", renormalize=True, activation="swiglu")
    expert = {"input_layernorm": norm(h), "post_attention_layernorm": norm(h),
              "self_attn": {"q_proj": lin(nh * d, h), "k_proj": lin(kvh * d, h),
                            "v_proj": lin(kvh * d, h), "o_proj": bf16(h, nh * d, scale=0.05),
                            "q_norm": norm(d), "k_norm": norm(d)},
              "moe": moe}
    head = lin(cfg.vocab_size, h)
    return Model.build(cfg, bf16(cfg.vocab_size, h), [dense, expert], norm(h), head)


def _greedy_program(model, prompt, steps: int, backend: str = "auto"):
    import jax
    import jax.numpy as jnp

    from nvfp4_jax import models

    cache = models.init_cache(model.config, prompt.shape[0], prompt.shape[1] + steps)
    logits, cache = models.forward(model, prompt, cache, backend=backend)

    def step(carry, _):
        tok, cache = carry
        lg, cache = models.forward(model, tok[:, None], cache, backend=backend)
        return (jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32), cache), lg[:, 0]

    tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    (_, cache), out = jax.lax.scan(step, (tok, cache), None, length=steps)
    return logits, cache.k, cache.v, out


_JIT = {}


def greedy(model, prompt, steps: int, backend: str = "auto"):
    """Prefill logits [B, T, V], the final cache, and ``steps`` greedy steps' logits
    [steps, B, V]: ``models.forward`` on the prompt, then on each argmax token, in one jitted
    program (one compile per model structure and mesh; both variants share it)."""
    import jax

    if "run" not in _JIT:
        _JIT["run"] = jax.jit(_greedy_program, static_argnames=("steps", "backend"))
    logits, k, v, out = _JIT["run"](model, prompt, steps=steps, backend=backend)
    return (np.asarray(logits), np.asarray(k), np.asarray(v)), np.asarray(out)


def model_agreement(devices: int, row_parallel: str, noise_backend: str = "xla"):
    """The multi-GPU check (tests/parallel/test_parallel_gpu.py), also run here on CPU
    devices: the sharded model against the single-device one where kernels add in their
    own orders, so bit equality is not expected. ``noise`` = max |single-device logits with
    the default backend - with ``noise_backend``| (two legitimate single-device programs),
    at least one bf16 ulp of the largest prefill logit (the LM head's outputs are bf16).
    Passes when the prefill logits differ by at most 4 noise, and each of the 32 greedy
    tokens equals the single-device token up to the first step whose single-device top-2
    logit margin is at most 8 noise (after a legitimate divergence the sequences differ).
    Returns (ok, detail)."""
    from nvfp4_jax import models
    from nvfp4_jax import parallel as par

    model = build_model("normal")
    prompt = np.random.default_rng(1).integers(0, 128, (B, T_PROMPT)).astype(np.int32)
    (lg1, _, _), st1 = greedy(model, prompt, STEPS)
    (lgx, _, _), _ = greedy(model, prompt, STEPS, backend=noise_backend)
    sm = models.shard_model(model, par.mesh_1d(devices, "tp"), row_parallel=row_parallel)
    (lg, _, _), st = greedy(sm, prompt, STEPS)
    ulp = 2.0 ** (np.floor(np.log2(np.max(np.abs(lg1)))) - 7)
    noise = max(float(np.max(np.abs(lg1 - lgx))), ulp)
    err = float(np.max(np.abs(lg - lg1)))
    top2 = np.sort(st1, axis=-1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]  # [steps, B]
    t1, t = np.argmax(st1, axis=-1), np.argmax(st, axis=-1)
    bad = []
    for b in range(B):
        for i in range(STEPS):
            if margin[i, b] <= 8 * noise:
                break
            if t[i, b] != t1[i, b]:
                bad.append((b, i))
                break
    ok = err <= 4 * noise and not bad
    return ok, (f"D={devices} {row_parallel}: max |prefill logits - single| {err:.3g} "
                f"(4 noise = {4 * noise:.3g}); token mismatches before a small margin: {bad}")


def _same_run(run, ref) -> tuple[bool, str]:
    (lg, k, v), steps = run
    (lg1, k1, v1), steps1 = ref
    parts = []
    for name, a, b in (("prefill logits", lg, lg1), ("k cache", k, k1), ("v cache", v, v1),
                       ("decode logits", steps, steps1)):
        ok, detail = bits_equal(a, b)
        if not ok:
            return False, f"{name}: {detail}"
        parts.append(f"{name} {a.size}")
    toks = np.argmax(steps, axis=-1).T
    return True, f"bit for bit ({', '.join(parts)}); greedy tokens[0] {toks[0].tolist()}"


def run_checks() -> dict:
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj
    import oracle
    from nvfp4_jax import models
    from nvfp4_jax import parallel as par
    from nvfp4_jax.testing import assert_gemm_close, gemm_reference

    res = {}

    record = recorder(res)

    prompt = jnp.asarray(np.random.default_rng(1).integers(0, 128, (B, T_PROMPT)), jnp.int32)
    meshes = {d: par.mesh_1d(d, "tp") for d in (1, 2, 4, 8)}
    refs = {}
    jits = {}
    for v in VARIANTS:
        model = build_model(v)

        def scales(model=model, v=v):
            s = np.concatenate([np.asarray(a, np.float32).ravel()
                                for a in jax.tree_util.tree_leaves(model)
                                if a.dtype == jnp.float8_e4m3fn])
            frac = float(np.mean(s < 2.0**-6))
            ok = frac == 1.0 if v == "subnormal" else frac == 0.0
            return ok, f"{frac:.3f} of {s.size} block scales are E4M3 subnormals"

        record(f"scales_{v}", scales)
        ref = refs[v] = greedy(model, prompt, STEPS)
        for d in GATHER_D:
            record(f"gather_{v}_d{d}", lambda d=d, model=model, ref=ref: _same_run(
                greedy(models.shard_model(model, meshes[d], row_parallel="gather"), prompt,
                       STEPS), ref))
        for d in PSUM_EXACT_D:
            record(f"psum_{v}_d{d}", lambda d=d, model=model, ref=ref: _same_run(
                greedy(models.shard_model(model, meshes[d]), prompt, STEPS), ref))

        # per layer: the model's row-parallel linears, psum over 4 and 8 devices
        rows = [("layer 0 o_proj", model.groups[0]["self_attn"]["o_proj"]),
                ("layer 0 down_proj", model.groups[0]["mlp"]["down_proj"])]
        rng = np.random.default_rng(7)
        for d in PSUM_BOUND_D:
            def psum_rows(d=d, rows=rows, v=v):
                worst, same, total = 0.0, 0, 0
                for label, lin in rows:
                    n, k = lin.shape
                    x = jnp.asarray(rng.standard_normal((B * T_PROMPT, k)), jnp.bfloat16)
                    s_in = lin.input_scale
                    key = (d, label)  # one compile per linear, shared by the variants
                    if key not in jits:
                        jits[key] = (jax.jit(lambda x, w, s, d=d: par.linear_tp(
                            x, w, mesh=meshes[d], mode="row", input_scale=s)),
                            jax.jit(lambda x, w, s: nj.matmul(x, w, input_scale=s)))
                    out = jits[key][0](x, lin.w, s_in)
                    single = jits[key][1](x, lin.w, s_in)
                    x64 = np.asarray(x, np.float64)
                    w_or = nj.to_oracle(lin.w)
                    s_or = None if s_in is None else float(s_in)
                    assert_gemm_close(out, x64, w_or, input_scale=s_or, accum_u=2.0**-24,
                                      label=f"{label} psum {v} D={d}")
                    ref_g, abs_a, alpha = gemm_reference(x64, w_or, input_scale=s_or)
                    abs_w = np.abs(oracle.dequantize(w_or, include_decode_scale=False))
                    bound = oracle.gemm_error_bound(abs_a, abs_w, alpha, ref_g,
                                                    accum_u=2.0**-24, out_u=2.0**-8)
                    diff = np.abs(np.asarray(out, np.float64) - np.asarray(single, np.float64))
                    worst = max(worst, float(np.max(diff / (2 * bound))))
                    same += int(np.sum(diff == 0))
                    total += diff.size
                return worst <= 1.0, (f"|psum - single| <= {worst:.3g} x the summed bounds; "
                                      f"{same} of {total} identical")

            record(f"psum_rows_{v}_d{d}", psum_rows)

    def tokens_vary():
        # the greedy run is not degenerate: tokens change along the sequence and across it
        toks = np.argmax(refs["normal"][1], axis=-1)
        n = len(np.unique(toks))
        return n >= 4, f"{n} distinct greedy tokens in {toks.size}"

    record("tokens_vary", tokens_vary)

    def placement():
        sm = models.shard_model(build_model("normal"), meshes[4])
        g0, g1 = sm.model.groups
        want = {"q_proj codes": (g0["self_attn"]["q_proj"].w.codes, (32, 32)),
                "o_proj codes": (g0["self_attn"]["o_proj"].w.codes, (64, 16)),
                "down_proj scales": (g0["mlp"]["down_proj"].w.scales, (64, 2)),
                "fc1 codes": (g1["moe"].fc1.codes, (2, 64, 32)),
                "fc1 decode_scale": (g1["moe"].fc1.decode_scale, (2,)),
                "fc2_input_scale": (g1["moe"].fc2_input_scale, (2,)),
                "lm_head codes": (sm.model.lm_head.w.codes, (32, 32)),
                "router": (g1["moe"].router, (8, 64))}
        bad = [f"{k}: {a.addressable_shards[0].data.shape} != {s}"
               for k, (a, s) in want.items() if a.addressable_shards[0].data.shape != s]
        return not bad, "; ".join(bad) or f"{len(want)} per-device shard shapes as planned"

    record("placement_d4", placement)

    def errors():
        from jax.sharding import Mesh

        base = build_model("normal")
        mesh3 = Mesh(jax.devices()[:3], ("tp",))
        cases = [
            ("num_heads = 8", lambda: models.shard_model(base, mesh3)),
            ("num_kv_heads = 4", lambda: models.shard_model(
                _with(base, num_kv_heads=4), meshes[8])),
            ("intermediate_size = 64 (down_proj", lambda: models.shard_model(
                _with(base, intermediate_size=64), meshes[8])),
            ("num_experts = 4", lambda: models.shard_model(_with(base, num_experts=4),
                                                           meshes[8])),
            ("vocab_size = 132", lambda: models.shard_model(_with(base, vocab_size=132),
                                                            meshes[8])),
            ("row_parallel: expected", lambda: models.shard_model(base, meshes[2],
                                                                  row_parallel="ring")),
            ("axis: expected one of", lambda: models.shard_model(base, meshes[2], axis="ep")),
            ("moe_capacity_factor", lambda: models.shard_model(base, meshes[2],
                                                               moe_capacity_factor=0.0)),
            ("model: expected a models.Model", lambda: models.shard_model(base.groups,
                                                                          meshes[2])),
            ("model: expected a models.Model or models.ShardedModel", lambda: models.forward(
                base.groups, prompt, models.init_cache(base.config, B, 8))),
        ]
        return expect_value_errors(cases)

    record("errors", errors)

    def capacity():
        # a zero router ties every expert, so top-2 picks experts 0 and 1 (device 0 of 4) for
        # every token; a capacity of ceil(1.0 * 10 * 2 / 4) = 5 route rows computes routes
        # 0..4 (token-major), so tokens 0 and 1 are whole and tokens 2..9 lose a route
        import dataclasses

        base = build_model("normal")
        g1 = dict(base.groups[1])
        g1["moe"] = dataclasses.replace(g1["moe"], router=jnp.zeros_like(g1["moe"].router))
        model = dataclasses.replace(base, groups=[base.groups[0], g1])
        (ref, _, _), _ = greedy(model, prompt, STEPS)  # the cached single-device program
        sm = models.shard_model(model, meshes[4], row_parallel="gather", moe_capacity_factor=1.0)
        cache = models.init_cache(model.config, B, T_PROMPT + STEPS)
        out = np.asarray(jax.jit(models.forward)(sm, prompt, cache)[0]).reshape(B * T_PROMPT, -1)
        ref = ref.reshape(B * T_PROMPT, -1)
        nan_rows = np.flatnonzero(np.isnan(out).all(axis=1)).tolist()
        same, detail = bits_equal(out[:2], ref[:2])
        ok = nan_rows == list(range(2, B * T_PROMPT)) and same
        return ok, f"NaN logit rows {nan_rows}; whole tokens 0, 1: {detail}"

    record("moe_capacity_nan_d4", capacity)
    # the GPU test's body on 2 CPU devices (noise reference: the same backend, cached)
    record("gpu_body_d2", lambda: model_agreement(2, "psum", noise_backend="auto"))
    return res


def _with(model, **cfg):
    """The model with config fields replaced (the checks above need only the config)."""
    import dataclasses

    return dataclasses.replace(model, config=dataclasses.replace(model.config, **cfg))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_module(__file__, "parallel model checks", tmp_path_factory)


@pytest.mark.parametrize("name", check_names())
def test_parallel_models(results, name):
    assert_check(results, name)


def test_bench_model_dry_run(tmp_path):
    """bench/parallel_bench.py --model runs end to end on 4 CPU devices (tiny shapes), so the
    multi-GPU run cannot die on a typo."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(ROOT, "bench", "parallel_bench.py"), "--out",
           str(tmp_path), "--cpu-devices", "4", "--shapes", "tiny", "--model", "qwen3-30b-a3b",
           "--devices", "4", "--batches", "2", "--steps", "2"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(tmp_path / "model-tp-cpu-qwen3-30b-a3b.json") as f:
        res = json.load(f)
    (row,) = res["results"]
    assert row["devices"] == 4 and not row["nan_last_logits"], row
    assert row["decode"][0]["tokens_per_s"] > 0 and row["prefill"]["tokens_per_s"] > 0, row
    assert row["decode"][0]["bytes_sent_per_device"] > 0, row


if __name__ == "__main__":
    main(run_checks, check_names)
