"""A/B of two trees of this repository on a decoder's batch-1 step: ``bench/e2e_profile.py``
run from each tree in a process of its own, arms alternated, and the per-kernel device time of
the two side by side.

Usage, here (with git): ``python bench/e2e_ab.py prepare --base REV [--arm C=REV2 ...]``
writes the tree of commit REV to ``.ab/a`` (arm A), the working tree's tracked and untracked
files to ``.ab/b`` (arm B) and each further arm's commit to its own folder (``.ab/c``), and
lists ``.ab/`` in ``.git/info/exclude``; a folder made by hand (``cp -r .ab/b .ab/c`` then an
edit) is an arm too. On the GPU machine (``.ab`` carried; no git needed): ``python3
bench/e2e_ab.py run --out $OUT [--models qwen3-30b-a3b] [--arms "A B A B"] [--steps 64]
[--arm-timeout 150] [--tiny]`` -> ``OUT/e2e-ab.json``: per model and arm each run's untraced
wall time, device-busy time and launches per step, and the kernels of the last run of each
arm; the table of the kernels by device time per step, the arms side by side, is printed.
Arms run at full depth (``--layers 0``), stacked layers, 1024 cached tokens, no XLA flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AB = os.path.join(ROOT, ".ab")


def prepare(base: str, extra: dict[str, str] | None = None) -> None:
    """``.ab/a``: the tree of commit ``base``; ``.ab/b``: the working tree (tracked and
    untracked files git does not ignore); ``extra``: {arm letter: commit}, each commit's tree
    in ``.ab/<letter>``."""
    extra = {k: subprocess.run(["git", "rev-parse", "--short", v], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.strip()
             for k, v in (extra or {}).items()}
    shutil.rmtree(AB, ignore_errors=True)
    for arm, rev in {"A": base, **extra}.items():
        os.makedirs(os.path.join(AB, arm.lower()))
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True,
                                 capture_output=True)
        subprocess.run(["tar", "-x", "-C", os.path.join(AB, arm.lower())],
                       input=archive.stdout, check=True)
    os.makedirs(os.path.join(AB, "b"))
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = os.path.join(ROOT, f)
        if os.path.isfile(src) and not f.startswith(".ab/"):
            os.makedirs(os.path.dirname(os.path.join(AB, "b", f)) or ".", exist_ok=True)
            shutil.copy2(src, os.path.join(AB, "b", f))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(AB, "arms.json"), "w") as fh:
        json.dump({"A": base, "B": head + (" with uncommitted changes" if dirty else ""),
                   **extra}, fh)
    exclude = os.path.join(ROOT, ".git", "info", "exclude")
    lines = open(exclude).read().split("\n") if os.path.exists(exclude) else []
    if "/.ab/" not in lines:
        with open(exclude, "a") as fh:
            fh.write("\n/.ab/\n")
    more = "".join(f", arm {k}: {v}" for k, v in extra.items())
    print(f"arm A: {base}, arm B: the working tree{more}, under {AB}")


def kernel_rows(arms: dict[str, list[dict] | None], top: int = 30) -> list[dict]:
    """The kernels of several ``e2e_profile`` records side by side, ``arms`` {arm: kernels}:
    ``[{name, us: {arm: us}, calls: {arm: calls}}]`` per step, by the largest device time of
    any arm first (a kernel an arm lacks: 0 there)."""
    by = {arm: {k["name"]: k for k in ks or []} for arm, ks in arms.items()}

    def get(arm, n, key):
        return by[arm][n][key] if n in by[arm] else 0.0

    names = sorted(set().union(*by.values()),
                   key=lambda n: -max(get(a, n, "us_per_step") for a in by))
    return [{"name": n, "us": {a: get(a, n, "us_per_step") for a in by},
             "calls": {a: get(a, n, "calls_per_step") for a in by}} for n in names[:top]]


def run(args) -> int:
    arms = args.arms.split()
    if not arms or not all(len(a) == 1 and a.isupper() for a in arms):
        raise SystemExit(f"--arms: expected arm letters (A B ...), got {args.arms!r}")
    order = list(dict.fromkeys(arms))
    for arm in set(arms):
        if not os.path.isfile(os.path.join(AB, arm.lower(), "bench", "e2e_profile.py")):
            raise SystemExit(f"arm {arm}: no tree under {AB}/{arm.lower()} "
                             "(python bench/e2e_ab.py prepare --base REV, then carry .ab)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONUNBUFFERED"] = "1"
    doc = {"what": "bench/e2e_profile.py --layouts scan --layers 0 per arm, each in a process "
                   "of its own, arms alternated", "arms": arms, "steps": args.steps,
           "records": {}}
    arms_file = os.path.join(AB, "arms.json")
    if os.path.exists(arms_file):  # what ``prepare`` put in each arm
        doc["arm_trees"] = json.load(open(arms_file))
    os.makedirs(args.out, exist_ok=True)
    for model in args.models.split(","):
        per = doc["records"].setdefault(model, {a: [] for a in order})
        for arm in arms:
            with tempfile.TemporaryDirectory() as d:
                cmd = [sys.executable, "bench/e2e_profile.py", "--models", model, "--layouts",
                       "scan", "--layers", "0", "--steps", str(args.steps), "--out", d]
                cmd += ["--tiny"] if args.tiny else []
                try:
                    proc = subprocess.run(cmd, cwd=os.path.join(AB, arm.lower()), env=env,
                                          capture_output=True, text=True,
                                          timeout=args.arm_timeout)
                except subprocess.TimeoutExpired:
                    print(f"{model} {arm}: over {args.arm_timeout} s", flush=True)
                    continue
                path = os.path.join(d, "e2e-profile.json")
                if proc.returncode or not os.path.exists(path):
                    print(f"{model} {arm}: rc {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
                    continue
                prof = json.load(open(path))
            doc.setdefault("meta", {k: v for k, v in prof.items() if k != "records"})
            rec = prof["records"][0]
            per[arm].append({k: rec.get(k) for k in (
                "untraced_wall_ms_per_step", "untraced_runs_ms_per_step", "host_ms_per_step",
                "wall_ms_per_step",
                "busy_ms_per_step", "copies_ms_per_step", "launches_per_step", "kernels")})
            print(f"{model} {arm}: {rec['untraced_wall_ms_per_step']:.4f} ms untraced "
                  f"(host {rec.get('host_ms_per_step') or 0:.4f}), "
                  f"{rec.get('busy_ms_per_step') or 0:.4f} busy, "
                  f"{rec.get('launches_per_step') or 0:.0f} launches per step", flush=True)
            # only the last run of each arm keeps its kernels (the file stays small)
            for r in per[arm][:-1]:
                r.pop("kernels", None)
            with open(os.path.join(args.out, "e2e-ab.json"), "w") as f:
                json.dump(doc, f, indent=1)
        done = [a for a in order if per[a]]
        if len(done) > 1:
            print(f"{model}: us per step, {' | '.join(done)}")
            for r in kernel_rows({a: per[a][-1].get("kernels") for a in done}):
                cols = " | ".join(f"{r['us'][a]:9.1f} x{r['calls'][a]:5.1f}" for a in done)
                print(f"  {cols}  {r['name'][:90]}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write the two trees under .ab (needs git)")
    p.add_argument("--base", required=True, help="arm A's commit")
    p.add_argument("--arm", action="append", default=[], metavar="C=REV",
                   help="a further arm's letter and commit (repeatable)")
    r = sub.add_parser("run", help="profile the arms (on the GPU machine)")
    r.add_argument("--out", default=os.environ.get("OUT", "."))
    r.add_argument("--models", default="qwen3-30b-a3b")
    r.add_argument("--arms", default="A B A B")
    r.add_argument("--steps", type=int, default=64)
    r.add_argument("--arm-timeout", type=float, default=150.0)
    r.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        extra = dict(a.split("=", 1) for a in args.arm)
        if any(len(k) != 1 or not k.isupper() or k in "AB" for k in extra):
            raise SystemExit(f"--arm: expected LETTER=REV with a letter past B, got {args.arm}")
        prepare(args.base, extra)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
