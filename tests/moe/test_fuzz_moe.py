"""Property: every correct MoE implementation stays inside the derived interval around the oracle,
and the fuzzer has teeth: it finds TensorRT-LLM's CUTEDSL-b12x scale folding by itself.

The interval (``nvfp4_jax.testing.assertions.moe_bound``) follows each value through the MoE's
rounding points; it collapses to the oracle's value almost everywhere at these sizes, so any
change of the weights' effective values (such as re-rounding ``scale * weight_scale_2`` to E4M3)
lands outside it.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import nvfp4_jax
import oracle
from nvfp4_jax.interop import trtllm as T
from nvfp4_jax.testing import assert_moe_close, moe_bound
from nvfp4_jax.testing import strategies as nst
from nvfp4_jax.testing.assertions import moe_violations

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
DEEP = PROFILE == "deep"


def _fixed_shape_problems():
    """One shape per (activation) so XLA compiles few programs; values fuzzed over the full range."""
    if DEEP:
        return nst.moe_problems()
    return nst.moe_problems(num_tokens=6, hidden_size=64, intermediate_size=32, num_experts=4, top_k=2)


@settings(max_examples=400 if DEEP else 24)
@given(_fixed_shape_problems(), st.sampled_from(["trtllm_cutlass", "b12x"]))
def test_jax_moe_within_bound(p, mode):
    out = nvfp4_jax.moe(
        jnp.asarray(p.hidden, jnp.bfloat16), fc1=nvfp4_jax.from_oracle(p.fc1),
        fc2=nvfp4_jax.from_oracle(p.fc2), fc1_input_scale=jnp.asarray(p.fc1_input_scale, jnp.float32),
        fc2_input_scale=jnp.asarray(p.fc2_input_scale, jnp.float32), topk_ids=jnp.asarray(p.topk_ids),
        topk_weights=jnp.asarray(p.topk_weights), activation=p.activation,
        gate_up_order=p.gate_up_order, mode=mode, backend="xla")
    assert_moe_close(np.asarray(out.astype(jnp.float32)), *p.args(), **p.kwargs(), mode=mode,
                     label=f"nvfp4_jax.moe xla {mode}")


@settings(max_examples=200 if DEEP else 12, deadline=None)
@given(nst.moe_problems(num_tokens=5, hidden_size=256, intermediate_size=128, num_experts=4, top_k=2),
       st.sampled_from(["trtllm_cutlass", "b12x"]), st.sampled_from([None, "fused"]))
def test_jax_moe_mosaic_path_within_bound(p, mode, routing):
    """The Mosaic path's dataflow on CPU: its Pallas-Triton glue kernels (scales, FC1 operand,
    FC1 epilogue, combine) in interpret mode around the XLA emulation of the grouped GEMM (FC2
    with whole-K scales: I = 128); ``routing="fused"``: routing, scales and the FC1 operand
    from one kernel."""
    from nvfp4_jax.moe.mosaic import MosaicMoEConfig

    config = None if routing is None else MosaicMoEConfig(block_m=8, routing=routing, skip_padding=True)
    out = nvfp4_jax.moe(
        jnp.asarray(p.hidden, jnp.bfloat16), fc1=nvfp4_jax.from_oracle(p.fc1),
        fc2=nvfp4_jax.from_oracle(p.fc2), fc1_input_scale=jnp.asarray(p.fc1_input_scale, jnp.float32),
        fc2_input_scale=jnp.asarray(p.fc2_input_scale, jnp.float32), topk_ids=jnp.asarray(p.topk_ids),
        topk_weights=jnp.asarray(p.topk_weights), activation=p.activation,
        gate_up_order=p.gate_up_order, mode=mode, backend="mosaic",
        config=config)
    assert_moe_close(np.asarray(out.astype(jnp.float32)), *p.args(), **p.kwargs(), mode=mode,
                     label=f"nvfp4_jax.moe mosaic (interpret) {mode} routing {routing}")


@settings(max_examples=1000 if DEEP else 60)
@given(nst.moe_problems(), st.sampled_from(["trtllm_cutlass", "flashinfer_fixed"]), st.booleans())
def test_trtllm_cutlass_and_fixed_pipelines_within_bound(p, pipeline, fast_math):
    out = T.run_pipeline(pipeline, *p.args(), **p.kwargs(), fast_math=fast_math)
    assert_moe_close(out, *p.args(), **p.kwargs(), label=pipeline)


def _within(p: nst.MoEProblem, pipeline: str) -> bool:
    out = T.run_pipeline(pipeline, *p.args(), **p.kwargs())
    return not (moe_violations(out, moe_bound(*p.args(), **p.kwargs())) > 0).any()


def _folded_scale_underflow(p: nst.MoEProblem) -> tuple[int, int, int]:
    """(subnormal, zero, total) folded block scales of the problem's fc1 + fc2 (checkpoint scale > 0)."""
    rt = T.cutedsl_b12x_moe_weights(*p.args()[3:], **p.kwargs())
    sub = zero = tot = 0
    for orig, fold in ((p.fc1.scales, rt.fc1_scales), (p.fc2.scales, rt.fc2_scales)):
        f = oracle.e4m3_decode(fold)[orig > 0]
        sub += int(((f > 0) & (f < 2.0**-6)).sum())
        zero += int((f == 0).sum())
        tot += f.size
    return sub, zero, tot


def test_fuzzer_finds_the_folding_and_shrinks_it_to_scale_underflow():
    """hypothesis FINDS a problem where the CUTEDSL-b12x folding leaves the bound; its shrunk
    form has folded block scales in E4M3's subnormal range (or flushed to zero); the fix passes
    the same property on it."""
    cfg = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck))
    ex = find(nst.moe_problems(), lambda p: not _within(p, "trtllm_cutedsl_b12x"), settings=cfg)
    sub, zero, tot = _folded_scale_underflow(ex)
    assert sub + zero > 0, f"shrunk counterexample {ex!r} has no subnormal/zero folded scale"
    # shrinking drives the problem to the smallest shape
    t, k = ex.topk_ids.shape
    assert t == 1 and k == 1 and ex.fc1.codes.shape[0] == 2, repr(ex)
    assert _within(ex, "flashinfer_fixed") and _within(ex, "trtllm_cutlass")
    # and the assertion explains it
    with pytest.raises(AssertionError, match="outside the derived interval") as info:
        assert_moe_close(T.run_pipeline("trtllm_cutedsl_b12x", *ex.args(), **ex.kwargs()),
                         *ex.args(), **ex.kwargs(), label="trtllm_cutedsl_b12x")
    assert "worst at token 0" in str(info.value) and "block scales" in str(info.value)
    print(f"found and shrunk: {ex!r}; folded scales subnormal {sub}/{tot}, zero {zero}/{tot}")


@settings(max_examples=200 if DEEP else 30)
@given(nst.moe_problems(sigma=nst.log_uniform(1e-3, 1e-2)))
def test_folding_fails_at_checkpoint_magnitudes(p):
    """At weight sigma <= 1e-2 (weight_scale_2 <~ 2e-5) the fold fails every problem, and every
    folded scale is subnormal or zero."""
    sub, zero, tot = _folded_scale_underflow(p)
    assert sub + zero == tot
    assert not _within(p, "trtllm_cutedsl_b12x")


@settings(max_examples=200 if DEEP else 15, deadline=None)
@given(st.sampled_from([3, 16]), st.data(), st.sampled_from([("trtllm_cutlass", "scalar"), ("b12x", "per_expert"),
                                                             ("b12x", "scalar")]))
def test_scales_kernel_is_the_oracle(e, data, mode_scale):
    """The one-program scales kernel (``scales.moe_scales_kernel``, interpret mode)
    gives the oracle's encode scales and alphas bit for bit, for weight_scale_2 and input
    scales drawn log-uniformly over the ranges the fuzzer uses (ModelOpt's ~2e-5 included)."""
    from test_moe_epilogue import assert_scales_kernel_is_oracle

    mode, act = mode_scale
    vec = lambda: np.asarray(data.draw(st.lists(nst.global_scales(), min_size=e, max_size=e)), np.float32)
    w1, w2, s1, s2 = vec(), vec(), vec() * 2688.0, vec() * 2688.0  # input scales: amax / 2688 like D
    assert_scales_kernel_is_oracle(w1, w2, s1, s2, e=e, mode=mode, activation_scale=act)


@settings(max_examples=120 if DEEP else 12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from([(3, 6, 24), (4, 22, 512), (8, 22, 512), (2, 8, 160)]), st.sampled_from([8, 16]),
       st.sampled_from(["routes", "tokens"]), st.data())
def test_routing_kernel_methods_are_the_grouping(shape, bm, method, data):
    """The routing kernel's "routes" and "tokens" methods (interpret mode) give exactly the
    grouping of an independent numpy sort for drawn routings: distinct experts per token,
    drawn from a handful (long groups, many experts without tokens) or from all E
    (nemotron's 512)."""
    from test_moe_epilogue import _numpy_block_routing

    from nvfp4_jax.moe import routing_kernel as rtk

    t, k, e = shape
    pool = data.draw(st.integers(k, e), label="experts in use")
    ids = np.stack([np.asarray(data.draw(st.permutations(range(pool)), label="token order"))[:k]
                    for _ in range(t)]).astype(np.int32)
    ids = np.asarray(data.draw(st.permutations(range(e))), np.int32)[ids]  # which experts
    got = rtk.routing_kernel(jnp.asarray(ids), e, bm, interpret=True, method=method)
    for name, w in zip(("sorted_route", "block_expert", "num_blocks", "route_pos"),
                       _numpy_block_routing(ids, e, bm), strict=True):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), w, err_msg=name)
