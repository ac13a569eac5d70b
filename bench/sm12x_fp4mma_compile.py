"""Compile the FP4-MMA W4A4 kernel (nvfp4_jax/gemm/fp4mma.py) for sm_120a, sm_121a and sm_90a
without a GPU of that kind, and count the block-scaled FP4 MMAs in the SASS.

The kernel is lowered by JAX to Triton IR for CUDA (no GPU needed: the TTIR is
architecture-neutral), then compiled, not run, by each Triton compiler found here:

* ``xla``: the Triton that XLA bundles, through ``jax._src.lib.triton.compile`` (present with a
  jax CUDA plugin on jax <= 0.10.x, also on a machine without a GPU); PTX, then ``ptxas
  -arch=sm_XXa``;
* ``pip``: the pip ``triton`` package (``triton.compile`` on the TTIR text).

SASS comes from ``cuobjdump -sass`` (the one shipped with pip triton when there is one: it
decodes sm_121a from Triton 3.7 on). Counted: ``OMMA`` with ``E2M1.E2M1.UE4M3.4X`` (NVFP4
block-scaled MMA, ``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X``), ``HMMA``
(bf16/fp16 mma.sync), ``HGMMA`` (wgmma), in the whole kernel and in its main loop
(``sm12x_compile.main_loop_stats``). Usage: ``python bench/sm12x_fp4mma_compile.py --out DIR``
-> ``DIR/gemm-fp4mma-sm12x-compile.json``; ``--moe``: the routed MoE's grouped FC1/FC2 kernels
on the FP4 MMA (``MoEConfig.mma="fp4"``, default tiles) for sm_120a and sm_121a: every distinct
kernel ``sm12x_compile.MOE_LAYERS`` x ``MOE_FP4_TOKENS`` picks, once, with the T it serves ->
``DIR/moe-fp4mma-sm12x-compile.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
from run_meta import run_metadata
from sm12x_compile import MOE_LAYERS, capture_moe_ttir, lowered_kernels, main_loop_stats

ARCHS = (120, 121, 90)
#: shared memory one block may use on SM 12.x (99 KiB; sm_90 allows 227 KiB)
SM12X_SMEM = 99 * 1024
FP4_MMA = re.compile(r"\bOMMA\.SF\.\S*E2M1\.E2M1\.UE4M3\.4X\b")
PTX_FP4_MMA = "kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3"


def capture_ttir(m=16, n=256, k=512, config=None):
    """Lower one ``gemm_fp4mma`` call for CUDA; return (ttir_text, bytecode, warps, stages)."""
    from nvfp4_jax.gemm.fp4mma import default_config, gemm_fp4mma

    cfg = config or default_config(m)
    args = (
        jnp.zeros((m, k // 2), jnp.uint8),
        jnp.zeros((m, k // 16), jnp.float8_e4m3fn),
        jnp.zeros((n, k // 2), jnp.uint8),
        jnp.zeros((n, k // 16), jnp.float8_e4m3fn),
        jnp.float32(1.0),
    )
    mods = lowered_kernels(lambda *a: gemm_fp4mma(*a, config=cfg), *args, bytecode=True)
    if len(mods) != 1:
        raise RuntimeError(f"expected one Triton module, captured {len(mods)}")
    [(text, bc)] = mods.values()
    return text, bc, cfg.num_warps, cfg.num_stages


def _pip_triton_bin():
    try:
        import triton
    except ImportError:
        return None
    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return p if os.path.isdir(p) else None


def _tool(name):
    """Prefer pip triton's copy (ptxas and cuobjdump of one CUDA release), then PATH."""
    b = _pip_triton_bin()
    cands = [os.path.join(b, name)] if b else []
    cands += [shutil.which(name), f"/usr/local/cuda/bin/{name}"]
    for c in cands:
        if c and os.path.exists(c):
            return c
    return None


def sass_counts(cubin: bytes, workdir: str, tag: str) -> dict:
    path = os.path.join(workdir, f"{tag}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    cuobjdump = _tool("cuobjdump")
    if cuobjdump is None:
        return {"error": "cuobjdump not found"}
    r = subprocess.run([cuobjdump, "-sass", path], check=False, capture_output=True, text=True)
    sass = r.stdout
    if r.returncode != 0 or "Function" not in sass:
        return {"error": f"cuobjdump failed: {(r.stderr or sass)[-300:]}"}
    ops = re.findall(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[\w.]+)?)", sass, re.MULTILINE
    )
    head = lambda o: o.split(".", 1)[0]
    return {
        "n_instructions": len(ops),
        "FP4_MMA": sum(1 for o in ops if FP4_MMA.fullmatch(o)),
        "OMMA": sum(1 for o in ops if head(o) == "OMMA"),
        "QMMA": sum(1 for o in ops if head(o) == "QMMA"),
        "HMMA": sum(1 for o in ops if head(o) == "HMMA"),
        "HGMMA": sum(1 for o in ops if head(o) == "HGMMA"),
        "mma_forms": sorted({o for o in ops if "MMA" in head(o)}),
        "main_loop": main_loop_stats(sass),
    }


def _ptx_stats(ptx: str) -> dict:
    target = re.search(r"\.target\s+(\S+)", ptx)
    return {
        "ptx_target": target.group(1) if target else None,
        "ptx_fp4_mma": ptx.count(PTX_FP4_MMA),
        "ptx_mma_sync": ptx.count("mma.sync"),
        "ptx_wgmma": ptx.count("wgmma.mma_async"),
    }


def xla_compiler():
    """XLA's bundled Triton (``jax._src.lib.triton.compile``), or None with the reason."""
    try:
        from jax._src.lib import triton as jt
    except ImportError as e:
        return None, f"jax._src.lib.triton unavailable: {e}"
    if not hasattr(jt, "compile"):
        return None, f"jax {jax.__version__}: jax._src.lib.triton has no compile()"
    if not jt.has_compilation_handler("cuda"):
        try:
            from jax._src import xla_bridge

            xla_bridge.discover_pjrt_plugins()
        except Exception as e:  # noqa: BLE001 - plugin discovery is best effort here
            return None, f"no CUDA plugin: {e!r}"[:300]
    if not jt.has_compilation_handler("cuda"):
        return None, "no Triton compilation handler for CUDA (jax CUDA plugin not installed)"
    return jt, None


def compile_xla(jt, bytecode, warps, stages, cc, workdir) -> dict:
    arch = f"{cc // 10}.{cc % 10}"
    try:
        res = jt.compile("cuda", bytecode, arch, num_warps=warps, num_ctas=1, num_stages=stages)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the JSON records each failure
        return {"error": f"XLA Triton compile({arch}) failed: {repr(e)[:600]}"}
    ptx = res.asm if isinstance(res.asm, str) else res.asm.decode()
    out = {**_ptx_stats(ptx), "smem_bytes": getattr(res, "smem_bytes", None)}
    ptxas = _tool("ptxas")
    if ptxas is None:
        return {**out, "error": "ptxas not found"}
    ptx_path = os.path.join(workdir, f"xla_sm{cc}.ptx")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    cubin_path = ptx_path[:-4] + ".cubin"
    r = subprocess.run([ptxas, f"-arch=sm_{cc}a", "-o", cubin_path, ptx_path],
                       check=False, capture_output=True, text=True)
    if r.returncode != 0:
        return {**out, "error": f"ptxas sm_{cc}a failed: {r.stderr[-400:]}"}
    with open(cubin_path, "rb") as f:
        out.update(sass_counts(f.read(), workdir, f"xla_sm{cc}"))
    return out


def compile_pip(ttir_text, warps, stages, cc, workdir) -> dict:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        return {"error": f"pip triton unavailable: {e}"}
    path = os.path.join(workdir, f"kernel_sm{cc}.ttir")
    with open(path, "w") as f:
        f.write(ttir_text)
    try:
        ck = triton.compile(path, target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": warps, "num_stages": stages})
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"triton": triton.__version__,
                "error": f"triton {triton.__version__} compile sm_{cc} failed: {repr(e)[:400]}"}
    out = {"triton": triton.__version__, **_ptx_stats(ck.asm.get("ptx", "")),
           "smem_bytes": getattr(ck.metadata, "shared", None)}
    out.update(sass_counts(ck.asm["cubin"], workdir, f"pip_sm{cc}"))
    return out


def pip_triton_version() -> tuple[int, int] | None:
    try:
        import triton
    except ImportError:
        return None
    return tuple(int(p) for p in triton.__version__.split(".")[:2])


def check(summary: dict) -> tuple[int, list[str]]:
    """Verdict on a :func:`run` summary: (builds checked, problems).

    sm_120a and sm_121a builds must hold the NVFP4 block-scaled MMA (``OMMA ... E2M1.E2M1.UE4M3
    .4X``, and no other MMA); sm_90a builds the same TTIR decomposed (bf16 ``HGMMA``). pip Triton
    < 3.8 has no sm_121 native path (PR #10010) and no NVFP4 decomposition (PR #9772): with it
    only sm_120a is checked. A build whose SASS cannot be read (old cuobjdump) is a problem too.
    """
    pip = summary.get("pip_triton") and pip_triton_version()
    problems, checked = [], 0
    for entry in summary["kernels"]:
        for prefix in ("xla", "pip"):
            if f"{prefix}_sm120" not in entry:
                continue
            full = prefix == "xla" or (pip is not None and pip >= (3, 8))
            for cc in (120, 121, 90) if full else (120,):
                r, tag = entry[f"{prefix}_sm{cc}"], f"{entry['shape']} {prefix} sm_{cc}a"
                checked += 1
                if "error" in r:
                    problems.append(f"{tag}: {r['error']}")
                elif r["ptx_target"] != f"sm_{cc}a":
                    problems.append(f"{tag}: PTX target {r['ptx_target']}")
                elif cc != 90 and not (r["FP4_MMA"] > 0 and r["FP4_MMA"] == r["OMMA"]
                                       and r["HMMA"] == r["HGMMA"] == r["QMMA"] == 0):
                    problems.append(f"{tag}: MMAs {r['mma_forms']}, want only the FP4 OMMA")
                elif cc != 90 and (r.get("smem_bytes") or 0) > SM12X_SMEM:
                    problems.append(f"{tag}: {r['smem_bytes']} B shared memory > {SM12X_SMEM}")
                elif cc == 90 and not (r["FP4_MMA"] == 0 and r["HGMMA"] > 0):
                    problems.append(f"{tag}: MMAs {r['mma_forms']}, want the bf16 HGMMA")
    return checked, problems


def run(out_dir: str | None = None, shapes=((16, 256, 512),)) -> dict:
    """Compile ``gemm_fp4mma`` at each (M, N, K) with its default tile for every arch and
    compiler found; the summary carries :func:`check`'s verdict (``fp4_mma_ok``)."""
    from nvfp4_jax.gemm.fp4mma import default_config

    summary = {"jax": jax.__version__, "kernels": []}
    try:
        import triton

        summary["pip_triton"] = triton.__version__
    except ImportError:
        summary["pip_triton"] = None
    if summary["pip_triton"] is None:
        summary["pip_triton_missing"] = "pip triton not importable"
    jt, why = xla_compiler()
    summary["xla_triton"] = "available" if jt is not None else why
    with tempfile.TemporaryDirectory() as wd:
        for m, n, k in shapes:
            text, bc, warps, stages = capture_ttir(m, n, k)
            entry = {
                "shape": [m, n, k],
                "config": dataclasses.asdict(default_config(m)),
                "ttir_dot_scaled": [
                    ln.strip() for ln in text.splitlines() if "tt.dot_scaled" in ln
                ],
            }
            for cc in ARCHS:
                if jt is not None:
                    entry[f"xla_sm{cc}"] = compile_xla(jt, bc, warps, stages, cc, wd)
                if summary["pip_triton"] is not None:
                    entry[f"pip_sm{cc}"] = compile_pip(text, warps, stages, cc, wd)
            summary["kernels"].append(entry)
            print(json.dumps(entry), flush=True)
    checked, problems = check(summary)
    summary["checked_builds"], summary["problems"] = checked, problems
    summary["fp4_mma_ok"] = checked > 0 and not problems
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gemm-fp4mma-sm12x-compile.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def check_moe(entries: list[dict]) -> tuple[int, list[str]]:
    """(builds checked, problems): every sm_120a/sm_121a build of an FP4 MoE kernel holds only
    the FP4 OMMA (no HMMA/QMMA), and its K loop holds ``omma_per_warp_iteration`` of them per
    iteration: in the SASS main loop, or, where the compiler unrolled the whole K loop (a
    static trip count: pip Triton 3.8 at a few steps), ``k_steps`` times that in the kernel.
    Sets each build's ``k_loop`` ("loop" or "unrolled"). pip Triton < 3.8 builds only sm_120a
    (no sm_121 native path before PR #10010): its sm_121a failure is not counted."""
    pip = pip_triton_version()
    problems, checked = [], 0
    for entry in entries:
        for prefix in ("xla", "pip"):
            for cc in (120, 121):
                r = entry.get(f"{prefix}_sm{cc}")
                if r is None or (prefix == "pip" and cc == 121 and (pip or (0,)) < (3, 8)):
                    continue
                tag = f"{entry['kernel']} {prefix} sm_{cc}a"
                checked += 1
                if "error" in r:
                    problems.append(f"{tag}: {r['error']}")
                    continue
                per_step = entry["omma_per_warp_iteration"]
                in_loop = ((r.get("main_loop") or {}).get("opcodes") or {}).get("OMMA", 0)
                unrolled = in_loop == 0 and r["FP4_MMA"] == per_step * entry["k_steps"]
                r["k_loop"] = "loop" if in_loop else "unrolled" if unrolled else None
                if not (r["FP4_MMA"] > 0 and r["FP4_MMA"] == r["OMMA"]
                        and r["HMMA"] == r["HGMMA"] == r["QMMA"] == 0):
                    problems.append(f"{tag}: MMAs {r['mma_forms']}, want only the FP4 OMMA")
                elif in_loop != per_step and not unrolled:
                    problems.append(f"{tag}: {in_loop} OMMA in the main loop, {r['FP4_MMA']} in "
                                    f"all; want {per_step} per K step ({entry['k_steps']} steps)")
                elif (r.get("smem_bytes") or 0) > SM12X_SMEM:
                    problems.append(f"{tag}: {r['smem_bytes']} B shared memory > {SM12X_SMEM}")
    return checked, problems


#: T of the MoE rows bench/sm12x_model.py predicts (its ``MOE_TOKENS``): decode (T <= 64)
#: and prefill. ``moe_run`` compiles each distinct kernel their default tiles pick once.
MOE_FP4_TOKENS = (1, 8, 16, 64, 4096)


def moe_kernel_plan(layer: dict, tokens=MOE_FP4_TOKENS) -> list[dict]:
    """The distinct FP4 grouped-GEMM kernels one MoE layer's default configs
    (``MoEConfig.mma="fp4"``) pick over ``tokens``: [{"gemm", "config" (a ``Config``),
    "moe_config" (the ``MoEConfig`` of the first T), "T" (the smallest T it serves: the one it
    is compiled at), "tokens" (every T it serves)}], in order of T, FC1 before FC2. The kernels
    of one tile differ across T only in row-count constants of their TTIR (strides of the
    routed-row buffers); their sm_120a SASS has the same instruction counts at every T."""
    from nvfp4_jax.moe.configs import default_config

    plan: dict = {}
    for t in sorted(tokens):
        cfg = default_config(t * layer["top_k"], layer["experts"], inter=layer["inter"],
                             hidden=layer["hidden"], gated=layer["gated"], mma="fp4")
        for gemm, c in (("fc1", cfg.fc1), ("fc2", cfg.fc2)):
            if (gemm, c) in plan:
                plan[(gemm, c)]["tokens"].append(t)
            else:
                plan[(gemm, c)] = {"gemm": gemm, "config": c, "moe_config": cfg, "T": t,
                                   "tokens": [t]}
    return sorted(plan.values(), key=lambda p: (p["T"], p["gemm"]))


def moe_run(out_dir: str | None = None, layers=None, tokens=MOE_FP4_TOKENS) -> dict:
    """Compile the FP4 MoE's grouped FC1/FC2 kernels (default tiles with ``mma="fp4"``) for
    sm_120a and sm_121a with every Triton compiler found; count OMMA in each kernel and in its
    main loop (per warp and iteration: one ``dot_scaled`` of a BN x BM x BK tile is
    (BN/16)(BM/8)(BK/64) m16n8k64 MMAs over the CTA's warps). Each distinct (layer, GEMM,
    tiles) of :func:`moe_kernel_plan` is compiled once, at the smallest T it serves, named
    ``moe_fp4_<gemm>_<layer>_T<T>``; its ``tokens`` lists every T of ``tokens`` it serves.
    Writes ``moe-fp4mma-sm12x-compile.json`` (run_meta header) to ``out_dir`` when given."""
    summary = {**run_metadata(), "pip_triton": None, "moe_tokens": sorted(tokens), "kernels": []}
    try:
        import triton

        summary["pip_triton"] = triton.__version__
    except ImportError:
        pass
    jt, why = xla_compiler()
    summary["xla_triton"] = "available" if jt is not None else why
    with tempfile.TemporaryDirectory() as wd:
        for lname, layer in (layers or MOE_LAYERS).items():
            plan = moe_kernel_plan(layer, tokens)
            for t in sorted({p["T"] for p in plan}):
                here = [p for p in plan if p["T"] == t]
                mods = capture_moe_ttir(layer, t, here[0]["moe_config"], bytecode=True)
                for p in here:
                    gemm, c = p["gemm"], p["config"]
                    tiles = 2 if gemm == "fc1" and layer["gated"] else 1
                    k_dim = layer["hidden"] if gemm == "fc1" else layer["inter"]
                    entry = {"kernel": f"moe_fp4_{gemm}_{lname}_T{t}", "tokens": p["tokens"],
                             "config": dataclasses.asdict(c), "weight_tiles": tiles,
                             "k_steps": -(-k_dim // c.block_k),
                             "omma_per_warp_iteration": tiles * (c.block_n // 16)
                             * (c.block_m // 8) * (c.block_k // 64) // c.num_warps}
                    mod = mods.get(f"nvfp4_moe_{gemm}")
                    if mod is None:
                        entry["error"] = f"no nvfp4_moe_{gemm} kernel lowered (got {sorted(mods)})"
                        summary["kernels"].append(entry)
                        continue
                    text, bc = mod
                    entry["ttir_dot_scaled"] = sum("tt.dot_scaled" in ln for ln in text.splitlines())
                    for cc in (120, 121):
                        if jt is not None:
                            entry[f"xla_sm{cc}"] = compile_xla(jt, bc, c.num_warps, c.num_stages,
                                                               cc, wd)
                        if summary["pip_triton"] is not None:
                            entry[f"pip_sm{cc}"] = compile_pip(text, c.num_warps, c.num_stages,
                                                               cc, wd)
                    summary["kernels"].append(entry)
                    print(json.dumps({k: v for k, v in entry.items() if k != "config"})[:600],
                          flush=True)
    checked, problems = check_moe(summary["kernels"])
    summary["checked_builds"], summary["problems"] = checked, problems
    summary["fp4_mma_ok"] = checked > 0 and not problems
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "moe-fp4mma-sm12x-compile.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--moe", action="store_true",
                   help="compile the FP4 MoE kernels instead (moe-fp4mma-sm12x-compile.json)")
    a = p.parse_args()
    if a.moe:
        s = moe_run(a.out)
        for e in s["kernels"]:
            for key in sorted(k for k in e if k.startswith(("xla_", "pip_"))):
                v = e[key]
                loop = v.get("main_loop") or {}
                print(e["kernel"], key, v.get("error") or {
                    "FP4_MMA": v.get("FP4_MMA"), "HMMA": v.get("HMMA"), "k_loop": v.get("k_loop"),
                    "loop_OMMA": loop.get("opcodes", {}).get("OMMA"),
                    "loop_instructions": loop.get("n_instructions")})
        print(f"fp4_mma_ok {s['fp4_mma_ok']} ({s['checked_builds']} builds checked)")
        for line in s["problems"]:
            print("problem:", line)
        sys.exit(0)
    s = run(a.out, shapes=((16, 256, 512), (1, 4096, 4096), (64, 4096, 4096), (512, 4096, 4096)))
    for e in s["kernels"]:
        for key in sorted(k for k in e if k.startswith(("xla_", "pip_"))):
            v = e[key]
            print(key, v.get("error") or {x: v.get(x) for x in ("FP4_MMA", "HMMA", "HGMMA")})
    print(f"fp4_mma_ok {s['fp4_mma_ok']} ({s['checked_builds']} builds checked)")
    for line in s["problems"]:
        print("problem:", line)
