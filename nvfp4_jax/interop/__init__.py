"""Other systems' NVFP4 conventions and arithmetic, and live bridges where they are importable.

* :mod:`~nvfp4_jax.interop.trtllm`: TensorRT-LLM's quantizer, GEMM and fused-MoE weight
  pipelines (CUTLASS, CUTEDSL-b12x with scale folding below m = 64, and the FlashInfer
  ``input_global_scale`` fix) re-enacted in numpy (no torch);
  :mod:`~nvfp4_jax.interop.trtllm_torch`: the same in torch, and live ``torch.ops.trtllm``
  calls on SM 10.x / 12.x GPUs.
* :mod:`~nvfp4_jax.interop.scale_decode`: the E4M3 block-scale decode of b12x's and
  FlashInfer's SM12x quantizers before and after their subnormal fix, selected by peer version
  (numpy).
* :mod:`~nvfp4_jax.interop.flashinfer`: FlashInfer's pure-torch trace references (CPU) and its
  GPU ops.
* :mod:`~nvfp4_jax.interop.b12x`: b12x's pure-torch MoE reference (CPU).
* :mod:`~nvfp4_jax.interop.modelopt`: ModelOpt checkpoint conventions and ModelOpt's own
  quantizer (CPU).

Every live entry point reports ``(available, reason)`` first and raises
:class:`~nvfp4_jax.interop.trtllm.LiveUnavailable` with that reason instead of pretending to
have run. Importing this package needs nothing beyond numpy; ``trtllm`` and ``scale_decode`` need
numpy and ml_dtypes only, ``trtllm_torch``, ``b12x`` and ``flashinfer`` need torch.
"""



class LiveUnavailable(RuntimeError):
    """A live peer op cannot run here; the message says exactly why."""


__all__ = ["LiveUnavailable"]
