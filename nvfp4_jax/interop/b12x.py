"""b12x (``pip install b12x``, 1.5.1): its pure-torch MoE reference as a CPU cross-check peer.

:func:`reference_moe` runs ``b12x.moe._shared.kernels.reference.moe_reference_nvfp4`` on the
same arguments ``oracle.moe`` takes (b12x conventions: encode-form ``a*_gscale``, per-expert
``alpha = weight_scale_2 / a_gscale``, block scales swizzled 128x4, w13 rows ``[up; gate]``),
either with the checkpoint block scales (``folded=False``, what b12x's own loader does) or with
``weight_scale_2`` folded into them and ``weight_scale_2 := 1`` (``folded=True``, what vLLM's
``FlashInferB12xExperts`` and TRT-LLM's CUTEDSL-b12x method did before the fix).

Importing the reference needs ``cutlass`` (nvidia-cutlass-dsl) and a package stub that skips
``b12x.moe._shared.kernels.__init__`` (which needs triton), see cpu-peers.md 2.5.
:func:`reference_available` says why when it cannot. b12x's GPU kernels need SM 12.x and are
not bridged here (FlashInfer vendors them: ``interop.flashinfer.live_b12x_moe``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types

import numpy as np
import torch

import oracle

from .trtllm_torch import LiveUnavailable, e4m3_saturating


def _import_reference():
    import b12x.moe._shared as sh

    name = "b12x.moe._shared.kernels"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(os.path.dirname(sh.__file__), "kernels")]
        sys.modules[name] = pkg
    ref = importlib.import_module(f"{name}.reference")
    intr = importlib.import_module("b12x._lib.intrinsics")
    return ref, intr


def reference_available() -> tuple[bool, str]:
    """``(True, version)`` when b12x's pure-torch reference imports, else ``(False, reason)``."""
    if importlib.util.find_spec("b12x") is None:
        return False, "b12x is not installed (pip install --no-deps b12x==1.5.1, see tools/install-peers.sh)"
    try:
        _import_reference()
    except Exception as exc:  # noqa: BLE001
        return False, f"b12x reference not importable: {type(exc).__name__}: {exc}"
    return True, f"b12x {importlib.metadata.version('b12x')}"


def reference_moe(
    hidden, topk_ids, topk_weights, fc1: oracle.NVFP4, fc2: oracle.NVFP4, fc1_input_scale,
    fc2_input_scale, *, activation: str = "relu2", activation_scale: str = "per_expert",
    folded: bool = False,
) -> np.ndarray:
    """b12x's ``moe_reference_nvfp4`` -> float64 [T, H] (bf16 values). Arguments as ``oracle.moe``."""
    ok, why = reference_available()
    if not ok:
        raise LiveUnavailable(why)
    ref, intr = _import_reference()
    g1, g2, a1, a2 = oracle.moe_scales(fc1, fc2, fc1_input_scale, fc2_input_scale, "b12x", activation_scale)
    e = fc1.codes.shape[0]

    def scales(w, g, alpha):
        s = torch.from_numpy(np.array(w.scales)).view(torch.float8_e4m3fn)
        if folded:
            ws2 = torch.tensor(np.broadcast_to(w.decode_scale, (e,)), dtype=torch.float32)
            s = e4m3_saturating(s.float() * ws2.view(-1, 1, 1))
            alpha = oracle.f32(1.0 / np.asarray(g))  # weight_scale_2 := 1
        rows, kv = s.shape[1:]
        sw = torch.stack([intr.swizzle_block_scale(s[i].reshape(rows, kv)).reshape(-1) for i in range(e)])
        return sw, torch.tensor(np.asarray(alpha), dtype=torch.float32)

    s1, al1 = scales(fc1, g1, a1)
    s2, al2 = scales(fc2, g2, a2)
    gs = (lambda g: torch.tensor(g if activation_scale == "per_expert" else g[0], dtype=torch.float32))
    out = ref.moe_reference_nvfp4(
        torch.tensor(np.asarray(hidden), dtype=torch.float32).to(torch.bfloat16),
        torch.from_numpy(np.array(fc1.codes)), s1, al1,
        torch.from_numpy(np.array(fc2.codes)), s2, al2, gs(g1), gs(g2),
        torch.from_numpy(np.asarray(topk_ids).astype(np.int64)),
        torch.tensor(np.asarray(topk_weights), dtype=torch.float32),
        e, np.asarray(hidden).shape[1], fc2.codes.shape[2] * 2,
        activation="silu" if activation == "swiglu" else "relu2")
    return out.to(torch.float32).numpy().astype(np.float64)
