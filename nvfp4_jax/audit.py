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
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
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
    "trtllm_cutedsl_b12x": "TRT-LLM CUTEDSL-b12x (folded)",
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
    import torch

    s = np.asarray(scales, np.uint8)
    ws = np.asarray(w_scale_2, np.float64)
    if ws.ndim == 0:
        s, ws = s[None], ws.reshape(1)
    folded = T.fold_block_scales(torch.from_numpy(np.array(s, copy=True)).view(torch.float8_e4m3fn),
                                 torch.from_numpy(ws).float())
    folded = folded.to(torch.float64).numpy()
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
    return ((rt.fc1_alpha * rt.fc1_act_scale).double().numpy(),
            (rt.fc2_alpha * rt.fc2_act_scale).double().numpy())


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
    calls.
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
        if not batched:
            return [fn(*st) for st in sets]
        y = fn(*(np.concatenate([st[i] for st in sets]) for i in range(3)))
        return np.split(y, np.cumsum(tokens)[:-1])

    def call(sem):
        if sem == "reference":
            return lambda h, i, w: oracle.moe(h, i, w, layer.fc1, layer.fc2, s1, s2, mode="trtllm_cutlass", **kw)
        if sem == "ours":
            return lambda h, i, w: _ours(layer, h, i, w, s1, s2)
        return lambda h, i, w: T.run_pipeline(sem, h, i, w, layer.fc1, layer.fc2, s1, s2, **kw)

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

    Weights (deterministic, torch generator ``seed``): N(0, 0.0106^2) per element -- so
    ``weight_scale_2`` ~ 2e-5 -- with 1.5 % of output channels at a quarter of that sigma.
    fc1 ``up_proj`` [I=2688, H=1024], fc2 ``down_proj`` [H, I], relu2. Input scales calibrated
    ModelOpt-style on 256 N(0, 1) tokens (fc2 per expert on the unquantized forward).
    """
    import torch

    h, i = DEFAULT_SHAPE["hidden"], DEFAULT_SHAPE["intermediate"]
    g = torch.Generator().manual_seed(seed)
    frac, fac = DEFAULT_QUIET
    calib = bf16_round(np.random.default_rng(seed + 1).standard_normal((256, h)))
    amax_x = float(np.abs(calib).max())
    calib_t = torch.from_numpy(calib).float()  # ModelOpt calibrates on the unquantized model
    fc1, fc2, s2 = [], [], []
    for _ in range(num_experts):
        lins = []
        for shape in ((i, h), (h, i)):
            rows = torch.where(torch.rand((shape[0], 1), generator=g) < frac, fac, 1.0)
            w = torch.randn(shape, generator=g) * (DEFAULT_SIGMA * rows)
            w = w.to(torch.bfloat16).float()  # checkpoints come from bf16 weights
            lins.append(w)
        l1 = MO.quantize_linear(lins[0].numpy(), amax_x)
        hcal = torch.relu(calib_t @ lins[0].T) ** 2
        l2 = MO.quantize_linear(lins[1].numpy(), float(hcal.abs().max()))
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
                  progress: bool = True, semantics: Iterable[str] = SEMANTICS) -> list[LayerReport]:
    """Audit the synthetic Nemotron-Super-layer-1 MoE (see :func:`default_layer`)."""
    semantics = tuple(semantics)
    bar = Progress(num_experts + 1 + len(semantics), "nvfp4 audit", progress)
    try:
        layer = default_layer(num_experts=num_experts, seed=seed, progress=bar.update)
        rep = audit_moe_layer(layer, top_k=DEFAULT_SHAPE["top_k"], tokens=tokens, seed=seed,
                              progress=bar.update, semantics=semantics)
    finally:
        bar.close()
    rep.notes.insert(0, f"synthetic weights N(0, {DEFAULT_SIGMA}^2), {DEFAULT_QUIET[0]:.1%} quiet "
                        f"channels at {DEFAULT_QUIET[1]}x sigma; hidden {DEFAULT_SHAPE['hidden']}, "
                        f"intermediate {DEFAULT_SHAPE['intermediate']}, relu2")
    return [rep]


def audit_checkpoint(path: str, *, max_experts: int = 64, top_k: int | None = None, tokens=TOKENS,
                     seed: int = 0, progress: bool = True,
                     semantics: Iterable[str] = SEMANTICS) -> list[LayerReport]:
    """Audit every NVFP4 layer of a ModelOpt checkpoint directory.

    Each MoE layer is loaded with its first ``max_experts`` experts (scale statistics and output
    errors both use those); top-k comes from ``config.json`` (``num_experts_per_tok``, else 8)
    unless given. Dense NVFP4 linears get the scale statistics only.
    """
    semantics = tuple(semantics)
    ck = ckpt.load(path)
    k = top_k or int(ck.config.get("num_experts_per_tok") or 8)
    layers = list(ck.layers(max_experts=max_experts))
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
        for n in r.notes:
            lines.append(f"  note: {n}")
    lines += ["", ("TRT-LLM #21461 (DGX Spark, Nemotron Super) reported: "
                   f"{ISSUE_21461['moe_rel_error']} output error, "
                   f"{ISSUE_21461['fc1_zero_scales']:.1%} of FC1 block scales exactly 0, "
                   f"mean scale error {ISSUE_21461['mean_scale_error']:.1%}."),
              ("The folded path's output error follows the dequantized-weight change (W err): "
               "relu2 squares the FC1 output, doubling FC1's relative error, and FC2 adds its own.")]
    if seconds is not None:
        lines.append(f"({seconds:.1f} s)")
    return "\n".join(lines)


def to_json(reports: list[LayerReport], source: str) -> dict:
    return {"tool": "nvfp4 audit", "source": source,
            "reference": "oracle.moe(mode='trtllm_cutlass') on the checkpoint scales",
            "error_metric": "||out - ref||_F / ||ref||_F", "scale_error_metric":
            "|E4M3(s * w_scale_2) - s * w_scale_2| / (s * w_scale_2), blocks with s > 0",
            "issue_21461_reported": ISSUE_21461, "layers": [r.to_json() for r in reports]}


def plot(reports: list[LayerReport], path: str) -> None:
    """PNG: folded-scale relative error against scale magnitude, and MoE error against T."""
    try:
        import matplotlib
    except ImportError as e:  # an optional dependency: only the plot needs it
        raise ImportError("plot: writing a PNG needs matplotlib: pip install 'nvfp4-jax[plot]' "
                          "(or pip install matplotlib)") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [r for r in reports if r.kind == "moe" and r.moe_errors]
    fig, axes = plt.subplots(1, 2 if moe else 1, figsize=(13 if moe else 7, 4.8), squeeze=False)
    ax = axes[0, 0]
    for r in reports[:6]:
        for wn, s in r.scales.items():
            if s.sample_ideal.size:
                ax.scatter(s.sample_ideal, np.maximum(s.sample_rel_error, 1e-6), s=2, alpha=0.3,
                           label=f"{r.name[-24:]} {wn}")
    ax.axvline(2.0**-6, color="k", ls="--", lw=1)
    ax.text(2.0**-6, 1.05, " E4M3 min normal 2^-6", fontsize=8, va="bottom")
    ax.axvline(2.0**-10, color="r", ls=":", lw=1)
    ax.text(2.0**-10, 1.05, " rounds to 0 below 2^-10", fontsize=8, va="bottom", color="r")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1e-6, 3)
    ax.set_xlabel("block scale x weight_scale_2 (exact)")
    ax.set_ylabel("relative error of the folded E4M3 scale")
    ax.set_title("Folding weight_scale_2 into E4M3 block scales")
    ax.legend(fontsize=7, markerscale=4, loc="lower left")
    if moe:
        ax = axes[0, 1]
        r = moe[0]
        for sem, e in r.moe_errors.items():
            ts = sorted(e)
            ax.plot(ts, [max(e[t], 1e-7) for t in ts], marker="o", label=SEMANTICS_LABEL.get(sem, sem))
        ax.axhline(2.0**-9, color="gray", ls=":", lw=1)
        ax.text(1, 2.0**-9, "bf16 half-ulp 2^-9", fontsize=8, va="bottom", color="gray")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("relative output error vs oracle")
        ax.set_title(f"MoE output error: {r.name[-40:]}")
        ax.legend(fontsize=8)
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
        reports = audit_default(num_experts=n, tokens=tokens, seed=seed, progress=progress)
        source = (f"default layer: Nemotron Super layer 1 shape (MoE hidden {DEFAULT_SHAPE['hidden']}, "
                  f"intermediate {DEFAULT_SHAPE['intermediate']}, {DEFAULT_SHAPE['experts']} experts, "
                  f"top-{DEFAULT_SHAPE['top_k']}, relu2), synthetic ModelOpt-quantized weights; "
                  f"subset of {n} experts evaluated for speed")
    else:
        reports = audit_checkpoint(checkpoint, max_experts=experts or 64, top_k=top_k, tokens=tokens,
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
