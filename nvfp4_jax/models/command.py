"""``nvfp4 generate``: run a ModelOpt NVFP4 export with :mod:`nvfp4_jax.models`.

``nvfp4 generate --checkpoint DIR (--prompt TEXT [--chat] | --prompt-ids 1,2,3)
[--max-new-tokens N] [--temperature T [--top-k K] [--top-p P]] [--seed S] [--backend B]
[--json FILE]``: loads the checkpoint (progress on stderr), generates, prints the text (with
the checkpoint's tokenizer, through transformers, imported only here) or the token ids, and
the prefill and decode tokens/s (compilation excluded).

``--chat``: the prompt as one user message through the tokenizer's chat template, with the
generation prompt. Generation ends at any end token: the tokenizer's ``eos_token_id`` and
every ``eos_token_id`` of the checkpoint's generation_config.json (an id or a list, as
Llama-3 and Qwen3 instruct exports list several). Sampling (``--temperature`` > 0, optionally
``--top-k`` / ``--top-p``) follows transformers' order (``models.sample``); the default is
greedy. A checkpoint's quantized KV cache is not applied (K and V stay bf16): the loader's
warning says so on stderr, and ``--json`` records it (``kv_cache``,
``checkpoint_kv_cache_quant``) with the end tokens and the sampling settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def _ids(s: str) -> list[int]:
    try:
        ids = [int(v) for v in s.split(",") if v.strip()]
    except ValueError as exc:
        msg = f"--prompt-ids: expected comma-separated ints, got {s!r}"
        raise argparse.ArgumentTypeError(msg) from exc
    if not ids or min(ids) < 0 or max(ids) >= 2**31:
        raise argparse.ArgumentTypeError(f"--prompt-ids: expected non-negative ints (below "
                                         f"2^31), got {s!r}")
    return ids


def add_parser(sub) -> None:
    """Add the ``generate`` subcommand to an argparse subparsers object."""
    g = sub.add_parser(
        "generate",
        help="generate with a ModelOpt NVFP4 checkpoint (Llama, Qwen3, Qwen3-MoE, Nemotron-H)",
        description="Load a ModelOpt NVFP4 HF export (weights stay NVFP4), run a jitted prefill "
                    "and decode loop, print the generated text or ids and prefill/decode tokens "
                    "per second.")
    g.add_argument("--checkpoint", metavar="DIR", required=True,
                   help="ModelOpt NVFP4 export directory")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT",
                     help="prompt text (needs the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, metavar="IDS", help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="default 32")
    g.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="with a temperature: sample among the K largest logits; 0 turns it "
                        "off (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with a temperature: nucleus sampling, P in (0, 1]; 1 turns it off "
                        "(default: 1.0)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--backend", default="auto", choices=("auto", "mosaic", "pallas", "xla"),
                   help="GEMM/MoE implementation (default auto)")
    g.add_argument("--json", metavar="FILE", help="write ids, text and timings as JSON")


def _tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def end_tokens(path: str, tok) -> list[int]:
    """The ids that end generation: ``tok``'s ``eos_token_id`` (None: no tokenizer) and the
    ``eos_token_id`` (an int or a list of ints) of ``path``/generation_config.json, in that
    order without repeats; a generation_config.json that is not valid JSON or holds other
    values raises ``ValueError`` naming it."""
    ids = []
    if getattr(tok, "eos_token_id", None) is not None:
        ids.append(int(tok.eos_token_id))
    gc = os.path.join(path, "generation_config.json")
    if os.path.exists(gc):
        try:
            with open(gc) as f:
                v = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{gc}: not valid JSON ({exc})") from None
        e = v.get("eos_token_id") if isinstance(v, dict) else None
        es = e if isinstance(e, list) else [] if e is None else [e]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in es):
            raise ValueError(f"{gc}: eos_token_id: expected a token id or a list of them, "
                             f"got {e!r}")
        ids += [i for i in es if i not in ids]
    return ids


def _problem(args) -> str | None:
    """What is wrong with the options (checked before the checkpoint is read), or None."""
    if args.chat and args.prompt is None:
        return "--chat: needs --prompt (a chat template turns text into ids)"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens: expected an integer >= 1, got {args.max_new_tokens}"
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return f"--temperature: expected a finite number >= 0 (0: greedy), got {args.temperature}"
    if args.top_k < 0:
        return f"--top-k: expected an integer >= 0 (0: off), got {args.top_k}"
    if not 0 < args.top_p <= 1:
        return f"--top-p: expected a number in (0, 1] (1: off), got {args.top_p}"
    if not os.path.isdir(args.checkpoint):
        return f"--checkpoint {args.checkpoint}: not a directory"
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d) or os.path.isdir(args.json) or not os.access(d, os.W_OK):
            return f"--json {args.json}: cannot write there"
    return None


def run(args) -> int:
    """Execute ``nvfp4 generate``; returns the exit code (2 for bad input)."""
    from .. import checkpoint as ckpt
    from . import generate, load_model, stderr_progress

    problem = _problem(args)
    if problem:
        print(f"nvfp4 generate: {problem}", file=sys.stderr)
        return 2
    tok = _tokenizer(args.checkpoint)
    if args.prompt is not None:
        if tok is None:
            print(f"nvfp4 generate: --prompt needs a tokenizer in {args.checkpoint!r} (and "
                  "transformers installed); pass --prompt-ids instead", file=sys.stderr)
            return 2
        if args.chat:
            if not getattr(tok, "chat_template", None):
                print(f"nvfp4 generate: --chat: the tokenizer in {args.checkpoint!r} has no "
                      "chat_template", file=sys.stderr)
                return 2
            try:
                text = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                               tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - a template's own error, reported
                print(f"nvfp4 generate: --chat: the chat template failed: {exc}",
                      file=sys.stderr)
                return 2
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(args.prompt)["input_ids"]
        if not ids:
            print(f"nvfp4 generate: --prompt {args.prompt!r} gives no tokens", file=sys.stderr)
            return 2
    else:
        ids = args.prompt_ids
    t0 = time.perf_counter()
    try:
        eos = end_tokens(args.checkpoint, tok)
        model = load_model(args.checkpoint, progress=stderr_progress)
        kv_quant = ckpt.load(args.checkpoint).kv_cache_quant
        stderr_progress(f"loaded in {time.perf_counter() - t0:.1f} s; compiling and generating")
        gen = generate(model, [ids], args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       backend=args.backend, eos_id=eos or None)
    except (OSError, KeyError, ValueError) as exc:
        print(f"nvfp4 generate: {exc}", file=sys.stderr)
        return 2
    new = [int(t) for t in gen.tokens[0]]
    end = next((i for i, t in enumerate(new) if t in eos), None)
    if end is not None:
        new = new[:end + 1]
    text = tok.decode(new, skip_special_tokens=True) if tok is not None else None
    print(text if text is not None else ",".join(map(str, new)))
    print(f"prefill: {gen.prompt_tokens} tokens, {gen.prefill_tokens_per_s:.1f} tokens/s; "
          f"decode: {gen.new_tokens} tokens, {gen.decode_tokens_per_s:.1f} tokens/s",
          file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompt_ids": list(ids), "new_ids": new, "text": text,
                       "prefill_tokens_per_s": gen.prefill_tokens_per_s,
                       "decode_tokens_per_s": gen.decode_tokens_per_s,
                       "prefill_s": gen.prefill_s, "decode_s": gen.decode_s,
                       "kv_cache": "bf16", "checkpoint_kv_cache_quant": kv_quant,
                       "eos_ids": eos, "chat": args.chat, "temperature": args.temperature,
                       "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}, f, indent=2)
    return 0
