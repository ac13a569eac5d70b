"""The benchmark harness and bookkeeping (bench/gemm_bench.py, bench/moe_bench.py,
bench/merge_results.py, bench/tables.py): the timed loops measure what a model runs, merged
records keep the HBM copy rate of their own run, and the MoE table's percentages use it."""

from __future__ import annotations

from bench_modules import fresh


def _rec(impl, t, us, tbps, commit):
    return {"impl": impl, "shape": "nemotron", "routing": "random", "T": t, "median_us": us,
            "tbps": tbps, "tflops": 1.0, "commit": commit}


def test_merge_keeps_each_runs_copy_rate_and_tables_use_it():
    merge, tables = fresh("merge_results").merge, fresh("tables").moe
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

    mb = fresh("moe_bench")
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
    copy before each layer's routing kernel (two per layer: ids and weights), a cost of the
    harness that a model's router does not have."""

    import jax
    import numpy as np

    mb, (x, ids, wts, n, params) = _tiny_moe_loop()
    assert len(ids) == len(wts) == mb.NROT and all(i.shape == (3, 2) for i in ids)
    run = mb.timed_loop(mb.nvfp4_layer("swiglu", "pallas"), mb.per_layer_scales)
    stacked = (mb.NROT, 3, 2)
    assert _routing_slices(jax.make_jaxpr(run)(x, ids, wts, n, params).jaxpr, stacked) == 0
    ids_s, wts_s = np.stack([np.asarray(i) for i in ids]), np.stack([np.asarray(w) for w in wts])
    # the stacked form slices both arrays in every layer (so the check can fail)
    assert _routing_slices(jax.make_jaxpr(run)(x, ids_s, wts_s, n, params).jaxpr, stacked) >= 2 * mb.NROT


def test_moe_bench_loop_recomputes_scales_per_layer():
    """The MoE bench's timed loop gives every layer its own run-time global scales, so XLA
    computes the scale expressions (G = 1 / input_scale, the alphas: f32 divisions over
    [E]-sized or scalar operands) once per layer inside the loop, as a model would. With the
    same scale arrays for every layer XLA shares them between the layers and hoists them out
    of the loop."""


    mb, args = _tiny_moe_loop()
    layer = mb.nvfp4_layer("swiglu", "pallas")

    shared = _scale_divisions(mb.timed_loop(layer).lower(*args).compile().as_text())
    assert shared[0] > 0  # shared scale arrays: the scales computed once, outside the loop
    entry, body = _scale_divisions(mb.timed_loop(layer, mb.per_layer_scales).lower(*args).compile().as_text())
    assert entry == 0
    assert body >= mb.NROT * shared[0]  # per layer, at least what the shared copy had


def test_merge_refuses_to_mix_scale_layouts():
    """A MoE run on linear weight scales does not silently replace rows measured on swizzled
    ones (the README says which layout its rows use)."""
    import pytest

    merge = fresh("merge_results").merge
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

    import jax.numpy as jnp

    gb = fresh("gemm_bench")
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


def test_merge_keeps_the_old_runs_commit_on_rows_it_keeps():
    """Rows of the old file that carry no commit of their own were measured at the old file's
    top-level commit; the merged file's top level is the new run's, so they must take the old
    commit, date and timing with them."""
    merge = fresh("merge_results").merge
    old = {"commit": "aaaa", "date": "d-old", "timing": "t-old", "records": [
        {"impl": "x", "N": 1, "K": 2, "M": 1, "median_us": 5.0},
        {"impl": "x", "N": 1, "K": 2, "M": 16, "median_us": 6.0, "commit": "cccc"}]}
    new = {"commit": "bbbb", "date": "d-new", "timing": "t-new", "records": [
        {"impl": "x", "N": 1, "K": 2, "M": 64, "median_us": 7.0}]}
    doc = merge("gemm", old, new)
    by_m = {r["M"]: r for r in doc["records"]}
    assert doc["commit"] == "bbbb"
    assert (by_m[1]["commit"], by_m[1]["date"], by_m[1]["timing"]) == ("aaaa", "d-old", "t-old")
    assert by_m[16]["commit"] == "cccc"
    assert (by_m[64]["commit"], by_m[64]["date"]) == ("bbbb", "d-new")


def test_e2e_ab_kernel_rows_pair_the_arms_kernels():
    """bench/e2e_ab.py's table: each kernel of either arm once, the arm without it at 0, by
    the larger device time per step first, cut at ``top``."""
    ab = fresh("e2e_ab")
    a = [{"name": "gemm", "us_per_step": 500.0, "calls_per_step": 96.0},
         {"name": "concat", "us_per_step": 65.0, "calls_per_step": 48.0},
         {"name": "attn", "us_per_step": 190.0, "calls_per_step": 48.0}]
    b = [{"name": "attn", "us_per_step": 210.0, "calls_per_step": 48.0},
         {"name": "gemm", "us_per_step": 498.0, "calls_per_step": 96.0},
         {"name": "new", "us_per_step": 1.0, "calls_per_step": 1.0}]
    c = [{"name": "attn", "us_per_step": 700.0, "calls_per_step": 48.0}]
    rows = ab.kernel_rows({"A": a, "B": b})
    assert [r["name"] for r in rows] == ["gemm", "attn", "concat", "new"]
    assert rows[1] == {"name": "attn", "us": {"A": 190.0, "B": 210.0},
                       "calls": {"A": 48.0, "B": 48.0}}
    assert (rows[2]["us"]["B"], rows[2]["calls"]["B"], rows[3]["us"]["A"]) == (0.0, 0.0, 0.0)
    assert [r["name"] for r in ab.kernel_rows({"A": a, "B": None}, top=2)] == ["gemm", "attn"]
    three = ab.kernel_rows({"A": a, "B": b, "C": c})  # a third arm orders by its time too
    assert [r["name"] for r in three][:2] == ["attn", "gemm"]
    assert three[0]["us"] == {"A": 190.0, "B": 210.0, "C": 700.0}
