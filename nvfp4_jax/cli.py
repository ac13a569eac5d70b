"""The ``nvfp4`` command line.

``nvfp4 audit [--checkpoint DIR] [--json FILE] [--plot FILE] [--experts N] [--tokens LIST]
[--top-k K] [--seed S] [--no-progress]``: the scale-folding audit (``nvfp4_jax.audit``). With no
checkpoint it audits a synthetic MoE layer shaped like Nemotron Super's layer 1.
"""

from __future__ import annotations

import argparse
import sys


def _tokens(s: str) -> tuple[int, ...]:
    try:
        t = tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--tokens: expected comma-separated ints, got {s!r}") from exc
    if not t or min(t) < 1:
        raise argparse.ArgumentTypeError(f"--tokens: expected positive ints, got {s!r}")
    return t


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvfp4", description="NVFP4 tools from nvfp4-jax")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit", help="scale-folding audit of a ModelOpt NVFP4 checkpoint (TRT-LLM #21461)",
        description="Measure what folding weight_scale_2 into E4M3 block scales does to each NVFP4 "
                    "layer, and the MoE output error of each semantics against the exact oracle. "
                    "Without --checkpoint: a synthetic MoE layer shaped like Nemotron Super's layer 1.")
    a.add_argument("--checkpoint", metavar="DIR", help="ModelOpt NVFP4 checkpoint (safetensors + hf_quant_config.json)")
    a.add_argument("--json", metavar="FILE", help="write the report as JSON")
    a.add_argument("--plot", metavar="FILE", help="write a PNG: scale error against scale magnitude, MoE error against T")
    a.add_argument("--experts", type=int, metavar="N",
                   help="experts per MoE layer to evaluate (default 32 for the synthetic layer, 64 for a checkpoint)")
    a.add_argument("--tokens", type=_tokens, default=None, metavar="LIST",
                   help="token counts T (default 1,2,4,8,17,64)")
    a.add_argument("--top-k", type=int, default=None, help="experts per token (default: config.json or 8)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "audit":
        try:
            from . import audit
        except ImportError as exc:
            print(f"nvfp4 audit: needs torch for the TensorRT-LLM re-enactment ({exc}); "
                  "pip install 'nvfp4-jax[torch]'", file=sys.stderr)
            return 2

        if args.experts is not None and args.experts < 1:
            print("nvfp4 audit: --experts must be >= 1", file=sys.stderr)
            return 2
        try:
            audit.run(args.checkpoint, json_path=args.json, plot_path=args.plot, experts=args.experts,
                      tokens=args.tokens or audit.TOKENS, top_k=args.top_k, seed=args.seed,
                      progress=not args.no_progress)
        except (FileNotFoundError, ValueError) as exc:
            print(f"nvfp4 audit: {exc}", file=sys.stderr)
            return 2
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
