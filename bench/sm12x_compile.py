"""Compile the NVFP4 GEMM kernel's Triton IR for SM 12.x (RTX 50xx / RTX PRO, GB10) on any
CUDA machine and check that the SASS uses tensor-core MMA (HMMA).

Nothing here runs on an SM12x GPU: the kernel is lowered by JAX on the local GPU (TTIR is
architecture-neutral), then compiled, not run, for sm_120a and sm_121a (and sm_90a for
reference) two ways:

* ``jaxlib``: the Triton bundled in jaxlib (``jax._src.lib.triton.compile``), which is what
  Pallas uses at run time on jaxlib > 0.10.2, gives PTX; ``ptxas -arch=sm_XXXa`` makes a cubin;
* ``pip``: the pip ``triton`` package (``triton.compile`` on the TTIR text, ``GPUTarget``).

SASS comes from ``cuobjdump -sass``; we count HMMA (mma.sync), HGMMA (wgmma, sm_90a only) and
the FP8/FP4 MMAs (QMMA/OMMA), in the whole kernel and in its main loop (``main_loop_stats``: the
body of the backward branch that holds the MMAs), and from the main loop the warp-instructions
issued per weight (``per_weight``), which ``bench/sm12x_model.py`` sets against each GPU's
issue rate. Usage: ``python bench/sm12x_compile.py --out DIR`` -> ``DIR/gemm-sm12x-compile.json``.
``--attention``, ``--routing``, ``--operand`` and ``--norm-router`` compile the decode
attention's kernels, the MoE routing kernel, the W4A4 prologue and the MoE norm-router kernel
instead (``DIR/attention-sm12x-compile.json``, ``DIR/routing-sm12x-compile.json``,
``DIR/operand-sm12x-compile.json``, ``DIR/norm-router-sm12x-compile.json``).

No GPU is needed: without one the kernel is lowered for CUDA from the CPU
(``lowering_platforms=("cuda",)``) and compiled by the pip ``triton`` package, whose wheel
ships ptxas and cuobjdump (that cuobjdump cannot decode sm_121a; the PyPI packages
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` bring one that can, found first on PATH):
    pip install --target /tmp/sass triton==3.6.0 nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    PYTHONPATH=$PWD:/tmp/sass PATH=/tmp/sass/nvidia/cu13/bin:$PATH python bench/sm12x_compile.py
"""

from __future__ import annotations

import argparse
import io
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

ARCHS = (90, 120, 121)


def capture_ttir(m=16, n=4096, k=4096, config=None):
    """Lower one ``matmul_pallas`` call; return [(ttir_text, bytecode, num_warps, num_stages)]."""
    from nvfp4_jax.gemm.pallas_triton import Config, matmul_pallas

    cfg = config or Config(
        block_m=16, block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3
    )
    mods = lowered_kernels(lambda x, c, s: matmul_pallas(x, c, s, 1.0, config=cfg),
                           jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((n, k // 2), jnp.uint8),
                           jnp.zeros((n, k // 16), jnp.float8_e4m3fn), bytecode=True)
    return [(t, b, cfg.num_warps, cfg.num_stages) for t, b in mods.values()]


def _tool(name):
    for cand in [shutil.which(name), f"/usr/local/cuda/bin/{name}"]:
        if cand and os.path.exists(cand):
            return cand
    try:
        import triton

        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.exists(p):
            return p
    except ImportError:
        pass
    return None


_INSN = re.compile(
    r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[\w.]+)?)([^;]*);"
)
_LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):")
_TARGET = re.compile(r"`\((\.L_\w+)\)|\b0x([0-9a-f]+)\s*$")
MMA_OPS = ("HMMA", "HGMMA", "QMMA", "OMMA", "IMMA")


def parse_sass(sass: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """([(address, opcode, operands)], {label: address}) of one ``cuobjdump -sass`` kernel."""
    insns, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = _LABEL.match(line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _INSN.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            insns.append((addr, m.group(2), m.group(4)))
    return insns, labels


def main_loop_stats(sass: str) -> dict | None:
    """The main loop of a kernel's SASS: of the loops (a branch back to an earlier label or
    address; the body is every instruction from there to the branch), the one with the most
    MMA instructions (ties: the longest). Returns its instruction count, its MMAs, global and
    shared loads, and opcode counts; None if the kernel has no loop."""
    insns, labels = parse_sass(sass)
    best = None
    for addr, op, args in insns:
        if op not in ("BRA", "JMP"):
            continue
        t = _TARGET.search(args.split("&")[0].split("?")[0].strip())  # drop scoreboard notes
        if not t:
            continue
        start = labels.get(t.group(1), -1) if t.group(1) else int(t.group(2), 16)
        if not 0 <= start < addr:
            continue  # a forward branch, or a branch to itself (the kernel's trailing trap)
        body = [o for a, o, _ in insns if start <= a <= addr]
        key = (sum(o in MMA_OPS for o in body), len(body))
        if best is None or key > best[0]:
            best = (key, body)
    if best is None:
        return None
    body = best[1]
    ops: dict[str, int] = {}
    for o in body:
        ops[o] = ops.get(o, 0) + 1
    return {
        "n_instructions": len(body),
        "mma": sum(ops.get(o, 0) for o in MMA_OPS),
        "global_loads": ops.get("LDG", 0) + ops.get("LDGSTS", 0),
        "shared_loads": ops.get("LDS", 0) + ops.get("LDSM", 0),
        "opcodes": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
    }


def per_weight(loop: dict | None, config, weight_tiles: int = 1) -> dict | None:
    """Warp-instructions issued per weight by the main loop of a swap-AB GEMM kernel: one
    iteration runs the loop body once in each of ``num_warps`` warps over ``weight_tiles``
    weight tiles of ``block_n x block_k`` (for up to ``block_m`` tokens; more tokens re-run it
    per token tile). ``weight_tiles``: 2 for the MoE's gated FC1 (up and gate rows)."""
    if not loop:
        return None
    weights = weight_tiles * config.block_n * config.block_k
    return {
        "weights_per_iteration": weights,
        "num_warps": config.num_warps,
        "tokens_per_iteration": config.block_m,
        "warp_instructions_per_weight": loop["n_instructions"] * config.num_warps / weights,
        "mma_per_weight": loop["mma"] * config.num_warps / weights,
    }


#: per-SM limits that set how many CTAs of a kernel are resident at once (CUDA C++ Programming
#: Guide, technical specifications per compute capability: 9.0 has 228 KB of shared memory per
#: SM, 227 KB per block and 2048 threads per SM; 12.x has 100 KB per SM, 99 KB per block and
#: 1536 threads per SM; both 64 K registers and 32 blocks per SM). Not measured here.
SM_LIMITS = {
    90: {"regs": 65536, "smem_sm": 228 * 1024, "smem_block": 227 * 1024, "threads": 2048,
         "ctas": 32},
    120: {"regs": 65536, "smem_sm": 100 * 1024, "smem_block": 99 * 1024, "threads": 1536,
          "ctas": 32},
}
#: shared memory the CUDA runtime reserves per resident CTA (compute capability >= 8.0)
SMEM_RESERVED_PER_CTA = 1024


def occupancy(regs: int | None, smem: int | None, num_warps: int, cc: int) -> dict | None:
    """Resident CTAs per SM and warps per scheduler (4 per SM) of a kernel with ``regs``
    registers per thread and ``smem`` bytes of shared memory per CTA on compute capability
    ``cc`` (90, 120, 121). ``fits``: False where the CTA's shared memory exceeds the per-block
    limit (the launch fails). Registers are allocated per warp in units of 256."""
    if regs is None or smem is None:
        return None
    lim = SM_LIMITS[90 if cc < 100 else 120]
    per_warp = -(-regs * 32 // 256) * 256
    by = {
        "registers": lim["regs"] // (per_warp * num_warps),
        "shared memory": lim["smem_sm"] // (smem + SMEM_RESERVED_PER_CTA),
        "threads": lim["threads"] // (num_warps * 32),
        "CTAs": lim["ctas"],
    }
    ctas = min(by.values())
    return {"fits": smem <= lim["smem_block"], "ctas_per_sm": ctas,
            "warps_per_scheduler": ctas * num_warps / 4,
            "limited_by": min(by, key=by.get)}


#: main-loop opcodes by what they do in the decode GEMM (the rest: "other")
OPCODE_GROUPS = {
    "bit ops (LOP3, SHF, PRMT)": ("LOP3", "SHF", "PRMT"),
    "bf16x2 scale multiply (HMUL2, HFMA2)": ("HMUL2", "HFMA2"),
    "scale conversion (F2FP, HADD2, FMUL)": ("F2FP", "HADD2", "FMUL"),
    "integer (IMAD, IADD, LEA, ...)": ("IMAD", "IADD", "IADD3", "VIADD", "LEA", "UIADD3", "ULEA",
                                       "ISETP", "UISETP", "SEL", "USEL", "UMOV", "USHF",
                                       "USGXT", "PLOP3"),
    "register moves (MOV)": ("MOV",),
    "loads (LDS, LDSM, LDGSTS, LDG)": ("LDS", "LDSM", "LDGSTS", "LDG"),
    "MMA (HMMA, HGMMA, WARPGROUP)": ("HMMA", "HGMMA", "WARPGROUP"),
    "accumulate (FADD)": ("FADD",),
}


def budget_by_source(loop: dict | None, config) -> dict | None:
    """Main-loop instructions per weight per lane (one thread's share of a ``block_n x
    block_k`` step: ``block_n * block_k / (32 * num_warps)`` weights), total and by
    ``OPCODE_GROUPS``."""
    if not loop:
        return None
    per_lane = config.block_n * config.block_k / (32 * config.num_warps)
    groups = dict.fromkeys([*OPCODE_GROUPS, "other"], 0)
    for op, n in loop["opcodes"].items():
        g = next((g for g, ops in OPCODE_GROUPS.items() if op in ops), "other")
        groups[g] += n
    return {"total": loop["n_instructions"] / per_lane,
            **{g: n / per_lane for g, n in groups.items()}}


def sass_stats(cubin: bytes, workdir: str, tag: str) -> dict:
    path = os.path.join(workdir, f"{tag}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    cuobjdump = _tool("cuobjdump")
    if cuobjdump is None:
        return {"error": "cuobjdump not found"}
    r = subprocess.run([cuobjdump, "-sass", path], check=False, capture_output=True, text=True)
    sass = r.stdout
    if r.returncode != 0 or not sass:
        return {"error": f"cuobjdump failed: {r.stderr[-300:]}"}
    ops = re.findall(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[\w.]+)?", sass, re.MULTILINE
    )
    count = lambda pfx: sum(1 for o in ops if o == pfx)
    arch = re.search(r"arch = (sm_\w+)", sass)
    res = subprocess.run([cuobjdump, "-res-usage", path], check=False, capture_output=True,
                         text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    return {
        "arch": arch.group(1) if arch else None,
        "n_instructions": len(ops),
        "HMMA": count("HMMA"),
        "HGMMA": count("HGMMA"),
        "QMMA": count("QMMA"),
        "OMMA": count("OMMA"),
        "PRMT": count("PRMT"),
        "LOP3": count("LOP3"),
        "regs_per_thread": int(regs.group(1)) if regs else None,
        "main_loop": main_loop_stats(sass),
    }


def compile_jaxlib(bytecode, num_warps, num_stages, cc, workdir) -> dict:
    try:
        from jax._src.lib import triton as jt
    except ImportError as e:
        return {"error": f"jaxlib triton unavailable: {e}"}
    arch = f"{cc // 10}.{cc % 10}"
    try:
        res = jt.compile(
            "cuda", bytecode, arch, num_warps=num_warps, num_ctas=1, num_stages=num_stages
        )
    except Exception as e:  # noqa: BLE001
        return {"error": f"jaxlib triton.compile({arch}) failed: {repr(e)[:400]}"}
    ptx = res.asm if isinstance(res.asm, str) else res.asm.decode()
    target = re.search(r"\.target\s+(\S+)", ptx)
    out = {
        "ptx_target": target.group(1) if target else None,
        "ptx_mma_sync": ptx.count("mma.sync"),
        "ptx_wgmma": ptx.count("wgmma.mma_async"),
        "smem_bytes": getattr(res, "smem_bytes", None),
    }
    ptxas = _tool("ptxas")
    if ptxas is None:
        out["error"] = "ptxas not found"
        return out
    ptx_path = os.path.join(workdir, f"jaxlib_sm{cc}.ptx")
    with open(ptx_path, "w") as f:
        # ptxas needs the arch-specific target for wgmma / sm_12x features
        f.write(re.sub(r"\.target\s+sm_(\d+)\b(?!a)", r".target sm_\1a", ptx))
    cubin_path = ptx_path[:-4] + ".cubin"
    r = subprocess.run(
        [ptxas, f"-arch=sm_{cc}a", "-o", cubin_path, ptx_path],
        check=False,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        out["error"] = f"ptxas sm_{cc}a failed: {r.stderr[-400:]}"
        return out
    with open(cubin_path, "rb") as f:
        out.update(sass_stats(f.read(), workdir, f"jaxlib_sm{cc}"))
    out["ptxas"] = (
        subprocess.run([ptxas, "--version"], check=False, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1:]
    )
    return out


def compile_pip(ttir_text, num_warps, num_stages, cc, workdir) -> dict:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        return {"error": f"pip triton unavailable: {e}"}
    path = os.path.join(workdir, f"kernel_sm{cc}.ttir")
    with open(path, "w") as f:
        f.write(ttir_text)
    try:
        ck = triton.compile(
            path,
            target=GPUTarget("cuda", cc, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    except Exception as e:  # noqa: BLE001
        return {"error": f"triton {triton.__version__} compile sm_{cc} failed: {repr(e)[:600]}"}
    out = {"triton": triton.__version__}
    ptx = ck.asm.get("ptx", "")
    target = re.search(r"\.target\s+(\S+)", ptx)
    out.update(
        ptx_target=target.group(1) if target else None,
        ptx_mma_sync=ptx.count("mma.sync"),
        ptx_wgmma=ptx.count("wgmma.mma_async"),
    )
    out["smem_bytes"] = ck.metadata.shared
    out.update(sass_stats(ck.asm["cubin"], workdir, f"pip_sm{cc}"))
    return out


#: MoE layers (moe_bench's shapes) and token counts whose grouped-GEMM kernels are compiled
#: with the library's default tiles: decode (<= 16 rows per expert) and prefill
MOE_LAYERS = {
    "qwen3_30b": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "gated": True},
    "nemotron": {"hidden": 1024, "inter": 2688, "experts": 512, "top_k": 22, "gated": False},
}
MOE_TOKENS = (8, 4096)


def capture_moe_ttir(layer: dict, t: int, config=None, *, bytecode: bool = False) -> dict:
    """{kernel name: TTIR text, or (text, bytecode) with ``bytecode``} of one ``nvfp4_jax.moe``
    layer on the Pallas-Triton kernels (``backend="pallas"``, tiles ``config``: a ``MoEConfig``
    or None for the defaults), lowered for CUDA (from the CPU where there is no GPU: the
    kernels are traced for Triton, not for interpret mode, whatever the local platform)."""
    import nvfp4_jax
    from nvfp4_jax.moe import api as moe_api

    e, h, i, k = layer["experts"], layer["hidden"], layer["inter"], layer["top_k"]
    r = 2 * i if layer["gated"] else i
    fc1 = nvfp4_jax.NVFP4Array(jnp.zeros((e, r, h // 2), jnp.uint8),
                               jnp.zeros((e, r, h // 16), jnp.float8_e4m3fn),
                               jnp.ones((e,), jnp.float32), (e, r, h), "linear")
    fc2 = nvfp4_jax.NVFP4Array(jnp.zeros((e, h, i // 2), jnp.uint8),
                               jnp.zeros((e, h, i // 16), jnp.float8_e4m3fn),
                               jnp.ones((e,), jnp.float32), (e, h, i), "linear")
    s = jnp.ones((e,), jnp.float32)

    def layer_fn(x, ids, w, fc1, fc2):
        return nvfp4_jax.moe(x, fc1=fc1, fc2=fc2, fc1_input_scale=s, fc2_input_scale=s,
                             topk_ids=ids, topk_weights=w,
                             activation="swiglu" if layer["gated"] else "relu2",
                             backend="pallas", config=config)

    args = (jnp.zeros((t, h), jnp.bfloat16), jnp.zeros((t, k), jnp.int32),
            jnp.full((t, k), 1.0 / k, jnp.float32), fc1, fc2)
    interpret = moe_api.pallas_interpret
    moe_api.pallas_interpret = lambda: False
    try:
        return lowered_kernels(layer_fn, *args, bytecode=bytecode)
    finally:
        moe_api.pallas_interpret = interpret


def lowered_kernels(fn, *args, bytecode: bool = False) -> dict:
    """{kernel name (its ``tt.func``): TTIR text, or (text, MLIR bytecode) with ``bytecode``}
    of every Pallas-Triton kernel of ``jax.jit(fn)(*args)``, lowered for CUDA (from the CPU
    where there is no GPU: the TTIR does not depend on the GPU)."""
    from jax._src.pallas.triton import lowering

    got, orig = {}, lowering.lower_jaxpr_to_triton_module

    def spy(*a, **kw):
        res = orig(*a, **kw)
        text = res.module.operation.get_asm()
        name = re.search(r"tt\.func (?:public )?@(\w+)", text)
        name = name.group(1) if name else "kernel"
        if name in got:  # a second kernel of one name keeps its own entry
            name = f"{name}#{len(got)}"
        if bytecode:
            buf = io.BytesIO()
            res.module.operation.write_bytecode(buf)
            got[name] = (text, buf.getvalue())
        else:
            got[name] = text
        return res

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        f = jax.jit(fn)
        if jax.default_backend() == "gpu":
            f.lower(*args)
        else:
            f.trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = orig
    return got


def moe_entries(workdir: str) -> list[dict]:
    """SASS counts of the MoE's grouped FC1 and FC2 kernels (pip Triton; sm_90a, sm_120a,
    sm_121a) at ``MOE_LAYERS`` x ``MOE_TOKENS``, with the library's default tiles."""
    from nvfp4_jax.moe.configs import default_config

    out = []
    for lname, layer in MOE_LAYERS.items():
        for t in MOE_TOKENS:
            cfg = default_config(t * layer["top_k"], layer["experts"], inter=layer["inter"],
                                 hidden=layer["hidden"], gated=layer["gated"])
            ttirs = capture_moe_ttir(layer, t)
            for gemm, c, tiles in (("fc1", cfg.fc1, 2 if layer["gated"] else 1),
                                   ("fc2", cfg.fc2, 1)):
                ttir = ttirs.get(f"nvfp4_moe_{gemm}")
                entry = {"kernel": f"moe_{gemm}_{lname}_T{t}", "decode": c.decode,
                         "config": c.__dict__, "moe": {"layer": lname, "T": t, "gemm": gemm,
                                                       "weight_tiles": tiles}}
                if ttir is None:
                    entry["error"] = f"no nvfp4_moe_{gemm} kernel lowered (got {sorted(ttirs)})"
                    out.append(entry)
                    continue
                for cc in ARCHS:
                    res = compile_pip(ttir, c.num_warps, c.num_stages, cc, workdir)
                    pw = per_weight(res.get("main_loop"), c, tiles)
                    if pw:
                        res["per_weight"] = pw
                    entry[f"pip_sm{cc}"] = res
                out.append(entry)
                print(json.dumps({k: v for k, v in entry.items() if k != "config"})[:400],
                      flush=True)
    return out


#: (N, K) and M of the GEMM rows whose library configs are compiled (gemm_bench's proxy shapes)
LIBRARY_SHAPES = ((28672, 8192), (4096, 14336), (14336, 4096), (4096, 4096))
LIBRARY_MS = (1, 16, 64, 256)


def library_configs() -> list:
    """[(name, Config, (M, N, K))]: each distinct config ``configs.get_config`` picks for the
    Pallas-Triton GEMM at ``LIBRARY_SHAPES`` x ``LIBRARY_MS``, for the SM12x family (what an
    SM12x user runs) and the sm90 family (what the H200 proxy runs measured)."""
    from nvfp4_jax.gemm import configs

    seen, out = set(), []
    for fam in ("sm12x", "sm90"):
        for n, k in LIBRARY_SHAPES:
            for m in LIBRARY_MS:
                c = configs.get_config(m, n, k, family=fam)
                key = tuple(sorted(c.__dict__.items()))
                if key in seen:
                    continue
                seen.add(key)
                out.append((f"library_{fam}_m{m}_{n}x{k}", c, (m, n, k)))
    return out


VARIANT_ARCHS = (90, 120)


def variant_entry(label: str, c, workdir: str, shape=(16, 4096, 4096)) -> dict:
    """One GEMM config compiled by pip Triton for sm_90a and sm_120a: main-loop instructions,
    per weight per lane by source, registers, shared memory and occupancy per arch."""
    [(ttir, _, nw, ns)] = capture_ttir(*shape, config=c)
    entry = {"label": label, "config": {k: v for k, v in c.__dict__.items() if k != "measured"}}
    for cc in VARIANT_ARCHS:
        r = compile_pip(ttir, nw, ns, cc, workdir)
        loop = r.get("main_loop")
        entry[f"sm{cc}"] = {
            "error": r.get("error"),
            "main_loop_instructions": loop and loop["n_instructions"],
            "per_weight_per_lane": budget_by_source(loop, c),
            "opcodes": loop and loop["opcodes"],
            "regs_per_thread": r.get("regs_per_thread"),
            "smem_bytes": r.get("smem_bytes"),
            "occupancy": occupancy(r.get("regs_per_thread"), r.get("smem_bytes"), nw, cc),
        }
    return entry


def variants_table(entries: list[dict]) -> str:
    """Markdown: one row per config, sm_90a and sm_120a side by side."""
    head = ("| config | decode | sm_90a instr/step | per weight/lane | regs | smem KB | CTAs/SM "
            "(warps/sched) | sm_120a instr/step | per weight/lane | regs | smem KB | CTAs/SM "
            "(warps/sched) |")
    rows = [head, "|" + "---|" * 12]
    for e in entries:
        c = e["config"]
        cells = [f"{e['label']}: m{c['block_m']} n{c['block_n']} k{c['block_k']} "
                 f"s{c['split_k']} w{c['num_warps']} st{c['num_stages']}", c["decode"]]
        for cc in VARIANT_ARCHS:
            a = e[f"sm{cc}"]
            occ, pw = a["occupancy"], a["per_weight_per_lane"]
            if a["error"] or not pw:
                cells += [f"error: {(a['error'] or 'no loop')[:60]}", "", "", "", ""]
                continue
            fit = "" if occ["fits"] else " DOES NOT FIT"
            cells += [str(a["main_loop_instructions"]), f"{pw['total']:.2f}",
                      str(a["regs_per_thread"]), f"{a['smem_bytes'] / 1024:.0f}{fit}",
                      f"{occ['ctas_per_sm']} ({occ['warps_per_scheduler']:g}, "
                      f"{occ['limited_by']})"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def run_variants(out_dir: str, candidates: list) -> dict:
    """``--variants``: compile each (label, Config) of ``candidates`` -> OUT/
    gemm-decode-variants.json and .md (sm_90a and sm_120a main loops side by side)."""
    from run_meta import run_metadata

    os.makedirs(out_dir, exist_ok=True)
    doc = {**run_metadata(), "sm_limits": SM_LIMITS, "entries": []}
    seen = set()
    with tempfile.TemporaryDirectory() as wd:
        for label, c in candidates:
            key = tuple(sorted((k, v) for k, v in c.__dict__.items() if k != "measured"))
            if key in seen or c.algo != "fused":
                continue
            seen.add(key)
            doc["entries"].append(variant_entry(label, c, wd))
            e = doc["entries"][-1]
            print(label, {cc: (e[f"sm{cc}"]["main_loop_instructions"],
                               e[f"sm{cc}"]["regs_per_thread"], e[f"sm{cc}"]["smem_bytes"],
                               e[f"sm{cc}"]["occupancy"]) for cc in VARIANT_ARCHS}, flush=True)
    with open(os.path.join(out_dir, "gemm-decode-variants.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out_dir, "gemm-decode-variants.md"), "w") as f:
        f.write("Main loop of the Pallas-Triton GEMM per config, compiled (not run) by pip "
                f"Triton {doc.get('pip_triton', '')} from the CPU (bench/sm12x_compile.py "
                "--variants). instr/step: warp-instructions per warp per K step; per "
                "weight/lane: that over the weights one thread decodes per step; CTAs/SM "
                "from registers, shared memory and threads (SM_LIMITS).\n\n")
        f.write(variants_table(doc["entries"]))
    return doc


def attention_entries(workdir: str) -> list[dict]:
    """The decoders' one-token attention, ``attention.decode_qkv_attention``'s kernels (the
    chunks from the q/k/v projection, the combine; and the combine writing o_proj's W4A4
    operand) at
    Qwen3-30B-A3B's heads (32 / 4, head_dim 128, q/k RMSNorm read from 48-layer stacks as the
    decoders' scan passes them, RoPE, batch 1, 1060 cache slots), compiled by pip triton per
    arch."""
    from nvfp4_jax import attention

    qkv = jnp.zeros((1, 40 * 128), jnp.bfloat16)
    kv = jnp.zeros((48, 1, 1060, 4, 128), jnp.bfloat16)
    norm = jnp.ones((48, 128), jnp.bfloat16)
    rope = (jnp.ones((1, 128), jnp.float32), jnp.zeros((1, 128), jnp.float32))
    scales = jnp.ones((48,), jnp.float32)
    kernels = {}
    for operand in (None, (scales, jnp.int32(3), 8)):  # and with o_proj's W4A4 operand
        kernels.update(lowered_kernels(
            lambda a, k, v, operand=operand: attention.decode_qkv_attention(
                a, k, v, jnp.int32(0), jnp.int32(5), num_heads=32, q_norm=norm, k_norm=norm,
                norm_layer=jnp.int32(0), rope=rope, w4a4_operand=operand),
            qkv, kv, kv))
    # decode_attention's own chunks (on a q already normed and rotated; its combine is the same)
    kernels.update(lowered_kernels(
        lambda q, k, v: attention.decode_attention(q, k, v, jnp.int32(0), jnp.full((1,), 6)),
        jnp.zeros((1, 32, 128), jnp.bfloat16), kv, kv))
    # num_stages: 2 for the chunks, 1 for the combines
    return compiled_entries(kernels, 4, lambda name: 2 if name in (
        "nvfp4_decode_qkv_attention", "nvfp4_decode_attention") else 1, workdir)


def compiled_entries(kernels: dict, num_warps: int, num_stages, workdir: str) -> list[dict]:
    """One entry per captured kernel (name -> TTIR): its TTIR ops and its pip-Triton compile
    for each of ``ARCHS``; ``num_stages(name)`` gives the kernel's stages."""
    entries = []
    for name, ttir in kernels.items():
        ns = num_stages(name)
        entry = {"kernel": name, "num_warps": num_warps, "num_stages": ns,
                 "ttir_ops": sorted(set(re.findall(r"\btt\.\w+", ttir)))}
        for cc in ARCHS:
            entry[f"pip_sm{cc}"] = compile_pip(ttir, num_warps, ns, cc, workdir)
        entries.append(entry)
        print(json.dumps(entry), flush=True)
    return entries


def routing_entries(workdir: str) -> list[dict]:
    """``moe.select_kernel`` at Qwen3-30B-A3B's router (T = 8 tokens, 128 experts, top-8,
    H 2048, renormalized: one program per token, one warp), and the routing-operand launch
    that follows it at batch 1 (``routing_kernel.routing_operand_kernel``: 8 routes, block_m
    8, the scales read in place from 48-layer [L, E] stacks, the trtllm recipe; eight warps),
    compiled by pip triton per arch."""
    from nvfp4_jax.moe.routing_kernel import routing_operand_kernel
    from nvfp4_jax.moe.select_kernel import select_kernel

    lg = jnp.zeros((8, 128), jnp.float32)
    x = jnp.zeros((8, 2048), jnp.bfloat16)
    kernels = lowered_kernels(lambda a, b: select_kernel(a, b, 8, renormalize=True), lg, x)
    entries = compiled_entries(kernels, 1, lambda name: 1, workdir)
    ids = jnp.zeros((1, 8), jnp.int32)
    st = jnp.ones((48, 128), jnp.float32)
    kernels = lowered_kernels(
        lambda i, h, a, b, c, d: routing_operand_kernel(
            i, h, 128, 8, (a, b, c, d, "trtllm_cutlass", "scalar"), recipe="trtllm",
            layer=jnp.int32(3)), ids, x[:1], st, st, st, st)
    return entries + compiled_entries(kernels, 8, lambda name: 1, workdir)


def operand_entries(workdir: str) -> list[dict]:
    """``gemm.operand.mosaic_w4a4_operand``, the W4A4 prologue SM 12.x also runs before the
    Mosaic GEMM at M <= 64: RMSNorm'd at Qwen3-30B-A3B's K 2048 and Llama-3-8B's 4096 (layer
    read in place from 48-layer stacks, one program a row), and plain at Llama's down_proj K
    14336 (a stack of 32 input_scales); batch 1, compiled by pip triton per arch."""
    from nvfp4_jax.gemm import mosaic
    from nvfp4_jax.gemm.operand import mosaic_w4a4_operand

    entries = []
    for tag, k, layers, norm in (("norm_k2048", 2048, 48, True), ("norm_k4096", 4096, 32, True),
                                 ("plain_k14336", 14336, 32, False)):
        x = jnp.zeros((1, k), jnp.bfloat16)
        s = jnp.ones((layers,), jnp.float32)
        w = jnp.ones((layers, k), jnp.bfloat16)
        kernels = lowered_kernels(
            lambda a, b, c, norm=norm: mosaic_w4a4_operand(
                a, b, mosaic.token_tile(1), layer=jnp.int32(3),
                norm_weight=c if norm else None), x, s, w)
        nw = 8 if norm and k > 4096 else 4  # as mosaic_w4a4_operand picks: 8 above 4096 values
        for e in compiled_entries(kernels, nw, lambda name: 1, workdir):
            entries.append({"case": tag, "k": k, **e})
    return entries


def norm_router_entries(workdir: str) -> list[dict]:
    """``moe.norm_router.norm_router_kernel``, a MoE layer's RMSNorm and router logits (and
    with the residual add), at Qwen3-30B-A3B's H 2048 and 128 experts (norm weight and router
    read in place from 48-layer stacks) for batch 1 and 8, compiled by pip triton per arch."""
    from nvfp4_jax.moe import norm_router as nr

    entries = []
    for t in (1, 8):
        x = jnp.zeros((t, 2048), jnp.bfloat16)
        w = jnp.ones((48, 2048), jnp.bfloat16)
        r = jnp.zeros((48, 128, 2048), jnp.bfloat16)
        kernels = {}
        for res in (None, x):  # and with the residual add (the decoders' add_norm_router)
            kernels.update(lowered_kernels(
                lambda a, b, c, res=res: nr.norm_router_kernel(a, b, c, 1e-6, layer=jnp.int32(3),
                                                               residual=res), x, w, r))
        eb = nr.expert_block(t, 128)
        for e in compiled_entries(kernels, nr.num_warps(eb, 2048), lambda name: 1, workdir):
            entries.append({"case": f"t{t}_h2048_e128", "experts_per_program": eb, **e})
    return entries


def lowered_for() -> str:
    """How :func:`lowered_kernels` lowered: for CUDA on the local GPU, or from the CPU."""
    on_cpu = jax.default_backend() != "gpu"
    return "cuda" + (" (from the CPU: lowering_platforms)" if on_cpu else "")


def pip_triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def run(out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    from run_meta import run_metadata

    summary = {**run_metadata(), "device": jax.devices()[0].device_kind,
               "lowered_for": lowered_for(),
               "kernels": []}
    summary["pip_triton"] = pip_triton_version()
    from nvfp4_jax.gemm.pallas_triton import Config

    kernels = {
        "w4a16_small_m": Config(16, 64, 256, 1, 4, 3),
        "w4a16_large_m": Config(128, 128, 64, 1, 8, 3),
    }
    runs = [(name, Config(**{**cfg.__dict__, "decode": d}), None)
            for name, cfg in kernels.items() for d in ("asm", "bits")]
    runs += library_configs()
    with tempfile.TemporaryDirectory() as wd:
        for name, c, shape in runs:
            if c.algo != "fused":
                continue  # dequantize + cuBLAS: no GEMM kernel of ours
            m, n, k = shape or (16, 4096, 4096)
            [(ttir, bc, nw, ns)] = capture_ttir(m, n, k, config=c)
            entry = {
                "kernel": name,
                "decode": c.decode,
                "config": c.__dict__,
                "shape_mnk": [m, n, k],
                "ttir_ops": sorted(set(re.findall(r"\btt\.\w+", ttir))),
            }
            if name == "w4a16_small_m" and c.decode == "asm":
                with open(os.path.join(out_dir, "gemm-w4a16-small-m.ttir"), "w") as f:
                    f.write(ttir)
            for cc in ARCHS:
                entry[f"jaxlib_sm{cc}"] = compile_jaxlib(bc, nw, ns, cc, wd)
                entry[f"pip_sm{cc}"] = compile_pip(ttir, nw, ns, cc, wd)
                for side in ("jaxlib", "pip"):
                    pw = per_weight(entry[f"{side}_sm{cc}"].get("main_loop"), c)
                    if pw:
                        entry[f"{side}_sm{cc}"]["per_weight"] = pw
            summary["kernels"].append(entry)
            print(json.dumps(entry), flush=True)
        summary["kernels"] += moe_entries(wd)
    ok = [
        k
        for k in summary["kernels"]
        if all(
            k.get(f"{p}_sm{cc}", {}).get("HMMA", 0) > 0 for cc in (120, 121) for p in ("jaxlib",)
        )
        or all(k.get(f"pip_sm{cc}", {}).get("HMMA", 0) > 0 for cc in (120, 121))
    ]
    summary["sm12x_hmma_ok"] = bool(ok)
    with open(os.path.join(out_dir, "gemm-sm12x-compile.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--variants", action="store_true",
                   help="compile gemm_bench's candidate configs (sweep_candidates) for sm_90a "
                   "and sm_120a -> OUT/gemm-decode-variants.{json,md}")
    p.add_argument("--attention", action="store_true",
                   help="compile attention.decode_qkv_attention's kernels for sm_90a, sm_120a, "
                   "sm_121a -> OUT/attention-sm12x-compile.json")
    p.add_argument("--routing", action="store_true",
                   help="compile moe.select_kernel for sm_90a, sm_120a, sm_121a -> "
                   "OUT/routing-sm12x-compile.json")
    p.add_argument("--operand", action="store_true",
                   help="compile gemm.operand.mosaic_w4a4_operand (the W4A4 prologue) for "
                   "sm_90a, sm_120a, sm_121a -> OUT/operand-sm12x-compile.json")
    p.add_argument("--norm-router", action="store_true",
                   help="compile moe.norm_router's kernel (a MoE layer's RMSNorm and router "
                   "logits) for sm_90a, sm_120a, sm_121a -> OUT/norm-router-sm12x-compile.json")
    a = p.parse_args()
    for flag, entries, fname in ((a.norm_router, norm_router_entries, "norm-router"),
                                 (a.attention, attention_entries, "attention"),
                                 (a.routing, routing_entries, "routing"),
                                 (a.operand, operand_entries, "operand")):
        if not flag:
            continue
        from run_meta import run_metadata

        with tempfile.TemporaryDirectory() as wd:
            doc = {**run_metadata(), "lowered_for": lowered_for(), "kernels": entries(wd)}
        doc["pip_triton"] = pip_triton_version()
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{fname}-sm12x-compile.json"), "w") as f:
            json.dump(doc, f, indent=1)
    if a.attention or a.routing or a.operand or a.norm_router:
        sys.exit(0)
    if a.variants:
        from gemm_bench import all_sweep_candidates

        run_variants(a.out, all_sweep_candidates())
        sys.exit(0)
    s = run(a.out)
    print("sm12x_hmma_ok", s["sm12x_hmma_ok"])
