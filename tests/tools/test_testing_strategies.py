"""nvfp4_jax.testing: the strategies reach the regimes they promise; the assertions bite and explain."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from moe_cases import make_case

import oracle
from nvfp4_jax.testing import assert_gemm_close, assert_moe_close, moe_bound, quantize_interval
from nvfp4_jax.testing import strategies as nst

FIND = settings(max_examples=500, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def _scales(inp):
    return oracle.e4m3_decode(inp.quantize("trtllm").scales)


@pytest.mark.parametrize("regime, check", [
    ("subnormal", lambda s: ((s > 0) & (s < 2.0**-6)).any()),
    ("underflow", lambda s: (s == 0).all()),
    ("overflow_edge", lambda s: (s == 448.0).any()),
])
def test_nvfp4_inputs_reach_each_scale_regime(regime, check):
    ex = find(nst.nvfp4_inputs(regimes=st.just(regime), kinds=st.just("random")),
              lambda inp: check(_scales(inp)), settings=FIND)
    assert (ex.regimes == regime).all()


def test_zero_and_outlier_blocks():
    z = find(nst.nvfp4_inputs(kinds=st.just("zero")), lambda inp: True, settings=FIND)
    assert (z.x == 0).all() and (_scales(z) == 0).all()
    o = find(nst.nvfp4_inputs(kinds=st.just("outlier"), regimes=st.just("normal")),
             lambda inp: True, settings=FIND)
    blocks = np.abs(o.x.reshape(-1, 16))
    top = np.sort(blocks, axis=1)
    assert (top[:, -2] <= top[:, -1] / 8).all()  # one element dominates each block


@settings(max_examples=50)
@given(nst.global_scales())
def test_global_scales_are_fp32_and_in_range(d):
    assert float(oracle.f32(d)) == d and 2.0**-20 <= d <= 2.0**6


@settings(max_examples=30)
@given(nst.checkpoint_weights(shape=(2, 32, 64)))
def test_checkpoint_weights_are_modelopt_quantized(cw):
    assert 1e-3 <= cw.sigma <= 1e-1
    assert cw.nvfp4.decode_scale.shape == (2,)
    for e in range(2):
        want = oracle.quantize(cw.w[e].astype(np.float64), "modelopt")
        np.testing.assert_array_equal(cw.nvfp4.codes[e], want.codes)
        assert cw.nvfp4.decode_scale[e] == float(want.decode_scale)


@settings(max_examples=60)
@given(nst.routings(num_experts=6, top_k=3))
def test_routings_are_valid(r):
    ids, wts = r
    assert ids.dtype == np.int32 and wts.dtype == np.float32
    assert all(len(set(row)) == 3 for row in ids.tolist())
    assert (wts > 0).all() and np.allclose(wts.sum(1), 1, atol=1e-6)


def test_routings_reach_empty_experts():
    ex = find(nst.routings(num_tokens=8, num_experts=8, top_k=2, kind=st.just("empty_experts")),
              lambda r: len(np.unique(r[0])) <= 4, settings=FIND)
    assert len(np.unique(ex[0])) <= 4


# ---------------------------------------------------------------------------------------
# assertions
# ---------------------------------------------------------------------------------------

def test_gemm_assertion_accepts_oracle_and_names_the_worst_element():
    rng = np.random.default_rng(0)
    x = oracle.bf16_round(rng.standard_normal((4, 64)))
    w = oracle.quantize(oracle.bf16_round(rng.standard_normal((8, 64)) * 0.01), "modelopt")
    ref = oracle.gemm_w4a16(x, w)
    assert_gemm_close(oracle.bf16_round(ref), x, w)
    bad = oracle.bf16_round(ref)
    bad[2, 5] *= 1.05
    with pytest.raises(AssertionError, match=r"worst at \[2, 5\]") as info:
        assert_gemm_close(bad, x, w, label="mygemm")
    msg = str(info.value)
    assert "mygemm" in msg and "bound" in msg and "block scales" in msg


def test_quantize_interval_covers_ties_with_one_step():
    g = np.array([1.0])
    x = np.zeros((1, 16))
    x[0, 0] = 6.0      # block max -> scale 1
    x[0, 1] = 2.5      # an exact E2M1 tie (RNE -> 2)
    x[0, 2] = 2.2
    lo, hi = quantize_interval(x, x, g)
    assert lo[0, 1] == 2.0 and hi[0, 1] == 3.0  # either side of the tie
    assert lo[0, 2] == hi[0, 2] == 2.0          # far from a tie: a point
    assert lo[0, 0] == hi[0, 0] == 6.0


@pytest.mark.parametrize("mode", ["trtllm_cutlass", "b12x"])
def test_moe_bound_contains_oracle_and_is_tight(mode):
    rng = np.random.default_rng(1)
    case = make_case(rng, t=8, h=64, inter=32, e=4, k=2, activation="swiglu")
    b = moe_bound(*case, activation="swiglu", mode=mode)
    assert (b.lo <= b.ref).all() and (b.ref <= b.hi).all()
    assert np.mean(b.lo == b.hi) > 0.9  # collapses to the oracle almost everywhere
    assert_moe_close(b.ref, *case, activation="swiglu", mode=mode)
    bad = b.ref.copy()
    bad[3, 7] = bad[3, 7] * 1.1 + 1e-3
    with pytest.raises(AssertionError, match="worst at token 3, column 7"):
        assert_moe_close(bad, *case, activation="swiglu", mode=mode, bound=b)
