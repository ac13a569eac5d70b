"""nvfp4_jax.checkpoint: our safetensors reader/writer agrees with the safetensors package;
ModelOpt layouts (per-expert w1/w2/w3 and gate/up/down naming) load as oracle.moe stacks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
from nvfp4_jax import checkpoint as C
from nvfp4_jax.interop import modelopt as MO


def test_reader_matches_safetensors_package(tmp_path):
    p = str(tmp_path / "x.safetensors")
    t = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
         "b": torch.tensor([1.0, 448.0, 2.0**-9, 0.0]).to(torch.float8_e4m3fn),
         "c": torch.arange(6, dtype=torch.uint8).reshape(2, 3), "d": torch.tensor(3.5)}
    save_file(t, p)
    f = C.SafetensorsFile(p)
    np.testing.assert_array_equal(f.get("a"), t["a"].numpy())
    np.testing.assert_array_equal(f.get("b"), [0x38, 0x7E, 0x01, 0x00])  # bytes, never a numeric cast
    assert f.dtype("b") == "F8_E4M3" and f.get("d").shape == ()


def test_writer_read_by_safetensors_package(tmp_path):
    p = str(tmp_path / "y.safetensors")
    C.write_safetensors(p, {"w": (np.arange(8, dtype=np.uint8).reshape(2, 4), "U8"),
                            "s": (np.array([0x38, 0x01], np.uint8), "F8_E4M3"),
                            "g": (np.array(2.5e-5, np.float32), "F32")})
    t = load_file(p)
    assert t["s"].dtype == torch.float8_e4m3fn and t["s"].float().tolist() == [1.0, 2.0**-9]
    assert t["w"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and t["g"].item() == np.float32(2.5e-5)


@pytest.mark.parametrize("naming, activation", [("gate_up_down", "relu2"), ("w123", "swiglu"),
                                                ("gate_up_down", "swiglu"), ("w123", "relu2")])
def test_test_checkpoint_loads_as_oracle_stacks(tmp_path, naming, activation):
    d = C.write_test_checkpoint(str(tmp_path), num_layers=2, num_experts=3, activation=activation,
                                naming=naming)
    ck = C.load(d)
    layers = list(ck.layers())
    dense = [l for l in layers if isinstance(l, C.DenseLayer)]
    moe = [l for l in layers if isinstance(l, C.MoELayer)]
    assert len(dense) == 2 and len(moe) == 2
    m = moe[0]
    r = 64 if activation == "swiglu" else 32
    assert m.fc1.codes.shape == (3, r, 32) and m.fc2.codes.shape == (3, 64, 16)
    assert m.activation == activation and m.experts == (0, 1, 2) and m.num_experts == 3
    assert m.fc1_input_scale.shape == (3,) and np.all(m.fc1_input_scale > 0)
    # fc1 rows are [up; gate] (TRT-LLM fc31) and bit-identical to the stored tensors
    up = MO.expert_prefix(m.name, 1, "up", naming)
    np.testing.assert_array_equal(m.fc1.codes[1, :32], ck.get(f"{up}.weight"))
    if activation == "swiglu":
        gate = MO.expert_prefix(m.name, 1, "gate", naming)
        np.testing.assert_array_equal(m.fc1.scales[1, 32:], ck.get(f"{gate}.weight_scale"))
    assert m.fc2.decode_scale[2] == ck.get(f"{MO.expert_prefix(m.name, 2, 'down', naming)}.weight_scale_2")
    # the quantized weights run through the oracle MoE
    x = oracle.bf16_round(np.random.default_rng(0).standard_normal((3, 64)))
    out = oracle.moe(x, np.array([[0, 2], [1, 0], [2, 1]]), oracle.f32(np.full((3, 2), 0.5)),
                     m.fc1, m.fc2, m.fc1_input_scale, m.fc2_input_scale, activation=activation)
    assert np.isfinite(out).all() and np.abs(out).max() > 0
    sub = list(ck.layers(max_experts=2))
    assert next(x.experts for x in sub if isinstance(x, C.MoELayer)) == (0, 1)


def test_checkpoint_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        C.load(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        C.load(str(tmp_path))
    d = C.write_test_checkpoint(str(tmp_path / "ck"))
    with open(os.path.join(d, MO.QUANT_CONFIG_FILE), "w") as f:
        json.dump({"quantization": {"quant_algo": "FP8"}}, f)
    with pytest.raises(ValueError, match="FP8"):
        C.load(d)


def test_modelopt_fused_gate_up_takes_max_scale_with_warning():
    rng = np.random.default_rng(0)
    g = MO.quantize_linear(rng.standard_normal((16, 32)).astype(np.float32) * 0.01, 1.0)
    u = MO.quantize_linear(rng.standard_normal((16, 32)).astype(np.float32) * 0.02, 1.0)
    with pytest.warns(UserWarning, match="without requantizing"):
        f = MO.fuse_gate_up(g, u)
    assert f.weight_scale_2 == max(g.weight_scale_2, u.weight_scale_2)
    np.testing.assert_array_equal(f.weight[:16], u.weight)  # up first (TRT-LLM fc31)
