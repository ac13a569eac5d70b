"""FlashInfer: its pure-torch trace references (run on CPU) and a live bridge to its GPU ops.

* :func:`reference_quantize` calls ``flashinfer.trace.templates.quantize._nvfp4_quantize_reference``
  (encode-form global scale, E2M1 by nearest value with **ties toward zero**; oracle recipe
  ``flashinfer_reference``).
* :func:`reference_b12x_moe` calls ``flashinfer.trace.templates.moe._b12x_fused_moe_reference``
  on the runtime tensors of any ``nvfp4_jax.interop.trtllm.MoERuntime`` (swiglu only): weights
  dequantized times the per-expert alphas (FC1's without the activation scale, as the FC1 input
  is *not* quantized there), FC2 input quantized with
  ``fc2_input_scale``, fp32 throughout (a tolerance reference, not bit-exact with a kernel).
  Fed the folded (CUTEDSL-b12x) runtime it shows the folding error with FlashInfer's own code.
* Live (GPU): :func:`live_fp4_quantize` (``flashinfer.fp4_quantize``) and
  :func:`live_b12x_moe` (``B12xMoEWrapper`` / ``b12x_fused_moe`` with ``input_global_scale``,
  the fix of FlashInfer PR #3932) need CUDA and SM 10.x / 12.x; elsewhere they raise
  ``LiveUnavailable`` with the reason. Neither has run on this project's machines (no FP4 GPU).
"""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import torch

from .trtllm_torch import LiveUnavailable, MoERuntime


def reference_available() -> tuple[bool, str]:
    """``(True, version)`` when FlashInfer's trace references import, else ``(False, reason)``."""
    if importlib.util.find_spec("flashinfer") is None:
        return False, ("flashinfer-python is not installed (pip install --no-deps "
                       "flashinfer-python==0.7.2.post1, see tools/install-peers.sh)")
    try:
        import flashinfer

        importlib.import_module("flashinfer.trace.templates.quantize")
        importlib.import_module("flashinfer.trace.templates.moe")
    except Exception as exc:  # noqa: BLE001
        return False, f"import flashinfer.trace.templates failed: {type(exc).__name__}: {exc}"
    return True, f"flashinfer {getattr(flashinfer, '__version__', '?')}"


def _require_reference():
    ok, why = reference_available()
    if not ok:
        raise LiveUnavailable(why)


def reference_quantize(x: torch.Tensor, encode_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's trace quantizer: ``x [M, K]`` -> (packed uint8 [M, K/2], scale bytes uint8 [M, K/16])."""
    _require_reference()
    from flashinfer.trace.templates.quantize import _nvfp4_quantize_reference

    q, s = _nvfp4_quantize_reference(x, torch.tensor([encode_scale], dtype=torch.float32))
    s = s.view(torch.uint8) if s.dtype != torch.uint8 else s
    return q.view(torch.uint8).numpy().copy(), s.reshape(x.shape[0], -1).numpy().copy()


def reference_b12x_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w: MoERuntime) -> torch.Tensor:
    """FlashInfer's b12x MoE trace reference on a :class:`MoERuntime` -> bf16 [T, H] (swiglu, up_gate)."""
    _require_reference()
    if w.activation != "swiglu" or w.gate_up_order != "up_gate":
        raise ValueError(f"w: the FlashInfer b12x reference computes silu(gate) * up with rows "
                         f"[up; gate]; got activation={w.activation!r}, gate_up_order={w.gate_up_order!r}")
    from flashinfer.trace.templates.moe import _b12x_fused_moe_reference

    e = w.fc1_weight.shape[0]
    return _b12x_fused_moe_reference(
        hidden.to(torch.bfloat16), w.fc1_weight, w.fc1_scales, w.fc2_weight, w.fc2_scales,
        topk_ids.to(torch.int64), topk_weights.to(torch.float32), e, topk_ids.shape[1],
        # the reference does not quantize the FC1 input, so its w1_alpha is the weight part only
        w1_alpha=w.fc1_alpha * w.fc1_act_scale, w2_alpha=w.fc2_alpha,
        fc2_input_scale=w.fc2_act_scale.reshape(1), quant_mode="nvfp4")


def live_available(min_sm: tuple[int, ...] = (10, 11, 12)) -> tuple[bool, str]:
    """``(True, device)`` where FlashInfer's NVFP4 GPU ops can run, else ``(False, reason)``."""
    ok, why = reference_available()
    if not ok:
        return False, why
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA device; FlashInfer's FP4 ops are CUDA-only"
    major, minor = torch.cuda.get_device_capability()
    if major not in min_sm:
        return False, (f"GPU {torch.cuda.get_device_name()} is SM {major}.{minor}; FlashInfer's NVFP4 "
                       f"kernels need SM {'/'.join(f'{m}.x' for m in min_sm)}")
    return True, f"{torch.cuda.get_device_name()} (SM {major}.{minor})"


def live_fp4_quantize(x: torch.Tensor, encode_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``flashinfer.fp4_quantize(x, G, 16, False, is_sf_swizzled_layout=False)`` on the GPU."""
    ok, why = live_available()
    if not ok:
        raise LiveUnavailable(why)
    import flashinfer

    q, s = flashinfer.fp4_quantize(x.cuda(), torch.tensor([encode_scale], device="cuda"), 16, False,
                                   is_sf_swizzled_layout=False)
    return q.view(torch.uint8).cpu().numpy(), s.view(torch.uint8).cpu().numpy().reshape(x.shape[0], -1)


def live_b12x_moe(hidden: torch.Tensor, topk_ids, topk_weights, w: MoERuntime, *,
                  input_global_scale: float | None = None) -> torch.Tensor:
    """FlashInfer's SM12x b12x fused MoE (``b12x_fused_moe``) on a :class:`MoERuntime`.

    ``input_global_scale`` (FlashInfer >= 0.6.17): decode-form FC1 activation scale, letting
    ``w1_alpha`` carry ``weight_scale_2`` (the fix); None is the legacy dual use of ``w1_alpha``.
    Arguments as FlashInfer's ``b12x_fused_moe``; not run on this project's machines.
    """
    ok, why = live_available(min_sm=(12,))
    if not ok:
        raise LiveUnavailable(why)
    from flashinfer.fused_moe.cute_dsl.b12x_moe import b12x_fused_moe

    kw = {} if input_global_scale is None else {"input_global_scale": torch.tensor([input_global_scale], device="cuda")}
    act = {"relu2": "relu2", "swiglu": "silu"}[w.activation]
    out = b12x_fused_moe(
        hidden.cuda().to(torch.bfloat16), w.fc1_weight.cuda(), w.fc1_scales.cuda(), w.fc1_alpha.cuda(),
        (1.0 / w.fc2_act_scale).reshape(1).cuda(), w.fc2_weight.cuda(), w.fc2_scales.cuda(),
        w.fc2_alpha.cuda(), topk_ids.cuda().to(torch.int32), topk_weights.cuda().to(torch.float32),
        activation=act, **kw)
    return out.cpu()
