"""The Pallas-Triton MoE on the FP4 MMA (``MoEConfig.mma="fp4"``) on CPU, interpret mode: the
FC1 operand as NVFP4 codes + scale bytes (the oracle's bytes), both grouped GEMMs through
``fp4mma.dot_scaled``, the FC1 epilogue requantizing ``h`` to FC2's codes + scale bytes. Checked
in the parity suite's way: ``nvfp4_jax.moe`` against ``oracle.moe`` inside
``testing.assertions.moe_bound``'s interval with zero slack in the activation quantization, every
mode and activation; and the choice of MMA (``default_config`` sets "fp4" on SM 12.x only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import check_against_oracle, make_case

import nvfp4_jax
import oracle
from nvfp4_jax.gemm import fp4mma
from nvfp4_jax.moe import pallas_triton
from nvfp4_jax.moe.configs import Config, MoEConfig, default_config
from nvfp4_jax.moe.operand import fc1_operand
from nvfp4_jax.moe.routing import block_routing
from nvfp4_jax.testing import assert_moe_close
from oracle.formats import f32

FP4 = MoEConfig(Config(16, 32, 64, decode="bits"), Config(16, 32, 64, decode="bits"), mma="fp4")


def _run(case, *, mode, activation, order="up_gate", activation_scale=None, config=FP4,
         backend="pallas"):
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    kw = {} if activation_scale is None else {"activation_scale": activation_scale}
    f = jax.jit(lambda x, w1, w2, a, b, i, w: nvfp4_jax.moe(
        x, fc1=w1, fc2=w2, fc1_input_scale=a, fc2_input_scale=b, topk_ids=i, topk_weights=w,
        activation=activation, gate_up_order=order, mode=mode, backend=backend, config=config,
        **kw))
    out = f(jnp.asarray(hidden, jnp.bfloat16), nvfp4_jax.from_oracle(fc1),
            nvfp4_jax.from_oracle(fc2), jnp.asarray(s1, jnp.float32), jnp.asarray(s2, jnp.float32),
            jnp.asarray(ids, jnp.int32), jnp.asarray(wts, jnp.float32))
    return np.asarray(out.astype(jnp.float32), np.float64)


@pytest.fixture
def spy(monkeypatch):
    """Counts the ``dot_scaled`` calls the MoE kernels trace (the real primitive still runs)."""
    calls = []
    real = pallas_triton.dot_scaled
    monkeypatch.setattr(pallas_triton, "dot_scaled",
                        lambda *a: calls.append(a[1].shape) or real(*a))
    return calls


CASES = [  # (mode, activation, gate_up_order, activation_scale, make_case kwargs)
    # K tails: H = 96 and I = 96 are not multiples of block_k = 64
    ("trtllm_cutlass", "relu2", "up_gate", None, {"t": 5, "h": 96, "inter": 96, "e": 4, "k": 2}),
    ("trtllm_cutlass", "swiglu", "up_gate", None, {"t": 21, "h": 64, "inter": 32, "e": 6, "k": 2,
                                                   "routing": "skewed"}),
    ("trtllm_cutlass", "swiglu", "gate_up", None, {"t": 37, "h": 64, "inter": 64, "e": 4, "k": 1,
                                                   "routing": "one"}),
    ("b12x", "relu2", "up_gate", None, {"t": 9, "h": 64, "inter": 32, "e": 3, "k": 2,
                                        "scale_factor": 2.0**15}),
    ("b12x", "swiglu", "gate_up", None, {"t": 1, "h": 128, "inter": 64, "e": 4, "k": 3}),
    ("b12x", "relu2", "up_gate", "scalar", {"t": 6, "h": 64, "inter": 32, "e": 5, "k": 2}),
    ("trtllm_cutlass", "relu2", "up_gate", None, {"t": 9, "h": 64, "inter": 32, "e": 3, "k": 2,
                                                  "scale_factor": 2.0**15}),
]


@pytest.mark.parametrize("mode,activation,order,act_scale,shape", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-t{c[4]['t']}" for c in CASES])
def test_fp4_moe_meets_the_oracle(spy, mode, activation, order, act_scale, shape):
    case = make_case(np.random.default_rng(shape["t"] * 7 + shape["h"]), activation=activation,
                     **shape)
    if shape.get("scale_factor", 1.0) > 1:
        assert np.mean(case[3].scales < 0x08) > 0.5  # mostly E4M3-subnormal weight block scales
    out = _run(case, mode=mode, activation=activation, order=order, activation_scale=act_scale)
    # one dot_scaled per weight tile: FC1 (two for swiglu) and FC2
    assert len(spy) == (3 if activation == "swiglu" else 2)
    b = assert_moe_close(out, *case, mode=mode, activation=activation, gate_up_order=order,
                         activation_scale=act_scale, quant_slack=0.0,
                         label=f"moe fp4 {mode} {activation}")
    assert np.isfinite(out).all() and np.mean(out == b.ref) > 0.5


@pytest.mark.parametrize("mode,activation", [("trtllm_cutlass", "swiglu"), ("b12x", "relu2")])
def test_fp4_intermediate_h_meets_the_stagewise_bounds(mode, activation):
    """``return_intermediates``: the per-route ``h`` and the output, stage by stage."""
    case = make_case(np.random.default_rng(11), t=7, h=64, inter=32, e=3, k=2,
                     activation=activation)
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    act_scale = "scalar" if mode == "trtllm_cutlass" else "per_expert"
    fn = lambda *a: pallas_triton.moe_pallas(
        *a, activation=activation, gate_up_order="up_gate", mode=mode,
        activation_scale=act_scale, config=FP4, interpret=True, return_intermediates=True)
    out, inter = jax.jit(fn)(jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(ids, jnp.int32),
                             jnp.asarray(wts, jnp.float32), nvfp4_jax.from_oracle(fc1),
                             nvfp4_jax.from_oracle(fc2), jnp.asarray(s1), jnp.asarray(s2))
    f = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    check_against_oracle(case, f(out), f(inter["h"]), mode=mode, activation=activation)


def test_fc1_operand_codes_are_the_oracles_quantization():
    """Each sorted row holds its token quantized with its expert's encode scale (per_expert),
    codes and scale bytes as ``oracle.quantize``; padding rows are zero bytes."""
    rng = np.random.default_rng(0)
    t, h, e, k, bm = 7, 80, 4, 2, 16
    x = rng.standard_normal((t, h)) * np.exp2(rng.uniform(-12, 4, (t, h // 16))).repeat(16, 1)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    g1 = f32(2688.0 / np.abs(x).max() * np.exp2(rng.uniform(-4, 4, e)))
    rg1 = f32(1.0 / g1)
    br = block_routing(jnp.asarray(ids), e, bm)
    for recipe in ("trtllm", "b12x"):
        codes, scales = fc1_operand(jnp.asarray(x, jnp.bfloat16), br.sorted_route, br.block_expert,
                                    br.num_blocks, jnp.asarray(g1), jnp.asarray(rg1), top_k=k,
                                    block_m=bm, recipe=recipe, per_expert=True, interpret=True,
                                    permute=False, codes=True)
        codes, scales = np.asarray(codes), np.asarray(scales)
        routes, experts = np.asarray(br.sorted_route), np.asarray(br.block_expert)
        nb = int(br.num_blocks[0])
        for p in range(nb * bm):
            if routes[p] >= t * k:
                assert not codes[p].any() and not scales[p].any(), p
                continue
            want = oracle.quantize(x[routes[p] // k][None], recipe,
                                   encode_scale=float(g1[experts[p // bm]]))
            np.testing.assert_array_equal(scales[p], want.scales[0], err_msg=f"{recipe} row {p}")
            np.testing.assert_array_equal(codes[p], want.codes[0], err_msg=f"{recipe} row {p}")


def test_nonfinite_token_gives_a_nan_row_only():
    """docs/input-policy.md (traced, unchecked): the token's output row is NaN, others finite."""
    case = make_case(np.random.default_rng(4), t=4, h=64, inter=32, e=3, k=2)
    hidden = case[0].copy()
    hidden[2, 17] = np.nan
    out = _run((hidden, *case[1:]), mode="trtllm_cutlass", activation="relu2")
    assert np.isnan(out[2]).all() and np.isfinite(np.delete(out, 2, axis=0)).all()


def test_default_config_picks_fp4_on_sm12x_only(monkeypatch, spy):
    monkeypatch.setattr(fp4mma, "is_sm12x", lambda: False)
    assert default_config(64, 8).mma == "bf16"
    case = make_case(np.random.default_rng(8), t=3, h=128, inter=64, e=4, k=2)
    _run(case, mode="b12x", activation="relu2", config=None)
    assert spy == []  # bf16 MMA
    monkeypatch.setattr(fp4mma, "is_sm12x", lambda: True)
    assert default_config(64, 8).mma == "fp4"
    assert default_config(64, 8, mma="bf16").mma == "bf16"
    out = _run(case, mode="b12x", activation="relu2", config=None)
    assert len(spy) == 2
    assert_moe_close(out, *case, mode="b12x", activation="relu2", quant_slack=0.0)


def test_config_mma_none_follows_the_device_and_explicit_bf16_stays(monkeypatch, spy):
    monkeypatch.setattr(fp4mma, "is_sm12x", lambda: True)
    case = make_case(np.random.default_rng(9), t=3, h=64, inter=32, e=3, k=2)
    tiles = (Config(16, 32, 64, decode="bits"), Config(16, 32, 64, decode="bits"))
    _run(case, mode="trtllm_cutlass", activation="relu2", config=MoEConfig(*tiles, mma="bf16"))
    assert spy == []
    _run(case, mode="trtllm_cutlass", activation="relu2", config=MoEConfig(*tiles))
    assert len(spy) == 2
    # tiles the FP4 MMA cannot take (block_k < 64) keep the bf16 MMA when mma is the device's
    small = (Config(16, 32, 32, decode="bits"), Config(16, 32, 32, decode="bits"))
    out = _run(case, mode="trtllm_cutlass", activation="relu2", config=MoEConfig(*small))
    assert len(spy) == 2
    assert_moe_close(out, *case, mode="trtllm_cutlass", activation="relu2", quant_slack=0.0)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"MoEConfig.mma: expected one of \('bf16', 'fp4'\)"):
        MoEConfig(mma="fp8")
    with pytest.raises(ValueError, match="mma 'fp4' needs block_k >= 64"):
        MoEConfig(Config(16, 32, 32), Config(16, 32, 64), mma="fp4")
    with pytest.raises(ValueError, match="codes: the NVFP4 operand is written in natural K order"):
        fc1_operand(jnp.zeros((2, 256), jnp.bfloat16), jnp.zeros((16,), jnp.int32),
                    jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), jnp.ones((1,)),
                    jnp.ones((1,)), top_k=1, block_m=16, recipe="trtllm", per_expert=False,
                    codes=True)


def test_default_decode_tiles_per_family(monkeypatch):
    """Decode tiles (BM 16): on sm_90 the measured ``SM90_DECODE`` entry of the layer's FC1
    kind for both GEMMs (moe-candidates-h200.json), prefill tiles untouched by it; elsewhere
    the SM12x rule (BN 128 where two programs per SM remain) and the 4-byte decode.
    Nemotron-shaped at T = 8 (48 routes of 128 experts), Qwen3-shaped gated."""
    from nvfp4_jax.moe import configs as moe_configs

    kw = dict(inter=1856, hidden=2688, gated=False, mma="bf16")
    monkeypatch.setattr(moe_configs, "is_sm90", lambda: True)
    for gated in (False, True):
        c = default_config(48, 128, **{**kw, "gated": gated})
        assert c.fc1 == c.fc2 == moe_configs.SM90_DECODE[gated] and c.fc1.block_m == 16
        assert c.mma == "bf16"
    c = default_config(4096 * 8, 128, inter=768, hidden=2048, gated=True, mma="bf16")
    assert c.fc1.block_m == 64 and c.fc1.decode == "asm2m"  # prefill: the general rule
    monkeypatch.setattr(moe_configs, "is_sm90", lambda: False)
    c = default_config(48, 128, **kw)
    assert (c.fc1.block_m, c.fc1.block_n, c.fc2.block_n, c.fc1.decode) == (16, 128, 128, "asmm")
