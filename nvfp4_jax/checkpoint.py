"""Load ModelOpt NVFP4 checkpoints (safetensors + ``hf_quant_config.json``); write tiny ones for tests.

Each safetensors file is opened with the ``safetensors`` library (``safe_open(...,
framework="numpy")``), which checks the container before any tensor is read: the header length
against the file size (a hostile 2^40 length allocates nothing), the header JSON, every tensor's
dtype, and that the data offsets cover the data exactly with ``prod(shape) * itemsize`` bytes per
tensor. Tensors are read one at a time, so memory follows what is asked for. numpy has no
float8 dtypes and the library's numpy path cannot return them, so E4M3 (and E5M2) tensors are
read here as their raw uint8 bytes, at the offsets the library validated (never a numeric cast:
nvfp4-semantics.md section 8); BF16 comes back as ``ml_dtypes.bfloat16``.

A sharded checkpoint with ``model.safetensors.index.json`` is read through its ``weight_map``
(the index and the shards must agree); without an index every ``*.safetensors`` file in the
directory is read and a tensor name may appear in only one of them.

Every problem with the files raises :class:`CheckpointError` (a ``ValueError``) naming the file
and, where there is one, the tensor.

Layers found (naming conventions in ``nvfp4_jax.interop.modelopt``):

* :class:`DenseLayer`: every NVFP4 linear outside an expert list;
* :class:`MoELayer`: ``{layer}.experts.{e}.{w1,w2,w3}`` or ``{gate,up,down}_proj``, as the
  ``oracle.moe`` stacks (``fc1`` rows ``[up; gate]`` when gated).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
import struct
from collections import defaultdict
from collections.abc import Iterator

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy for the library's numpy path)
import numpy as np
from safetensors import SafetensorError, safe_open

import oracle

from .interop import modelopt as MO

_DTYPES = {"U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8, "F32": np.float32,
           "F16": np.float16, "I32": np.int32, "I64": np.int64, "F64": np.float64,
           "BF16": np.uint16}
#: dtypes numpy lacks: read as their raw bytes (uint8, same shape)
_BYTE_DTYPES = ("F8_E4M3", "F8_E5M2")
#: dtypes the library's numpy path returns
_NUMPY_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16",
                 "F32", "F64")
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_SCALARS = ("F32", "F16", "BF16", "F64")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as a ModelOpt NVFP4 checkpoint.

    ``file``: the path at fault; ``tensor``: the tensor name, or None for a whole-file problem;
    ``reason``: what is wrong. ``str(err)`` is ``"{file}: tensor {tensor!r}: {reason}"``.
    """

    def __init__(self, file: str, tensor: str | None, reason: str):
        self.file, self.tensor, self.reason = file, tensor, reason
        where = file if tensor is None else f"{file}: tensor {tensor!r}"
        super().__init__(f"{where}: {reason}")


def write_safetensors(path: str, tensors: dict[str, tuple[np.ndarray, str]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``{name: (array, dtype string)}`` as a safetensors file (dtype e.g. "U8", "F8_E4M3")."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    off = 0
    blobs = []
    for name in sorted(tensors):
        arr, dt = tensors[name]
        if dt not in _DTYPES:
            raise ValueError(f"tensors[{name!r}]: dtype {dt!r} not one of {sorted(_DTYPES)}")
        b = np.ascontiguousarray(arr, dtype=_DTYPES[dt]).astype(np.dtype(_DTYPES[dt]).newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(np.shape(arr)), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


class SafetensorsFile:
    """One safetensors file, validated on open by the ``safetensors`` library; tensors read lazily.

    ``names()``, ``dtype(name)`` (the safetensors dtype string, e.g. "F8_E4M3"), ``shape(name)``,
    ``get(name)`` (numpy; E4M3/E5M2 as uint8 bytes, BF16 as ``ml_dtypes.bfloat16``),
    ``metadata`` (the header's ``__metadata__``). Raises :class:`CheckpointError`.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            self._f = safe_open(path, framework="numpy")
            self.metadata = dict(self._f.metadata() or {})
            names = list(self._f.keys())
            info = {n: (self._f.get_slice(n).get_dtype(), tuple(self._f.get_slice(n).get_shape()))
                    for n in names}
        except SafetensorError as exc:
            raise CheckpointError(path, None, f"not a valid safetensors file ({exc})") from None
        except OSError as exc:
            raise CheckpointError(path, None, f"cannot read: {exc.strerror or exc}") from None
        self._info = info
        self._offsets: dict[str, tuple[int, int]] | None = None
        self._base = 0

    def names(self) -> list[str]:
        return list(self._info)

    def _entry(self, name: str) -> tuple[str, tuple[int, ...]]:
        if name not in self._info:
            raise CheckpointError(self.path, name, "no such tensor in this file")
        return self._info[name]

    def dtype(self, name: str) -> str:
        return self._entry(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _byte_range(self, name: str) -> tuple[int, int]:
        """Absolute [start, end) of a tensor's data; the library has already checked the header."""
        if self._offsets is None:
            with open(self.path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                size = os.fstat(fh.fileno()).st_size
                if n > size - 8:  # the file changed since it was validated
                    raise CheckpointError(self.path, None, f"header length {n} exceeds the file")
                try:
                    header = json.loads(fh.read(n))
                except ValueError as exc:
                    raise CheckpointError(self.path, None, f"header is not JSON ({exc})") from None
            self._base = 8 + n
            self._offsets = {k: tuple(v["data_offsets"]) for k, v in header.items()
                             if k != "__metadata__"}
        try:
            a, b = (int(v) for v in self._offsets[name])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(self.path, name, "no data_offsets in the header") from None
        return self._base + a, self._base + b

    def get(self, name: str) -> np.ndarray:
        dt, shape = self._entry(name)
        if dt in _BYTE_DTYPES:
            a, b = self._byte_range(name)
            n = math.prod(shape)
            if b - a != n:
                raise CheckpointError(self.path, name, f"{dt} shape {list(shape)} needs {n} bytes, "
                                      f"the header gives {b - a}")
            with open(self.path, "rb") as fh:
                fh.seek(a)
                raw = fh.read(b - a)
            if len(raw) != b - a:
                raise CheckpointError(self.path, name,
                                      "data truncated (the file changed while read)")
            return np.frombuffer(raw, np.uint8).reshape(shape)
        if dt not in _NUMPY_DTYPES:
            raise CheckpointError(self.path, name, f"dtype {dt} is not supported (expected one of "
                                  f"{', '.join(_NUMPY_DTYPES + _BYTE_DTYPES)})")
        try:
            return self._f.get_tensor(name)
        except (SafetensorError, OSError, TypeError, ValueError) as exc:
            raise CheckpointError(self.path, name, f"cannot read: {exc}") from None


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """One NVFP4 linear: ``weight`` as an ``oracle.NVFP4`` [N, K] (decode_scale = weight_scale_2)."""

    name: str
    weight: oracle.NVFP4
    input_scale: float | None


@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One MoE layer as ``oracle.moe`` takes it.

    fc1 ``oracle.NVFP4`` [E, R, H] (R = I relu2; 2I swiglu with rows [up; gate]), fc2 [E, H, I],
    decode_scale [E] = weight_scale_2; fc1/fc2_input_scale float64 [E] (decode form); experts:
    the checkpoint expert ids held (a subset when ``max_experts`` cut them); num_experts: all.
    """

    name: str
    fc1: oracle.NVFP4
    fc2: oracle.NVFP4
    fc1_input_scale: np.ndarray
    fc2_input_scale: np.ndarray
    activation: str
    experts: tuple[int, ...]
    num_experts: int
    gate_up_order: str = "up_gate"

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"


class Checkpoint:
    """A ModelOpt NVFP4 checkpoint directory (``*.safetensors`` + ``hf_quant_config.json``).

    Raises ``FileNotFoundError`` for a missing directory or no safetensors file, and
    :class:`CheckpointError` for anything wrong inside the files.
    """

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint: {path!r} is not a directory")
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files and not os.path.exists(index):
            raise FileNotFoundError(f"checkpoint: no *.safetensors file in {path!r}")
        self.quant_config = self._read_json(MO.QUANT_CONFIG_FILE)
        self.config = self._read_json("config.json") or {}
        if self.quant_config is None:
            qc = self.config.get("quantization_config")
            if qc is not None:
                self.quant_config = {"quantization": qc}
        quant = self.quantization
        algo = quant.get("quant_algo") if isinstance(quant, dict) else None
        if algo is None:
            raise ValueError(f"checkpoint: no {MO.QUANT_CONFIG_FILE} (or config.json quantization_config) in {path!r}")
        if str(algo).upper() != "NVFP4":
            raise ValueError(f"checkpoint: quant_algo is {algo!r}, expected 'NVFP4'")
        self._where: dict[str, SafetensorsFile] = {}
        if os.path.exists(index):
            self._read_index(index)
        else:
            for fn in files:
                f = SafetensorsFile(fn)
                for n in f.names():
                    if n in self._where:
                        msg = (f"also in {self._where[n].path} (a tensor name must be in one "
                               f"file only; no {INDEX_FILE} says which)")
                        raise CheckpointError(fn, n, msg)
                    self._where[n] = f

    def _read_index(self, index: str) -> None:
        """Shards named by the index's ``weight_map``; the index and the shards must agree."""
        wm = (self._read_json(INDEX_FILE) or {}).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(index, None, 'expected {"weight_map": {tensor: file, ...}}')
        shards: dict[str, SafetensorsFile] = {}
        for fn in sorted(set(wm.values())):
            full = os.path.join(self.path, fn)
            if os.path.basename(fn) != fn or not os.path.isfile(full):
                name = next(n for n, v in wm.items() if v == fn)
                raise CheckpointError(index, name, f"shard {fn!r} is not a file in {self.path!r}")
            shards[fn] = SafetensorsFile(full)
        for n, fn in wm.items():
            if n not in shards[fn].names():
                raise CheckpointError(shards[fn].path, n,
                                      f"listed in {INDEX_FILE} but not in this shard")
        for fn, f in shards.items():
            for n in f.names():
                if wm.get(n) != fn:
                    raise CheckpointError(index, n, f"held by shard {fn!r} but the weight_map says "
                                          f"{wm.get(n)!r}")
        self._where = {n: shards[fn] for n, fn in wm.items()}

    def _read_json(self, name: str):
        p = os.path.join(self.path, name)
        if not os.path.exists(p):
            return None
        try:
            with open(p, "rb") as f:
                d = json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise CheckpointError(p, None, f"not valid JSON ({exc})") from None
        if not isinstance(d, dict):
            raise CheckpointError(p, None, f"expected a JSON object, got {type(d).__name__}")
        return d

    def names(self) -> list[str]:
        return sorted(self._where)

    @property
    def quantization(self) -> dict:
        """The ``quantization`` section: hf_quant_config.json's, else config.json's
        ``quantization_config`` (a dict holding ``quant_algo`` "NVFP4" once the checkpoint is
        open)."""
        return (self.quant_config or {}).get("quantization") or {}

    @property
    def kv_cache_quant(self) -> str | None:
        """The KV-cache quantization the export declares, or None: ``kv_cache_quant_algo`` of
        hf_quant_config.json (ModelOpt writes "FP8" or "NVFP4", with each attention layer's
        ``k_proj.k_scale`` / ``v_proj.v_scale``, amax / 448), else config.json's
        ``quantization_config.kv_cache_scheme`` ({"type": "float", "num_bits": 8} reads as
        "FP8")."""
        q = self.quantization
        algo = q.get("kv_cache_quant_algo")
        if algo is not None:
            return str(algo)
        scheme = q.get("kv_cache_scheme")
        if isinstance(scheme, dict):
            if scheme.get("type") == "float" and scheme.get("num_bits") == 8:
                return "FP8"
            return json.dumps(scheme, sort_keys=True)
        return None if scheme is None else str(scheme)

    def file_of(self, name: str) -> str:
        """Path of the file that holds tensor ``name``."""
        if name not in self._where:
            raise KeyError(f"checkpoint: no tensor {name!r}")
        return self._where[name].path

    def dtype(self, name: str) -> str:
        """The safetensors dtype string of tensor ``name`` (e.g. "F8_E4M3", "BF16")."""
        if name not in self._where:
            raise KeyError(f"checkpoint: no tensor {name!r}")
        return self._where[name].dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` from its file's header (nothing is read)."""
        if name not in self._where:
            raise KeyError(f"checkpoint: no tensor {name!r}")
        return self._where[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"checkpoint: no tensor {name!r}")
        return self._where[name].get(name)

    def nvfp4_prefixes(self) -> list[str]:
        """Every ``{prefix}`` with ``.weight``, ``.weight_scale`` and ``.weight_scale_2``."""
        s = set(self._where)
        return sorted(n[: -len(".weight_scale_2")] for n in s if n.endswith(".weight_scale_2")
                      and n[: -len("_2")] in s and n[: -len("_scale_2")] in s)

    def incomplete_prefixes(self) -> dict[str, list[str]]:
        """``{prefix: missing suffixes}`` for NVFP4 linears lacking part of their tensors: a prefix
        with ``.weight_scale_2``, or with an F8_E4M3 ``.weight_scale``, but not all three."""
        s = set(self._where)
        cand = {n[: -len(".weight_scale_2")] for n in s if n.endswith(".weight_scale_2")}
        cand |= {n[: -len(".weight_scale")] for n in s if n.endswith(".weight_scale")
                 and self._where[n].dtype(n) == "F8_E4M3"}
        out = {}
        for p in sorted(cand):
            miss = [x for x in (MO.WEIGHT, MO.WEIGHT_SCALE, MO.WEIGHT_SCALE_2)
                    if f"{p}.{x}" not in s]
            if miss:
                out[p] = miss
        return out

    def _tensor(self, name: str, dtypes: tuple[str, ...]) -> np.ndarray:
        f = self._where[name]
        if f.dtype(name) not in dtypes:
            msg = f"expected dtype {' or '.join(dtypes)}, got {f.dtype(name)}"
            raise CheckpointError(f.path, name, msg)
        return f.get(name)

    def _scalar(self, name: str) -> float:
        """A positive finite per-tensor scale (fp32 ``weight_scale_2`` / ``input_scale``)."""
        f = self._where[name]
        if math.prod(f.shape(name)) != 1:
            msg = f"expected one value, got shape {list(f.shape(name))}"
            raise CheckpointError(f.path, name, msg)
        v = float(np.asarray(self._tensor(name, _FLOAT_SCALARS), np.float32).reshape(-1)[0])
        if not (math.isfinite(v) and v > 0):
            msg = f"expected a finite positive decode scale, got {v!r}"
            raise CheckpointError(f.path, name, msg)
        return v

    def linear(self, prefix: str) -> MO.NVFP4Linear:
        """The NVFP4 linear ``{prefix}``, every tensor's dtype, shape and scale values checked:
        ``.weight`` U8 [N, K/2], ``.weight_scale`` F8_E4M3 (or U8) [N, K/16] with no NaN byte
        (0x7F/0xFF) and no sign bit, ``.weight_scale_2`` / ``.input_scale`` one finite positive
        float."""
        wn, sn = f"{prefix}.{MO.WEIGHT}", f"{prefix}.{MO.WEIGHT_SCALE}"
        w = self._tensor(wn, ("U8",))
        if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 8 or w.shape[1] % 8:
            msg = (f"expected packed E2M1 codes [N, K/2] with K a positive multiple of 16, got "
                   f"shape {list(w.shape)}")
            raise CheckpointError(self.file_of(wn), wn, msg)
        want = (w.shape[0], w.shape[1] // 8)
        if self._where[sn].shape(sn) != want:
            msg = (f"expected shape {list(want)} (one scale per 16 values of {wn} "
                   f"{list(w.shape)}), got {list(self._where[sn].shape(sn))}")
            raise CheckpointError(self.file_of(sn), sn, msg)
        ws = self._tensor(sn, ("F8_E4M3", "U8"))
        bad = (ws == 0x7F) | (ws == 0xFF)
        if bad.any():
            msg = (f"{int(bad.sum())} E4M3 NaN bytes (0x7F/0xFF), first at "
                   f"{list(map(int, np.argwhere(bad)[0]))}")
            raise CheckpointError(self.file_of(sn), sn, msg)
        neg = ws >= 0x80
        if neg.any():
            msg = (f"{int(neg.sum())} scale bytes with the sign bit set, first at "
                   f"{list(map(int, np.argwhere(neg)[0]))}; NVFP4 block scales are positive "
                   "(UE4M3)")
            raise CheckpointError(self.file_of(sn), sn, msg)
        ins = f"{prefix}.{MO.INPUT_SCALE}"
        return MO.NVFP4Linear(w, ws, self._scalar(f"{prefix}.{MO.WEIGHT_SCALE_2}"),
                              self._scalar(ins) if ins in self._where else None)

    def activation(self, gated: bool) -> str:
        act = str(self.config.get("mlp_hidden_act") or self.config.get("hidden_act") or "").lower()
        if gated:
            return "swiglu"
        if act and act not in ("relu2", "relu_squared", "squared_relu"):
            msg = f"non-gated experts with activation {act!r}; only relu2 is supported"
            raise CheckpointError(os.path.join(self.path, "config.json"), None, msg)
        return "relu2"

    def layers(self, max_experts: int | None = None) -> Iterator[DenseLayer | MoELayer]:
        """Yield every NVFP4 layer: dense linears, then MoE layers (experts ``< max_experts``).

        Raises :class:`CheckpointError` first if any NVFP4 linear lacks one of its tensors.
        """
        for p, miss in self.incomplete_prefixes().items():
            have = next(f"{p}.{x}" for x in (MO.WEIGHT_SCALE_2, MO.WEIGHT_SCALE)
                        if f"{p}.{x}" in self._where)
            msg = (f"missing: {have} is here, so the NVFP4 linear {p} needs "
                   f"{', '.join(f'.{m}' for m in miss)}")
            raise CheckpointError(self.file_of(have), f"{p}.{miss[0]}", msg)
        experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        dense = []
        for p in self.nvfp4_prefixes():
            m = MO.EXPERT_RE.match(p)
            if m:
                experts[m["layer"]][int(m["e"])][MO.PROJ_ROLES[m["proj"]]] = p
            else:
                dense.append(p)
        for p in dense:
            lin = self.linear(p)
            yield DenseLayer(p, lin.to_oracle(), lin.input_scale)
        for layer in sorted(experts, key=_natural):
            yield self._moe_layer(layer, experts[layer], max_experts)

    def _moe_layer(self, layer: str, by_e: dict[int, dict[str, str]], max_experts: int | None) -> MoELayer:
        ids = sorted(by_e)
        n_all = len(ids)
        if ids != list(range(n_all)):
            gap = sorted(set(range(ids[-1] + 1)) - set(ids))
            some = next(iter(by_e[ids[0]].values()))
            msg = f"experts {gap[:8]} of {layer} missing (found ids {ids[0]}..{ids[-1]})"
            raise CheckpointError(self.file_of(f"{some}.{MO.WEIGHT}"), f"{layer}.experts.{gap[0]}",
                                  msg)
        if max_experts is not None:
            ids = ids[:max_experts]
        roles = set(by_e[ids[0]])
        gated = "gate" in roles
        need = {"gate", "up", "down"} if gated else {"down"}
        fc1_role = None if gated else ("up" if "up" in roles else "gate")
        fc1, fc2 = [], []
        for e in ids:
            r = by_e[e]
            if not need <= set(r) or (not gated and fc1_role not in r):
                some = next(iter(r.values()))
                raise CheckpointError(self.file_of(f"{some}.{MO.WEIGHT}"), f"{layer}.experts.{e}",
                                      f"missing projections: found {sorted(r)}, expected "
                                      f"{sorted(need | ({fc1_role} if fc1_role else set()))}")
            if gated:
                fc1.append(MO.fuse_gate_up(self.linear(r["gate"]), self.linear(r["up"])))
            else:
                fc1.append(self.linear(r[fc1_role]))
            fc2.append(self.linear(r["down"]))
        for lins, role in ((fc1, "up" if gated else fc1_role), (fc2, "down")):
            for e, lin in zip(ids, lins):
                if lin.weight.shape != lins[0].weight.shape:
                    name = f"{by_e[e][role]}.{MO.WEIGHT}"
                    msg = (f"shape {list(lin.weight.shape)} differs from expert {ids[0]}'s "
                           f"{list(lins[0].weight.shape)}")
                    raise CheckpointError(self.file_of(name), name, msg)
        (r1, h2), (h, i2) = fc1[0].weight.shape, fc2[0].weight.shape
        if h != 2 * h2 or 2 * i2 * (2 if gated else 1) != r1:
            name = f"{by_e[ids[0]]['down']}.{MO.WEIGHT}"
            raise CheckpointError(self.file_of(name), name, f"shape {[h, i2]} does not fit FC1 "
                                  f"{[r1, h2]} ({'gate+up' if gated else fc1_role}; expected "
                                  f"{[2 * h2, r1 // (4 if gated else 2)]})")
        s1 = np.array([l.input_scale if l.input_scale is not None else np.nan for l in fc1])
        s2 = np.array([l.input_scale if l.input_scale is not None else np.nan for l in fc2])
        return MoELayer(layer, MO.stack(fc1), MO.stack(fc2), s1, s2, self.activation(gated),
                        tuple(ids), n_all)


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def load(path: str) -> Checkpoint:
    """Open a ModelOpt NVFP4 checkpoint directory."""
    return Checkpoint(path)


def write_test_checkpoint(
    path: str,
    *,
    num_layers: int = 1,
    num_experts: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 32,
    activation: str = "relu2",
    naming: str = "gate_up_down",
    dense: bool = True,
    sigma: float = 0.02,
    seed: int = 0,
) -> str:
    """Write a tiny ModelOpt-format NVFP4 checkpoint (one safetensors file) into ``path``.

    Per layer: ``model.layers.{l}.mixer.experts.{e}.*`` with ``naming`` "gate_up_down"
    (``{gate,up,down}_proj``) or "w123" (``w1, w3, w2``); relu2 layers have no gate. With
    ``dense``, one dense NVFP4 linear ``model.layers.{l}.mixer.shared_experts.up_proj`` too.
    Weights ~ N(0, sigma^2), quantized the ModelOpt way; input scales calibrated on N(0, 1)
    tokens. Returns ``path``.
    """
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict = {}
    gated = activation == "swiglu"
    for layer in range(num_layers):
        base = f"model.layers.{layer}.mixer"
        x = rng.standard_normal((64, hidden_size)).astype(np.float32)
        for e in range(num_experts):
            ws = {r: (rng.standard_normal((intermediate_size, hidden_size)) * sigma).astype(np.float32)
                  for r in (("gate", "up") if gated else ("up",))}
            wd = (rng.standard_normal((hidden_size, intermediate_size)) * sigma).astype(np.float32)
            u = {r: x @ w.T for r, w in ws.items()}
            if gated:
                h = u["up"] * u["gate"] / (1 + np.exp(-u["gate"]))
            else:
                h = np.maximum(u["up"], 0) ** 2
            amax_x = float(np.abs(x).max())
            amax_w = max(float(np.abs(w).max()) for w in ws.values())  # ModelOpt syncs gate/up amax
            for r, w in ws.items():
                lin = MO.quantize_linear(w, amax_x, weight_amax=amax_w)
                tensors.update(lin.tensors(MO.expert_prefix(base, e, r, naming)))
            tensors.update(MO.quantize_linear(wd, float(np.abs(h).max())).tensors(
                MO.expert_prefix(base, e, "down", naming)))
        if dense:
            wdn = (rng.standard_normal((intermediate_size, hidden_size)) * sigma).astype(np.float32)
            tensors.update(MO.quantize_linear(wdn, float(np.abs(x).max())).tensors(f"{base}.shared_experts.up_proj"))
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(path, MO.QUANT_CONFIG_FILE), "w") as f:
        json.dump(MO.quant_config(), f, indent=2)
    cfg = {"architectures": ["NemotronHForCausalLM"], "hidden_size": hidden_size,
           "moe_intermediate_size": intermediate_size, "n_routed_experts": num_experts,
           "num_experts_per_tok": min(2, num_experts),
           "mlp_hidden_act": "silu" if gated else "relu2"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path
