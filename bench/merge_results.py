"""Merge a new benchmark JSON into the committed one: new records replace old ones with the same
key, old records without a new counterpart are kept (each record keeps its own commit and date).

Usage: python bench/merge_results.py {gemm|moe} OLD.json NEW.json OUT.json [--note T] [--no-plot]
Top-level metadata (date, commit, gpu, versions, timing) comes from NEW; the PNG named after OUT
(gemm-h200.json -> gemm-h200.png) is redrawn from the merged records unless --no-plot (the
proxy files have no PNG). ``measured`` gives the rows a resumed run (``--resume`` of
gemm_bench.py and moe_bench.py) skips.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KEYS = {"gemm": ("impl", "N", "K", "M"), "moe": ("impl", "shape", "routing", "T")}


def measured(kind: str, path: str, stem: str) -> set[tuple]:
    """Keys (``KEYS[kind]``) of the records in the JSON at ``path`` (a directory: its
    ``<stem>.json``) that hold a measurement (``median_us``): the rows a resumed run skips."""
    if os.path.isdir(path):
        path = os.path.join(path, stem + ".json")
    if not os.path.isfile(path):
        raise SystemExit(f"--resume: expected a results JSON (or a directory holding {stem}.json), "
                         f"found no file {path}")
    with open(path) as f:
        records = json.load(f)["records"]
    return {tuple(r.get(k) for k in KEYS[kind]) for r in records if "median_us" in r}


def merge(kind: str, old: dict, new: dict) -> dict:
    """New records replace old ones with the same key; an ``hbm_copy`` record is keyed by its
    commit too, so that rows kept from an older run keep the copy rate of their own run."""
    def key(r: dict) -> tuple:
        keys = (*KEYS[kind], "commit") if r.get("impl") == "hbm_copy" else KEYS[kind]
        return tuple(r.get(k) for k in keys)

    def stamped(doc: dict, records: list[dict]) -> list[dict]:
        """``records`` with ``doc``'s run commit, date and timing harness where a record lacks
        its own: each record keeps those of its own run (the merged top level is NEW's). A MoE
        run without a "harness" entry gave all layers the same global scales (moe_bench.py's
        docstring); a GEMM run's timing note names the loop structure (gemm_bench.py's)."""
        stamp = {"commit": doc.get("commit"), "date": doc.get("date")}
        if kind == "moe":
            stamp["harness"] = doc.get("harness", "shared global scales")
        else:
            stamp["timing"] = doc.get("timing", "")
        return [{**r, **{k: v for k, v in stamp.items() if k not in r}} for r in records]

    fresh = stamped(new, new["records"])
    seen = {key(r) for r in fresh}
    if kind == "moe":  # the tables show one weight-scale layout per row: never mix them
        layouts = {key(r): r.get("scale_layout") for r in old["records"] if r.get("scale_layout")}
        for r in fresh:
            if r.get("scale_layout") and layouts.get(key(r), r["scale_layout"]) != r["scale_layout"]:
                raise SystemExit(f"merge_results: {key(r)} was measured with {layouts[key(r)]} "
                                 f"weight scales, the new run with {r['scale_layout']}; keep it apart")
    kept = stamped(old, [r for r in old["records"] if key(r) not in seen])
    return {**{k: v for k, v in new.items() if k != "records"}, "records": fresh + kept}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=sorted(KEYS))
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("out")
    p.add_argument("--note", default="")
    p.add_argument("--no-plot", action="store_true",
                   help="write no PNG (the proxy runs draw none); else OUT's name with .png")
    a = p.parse_args()
    with open(a.old) as f:
        old = json.load(f)
    with open(a.new) as f:
        new = json.load(f)
    doc = merge(a.kind, old, new)
    if a.note:
        doc["note"] = a.note
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    if not a.no_plot:  # named after OUT: gemm-h200.json -> gemm-h200.png
        if a.kind == "gemm":
            import gemm_bench as bench_mod
        else:
            import moe_bench as bench_mod

        bench_mod.plot(doc["records"], os.path.splitext(os.path.abspath(a.out))[0] + ".png")
    print(f"{a.out}: {len(doc['records'])} records ({len(new['records'])} new)")


if __name__ == "__main__":
    main()
