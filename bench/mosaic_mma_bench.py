"""The Mosaic GEMM with warp-level ``mma.sync`` (``MosaicConfig(mma="sync")``: the form SM 12.x
can run) against the same tiles with ``wgmma``, the Pallas-Triton kernel (``backend="pallas"``),
and bf16 ``jnp.dot``, W4A16, on this GPU, interleaved rounds of ``gemm_bench.make_timer``
(in-graph, one call per weight copy, copies > 4x L2).

    python bench/mosaic_mma_bench.py --out $OUT [--shapes 28672x8192,...] [--ms 1,16,64]
        [--pallas] [--sm12x [--block-ks 256] [--block-ns 128] | --sm90-tiles]

Writes ``mosaic-mma-<gpu>.json`` (``gemm_bench.candidates_sweep``'s records): per shape and M
each impl's median us, its rounds, x bf16, and its config. ``--sm12x``: instead every
one-warpgroup ``mma.sync`` form that fits SM 12.x's 99 KB per CTA (``sm12x_candidates``; what
``config_for(..., 120)`` picks among them), ``mosaic-sm12x-forms-<gpu>.json``;
``--sm90-tiles``: the wgmma tiles of ``sm90_candidates`` (shapes the sm_90 table lacks),
``mosaic-sm90-tiles-<gpu>.json``.
``bench/mosaic_sm12x.py`` dumps and assembles the kernels' PTX for SM 12.x."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm_bench as gb  # noqa: E402
from run_meta import gpu_tag  # noqa: E402

from nvfp4_jax.gemm import configs, mosaic  # noqa: E402


def mosaic_fn(cfg):
    def fn(x, w):
        return mosaic.matmul_mosaic(x, w.codes, w.scales, w.decode_scale, config=cfg)

    return fn


def candidates(pallas: bool):
    """``gemm_bench.candidates_sweep``'s candidates: the sm_90 config of (M, N, K) on wgmma
    and on mma.sync (``sync_form``), the wgmma one without overlap where it has it, and with
    ``pallas`` the Pallas-Triton kernel with its table's tiles."""

    def cands(m, n, k):
        wcfg = mosaic.config_for(m, n, k, 90)
        out = [("mosaic_wgmma", wcfg, mosaic_fn(wcfg)),
               ("mosaic_sync", wcfg.sync_form(), mosaic_fn(wcfg.sync_form()))]
        if wcfg.overlap or wcfg.consumers > 1:
            plain = dataclasses.replace(wcfg, overlap=False, consumers=1, measured="")
            out.append(("mosaic_wgmma_plain", plain, mosaic_fn(plain)))
        if pallas:
            pcfg = configs.get_config(m, n, k)
            out.append(("pallas", pcfg, gb.impl_ours_w4a16(pcfg, "pallas")))
        return out

    return cands


def sm12x_candidates(m, n, k, block_ks=mosaic.BLOCK_KS, block_ns=(64, 128)):
    """The tiles SM 12.x can run at (M, N, K) on ``mma.sync``, timed on this GPU as their proxy:
    ``config_for(m, n, k, 120)`` (what ``auto`` runs there) and the other one-warpgroup forms
    within ``SM12X_SMEM_LIMIT`` (block_n, block_k, split_k, num_stages; bf16_store at split 1),
    the wgmma config of the same shape for reference."""
    mt = mosaic.token_tile(m)
    picked = mosaic.config_for(m, n, k, 120)
    out = [("mosaic_wgmma", mosaic.config_for(m, n, k, 90)), ("mosaic_sm12x", picked)]
    forms = itertools.product(block_ns, block_ks, (1, 2, 4, 8), (2, 3, 4))
    for bn, bk, split, stages in forms:
        c = mosaic.MosaicConfig(block_n=bn, split_k=split, num_stages=stages, block_k=bk,
                                bf16_store=split == 1, mma="sync")
        if c != picked and k % (bk * split) == 0 and c.smem_bytes(mt) <= mosaic.SM12X_SMEM_LIMIT:
            out.append((f"sync_n{bn}_k{bk}_s{split}_st{stages}", c))
    return [(label, cfg, mosaic_fn(cfg)) for label, cfg in out]


def sm90_candidates(m, n, k):
    """The wgmma tiles of the sm_90 table's space at (M, N, K), for shapes the table lacks:
    ``config_for(m, n, k, 90)`` (what ``auto`` runs now) and every block_n 64 / 128 with
    split_k 1, 2, 4, 8 (a divisor of the K steps), 2 stages (the table's best almost
    everywhere), the bf16 store at split 1 (one launch fewer), and at the 8-token tile each
    also with ``overlap``."""
    mt = mosaic.token_tile(m)
    picked = mosaic.config_for(m, n, k, 90)
    out = [("mosaic_auto", picked)]
    steps = k // mosaic.BLOCK_K
    for bn, split, overlap in itertools.product((64, 128), (1, 2, 4, 8), (False, True)):
        if steps % split or (overlap and mt != 8):
            continue
        c = mosaic.MosaicConfig(block_n=bn, split_k=split, num_stages=2, bf16_store=split == 1,
                                overlap=overlap)
        if c != picked:
            out.append((f"wgmma_n{bn}_s{split}{'_ov' if overlap else ''}", c))
    return [(label, cfg, mosaic_fn(cfg)) for label, cfg in out]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--shapes", default="28672x8192,4096x14336,14336x4096")
    p.add_argument("--ms", default="1,16,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=300)
    p.add_argument("--pallas", action="store_true", help="also time backend='pallas'")
    p.add_argument("--sm12x", action="store_true",
                   help="time every one-warpgroup mma.sync form SM 12.x can run (sm12x_candidates)")
    p.add_argument("--sm90-tiles", action="store_true",
                   help="time the wgmma tiles of sm90_candidates (shapes the sm_90 table lacks)")
    p.add_argument("--block-ks", default=",".join(map(str, mosaic.BLOCK_KS)),
                   help="--sm12x: only forms with these block_k")
    p.add_argument("--block-ns", default="64,128", help="--sm12x: only forms with these block_n")
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    ms = [int(v) for v in a.ms.split(",") if v]
    name = ("mosaic-sm12x-forms" if a.sm12x else "mosaic-sm90-tiles" if a.sm90_tiles
            else "mosaic-mma")
    path = os.path.join(a.out, f"{name}-{gpu_tag(jax.devices()[0].device_kind)}.json")
    bks = tuple(int(v) for v in a.block_ks.split(","))
    bns = tuple(int(v) for v in a.block_ns.split(","))
    cands = (functools.partial(sm12x_candidates, block_ks=bks, block_ns=bns) if a.sm12x else sm90_candidates if a.sm90_tiles
             else candidates(a.pallas))
    gb.candidates_sweep(path, shapes, ms, a.budget_s, repeats=a.repeats, candidates=cands)
    print(path)


if __name__ == "__main__":
    main()
