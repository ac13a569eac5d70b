"""``nvfp4 selftest``: every NVFP4 kernel this device runs, against the exact oracle.

What an RTX 50xx / DGX Spark (or any) user runs first. For each kernel the local device can
run, at a spread of shapes, on fuzzed inputs (numpy RNG; 16-value blocks spread over many
powers of two, so that E4M3 block scales reach the subnormals, underflow and saturate):

* ``quantize/<recipe>`` (every JAX recipe; given and derived global scale): codes, scale
  bytes and decode scale byte for byte equal to ``oracle.quantize``;
* ``matmul/<backend>/<w4a16|w4a4>`` (``pallas``: Pallas-Triton, interpreted on CPU; ``mosaic``
  on sm_90 and SM 12.x; ``xla``; ``fp4mma``: W4A4 on the FP4-MMA kernel, native on SM 12.x),
  fp32 output: within the oracle's fp32-accumulation bound
  (``explain.explain_gemm``: its verdict and margin, the largest ``|out - oracle| / bound``);
* ``moe/<path>/<mode>/<activation>`` (``pallas-triton``, ``mosaic`` on sm_90 and SM 12.x,
  ``xla``): inside ``testing.assertions.moe_bound``'s interval with zero slack in the
  activation quantization (so a code flipped by an inexact division fails);
* ``moe/routing`` (``nvfp4_jax.moe.select_kernel``, ``moe``'s softmax top-k routing on the
  kernel backends): fp32 logits from 1e-3 to 300 with ties, -inf, NaN and +inf, non-finite
  hidden rows: the experts of ``oracle.select_experts``, weights within
  ``oracle.select_experts_error_bound``, NaN weights where the oracle's are undefined;
* ``attention/decode`` (``nvfp4_jax.attention.decode_attention``): a stacked cache with NaN
  in every slot past a sequence's length and other data in the other layer, scores from about
  0.01 to 1000, within ``oracle.decode_attention_error_bound``;
* ``attention/qkv`` (``nvfp4_jax.attention.decode_qkv_attention``, the decoders' one-token
  attention on a GPU: q/k RMSNorm, RoPE, the cache writes and the attention's chunks in one
  launch, then ``decode_attention``'s combine): the same caches (the new token's slot NaN
  too), the new k row among ``oracle.decode_qkv_attention_error_bound``'s
  values, every other slot untouched, the output within its bound;
* ``linear/norm_linear`` (``nvfp4_jax.nn.norm_linear``, the decoders' W4A4 linears with their
  RMSNorm, the norm weight and input scale read from layer stacks: on Hopper and SM 12.x at
  M <= 64 one Pallas-Triton prologue launch before the Mosaic GEMM, else the composition):
  within ``testing.norm_linear_bound`` (the norm's rounding interval carried through the
  quantizer and the GEMM); the detail says which path ran;
* ``moe/norm_router`` (``nvfp4_jax.nn.norm_router``, a MoE layer's RMSNorm and router logits
  in one Pallas-Triton launch at decode, the norm weight and router read from layer stacks):
  rows from 2^-20 to 300, h among ``oracle.norm_rope_interval``'s values and the logits among
  ``oracle.router_logits_interval``'s (of the kernel's h).

A verdict per kernel; for each failure an ``.npz`` (GEMM failures in the form ``nvfp4 explain
FILE.npz`` reads; quantize, MoE and attention failures hold their inputs, the output and the
oracle's; routing failures the logits, hidden rows and both results).
On CPU the Pallas kernels run interpreted at small sizes. Needs no hypothesis.

Each check is one compile of one kernel at one shape with several fuzzed inputs through it (a
GPU's time here is compile time); the default run covers every kernel at a few shapes chosen
for their edges, ``full=True`` (``nvfp4 selftest --full``) adds shapes, ``jobs=N`` (``--jobs``)
runs N checks at once so that their compiles overlap. Each check reports its seconds and its
backend compiles (``jax.monitoring``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
import json
import os
import platform
import shutil
import subprocess
import threading
import time
import traceback
from collections.abc import Callable

import ml_dtypes
import numpy as np

import oracle
from oracle.formats import bf16_round, f32

#: check outcomes
PASS, FAIL = "PASS", "FAIL"


@dataclasses.dataclass
class Check:
    """One kernel at one shape: ``status`` PASS or FAIL, ``detail`` why, ``npz`` the failure's
    inputs and output (None when it passed), ``inputs`` the fuzzed inputs run through its one
    compile, ``compiles`` and ``compile_s`` the backend compiles it took and their seconds."""

    kernel: str
    shape: str
    status: str
    detail: str
    seconds: float
    npz: str | None = None
    inputs: int = 1
    compiles: int = 0
    compile_s: float = 0.0


# ----------------------------------------------------------------------------- the device

def _nvidia_smi() -> dict | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        p = subprocess.run([exe, "--query-gpu=name,driver_version,compute_cap",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
                           check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}
    rows = [[c.strip() for c in line.split(",")] for line in p.stdout.splitlines() if line.strip()]
    if p.returncode != 0 or not rows:
        return {"error": (p.stderr or p.stdout).strip()[:500]}
    return {"gpus": [dict(zip(("name", "driver", "compute_capability"), r)) for r in rows],
            "driver": rows[0][1] if len(rows[0]) > 1 else None}


def _version_of(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def compute_capability() -> int | None:
    """The default device's CUDA compute capability as an int (120 for 12.0), None elsewhere."""
    import jax

    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major) * 10 + int(minor or 0)


def device_info() -> dict:
    """GPU name, compute capability, driver (nvidia-smi when present), jax/jaxlib/Triton."""
    import jax
    import jaxlib

    from .versions import SUPPORTED_JAX

    dev = jax.devices()[0]
    smi = _nvidia_smi()
    return {
        "platform": dev.platform, "device_kind": dev.device_kind,
        "compute_capability": compute_capability(), "devices": jax.device_count(),
        "driver": (smi or {}).get("driver"), "nvidia_smi": smi,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        # Pallas-Triton kernels compile with the Triton that XLA bundles (jaxlib's); the pip
        # package, if any, is not used by them
        "triton": {"bundled_with": f"jaxlib {jaxlib.__version__}",
                   "pip_triton": _version_of("triton")},
        "jax_cuda_plugin": _version_of("jax-cuda12-plugin") or _version_of("jax-cuda13-plugin"),
        "python": platform.python_version(), "supported_jax": SUPPORTED_JAX,
    }


# ----------------------------------------------------------------------------- fuzzed inputs

def spread_values(rng: np.random.Generator, shape: tuple[int, ...], lo: float,
                  hi: float) -> np.ndarray:
    """bf16 values (float64) whose 16-value blocks have magnitudes 2^U(lo, hi)."""
    *lead, k = shape
    mag = np.exp2(rng.uniform(lo, hi, (*lead, k // 16, 1))).repeat(16, -1).reshape(shape)
    return bf16_round(rng.standard_normal(shape) * mag)


def _weight(rng, n: int, k: int) -> oracle.NVFP4:
    """ModelOpt-quantized weight [N, K] with blocks over 2^-30..2^0: E4M3-subnormal block
    scales and zero blocks among them."""
    w = spread_values(rng, (n, k), -30.0, 0.0)
    return oracle.quantize(w, "modelopt", decode_scale=float(f32(np.abs(w).max() / 2688)))


# ----------------------------------------------------------------------------- compiles

class CompileCounter:
    """Backend compiles (XLA's, with the Pallas-Triton kernels they hold) and their seconds,
    from ``jax.monitoring`` while it is registered (:func:`run` registers one), per thread:
    ``count`` and ``seconds`` are those of the calling thread (JAX records the event in the
    thread that compiles), so concurrent checks each count their own."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self._local = threading.local()

    def _mine(self):
        if not hasattr(self._local, "count"):
            self._local.count, self._local.seconds = 0, 0.0
        return self._local

    @property
    def count(self) -> int:
        return self._mine().count

    @property
    def seconds(self) -> float:
        return self._mine().seconds

    def __call__(self, event: str, duration: float, **_: object) -> None:
        if event == self.EVENT:
            mine = self._mine()
            mine.count += 1
            mine.seconds += duration


# ----------------------------------------------------------------------------- checks

def _timed(kernel: str, shape: str, fn: Callable[[], tuple[str, str, dict | None]],
           out_dir: str, counter: CompileCounter | None = None) -> Check:
    t0 = time.perf_counter()
    c0, s0 = (counter.count, counter.seconds) if counter is not None else (0, 0.0)
    try:
        status, detail, dump = fn()
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here is a failure, reported
        status, detail, dump = FAIL, f"{type(exc).__name__}: {exc}".splitlines()[0][:400], None
        detail += " | " + traceback.format_exc(limit=2).strip().splitlines()[-1][:200]
    npz = None
    if status == FAIL and dump is not None:
        os.makedirs(out_dir, exist_ok=True)
        npz = os.path.join(out_dir, f"{kernel.replace('/', '_')}_{shape.replace(' ', '')}.npz")
        writer = dump.pop("_writer", None)
        if writer is not None:
            writer(npz)
        else:
            np.savez(npz, **{k: np.asarray(v) for k, v in dump.items()})
    inputs = getattr(fn, "inputs", 1)
    compiles, compile_s = ((counter.count - c0, round(counter.seconds - s0, 3))
                           if counter is not None else (0, 0.0))
    return Check(kernel, shape, status, detail, round(time.perf_counter() - t0, 3), npz, inputs,
                 compiles, compile_s)


def _quant_inputs(seed: int, m: int, k: int, i: int) -> tuple[np.ndarray, float]:
    """Fuzzed input ``i`` of an [m, k] quantize check: blocks over 2^-40..2^10 and a given
    global scale around the ModelOpt one (x 2^U(-3, 3))."""
    rng = np.random.default_rng([seed, 1, m, k, i])
    x = spread_values(rng, (m, k), -40.0, 10.0)
    return x, float(f32(np.abs(x).max() / 2688 * np.exp2(rng.uniform(-3, 3))))


def _quantize_check(recipe: str, seed: int, m: int, k: int, inputs: int, derived: bool):
    """One compile of ``nvfp4_jax.quantize`` (given or derived global scale), ``inputs``
    fuzzed inputs through it, each byte for byte against ``oracle.quantize``."""
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj

    if derived:
        fn = jax.jit(lambda v: nj.quantize(v, recipe))
    else:
        fn = jax.jit(lambda v, g: nj.quantize(v, recipe, decode_scale=g))
    subnormal = 0
    for i in range(inputs):
        x, d = _quant_inputs(seed, m, k, i)
        if derived:
            got, want = fn(jnp.asarray(x, jnp.bfloat16)), oracle.quantize(x, recipe)
        else:
            got = fn(jnp.asarray(x, jnp.float32), jnp.float32(d))
            want = oracle.quantize(x, recipe, decode_scale=d)
        got = nj.to_oracle(got)
        dc = int((got.codes != want.codes).sum())
        ds = int((got.scales != want.scales).sum())
        dd = float(got.decode_scale) != float(want.decode_scale)
        if dc or ds or dd:
            detail = (f"input {i}: {dc} of {want.codes.size} code bytes, {ds} of "
                      f"{want.scales.size} scale bytes{', the decode scale' if dd else ''} differ "
                      "from oracle.quantize")
            return FAIL, detail, {"x": x, "recipe": np.array(recipe),
                                  "decode_scale": np.float64(0.0 if derived else d),
                                  "codes": got.codes, "scales": got.scales,
                                  "oracle_codes": want.codes, "oracle_scales": want.scales}
        subnormal += int(((want.scales > 0) & (want.scales < 8)).sum())
    return PASS, (f"byte-exact ({subnormal} E4M3-subnormal block scales over {inputs} "
                  "inputs)"), None


@functools.lru_cache(maxsize=None)
def _gemm_operands(seed: int, m: int, n: int, k: int, i: int) -> tuple[oracle.NVFP4, np.ndarray]:
    """Fuzzed input ``i`` of an (m, n, k) GEMM check, shared by every backend and mode (the
    oracle's quantization of a large weight costs seconds)."""
    rng = np.random.default_rng([seed, 2, m, n, k, i])
    return _weight(rng, n, k), spread_values(rng, (m, k), -12.0, 4.0)


def _matmul_check(select: dict, w4a4: bool, seed: int, m: int, n: int, k: int, inputs: int):
    """One compile of ``nvfp4_jax.matmul(..., **select)`` (fp32 output), ``inputs`` fuzzed
    operand pairs through it, each held to the oracle's bound by ``explain.explain_gemm``."""
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj

    from . import explain

    mm = jax.jit(lambda xx, ww, ss: nj.matmul(xx, ww, input_scale=ss, out_dtype=jnp.float32,
                                              **select))
    worst = 0.0
    for i in range(inputs):
        wo, x = _gemm_operands(seed, m, n, k, i)
        s = float(f32(np.abs(x).max() / 2688)) if w4a4 else None
        # fp32 output: no output rounding in the bound, so explain can fit a fault's exact shift
        case = explain.GemmCase.from_linear(x, wo.codes, wo.scales, float(wo.decode_scale), s,
                                            out_dtype="float32")
        out = mm(jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo),
                 None if s is None else jnp.float32(s))
        out = np.asarray(out.astype(jnp.float32), np.float64)
        e = explain.explain_gemm(case, out)
        if e.verdict != "correct":
            best = f"; best match: {e.best.name} ({e.best.meaning})" if e.best is not None else ""
            detail = (f"input {i}: {e.bad} of {e.total} outputs outside the oracle's bound: "
                      f"{e.reason}{best} (nvfp4 explain FILE.npz --out-dtype float32)")
            return FAIL, detail, {
                "_writer": lambda path, c=case, o=out: explain.save_npz(path, c, o)}
        worst = max(worst, e.margin)
    return PASS, f"within the oracle's bound on {inputs} inputs (largest margin {worst:.3g})", None


def _norm_linear_inputs(seed: int, m: int, n: int, k: int, norm: bool, i: int):
    """Fuzzed input ``i`` of a norm_linear check: x blocks over 2^-3..2^3, two layers' bf16
    norm weights over 2^-10..2^4 (block scales reach E4M3 subnormals), layer 1's input scale
    at the normed amax / 2688 times 1 or 2^-6 (saturating), layer 0's 1.5x that."""
    rng = np.random.default_rng([seed, 7, m, n, k, int(norm), i])
    wo = _weight(rng, n, k)
    x = spread_values(rng, (m, k), -3.0, 3.0)
    norms = bf16_round(np.exp2(rng.uniform(-10, 4, (2, k))) * rng.choice([-1, 1], (2, k)))
    xn = oracle.norm_rope_interval(x, norms[1], 1e-6, None, None)[0] if norm else x
    s = float(f32(np.abs(xn).max() / 2688 * (1.0 if i % 2 == 0 else 2.0**-6)))
    return wo, x, (norms if norm else None), np.array([1.5 * s, s], np.float32)


def _norm_linear_check(seed: int, m: int, n: int, k: int, norm: bool, inputs: int):
    """One compile of ``nn.norm_linear`` (W4A4, RMSNorm'd when ``norm``) with the norm weight
    and input scale read from two-layer stacks at layer 1, as the decoders' scan runs it;
    ``inputs`` fuzzed cases each held to ``testing.norm_linear_bound`` (the norm's rounding
    interval through the quantizer and the GEMM). Where ``gemm.prologue_applies`` (Hopper,
    SM 12.x with ``plgpu.mma``, M <= 64) that is the one-launch prologue before the Mosaic
    GEMM; elsewhere the composition in XLA ops. The detail says which ran."""
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj

    from . import nn
    from .gemm import prologue_applies
    from .testing.assertions import interval_violations, norm_linear_bound

    fn = jax.jit(lambda p, x, nw, ss: nn.norm_linear(p, x, nw, 1e-6, layer=jnp.int32(1),
                                                      input_scales=ss))
    for i in range(inputs):
        wo, x, norms, scales = _norm_linear_inputs(seed, m, n, k, norm, i)
        p = nn.Linear(nj.from_oracle(wo), jnp.float32(scales[1]))
        out = fn(p, jnp.asarray(x, jnp.bfloat16),
                 None if norms is None else jnp.asarray(norms, jnp.bfloat16), jnp.asarray(scales))
        out = np.asarray(out.astype(jnp.float32), np.float64)
        b = norm_linear_bound(x, wo, float(scales[1]), None if norms is None else norms[1])
        v = interval_violations(out, b)
        if v.any():
            r, c = np.unravel_index(int(np.argmax(v)), v.shape)
            return FAIL, (f"input {i}: {int((v > 0).sum())} of {v.size} outputs outside the "
                          f"norm_linear interval; worst [{r}, {c}]: {float(out[r, c])!r} "
                          f"against [{float(b.lo[r, c])!r}, {float(b.hi[r, c])!r}] (oracle "
                          f"{float(b.ref[r, c])!r})"), {
                "x": x, "norm_weight": np.zeros(0) if norms is None else norms,
                "input_scales": scales, "out": out, "ref": b.ref, "lo": b.lo, "hi": b.hi}
    ran = ("one-launch prologue + Mosaic GEMM" if prologue_applies(m, n, k, norm=norm)
           else "composition in XLA ops")
    return PASS, f"within the norm_linear interval on {inputs} inputs ({ran})", None


def _moe_kwargs(path: str) -> dict:
    """``nvfp4_jax.moe`` keyword arguments selecting ``path`` (pallas-triton, mosaic, xla)."""
    if path == "xla":
        return {"backend": "xla"}
    if path == "pallas-triton-fp4":  # the FP4-MMA grouped GEMMs, whatever the device's default
        return {"backend": "pallas", "mma": "fp4"}
    return {"backend": "pallas" if path == "pallas-triton" else "mosaic"}


def _moe_case(rng, t: int, h: int, inter: int, e: int, k: int, activation: str):
    r = 2 * inter if activation == "swiglu" else inter

    def stack(n, kk):
        parts = [_weight(rng, n, kk) for _ in range(e)]
        return oracle.NVFP4(np.stack([p.codes for p in parts]), np.stack([p.scales for p in parts]),
                            np.array([float(p.decode_scale) for p in parts]))

    hidden = spread_values(rng, (t, h), -8.0, 2.0)
    fc1, fc2 = stack(r, h), stack(h, inter)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    wts = f32(rng.random((t, k)) + 0.1)
    wts = f32(wts / wts.sum(1, keepdims=True))
    s1 = f32(np.abs(hidden).max() * rng.uniform(0.7, 1.3, e) / 2688)
    u = np.einsum("th,erh->ter", hidden, oracle.dequantize(fc1))
    amax_h = max(float(np.abs(importlib.import_module("oracle.moe").activate(u, activation)).max()),
                 1e-30)
    s2 = f32(amax_h * rng.uniform(0.7, 1.3, e) / 2688)
    return hidden, ids, wts, fc1, fc2, s1, s2


@functools.lru_cache(maxsize=None)
def _moe_inputs(seed: int, t: int, h: int, inter: int, e: int, k: int, activation: str, i: int):
    """Fuzzed layer ``i`` (weights, routing, scales) of a MoE check, shared by every path."""
    return _moe_case(np.random.default_rng([seed, 3, t, h, inter, e, k, i]), t, h, inter, e, k,
                     activation)


@functools.lru_cache(maxsize=None)
def _moe_bound(seed: int, t: int, h: int, inter: int, e: int, k: int, activation: str,
               mode: str, i: int):
    """``moe_bound`` of fuzzed layer ``i`` with zero quantization slack, shared by every path
    (the interval arithmetic costs seconds of host time at top-6)."""
    from .testing.assertions import moe_bound

    return moe_bound(*_moe_inputs(seed, t, h, inter, e, k, activation, i), activation=activation,
                     mode=mode, quant_slack=0.0)


def _moe_check(path: str, mode: str, activation: str, seed: int, t, h, inter, e, k,
               inputs: int):
    """One compile of ``nvfp4_jax.moe``, ``inputs`` fuzzed layers through it, each inside
    ``moe_bound``'s interval with zero slack in the activation quantization."""
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj

    from .testing.assertions import assert_moe_close

    kw = {"activation": activation, "mode": mode, **_moe_kwargs(path)}
    if "mma" in kw:  # the default tiles of this layer on the named MMA
        from .moe.configs import default_config

        kw["config"] = default_config(t * k, e, inter=inter, hidden=h,
                                      gated=activation == "swiglu", mma=kw.pop("mma"))
    layer = jax.jit(lambda x, w1, w2, a, b, i, w: nj.moe(x, fc1=w1, fc2=w2, fc1_input_scale=a,
                                                          fc2_input_scale=b, topk_ids=i,
                                                          topk_weights=w, **kw))
    same = total = 0
    for j in range(inputs):
        case = _moe_inputs(seed, t, h, inter, e, k, activation, j)
        hidden, ids, wts, fc1, fc2, s1, s2 = case
        out = layer(jnp.asarray(hidden, jnp.bfloat16), nj.from_oracle(fc1), nj.from_oracle(fc2),
                    jnp.asarray(s1), jnp.asarray(s2), jnp.asarray(ids), jnp.asarray(wts))
        out = np.asarray(out.astype(jnp.float32), np.float64)
        try:
            b = assert_moe_close(out, *case, label=f"moe {path}",
                                 bound=_moe_bound(seed, t, h, inter, e, k, activation, mode, j))
        except AssertionError as exc:
            ref = _moe_bound(seed, t, h, inter, e, k, activation, mode, j).ref
            dump = {"hidden": hidden, "topk_ids": ids, "topk_weights": wts,
                    "fc1_codes": fc1.codes, "fc1_scales": fc1.scales,
                    "fc1_weight_scale_2": fc1.decode_scale, "fc2_codes": fc2.codes,
                    "fc2_scales": fc2.scales, "fc2_weight_scale_2": fc2.decode_scale,
                    "fc1_input_scale": s1, "fc2_input_scale": s2, "mode": np.array(mode),
                    "activation": np.array(activation), "out": out, "oracle_out": ref}
            return FAIL, f"input {j}: " + str(exc).splitlines()[0][:400], dump
        same, total = same + int(np.sum(out == b.ref)), total + out.size
    return PASS, (f"inside the oracle's interval on {inputs} inputs; {same / total:.1%} of "
                  "outputs bit-identical to it"), None


def _attention_inputs(seed: int, b: int, s: int, kvh: int, g: int, d: int, i: int):
    """Fuzzed input ``i`` of a decode-attention check: (q [B, NH, D], k, v [2, B, S, KVH, D],
    layer, lengths [B]) as bf16 values in float64; q and k at a magnitude cycling over 0.05,
    1, 4 and 32 (scores up to ~1000: exponents must be taken against the running maximum),
    v over 10^U(-3, 3); the other layer of the stack holds +-1e4 (a read of it breaks the
    bound); the first sequence's length cycles over S, 1 and 65 (chunk and block edges), the
    others' random; NaN in every slot past a length."""
    rng = np.random.default_rng([seed, 4, b, s, kvh, g, d, i])
    scale = (0.05, 1.0, 4.0, 32.0)[i % 4]
    layer = i % 2
    lengths = rng.integers(1, s + 1, b)
    lengths[0] = (s, 1, min(s, 65))[i % 3]

    def values(shape, mag):  # any bf16 values will do: the kernel and the oracle see the same
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(mag)
        return x.astype(ml_dtypes.bfloat16).astype(np.float64)

    q = values((b, kvh * g, d), scale)
    k = np.full((2, b, s, kvh, d), 1e4)
    v = np.full((2, b, s, kvh, d), -1e4)
    k[layer] = values((b, s, kvh, d), scale)
    v[layer] = values((b, s, kvh, d), 10.0 ** rng.uniform(-3, 3))
    for bi, n in enumerate(lengths):  # never read: NaN shows a read past the written positions
        k[:, bi, n:] = np.nan
        v[:, bi, n:] = np.nan
    return q, k, v, layer, lengths


def _attention_check(seed: int, b: int, s: int, kvh: int, g: int, d: int, inputs: int):
    """One compile of ``nvfp4_jax.attention.decode_attention`` at one shape, ``inputs`` fuzzed
    caches through it, each within ``oracle.decode_attention_error_bound`` (NaN never passes)."""
    import jax
    import jax.numpy as jnp

    from .attention import decode_attention
    from .device import pallas_interpret

    fn = jax.jit(functools.partial(decode_attention, interpret=pallas_interpret()))
    worst = 0.0
    for i in range(inputs):
        q, k, v, layer, lengths = _attention_inputs(seed, b, s, kvh, g, d, i)
        out = fn(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), jnp.int32(layer),
                 jnp.asarray(lengths, jnp.int32))
        got = np.asarray(out.astype(jnp.float32), np.float64)
        want, bound = oracle.decode_attention_error_bound(q, k[layer], v[layer], lengths)
        err = np.abs(got - want)
        bad = ~(err <= bound)  # NaN fails
        if bad.any():
            nan = int(np.isnan(got).sum())
            why = (f"{nan} NaN (a read past lengths[b]?)" if nan else
                   f"largest |err| / bound {np.max(err / bound):.3g}")
            detail = (f"input {i}: {int(bad.sum())} of {got.size} outputs outside the oracle's "
                      f"bound, {why}")
            f32c = np.float32  # bf16 values are exact in float32; the failing layer only
            return FAIL, detail, {"q": q.astype(f32c), "k": k[layer].astype(f32c),
                                  "v": v[layer].astype(f32c), "lengths": lengths, "out": got,
                                  "oracle": want, "bound": bound}
        worst = max(worst, float(np.max(err / bound)))
    return PASS, (f"within the oracle's bound on {inputs} inputs (largest |err| / bound "
                  f"{worst:.3g})"), None


def _qkv_inputs(seed: int, b: int, s: int, kvh: int, g: int, d: int, norm: bool, i: int):
    """Fuzzed input ``i`` of a q/k/v decode-attention check, as bf16 values in float64: (qkv
    [B, (NH + 2 KVH) D], k, v [2, B, S, KVH, D], layer, start, norms [2, D] or None, cos,
    sin [B, D]); qkv at a magnitude cycling over 0.05, 1, 4 and 32, the cache as in
    :func:`_attention_inputs` (+-8192 in the other layer) with NaN in every slot past the new
    token's position ``start`` (cycling over S - 1, 0 and 64); RoPE at that position."""
    rng = np.random.default_rng([seed, 6, b, s, kvh, g, d, int(norm), i])

    def values(shape, mag):
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(mag)
        return x.astype(ml_dtypes.bfloat16).astype(np.float64)

    scale = (0.05, 1.0, 4.0, 32.0)[i % 4]
    layer, start = i % 2, (s - 1, 0, min(s - 1, 64))[i % 3]
    qkv = values((b, (kvh * g + 2 * kvh) * d), scale)
    k = np.full((2, b, s, kvh, d), 8192.0)  # bf16 values: the untouched slots compare exactly
    v = np.full((2, b, s, kvh, d), -8192.0)
    k[layer] = values((b, s, kvh, d), scale)
    v[layer] = values((b, s, kvh, d), 10.0 ** rng.uniform(-3, 3))
    k[:, :, start:] = np.nan  # never read (the new token's k and v come from qkv)
    v[:, :, start:] = np.nan
    norms = values((2, d), 1.0) if norm else None
    ang = start * 1e6 ** -(np.arange(0, d, 2) / d)
    ang = np.concatenate([ang, ang])
    cos, sin = (np.broadcast_to(bf16_round(f(ang)), (b, d)) for f in (np.cos, np.sin))
    return qkv, k, v, layer, start, norms, cos, sin


def _qkv_attention_check(seed: int, b: int, s: int, kvh: int, g: int, d: int, norm: bool,
                         inputs: int):
    """Two compiles of ``nvfp4_jax.attention.decode_qkv_attention`` (the decoders' one-token
    attention: q/k RMSNorm, RoPE, the cache writes and the chunks in one launch, then the
    combine), ``inputs`` fuzzed steps through it: the new k row among
    ``oracle.decode_qkv_attention_error_bound``'s values, the new v row copied, every other
    cache slot untouched (bit for bit), the output within the oracle's bound (NaN never
    passes); and with ``w4a4_operand`` (the decoders' o_proj operand from the last launch) the
    oracle's ``trtllm`` quantization of that output in the Mosaic GEMM's layout, bit for bit,
    at input scales that put block scales among E4M3 subnormals, in range, or saturated."""
    import jax
    import jax.numpy as jnp

    from .attention import decode_qkv_attention
    from .device import pallas_interpret
    from .gemm.mosaic import PERM, token_tile

    rows = token_tile(b)

    def step(qkv, k, v, layer, start, norms, cos, sin, scale=None):
        return decode_qkv_attention(qkv, k, v, layer, start, num_heads=kvh * g,
                                    q_norm=None if norms is None else norms[0],
                                    k_norm=None if norms is None else norms[1], eps=1e-6,
                                    rope=(cos, sin), interpret=pallas_interpret(),
                                    w4a4_operand=None if scale is None else (scale, None, rows))

    fn = jax.jit(step)
    worst = 0.0
    for i in range(inputs):
        qkv, k, v, layer, start, norms, cos, sin = _qkv_inputs(seed, b, s, kvh, g, d, norm, i)
        bf = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
        out, kc, vc = fn(bf(qkv), bf(k), bf(v), jnp.int32(layer), jnp.int32(start),
                         None if norms is None else bf(norms), jnp.asarray(cos, jnp.float32),
                         jnp.asarray(sin, jnp.float32))
        want = oracle.decode_qkv_attention_error_bound(
            qkv, k[layer], v[layer], start, kvh * g, None if norms is None else norms[0],
            None if norms is None else norms[1], 1e-6, cos, sin)
        got = np.asarray(out.astype(jnp.float32), np.float64)
        kc, vc = (np.asarray(c.astype(jnp.float32), np.float64) for c in (kc, vc))
        new_k = kc[layer, :, start]
        k_ok = (want["k_lo"] <= new_k) & (new_k <= want["k_hi"])
        rest = np.ones(k.shape, bool)
        rest[layer, :, start] = False
        same = (np.array_equal(kc[rest], k[rest], equal_nan=True)
                and np.array_equal(vc[rest], v[rest], equal_nan=True)
                and np.array_equal(vc[layer, :, start], want["v_row"]))
        err = np.abs(got - want["out"])
        bad = ~(err <= want["out_bound"])  # NaN fails
        if bad.any() or not k_ok.all() or not same:
            nan = int(np.isnan(got).sum())
            why = [f"{int((~k_ok).sum())} of {k_ok.size} new k values off the oracle's"] * (
                not k_ok.all()) + ["a cache slot other than the new row changed, or v's new "
                                   "row is not the copy"] * (not same)
            if bad.any():
                why.append(f"{int(bad.sum())} of {got.size} outputs outside the oracle's bound, "
                           + (f"{nan} NaN (a read past the new token?)" if nan else
                              f"largest |err| / bound {np.max(err / want['out_bound']):.3g}"))
            f32c = np.float32  # bf16 values are exact in float32
            return FAIL, f"input {i}: " + "; ".join(why), {
                "qkv": qkv.astype(f32c), "k": k[layer].astype(f32c), "v": v[layer].astype(f32c),
                "start": start, "cos": cos.astype(f32c), "sin": sin.astype(f32c),
                "norms": np.zeros(0) if norms is None else norms.astype(f32c), "out": got,
                "oracle": want["out"], "bound": want["out_bound"], "k_new": new_k,
                "k_lo": want["k_lo"], "k_hi": want["k_hi"]}
        worst = max(worst, float(np.max(err / want["out_bound"])))
        if kvh * g * d % 128:
            continue
        # block scale amax / (6 s): below 2^-6 (E4M3 subnormal), about 1, above 448 (saturated)
        scale = np.float32(np.abs(got).max() * (40.0, 1 / 6.0, 1 / 6000.0)[i % 3])
        xp = fn(bf(qkv), bf(k), bf(v), jnp.int32(layer), jnp.int32(start),
                None if norms is None else bf(norms), jnp.asarray(cos, jnp.float32),
                jnp.asarray(sin, jnp.float32), jnp.float32(scale))[0]
        vals = oracle.dequantize(oracle.quantize(got.reshape(b, -1), "trtllm",
                                                 encode_scale=float(np.float32(1 / scale))),
                                 include_decode_scale=False)
        op = np.zeros((rows, vals.shape[1]))
        op[:b] = vals.reshape(b, -1, 128)[:, :, PERM].reshape(b, -1)
        gotp = np.asarray(xp.astype(jnp.float32), np.float64)
        if gotp.shape != op.shape or not np.array_equal(gotp, op):
            nbad = int((gotp != op).sum()) if gotp.shape == op.shape else gotp.size
            return FAIL, (f"input {i}: {nbad} of {op.size} values of o_proj's operand (the "
                          f"w4a4_operand output) not the oracle's quantization"), {
                "out": got, "input_scale": np.float64(scale), "operand": gotp, "oracle": op}
    return PASS, (f"new k rows among the oracle's values, the rest of the caches untouched, "
                  f"outputs within its bound, o_proj's operand the oracle's, on {inputs} inputs "
                  f"(largest |err| / bound {worst:.3g})"), None


def _routing_inputs(seed: int, t: int, e: int, h: int, i: int):
    """Fuzzed input ``i`` of a routing check: (logits float32 [T, E], hidden bf16 values as
    float32 [T, H]); rows at magnitudes 1e-3, 1, 30 or 300 (most exps flush to zero at 300),
    tied logits, -inf experts, and tokens with a NaN or +inf logit, all logits -inf or a
    non-finite hidden value."""
    rng = np.random.default_rng([seed, 5, t, e, h, i])
    lg = (rng.standard_normal((t, e)) * rng.choice([1e-3, 1.0, 30.0, 300.0], (t, 1)))
    lg = lg.astype(np.float32)
    x = rng.standard_normal((t, h)).astype(ml_dtypes.bfloat16).astype(np.float32)
    for r in range(t):
        kind = (r + i) % 8  # every kind within a few rows or inputs; 5-7: plain rows
        if kind == 0:  # ties: three experts share another's logit
            lg[r, rng.choice(e, size=min(e, 3), replace=False)] = lg[r, rng.integers(e)]
        elif kind == 1:
            lg[r, rng.choice(e, size=rng.integers(1, e), replace=False)] = -np.inf
        elif kind == 2:
            lg[r, rng.integers(e)] = (np.nan, np.inf)[int(rng.integers(2))]
        elif kind == 3:
            lg[r] = -np.inf
        elif kind == 4:
            x[r, rng.integers(h)] = (np.nan, np.inf, -np.inf)[int(rng.integers(3))]
    return lg, x


def _routing_check(seed: int, t: int, e: int, k: int, h: int, renorm: bool, inputs: int):
    """One compile of ``nvfp4_jax.moe.select_kernel``, ``inputs`` fuzzed [T, E] logits through
    it: the oracle's experts where softmax is defined and the hidden
    row finite, weights within ``oracle.select_experts_error_bound``, NaN weights elsewhere."""
    import jax
    import jax.numpy as jnp

    from .device import pallas_interpret
    from .moe.select_kernel import select_kernel

    fn = jax.jit(functools.partial(select_kernel, top_k=k, renormalize=renorm,
                                   interpret=pallas_interpret()))
    worst = 0.0
    for i in range(inputs):
        lg, x = _routing_inputs(seed, t, e, h, i)
        ids, w = fn(jnp.asarray(lg), jnp.asarray(x, jnp.bfloat16))
        ids, w = np.asarray(ids), np.asarray(w, np.float64)
        want_ids, want, bound = oracle.select_experts_error_bound(lg, k, renormalize=renorm)
        undefined = ~np.isfinite(want).all(axis=1) | ~np.isfinite(x).all(axis=1)
        ok = ~undefined
        err = np.abs(w - want)
        why = None
        if not np.isnan(w[undefined]).all():
            why = "a token with undefined softmax or a non-finite hidden row has finite weights"
        elif (ids[ok] != want_ids[ok]).any():
            moved = int((ids[ok] != want_ids[ok]).any(axis=1).sum())
            why = f"{moved} tokens route to other experts"
        elif not (err[ok] <= bound[ok]).all():  # NaN fails
            why = f"largest |err| / bound {np.nanmax(err[ok] / bound[ok]):.3g}"
        if why:
            return FAIL, f"input {i}: {why}", {
                "logits": lg, "hidden": x, "ids": ids, "weights": w, "oracle_ids": want_ids,
                "oracle_weights": want, "bound": bound}
        if ok.any():
            worst = max(worst, float(np.max(err[ok] / bound[ok])))
    return PASS, (f"the oracle's experts and weights within its bound on {inputs} inputs "
                  f"(largest |err| / bound {worst:.3g})"), None


def _norm_router_check(seed: int, t: int, h: int, e: int, inputs: int):
    """Two compiles on the kernel (backend "pallas"; interpreted on CPU), ``nn.norm_router``
    (even inputs) and the decoders' ``nn.add_norm_router`` (odd inputs: x = x0 + a), with
    [2, H] / [2, E, H] stacks read at a traced layer 1, ``inputs`` fuzzed cases: x rows at
    2^-20 (mean square near eps), 1 or 300 (a at x0's scale, or cancelling it), router rows
    from 2^-12 to 1, other data in layer 0; the sum the bf16 add bit for bit, h within
    ``oracle.norm_rope_interval``, logits bf16 values within ``oracle.router_logits_interval``
    of the kernel's h."""
    import jax
    import jax.numpy as jnp

    from . import nn

    plain = jax.jit(lambda x, w, r: nn.norm_router(x, w, r, 1e-6, layer=jnp.int32(1),
                                                   backend="pallas"))
    add = jax.jit(lambda x, a, w, r: nn.add_norm_router(x, a, w, r, 1e-6, layer=jnp.int32(1),
                                                        backend="pallas"))
    narrow = 0
    for i in range(inputs):
        rng = np.random.default_rng([seed, 7, t, h, e, i])
        x = (rng.standard_normal((t, h)) * rng.choice([2.0**-20, 1.0, 300.0], (t, 1)))
        x = x.astype(ml_dtypes.bfloat16)
        w = rng.uniform(0.25, 2.0, (2, h)).astype(ml_dtypes.bfloat16)
        r = (rng.standard_normal((2, e, h)) * rng.choice([2.0**-12, 0.05, 1.0], (1, e, 1)))
        r = r.astype(ml_dtypes.bfloat16)
        if i % 2:  # the residual stream x0 + a, the add in the kernel's launch
            x0 = x
            a = (np.where(rng.random((t, 1)) < 0.5, -x0.astype(np.float32), 0.0)
                 + rng.standard_normal((t, h)) * np.abs(x0.astype(np.float32)).mean())
            a = a.astype(ml_dtypes.bfloat16)
            x = (x0.astype(np.float32) + a.astype(np.float32)).astype(ml_dtypes.bfloat16)
            sk, hh, lg = add(jnp.asarray(x0), jnp.asarray(a), jnp.asarray(w), jnp.asarray(r))
            bad = np.asarray(sk.astype(jnp.float32)) != x.astype(np.float32)
            if bad.any():
                return FAIL, f"input {i}: {int(bad.sum())} sums x + a not the bf16 add", {
                    "x": x0.astype(np.float32), "a": a.astype(np.float32),
                    "sum": np.asarray(sk.astype(jnp.float32)), "want": x.astype(np.float32)}
        else:
            hh, lg = plain(jnp.asarray(x), jnp.asarray(w), jnp.asarray(r))
        hh = np.asarray(hh.astype(jnp.float32), np.float64)
        lg = np.asarray(lg, np.float64)
        lo, hi = oracle.norm_rope_interval(x.astype(np.float64), w[1].astype(np.float64),
                                           1e-6, None, None)
        llo, lhi = oracle.router_logits_interval(hh, r[1].astype(np.float64))
        # NaN is outside; a logit that is not a bf16 value is off the router's rounding
        h_out = ~((lo <= hh) & (hh <= hi))
        lg_out = ~((llo <= lg) & (lg <= lhi)) | (oracle.bf16_round(lg) != lg)
        why = None
        if h_out.any():
            why = f"{int(h_out.sum())} normed values outside the interval"
        elif lg_out.any():
            why = f"{int(lg_out.sum())} logits outside the interval"
        if why:
            return FAIL, f"input {i}: {why}", {
                "x": x.astype(np.float32), "norm_weight": w.astype(np.float32),
                "router": r.astype(np.float32), "h": hh, "logits": lg, "h_lo": lo, "h_hi": hi,
                "logits_lo": llo, "logits_hi": lhi}
        narrow += int((llo == lhi).sum())
    return PASS, (f"h and logits within the oracle's intervals on {inputs} inputs ("
                  f"{narrow / (inputs * t * e):.0%} of the logits' intervals one value)"), None


# ----------------------------------------------------------------------------- the plan
# Time on a GPU is compile time: every (kernel, shape, mode, activation) is one compile (XLA's,
# with the Triton or Mosaic kernels inside), and every further fuzzed input through it costs
# milliseconds of device time plus the oracle's host time. So the plan is few shapes per kernel,
# chosen for their edges (decode M = 1, ragged M, K not a multiple of 256, N below one tile,
# top-k above 2, I not a multiple of 256), and several inputs per compiled shape.


def _anywhere(cc: int | None) -> bool:
    return True


def _pallas_triton(cc: int | None) -> bool:
    """Pallas-Triton: interpreted on CPU; on a GPU its E4M3 converts need sm_89+."""
    return cc is None or cc >= 89


def _dot_scaled(cc: int | None) -> bool:
    """Triton's scaled dot (gemm/fp4mma.py): interpreted on CPU; native FP4 MMA on SM 12.x,
    decomposed to a bf16 MMA on sm_90 (the Triton that jaxlib ships); not on older GPUs."""
    return cc is None or cc >= 90


def _mosaic(cc: int | None) -> bool:
    """The Mosaic kernels: wgmma on sm_90, the mma.sync form on SM 12.x (JAX >= 0.11)."""
    from .gemm.mosaic import unavailable

    return unavailable(cc) is None


def _any_gemm(m: int, n: int, k: int) -> bool:
    return True


def _mosaic_gemm(m: int, n: int, k: int) -> bool:
    """Inside the Mosaic kernel's shapes (elsewhere ``matmul`` would fall back)."""
    return m <= 64 and k % 256 == 0


#: matmul kernels, one row each: (name in ``matmul/<name>/<mode>``, the ``nvfp4_jax.matmul``
#: arguments that select it, modes, runs on this compute capability (None: CPU), fits (M, N, K))
MATMUL = (
    ("pallas", {"backend": "pallas"}, ("w4a16", "w4a4"), _pallas_triton, _any_gemm),
    ("mosaic", {"backend": "mosaic"}, ("w4a16", "w4a4"), _mosaic, _mosaic_gemm),
    ("xla", {"backend": "xla"}, ("w4a16", "w4a4"), _anywhere, _any_gemm),
    # tt.dot_scaled: the FP4 MMA on SM 12.x, Triton's decomposition on sm_90
    ("fp4mma", {"backend": "pallas", "mma": "fp4"}, ("w4a4",), _dot_scaled, _any_gemm),
)
#: MoE paths: (path, runs on this compute capability, fits hidden size H)
MOE_PATHS = (
    ("pallas-triton", _pallas_triton, lambda h: True),
    ("pallas-triton-fp4", _dot_scaled, lambda h: True),
    ("mosaic", _mosaic, lambda h: h % 256 == 0),
    ("xla", _anywhere, lambda h: True),
)
#: shapes: "cpu" (the Pallas kernels interpreted), "gpu" (the default run on a GPU), "full"
#: (added to "gpu" by ``--full``). quantize (M, K); matmul (M, N, K); moe (T, H, I, E, k,
#: activation, mode): the default run has every (activation, mode) pair once per path.
QUANT_SHAPES = {"cpu": ((3, 64), (17, 272)), "gpu": ((300, 1040),),
                "full": ((1, 16), (1, 2048), (33, 4096), (256, 512))}
GEMM_SHAPES = {"cpu": ((3, 128, 256), (17, 64, 272)),
               "gpu": ((1, 1024, 4096), (33, 512, 2048), (300, 256, 1040)),
               "full": ((1, 4096, 4096), (16, 1024, 2048), (64, 512, 4096))}
MOE_SHAPES = {"cpu": ((3, 256, 128, 4, 2, "relu2", "trtllm_cutlass"),
                      (2, 256, 128, 4, 2, "swiglu", "b12x")),
              "gpu": ((5, 256, 256, 8, 2, "relu2", "trtllm_cutlass"),
                      (5, 256, 256, 8, 2, "swiglu", "b12x"),
                      (19, 512, 640, 8, 6, "relu2", "b12x"),
                      (9, 256, 384, 8, 2, "swiglu", "trtllm_cutlass")),
              "full": ((3, 768, 512, 8, 3, "swiglu", "b12x"),
                       (37, 1024, 2688, 8, 6, "relu2", "trtllm_cutlass"),
                       (9, 512, 1024, 8, 2, "swiglu", "trtllm_cutlass"))}
#: decode attention (B, S, KVH, G, D): batch, cache slots, kv heads, query heads per kv head,
#: head_dim; "gpu": Qwen3-30B-A3B's heads (32 / 4) at batch 8, ragged lengths (its kernels at
#: Llama-3-8B's heads run in attention/qkv's checks)
ATTENTION_SHAPES = {"cpu": ((2, 100, 2, 4, 64),),
                    "gpu": ((8, 1024, 4, 8, 128),),
                    "full": ((1, 2048, 8, 4, 128), (32, 512, 8, 4, 128), (3, 300, 2, 16, 64),
                             (2, 4096, 1, 8, 64))}
#: q/k/v decode attention (B, S, KVH, G, D, q/k RMSNorm): "gpu": Qwen3-30B-A3B's heads (32 / 4,
#: RMSNorm) at batch 8, Llama-3-8B's (32 / 8) at batch 1
QKV_SHAPES = {"cpu": ((2, 80, 2, 4, 64, True),),
              "gpu": ((8, 1024, 4, 8, 128, True), (1, 2048, 8, 4, 128, False)),
              "full": ((3, 300, 2, 16, 64, True),)}
#: routing (T, E, k, H, renormalize): a batch at Qwen3-30B-A3B's router (128 experts, top-8,
#: H 2048, renormalized), many experts with a large k; full: a decode token, few experts
#: several tokens to a program, a prefill
ROUTING_SHAPES = {"cpu": ((5, 60, 6, 64, True),),
                  "gpu": ((33, 128, 8, 2048, True), (7, 512, 22, 256, False)),
                  "full": ((1, 128, 8, 2048, True), (300, 16, 2, 32, False),
                           (2048, 128, 8, 2048, True))}
#: norm_linear (M, N, K, RMSNorm'd): Qwen3-30B-A3B's q/k/v and Llama-3-8B's gate/up at
#: decode, Llama's down_proj (no norm); "cpu" runs the XLA composition
NORM_LINEAR_SHAPES = {"cpu": ((3, 64, 256, True), (2, 48, 512, False)),
                      "gpu": ((1, 5120, 2048, True), (8, 2048, 4096, True),
                              (33, 1024, 14336, False)),
                      "full": ((64, 4096, 4096, True), (5, 1024, 8192, True))}
#: norm_router (T, H, E): Qwen3-30B-A3B's H 2048 and 128 experts at batch 1, 60 experts in
#: blocks of 8 at T = 64 (the last block part empty); full: H 4096, 256 experts
NORM_ROUTER_SHAPES = {"cpu": ((3, 64, 10),),
                      "gpu": ((1, 2048, 128), (64, 2048, 60)),
                      "full": ((8, 4096, 256),)}
#: fuzzed inputs per compiled shape (``--fuzz`` overrides)
FUZZ = {"cpu": 2, "gpu": 3}


def _shapes(table: dict, gpu: bool, full: bool) -> tuple:
    return (table["gpu"] + (table["full"] if full else ())) if gpu else table["cpu"]


def plan(cc: int | None, seed: int = 0, *, full: bool = False,
         fuzz: int | None = None) -> list[tuple[str, str, Callable]]:
    """(kernel, shape, check) for every kernel this device runs (``cc``: compute capability,
    None on CPU); ``full``: more shapes on a GPU; ``fuzz``: inputs per compiled shape (default
    ``FUZZ``). Each check compiles once and carries its input count as ``check.inputs``."""
    import nvfp4_jax as nj

    gpu = cc is not None
    n_in = FUZZ["gpu" if gpu else "cpu"] if fuzz is None else fuzz
    if n_in < 1:
        raise ValueError(f"fuzz: expected at least 1 input per compiled shape, got {n_in}")
    out: list[tuple[str, str, Callable]] = []

    def add(kernel: str, shape: str, fn: Callable, *args) -> None:
        check = functools.partial(fn, *args)
        check.inputs = n_in  # type: ignore[attr-defined]
        out.append((kernel, shape, check))

    for recipe in nj.JAX_RECIPES:
        for m, k in _shapes(QUANT_SHAPES, gpu, full):
            add(f"quantize/{recipe}", f"{m}x{k}", _quantize_check, recipe, seed, m, k, n_in, False)
            add(f"quantize/{recipe}", f"{m}x{k} amax", _quantize_check, recipe, seed, m, k, n_in,
                True)
    for name, select, modes, runs_on, fits in MATMUL:
        if not runs_on(cc):
            continue
        for mode in modes:
            for m, n, k in _shapes(GEMM_SHAPES, gpu, full):
                if fits(m, n, k):
                    add(f"matmul/{name}/{mode}", f"{m}x{n}x{k}", _matmul_check, select,
                        mode == "w4a4", seed, m, n, k, n_in)
    for path, runs_on, fits in MOE_PATHS:
        if not runs_on(cc):
            continue
        for t, h, i, e, k, act, mode in _shapes(MOE_SHAPES, gpu, full):
            if fits(h):
                add(f"moe/{path}/{mode}/{act}", f"T{t} H{h} I{i} E{e} k{k}", _moe_check, path,
                    mode, act, seed, t, h, i, e, k, n_in)
    for m, n, k, norm in _shapes(NORM_LINEAR_SHAPES, gpu, full):
        add("linear/norm_linear", f"{m}x{n}x{k}" + (" rmsnorm" if norm else ""),
            _norm_linear_check, seed, m, n, k, norm, n_in)
    if _pallas_triton(cc):  # moe's softmax top-k routing on the kernel backends
        for t, e, k, h, renorm in _shapes(ROUTING_SHAPES, gpu, full):
            add("moe/routing", f"T{t} E{e} k{k} H{h}" + (" renorm" if renorm else ""),
                _routing_check, seed, t, e, k, h, renorm, n_in)
        for t, h, e in _shapes(NORM_ROUTER_SHAPES, gpu, full):
            add("moe/norm_router", f"T{t} H{h} E{e}", _norm_router_check, seed, t, h, e, n_in)
    if _pallas_triton(cc):  # the decoders' one-token attention (Pallas-Triton)
        for b, s, kvh, g, d in _shapes(ATTENTION_SHAPES, gpu, full):
            add("attention/decode", f"B{b} S{s} KVH{kvh} G{g} D{d}", _attention_check, seed, b,
                s, kvh, g, d, n_in)
        for b, s, kvh, g, d, norm in _shapes(QKV_SHAPES, gpu, full):
            add("attention/qkv", f"B{b} S{s} KVH{kvh} G{g} D{d}" + (" qk_norm" if norm else ""),
                _qkv_attention_check, seed, b, s, kvh, g, d, norm, n_in)
    return out


def run(*, seed: int = 0, out_dir: str = "nvfp4-selftest-failures", only: tuple[str, ...] = (),
        full: bool = False, fuzz: int | None = None, jobs: int = 1,
        progress: Callable[[Check], None] | None = None) -> tuple[dict, list[Check]]:
    """Run every check of :func:`plan` (those whose kernel starts with one of ``only``, if
    given). Returns (device info, checks); each check counts its backend compiles.

    ``jobs`` > 1: that many checks at once on a thread pool (XLA's compiles, Triton's
    inside them, and numpy's oracle release the GIL, so compiles overlap); ``progress`` still
    sees the checks in plan order, and a check's seconds then include time shared with others.
    """
    import jax

    if jobs < 1:
        raise ValueError(f"jobs: expected at least 1 check at a time, got {jobs}")

    info = device_info()
    cc = info["compute_capability"]
    if cc is not None:  # GeForce RTX 50xx is missing from JAX 0.11's Pallas-Triton GPU table
        from .gemm.api import register_sm12x_device_kinds

        register_sm12x_device_kinds()
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    checks = []
    todo = [(k, s, fn) for k, s, fn in plan(cc, seed, full=full, fuzz=fuzz)
            if not only or k.startswith(only)]
    try:
        if jobs == 1:
            results = (_timed(k, s, fn, out_dir, counter) for k, s, fn in todo)
        else:
            pool = concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="selftest")
            futures = [pool.submit(_timed, k, s, fn, out_dir, counter) for k, s, fn in todo]
            results = (f.result() for f in futures)
        for c in results:
            checks.append(c)
            if progress is not None:
                progress(c)
    finally:
        if jobs > 1:
            pool.shutdown(wait=True, cancel_futures=True)
        jax.monitoring.unregister_event_duration_listener(counter)
        _gemm_operands.cache_clear()
        _moe_inputs.cache_clear()
        _moe_bound.cache_clear()
    return info, checks


def verdicts(checks: list[Check]) -> dict[str, str]:
    """PASS or FAIL per kernel (FAIL when any of its shapes failed)."""
    out: dict[str, str] = {}
    for c in checks:
        out[c.kernel] = FAIL if FAIL in (out.get(c.kernel), c.status) else PASS
    return out


def format_check(c: Check) -> str:
    npz = f"  -> {c.npz}" if c.npz else ""
    return (f"{c.status:4}  {c.kernel:36} {c.shape:22} {c.seconds:7.2f}s ({c.compiles} compiles "
            f"{c.compile_s:5.1f}s)  {c.detail}{npz}")


def summary(checks: list[Check], wall_s: float | None = None) -> dict:
    """Totals of a run: checks, fuzzed inputs, backend compiles, seconds (the checks' sum and
    their compiling part; ``wall_s``: the run's wall time, less than the sum with ``jobs``)."""
    return {"checks": len(checks), "inputs": sum(c.inputs for c in checks),
            "compiles": sum(c.compiles for c in checks),
            "seconds": round(sum(c.seconds for c in checks), 3),
            "compile_s": round(sum(c.compile_s for c in checks), 3),
            "wall_s": None if wall_s is None else round(wall_s, 3)}


def to_json(info: dict, checks: list[Check], options: dict | None = None,
            wall_s: float | None = None) -> str:
    """The run as JSON: device and versions, the verdicts, the totals, every check (with its
    seconds and compiles); ``options``: how it was run (full, fuzz, seed, only, jobs)."""
    v = verdicts(checks)
    return json.dumps({"device": info, "options": options or {},
                       "verdict": FAIL if FAIL in v.values() else PASS, "kernels": v,
                       "summary": summary(checks, wall_s),
                       "checks": [dataclasses.asdict(c) for c in checks]}, indent=1)
