"""nvfp4_jax.audit: folded-scale statistics, batched == per-T evaluation, checkpoint audit."""

from __future__ import annotations

import numpy as np

import oracle
from nvfp4_jax import audit as A
from nvfp4_jax import checkpoint as C


def test_folded_scale_stats_on_known_scales():
    # scales 448, 224, 0.25 times w_scale_2 = 2^-9: 0.875 (normal), 0.4375 (normal),
    # 2^-11 (rounds to 0); a zero checkpoint scale is left out
    s = oracle.e4m3_encode(np.array([[448.0, 224.0, 0.25, 0.0]]))
    st = A.folded_scale_stats(s, np.array([2.0**-9]))
    assert st.blocks == 3 and st.zero == 1 / 3 and st.subnormal == 0
    assert st.max_rel_error == 1.0
    s2 = oracle.e4m3_encode(np.array([[3.0 * 2**-3]]))  # x 2^-7 = 1.5 subnormal units -> 2 (tie to even)
    st2 = A.folded_scale_stats(s2, np.array([2.0**-7]))
    assert st2.subnormal == 1.0 and abs(st2.mean_rel_error - 1 / 3) < 1e-12


def test_batched_evaluation_equals_separate_calls(tmp_path):
    d = C.write_test_checkpoint(str(tmp_path), num_experts=4, hidden_size=64, intermediate_size=32,
                                sigma=0.01, dense=False)
    layer = next(C.load(d).layers())
    kw = {"tokens": (1, 3), "top_k": 2, "seed": 3}
    a = A.moe_errors(layer, batched=True, **kw)
    b = A.moe_errors(layer, batched=False, **kw)
    assert a == b
    assert a["trtllm_cutedsl_b12x"][3] > 0.05 and a["trtllm_cutlass"][3] < 2e-3


def test_checkpoint_audit_reports_every_layer(tmp_path):
    d = C.write_test_checkpoint(str(tmp_path), num_layers=2, num_experts=3, sigma=0.01)
    reps = A.audit_checkpoint(d, tokens=(1, 2), progress=False)
    kinds = sorted(r.kind for r in reps)
    assert kinds == ["dense", "dense", "moe", "moe"]
    moe = next(r for r in reps if r.kind == "moe")
    assert set(moe.scales) == {"fc1", "fc2"} and moe.scales["fc1"].subnormal > 0.9
    assert set(moe.moe_errors) == set(A.SEMANTICS)
    j = A.to_json(reps, d)
    assert j["layers"][0]["scales"]["weight"]["blocks"] > 0
    txt = A.format_report(reps, d)
    assert "CUTEDSL-b12x (folded)" in txt and "T=2" in txt


def test_default_layer_scales_look_like_issue_21461():
    """A 2-expert slice of the default layer: weight_scale_2 ~ 2e-5, ~1 % zero folded scales."""
    layer = A.default_layer(num_experts=2)
    assert 1.5e-5 < layer.fc1.decode_scale.mean() < 2.6e-5
    f1, _ = A.moe_fold_factors(layer)
    st = A.folded_scale_stats(layer.fc1.scales, f1, codes=layer.fc1.codes)
    assert st.subnormal > 0.95 and 0.002 < st.zero < 0.03 and 0.10 < st.mean_rel_error < 0.20
    assert 0.10 < st.weight_rel_error < 0.25
    assert layer.activation == "relu2" and layer.num_experts == 512
