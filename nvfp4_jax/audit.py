"""The scale-folding audit behind ``nvfp4 audit`` (TensorRT-LLM issue #21461).

For each NVFP4 layer of a ModelOpt checkpoint (or, by default, one synthetic MoE layer shaped
like Nemotron Super's layer 1) it measures what folding ``weight_scale_2`` into the E4M3 block
scales does (``NVFP4CuteDslB12xFusedMoEMethod.transform_weights``,
``nvfp4_jax.interop.trtllm.fold_block_scales``):

* the share of folded block scales ``E4M3(scale * weight_scale_2)`` that are E4M3 subnormals
  (``0 < s < 2^-6``) and that are exactly zero, over blocks whose checkpoint scale is non-zero;
* the mean and max relative error of the folded scale against ``scale * weight_scale_2``;
* for MoE layers, the relative output error ``||out - ref|| / ||ref||`` (Frobenius) against
  ``oracle.moe(mode="trtllm_cutlass")`` at T in {1, 2, 4, 8, 17, 64} tokens for each
  semantics: ``ours`` (``nvfp4_jax.moe``), ``trtllm_cutlass``, ``trtllm_cutedsl_b12x``
  (folded) and ``flashinfer_fixed`` (the fix), the last three re-enacted by
  ``nvfp4_jax.interop.trtllm``.

Only folding TensorRT-LLM's way reproduces the issue: for MoE layers the folded factor is
``w_scale_2 = fc_alpha * fc_input_scale`` (fp32), for dense layers ``weight_scale_2`` itself.

The report ends with a :func:`verdict`: whether the folded path is damaged (median output error
over decode batches above 1 %), how much in the worst and the typical MoE layer, and which paths
keep ``weight_scale_2`` in an fp32 alpha instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterable

import numpy as np

import oracle
from oracle.formats import bf16_round, e4m3_decode, f32

from . import checkpoint as ckpt
from .interop import modelopt as MO
from .interop import trtllm as T

TOKENS = (1, 2, 4, 8, 17, 64)
SEMANTICS = ("ours", "trtllm_cutlass", "trtllm_cutedsl_b12x", "flashinfer_fixed")
SEMANTICS_LABEL = {
    "ours": "ours (nvfp4_jax.moe)",
    "trtllm_cutlass": "TRT-LLM CUTLASS",
    "trtllm_cutedsl_b12x": "TRT-LLM CUTEDSL-b12x (folded)",  # folded below m = 64 only
    "flashinfer_fixed": "fixed (input_global_scale)",
}
#: what TRT-LLM issue #21461 reported on DGX Spark (Nemotron Super, CUTEDSL-b12x backend)
ISSUE_21461 = {"moe_rel_error": "8-10 % per MoE layer", "fc1_zero_scales": 0.008,
               "mean_scale_error": 0.141}
E4M3_MIN_NORMAL = 2.0**-6
_E2M1 = oracle.E2M1_VALUES

#: the default layer: Nemotron Super layer 1 (latent MoE: hidden 1024, 512 experts, top-22)
DEFAULT_SHAPE = {"hidden": 1024, "intermediate": 2688, "experts": 512, "top_k": 22,
                 "activation": "relu2"}
DEFAULT_SUBSET = 24
#: a checkpoint's defaults: experts evaluated per MoE layer; top-k without num_experts_per_tok
CHECKPOINT_EXPERTS = 64
CHECKPOINT_TOP_K = 8
#: N(0, sigma^2) with sigma giving weight_scale_2 ~ 2e-5 for a 2688x1024 matrix
DEFAULT_SIGMA = 0.0106
#: share of quiet output channels (sigma / 4): real checkpoints have some; they give the zeros
DEFAULT_QUIET = (0.015, 0.25)


# ---------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------

class Progress:
    """tqdm when installed, else a one-line stderr bar; silent when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.enabled, self.total, self.n, self.desc = enabled, total, 0, desc
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except ImportError:
                self._bar = None

    def update(self, note: str = "") -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(note)
            self._bar.update(1)
            return
        width = 30
        k = int(width * self.n / max(self.total, 1))
        sys.stderr.write(f"\r{self.desc} [{'#' * k}{'.' * (width - k)}] {self.n}/{self.total} {note:<30}")
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


# ---------------------------------------------------------------------------------------
# scale statistics
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class ScaleStats:
    """Folded block scales of one weight (all experts): shares and relative errors."""

    blocks: int
    subnormal: float
    zero: float
    mean_rel_error: float
    max_rel_error: float
    sample_ideal: np.ndarray = dataclasses.field(repr=False)
    sample_rel_error: np.ndarray = dataclasses.field(repr=False)
    weight_rel_error: float | None = None  # ||W_folded - W||_F / ||W||_F of the dequantized weight

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "subnormal_share": self.subnormal, "zero_share": self.zero,
                "mean_rel_scale_error": self.mean_rel_error, "max_rel_scale_error": self.max_rel_error,
                "weight_rel_error": self.weight_rel_error}


def folded_scale_stats(scales: np.ndarray, w_scale_2: np.ndarray, *, codes: np.ndarray | None = None,
                       sample: int = 20000, seed: int = 0) -> ScaleStats:
    """Statistics of ``E4M3(float(scales) * w_scale_2[e])`` against the exact product.

    scales: uint8 E4M3 bytes [E, ...] (or [...] with a scalar w_scale_2); w_scale_2: fp32 [E]
    or scalar; codes: the packed E2M1 weights [..., K/2] (optional) for the relative Frobenius
    change of the dequantized weight. Blocks whose checkpoint scale is zero are left out of the
    shares and scale errors.
    """
    s = np.asarray(scales, np.uint8)
    ws = np.asarray(w_scale_2, np.float64)
    if ws.ndim == 0:
        s, ws = s[None], ws.reshape(1)
    folded = e4m3_decode(T.fold_block_scales(s, ws))
    ideal = e4m3_decode(s) * f32(ws).reshape((-1,) + (1,) * (s.ndim - 1))
    m = ideal > 0
    fi, ii = folded[m], ideal[m]
    rel = np.abs(fi - ii) / ii
    rng = np.random.default_rng(seed)
    pick = rng.choice(ii.size, size=min(sample, ii.size), replace=False) if ii.size else np.zeros(0, int)
    werr = None
    if codes is not None:
        c = np.asarray(codes, np.uint8).reshape(ideal.shape + (8,))
        sq = np.square(_E2M1[c & 0xF]) + np.square(_E2M1[c >> 4])  # per byte, both nibbles
        energy = sq.sum(-1)  # sum of e2m1^2 per block
        num = float(np.sum(energy * np.square(folded - ideal)))
        den = float(np.sum(energy * np.square(ideal)))
        werr = float(np.sqrt(num / den)) if den > 0 else 0.0
    return ScaleStats(int(ii.size), float(np.mean((fi > 0) & (fi < E4M3_MIN_NORMAL))) if ii.size else 0.0,
                      float(np.mean(fi == 0)) if ii.size else 0.0,
                      float(rel.mean()) if ii.size else 0.0, float(rel.max()) if ii.size else 0.0,
                      ii[pick], rel[pick], werr)


def moe_fold_factors(layer: ckpt.MoELayer) -> tuple[np.ndarray, np.ndarray]:
    """The ``w_scale_2 = fc_alpha * fc_input_scale`` TensorRT-LLM's b12x path folds (fp32 [E] each)."""
    rt = T.cutlass_moe_weights(layer.fc1, layer.fc2, _input_scales(layer.fc1_input_scale),
                               _input_scales(layer.fc2_input_scale), activation=layer.activation)
    return ((rt.fc1_alpha * rt.fc1_act_scale).astype(np.float64),
            (rt.fc2_alpha * rt.fc2_act_scale).astype(np.float64))


def _input_scales(s) -> np.ndarray:
    s = np.asarray(s, np.float64)
    if np.all(np.isnan(s)):
        raise ValueError("input_scale: the checkpoint has no input_scale for these experts (weight-only NVFP4)")
    return np.where(np.isnan(s), np.nanmax(s), s)


# ---------------------------------------------------------------------------------------
# MoE output error
# ---------------------------------------------------------------------------------------

def _routing(rng, t: int, e: int, k: int):
    logits = rng.standard_normal((t, e))
    ids = np.argsort(-logits, axis=1)[:, :k]
    top = np.take_along_axis(logits, ids, axis=1)
    w = np.exp(top - top.max(1, keepdims=True))
    return ids.astype(np.int32), f32(w / w.sum(1, keepdims=True)).astype(np.float32)


def _ours(layer: ckpt.MoELayer, hidden, ids, wts, s1, s2):
    import jax.numpy as jnp

    import nvfp4_jax

    fc1, fc2 = nvfp4_jax.from_oracle(layer.fc1), nvfp4_jax.from_oracle(layer.fc2)
    out = nvfp4_jax.moe(jnp.asarray(hidden, jnp.bfloat16), fc1=fc1, fc2=fc2,
                        fc1_input_scale=jnp.asarray(s1, jnp.float32),
                        fc2_input_scale=jnp.asarray(s2, jnp.float32),
                        topk_ids=jnp.asarray(ids), topk_weights=jnp.asarray(wts),
                        activation=layer.activation, gate_up_order=layer.gate_up_order,
                        mode="trtllm_cutlass")
    return np.asarray(out.astype(jnp.float32), np.float64)


def moe_errors(
    layer: ckpt.MoELayer,
    *,
    tokens: Iterable[int] = TOKENS,
    top_k: int = 8,
    semantics: Iterable[str] = SEMANTICS,
    seed: int = 0,
    hidden_std: float | None = None,
    batched: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[int, float]]:
    """Relative output error of each semantics vs ``oracle.moe(mode="trtllm_cutlass")`` per T.

    For each T: T tokens ~ N(0, hidden_std^2) in bf16 (default: matched to the calibrated
    ``fc1_input_scale``, amax ~ 4 sigma), routed to the top-k of a softmax over random router
    logits (renormalized). ``batched`` runs all token sets through one call per semantics and
    splits the rows: every semantics here is row-independent (static activation scales,
    per-row quantization, per-row dots), which ``tests/test_audit.py`` checks against separate
    calls. ``trtllm_cutedsl_b12x`` follows ``CuteDslB12xFusedMoE``'s dispatch: a layer call
    with T >= 64 rows (prefill) runs CUTLASS on the checkpoint scales, T < 64 (decode) the
    folded b12x path (``interop.trtllm.cutedsl_b12x_path``).
    """
    tokens = tuple(tokens)
    semantics = tuple(semantics)
    s1, s2 = _input_scales(layer.fc1_input_scale), _input_scales(layer.fc2_input_scale)
    if hidden_std is None:
        hidden_std = float(np.max(s1)) * 2688.0 / 4.0
    e = layer.fc1.codes.shape[0]
    k = min(top_k, e)
    rng = np.random.default_rng(seed)
    sets = []
    for t in tokens:
        hidden = bf16_round(rng.standard_normal((t, layer.fc1.codes.shape[2] * 2)) * hidden_std)
        sets.append((hidden, *_routing(rng, t, e, k)))
    kw = {"activation": layer.activation, "gate_up_order": layer.gate_up_order}

    def run_all(fn):
        # fn(hidden, ids, weights, m): m = the rows of the layer call being modelled (T), which
        # decides CUTEDSL-b12x's CUTLASS/b12x dispatch; batching only joins calls on one path
        if not batched:
            return [fn(*st, t) for st, t in zip(sets, tokens)]
        out: list = [None] * len(sets)
        for path in ("cutlass", "b12x"):
            idx = [j for j, t in enumerate(tokens) if T.cutedsl_b12x_path(t) == path]
            if not idx:
                continue
            y = fn(*(np.concatenate([sets[j][i] for j in idx]) for i in range(3)), tokens[idx[0]])
            for j, part in zip(idx, np.split(y, np.cumsum([tokens[j] for j in idx])[:-1])):
                out[j] = part
        return out

    def call(sem):
        if sem == "reference":
            return lambda h, i, w, m: oracle.moe(h, i, w, layer.fc1, layer.fc2, s1, s2,
                                                 mode="trtllm_cutlass", **kw)
        if sem == "ours":
            return lambda h, i, w, m: _ours(layer, h, i, w, s1, s2)
        return lambda h, i, w, m: T.run_pipeline(sem, h, i, w, layer.fc1, layer.fc2, s1, s2,
                                                 dispatch_m=m, **kw)

    refs = run_all(call("reference"))
    if progress:
        progress("oracle")
    out: dict[str, dict[int, float]] = {}
    for sem in semantics:
        ys = run_all(call(sem))
        out[sem] = {t: float(np.linalg.norm(y - r) / max(float(np.linalg.norm(r)), 1e-300))
                    for t, y, r in zip(tokens, ys, refs)}
        if progress:
            progress(sem)
    return out


# ---------------------------------------------------------------------------------------
# the default layer
# ---------------------------------------------------------------------------------------

def default_layer(*, num_experts: int = DEFAULT_SUBSET, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> ckpt.MoELayer:
    """A ModelOpt-quantized MoE layer shaped like Nemotron Super's layer 1, experts 0..n-1 of 512.

    Weights (deterministic, numpy ``Generator`` ``seed``): N(0, 0.0106^2) per element -- so
    ``weight_scale_2`` ~ 2e-5 -- with 1.5 % of output channels at a quarter of that sigma.
    fc1 ``up_proj`` [I=2688, H=1024], fc2 ``down_proj`` [H, I], relu2. Input scales calibrated
    ModelOpt-style on 256 N(0, 1) tokens (fc2 per expert on the unquantized forward, fp32).
    """
    h, i = DEFAULT_SHAPE["hidden"], DEFAULT_SHAPE["intermediate"]
    g = np.random.default_rng(seed)
    frac, fac = DEFAULT_QUIET
    calib = bf16_round(np.random.default_rng(seed + 1).standard_normal((256, h)))
    amax_x = float(np.abs(calib).max())
    calib32 = calib.astype(np.float32)  # ModelOpt calibrates on the unquantized model
    fc1, fc2, s2 = [], [], []
    for _ in range(num_experts):
        lins = []
        for shape in ((i, h), (h, i)):
            rows = np.where(g.random((shape[0], 1), dtype=np.float32) < frac, fac, 1.0)
            sigma = np.float32(DEFAULT_SIGMA) * rows.astype(np.float32)
            w = g.standard_normal(shape, dtype=np.float32) * sigma
            lins.append(bf16_round(w).astype(np.float32))  # checkpoints come from bf16 weights
        l1 = MO.quantize_linear(lins[0], amax_x)
        hcal = np.square(np.maximum(calib32 @ lins[0].T, np.float32(0.0)))
        l2 = MO.quantize_linear(lins[1], float(np.abs(hcal).max()))
        fc1.append(l1)
        fc2.append(l2)
        s2.append(l2.input_scale)
        if progress:
            progress(f"expert {len(fc1)}/{num_experts}")
    s1 = np.full(num_experts, fc1[0].input_scale)
    return ckpt.MoELayer("nemotron_super_layer1 (synthetic)", MO.stack(fc1), MO.stack(fc2), s1,
                         np.array(s2), "relu2", tuple(range(num_experts)), DEFAULT_SHAPE["experts"])


# ---------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class LayerReport:
    name: str
    kind: str  # "moe" | "dense"
    scales: dict[str, ScaleStats]
    moe_errors: dict[str, dict[int, float]] | None = None
    experts: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        d = {"name": self.name, "kind": self.kind,
             "scales": {k: v.to_json() for k, v in self.scales.items()}, "notes": self.notes}
        if self.kind == "moe":
            d.update(experts_evaluated=self.experts, num_experts=self.num_experts, top_k=self.top_k,
                     moe_rel_output_error={s: {str(t): v for t, v in e.items()}
                                           for s, e in (self.moe_errors or {}).items()})
        return d


def audit_moe_layer(layer: ckpt.MoELayer, *, top_k: int, tokens=TOKENS, seed: int = 0,
                    progress: Callable[[str], None] | None = None,
                    semantics: Iterable[str] = SEMANTICS) -> LayerReport:
    notes = []
    if len(layer.experts) < layer.num_experts:
        notes.append(f"experts {layer.experts[0]}..{layer.experts[-1]} of {layer.num_experts} "
                     f"evaluated (subset); routing top-{min(top_k, len(layer.experts))} among them")
    f1, f2 = moe_fold_factors(layer)
    scales = {"fc1": folded_scale_stats(layer.fc1.scales, f1, codes=layer.fc1.codes, seed=seed),
              "fc2": folded_scale_stats(layer.fc2.scales, f2, codes=layer.fc2.codes, seed=seed + 1)}
    errs = moe_errors(layer, tokens=tokens, top_k=top_k, seed=seed, progress=progress,
                      semantics=semantics)
    return LayerReport(layer.name, "moe", scales, errs, len(layer.experts), layer.num_experts,
                       min(top_k, len(layer.experts)), notes)


def audit_dense_layer(layer: ckpt.DenseLayer, seed: int = 0) -> LayerReport:
    st = folded_scale_stats(layer.weight.scales, np.asarray(layer.weight.decode_scale),
                            codes=layer.weight.codes, seed=seed)
    return LayerReport(layer.name, "dense", {"weight": st},
                       notes=["folding factor = weight_scale_2 (diagnostic; TRT-LLM folds only in the b12x MoE path)"])


def audit_default(*, num_experts: int = DEFAULT_SUBSET, tokens=TOKENS, seed: int = 0,
                  progress: bool = True, semantics: Iterable[str] = SEMANTICS,
                  top_k: int = DEFAULT_SHAPE["top_k"]) -> list[LayerReport]:
    """Audit the synthetic Nemotron-Super-layer-1 MoE (see :func:`default_layer`).

    ``num_experts``: 1..512; ``top_k``: 1..num_experts (ValueError otherwise, never clipped).
    """
    semantics = tuple(semantics)
    if not 1 <= num_experts <= DEFAULT_SHAPE["experts"]:
        raise ValueError(f"experts: expected 1..{DEFAULT_SHAPE['experts']} (the synthetic "
                         f"layer's), got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected 1..{num_experts} (the experts evaluated), got {top_k}")
    bar = Progress(num_experts + 1 + len(semantics), "nvfp4 audit", progress)
    try:
        layer = default_layer(num_experts=num_experts, seed=seed, progress=bar.update)
        rep = audit_moe_layer(layer, top_k=top_k, tokens=tokens, seed=seed,
                              progress=bar.update, semantics=semantics)
    finally:
        bar.close()
    rep.notes.insert(0, f"synthetic weights N(0, {DEFAULT_SIGMA}^2), {DEFAULT_QUIET[0]:.1%} quiet "
                        f"channels at {DEFAULT_QUIET[1]}x sigma; hidden {DEFAULT_SHAPE['hidden']}, "
                        f"intermediate {DEFAULT_SHAPE['intermediate']}, relu2")
    return [rep]


def audit_checkpoint(path: str, *, max_experts: int = CHECKPOINT_EXPERTS, top_k: int | None = None,
                     tokens=TOKENS, seed: int = 0, progress: bool = True,
                     semantics: Iterable[str] = SEMANTICS) -> list[LayerReport]:
    """Audit every NVFP4 layer of a ModelOpt checkpoint directory.

    Each MoE layer is loaded with its first ``max_experts`` experts (scale statistics and output
    errors both use those); top-k comes from ``config.json`` (``num_experts_per_tok``, else 8)
    unless given, and must not exceed the experts evaluated (ValueError, never clipped). Dense
    NVFP4 linears get the scale statistics only. A checkpoint with no NVFP4 linear raises
    ``checkpoint.CheckpointError``: there is nothing to audit.
    """
    semantics = tuple(semantics)
    ck = ckpt.load(path)
    if top_k is not None:
        k, origin = top_k, "top_k"
    else:
        k = ck.config.get("num_experts_per_tok") or CHECKPOINT_TOP_K
        origin = "config.json num_experts_per_tok"
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ckpt.CheckpointError(os.path.join(path, "config.json"), None,
                                       f"num_experts_per_tok: expected an integer >= 1, got {k!r}")
    layers = list(ck.layers(max_experts=max_experts))
    if not layers:
        dts = sorted({ck.dtype(n) for n in ck.names()})
        raise ckpt.CheckpointError(path, None, f"{MO.QUANT_CONFIG_FILE} says NVFP4, but no "
                                   "tensor set {prefix}.weight (U8) + .weight_scale (F8_E4M3) + "
                                   f".weight_scale_2 (F32) is present ({len(ck.names())} "
                                   "tensors, dtypes "
                                   f"{', '.join(dts) or 'none'}): nothing to audit")
    for l in layers:
        if isinstance(l, ckpt.MoELayer) and k > len(l.experts):
            more = " or more --experts" if len(l.experts) < l.num_experts else ""
            raise ValueError(f"{origin} {k}: expected 1..{len(l.experts)}, at most the experts "
                             f"evaluated in {l.name} ({len(l.experts)} of {l.num_experts}); give a "
                             f"smaller --top-k{more}")
    n_moe = sum(isinstance(l, ckpt.MoELayer) for l in layers)
    bar = Progress(len(layers) + n_moe * (1 + len(semantics)), "nvfp4 audit", progress)
    reports = []
    try:
        for l in layers:
            if isinstance(l, ckpt.MoELayer):
                reports.append(audit_moe_layer(l, top_k=k, tokens=tokens, seed=seed,
                                               progress=bar.update, semantics=semantics))
            else:
                reports.append(audit_dense_layer(l, seed=seed))
            bar.update(l.name)
    finally:
        bar.close()
    return reports


#: relative output error above which the folded path counts as damaged (bf16 output rounding
#: alone is ~0.2 %, see the TRT-LLM CUTLASS row)
DAMAGE_THRESHOLD = 0.01
#: TensorRT-LLM's CUTEDSL-b12x MoE runs CUTLASS for batches of this many tokens and more:
#: only decode batches take the folded path (nvfp4-semantics.md section 3.4)
B12X_CUTLASS_FROM = T.PREFILL_VIA_CUTLASS_THRESHOLD
FOLDED = "trtllm_cutedsl_b12x"
FIX_ADVICE = ("use a path that keeps weight_scale_2 as an fp32 alpha instead of folding it into "
              "the E4M3 block scales: FlashInfer >= 0.6.17's b12x MoE with input_global_scale "
              "(FlashInfer PR #3932; vLLM passes it since PR #48536), TensorRT-LLM's CUTLASS MoE "
              "backend, or nvfp4_jax.moe. The checkpoint itself is fine: do not requantize it.")


@dataclasses.dataclass
class Verdict:
    """What the audit concludes: which path is damaged, by how much, and what to do.

    ``worst`` / ``typical``: relative MoE output error of the folded path (the table's metric),
    each layer summarised by its median over decode token counts T < 64; ``worst`` is the
    worst layer's (``worst_layer``), ``typical`` the median over layers; ``fixed``: the same
    for the fp32-alpha fix. None where no MoE layer was evaluated.
    """

    damaged: bool
    path: str
    worst_layer: str | None
    worst: float | None
    typical: float | None
    fixed: float | None
    lines: list[str]

    def to_json(self) -> dict:
        return {"damaged": self.damaged, "path": self.path, "worst_layer": self.worst_layer,
                "worst_rel_output_error": self.worst, "typical_rel_output_error": self.typical,
                "fixed_rel_output_error": self.fixed, "text": " ".join(self.lines)}


def _decode_median(errors: dict[int, float]) -> float:
    ts = [t for t in errors if t < B12X_CUTLASS_FROM] or list(errors)
    return float(np.median([errors[t] for t in ts]))


def verdict(reports: list[LayerReport]) -> Verdict:
    """The verdict on ``reports`` (see :class:`Verdict`)."""
    path = SEMANTICS_LABEL[FOLDED]
    moe = [r for r in reports if r.kind == "moe" and r.moe_errors and FOLDED in r.moe_errors]
    if not moe:
        dense = [(s.weight_rel_error or 0.0, r.name) for r in reports for s in r.scales.values()]
        worst_w, name = max(dense) if dense else (0.0, None)
        lines = [f"No MoE layer evaluated: {path} folds weight_scale_2 only in MoE experts, so it "
                 "does not touch this checkpoint's NVFP4 linears (TensorRT-LLM keeps their "
                 "weight_scale_2 in the GEMM alpha)."]
        if name is not None:
            lines.append(f"Were they folded, the dequantized weights would change by up to "
                         f"{worst_w:.2%} (W err, {name}).")
        return Verdict(False, path, name, None, None, None, lines)
    per = sorted(((_decode_median(r.moe_errors[FOLDED]), r.name) for r in moe), reverse=True)
    worst, worst_layer = per[0]
    typical = float(np.median([e for e, _ in per]))
    fixed = (max(_decode_median(r.moe_errors["flashinfer_fixed"]) for r in moe)
             if all("flashinfer_fixed" in r.moe_errors for r in moe) else None)
    base = (max(_decode_median(r.moe_errors["trtllm_cutlass"]) for r in moe)
            if all("trtllm_cutlass" in r.moe_errors for r in moe) else None)
    fc1 = [r.scales["fc1"] for r in moe if "fc1" in r.scales]
    damaged = worst > DAMAGE_THRESHOLD
    n = f"{len(moe)} MoE layer{'s' if len(moe) > 1 else ''}"
    how = f"relative MoE output error (median over T < {B12X_CUTLASS_FROM}) {worst:.1%} "
    how += (f"in the worst layer ({worst_layer}), {typical:.1%} in the typical one of {n}"
            if len(moe) > 1 else f"({worst_layer})")
    if damaged:
        lines = [f"DAMAGED: {path}, TensorRT-LLM's MoE backend for SM120/SM121 (RTX 50xx, DGX "
                 f"Spark), on decode batches (< {B12X_CUTLASS_FROM} tokens; prefill runs CUTLASS): "
                 f"{how}."]
        why = ("Why: folding weight_scale_2 into the E4M3 block scales pushes them into E4M3's "
               "subnormals")
        if fc1:
            why += (f" (up to {max(st.subnormal for st in fc1):.1%} of FC1 scales subnormal, "
                    f"{max(st.zero for st in fc1):.2%} rounded to 0)")
        lines.append(why + ".")
        ref = []
        if fixed is not None:
            ref.append(f"the fp32-alpha fix: {fixed:.2%}")
        if base is not None:
            ref.append(f"TRT-LLM CUTLASS: {base:.2%}")
        if ref:
            tail = " (worst layer)." if len(moe) > 1 else "."
            lines.append("On the same tokens: " + ", ".join(ref) + tail)
        lines.append("What to do: " + FIX_ADVICE)
    else:
        lines = [f"Not damaged beyond {DAMAGE_THRESHOLD:.0%}: {path} on this checkpoint gives a "
                 f"{how}.", "Folding is still lossy where weight_scale_2 is small; if that "
                 f"changes, {FIX_ADVICE}"]
    return Verdict(damaged, path, worst_layer, worst, typical, fixed, lines)


def format_report(reports: list[LayerReport], source: str, seconds: float | None = None) -> str:
    """The human-readable table."""
    lines = [f"nvfp4 audit: {source}", ""]
    lines.append("Folding weight_scale_2 into E4M3 block scales (TRT-LLM CUTEDSL-b12x transform_weights):")
    hdr = (f"  {'layer':<44} {'weight':<7} {'blocks':>10} {'subnormal':>10} {'zero':>8} "
           f"{'mean err':>9} {'max err':>8} {'W err':>7}")
    lines += [("  (shares and errors over blocks with a non-zero checkpoint scale; W err = relative "
               "Frobenius change of the dequantized weight)"), hdr, "  " + "-" * (len(hdr) - 2)]
    for r in reports:
        for wn, s in r.scales.items():
            werr = "" if s.weight_rel_error is None else f"{s.weight_rel_error:>7.2%}"
            lines.append(f"  {r.name[-44:]:<44} {wn:<7} {s.blocks:>10d} {s.subnormal:>10.2%} "
                         f"{s.zero:>8.3%} {s.mean_rel_error:>9.2%} {s.max_rel_error:>8.1%} {werr}")
    for r in reports:
        if r.kind != "moe" or not r.moe_errors:
            continue
        toks = sorted(next(iter(r.moe_errors.values())))
        lines += ["", f"MoE relative output error vs oracle.moe (trtllm_cutlass semantics): {r.name}"]
        lines.append(f"  experts evaluated {r.experts} of {r.num_experts}, top-{r.top_k}")
        head = f"  {'semantics':<32}" + "".join(f"{'T=' + str(t):>10}" for t in toks)
        lines += [head, "  " + "-" * (len(head) - 2)]
        for sem, e in r.moe_errors.items():
            lines.append(f"  {SEMANTICS_LABEL.get(sem, sem):<32}" + "".join(f"{e[t]:>10.3%}" for t in toks))
        if "trtllm_cutedsl_b12x" in r.moe_errors:
            m = T.PREFILL_VIA_CUTLASS_THRESHOLD
            lines.append(f"  note: TRT-LLM CUTEDSL-b12x runs CUTLASS for m >= {m} rows (prefill, "
                         "checkpoint scales) and the folded b12x kernel below (decode): "
                         f"T >= {m} columns show its unfolded prefill path")
        for n in r.notes:
            lines.append(f"  note: {n}")
    lines += ["", ("TRT-LLM #21461 (DGX Spark, Nemotron Super) reported: "
                   f"{ISSUE_21461['moe_rel_error']} output error, "
                   f"{ISSUE_21461['fc1_zero_scales']:.1%} of FC1 block scales exactly 0, "
                   f"mean scale error {ISSUE_21461['mean_scale_error']:.1%}."),
              ("The folded path's output error follows the dequantized-weight change (W err): "
               "relu2 squares the FC1 output, doubling FC1's relative error, and FC2 adds its own.")]
    lines += ["", "Verdict:"]
    for t in verdict(reports).lines:
        lines += textwrap.wrap(t, 100, initial_indent="  ", subsequent_indent="    ")
    if seconds is not None:
        lines.append(f"({seconds:.1f} s)")
    return "\n".join(lines)


def to_json(reports: list[LayerReport], source: str) -> dict:
    return {"tool": "nvfp4 audit", "source": source,
            "reference": "oracle.moe(mode='trtllm_cutlass') on the checkpoint scales",
            "error_metric": "||out - ref||_F / ||ref||_F", "scale_error_metric":
            "|E4M3(s * w_scale_2) - s * w_scale_2| / (s * w_scale_2), blocks with s > 0",
            "issue_21461_reported": ISSUE_21461,
            "reenacted": f"re-enacted ({T.SOURCE})",
            "cutedsl_b12x_dispatch": (f"CUTLASS (unfolded) for T >= "
                                      f"{T.PREFILL_VIA_CUTLASS_THRESHOLD} rows, folded b12x below"),
            "verdict": verdict(reports).to_json(),
            "layers": [r.to_json() for r in reports]}


def short_names(names: list[str]) -> list[str]:
    """Layer names without the prefix they all share (``model.layers.``), still unique."""
    if len(names) < 2:
        return list(names)
    parts = [n.split(".") for n in names]
    i = 0
    while all(len(p) > i + 1 for p in parts) and len({p[i] for p in parts}) == 1:
        i += 1
    return [".".join(p[max(i - 1, 0):]) for p in parts]  # keep one shared word: "layers.3.mixer"


#: scale-panel series drawn one per layer up to this many; beyond, one per weight role
PLOT_MAX_SERIES = 6


def plot(reports: list[LayerReport], path: str) -> None:
    """PNG: folded-scale relative error against scale magnitude; MoE output error against T
    (one MoE layer) or per layer (several, each at its median over T < 64).

    Needs matplotlib (``pip install 'nvfp4-jax[plot]'``); ImportError saying so otherwise.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib, which is not installed: "
                          "pip install 'nvfp4-jax[plot]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [r for r in reports if r.kind == "moe" and r.moe_errors]
    fig, axes = plt.subplots(1, 2 if moe else 1, figsize=(14 if moe else 7.5, 6.4), squeeze=False)
    ax = axes[0, 0]
    series = [(r, wn, st) for r in reports for wn, st in r.scales.items() if st.sample_ideal.size]
    if len(series) <= PLOT_MAX_SERIES:
        short = dict(zip([r.name for r in reports], short_names([r.name for r in reports])))
        groups = [(f"{short[r.name]} {wn}", [st]) for r, wn, st in series]
    else:  # many layers: one colour per weight role, all layers' samples together
        roles = sorted({wn for _, wn, _ in series})
        groups = []
        for wn in roles:
            sts = [st for _, w, st in series if w == wn]
            name = "dense weight" if wn == "weight" else f"MoE {wn}"
            groups.append((f"{name} ({len(sts)} layers)", sts))
    for label, sts in groups:
        x = np.concatenate([st.sample_ideal for st in sts])
        y = np.concatenate([st.sample_rel_error for st in sts])
        ax.scatter(x, np.maximum(y, 1e-6), s=2, alpha=0.3, label=label, rasterized=True)
    ax.axvline(2.0**-6, color="k", ls="--", lw=1)
    ax.text(2.0**-6, 1.4, "E4M3 min normal 2^-6 ", fontsize=8, va="bottom", ha="right")
    ax.axvline(2.0**-10, color="r", ls=":", lw=1)
    ax.text(2.0**-10, 1.4, " rounds to 0 below 2^-10", fontsize=8, va="bottom", color="r")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-6, 8)
    ax.set_xlabel("block scale x weight_scale_2 (exact)")
    ax.set_ylabel("relative error of the folded E4M3 scale (errors < 1e-6 at 1e-6)")
    ax.set_title("Folding weight_scale_2 into E4M3 block scales")
    # legends below the panels: they never hide data, whatever the layers
    ax.legend(fontsize=7, markerscale=4, loc="upper center", bbox_to_anchor=(0.5, -0.13),
              ncol=2 if len(groups) > 2 else 1, frameon=False)
    if moe:
        ax = axes[0, 1]
        floor = 1e-7
        styles = {"ours": ("o", "-", 7), "trtllm_cutlass": ("s", "--", 6),
                  FOLDED: ("^", "-", 6), "flashinfer_fixed": ("x", ":", 8)}

        if len(moe) == 1:
            r = moe[0]
            for sem, e in r.moe_errors.items():
                ts = sorted(e)
                mk, ls, ms = styles.get(sem, ("o", "-", 6))
                ax.plot(ts, [max(e[t], floor) for t in ts], marker=mk, ls=ls, ms=ms,
                        label=SEMANTICS_LABEL.get(sem, sem))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens T")
            ax.set_title(f"MoE output error: {short_names([r.name])[0]}")
        else:
            names = short_names([r.name for r in moe])
            xs = np.arange(len(moe))
            for sem in moe[0].moe_errors:
                v = [_decode_median(r.moe_errors[sem]) for r in moe]
                mk, ls, ms = styles.get(sem, ("o", "-", 6))
                ax.plot(xs, [max(x, floor) for x in v], marker=mk, ls=ls, ms=ms,
                        label=SEMANTICS_LABEL.get(sem, sem))
            step = max(1, len(moe) // 16)
            ax.set_xticks(xs[::step])
            ax.set_xticklabels(names[::step], rotation=45, ha="right", fontsize=7)
            ax.set_xlabel("MoE layer")
            ax.set_title(f"MoE output error per layer (median over T < {B12X_CUTLASS_FROM})")
        ax.axhline(2.0**-9, color="gray", ls=":", lw=1)
        ax.text(0.01, 2.0**-9, "bf16 half-ulp 2^-9", fontsize=8, va="bottom", color="gray",
                transform=ax.get_yaxis_transform())
        ax.axhline(floor, color="gray", ls="-", lw=0.5)
        ax.text(0.99, floor * 0.5, "exactly 0 (drawn at 1e-7)", fontsize=8, va="top", ha="right",
                color="gray", transform=ax.get_yaxis_transform())
        ax.set_yscale("log")
        ax.set_ylim(floor / 10, 3)
        ax.set_ylabel("relative output error vs oracle")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13 if len(moe) == 1
                                                                  else -0.22), ncol=2,
                  frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(checkpoint: str | None = None, *, json_path: str | None = None, plot_path: str | None = None,
        experts: int | None = None, tokens=TOKENS, top_k: int | None = None, seed: int = 0,
        progress: bool = True, out=None) -> list[LayerReport]:
    """What ``nvfp4 audit`` does: audit, print the table, optionally write JSON and a PNG."""
    out = out if out is not None else sys.stdout
    t0 = time.time()
    if checkpoint is None:
        n = experts or DEFAULT_SUBSET
        reports = audit_default(num_experts=n, tokens=tokens, seed=seed, progress=progress,
                                top_k=top_k or DEFAULT_SHAPE["top_k"])
        source = (f"default layer: Nemotron Super layer 1 shape (MoE hidden {DEFAULT_SHAPE['hidden']}, "
                  f"intermediate {DEFAULT_SHAPE['intermediate']}, {DEFAULT_SHAPE['experts']} experts, "
                  f"top-{DEFAULT_SHAPE['top_k']}, relu2), synthetic ModelOpt-quantized weights; "
                  f"subset of {n} experts evaluated for speed")
    else:
        reports = audit_checkpoint(checkpoint, max_experts=experts or CHECKPOINT_EXPERTS,
                                   top_k=top_k, tokens=tokens,
                                   seed=seed, progress=progress)
        source = f"checkpoint {checkpoint}"
    dt = time.time() - t0
    print(format_report(reports, source, dt), file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(to_json(reports, source), f, indent=2, default=_json_default)
        print(f"wrote {json_path}", file=out)
    if plot_path:
        plot(reports, plot_path)
        print(f"wrote {plot_path}", file=out)
    return reports


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
