"""Damaged checkpoints end in a clean ``CheckpointError`` naming the file (and the tensor), or
load to exactly what the damaged bytes say; never another exception, never a hang.

A small ModelOpt-like NVFP4 checkpoint (relu2 MoE layer, 2 experts, plus one dense linear) is
written byte by byte here (``checkpoint.write_safetensors``, random codes and scale bytes), as
one file or as two shards with ``model.safetensors.index.json``; hypothesis then damages it:
truncations, bit flips in the header and in the data, absurd header lengths, non-JSON headers,
wrong dtypes and shapes, missing scales, missing or wrong index entries.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvfp4_jax import checkpoint as C
from nvfp4_jax.cli import main
from nvfp4_jax.interop import modelopt as MO

H, I, E = 32, 16, 2  # hidden, intermediate, experts: fc1 (up) [I, H], fc2 (down) [H, I]
LAYER = "model.layers.0.mixer"
DENSE = f"{LAYER}.shared_experts.up_proj"
SETTINGS = settings(max_examples=60, deadline=2000, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
SAFETENSORS_DTYPES = ["BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "I16", "U16", "F16", "BF16",
                      "I32", "U32", "F32", "F64", "I64", "U64", "F4", "XX"]


def _linear(rng, n: int, k: int) -> dict[str, tuple[np.ndarray, str]]:
    return {"weight": (rng.integers(0, 256, (n, k // 2), dtype=np.uint8), "U8"),
            "weight_scale": (rng.integers(0x08, 0x7F, (n, k // 16), dtype=np.uint8), "F8_E4M3"),
            "weight_scale_2": (np.array(rng.uniform(1e-5, 1e-3), np.float32), "F32"),
            "input_scale": (np.array(rng.uniform(1e-3, 1e-2), np.float32), "F32")}


def tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    out = {}
    prefixes = {DENSE: (I, H)}
    for e in range(E):
        prefixes[f"{LAYER}.experts.{e}.up_proj"] = (I, H)
        prefixes[f"{LAYER}.experts.{e}.down_proj"] = (H, I)
    for p, (n, k) in prefixes.items():
        out.update({f"{p}.{s}": v for s, v in _linear(rng, n, k).items()})
    return out


def write(d: str, ts: dict, *, shards: int = 1) -> dict[str, str]:
    """Write the checkpoint into ``d``; returns tensor -> file name."""
    os.makedirs(d, exist_ok=True)
    names = sorted(ts)
    where = {}
    if shards == 1:
        C.write_safetensors(os.path.join(d, "model.safetensors"), ts)
        where = dict.fromkeys(names, "model.safetensors")
    else:
        for i in range(shards):
            fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: ts[n] for n in names[i::shards]}
            C.write_safetensors(os.path.join(d, fn), part)
            where.update(dict.fromkeys(part, fn))
        with open(os.path.join(d, C.INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": where}, f)
    with open(os.path.join(d, MO.QUANT_CONFIG_FILE), "w") as f:
        json.dump(MO.quant_config(), f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"num_experts_per_tok": 1, "mlp_hidden_act": "relu2"}, f)
    return where


def load_everything(d: str) -> list:
    ck = C.load(d)
    layers = list(ck.layers())
    for n in ck.names():  # every tensor, not only the NVFP4 ones
        ck.get(n)
    return layers


def check_layers(layers: list, ts: dict) -> None:
    """The loaded layers are exactly the tensors ``ts`` (the bytes the files hold)."""
    dense = [x for x in layers if isinstance(x, C.DenseLayer)]
    moe = [x for x in layers if isinstance(x, C.MoELayer)]
    assert [x.name for x in dense] == [DENSE] and [x.name for x in moe] == [LAYER]
    np.testing.assert_array_equal(dense[0].weight.codes, ts[f"{DENSE}.weight"][0])
    np.testing.assert_array_equal(dense[0].weight.scales, ts[f"{DENSE}.weight_scale"][0])
    assert dense[0].weight.decode_scale == ts[f"{DENSE}.weight_scale_2"][0]
    m = moe[0]
    for fc, role in ((m.fc1, "up_proj"), (m.fc2, "down_proj")):
        for e in range(E):
            p = f"{LAYER}.experts.{e}.{role}"
            np.testing.assert_array_equal(fc.codes[e], ts[f"{p}.weight"][0])
            np.testing.assert_array_equal(fc.scales[e], ts[f"{p}.weight_scale"][0])
            assert fc.decode_scale[e] == ts[f"{p}.weight_scale_2"][0]
    assert m.activation == "relu2" and m.experts == tuple(range(E))


def assert_clean(exc: C.CheckpointError, d: str) -> None:
    assert os.path.commonpath([os.path.abspath(exc.file), os.path.abspath(d)]) == os.path.abspath(d)
    assert exc.file in str(exc) and exc.reason
    if exc.tensor is not None:
        assert repr(exc.tensor) in str(exc)


def outcome(d: str, expected: dict | None) -> str:
    """Load ``d``: a CheckpointError (checked) or a result equal to ``expected`` (if given)."""
    try:
        layers = load_everything(d)
    except C.CheckpointError as exc:
        assert_clean(exc, d)
        return "error"
    if expected is not None:
        check_layers(layers, expected)
    return "ok"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One valid checkpoint per layout; the fuzz copies and damages them."""
    ts = tensors()
    out = {}
    for shards in (1, 2):
        d = str(tmp_path_factory.mktemp(f"pristine{shards}"))
        out[shards] = (d, write(d, ts, shards=shards))
    return ts, out


def fresh(pristine, tmp_path, shards: int) -> tuple[str, dict[str, str]]:
    src, where = pristine[1][shards]
    d = str(tmp_path / f"ck{np.random.default_rng().integers(1 << 62)}")
    shutil.copytree(src, d)
    return d, where


def test_pristine_checkpoints_load_exactly(pristine):
    ts, dirs = pristine
    for d, _ in dirs.values():
        check_layers(load_everything(d), ts)


def _header(path: str) -> tuple[int, dict, bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite(path: str, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


@SETTINGS
@given(shards=st.sampled_from([1, 2]), which=st.integers(0, 10**6), frac=st.floats(0, 1),
       kind=st.sampled_from(["truncate", "flip_header", "flip_data", "header_length", "not_json"]))
def test_damaged_bytes(pristine, tmp_path, shards, which, frac, kind):
    ts = pristine[0]
    d, where = fresh(pristine, tmp_path, shards)
    files = sorted(set(where.values()))
    path = os.path.join(d, files[which % len(files)])
    n, header, data = _header(path)
    raw = bytearray(open(path, "rb").read())
    expected = None
    if kind == "truncate":
        raw = raw[:int(frac * (len(raw) - 1))]
    elif kind == "flip_header":
        pos = min(int(frac * (8 + n)), 8 + n - 1)
        raw[pos] ^= 1 << (which % 8)
    elif kind == "flip_data":
        pos = min(int(frac * len(data)), len(data) - 1)
        raw[8 + n + pos] ^= 1 << (which % 8)
        # what the files now say: the tensor holding that byte, with the bit flipped
        name = next(k for k, v in header.items()
                    if v["data_offsets"][0] <= pos < v["data_offsets"][1])
        arr, dt = ts[name]
        b = bytearray(np.ascontiguousarray(arr).tobytes())
        b[pos - header[name]["data_offsets"][0]] ^= 1 << (which % 8)
        expected = dict(ts)
        expected[name] = (np.frombuffer(bytes(b), arr.dtype).reshape(arr.shape), dt)
    elif kind == "header_length":
        big = [2**40, 2**64 - 1, 2**63, len(raw) - 7, n + 1 + which % 64][which % 5]
        raw[:8] = struct.pack("<Q", big)
    else:  # not_json
        raw[8:8 + n] = bytes((which + i * 7) % 256 for i in range(n))
    with open(path, "wb") as f:
        f.write(bytes(raw))
    r = outcome(d, expected)
    if kind in ("truncate", "header_length", "not_json"):
        assert r == "error"


@SETTINGS
@given(shards=st.sampled_from([1, 2]), pick=st.integers(0, 10**6),
       kind=st.sampled_from(["dtype", "shape", "drop", "rename"]),
       dtype=st.sampled_from(SAFETENSORS_DTYPES),
       shape=st.lists(st.integers(0, 40), min_size=0, max_size=3))
def test_damaged_headers(pristine, tmp_path, shards, pick, kind, dtype, shape):
    """Valid containers with wrong contents: every tensor's dtype/shape checked, a missing
    tensor of an NVFP4 linear named."""
    ts = pristine[0]
    d, where = fresh(pristine, tmp_path, shards)
    name = sorted(ts)[pick % len(ts)]
    path = os.path.join(d, where[name])
    n, header, data = _header(path)
    if kind == "dtype":
        header[name]["dtype"] = dtype
    elif kind == "shape":
        header[name]["shape"] = shape
    elif kind == "drop":  # the tensor is gone (its bytes stay, so the offsets must move)
        a, b = header.pop(name)["data_offsets"]
        data = data[:a] + data[b:]
        for v in header.values():
            if v["data_offsets"][0] >= b:
                v["data_offsets"] = [v["data_offsets"][0] - (b - a), v["data_offsets"][1] - (b - a)]
        if shards > 1:
            with open(os.path.join(d, C.INDEX_FILE)) as f:
                idx = json.load(f)
            del idx["weight_map"][name]
            with open(os.path.join(d, C.INDEX_FILE), "w") as f:
                json.dump(idx, f)
    else:  # rename: a layer name the loader does not know
        header[name + "_x"] = header.pop(name)
    _rewrite(path, header, data)
    r = outcome(d, None)
    if kind == "drop" and not name.endswith(".input_scale"):
        assert r == "error"  # a missing weight / scale is never skipped silently
    if kind == "dtype" and dtype in ("F32", "F64", "XX", "F4") and name.endswith(".weight"):
        assert r == "error"


@SETTINGS
@given(pick=st.integers(0, 10**6),
       kind=st.sampled_from(["drop_entry", "wrong_shard", "missing_shard", "not_json",
                             "no_weight_map", "path_escape"]))
def test_damaged_index(pristine, tmp_path, pick, kind):
    ts = pristine[0]
    d, where = fresh(pristine, tmp_path, 2)
    ip = os.path.join(d, C.INDEX_FILE)
    with open(ip) as f:
        idx = json.load(f)
    name = sorted(ts)[pick % len(ts)]
    wm = idx["weight_map"]
    files = sorted(set(wm.values()))
    if kind == "drop_entry":
        del wm[name]
    elif kind == "wrong_shard":
        wm[name] = next(f for f in files if f != wm[name])
    elif kind == "missing_shard":
        wm[name] = "model-00009-of-00009.safetensors"
    elif kind == "path_escape":
        wm[name] = "../" + wm[name]
    elif kind == "no_weight_map":
        idx = {"metadata": {}}
    text = "{not json" if kind == "not_json" else json.dumps(idx)
    with open(ip, "w") as f:
        f.write(text)
    assert outcome(d, None) == "error"


@pytest.mark.parametrize("damage", ["4_bytes", "2^40", "2^64-1", "bad_json", "truncated",
                                    "no_scale", "bf16_only", "nan_scale_2", "wrong_shape"])
def test_audit_cli_exits_2_with_one_line(pristine, tmp_path, capsys, damage):
    """``nvfp4 audit --checkpoint`` on damaged files: exit 2, one line naming the file, and
    (main returns) no traceback."""
    ts = dict(pristine[0])
    d = str(tmp_path / "ck")
    write(d, ts)
    path = os.path.join(d, "model.safetensors")
    raw = open(path, "rb").read()
    n, header, data = _header(path)
    if damage == "4_bytes":
        raw = raw[:4]
    elif damage in ("2^40", "2^64-1"):
        raw = struct.pack("<Q", 2**40 if damage == "2^40" else 2**64 - 1) + raw[8:]
    elif damage == "bad_json":
        raw = raw[:8] + b"{" * n + raw[8 + n:]
    elif damage == "truncated":
        raw = raw[:-100]
    if damage in ("no_scale", "bf16_only", "nan_scale_2", "wrong_shape"):
        if damage == "no_scale":
            del ts[f"{LAYER}.experts.1.down_proj.weight_scale"]
        elif damage == "bf16_only":
            ts = {n.replace("weight", "w"): (np.zeros(4, np.uint16), "BF16") for n in ts}
        elif damage == "nan_scale_2":
            ts[f"{DENSE}.weight_scale_2"] = (np.array(np.nan, np.float32), "F32")
        else:
            w, dt = ts[f"{DENSE}.weight_scale"]
            ts[f"{DENSE}.weight_scale"] = (w[:, :1], dt)
        write(d, ts)
    else:
        with open(path, "wb") as f:
            f.write(raw)
    assert main(["audit", "--checkpoint", d, "--no-progress", "--tokens", "1"]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvfp4 audit: ") and d in lines[0], cap.err
    assert "Traceback" not in cap.err and cap.out == ""
    if damage == "bf16_only":
        assert "nothing to audit" in lines[0]
    if damage in ("no_scale", "nan_scale_2", "wrong_shape"):
        assert "weight_scale" in lines[0]


def test_sharded_checkpoint_equals_single_file(pristine):
    ts, dirs = pristine
    a = load_everything(dirs[1][0])
    b = load_everything(dirs[2][0])
    check_layers(a, ts)
    check_layers(b, ts)
    ck = C.load(dirs[2][0])
    assert len({os.path.basename(ck.file_of(n)) for n in ck.names()}) == 2


def test_duplicate_tensor_without_index_is_refused(pristine, tmp_path):
    d, _ = fresh(pristine, tmp_path, 1)
    shutil.copy(os.path.join(d, "model.safetensors"), os.path.join(d, "consolidated.safetensors"))
    with pytest.raises(C.CheckpointError, match="also in") as exc:
        C.load(d)
    assert_clean(exc.value, d)


def test_dtypes_numpy_lacks(tmp_path):
    """E4M3 comes back as its bytes (the library's numpy path cannot return it), BF16 as
    ml_dtypes.bfloat16 values, U8 as is."""
    import ml_dtypes

    p = str(tmp_path / "d.safetensors")
    C.write_safetensors(p, {"e": (np.array([0x38, 0x01, 0x7E], np.uint8), "F8_E4M3"),
                            "b": (np.array([0x3FC0, 0xC000], np.uint16), "BF16"),  # 1.5, -2
                            "u": (np.arange(4, dtype=np.uint8).reshape(2, 2), "U8")})
    f = C.SafetensorsFile(p)
    e, b, u = f.get("e"), f.get("b"), f.get("u")
    assert e.dtype == np.uint8 and e.tolist() == [0x38, 0x01, 0x7E] and f.dtype("e") == "F8_E4M3"
    assert b.dtype == ml_dtypes.bfloat16 and b.astype(np.float32).tolist() == [1.5, -2.0]
    assert u.dtype == np.uint8 and u.tolist() == [[0, 1], [2, 3]] and f.shape("u") == (2, 2)
    with pytest.raises(C.CheckpointError, match="no such tensor") as exc:
        f.get("missing")
    assert exc.value.file == p and exc.value.tensor == "missing"
