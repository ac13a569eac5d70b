"""Hypothesis strategies for NVFP4 tensors, checkpoint-like weights, routings and MoE problems.

Every strategy is a small composable function with documented parameters (in the style of
``hypothesis.extra.numpy``); parameters accept plain values or strategies. Large arrays are not
drawn element by element: hypothesis draws the *structure* (shapes, per-block scale regime and
magnitude, block kind, sigma, routing kind) and a seed, and numpy fills in the values, so
examples are cheap and shrink towards small shapes, simple regimes and seed 0.

Scale regimes (the ideal block scale ``vmax * G / 6`` = ``vmax / (6 * D)``):

* ``"underflow"``  2^-14 .. 2^-10: E4M3 rounds the scale to 0 (the block is lost);
* ``"subnormal"``  2^-10 .. 2^-6: E4M3 subnormals, 3-bit precision, step 2^-9;
* ``"normal"``     2^-6 .. 448;
* ``"overflow_edge"`` 400 .. 480: around the saturation point 448 (and the 464 NaN edge of
  non-saturating casts).

Block kinds: ``"random"`` (uniform in [-vmax, vmax], one element at +-vmax), ``"zero"``
(all zero), ``"outlier"`` (one element at +-vmax, the others 2^-4 .. 2^-20 smaller).

Example::

    from hypothesis import given
    from nvfp4_jax.testing import strategies as nst

    @given(nst.moe_problems(activation="relu2"))
    def test_my_kernel(p):
        out = my_kernel(*p.args(), **p.kwargs())
        assert_moe_close(out, *p.args(), **p.kwargs())
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import numpy as np

try:
    from hypothesis import strategies as st
except ImportError as e:  # a test-time dependency, not a runtime one
    raise ImportError("nvfp4_jax.testing.strategies needs hypothesis: pip install "
                      "'nvfp4-jax[test]' (or pip install hypothesis)") from e

import oracle
from oracle.formats import bf16_round, f32

SCALE_REGIMES: dict[str, tuple[float, float]] = {
    "underflow": (2.0**-14, 2.0**-10),
    "subnormal": (2.0**-10, 2.0**-6),
    "normal": (2.0**-6, 448.0),
    "overflow_edge": (400.0, 480.0),
}
BLOCK_KINDS = ("random", "zero", "outlier")
ROUTING_KINDS = ("uniform", "skewed", "empty_experts")

# default parameter strategies (module-level so every call shares them)
_ROWS = st.integers(1, 4)
_BLOCKS = st.integers(1, 4)
_REGIMES = st.sampled_from(tuple(SCALE_REGIMES))
_KINDS = st.sampled_from(BLOCK_KINDS)
_BOOLS = st.booleans()
_TOKENS_8 = st.integers(1, 8)
_EXPERTS_8 = st.integers(2, 8)
_ROUTING = st.sampled_from(ROUTING_KINDS)
_TOKENS_6 = st.integers(1, 6)
_SIZES = st.sampled_from([32, 64])
_EXPERTS_5 = st.integers(2, 5)
_ACTIVATIONS = st.sampled_from(["relu2", "swiglu"])


def _st(v):
    """A strategy from a value or a strategy."""
    return v if isinstance(v, st.SearchStrategy) else st.just(v)


@st.composite
def log_uniform(draw, min_value: float, max_value: float) -> float:
    """A float32 value whose log2 is uniform in ``[log2 min_value, log2 max_value]``."""
    if not 0 < min_value <= max_value:
        raise ValueError(f"min_value/max_value: expected 0 < min <= max, got {min_value}, {max_value}")
    e = draw(st.floats(math.log2(min_value), math.log2(max_value), allow_nan=False))
    return float(f32(np.clip(2.0**e, min_value, max_value)))


def global_scales(min_value: float = 2.0**-20, max_value: float = 2.0**6):
    """Per-tensor **decode** scales ``D = amax / 2688`` (fp32), log-uniform.

    The default range covers tiny weights (D ~ 1e-6, so ``weight_scale_2`` folding
    underflows) through large activations (D ~ 64).
    """
    return log_uniform(min_value, max_value)


@dataclasses.dataclass(frozen=True)
class NVFP4Input:
    """A float input built to hit chosen quantization regimes.

    x: float32 [rows, K] (bf16 values when drawn with ``dtype="bfloat16"``);
    decode_scale: fp32 D (``encode_scale`` = fp32(1/D)); ideal_scales: [rows, K/16] the
    block scales ``vmax / (6 D)`` aimed at; regimes / kinds: [rows, K/16] labels.
    """

    x: np.ndarray
    decode_scale: float
    ideal_scales: np.ndarray
    regimes: np.ndarray
    kinds: np.ndarray

    @property
    def encode_scale(self) -> float:
        return float(f32(1.0 / self.decode_scale))

    def quantize(self, recipe: str = "trtllm") -> oracle.NVFP4:
        """Quantize with the oracle recipe, passing the global scale in its native form."""
        native = oracle.RECIPES[recipe].native
        kw = {"encode_scale": self.encode_scale} if native == "encode" else {"decode_scale": self.decode_scale}
        return oracle.quantize(self.x.astype(np.float64), recipe, **kw)


@st.composite
def nvfp4_inputs(
    draw,
    rows=_ROWS,
    blocks_per_row=_BLOCKS,
    decode_scale=None,
    regimes=_REGIMES,
    kinds=_KINDS,
    dtype: str = "bfloat16",
) -> NVFP4Input:
    """Float inputs with controlled block maxima and a global scale (see the module docstring).

    rows, blocks_per_row: ints or strategies (K = 16 * blocks_per_row). decode_scale: float or
    strategy (default :func:`global_scales`). regimes: strategy of keys of
    :data:`SCALE_REGIMES`, drawn per block; kinds: strategy of :data:`BLOCK_KINDS`, per block.
    dtype: ``"bfloat16"`` (values rounded to bf16) or ``"float32"``.
    """
    m, nb = draw(_st(rows)), draw(_st(blocks_per_row))
    d = float(draw(_st(decode_scale) if decode_scale is not None else global_scales()))
    reg = np.array([[draw(regimes) for _ in range(nb)] for _ in range(m)])
    kind = np.array([[draw(kinds) for _ in range(nb)] for _ in range(m)])
    ideal = np.array([[draw(log_uniform(*SCALE_REGIMES[r])) for r in row] for row in reg])
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    vmax = 6.0 * ideal * d
    u = rng.uniform(-1.0, 1.0, (m, nb, 16))
    x = u * vmax[..., None]
    small = u * vmax[..., None] * np.exp2(-rng.uniform(4, 20, (m, nb, 16)))
    x = np.where((kind == "outlier")[..., None], small, x)
    x = np.where((kind == "zero")[..., None], 0.0, x)
    at = rng.integers(0, 16, (m, nb))
    sign = np.where(rng.random((m, nb)) < 0.5, -1.0, 1.0)
    ii, jj = np.meshgrid(np.arange(m), np.arange(nb), indexing="ij")
    x[ii, jj, at] = np.where(kind == "zero", 0.0, sign * vmax)
    x = x.reshape(m, nb * 16)
    if dtype == "bfloat16":
        x = bf16_round(f32(x))
    elif dtype != "float32":
        raise ValueError(f"dtype: expected 'bfloat16' or 'float32', got {dtype!r}")
    return NVFP4Input(f32(x).astype(np.float32), d, ideal, reg, kind)


def nvfp4_tensors(recipe: str = "trtllm", **kwargs):
    """``oracle.NVFP4`` tensors: :func:`nvfp4_inputs` (same keyword arguments) quantized with ``recipe``."""
    return nvfp4_inputs(**kwargs).map(lambda inp: inp.quantize(recipe))


@dataclasses.dataclass(frozen=True)
class CheckpointWeights:
    """Checkpoint-like weights: float [..., N, K] and their ModelOpt NVFP4 quantization.

    w: float32 [..., N, K] (bf16 values); sigma: the normal's standard deviation;
    nvfp4: ``oracle.NVFP4`` with decode_scale = weight_scale_2 per matrix (shape ``[...]``).
    """

    w: np.ndarray
    sigma: float
    nvfp4: oracle.NVFP4


def modelopt_quantize(w: np.ndarray) -> oracle.NVFP4:
    """ModelOpt NVFP4 of each matrix of ``w [..., N, K]``: ``weight_scale_2 = amax / 2688`` per matrix."""
    w = np.asarray(w, np.float64)
    lead = w.shape[:-2]
    flat = w.reshape((-1,) + w.shape[-2:])
    parts = []
    for m in flat:
        amax = float(np.abs(m).max())
        d = oracle.decode_scale_from_amax(amax) if amax > 0 else 1.0
        parts.append(oracle.quantize(m, "modelopt", decode_scale=d))
    codes = np.stack([p.codes for p in parts]).reshape(lead + parts[0].codes.shape)
    scales = np.stack([p.scales for p in parts]).reshape(lead + parts[0].scales.shape)
    dec = np.array([float(p.decode_scale) for p in parts]).reshape(lead)
    return oracle.NVFP4(codes, scales, dec)


@st.composite
def checkpoint_weights(draw, shape=(64, 64), sigma=None, outlier: bool | st.SearchStrategy = _BOOLS):
    """Normal weights with sigma log-uniform in [1e-3, 1e-1] (default), quantized the ModelOpt way.

    shape: ``[..., N, K]`` (K a multiple of 16), tuple or strategy. sigma: float or strategy.
    outlier: add one 8-sigma outlier per matrix (real checkpoints have them; it raises
    ``weight_scale_2`` relative to the typical block).
    """
    shp = tuple(draw(_st(shape)))
    s = float(draw(_st(sigma) if sigma is not None else log_uniform(1e-3, 1e-1)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w = rng.standard_normal(shp) * s
    if draw(_st(outlier)):
        flat = w.reshape((-1,) + shp[-2:])
        idx = rng.integers(0, shp[-2] * shp[-1], flat.shape[0])
        flat.reshape(flat.shape[0], -1)[np.arange(flat.shape[0]), idx] = 8.0 * s
        w = flat.reshape(shp)
    w = bf16_round(w)
    return CheckpointWeights(w.astype(np.float32), s, modelopt_quantize(w))


@st.composite
def routings(draw, num_tokens=_TOKENS_8, num_experts=_EXPERTS_8, top_k=None, kind=_ROUTING):
    """``(topk_ids int32 [T, k], topk_weights fp32 [T, k])``, distinct experts per token.

    kind: ``"uniform"`` (every expert equally likely), ``"skewed"`` (Zipf-like, a few hot
    experts), ``"empty_experts"`` (only a drawn subset of at least k experts is ever used, so
    some experts get no tokens). Weights are softmax-like positive fp32 summing to ~1.
    top_k: int or strategy, default 1..min(4, E).
    """
    t, e = draw(_st(num_tokens)), draw(_st(num_experts))
    k = draw(_st(top_k) if top_k is not None else st.integers(1, min(4, e)))
    if not 1 <= k <= e:
        raise ValueError(f"top_k: expected 1 <= k <= num_experts={e}, got {k}")
    kd = draw(_st(kind))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    p = np.ones(e)
    if kd == "skewed":
        p = 1.0 / (1.0 + np.arange(e)) ** 1.5
    elif kd == "empty_experts":
        used = draw(st.integers(k, e))
        p = np.zeros(e)
        p[rng.permutation(e)[:used]] = 1.0
    elif kd != "uniform":
        raise ValueError(f"kind: expected one of {ROUTING_KINDS}, got {kd!r}")
    ids = np.stack([rng.choice(e, size=k, replace=False, p=p / p.sum()) for _ in range(t)])
    logits = rng.standard_normal((t, k))
    wts = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return ids.astype(np.int32), f32(wts).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class MoEProblem:
    """One MoE layer and its inputs, in ``oracle.moe``'s argument order (see :meth:`args`).

    hidden float64 [T, H] (bf16 values); topk_ids int32 [T, k]; topk_weights float32 [T, k];
    fc1 ``oracle.NVFP4`` [E, R, H], fc2 [E, H, I] (ModelOpt-quantized, decode_scale [E]);
    fc1_input_scale, fc2_input_scale float64 [E] (fp32 values, decode form); w1/w2 the float
    weights they came from; sigma their standard deviation.
    """

    hidden: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    fc1: oracle.NVFP4
    fc2: oracle.NVFP4
    fc1_input_scale: np.ndarray
    fc2_input_scale: np.ndarray
    activation: str
    gate_up_order: str
    w1: np.ndarray
    w2: np.ndarray
    sigma: float

    def args(self) -> tuple:
        return (self.hidden, self.topk_ids, self.topk_weights, self.fc1, self.fc2,
                self.fc1_input_scale, self.fc2_input_scale)

    def kwargs(self) -> dict:
        return {"activation": self.activation, "gate_up_order": self.gate_up_order}

    def __repr__(self) -> str:
        t, h = self.hidden.shape
        e, r, _ = self.fc1.codes.shape
        return (f"MoEProblem(T={t}, H={h}, R={r}, E={e}, k={self.topk_ids.shape[1]}, "
                f"activation={self.activation!r}, sigma={self.sigma:.3g}, "
                f"weight_scale_2 fc1 {np.round(np.atleast_1d(self.fc1.decode_scale), 9).tolist()}, "
                f"fc2 {np.round(np.atleast_1d(self.fc2.decode_scale), 9).tolist()}, "
                f"topk_ids={self.topk_ids.tolist()})")


@st.composite
def moe_problems(
    draw,
    num_tokens=_TOKENS_6,
    hidden_size=_SIZES,
    intermediate_size=_SIZES,
    num_experts=_EXPERTS_5,
    top_k=None,
    activation=_ACTIVATIONS,
    gate_up_order: str = "up_gate",
    sigma=None,
    hidden_scale=None,
    routing_kind=_ROUTING,
) -> MoEProblem:
    """Small MoE layers with checkpoint-like weights and calibrated input scales.

    Weights ~ N(0, sigma^2) with sigma log-uniform in [1e-3, 1e-1] (default), quantized the
    ModelOpt way per expert. hidden ~ N(0, hidden_scale^2) (default log-uniform in [1e-2, 1e2]),
    bf16. ``input_scale`` per expert = calibrated amax / 2688 times a jitter in [0.7, 1.3]
    (FC2's from the float forward pass), as ModelOpt's calibration gives. Every parameter
    takes a value or a strategy.
    """
    t = draw(_st(num_tokens))
    h = draw(_st(hidden_size))
    i = draw(_st(intermediate_size))
    e = draw(_st(num_experts))
    act = draw(_st(activation))
    ids, wts = draw(routings(num_tokens=t, num_experts=e, top_k=top_k, kind=routing_kind))
    r = 2 * i if act == "swiglu" else i
    w1 = draw(checkpoint_weights(shape=(e, r, h), sigma=sigma))
    w2 = draw(checkpoint_weights(shape=(e, h, i), sigma=w1.sigma))
    hs = float(draw(_st(hidden_scale) if hidden_scale is not None else log_uniform(1e-2, 1e2)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hidden = bf16_round(rng.standard_normal((t, h)) * hs)
    amax_x = max(float(np.abs(hidden).max()), 1e-30)
    s1 = f32(amax_x * rng.uniform(0.7, 1.3, e) / 2688.0)
    u = np.einsum("th,erh->ter", hidden, oracle.dequantize(w1.nvfp4))
    hf = importlib.import_module("oracle.moe").activate(u, act, gate_up_order)
    amax_h = max(float(np.abs(hf).max()), 1e-30)
    s2 = f32(amax_h * rng.uniform(0.7, 1.3, e) / 2688.0)
    return MoEProblem(hidden, ids, wts, w1.nvfp4, w2.nvfp4, s1, s2, act, gate_up_order,
                      w1.w, w2.w, w1.sigma)
