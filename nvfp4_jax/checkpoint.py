"""Load ModelOpt NVFP4 checkpoints (safetensors + ``hf_quant_config.json``); write tiny ones for tests.

The safetensors container is read directly (8-byte little-endian header length, JSON header,
raw little-endian data) through ``np.memmap``, so loading needs neither torch nor the
``safetensors`` package and touches only the tensors asked for. E4M3 tensors come back as
their uint8 bytes (never a numeric cast).

Layers found (naming conventions in ``nvfp4_jax.interop.modelopt``):

* :class:`DenseLayer`: every NVFP4 linear outside an expert list;
* :class:`MoELayer`: ``{layer}.experts.{e}.{w1,w2,w3}`` or ``{gate,up,down}_proj``, as the
  ``oracle.moe`` stacks (``fc1`` rows ``[up; gate]`` when gated).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import struct
from collections import defaultdict
from collections.abc import Iterator

import numpy as np

import oracle

from .interop import modelopt as MO

_DTYPES = {"U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8, "F32": np.float32,
           "F16": np.float16, "I32": np.int32, "I64": np.int64, "F64": np.float64,
           "BF16": np.uint16}


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
    """Lazy reader of one safetensors file: ``names()``, ``dtype(name)``, ``get(name)``."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
        self.metadata = self.header.pop("__metadata__", {})
        self._base = 8 + n
        self._mm = None

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        dt = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        a, b = info["data_offsets"]
        return np.frombuffer(self._mm[self._base + a:self._base + b], dtype=dt).reshape(info["shape"])


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
    """A ModelOpt NVFP4 checkpoint directory (``*.safetensors`` + ``hf_quant_config.json``)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint: {path!r} is not a directory")
        self.path = path
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"checkpoint: no *.safetensors file in {path!r}")
        self.quant_config = self._read_json(MO.QUANT_CONFIG_FILE)
        self.config = self._read_json("config.json") or {}
        if self.quant_config is None:
            qc = self.config.get("quantization_config")
            if qc is not None:
                self.quant_config = {"quantization": qc}
        algo = ((self.quant_config or {}).get("quantization") or {}).get("quant_algo")
        if algo is None:
            raise ValueError(f"checkpoint: no {MO.QUANT_CONFIG_FILE} (or config.json quantization_config) in {path!r}")
        if str(algo).upper() != "NVFP4":
            raise ValueError(f"checkpoint: quant_algo is {algo!r}, expected 'NVFP4'")
        self._where: dict[str, SafetensorsFile] = {}
        for fn in files:
            f = SafetensorsFile(fn)
            for n in f.names():
                self._where[n] = f

    def _read_json(self, name: str):
        p = os.path.join(self.path, name)
        if not os.path.exists(p):
            return None
        with open(p) as f:
            return json.load(f)

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"checkpoint: no tensor {name!r}")
        return self._where[name].get(name)

    def nvfp4_prefixes(self) -> list[str]:
        """Every ``{prefix}`` with ``.weight``, ``.weight_scale`` and ``.weight_scale_2``."""
        s = set(self._where)
        return sorted(n[: -len(".weight_scale_2")] for n in s if n.endswith(".weight_scale_2")
                      and n[: -len("_2")] in s and n[: -len("_scale_2")] in s)

    def linear(self, prefix: str) -> MO.NVFP4Linear:
        ws = self.get(f"{prefix}.weight_scale")
        if self._where[f"{prefix}.weight_scale"].dtype(f"{prefix}.weight_scale") not in ("F8_E4M3", "U8"):
            raise ValueError(f"{prefix}.weight_scale: expected F8_E4M3 bytes, got "
                             f"{self._where[f'{prefix}.weight_scale'].dtype(f'{prefix}.weight_scale')}")
        ins = f"{prefix}.input_scale"
        return MO.NVFP4Linear(self.get(f"{prefix}.weight"), ws,
                              float(np.asarray(self.get(f"{prefix}.weight_scale_2"), np.float32).reshape(-1)[0]),
                              float(np.asarray(self.get(ins), np.float32).reshape(-1)[0]) if ins in self._where else None)

    def activation(self, gated: bool) -> str:
        act = str(self.config.get("mlp_hidden_act") or self.config.get("hidden_act") or "").lower()
        if gated:
            return "swiglu"
        if act and act not in ("relu2", "relu_squared", "squared_relu"):
            raise ValueError(f"config.json: non-gated experts with activation {act!r}; only relu2 is supported")
        return "relu2"

    def layers(self, max_experts: int | None = None) -> Iterator[DenseLayer | MoELayer]:
        """Yield every NVFP4 layer: dense linears, then MoE layers (experts ``< max_experts``)."""
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
                raise ValueError(f"{layer}.experts.{e}: missing projections, found {sorted(r)}")
            if gated:
                fc1.append(MO.fuse_gate_up(self.linear(r["gate"]), self.linear(r["up"])))
            else:
                fc1.append(self.linear(r[fc1_role]))
            fc2.append(self.linear(r["down"]))
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
