"""Cross-check NVFP4 backends against the exact oracle on the same inputs.

``nvfp4 crosscheck`` (or :func:`run`) makes linear-layer cases whose weight blocks span five
decades of magnitude (so E4M3 block scales land in the subnormal range, where folding bugs
live) at several global magnitudes, or reads one from an ``.npz`` (``nvfp4_jax.explain``'s
linear form), and runs every backend on it:

* **quantize** (the W4A4 activation, TensorRT-LLM linear semantics: ``trtllm`` recipe with
  ``G = fp32(1 / input_scale)``): codes and scale bytes against ``oracle.quantize``, byte for
  byte: ``jax`` (``nvfp4_jax.quantize``), ``trtllm_reenacted`` (the numpy re-enactment of
  ``fp4_quantize``, exact variant), ``trtllm_reenacted_fast`` (its fast-math default, against
  the oracle's ``trtllm_fast`` recipe), ``flashinfer_reference`` (its trace quantizer, against
  the oracle's ``flashinfer_reference`` recipe), ``trtllm_live`` (``torch.ops.trtllm``);
* **gemm_w4a4** and **gemm_w4a16**: the output against the oracle under the derived
  fp32-accumulation bound, explained by ``nvfp4_jax.explain`` when it fails: ``jax_xla``,
  ``jax_pallas`` (Pallas-Triton; interpret mode off the GPU), ``jax_mosaic`` (the Mosaic
  kernel; sm_90, and SM 12.x in its mma.sync form), ``trtllm_reenacted`` (``nvfp4_gemm``,
  W4A4), ``trtllm_live``;
* **moe_relu2** and **moe_swiglu** (``--ops moe``; a small routed layer, 8 experts, top-2,
  ``trtllm_cutlass`` semantics, T = 5): the output against ``oracle.moe`` inside the interval
  ``testing.moe_bound`` propagates through every rounding point: ``jax_xla``, ``jax_pallas``
  (the Pallas-Triton kernels), ``jax_mosaic`` (the Mosaic grouped GEMMs; sm_90, SM 12.x),
  ``trtllm_reenacted`` (the CUTLASS fused-MoE dataflow with its fast-math quantizer),
  ``trtllm_live`` (the fused MoE op).

A backend that cannot run here is reported as SKIP with the reason; nothing passes without
having run. Each result names the version its backend ran at (:func:`backend_version`: the
installed distribution, or "re-enacted (TensorRT-LLM <commits read>)"), in the table's
``versions`` block and in the JSON's ``version`` field. The exit code of the CLI is 1 when
any backend FAILs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable

import numpy as np

import oracle
from oracle.formats import bf16_round, f32

from .device import gpu_compute_capability
from .explain import GemmCase, explain_gemm, load_npz_case, spread_case

log = logging.getLogger(__name__)

QUANTIZE_BACKENDS = ("jax", "trtllm_reenacted", "trtllm_reenacted_fast", "flashinfer_reference", "trtllm_live")
GEMM_BACKENDS = ("jax_xla", "jax_pallas", "jax_mosaic", "trtllm_reenacted", "trtllm_live")
BACKENDS = tuple(dict.fromkeys(QUANTIZE_BACKENDS + GEMM_BACKENDS))
#: (weight block magnitude decades, activation scale) per generated case: weight blocks from
#: 1e-7 (E4M3 underflow after ModelOpt's global scale) to 1e0, activations 1e-3 to 1e3
MAGNITUDES = ((-4.5, -1.5, 1.0), (-7.0, -2.0, 1e-3), (-3.0, 0.0, 1e3), (-6.0, -5.0, 30.0))


class Skip(Exception):
    """The backend cannot run here; the message says why."""


@dataclasses.dataclass
class Result:
    case: int
    op: str
    backend: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0
    version: str = ""  # what the backend ran at (backend_version)


def _dist_version(dist: str) -> str:
    import importlib.metadata

    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} not installed"


def backend_version(backend: str) -> str:
    """The peer version a backend's behaviour belongs to: the installed distribution
    (``importlib.metadata``) for code that runs, "re-enacted (TensorRT-LLM <source read>)" for
    the numpy re-enactment."""
    if backend.startswith("jax"):
        return f"{_dist_version('jax')}, {_dist_version('jaxlib')}"
    if backend.startswith("trtllm_reenacted"):
        from .interop import trtllm

        return f"re-enacted ({trtllm.SOURCE})"
    if backend == "flashinfer_reference":
        return _dist_version("flashinfer-python")
    if backend == "trtllm_live":
        return _dist_version("tensorrt_llm")
    raise ValueError(f"backend: unknown {backend!r}")


OPS = ("quantize", "gemm", "moe")
MOE_BACKENDS = ("jax_xla", "jax_pallas", "jax_mosaic", "trtllm_reenacted", "trtllm_live")
#: the small routed layer of the ``moe`` ops: experts, hidden, intermediate, top-k, tokens
MOE_SHAPE = {"experts": 8, "hidden": 256, "inter": 256, "top_k": 2, "tokens": 5}


@dataclasses.dataclass(frozen=True)
class MoECase:
    """A routed layer in ``oracle.moe``'s terms (``trtllm_cutlass``)."""

    hidden: np.ndarray  # [T, H] bf16 values
    topk_ids: np.ndarray  # int32 [T, k]
    topk_weights: np.ndarray  # fp32 [T, k]
    fc1: oracle.NVFP4  # [E, R, H], decode_scale [E]
    fc2: oracle.NVFP4  # [E, H, I]
    fc1_input_scale: np.ndarray  # fp32 [E]
    fc2_input_scale: np.ndarray
    activation: str


def make_moe_case(seed: int, activation: str, magnitude: int = 0) -> MoECase:
    """A small routed layer: ModelOpt-quantized experts whose blocks span the decades
    ``MAGNITUDES[magnitude]`` names, bf16 hidden states of that scale, calibrated per-expert
    input scales (amax / 2688 times a jitter in [0.7, 1.3], FC2's from the float forward pass)."""
    from .testing.strategies import modelopt_quantize

    e, h, i, k, t = (MOE_SHAPE[n] for n in ("experts", "hidden", "inter", "top_k", "tokens"))
    lo, hi, xs = MAGNITUDES[magnitude % len(MAGNITUDES)]
    rng = np.random.default_rng(seed)
    r = 2 * i if activation == "swiglu" else i

    def weights(shape):
        mag = 10.0 ** rng.uniform(lo, hi, size=(*shape[:-1], shape[-1] // 16, 1))
        w = (rng.standard_normal((*shape[:-1], shape[-1] // 16, 16)) * mag).reshape(shape)
        return modelopt_quantize(bf16_round(w))

    fc1, fc2 = weights((e, r, h)), weights((e, h, i))
    hidden = bf16_round(rng.standard_normal((t, h)) * xs)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    w = rng.random((t, k)) + 0.1
    wts = (w / w.sum(-1, keepdims=True)).astype(np.float32)
    s1 = f32(np.abs(hidden).max() * rng.uniform(0.7, 1.3, e) / 2688.0)
    u = np.einsum("th,erh->ter", hidden, oracle.dequantize(fc1))
    from oracle.moe import activate

    hf = activate(u, activation, "up_gate")
    s2 = f32(max(float(np.abs(hf).max()), 1e-30) * rng.uniform(0.7, 1.3, e) / 2688.0)
    return MoECase(hidden, ids, wts, fc1, fc2, s1, s2, activation)


def _moe(backend: str, c: MoECase) -> np.ndarray:
    """``c``'s layer output from ``backend`` (float64 [T, H]); raises Skip where it cannot run."""
    if backend.startswith("jax_"):
        import jax
        import jax.numpy as jnp

        from .gemm.mosaic import unavailable as mosaic_unavailable
        from .moe import moe
        from .quantize import from_oracle

        kind = backend[4:]
        if kind == "mosaic" and (why := mosaic_unavailable(gpu_compute_capability())):
            raise Skip(f"{why} ({jax.devices()[0].device_kind})")
        kw = {"backend": kind}  # "pallas" runs in interpret mode off the GPU
        out = moe(jnp.asarray(c.hidden, jnp.bfloat16), fc1=from_oracle(c.fc1), fc2=from_oracle(c.fc2),
                  fc1_input_scale=jnp.asarray(c.fc1_input_scale, jnp.float32),
                  fc2_input_scale=jnp.asarray(c.fc2_input_scale, jnp.float32),
                  topk_ids=jnp.asarray(c.topk_ids), topk_weights=jnp.asarray(c.topk_weights),
                  activation=c.activation, mode="trtllm_cutlass", **kw)
        return np.asarray(out, np.float64)
    from .interop import trtllm

    args = (c.hidden, c.topk_ids, c.topk_weights, c.fc1, c.fc2, c.fc1_input_scale, c.fc2_input_scale)
    if backend == "trtllm_reenacted":
        return trtllm.run_pipeline("trtllm_cutlass", *args, activation=c.activation)
    if backend == "trtllm_live":
        torch = _torch()
        from .interop import LiveUnavailable
        from .interop import trtllm_torch as TT

        try:
            rt = TT.moe_weights("trtllm_cutlass", *args[3:], activation=c.activation,
                                gate_up_order="up_gate")
            hidden = torch.from_numpy(np.asarray(c.hidden, np.float32)).to(torch.bfloat16)
            out = TT.live_fused_moe(hidden,
                                        torch.from_numpy(c.topk_ids.astype(np.int64)),
                                        torch.from_numpy(c.topk_weights), rt)
        except LiveUnavailable as exc:
            raise Skip(str(exc)) from exc
        return out.to(torch.float64).numpy()
    raise ValueError(f"backend: unknown MoE backend {backend!r}")


def check_moe_case(i: int, c: MoECase, backends=BACKENDS) -> list[Result]:
    """Every requested MoE backend on ``c`` against ``testing.moe_bound``'s interval."""
    from .testing.assertions import moe_bound, moe_violations

    bound = moe_bound(c.hidden, c.topk_ids, c.topk_weights, c.fc1, c.fc2, c.fc1_input_scale,
                      c.fc2_input_scale, activation=c.activation, mode="trtllm_cutlass")
    res = []
    for b in (b for b in MOE_BACKENDS if b in backends):
        def run_one(b=b) -> Result:
            op = f"moe_{c.activation}"
            try:
                out = _moe(b, c)
            except Skip as exc:
                return Result(i, op, b, "SKIP", str(exc))
            v = moe_violations(out, bound)
            bad = int((v > 0).sum())
            if bad == 0:
                interp = " (interpret mode)" if b == "jax_pallas" and gpu_compute_capability() is None else ""
                width = float(np.max(bound.hi - bound.lo))
                return Result(i, op, b, "PASS", f"all {out.size} outputs inside the oracle's interval "
                              f"(widest {width:.3g}){interp}")
            t, h = np.unravel_index(int(np.argmax(v)), v.shape)
            return Result(i, op, b, "FAIL", f"{bad} of {out.size} outputs outside the oracle's interval; worst "
                          f"[{t}, {h}]: {out[t, h]:.6g} not in [{bound.lo[t, h]:.6g}, {bound.hi[t, h]:.6g}]")
        res.append(_timed(run_one))
    return res


def make_case(seed: int, m: int = 16, n: int = 256, k: int = 512, magnitude: int = 0) -> GemmCase:
    """A W4A4 linear-layer case (``explain.spread_case``) at the weight block decades and
    activation scale ``MAGNITUDES[magnitude]`` names."""
    lo, hi, xs = MAGNITUDES[magnitude % len(MAGNITUDES)]
    return spread_case(seed, m, n, k, decades=(lo, hi), x_scale=xs)


# ---------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------

def _torch():
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"needs torch (pip install 'nvfp4-jax[torch]'): {exc}") from exc
    return torch


def _quantize(backend: str, x: np.ndarray, encode: float) -> tuple[np.ndarray, np.ndarray, str]:
    """(codes, scale bytes) from ``backend``, and the oracle recipe it is held to."""
    if backend == "jax":
        import jax.numpy as jnp

        from .formats import e4m3_bytes
        from .quantize import quantize

        q = quantize(jnp.asarray(x, jnp.bfloat16), "trtllm", encode_scale=encode)
        return np.asarray(q.codes), np.asarray(e4m3_bytes(q.linear_scales())), "trtllm"
    if backend in ("trtllm_reenacted", "trtllm_reenacted_fast"):
        from .interop import trtllm

        fast = backend.endswith("fast")
        c, s = trtllm.fp4_quantize(bf16_round(x), encode, fast_math=fast)
        return c, s, "trtllm_fast" if fast else "trtllm"
    torch = _torch()
    xt = torch.tensor(x, dtype=torch.float32).to(torch.bfloat16)
    if backend == "flashinfer_reference":
        from .interop import LiveUnavailable, flashinfer

        try:
            c, s = flashinfer.reference_quantize(xt, encode)
        except LiveUnavailable as exc:
            raise Skip(str(exc)) from exc
        return c, s, "flashinfer_reference"
    if backend == "trtllm_live":
        from .interop import LiveUnavailable
        from .interop import trtllm_torch as TT

        try:
            c, s = TT.live_fp4_quantize(xt, encode)
        except LiveUnavailable as exc:
            raise Skip(str(exc)) from exc
        return c.numpy(), s.numpy().reshape(x.shape[0], -1), "trtllm"
    raise ValueError(f"backend: unknown quantize backend {backend!r}")


def _gemm(backend: str, case: GemmCase) -> np.ndarray:
    """``case``'s output from ``backend`` (float64 [M, N]); raises Skip where it cannot run."""
    w = case.weight
    if backend.startswith("jax_"):
        import jax
        import jax.numpy as jnp

        from .gemm.api import matmul
        from .gemm.mosaic import unavailable as mosaic_unavailable
        from .quantize import NVFP4Array

        kind = backend[4:]
        if kind == "mosaic" and (why := mosaic_unavailable(gpu_compute_capability())):
            raise Skip(f"{why} ({jax.devices()[0].device_kind})")
        if kind == "mosaic" and (case.shape[0] > 64 or case.shape[2] % 256):
            raise Skip(f"the Mosaic GPU kernel takes M <= 64 and K % 256 == 0, got {case.shape}")
        arr = NVFP4Array.from_parts(jnp.asarray(w.codes), jnp.asarray(w.scales).view(jnp.float8_e4m3fn),
                                    jnp.asarray(case.weight_scale_2, jnp.float32))
        if case.weight_sf_layout != "linear" and kind == "mosaic":
            # the Mosaic kernel reads swizzled_128x4 scales as they are; the XLA and Pallas-Triton
            # paths convert them to linear on every call (logged), so they get linear ones
            arr = arr.with_layout(case.weight_sf_layout)
        out = matmul(jnp.asarray(case.x, jnp.bfloat16), arr, input_scale=case.input_scale,
                     out_dtype=jnp.float32, backend=kind)
        return np.asarray(out, np.float64)
    if case.mode != "w4a4":
        raise Skip("TensorRT-LLM's nvfp4_gemm is W4A4 only (FP4 activations)")
    g = float(f32(1.0 / case.input_scale))
    if backend == "trtllm_reenacted":
        from .interop import trtllm

        ac, asf = trtllm.fp4_quantize(bf16_round(case.x), g, fast_math=False)
        out = trtllm.nvfp4_gemm(ac, w.codes, asf, w.scales, case.alpha, "float32")
        return out.astype(np.float64)
    torch = _torch()
    from .interop import LiveUnavailable
    from .interop import trtllm_torch as TT

    xt = torch.tensor(case.x, dtype=torch.float32).to(torch.bfloat16)
    codes, wsf = torch.from_numpy(w.codes), torch.from_numpy(w.scales)
    if backend == "trtllm_live":
        try:
            ac, asf = TT.live_fp4_quantize(xt, g, swizzled=True)
            wsf_128x4 = TT.swizzle_128x4(wsf.view(torch.float8_e4m3fn)).view(torch.uint8)
            out = TT.live_nvfp4_gemm(ac, codes, asf, wsf_128x4,
                                     case.alpha, out_dtype=torch.float32)
        except LiveUnavailable as exc:
            raise Skip(str(exc)) from exc
        return out.double().numpy()
    raise ValueError(f"backend: unknown GEMM backend {backend!r}")


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

def _timed(fn: Callable[[], Result]) -> Result:
    t0 = time.perf_counter()
    r = fn()
    r.seconds = time.perf_counter() - t0
    r.version = backend_version(r.backend)
    return r


def check_case(i: int, case: GemmCase, backends=BACKENDS) -> list[Result]:
    """Every requested backend on ``case`` (W4A4 linear form): quantize, gemm_w4a4, gemm_w4a16."""
    if case.mode != "w4a4":
        raise ValueError("check_case: expected a W4A4 linear-layer case (x and input_scale given)")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"backends: unknown {unknown}; expected some of {BACKENDS}")
    res: list[Result] = []
    encode = float(f32(1.0 / case.input_scale))

    for b in (b for b in QUANTIZE_BACKENDS if b in backends):
        def q(b=b) -> Result:
            try:
                codes, sbytes, recipe = _quantize(b, case.x, encode)
            except Skip as exc:
                return Result(i, "quantize", b, "SKIP", str(exc))
            ref = oracle.quantize(case.x, recipe, encode_scale=encode)
            dc = int((np.asarray(codes) != ref.codes).sum())
            ds = int((np.asarray(sbytes) != ref.scales).sum())
            ok = dc == 0 and ds == 0 and codes.shape == ref.codes.shape
            detail = (f"vs oracle '{recipe}': {dc} of {ref.codes.size} code bytes and {ds} of "
                      f"{ref.scales.size} scale bytes differ")
            return Result(i, "quantize", b, "PASS" if ok else "FAIL", detail)
        res.append(_timed(q))

    w16 = dataclasses.replace(case, input_scale=None, alpha=case.weight_scale_2)
    for op, c in (("gemm_w4a4", case), ("gemm_w4a16", w16)):
        for b in (b for b in GEMM_BACKENDS if b in backends):
            def g(b=b, op=op, c=c) -> Result:
                try:
                    out = _gemm(b, c)
                except Skip as exc:
                    return Result(i, op, b, "SKIP", str(exc))
                e = explain_gemm(c, out)
                if e.verdict == "correct":
                    interp = " (interpret mode: the kernel's logic, not its GPU build)" if (
                        b == "jax_pallas" and gpu_compute_capability() is None) else ""
                    return Result(i, op, b, "PASS", f"max |out - oracle| / bound = {e.margin:.3g}{interp}")
                detail = f"{e.bad} of {e.total} outside the bound; {e.verdict}: {e.reason}"
                if op == "gemm_w4a4" and b == "jax_xla" and any(
                        r.op == "quantize" and r.backend == "jax" and r.status == "FAIL" for r in res):
                    detail += "; its activations come from the jax quantizer, which differs here (quantize row)"
                return Result(i, op, b, "FAIL", detail)
            res.append(_timed(g))
    return res


def run(*, cases: int = 4, seed: int = 0, m: int = 16, n: int = 256, k: int = 512,
        backends=BACKENDS, inputs: str | None = None, ops=("quantize", "gemm")) -> list[Result]:
    """The cross-check: ``cases`` generated cases (one per ``MAGNITUDES`` entry, cycling), or
    the single W4A4 linear-layer case in ``inputs`` (``.npz``). ``ops``: some of ``OPS``
    ("moe" adds the routed layer, relu2 and swiglu, per generated case)."""
    bad_ops = sorted(set(ops) - set(OPS))
    if bad_ops:
        raise ValueError(f"ops: unknown {bad_ops}; expected some of {OPS}")
    if inputs is not None:
        todo = [load_npz_case(inputs)]
    else:
        todo = [make_case(seed + i, m, n, k, magnitude=i) for i in range(cases)]
    out: list[Result] = []
    for i, c in enumerate(todo):
        if "quantize" in ops or "gemm" in ops:
            out += [r for r in check_case(i, c, backends)
                    if (r.op == "quantize" and "quantize" in ops) or (r.op != "quantize" and "gemm" in ops)]
        if "moe" in ops and inputs is None:
            for act in ("relu2", "swiglu"):
                out += check_moe_case(i, make_moe_case(seed + i, act, magnitude=i), backends)
    return out


def format_table(results: list[Result]) -> str:
    """The results table, after the version each backend ran at."""
    lines = ["versions:"]
    for b in dict.fromkeys(r.backend for r in results):
        v = next(r.version for r in results if r.backend == b) or backend_version(b)
        lines.append(f"  {b:<22}  {v}")
    lines.append(f"{'case':>4}  {'op':<10}  {'backend':<22}  {'result':<6}  detail")
    for r in results:
        lines.append(f"{r.case:>4}  {r.op:<10}  {r.backend:<22}  {r.status:<6}  {r.detail}")
    n = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped")
    return "\n".join(lines)


def to_json(results: list[Result]) -> str:
    return json.dumps([dataclasses.asdict(r) for r in results], indent=2)
