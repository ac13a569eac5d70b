"""Expert- and tensor-parallel NVFP4 layers (nvfp4_jax.parallel) on 1, 2, 4 and 8 CPU devices.

The sharded checks need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX
starts its backends, and the rest of the suite runs without it, so one subprocess (this file
run as a script) runs every check and prints one JSON object; each test reads its entry.

Properties (weights with normal and with E4M3-subnormal block scales):

* ``moe_ep`` equals single-device ``nvfp4_jax.moe(backend="xla")`` bit for bit (the same
  per-route arithmetic, the same fp32 top-k sum);
* ``linear_tp(mode="column")`` equals ``nvfp4_jax.matmul`` bit for bit (W4A16 and W4A4);
* ``linear_tp(mode="row")`` is within ``oracle.gemm_error_bound`` of the exact oracle GEMM,
  and within the sum of the two bounds of the single-device result (only the fp32
  accumulation order changes);
* a ``capacity`` below a device's load makes exactly the dropped tokens' rows NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
from host_devices import assert_check, bits_equal, expect_value_errors, main, recorder, run_module

DEVICES = (1, 2, 4, 8)
VARIANTS = ("normal", "subnormal")
E, H, INTER, T, K_TOP = 8, 64, 32, 16, 3
GEMM_N, GEMM_K, GEMM_M = 64, 256, 8


def check_names() -> list[str]:
    names = []
    for v in VARIANTS:
        names.append(f"scales_{v}")
        names += [f"moe_ep_relu2_{v}_d{d}" for d in DEVICES]
        names += [f"linear_{m}_{a}_{v}_d{d}" for m in ("column", "row") for a in ("w4a16", "w4a4")
                  for d in DEVICES]
    names += [f"moe_ep_swiglu_logits_d{d}" for d in (2, 8)]
    names += ["moe_ep_capacity_nan", "moe_ep_collectives_d4", "errors"]
    return names


# ----------------------------------------------------------------------------- worker


def _quantize_experts(w: np.ndarray, decode: np.ndarray):
    """Per-expert quantization of w [E, N, K] with given decode scales [E] (chosen to put the
    block scales in E4M3's normal or subnormal range; ``quantize_experts`` derives them)."""
    import jax.numpy as jnp

    import nvfp4_jax as nj

    qs = [nj.quantize(jnp.asarray(w[i]), "trtllm", decode_scale=jnp.float32(decode[i]))
          for i in range(w.shape[0])]
    return nj.NVFP4Array.from_parts(jnp.stack([q.codes for q in qs]),
                                    jnp.stack([q.scales for q in qs]),
                                    jnp.stack([q.decode_scale for q in qs]), shape=w.shape)


def _values(seed: int, shape: tuple, variant: str, decode: float) -> np.ndarray:
    """Values whose ideal block scales lie in E4M3's normal range or its subnormal range
    (2^-10 .. 2^-6.5), from the suite's block generator."""
    from conftest import nvfp4_blocks

    n = int(np.prod(shape))
    lo, hi = (-5.0, 6.0) if variant == "normal" else (-10.0, -6.5)
    x = nvfp4_blocks(seed, n // 16, decode, scale_log2_lo=lo, scale_log2_hi=hi,
                     kind_weights=(0.8, 0.05, 0.1, 0.05, 0.0, 0.0))
    return x.reshape(shape)


def run_checks() -> dict:
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj
    import oracle
    from nvfp4_jax import parallel as par
    from nvfp4_jax.testing import assert_gemm_close, gemm_reference

    res = {}

    record = recorder(res)

    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :K_TOP], jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (T, K_TOP)), jnp.float32)
    s1 = jnp.asarray(rng.uniform(1, 4, E) / 2688, jnp.float32)
    s2 = jnp.asarray(rng.uniform(1, 4, E) / 2688, jnp.float32)
    hidden = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)

    jits = {}  # one compile per (function, devices): both variants pass arrays of one shape

    def ep(mesh, fc1, fc2, activation="relu2", **routing):
        key = ("ep", mesh.size, activation, tuple(sorted(routing)))
        if key not in jits:
            static = {n: v for n, v in routing.items() if n in ("top_k", "renormalize")}
            jits[key] = jax.jit(lambda x, a, b, r: par.moe_ep(
                x, fc1=a, fc2=b, fc1_input_scale=s1, fc2_input_scale=s2, mesh=mesh,
                activation=activation, backend="xla", **r, **static))
        arrays = {n: v for n, v in routing.items() if n not in ("top_k", "renormalize")}
        return jits[key](hidden, par.shard_experts(fc1, mesh), par.shard_experts(fc2, mesh),
                         arrays)

    def tp(mesh, mode, x, w, s_in):
        key = ("tp", mesh.size, mode, s_in is None)
        if key not in jits:
            jits[key] = jax.jit(lambda x, w, s: par.linear_tp(
                x, w, mesh=mesh, mode=mode, input_scale=s, backend="xla", out_dtype=jnp.float32))
        return jits[key](x, w, s_in)

    ref_moe = jax.jit(lambda x, a, b, r, act: nj.moe(
        x, fc1=a, fc2=b, fc1_input_scale=s1, fc2_input_scale=s2, activation=act, backend="xla",
        **r), static_argnames="act")
    ref_mm = jax.jit(lambda x, w, s: nj.matmul(x, w, input_scale=s, backend="xla",
                                               out_dtype=jnp.float32))

    for vi, v in enumerate(VARIANTS):
        d1 = rng.uniform(0.5, 2.0, E).astype(np.float32) * 2.0**-8
        d2 = rng.uniform(0.5, 2.0, E).astype(np.float32) * 2.0**-8
        fc1 = _quantize_experts(np.stack([_values(100 * vi + i, (INTER, H), v, d1[i])
                                          for i in range(E)]), d1)
        fc2 = _quantize_experts(np.stack([_values(200 + 100 * vi + i, (H, INTER), v, d2[i])
                                          for i in range(E)]), d2)

        def scales_regime(fc1=fc1, fc2=fc2, v=v):
            s = np.concatenate([np.asarray(f.scales, np.float32).ravel() for f in (fc1, fc2)])
            nz = s[s > 0]
            frac = float(np.mean(nz < 2.0**-6))
            ok = frac > 0.9 if v == "subnormal" else frac < 0.1
            return ok, f"{frac:.3f} of {nz.size} nonzero block scales are E4M3 subnormals"

        record(f"scales_{v}", scales_regime)
        ref = ref_moe(hidden, fc1, fc2, {"topk_ids": ids, "topk_weights": wts}, act="relu2")
        for d in DEVICES:
            mesh = par.mesh_1d(d, "ep")
            record(f"moe_ep_relu2_{v}_d{d}",
                   lambda mesh=mesh, fc1=fc1, fc2=fc2, ref=ref: bits_equal(
                       ep(mesh, fc1, fc2, topk_ids=ids, topk_weights=wts), ref))

        dw = np.float32(2.0**-7)
        w = nj.quantize(jnp.asarray(_values(300 + vi, (GEMM_N, GEMM_K), v, dw)), "trtllm",
                        decode_scale=dw)
        w_or = nj.to_oracle(w)
        x = jnp.asarray(rng.standard_normal((GEMM_M, GEMM_K)), jnp.bfloat16)
        for a, s_in in (("w4a16", None), ("w4a4", jnp.float32(3.0 / 2688))):
            single = ref_mm(x, w, s_in)
            x64 = np.asarray(x, np.float64)
            s_or = None if s_in is None else float(s_in)
            ref_g, abs_a, alpha = gemm_reference(x64, w_or, input_scale=s_or)
            abs_w = np.abs(oracle.dequantize(w_or, include_decode_scale=False))
            for d in DEVICES:
                mesh = par.mesh_1d(d, "tp")
                record(f"linear_column_{a}_{v}_d{d}", lambda mesh=mesh, s_in=s_in, single=single:
                       bits_equal(tp(mesh, "column", x, w, s_in), single))

                def row(mesh=mesh, s_in=s_in, single=single, s_or=s_or, ref_g=ref_g, abs_a=abs_a,
                        alpha=alpha, d=d, a=a, v=v):
                    out = tp(mesh, "row", x, w, s_in)
                    assert_gemm_close(out, x64, w_or, input_scale=s_or, out_dtype="float32",
                                      accum_u=2.0**-24, label=f"row-parallel {a} {v} D={d}")
                    bound = oracle.gemm_error_bound(abs_a, abs_w, alpha, ref_g, accum_u=2.0**-24,
                                                    out_u=2.0**-24)
                    diff = np.abs(np.asarray(out, np.float64) - np.asarray(single, np.float64))
                    worst = float(np.max(diff / (2 * bound)))
                    same = int(np.sum(diff == 0))
                    return worst <= 1.0, (f"|sharded - single| <= {worst:.3g} x the summed "
                                          f"bounds; {same} of {diff.size} identical")

                record(f"linear_row_{a}_{v}_d{d}", row)
        if v == "normal":
            fc1_n, fc2_n = fc1, fc2

    # swiglu, routed from logits (softmax top-k, renormalized)
    d1 = np.full(E, 2.0**-8, np.float32)
    fc1s = _quantize_experts(_values(900, (E, 2 * INTER, H), "normal", 2.0**-8), d1)
    fc2s = _quantize_experts(_values(901, (E, H, INTER), "normal", 2.0**-8), d1)
    logits = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    rkw = {"router_logits": logits, "top_k": K_TOP, "renormalize": True}
    ref_s = nj.moe(hidden, fc1=fc1s, fc2=fc2s, fc1_input_scale=s1, fc2_input_scale=s2,
                   activation="swiglu", backend="xla", **rkw)
    for d in (2, 8):
        record(f"moe_ep_swiglu_logits_d{d}", lambda d=d: bits_equal(
            ep(par.mesh_1d(d, "ep"), fc1s, fc2s, activation="swiglu", **rkw), ref_s))

    def capacity():
        # every token routes to experts 0, 1, 2: experts 0 and 1 live on device 0 of 4, which
        # holds routes 2t and 2t + 1 of token t in this order
        sk_ids = jnp.tile(jnp.arange(K_TOP, dtype=jnp.int32), (T, 1))
        mesh = par.mesh_1d(4, "ep")
        full = ref_moe(hidden, fc1_n, fc2_n, {"topk_ids": sk_ids, "topk_weights": wts},
                       act="relu2")
        cap = 2 * 10 + 1  # tokens 0..9 complete, token 10 loses its second route, 11.. both
        out = jax.jit(lambda x, a, b: par.moe_ep(
            x, fc1=a, fc2=b, fc1_input_scale=s1, fc2_input_scale=s2, mesh=mesh,
            topk_ids=sk_ids, topk_weights=wts, backend="xla", capacity=cap))(hidden, fc1_n, fc2_n)
        out = np.asarray(out, np.float32)
        nan_rows = np.isnan(out).all(axis=1)
        ok_nan = nan_rows.tolist() == [False] * 10 + [True] * (T - 10)
        same, detail = bits_equal(out[:10], np.asarray(full, np.float32)[:10])
        # an expert id out of range under jit (no check possible): that token's row is NaN
        oob = jax.jit(lambda x, a, b, i: par.moe_ep(
            x, fc1=a, fc2=b, fc1_input_scale=s1, fc2_input_scale=s2, mesh=mesh,
            topk_ids=i, topk_weights=wts, backend="xla"))(hidden, fc1_n, fc2_n,
                                                          ids.at[5, 2].set(-1))
        oob_rows = np.flatnonzero(np.isnan(np.asarray(oob, np.float32)).all(axis=1)).tolist()
        return ok_nan and same and oob_rows == [5], (
            f"NaN rows {np.flatnonzero(nan_rows).tolist()}; kept rows: {detail}; NaN rows with "
            f"an id of -1 in token 5: {oob_rows}")

    record("moe_ep_capacity_nan", capacity)

    def collectives():
        """The compiled program's all-gathers and reduce-scatters move the elements that
        ep_bytes counts (XLA:CPU widens bf16 collectives to f32, so elements, not bytes)."""
        import re

        d = 4
        mesh = par.mesh_1d(d, "ep")
        found = {}
        for cap in (None, 2 * T * K_TOP // d):
            txt = jax.jit(lambda x, a, b, cap=cap: par.moe_ep(
                x, fc1=a, fc2=b, fc1_input_scale=s1, fc2_input_scale=s2, mesh=mesh,
                topk_ids=ids, topk_weights=wts, backend="xla", capacity=cap)).lower(
                hidden, fc1_n, fc2_n).compile().as_text()
            sent = 0.0
            for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (all-gather|reduce-scatter)\(", txt):
                n = int(np.prod([int(v) for v in m.group(1).split(",") if v]))
                full = n if m.group(2) == "all-gather" else n * d
                sent += (d - 1) / d * full
            b = par.ep_bytes(T, H, K_TOP, E, d, capacity_limited=cap is not None)
            # elements: hidden [T, H] and per-route outputs [T*k, H] (2 bytes each), ids and
            # flags (4 bytes each)
            want = b["all_gather"] / 2 + b["routing"] / 4
            found[str(cap)] = (sent, want)
        ok = all(s == w for s, w in found.values())
        return ok, f"(elements sent per device, ep_bytes) by capacity: {found}"

    record("moe_ep_collectives_d4", collectives)

    def errors():
        mesh3 = par.mesh_1d(3, "ep")
        cases = [
            ("E = 8 experts", lambda: par.moe_ep(
                hidden[:15], fc1=fc1_n, fc2=fc2_n, fc1_input_scale=s1, fc2_input_scale=s2,
                mesh=mesh3, topk_ids=ids[:15], topk_weights=wts[:15])),
            ("mode: moe_ep supports", lambda: par.moe_ep(
                hidden, fc1=fc1_n, fc2=fc2_n, fc1_input_scale=s1, fc2_input_scale=s2,
                mesh=par.mesh_1d(2), topk_ids=ids, topk_weights=wts, mode="b12x")),
            ("axis: expected one of", lambda: par.moe_ep(
                hidden, fc1=fc1_n, fc2=fc2_n, fc1_input_scale=s1, fc2_input_scale=s2,
                mesh=par.mesh_1d(2), axis="tp", topk_ids=ids, topk_weights=wts)),
            ("topk_ids: expected expert ids in [0, 8)", lambda: par.moe_ep(
                hidden, fc1=fc1_n, fc2=fc2_n, fc1_input_scale=s1, fc2_input_scale=s2,
                mesh=par.mesh_1d(2), topk_ids=ids.at[3, 1].set(E), topk_weights=wts)),
            ("whole 16-value blocks", lambda: par.linear_tp(
                hidden, nj.quantize(jnp.ones((32, 64), jnp.float32)), mesh=par.mesh_1d(8, "tp"),
                mode="row")),
            ("with_layout('linear')", lambda: par.linear_tp(
                hidden, nj.quantize(jnp.ones((128, 64), jnp.float32), layout="swizzled_128x4"),
                mesh=par.mesh_1d(2, "tp"))),
        ]
        return expect_value_errors(cases)

    record("errors", errors)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_module(__file__, "parallel checks", tmp_path_factory)


@pytest.mark.parametrize("name", check_names())
def test_parallel(results, name):
    assert_check(results, name)


if __name__ == "__main__":
    main(run_checks, check_names)
