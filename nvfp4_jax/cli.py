"""The ``nvfp4`` command line.

``nvfp4 audit [--checkpoint DIR] [--json FILE] [--plot FILE] [--experts N] [--tokens LIST]
[--top-k K] [--seed S] [--no-progress]``: the scale-folding audit (``nvfp4_jax.audit``). With no
checkpoint it audits a synthetic MoE layer shaped like Nemotron Super's layer 1.

``nvfp4 crosscheck [--cases N] [--seed S] [--m M] [--n N] [--k K] [--backends LIST]
[--ops LIST] [--inputs FILE.npz] [--json FILE]``: every quantize, GEMM and MoE backend
against the oracle on the same inputs (``nvfp4_jax.crosscheck``); exit code 1 when one fails.

``nvfp4 explain FILE.npz [--out-key KEY] [--out-dtype DTYPE] [--splits S] [--json FILE]`` or
``nvfp4 explain --demo FAULT [--save FILE.npz]``: where a GEMM output is wrong and which known
fault reproduces it (``nvfp4_jax.explain``); exit code 1 when the output is wrong.

``nvfp4 --version``. Bad input (an option out of its range, a damaged checkpoint or ``.npz``, a
checkpoint with nothing to audit) is refused before any work with one line on stderr and exit
code 2: no option is silently replaced, no traceback is shown.

``nvfp4 selftest [--json FILE] [--out-dir DIR] [--only LIST] [--seed S] [--full] [--fuzz N]
[--jobs N]``:
every kernel this device runs against the oracle (``nvfp4_jax.selftest``); exit code 1 when one
fails.

``nvfp4 generate --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
[--json FILE]``: generate with a ModelOpt NVFP4 export (``nvfp4_jax.models.command``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time


def _tokens(s: str) -> tuple[int, ...]:
    try:
        t = tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--tokens: expected comma-separated ints, got {s!r}") from exc
    if not t or min(t) < 1:
        raise argparse.ArgumentTypeError(f"--tokens: expected positive ints, got {s!r}")
    return t


def _int_at_least(lo: int, what: str):
    """argparse type: an int >= lo (refused, never replaced, outside the range)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            msg = f"expected an integer >= {lo} ({what}), got {s!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo} ({what}), got {v}")
        return v

    return parse


def version() -> str:
    """The installed distribution's version (importlib.metadata), else ``nvfp4_jax.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("nvfp4-jax")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def _writable(path: str | None, option: str) -> str | None:
    """Why ``path`` cannot be written (checked before a long run), or None."""
    if path is None:
        return None
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        return f"{option} {path}: directory {d} does not exist"
    if os.path.isdir(path) or not os.access(d, os.W_OK):
        return f"{option} {path}: cannot write there"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvfp4", description="NVFP4 tools from nvfp4-jax")
    p.add_argument("--version", action="version", version=f"nvfp4 (nvfp4-jax) {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit", help="scale-folding audit of a ModelOpt NVFP4 checkpoint (TRT-LLM #21461)",
        description="Measure what folding weight_scale_2 into E4M3 block scales does to each NVFP4 "
                    "layer, and the MoE output error of each semantics against the exact oracle. "
                    "Without --checkpoint: a synthetic MoE layer shaped like Nemotron Super's layer 1.")
    a.add_argument("--checkpoint", metavar="DIR", help="ModelOpt NVFP4 checkpoint (safetensors + hf_quant_config.json)")
    a.add_argument("--json", metavar="FILE", help="write the report as JSON")
    a.add_argument("--plot", metavar="FILE", help="write a PNG: scale error against scale magnitude, MoE error against T")
    a.add_argument("--experts", type=_int_at_least(1, "experts per MoE layer"), metavar="N",
                   help="experts per MoE layer to evaluate, the first N (default 24 of the "
                        "synthetic layer's 512, at most 512; 64 for a checkpoint)")
    a.add_argument("--tokens", type=_tokens, default=None, metavar="LIST",
                   help="token counts T (default 1,2,4,8,17,64)")
    a.add_argument("--top-k", type=_int_at_least(1, "experts per token"), default=None, metavar="K",
                   help="experts per token, 1 to the experts evaluated (default 22 for the "
                        "synthetic layer; for a checkpoint config.json's num_experts_per_tok, "
                        "else 8)")
    a.add_argument("--seed", type=_int_at_least(0, "random seed"), default=0,
                   help="seed of the synthetic weights, tokens and routing (default %(default)s)")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")

    from .crosscheck import BACKENDS
    from .explain import DEMO_FAULTS, OUT_DTYPES

    c = sub.add_parser(
        "crosscheck", help="every NVFP4 quantize/GEMM/MoE backend against the oracle on the same inputs",
        description="Run the activation quantization (TensorRT-LLM linear semantics) and the W4A4 / W4A16 GEMM "
                    "through every backend available here (JAX XLA, Pallas, Mosaic; TensorRT-LLM re-enacted "
                    "and live; FlashInfer's reference) and hold each to the exact oracle: quantization byte "
                    "for byte, GEMMs within the derived fp32-accumulation bound (a failure is explained), "
                    "and a small routed MoE layer inside the interval propagated through its rounding points. "
                    "Generated cases spread the weight blocks over five decades, through E4M3's subnormals.")
    c.add_argument("--cases", type=int, default=4,
                   help="generated cases, each at its own magnitudes (default %(default)s)")
    c.add_argument("--seed", type=int, default=0,
                   help="seed of the generated cases (default %(default)s)")
    c.add_argument("--m", type=int, default=16,
                   help="rows (tokens) of a generated case (default %(default)s)")
    c.add_argument("--n", type=int, default=256,
                   help="output features of a generated case (default %(default)s)")
    c.add_argument("--k", type=int, default=512,
                   help="input features, a multiple of 16 (default %(default)s)")
    c.add_argument("--backends", default=",".join(BACKENDS), metavar="LIST",
                   help=f"comma-separated subset of {', '.join(BACKENDS)} (default: all)")
    c.add_argument("--inputs", metavar="FILE.npz",
                   help="check this W4A4 linear-layer call instead (keys x, weight_fp4, weight_sf, weight_scale_2, "
                        "input_scale; see nvfp4 explain)")
    c.add_argument("--ops", default="quantize,gemm,moe", metavar="LIST",
                   help="comma-separated subset of quantize, gemm, moe (a small routed layer, relu2 and "
                        "swiglu, trtllm_cutlass semantics, per generated case; default: all)")
    c.add_argument("--json", metavar="FILE", help="write the results as JSON")

    e = sub.add_parser(
        "explain", help="where a GEMM output is wrong, and which known fault reproduces it",
        description="Compare an NVFP4 GEMM output with the exact oracle under the derived bound; localise the wrong "
                    "outputs (rows, columns, tiles, NaN) and test known faults (alpha, scale layout, nibble order, "
                    "folded weight_scale_2, split-K partials, UE8M0 scales, ...) and single corrupted scale bytes. "
                    "FILE.npz holds either TensorRT-LLM nvfp4_gemm's operands (act_fp4, act_sf, weight_fp4, "
                    "weight_sf, alpha) or a linear layer's (x, weight_fp4, weight_sf, weight_scale_2 [, input_scale]), "
                    "scale bytes as uint8 (2-D: linear layout; 1-D: swizzled_128x4), and the output 'out' [M, N].")
    e.add_argument("file", nargs="?", metavar="FILE.npz", help="the call's operands and its output")
    e.add_argument("--out-key", default="out",
                   help="name of the output array in FILE.npz (default %(default)s)")
    e.add_argument("--out-dtype", default="bfloat16", choices=OUT_DTYPES,
                   help="the dtype the backend returned (its rounding enters the bound; "
                        "default %(default)s)")
    e.add_argument("--splits", type=int, default=1,
                   help="split-K partials the backend sums (widens the bound; default %(default)s)")
    e.add_argument("--demo", choices=DEMO_FAULTS, metavar="FAULT",
                   help=f"explain the XLA backend's output with one fault injected: {', '.join(DEMO_FAULTS)}")
    e.add_argument("--save", metavar="FILE.npz", help="with --demo: also write the demo call and output")
    e.add_argument("--json", metavar="FILE", help="write the explanation as JSON")
    t = sub.add_parser(
        "selftest", help="every NVFP4 kernel this device runs, against the exact oracle",
        description="Run quantize (every recipe), matmul (every backend, W4A16 and W4A4), moe (every "
                    "path) on fuzzed inputs with E4M3-subnormal block scales, and the decoders' decode "
                    "attention, at a spread of shapes, and hold each to the exact oracle "
                    "(nvfp4_jax.selftest). On CPU the Pallas kernels run "
                    "interpreted at small sizes. Exit code 1 when a kernel fails.")
    t.add_argument("--json", metavar="FILE", help="write the device, versions and every check as JSON")
    t.add_argument("--out-dir", default="nvfp4-selftest-failures", metavar="DIR",
                   help="where each failure's .npz goes (GEMM ones: nvfp4 explain FILE.npz reads "
                        "them; default: %(default)s)")
    t.add_argument("--only", default="", metavar="LIST",
                   help="comma-separated kernel name prefixes, e.g. quantize,matmul/pallas (default: all)")
    t.add_argument("--seed", type=int, default=0, help="the fuzzed inputs' seed (default: %(default)s)")
    t.add_argument("--full", action="store_true",
                   help="more shapes per kernel on a GPU (the default run: a few shapes chosen for "
                        "their edges, every kernel; what to run first)")
    t.add_argument("--fuzz", type=int, default=None, metavar="N",
                   help="fuzzed inputs per compiled shape (default: 3 on a GPU, 2 on CPU)")
    t.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="checks run at once on N threads, so that their compiles overlap "
                        "(default: %(default)s)")

    from .models import command as generate_command

    generate_command.add_parser(sub)
    return p


def _selftest(args) -> int:
    from . import selftest

    only = tuple(o for o in args.only.split(",") if o)
    if args.fuzz is not None and args.fuzz < 1:
        print(f"nvfp4 selftest: --fuzz expects at least 1 input per shape, got {args.fuzz}",
              file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"nvfp4 selftest: --jobs expects at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    info, checks = selftest.run(seed=args.seed, out_dir=args.out_dir, only=only, full=args.full,
                                fuzz=args.fuzz, jobs=args.jobs,
                                progress=lambda c: print(selftest.format_check(c), flush=True))
    wall = time.perf_counter() - t0
    if not checks:
        print(f"nvfp4 selftest: --only {args.only!r} selects no kernel", file=sys.stderr)
        return 2
    v = selftest.verdicts(checks)
    print(f"\n{info['device_kind']} (compute capability {info['compute_capability']}, driver "
          f"{info['driver']}), jax {info['jax']}, jaxlib {info['jaxlib']}")
    for kernel, verdict in v.items():
        print(f"{verdict:4}  {kernel}")
    t = selftest.summary(checks, wall)
    print(f"{t['checks']} checks, {t['inputs']} inputs, {t['compiles']} compiles in {wall:.0f} s "
          f"(checks' sum {t['seconds']:.0f} s, {t['compile_s']:.0f} s of it compiling)")
    if args.json:
        with open(args.json, "w") as f:
            f.write(selftest.to_json(info, checks, {"full": args.full, "fuzz": args.fuzz,
                                                    "seed": args.seed, "only": list(only),
                                                    "jobs": args.jobs}, wall))
    return 1 if selftest.FAIL in v.values() else 0


def _crosscheck(args) -> int:
    from . import crosscheck

    backends = tuple(b for b in args.backends.split(",") if b)
    unknown = sorted(set(backends) - set(crosscheck.BACKENDS))
    if unknown or not backends:
        print(f"nvfp4 crosscheck: --backends: unknown {unknown or 'empty list'}; expected some of "
              f"{', '.join(crosscheck.BACKENDS)}", file=sys.stderr)
        return 2
    ops = tuple(o for o in args.ops.split(",") if o)
    if not ops or set(ops) - set(crosscheck.OPS):
        print(f"nvfp4 crosscheck: --ops: unknown {sorted(set(ops) - set(crosscheck.OPS)) or 'empty list'}; "
              f"expected some of {', '.join(crosscheck.OPS)}", file=sys.stderr)
        return 2
    if args.cases < 1 or args.m < 1 or args.n < 1 or args.k < 16 or args.k % 16:
        print("nvfp4 crosscheck: --cases, --m, --n must be >= 1 and --k a positive multiple of 16", file=sys.stderr)
        return 2
    try:
        results = crosscheck.run(cases=args.cases, seed=args.seed, m=args.m, n=args.n, k=args.k,
                                 backends=backends, inputs=args.inputs, ops=ops)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"nvfp4 crosscheck: {exc}", file=sys.stderr)
        return 2
    print(crosscheck.format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            f.write(crosscheck.to_json(results))
    return 1 if any(r.status == "FAIL" for r in results) else 0


def _explain(args) -> int:
    from . import explain

    if (args.file is None) == (args.demo is None):
        print("nvfp4 explain: give FILE.npz or --demo FAULT (one of them)", file=sys.stderr)
        return 2
    if args.save and not args.demo:
        print("nvfp4 explain: --save goes with --demo", file=sys.stderr)
        return 2
    try:
        if args.demo:
            case = explain.demo_case()
            out = explain.demo_output(case, args.demo)
            if args.save:
                explain.save_npz(args.save, case, out)
        else:
            if args.splits < 1:
                raise ValueError(f"--splits: expected >= 1, got {args.splits}")
            case, out = explain.load_npz(args.file, out_key=args.out_key, out_dtype=args.out_dtype,
                                         splits=args.splits)
        result = explain.explain_gemm(case, out)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"nvfp4 explain: {exc}", file=sys.stderr)
        return 2
    print(result.format())
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
    return 0 if result.verdict == "correct" else 1


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _audit(audit, args) -> int:
    """``nvfp4 audit``: every option checked before the run; one line and exit 2 on bad input."""
    problems = [m for m in (_writable(args.json, "--json"), _writable(args.plot, "--plot")) if m]
    if args.checkpoint is None:
        n_all = audit.DEFAULT_SHAPE["experts"]
        n = args.experts or audit.DEFAULT_SUBSET
        k = args.top_k or audit.DEFAULT_SHAPE["top_k"]
        if n > n_all:
            problems.append(f"--experts {n}: the synthetic layer has {n_all} experts "
                            f"(expected 1..{n_all})")
        elif k > n:
            problems.append(f"--top-k {k}: expected 1..{n}, at most the experts evaluated "
                            f"(--experts {n}); give --experts >= {k} or a smaller --top-k")
    if args.plot and not _importable("matplotlib"):
        problems.append(f"--plot {args.plot}: needs matplotlib, which is not installed: "
                        "pip install 'nvfp4-jax[plot]'")
    if problems:
        for m in problems:
            print(f"nvfp4 audit: {m}", file=sys.stderr)
        return 2
    try:
        reports = audit.run(args.checkpoint, json_path=args.json, plot_path=args.plot,
                            experts=args.experts, tokens=args.tokens or audit.TOKENS,
                            top_k=args.top_k, seed=args.seed, progress=not args.no_progress)
    except (OSError, ValueError, ImportError) as exc:
        print(f"nvfp4 audit: {exc}", file=sys.stderr)
        return 2
    return 0 if reports else 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "audit":
        try:
            from . import audit
        except ImportError as exc:
            print(f"nvfp4 audit: cannot import the audit ({exc}); it needs numpy, jax, ml_dtypes "
                  "and safetensors (pip install -e .)", file=sys.stderr)
            return 2

        return _audit(audit, args)
    if args.command == "crosscheck":
        return _crosscheck(args)
    if args.command == "explain":
        return _explain(args)
    if args.command == "selftest":
        return _selftest(args)
    if args.command == "generate":
        from .models import command as generate_command

        return generate_command.run(args)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
