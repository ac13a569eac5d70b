"""``nvfp4 selftest``: every NVFP4 kernel this device runs, against the exact oracle.

What an RTX 50xx / DGX Spark (or any) user runs first. For each kernel the local device can
run, at a spread of shapes, on fuzzed inputs (numpy RNG; 16-value blocks spread over many
powers of two, so that E4M3 block scales reach the subnormals, underflow and saturate):

* ``quantize/<recipe>`` (every JAX recipe; given and derived global scale): codes, scale
  bytes and decode scale byte for byte equal to ``oracle.quantize``;
* ``matmul/<backend>/<w4a16|w4a4>`` (``pallas``: Pallas-Triton, interpreted on CPU; ``mosaic``
  on sm_90; ``xla``; ``fp4mma``: W4A4 on the FP4-MMA kernel, native on SM 12.x), fp32 output:
  within the oracle's fp32-accumulation bound
  (``explain.explain_gemm``: its verdict and margin, the largest ``|out - oracle| / bound``);
* ``moe/<path>/<mode>/<activation>`` (``pallas-triton``, ``mosaic`` on sm_90, ``xla``): inside
  ``testing.assertions.moe_bound``'s interval with zero slack in the activation quantization
  (so a code flipped by an inexact division fails).

A verdict per kernel; for each failure an ``.npz`` (GEMM failures in the form ``nvfp4 explain
FILE.npz`` reads; quantize and MoE failures hold their inputs, the output and the oracle's).
On CPU the Pallas kernels run interpreted at small sizes. Needs no hypothesis.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import shutil
import subprocess
import time
import traceback
from collections.abc import Callable

import numpy as np

import oracle
from oracle.formats import bf16_round, f32

#: check outcomes
PASS, FAIL = "PASS", "FAIL"


@dataclasses.dataclass
class Check:
    """One kernel at one shape: ``status`` PASS or FAIL, ``detail`` why, ``npz`` the failure's
    inputs and output (None when it passed)."""

    kernel: str
    shape: str
    status: str
    detail: str
    seconds: float
    npz: str | None = None


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


# ----------------------------------------------------------------------------- checks

def _timed(kernel: str, shape: str, fn: Callable[[], tuple[str, str, dict | None]],
           out_dir: str) -> Check:
    t0 = time.perf_counter()
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
    return Check(kernel, shape, status, detail, round(time.perf_counter() - t0, 3), npz)


def _quantize_check(recipe: str, x: np.ndarray, d: float | None):
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj

    if d is None:
        got = jax.jit(lambda v: nj.quantize(v, recipe))(jnp.asarray(x, jnp.bfloat16))
        want = oracle.quantize(x, recipe)
    else:
        got = jax.jit(lambda v, g: nj.quantize(v, recipe, decode_scale=g))(
            jnp.asarray(x, jnp.float32), jnp.float32(d))
        want = oracle.quantize(x, recipe, decode_scale=d)
    got = nj.to_oracle(got)
    dc = int((got.codes != want.codes).sum())
    ds = int((got.scales != want.scales).sum())
    dd = float(got.decode_scale) != float(want.decode_scale)
    detail = (f"{dc} of {want.codes.size} code bytes, {ds} of {want.scales.size} scale bytes"
              f"{', the decode scale' if dd else ''} differ from oracle.quantize")
    if dc or ds or dd:
        return FAIL, detail, {"x": x, "recipe": np.array(recipe),
                              "decode_scale": np.float64(d or 0.0), "codes": got.codes,
                              "scales": got.scales, "oracle_codes": want.codes,
                              "oracle_scales": want.scales}
    subnormal = int(((want.scales > 0) & (want.scales < 8)).sum())
    return PASS, f"byte-exact ({subnormal} E4M3-subnormal block scales)", None


def _matmul_check(backend: str, w4a4: bool, rng, m: int, n: int, k: int):
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj

    from . import explain

    wo = _weight(rng, n, k)
    x = spread_values(rng, (m, k), -12.0, 4.0)
    s = float(f32(np.abs(x).max() / 2688)) if w4a4 else None
    # fp32 output: no output rounding in the bound, so explain can fit a fault's exact shift
    case = explain.GemmCase.from_linear(x, wo.codes, wo.scales, float(wo.decode_scale), s,
                                        out_dtype="float32")
    kw = {"backend": "pallas", "mma": "fp4"} if backend == "fp4mma" else {"backend": backend}
    mm = jax.jit(lambda xx, ww, ss: nj.matmul(xx, ww, input_scale=ss, out_dtype=jnp.float32,
                                              **kw))
    out = mm(jnp.asarray(x, jnp.bfloat16), nj.from_oracle(wo),
             None if s is None else jnp.float32(s))
    out = np.asarray(out.astype(jnp.float32), np.float64)
    e = explain.explain_gemm(case, out)
    if e.verdict == "correct":
        return PASS, f"within the oracle's bound (margin {e.margin:.3g})", None
    best = f"; best match: {e.best.name} ({e.best.meaning})" if e.best is not None else ""
    detail = (f"{e.bad} of {e.total} outputs outside the oracle's bound: {e.reason}{best} "
              "(nvfp4 explain FILE.npz --out-dtype float32)")
    return FAIL, detail, {"_writer": lambda path: explain.save_npz(path, case, out)}


def _moe_kwargs(path: str) -> dict:
    """``nvfp4_jax.moe`` keyword arguments selecting ``path`` (pallas-triton, mosaic, xla)."""
    if path == "xla":
        return {"backend": "xla"}
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


def _moe_check(path: str, mode: str, activation: str, rng, t, h, inter, e, k):
    import jax
    import jax.numpy as jnp

    import nvfp4_jax as nj

    from .testing.assertions import assert_moe_close

    case = _moe_case(rng, t, h, inter, e, k, activation)
    hidden, ids, wts, fc1, fc2, s1, s2 = case
    kw = {"activation": activation, "mode": mode, **_moe_kwargs(path)}
    layer = jax.jit(lambda x, w1, w2, a, b, i, w: nj.moe(x, fc1=w1, fc2=w2, fc1_input_scale=a,
                                                          fc2_input_scale=b, topk_ids=i,
                                                          topk_weights=w, **kw))
    out = layer(jnp.asarray(hidden, jnp.bfloat16), nj.from_oracle(fc1), nj.from_oracle(fc2),
                jnp.asarray(s1), jnp.asarray(s2), jnp.asarray(ids), jnp.asarray(wts))
    out = np.asarray(out.astype(jnp.float32), np.float64)
    try:
        b = assert_moe_close(out, *case, activation=activation, mode=mode, quant_slack=0.0,
                             label=f"moe {path}")
    except AssertionError as exc:
        ref = oracle.moe(*case, activation=activation, mode=mode)
        dump = {"hidden": hidden, "topk_ids": ids, "topk_weights": wts, "fc1_codes": fc1.codes,
                "fc1_scales": fc1.scales, "fc1_weight_scale_2": fc1.decode_scale,
                "fc2_codes": fc2.codes, "fc2_scales": fc2.scales,
                "fc2_weight_scale_2": fc2.decode_scale, "fc1_input_scale": s1,
                "fc2_input_scale": s2, "mode": np.array(mode), "activation": np.array(activation),
                "out": out, "oracle_out": ref}
        return FAIL, str(exc).splitlines()[0][:400], dump
    return PASS, (f"inside the oracle's interval; {np.mean(out == b.ref):.1%} of outputs "
                  "bit-identical to it"), None


# ----------------------------------------------------------------------------- the plan

#: (M, N, K) of the GEMM checks, and (T, H, I, E, k, activation, mode) of the MoE checks
GPU_GEMM = ((1, 4096, 4096), (16, 1024, 2048), (300, 256, 1040), (64, 512, 4096))
CPU_GEMM = ((3, 128, 256), (17, 64, 272))
GPU_QUANT = ((1, 16), (33, 4096), (256, 512), (300, 1040))
CPU_QUANT = ((3, 64), (17, 272))
GPU_MOE = ((5, 256, 256, 8, 2, "relu2", "trtllm_cutlass"), (5, 256, 256, 8, 2, "relu2", "b12x"),
           (3, 768, 512, 8, 3, "swiglu", "b12x"),
           (37, 1024, 2688, 8, 6, "relu2", "trtllm_cutlass"),
           (9, 512, 1024, 8, 2, "swiglu", "trtllm_cutlass"))
CPU_MOE = ((3, 256, 128, 4, 2, "relu2", "trtllm_cutlass"), (2, 256, 128, 4, 2, "swiglu", "b12x"))


def plan(cc: int | None, seed: int = 0) -> list[tuple[str, str, Callable]]:
    """(kernel, shape, check) for every kernel this device runs (``cc``: compute capability,
    None on CPU)."""
    import nvfp4_jax as nj

    gpu = cc is not None
    rng = np.random.default_rng(seed)
    out: list[tuple[str, str, Callable]] = []
    for recipe in nj.JAX_RECIPES:
        for m, k in GPU_QUANT if gpu else CPU_QUANT:
            x = spread_values(rng, (m, k), -40.0, 10.0)
            d = float(f32(np.abs(x).max() / 2688 * np.exp2(rng.uniform(-3, 3))))
            out.append((f"quantize/{recipe}", f"{m}x{k}",
                        lambda r=recipe, x=x, d=d: _quantize_check(r, x, d)))
            out.append((f"quantize/{recipe}", f"{m}x{k} amax",
                        lambda r=recipe, x=x: _quantize_check(r, x, None)))
    backends = ["xla"]
    if not gpu or cc >= 89:  # Pallas-Triton (interpreted on CPU; E4M3 converts need sm_89+)
        backends.insert(0, "pallas")
    if cc == 90:
        backends.insert(1, "mosaic")
    if not gpu or cc >= 90:  # tt.dot_scaled: FP4 MMA on SM 12.x, Triton's decomposition elsewhere
        backends.insert(-1, "fp4mma")
    for backend in backends:
        for mode in ("w4a4",) if backend == "fp4mma" else ("w4a16", "w4a4"):
            for m, n, k in GPU_GEMM if gpu else CPU_GEMM:
                if backend == "mosaic" and (m > 64 or k % 256):
                    continue  # outside the Mosaic kernel's shapes (matmul would fall back)
                out.append((f"matmul/{backend}/{mode}", f"{m}x{n}x{k}",
                            lambda b=backend, a4=mode == "w4a4", s=int(rng.integers(2**31)),
                            m=m, n=n, k=k: _matmul_check(b, a4, np.random.default_rng(s), m, n, k)))
    paths = ["pallas-triton", "xla"] if (not gpu or cc >= 89) else ["xla"]
    if cc == 90:
        paths.insert(1, "mosaic")
    for path in paths:
        for t, h, i, e, k, act, mode in GPU_MOE if gpu else CPU_MOE:
            if path == "mosaic" and h % 256:
                continue
            out.append((f"moe/{path}/{mode}/{act}", f"T{t} H{h} I{i} E{e} k{k}",
                        lambda p=path, md=mode, a=act, s=int(rng.integers(2**31)),
                        sh=(t, h, i, e, k): _moe_check(p, md, a, np.random.default_rng(s), *sh)))
    return out


def run(*, seed: int = 0, out_dir: str = "nvfp4-selftest-failures", only: tuple[str, ...] = (),
        progress: Callable[[Check], None] | None = None) -> tuple[dict, list[Check]]:
    """Run every check of :func:`plan` (those whose kernel starts with one of ``only``, if
    given). Returns (device info, checks)."""
    info = device_info()
    cc = info["compute_capability"]
    if cc is not None:  # GeForce RTX 50xx is missing from JAX 0.11's Pallas-Triton GPU table
        from .gemm.api import register_sm12x_device_kinds

        register_sm12x_device_kinds()
    checks = []
    for kernel, shape, fn in plan(cc, seed):
        if only and not kernel.startswith(only):
            continue
        c = _timed(kernel, shape, fn, out_dir)
        checks.append(c)
        if progress is not None:
            progress(c)
    return info, checks


def verdicts(checks: list[Check]) -> dict[str, str]:
    """PASS or FAIL per kernel (FAIL when any of its shapes failed)."""
    out: dict[str, str] = {}
    for c in checks:
        out[c.kernel] = FAIL if FAIL in (out.get(c.kernel), c.status) else PASS
    return out


def format_check(c: Check) -> str:
    npz = f"  -> {c.npz}" if c.npz else ""
    return f"{c.status:4}  {c.kernel:36} {c.shape:22} {c.seconds:7.2f}s  {c.detail}{npz}"


def to_json(info: dict, checks: list[Check]) -> str:
    v = verdicts(checks)
    return json.dumps({"device": info, "verdict": FAIL if FAIL in v.values() else PASS,
                       "kernels": v, "checks": [dataclasses.asdict(c) for c in checks]}, indent=1)
