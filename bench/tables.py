"""Markdown tables for the README from bench/results/{gemm,moe,e2e}-h200.json.

Usage: python bench/tables.py [gemm|moe|proxy|e2e] [--results DIR] [--gpu h200]
GEMM: per (N x K, M) our W4A16 (with the kernel auto chose), W4A4, bf16 jnp.dot, and the ratios
(the slower of our two against scaled_matmul and XLA dequantize-then-dot). MoE: ours vs the
bf16 ragged_dot and dequantize+ragged_dot baselines, TB/s over touched-expert NVFP4 bytes as a
fraction of the HBM copy measured in the same run (the hbm_copy record with the row's commit;
the newest one if none). A record older than the file's commit is
marked with *; ours on FC2 weights zero-padded along K (``moe_bench --pad-fc2``) with "p".
Proxy: the SM12x path (Pallas-Triton GEMM and MoE) next to bf16 and the Hopper path, from
{gemm,moe}-proxy-<gpu>.json (``gemm_bench --proxy``, ``moe_bench --proxy``).
E2E: per model and precision (``bench/e2e_bench.py``) decode tokens/s per batch, prefill
tokens/s, weight bytes and peak device memory, the batch-1 decode read rate against the HBM
copy of the same run, NVFP4's speed-up over bf16; then the per-token time breakdown.
"""

from __future__ import annotations

import argparse
import json
import os


def _kernel(r: dict) -> str:
    if (r.get("config") or {}).get("algo") == "dequant_dot":
        return "dequant+cuBLAS"
    return r.get("backend") or "pallas"


def _ratio(v: float) -> str:
    """Speed-up over a peer; a loss (< 1) in bold."""
    txt = f"{v:.1f}x" if v >= 10 else f"{v:.2f}x"
    return f"**{txt}**" if v < 1 else txt


def gemm(doc: dict) -> str:
    by = {(r["impl"], r["N"], r["K"], r["M"]): r for r in doc["records"] if "median_us" in r}
    head = doc.get("commit")
    lines = [
        ("| N x K | M | W4A16 us (kernel) | W4A4 us | bf16 dot us | vs bf16 | vs scaled_matmul "
        "| vs XLA dequant+dot | NVFP4 weight TB/s |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    shapes = sorted({(r["N"], r["K"]) for r in doc["records"]}, key=lambda s: -s[0] * s[1])
    for n, k in shapes:
        for m in sorted({r["M"] for r in doc["records"] if (r["N"], r["K"]) == (n, k)}):
            o, q, b = (by.get((i, n, k, m)) for i in ("nvfp4_w4a16", "nvfp4_w4a4", "bf16_dot"))
            if not (o and b):
                continue
            sm, xd = by.get(("scaled_matmul", n, k, m)), by.get(("xla_dequant_dot", n, k, m))
            slow = max(o["median_us"], q["median_us"] if q else 0.0)
            star = " *" if o.get("commit", head) != head else ""
            tb = o.get("weight_tbps") if m <= 64 else None
            lines.append(
                f"| {n}x{k}{star} | {m} | {o['median_us']:.1f} ({_kernel(o)}) | "
                f"{q['median_us']:.1f} | {b['median_us']:.1f} | "
                f"{b['median_us'] / o['median_us']:.2f}x | "
                + (_ratio(sm["median_us"] / slow) if sm else "-")
                + " | "
                + (_ratio(xd["median_us"] / slow) if xd else "-")
                + " | "
                + (f"{tb:.2f}" if tb else "-")
                + " |"
            )
    return "\n".join(lines)


def moe(doc: dict) -> str:
    copies = {r.get("commit"): r["tbps"] for r in reversed(doc["records"]) if r["impl"] == "hbm_copy"}
    latest = next((r["tbps"] for r in doc["records"] if r["impl"] == "hbm_copy"), None)
    by = {(r["impl"], r["shape"], r["routing"], r["T"]): r for r in doc["records"]
          if r["impl"] != "hbm_copy"}
    head = doc.get("commit")
    lines = [
        ("| shape | T | routing | ours us | TB/s (% of copy) | TFLOP/s | bf16 ragged_dot us "
        "(ours faster by) | dequant+ragged_dot us |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({k[1:] for k in by if k[0] == "nvfp4_moe"},
                  key=lambda t: (t[0] != "nemotron", t[2], t[1] != "random"))
    for shape, routing, t in keys:
        o = by[("nvfp4_moe", shape, routing, t)]
        if "median_us" not in o:
            continue
        b, d = by.get(("bf16_ragged_dot", shape, routing, t)), by.get(
            ("dequant_ragged_dot", shape, routing, t))

        def cell(r):
            if not r:
                return "-"
            if "median_us" not in r:
                return "skipped" if "skipped" in r.get("error", "") else "failed"
            return f"{r['median_us']:.0f}" + ("*" if r.get("commit", head) != head else "")

        copy = copies.get(o.get("commit"), latest)  # the copy measured in the row's own run
        tb = f"{o['tbps']:.2f} ({100 * o['tbps'] / copy:.0f} %)" if copy and t <= 512 else "-"
        ratio = (f" ({b['median_us'] / o['median_us']:.1f}x)"
                 if b and "median_us" in b else "")
        pad = " p" if o.get("fc2_padded") else ""
        lines.append(f"| {shape} | {t} | {routing} | {cell(o)}{pad} | {tb} | {o['tflops']:.1f} | "
                     f"{cell(b)}{ratio} | {cell(d)} |")
    return "\n".join(lines)


def _us(r: dict | None) -> str:
    if not r:
        return "-"
    if "median_us" not in r:
        return "skipped" if "skipped" in r.get("error", "") else "failed"
    return f"{r['median_us']:.1f}" if r["median_us"] < 100 else f"{r['median_us']:.0f}"


def _x(num: dict | None, den: dict | None) -> str:
    """``num``'s time over ``den``'s: how many times faster ``den`` runs."""
    if not (num and den and "median_us" in num and "median_us" in den):
        return "-"
    return _ratio(num["median_us"] / den["median_us"])


def proxy_gemm(doc: dict) -> str:
    """The SM12x path (``backend="pallas"``) next to bf16 ``jnp.dot`` and the Hopper path
    (``auto``), from ``gemm_bench --proxy``; ratios are speed-ups over bf16."""
    recs = doc["records"]
    by = {(r["impl"], r["N"], r["K"], r["M"]): r for r in recs}
    lines = [
        "| N x K | M | SM12x path W4A16 us | W4A4 us | vs bf16 | Hopper path us (kernel) "
        "| vs bf16 | bf16 dot us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, k in sorted({(r["N"], r["K"]) for r in recs}, key=lambda s: -s[0] * s[1]):
        for m in sorted({r["M"] for r in recs if (r["N"], r["K"]) == (n, k)}):
            p16, p4, hop, b = (by.get((i, n, k, m)) for i in (
                "nvfp4_w4a16_pallas", "nvfp4_w4a4_pallas", "nvfp4_w4a16", "bf16_dot"))
            kern = f" ({_kernel(hop)})" if hop and "median_us" in hop else ""
            lines.append(f"| {n}x{k} | {m} | {_us(p16)} | {_us(p4)} | {_x(b, p16)} | "
                         f"{_us(hop)}{kern} | {_x(b, hop)} | {_us(b)} |")
    return "\n".join(lines)


def proxy_moe(doc: dict) -> str:
    """The Pallas-Triton MoE (the SM12x path) next to the Hopper path (``nvfp4_moe``: the
    kernels ``auto`` picks here) and bf16 ``lax.ragged_dot``, from ``moe_bench --proxy``."""
    recs = [r for r in doc["records"] if r["impl"] != "hbm_copy"]
    by = {(r["impl"], r["shape"], r["routing"], r["T"]): r for r in recs}
    lines = [
        "| shape | T | SM12x path (Triton MoE) us | Hopper path us (kernel) | Triton / Hopper "
        "| bf16 ragged_dot us | vs bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["shape"], r["routing"], r["T"]) for r in recs},
                  key=lambda t: (t[0], t[1] != "random", t[2]))
    for shape, routing, t in keys:
        tri, hop, b = (by.get((i, shape, routing, t)) for i in (
            "nvfp4_moe_triton", "nvfp4_moe", "bf16_ragged_dot"))
        kern = f" ({hop.get('kernel') or '?'})" if hop and "median_us" in hop else ""
        ratio = (f"{tri['median_us'] / hop['median_us']:.2f}"
                 if tri and hop and "median_us" in tri and "median_us" in hop else "-")
        name = shape if routing == "random" else f"{shape} ({routing})"
        lines.append(f"| {name} | {t} | {_us(tri)} | {_us(hop)}{kern} | {ratio} | {_us(b)} | "
                     f"{_x(b, tri)} |")
    return "\n".join(lines)


def e2e(doc: dict) -> str:
    """``bench/e2e_bench.py`` output: one row per model and precision, then the breakdown."""
    recs = doc["records"]
    batches = doc["settings"]["batches"]
    names = list(dict.fromkeys(r["model"] for r in recs))
    by = {(r["model"], r["precision"], r["kind"], r.get("batch")): r for r in recs}
    gib = 2.0**30
    # a device's peak_bytes_in_use never resets within the process: with every model and
    # precision in a process of its own ("processes") each peak is its own, else only where it
    # exceeds every earlier model's (else "-": it may be smaller)
    own_peak, high = {}, 0
    for r in recs:
        if r["kind"] == "memory":
            peak = (r.get("after_runs") or {}).get("peak_bytes_in_use") or 0
            own = peak if ("processes" in doc or peak > high) else None
            own_peak[(r["model"], r["precision"])] = own
            high = max(high, peak)
    lines = [
        "| model | precision | " + " | ".join(f"decode b={b} tok/s" for b in batches)
        + f" | prefill {doc['settings']['prefill']} tok/s | weights GiB | own peak GiB "
        "| b=1 read TB/s (% of copy) |",
        "|---|---|" + "---|" * len(batches) + "---|---|---|---|",
    ]
    for name in names:
        for prec in ("nvfp4", "bf16"):
            mem = by.get((name, prec, "memory", None))
            if not mem:
                continue
            cells = []
            for b in batches:
                r = by.get((name, prec, "decode", b))
                cells.append(f"{r['tokens_per_s']:.1f}" if r else "-")
            pre = by.get((name, prec, "prefill", None))
            peak = own_peak.get((name, prec))
            d1 = by.get((name, prec, "decode", 1))
            read = (f"{d1['read_tbps']:.2f} ({100 * d1['read_fraction_of_copy']:.0f} %)"
                    if d1 else "-")
            lines.append(f"| {name} | {prec} | " + " | ".join(cells) + " | "
                         + (f"{pre['tokens_per_s']:.0f}" if pre else "-")
                         + f" | {mem['weight_bytes'] / gib:.2f} | "
                         + (f"{peak / gib:.1f}" if peak else "-") + f" | {read} |")
        up = doc.get("summary", {}).get(name, {})
        if any(f"decode_speedup_b{b}" in up for b in batches):
            lines.append(f"| {name} | NVFP4 / bf16 | " + " | ".join(
                _ratio(up[f"decode_speedup_b{b}"]) if f"decode_speedup_b{b}" in up else "-"
                for b in batches) + " | | | | |")
    bds = [r for r in recs if r["kind"] == "breakdown"]
    if bds:
        lines += ["", ("| model | precision | ms per token (b=1) | attention | MoE | dense "
                       "| other |"), "|---|---|---|---|---|---|---|"]
        for r in bds:
            ms = r["ms"]
            lines.append(f"| {r['model']} | {r['precision']} | {r['ms_per_step']:.2f} | "
                         + " | ".join(f"{ms[k]:.2f}" if k in ms else "-"
                                      for k in ("attention", "moe", "dense", "other")) + " |")
    if doc.get("skipped"):
        lines += ["", "skipped (out of time budget, or failed with the exit status shown): "
                  + ", ".join(doc["skipped"])]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", choices=("gemm", "moe", "proxy", "e2e"))
    p.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--gpu", default=None,
                   help="the tag of the results file (run_meta.gpu_tag): proxy: "
                   "gemm/moe-proxy-<gpu>.json (default: every one found); gemm, moe, e2e: "
                   "<which>-<gpu>.json (default h200)")
    a = p.parse_args()
    if a.which == "proxy":
        import glob

        for kind, render in (("gemm", proxy_gemm), ("moe", proxy_moe)):
            gpu = a.gpu or "*"
            paths = sorted(glob.glob(os.path.join(a.results, f"{kind}-proxy-{gpu}.json")))
            if not paths:
                print(f"({kind}-proxy-{gpu}.json: not measured yet)\n")
            for path in paths:
                with open(path) as f:
                    doc = json.load(f)
                print(f"{kind.upper()} on {doc.get('gpu')} ({doc.get('date', '?')[:10]}, commit "
                      f"{str(doc.get('commit'))[:10]}, jax {doc.get('jax')}, XLA_FLAGS "
                      f"{doc.get('xla_flags') or 'none'})\n")
                print(render(doc) + "\n")
        return
    name = f"{a.which}-{a.gpu or 'h200'}.json"
    path = os.path.join(a.results, name)
    if not os.path.exists(path):
        raise SystemExit(f"--results: no {name} in {a.results}")
    with open(path) as f:
        doc = json.load(f)
    print({"gemm": gemm, "moe": moe, "e2e": e2e}[a.which](doc))


if __name__ == "__main__":
    main()
