"""ModelOpt NVFP4 checkpoint conventions, and a live bridge to ModelOpt's own quantizer.

A ModelOpt "unified HF" NVFP4 export stores per linear
``{prefix}``:

* ``{prefix}.weight``          uint8 [N, K/2], two E2M1 codes per byte, element 2j low nibble;
* ``{prefix}.weight_scale``    float8_e4m3fn [N, K/16], linear layout;
* ``{prefix}.weight_scale_2``  float32 scalar, decode form ``amax_w / (6 * 448)``;
* ``{prefix}.input_scale``     float32 scalar, decode form ``amax_x / (6 * 448)`` (static
  activation calibration; absent for weight-only layers);

and ``hf_quant_config.json`` = ``{"producer": {"name": "modelopt", ...}, "quantization":
{"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}}``.

MoE experts are one set of linears per expert, named ``{layer}.experts.{e}.{w1,w2,w3}``
(Mixtral style: w1 = gate, w3 = up, w2 = down) or ``{layer}.experts.{e}.{gate,up,down}_proj``.
A non-gated (``relu2``, Nemotron-H) expert has only up and down (or w1 and w2). TensorRT-LLM
fuses FC1 as ``[w3 (up); w1 (gate)]`` ("fc31"), which is ``oracle.moe``'s ``"up_gate"`` order.
Gate and up must share ``weight_scale_2`` and ``input_scale`` (ModelOpt syncs their amax); if
they do not, TensorRT-LLM takes the max for the alpha without requantizing
(``load_all_fp4_weight_scales_and_alphas``), and :func:`fuse_gate_up` does the same, with a
warning.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import warnings

import numpy as np

import oracle
from oracle.formats import f32

WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE = "weight", "weight_scale", "weight_scale_2", "input_scale"
QUANT_CONFIG_FILE = "hf_quant_config.json"

#: expert projection name -> role
PROJ_ROLES = {"w1": "gate", "w3": "up", "w2": "down",
              "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
#: naming styles -> role -> name
NAMING = {"w123": {"gate": "w1", "up": "w3", "down": "w2"},
          "gate_up_down": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}
EXPERT_RE = re.compile(r"^(?P<layer>.+)\.experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)$")


def quant_config(exclude_modules: list[str] | None = None) -> dict:
    """The ``hf_quant_config.json`` content ModelOpt writes for NVFP4."""
    return {"producer": {"name": "modelopt", "version": "0.47.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": list(exclude_modules or [])}}


@dataclasses.dataclass(frozen=True)
class NVFP4Linear:
    """One ModelOpt NVFP4 linear as stored (numpy).

    weight uint8 [N, K/2]; weight_scale uint8 E4M3 bytes [N, K/16] (linear); weight_scale_2 and
    input_scale fp32 decode scales (input_scale None for weight-only).
    """

    weight: np.ndarray
    weight_scale: np.ndarray
    weight_scale_2: float
    input_scale: float | None = None

    def to_oracle(self) -> oracle.NVFP4:
        return oracle.NVFP4(np.asarray(self.weight, np.uint8), np.asarray(self.weight_scale, np.uint8),
                            np.float64(self.weight_scale_2))

    def tensors(self, prefix: str) -> dict[str, tuple[np.ndarray, str]]:
        """``{name: (array, safetensors dtype)}`` as ModelOpt exports them."""
        out = {f"{prefix}.{WEIGHT}": (np.asarray(self.weight, np.uint8), "U8"),
               f"{prefix}.{WEIGHT_SCALE}": (np.asarray(self.weight_scale, np.uint8), "F8_E4M3"),
               f"{prefix}.{WEIGHT_SCALE_2}": (np.array(self.weight_scale_2, np.float32), "F32")}
        if self.input_scale is not None:
            out[f"{prefix}.{INPUT_SCALE}"] = (np.array(self.input_scale, np.float32), "F32")
        return out


def modelopt_quantize_torch(w, decode_scale: float):
    """ModelOpt ``NVFP4QTensor.quantize`` arithmetic in torch fp32 (bit-exact with recipe ``modelopt``).

    w: torch float32 [..., K]. ``sf = vmax / (6 * D)``, zero -> 1, clamp to [2^-9, 448], E4M3;
    ``y = w / (float(sf) * D)``; E2M1 RNE of |y| with the sign from ``w < 0``. Returns
    ``(packed uint8 [..., K/2], scale bytes uint8 [..., K/16])``.
    """
    import torch

    from .trtllm_torch import e2m1_encode, e4m3_saturating, pack_nibbles

    d = torch.tensor(decode_scale, dtype=torch.float32)
    w = w.to(torch.float32)
    xb = w.reshape(*w.shape[:-1], -1, 16)
    sf = xb.abs().amax(-1) / (torch.tensor(6.0) * d)
    sf = torch.where(sf == 0, torch.tensor(1.0), sf).clamp(2.0**-9, 448.0)
    s8 = e4m3_saturating(sf)
    y = xb / (s8.to(torch.float32) * d)[..., None]
    code = (e2m1_encode(y.abs()) & 0x7) | ((xb < 0).to(torch.uint8) << 3)
    return pack_nibbles(code.reshape(w.shape)), s8.view(torch.uint8)


_JAX_MODELOPT = None


def _jax_modelopt():
    """Jitted ``nvfp4_jax.quantize(w, "modelopt", decode_scale=d)`` -> (codes, scale bytes)."""
    global _JAX_MODELOPT
    if _JAX_MODELOPT is None:
        import jax

        import nvfp4_jax
        from nvfp4_jax import formats as F

        def f(w, d):
            a = nvfp4_jax.quantize(w, "modelopt", decode_scale=d)
            return a.codes, F.e4m3_bytes(a.scales)

        _JAX_MODELOPT = jax.jit(f)
    return _JAX_MODELOPT


def quantize_linear(w, input_amax: float | None = None, *, backend: str = "jax",
                    weight_amax: float | None = None) -> NVFP4Linear:
    """Quantize a float weight [N, K] the ModelOpt way (``NVFP4QTensor``, recipe ``modelopt``).

    ``weight_scale_2 = fp32(amax / 2688)`` (``weight_amax`` overrides ``max|w|``, e.g. the shared
    amax ModelOpt syncs across gate and up); ``input_scale = fp32(input_amax / 2688)`` when given.
    backend: ``"jax"`` (jitted ``nvfp4_jax.quantize``, fastest on CPU), ``"torch"``
    (:func:`modelopt_quantize_torch`) or ``"oracle"``; all three give the same bytes.
    """
    if backend == "torch":
        import torch

        wt = w if isinstance(w, torch.Tensor) else torch.from_numpy(np.asarray(w, np.float32))
        amax = float(wt.abs().max())
    else:
        w = np.asarray(w, np.float32)
        amax = float(np.abs(w).max())
    if weight_amax is not None:
        amax = float(weight_amax)
    d = oracle.decode_scale_from_amax(amax) if amax > 0 else 1.0
    if backend == "torch":
        codes, scales = (t.numpy() for t in modelopt_quantize_torch(wt, d))
    elif backend == "jax":
        codes, scales = (np.asarray(t) for t in _jax_modelopt()(w, np.float32(d)))
    elif backend == "oracle":
        t = oracle.quantize(w.astype(np.float64), "modelopt", decode_scale=d)
        codes, scales = t.codes, t.scales
    else:
        raise ValueError(f"backend: expected 'torch', 'jax' or 'oracle', got {backend!r}")
    s_in = None if input_amax is None else float(oracle.decode_scale_from_amax(max(float(input_amax), 1e-30)))
    return NVFP4Linear(codes, scales, float(d), s_in)


def stack(linears: list[NVFP4Linear]) -> oracle.NVFP4:
    """Expert linears -> ``oracle.NVFP4`` stack [E, N, K] with decode_scale [E]."""
    return oracle.NVFP4(np.stack([np.asarray(l.weight, np.uint8) for l in linears]),
                        np.stack([np.asarray(l.weight_scale, np.uint8) for l in linears]),
                        np.array([l.weight_scale_2 for l in linears], np.float64))


def fuse_gate_up(gate: NVFP4Linear, up: NVFP4Linear, order: str = "up_gate") -> NVFP4Linear:
    """TensorRT-LLM's fc31 = ``[w3 (up); w1 (gate)]`` (``order="up_gate"``) or vLLM's w13.

    Differing ``weight_scale_2`` / ``input_scale``: the max is kept, without requantizing (as
    TensorRT-LLM's loader does; "Accuracy may be affected").
    """
    first, second = (up, gate) if order == "up_gate" else (gate, up)
    ws2 = max(gate.weight_scale_2, up.weight_scale_2)
    if gate.weight_scale_2 != up.weight_scale_2:
        warnings.warn(f"gate/up weight_scale_2 differ ({gate.weight_scale_2!r} vs {up.weight_scale_2!r}); "
                      "using the max without requantizing, as TensorRT-LLM does", stacklevel=2)
    ins = [s for s in (gate.input_scale, up.input_scale) if s is not None]
    return NVFP4Linear(np.concatenate([first.weight, second.weight]),
                       np.concatenate([first.weight_scale, second.weight_scale]),
                       ws2, max(ins) if ins else None)


def expert_prefix(layer: str, e: int, role: str, naming: str = "gate_up_down") -> str:
    """Tensor prefix of one expert projection, e.g. ``model.layers.1.mixer.experts.7.up_proj``."""
    return f"{layer}.experts.{e}.{NAMING[naming][role]}"


# ---------------------------------------------------------------------------------------
# live bridge: ModelOpt's own NVFP4QTensor (pure torch, runs on CPU)
# ---------------------------------------------------------------------------------------

def live_available() -> tuple[bool, str]:
    """``(True, version)`` when ModelOpt's ``NVFP4QTensor`` imports, else ``(False, reason)``."""
    if importlib.util.find_spec("modelopt") is None:
        return False, "nvidia-modelopt is not installed (pip install nvidia-modelopt==0.47.0)"
    try:
        import modelopt
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return False, f"import modelopt.torch.quantization.qtensor.nvfp4_tensor failed: {type(exc).__name__}: {exc}"
    return True, f"nvidia-modelopt {getattr(modelopt, '__version__', '?')}"


def live_quantize(w: np.ndarray) -> NVFP4Linear:
    """Quantize ``w [N, K]`` with ModelOpt's ``NVFP4QTensor.quantize(w, 16)`` (CPU torch)."""
    ok, why = live_available()
    if not ok:
        from . import LiveUnavailable

        raise LiveUnavailable(why)
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt, ws, ws2 = NVFP4QTensor.quantize(torch.from_numpy(np.asarray(w, np.float32)), 16)
    packed = qt._quantized_data if hasattr(qt, "_quantized_data") else qt.data
    return NVFP4Linear(packed.view(torch.uint8).numpy().copy(), ws.view(torch.uint8).numpy().copy(),
                       float(f32(ws2.float().item())))
