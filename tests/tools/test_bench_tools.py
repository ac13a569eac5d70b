"""The benchmark bookkeeping (bench/merge_results.py, bench/tables.py): merged records keep
the HBM copy rate of their own run, and the README's MoE percentages use it."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(impl, t, us, tbps, commit):
    return {"impl": impl, "shape": "nemotron", "routing": "random", "T": t, "median_us": us,
            "tbps": tbps, "tflops": 1.0, "commit": commit}


def test_merge_keeps_each_runs_copy_rate_and_tables_use_it():
    merge, tables = _load("merge_results").merge, _load("tables").moe
    old = {"commit": "a", "records": [
        {"impl": "hbm_copy", "tbps": 4.0, "commit": "a"},
        _rec("nvfp4_moe", 1, 50.0, 1.0, "a"), _rec("nvfp4_moe", 64, 500.0, 2.0, "a")]}
    new = {"commit": "b", "date": "d", "records": [
        {"impl": "hbm_copy", "tbps": 2.0}, _rec("nvfp4_moe", 1, 40.0, 1.0, None)]}
    new["records"][1].pop("commit")
    doc = merge("moe", old, new)
    copies = sorted((r["commit"], r["tbps"]) for r in doc["records"] if r["impl"] == "hbm_copy")
    assert copies == [("a", 4.0), ("b", 2.0)]
    ours = {r["T"]: r for r in doc["records"] if r["impl"] == "nvfp4_moe"}
    assert ours[1]["median_us"] == 40.0 and ours[1]["commit"] == "b"  # replaced, stamped
    assert ours[64]["median_us"] == 500.0  # kept from the older run
    rows = {line.split(" | ")[1]: line for line in tables(doc).splitlines()[2:]}
    assert "1.00 (50 %)" in rows["1"]  # 1.0 TB/s against its own run's 2.0
    assert "2.00 (50 %)" in rows["64"] and "500*" in rows["64"]  # 2.0 against 4.0, older run


def test_probe_config_names():
    """bench/moe_mosaic_probe.py's --configs names: knobs on both GEMMs or one (f1/f2), and the
    layer-wide ones; an unknown knob is refused."""
    import sys

    import pytest

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    probe = _load("moe_mosaic_probe")
    from nvfp4_jax.moe.mosaic import auto_config

    base = auto_config(8 * 8, 128, hidden=2048, rows1=1536, inter=768)
    cfg = probe.named_config("c2_bf_f2k3_sp", base, 2048, 768)
    assert (cfg.fc1.consumers, cfg.fc2.consumers) == (2, 2)
    assert (cfg.fc1.split_k, cfg.fc2.split_k) == (base.fc1.split_k, 3)
    assert cfg.bf16_partials and cfg.skip_padding
    assert probe.named_config("rk", base, 2048, 768).routing == "kernel"
    assert probe.named_config("fr_sp", base, 2048, 768).routing == "fused"
    # token_quant on a fused-routing base: the operand leaves the launch, so the routing
    # kernel alone
    assert base.routing == "fused"
    tq = probe.named_config("tq", base, 2048, 768)
    assert tq.token_quant and tq.routing == "kernel"
    # ew: a module constant set while tracing (not a config field), restored after
    patches, rest = probe.trace_knobs("pf_ew_tq")
    assert rest == "pf_tq" and [(m.__name__, a) for m, a, _ in patches] == [
        ("nvfp4_jax.moe.epilogue", "EPILOGUE_LOADED_ELEMS")]
    from nvfp4_jax.moe import epilogue as ep
    before = ep.EPILOGUE_LOADED_ELEMS
    with probe.patched(patches):
        assert ep.epilogue_row_chunk(64, 2) == 64  # whole 64-row blocks
    assert ep.EPILOGUE_LOADED_ELEMS == before and ep.epilogue_row_chunk(64, 2) == 32
    ov = probe.named_config("f2ov", base, 2048, 768)  # overlap, FC2 only
    assert (ov.fc1.overlap, ov.fc2.overlap) == (False, True)
    with pytest.raises(ValueError, match="unknown knob"):
        probe.named_config("fast", base, 2048, 768)
    # pf: a weight knob (FC2 padded by moe.pad_fc2), not a config field
    assert probe.weight_knobs("pf") == (True, "") and probe.weight_knobs("f2k2_pf") == (True, "f2k2")
    assert probe.weight_knobs("fr_sp") == (False, "fr_sp")


def _scale_divisions(text: str) -> tuple[int, int]:
    """(call sites in the ENTRY computation, call sites elsewhere: the timed loop and what it
    calls) of the fusions that divide over per-expert or scalar f32 scales, in a compiled HLO
    module."""
    import re

    comps = {c.split("\n")[0].split(" ")[0].lstrip("%") if not c.startswith("ENTRY") else "ENTRY": c
             for c in re.split(r"\n(?=\S.*\{\n)", text)}
    scale_fusions = {name for name, c in comps.items()
                     if re.search(r"-> f32\[(\d+|1,1)?\]", c.split("\n")[0]) and " divide(" in c}

    def sites(c):
        return sum(len(re.findall(rf"calls=%{re.escape(f)}\b", c)) for f in scale_fusions)

    return sites(comps["ENTRY"]), sum(sites(c) for name, c in comps.items() if name != "ENTRY")


def _tiny_moe_loop():
    """moe_bench (NROT = 2) and the timed loop's arguments (x, ids, weights, n = 2, params) for a
    small swiglu layer: 8 experts, top-2, 3 tokens."""
    import jax
    import numpy as np

    mb = _load("moe_bench")
    mb.NROT = 2
    s = {"hidden": 256, "inter": 256, "experts": 8, "top_k": 2, "activation": "swiglu"}
    _, _, q1, q2 = mb.make_weights(jax.random.PRNGKey(1), s)
    params = (q1, q2, *mb.input_scales(s))
    ids = np.array([[[0, 3]] * 3, [[5, 1]] * 3], np.int32)
    return mb, (mb.make_hidden(3, 256), *mb.device_routings(ids, np.full(ids.shape, 0.5, np.float32)),
                2, params)


def _routing_slices(jaxpr, shape) -> int:
    """Slicing equations (slice, dynamic_slice, gather, squeeze) on an operand of ``shape``
    anywhere in ``jaxpr``, its loop bodies and sub-programs included."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("slice", "dynamic_slice", "gather", "squeeze"):
            n += any(getattr(v.aval, "shape", None) == shape for v in eqn.invars)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _routing_slices(inner, shape)
    return n


def test_moe_bench_layers_read_their_routing_without_a_slice():
    """Each timed layer reads its routing from an array of its own (``device_routings``):
    ``ids[j]`` of a stacked [NROT, T, k] array is a slice, which XLA:GPU ran as a ~1 us device
    copy before each layer's routing kernel (two per layer: ids and weights), a cost of the harness that a model's router does not have."""
    import sys

    import jax
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    mb, (x, ids, wts, n, params) = _tiny_moe_loop()
    assert len(ids) == len(wts) == mb.NROT and all(i.shape == (3, 2) for i in ids)
    run = mb.timed_loop(mb.nvfp4_layer("swiglu", "pallas"), mb.per_layer_scales)
    stacked = (mb.NROT, 3, 2)
    assert _routing_slices(jax.make_jaxpr(run)(x, ids, wts, n, params).jaxpr, stacked) == 0
    ids_s, wts_s = np.stack([np.asarray(i) for i in ids]), np.stack([np.asarray(w) for w in wts])
    # the stacked form slices both arrays in every layer
    assert _routing_slices(jax.make_jaxpr(run)(x, ids_s, wts_s, n, params).jaxpr, stacked) >= 2 * mb.NROT


def test_moe_bench_loop_recomputes_scales_per_layer():
    """The MoE bench's timed loop gives every layer its own run-time global scales, so XLA
    computes the scale expressions (G = 1 / input_scale, the alphas: f32 divisions over
    [E]-sized or scalar operands) once per layer inside the loop, as a model would. With the
    same scale arrays for every layer XLA would share them between
    the layers and hoist them out of the loop."""
    import sys


    sys.path.insert(0, os.path.join(ROOT, "bench"))
    mb, args = _tiny_moe_loop()
    layer = mb.nvfp4_layer("swiglu", "pallas")

    shared = _scale_divisions(mb.timed_loop(layer).lower(*args).compile().as_text())
    assert shared[0] > 0  # the old harness: the scales computed once, outside the loop
    entry, body = _scale_divisions(mb.timed_loop(layer, mb.per_layer_scales).lower(*args).compile().as_text())
    assert entry == 0
    assert body >= mb.NROT * shared[0]  # per layer, at least what the shared copy had


def test_merge_refuses_to_mix_scale_layouts():
    """A MoE run on linear weight scales does not silently replace rows measured on swizzled
    ones (the README says which layout its rows use)."""
    import pytest

    merge = _load("merge_results").merge
    old = {"records": [{**_rec("nvfp4_moe", 1, 50.0, 1.0, "a"), "scale_layout": "swizzled_128x4"}]}
    new = {"commit": "b", "records": [{**_rec("nvfp4_moe", 1, 48.0, 1.0, None), "scale_layout": "linear"}]}
    with pytest.raises(SystemExit, match="swizzled_128x4 weight scales, the new run with linear"):
        merge("moe", old, new)
    new["records"][0]["scale_layout"] = "swizzled_128x4"
    assert merge("moe", old, new)["records"][0]["median_us"] == 48.0


def _while_trip_counts(hlo_text):
    """[known trip count or None] of every while loop in a compiled HLO module's text."""
    import re

    out = []
    for line in hlo_text.splitlines():
        if " while(" in line:
            m = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            out.append(int(m.group(1)) if m else None)
    return out


def test_bench_loops_share_one_host_round_trip_among_many_calls():
    """Both benches' timed programs: the outer loop (run-time trip count: XLA:GPU copies its
    predicate to the host every iteration) wraps an inner loop of static trip count, so one
    host round trip is shared by >= gemm_bench.INNER_CALLS GEMM calls and by NROT *
    INNER_ROUNDS MoE layers."""
    import sys

    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    gb = _load("gemm_bench")
    ws = [jnp.full((32, 16), 1.0 + c, jnp.float32) for c in range(3)]
    x = jnp.ones((2, 32), jnp.float32)
    f = gb.timed_program(lambda x, w: x @ w, x, ws)
    assert f.rounds * len(ws) >= gb.INNER_CALLS and (f.rounds - 1) * len(ws) < gb.INNER_CALLS
    counts = _while_trip_counts(f.lower(x, ws, 3).compile().as_text())
    assert sorted(counts, key=str) == [f.rounds, None]
    outs = f(x, ws, 2)  # the program runs: its outputs are the last round's calls
    assert float(outs[2][0, 0]) == 32 * 3.0

    mb, args = _tiny_moe_loop()
    run = mb.timed_loop(mb.nvfp4_layer("swiglu", "pallas"), mb.per_layer_scales)
    assert run.layers_per_iter == mb.NROT * mb.INNER_ROUNDS
    counts = _while_trip_counts(run.lower(*args).compile().as_text())
    assert None in counts and mb.INNER_ROUNDS in counts


def test_sort_probe_times_int32_keys_only_inside_its_context():
    """bench/sort_probe.py's A/B: inside ``int32_keys(True)`` the routing sorts int32 keys (the
    wide keys), outside it the narrow keys again."""
    import functools

    import jax
    import jax.numpy as jnp

    from nvfp4_jax.moe import routing

    probe = _load("sort_probe")
    ids = jnp.zeros((8, 4), jnp.int32)

    def sort_line():
        hlo = jax.jit(functools.partial(routing.block_routing, method="sort"),
                      static_argnums=(1, 2)).lower(ids, 128, 16).compiler_ir("hlo").as_hlo_text()
        return next(ln for ln in hlo.splitlines() if " sort(" in ln)

    with probe.int32_keys(True):
        assert "(s32[32]{0}, s32[32]{0}) sort(" in sort_line()
    assert "(u8[32]{0}, s32[32]{0}) sort(" in sort_line()


def test_launch_probe_kernels_lower_for_cuda():
    """bench/launch_probe.py's cases lower for CUDA on any machine (their GPU run is the
    probe): the TMA copies, the scalar kernel, and the grouped MoE kernel chained after a
    Triton kernel, one Mosaic custom call per launch."""
    import re
    import sys

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    lp = _load("launch_probe")
    xs = tuple(jnp.ones(lp.SHAPE, jnp.bfloat16) for _ in range(4))
    txt = jax.jit(lambda *a: lp.tma_copy(4)(*a)).trace(*xs).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @(\w+)", txt) == ["mosaic_gpu_v2"]
    txt = jax.jit(lp.scalar_copy()).trace(jnp.zeros((1,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @(\w+)", txt) == ["mosaic_gpu_v2"]
    txt = lp.grouped_step(True).trace(lp.grouped_inputs()).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(\w+)", txt)
    assert calls.count("mosaic_gpu_v2") == lp.CALLS and len(calls) == 2 * lp.CALLS
