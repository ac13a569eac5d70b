"""oracle.moe against a brute-force per-route computation with Python Fractions, and b12x."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from moe_cases import make_case

import oracle
from oracle.formats import bf16_round, f32


def _frac_bf16(x: Fraction) -> float:
    return float(bf16_round(np.float64(float(x))))  # float(x) is correctly rounded to float64


def _brute(case, mode, activation, gate_up_order, activation_scale=None):
    """Per route, per element, with Fractions; quantization reuses oracle.quantize (tested elsewhere)."""
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    t, k = ids.shape
    e = fc1.codes.shape[0]
    recipe = "trtllm" if mode == "trtllm_cutlass" else "b12x"
    s1, s2 = np.float32(s1), np.float32(s2)
    ws1, ws2 = np.float32(fc1.decode_scale), np.float32(fc2.decode_scale)
    one = np.float32(1)
    if mode == "trtllm_cutlass" or activation_scale == "scalar":
        g1 = np.full(e, one / s1.max(), np.float32)
        g2 = np.full(e, one / s2.max(), np.float32)
    else:
        g1, g2 = one / s1, one / s2
    if mode == "trtllm_cutlass":
        a1 = one / (g1 * (one / ws1))
        a2 = one / (g2 * (one / ws2))
    else:
        a1, a2 = ws1 / g1, ws2 / g2
    w1 = oracle.dequantize(fc1, include_decode_scale=False)
    w2 = oracle.dequantize(fc2, include_decode_scale=False)
    out = np.zeros(hidden.shape)
    inter = w2.shape[2]
    for ti in range(t):
        acc = [Fraction(0)] * hidden.shape[1]
        for j in range(k):
            ex = int(ids[ti, j])
            xq = oracle.quantize(hidden[ti], recipe, encode_scale=float(g1[ex]))
            xv = [Fraction(v) for v in oracle.dequantize(xq, include_decode_scale=False)]
            u = []
            for r in range(w1.shape[1]):
                dot = sum((xv[c] * Fraction(w1[ex, r, c]) for c in range(len(xv))), Fraction(0))
                val = dot * Fraction(float(a1[ex]))
                u.append(_frac_bf16(val) if mode == "trtllm_cutlass" else float(val))
            u = np.array(u)
            if activation == "relu2":
                h = np.maximum(u, 0) ** 2
            else:
                first, second = u[:inter], u[inter:]
                up, gate = (first, second) if gate_up_order == "up_gate" else (second, first)
                h = np.array([g / (1 + math.exp(-g)) * uu for g, uu in zip(gate, up)])
            h = bf16_round(h)
            hq = oracle.quantize(h, recipe, encode_scale=float(g2[ex]))
            hv = [Fraction(v) for v in oracle.dequantize(hq, include_decode_scale=False)]
            for c in range(hidden.shape[1]):
                dot = sum((hv[m] * Fraction(w2[ex, c, m]) for m in range(inter)), Fraction(0))
                d = dot * Fraction(float(a2[ex]))
                wt = Fraction(float(np.float32(wts[ti, j])))
                if mode == "trtllm_cutlass":
                    acc[c] += Fraction(float(f32(float(wt * Fraction(_frac_bf16(d))))))
                else:
                    acc[c] += wt * d
        out[ti] = [_frac_bf16(a) for a in acc]
    return out


@pytest.mark.parametrize("mode", ["trtllm_cutlass", "b12x"])
@pytest.mark.parametrize("activation,order", [("relu2", "up_gate"), ("swiglu", "up_gate"), ("swiglu", "gate_up")])
def test_oracle_matches_bruteforce(mode, activation, order):
    case = make_case(np.random.default_rng(7), t=3, h=32, inter=32, e=4, k=2, activation=activation)
    got = oracle.moe(*case, activation=activation, gate_up_order=order, mode=mode)
    want = _brute(case, mode, activation, order)
    # the activation (silu) differs between math.exp and np.exp by an ulp of float64 at most,
    # far below a bf16 tie except by measure-zero accident: require exact equality
    np.testing.assert_array_equal(got, want)


def test_oracle_b12x_scalar_activation_scale():
    case = make_case(np.random.default_rng(8), t=2, h=32, inter=16, e=3, k=2, activation="relu2")
    got = oracle.moe(*case, activation="relu2", mode="b12x", activation_scale="scalar")
    want = _brute(case, "b12x", "relu2", "up_gate", activation_scale="scalar")
    np.testing.assert_array_equal(got, want)


def test_oracle_outputs_are_bf16_and_trace_consistent():
    case = make_case(np.random.default_rng(9), t=5, h=64, inter=32, e=6, k=3, activation="swiglu")
    tr = oracle.moe_trace(*case, activation="swiglu", mode="trtllm_cutlass")
    assert np.array_equal(bf16_round(tr.out), tr.out)
    assert np.array_equal(bf16_round(tr.u), tr.u) and np.array_equal(bf16_round(tr.d), tr.d)
    # h_override with the oracle's own h reproduces the output
    tr2 = oracle.moe_trace(*case, activation="swiglu", mode="trtllm_cutlass", h_override=tr.h)
    np.testing.assert_array_equal(tr2.out, tr.out)


def test_oracle_modes_differ_only_by_rounding():
    case = make_case(np.random.default_rng(10), t=8, h=64, inter=64, e=4, k=2, activation="relu2")
    a = oracle.moe(*case, mode="trtllm_cutlass")
    b = oracle.moe(*case, mode="b12x", activation_scale="scalar")
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert 0 < rel < 0.05


def test_oracle_errors_name_arguments():
    hidden, ids, wts, fc1, fc2, s1, s2 = make_case(np.random.default_rng(0), t=2, h=32, inter=16, e=2, k=1)
    with pytest.raises(ValueError, match="mode"):
        oracle.moe(hidden, ids, wts, fc1, fc2, s1, s2, mode="cutlass")
    with pytest.raises(ValueError, match="topk_ids"):
        oracle.moe(hidden, ids + 5, wts, fc1, fc2, s1, s2)
    with pytest.raises(ValueError, match="hidden"):
        oracle.moe(hidden + 1e-5, ids, wts, fc1, fc2, s1, s2)
    with pytest.raises(ValueError, match="activation"):
        oracle.moe(hidden, ids, wts, fc1, fc2, s1, s2, activation="gelu")


# ---------------------------------------------------------------------------------------
# peer: b12x's pure-torch reference (b12x 1.5.1), see cpu-peers.md 2.5
# ---------------------------------------------------------------------------------------

def _import_b12x_reference():
    try:
        import os
        import sys
        import types

        import b12x.moe._shared as sh

        if "b12x.moe._shared.kernels" not in sys.modules:
            pkg = types.ModuleType("b12x.moe._shared.kernels")
            pkg.__path__ = [os.path.join(os.path.dirname(sh.__file__), "kernels")]
            sys.modules["b12x.moe._shared.kernels"] = pkg
        from b12x._lib.intrinsics import swizzle_block_scale
        from b12x.moe._shared.kernels import reference

        return reference, swizzle_block_scale
    except Exception as exc:  # noqa: BLE001 - any import failure means "peer absent"
        pytest.skip(f"b12x 1.5.1 reference not importable ({type(exc).__name__}: {exc}); "
                    "install per shared/docs/cpu-peers.md 2.5")


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("activation_scale", ["per_expert", "scalar"])
def test_oracle_b12x_mode_matches_b12x_reference(activation, activation_scale):
    reference, swizzle_block_scale = _import_b12x_reference()
    import torch

    rng = np.random.default_rng(11)
    hidden, ids, wts, fc1, fc2, s1, s2 = case = make_case(
        rng, t=6, h=128, inter=128, e=4, k=2, activation=activation)
    g1, g2, a1, a2 = oracle.moe_scales(fc1, fc2, s1, s2, "b12x", activation_scale)
    e = fc1.codes.shape[0]

    def sw(t):
        rows, kv = t.scales.shape[1:]
        out = [swizzle_block_scale(torch.from_numpy(t.scales[i]).view(torch.float8_e4m3fn).reshape(rows, kv))
               for i in range(e)]
        return torch.stack([o.reshape(-1) for o in out]) if out[0].dim() else torch.stack(out)

    try:
        got = reference.moe_reference_nvfp4(
            torch.tensor(hidden, dtype=torch.float32).to(torch.bfloat16),
            torch.from_numpy(fc1.codes), sw(fc1), torch.tensor(a1, dtype=torch.float32),
            torch.from_numpy(fc2.codes), sw(fc2), torch.tensor(a2, dtype=torch.float32),
            torch.tensor(g1 if activation_scale == "per_expert" else g1[0], dtype=torch.float32),
            torch.tensor(g2 if activation_scale == "per_expert" else g2[0], dtype=torch.float32),
            torch.from_numpy(ids.astype(np.int64)), torch.tensor(wts, dtype=torch.float32),
            e, hidden.shape[1], fc2.codes.shape[2] * 2,
            activation="silu" if activation == "swiglu" else "relu2",
        )
    except TypeError as exc:
        pytest.skip(f"b12x reference signature differs from 1.5.1: {exc}")
    got = got.to(torch.float32).numpy().astype(np.float64)
    want = oracle.moe(*case, activation=activation, mode="b12x", activation_scale=activation_scale)
    # b12x sums fp32 matmuls (fp32 accumulation, fp32 activation) where the oracle is exact;
    # both round once to bf16 at h and at the output, so values agree except where an
    # fp32-level difference crosses a bf16 rounding boundary: at most one bf16 ulp of the
    # output, or (rarely) a flipped FP4 code of h moving one route by one code step
    ulp = np.spacing(np.abs(want).astype(np.float32).astype(np.float64)) * 2.0**16
    diff = np.abs(got - want)
    assert np.mean(diff <= ulp) > 0.99, f"mismatch beyond 1 bf16 ulp in {np.mean(diff > ulp):.3%}"
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2
