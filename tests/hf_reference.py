"""Test support for tests/test_models.py: tiny ModelOpt NVFP4 exports made by ModelOpt itself,
and HF transformers running such an export with its dequantized weights.

``make_checkpoint(kind, path)``: a random Qwen3-MoE ("moe") or Llama ("dense") from a
transformers config, ``mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)`` with a short
calibration, ``export_hf_checkpoint`` (all on the CPU).

``HFReference(path, dtype, w4a4)``: the same architecture in transformers with every NVFP4
weight replaced by its exact dequantization (``oracle.dequantize``, float64, then cast to
``dtype``) and, with ``w4a4``, each quantized linear's input quantized as TensorRT-LLM does it
(``oracle.quantize(x, "trtllm", encode_scale=fp32(1/input_scale))``, dequantized exactly). The
experts always quantize their activations (as ``nvfp4_jax.moe`` does), with TensorRT-LLM
CUTLASS's activation scales (one per layer: the max of the experts' input_scale).
"""

from __future__ import annotations

import json
import os

import numpy as np

import oracle

TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def make_checkpoint(kind: str, path: str, seed: int = 0, init: float = 0.02) -> str:
    """Export a tiny random ``kind`` ("moe" | "dense") model with ModelOpt NVFP4 into ``path``
    (weights ~ N(0, init^2), norms ones)."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    torch.manual_seed(seed)
    if kind == "moe":
        cfg = Qwen3MoeConfig(**TINY, intermediate_size=128, moe_intermediate_size=32,
                             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                             norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"],
                             initializer_range=init)
    elif kind == "dense":
        cfg = LlamaConfig(**TINY, intermediate_size=128, architectures=["LlamaForCausalLM"],
                          initializer_range=init)
    else:
        raise ValueError(f"kind: expected 'moe' or 'dense', got {kind!r}")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    calib = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(seed))

    def forward_loop(m):
        with torch.no_grad():
            m(calib)

    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    with torch.no_grad():
        export_hf_checkpoint(model, export_dir=path)
    return path


def fake_quant(x, input_scale: float):
    """TensorRT-LLM's W4A4 activation as values: trtllm-recipe NVFP4 of x (torch, any float
    dtype) with G = fp32(1/input_scale), dequantized exactly (times input_scale), in x's dtype."""
    import torch

    s = np.float32(input_scale)
    g = float(np.float32(1.0) / s)
    xn = x.detach().to(torch.float32).numpy()
    q = oracle.quantize(xn, "trtllm", encode_scale=g)
    v = oracle.dequantize(q, include_decode_scale=False) * float(s)
    return torch.from_numpy(v).to(x.dtype)


class HFReference:
    """transformers running a ModelOpt NVFP4 export with exactly dequantized weights."""

    def __init__(self, path: str, dtype: str = "float32", w4a4: bool = True):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from nvfp4_jax import checkpoint as ckpt

        self.torch = torch
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw.pop("quantization_config", None)  # build the plain architecture, fill it below
        cfg = AutoConfig.for_model(**raw)
        tdtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype).eval()
        ck = ckpt.load(path)
        names = set(ck.names())
        self.hooks = []

        def deq(prefix):
            return torch.from_numpy(oracle.dequantize(ck.linear(prefix).to_oracle())).to(tdtype)

        def plain(name):
            a = np.asarray(ck.get(name))
            if a.dtype == np.uint16:
                a = (a.astype(np.uint32) << 16).view(np.float32)
            return torch.from_numpy(np.asarray(a, np.float32)).to(tdtype)

        with torch.no_grad():
            for name, prm in self.model.named_parameters():
                if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                    base = name.rsplit(".", 1)[0]
                    e_n = prm.shape[0]
                    if name.endswith("gate_up_proj"):  # HF rows [gate; up]
                        w = torch.stack([torch.cat([deq(f"{base}.{e}.gate_proj"),
                                                    deq(f"{base}.{e}.up_proj")])
                                         for e in range(e_n)])
                    else:
                        w = torch.stack([deq(f"{base}.{e}.down_proj") for e in range(e_n)])
                elif name.endswith(".weight") and f"{name[:-7]}.weight_scale_2" in names:
                    w = deq(name[:-7])
                else:
                    w = plain(name)
                if tuple(w.shape) != tuple(prm.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != "
                                     f"{tuple(prm.shape)}")
                prm.copy_(w)
        for mname, mod in self.model.named_modules():
            if w4a4 and isinstance(mod, torch.nn.Linear) and f"{mname}.input_scale" in names:
                s = float(np.asarray(ck.get(f"{mname}.input_scale")).reshape(-1)[0])
                self.hooks.append(mod.register_forward_pre_hook(
                    lambda m, args, s=s: (fake_quant(args[0], s),) + tuple(args[1:])))
            if type(mod).__name__.endswith("Experts") and hasattr(mod, "gate_up_proj"):
                e_n = mod.gate_up_proj.shape[0]
                def scale(name):
                    return float(np.asarray(ck.get(name)).reshape(-1)[0])

                s1 = max(scale(f"{mname}.{e}.{p}.input_scale")
                         for e in range(e_n) for p in ("gate_proj", "up_proj"))
                s2 = max(scale(f"{mname}.{e}.down_proj.input_scale") for e in range(e_n))
                mod.forward = self._experts_forward(mod, s1, s2)

    def _experts_forward(self, mod, s1: float, s2: float):
        """HF's expert loop with W4A4 activations (TensorRT-LLM: one scale per layer)."""
        torch = self.torch

        def forward(hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            xq = fake_quant(hidden_states, s1)
            for e in range(mod.gate_up_proj.shape[0]):
                tok, pos = torch.where(top_k_index == e)
                if tok.numel() == 0:
                    continue
                gate, up = torch.nn.functional.linear(xq[tok], mod.gate_up_proj[e]).chunk(2, dim=-1)
                h = fake_quant(mod.act_fn(gate) * up, s2)
                d = torch.nn.functional.linear(h, mod.down_proj[e]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, d.to(out.dtype))
            return out

        return forward

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """float64 logits [B, T, V] for token ids [B, T] (one full forward, no cache)."""
        with self.torch.no_grad():
            out = self.model(self.torch.as_tensor(np.asarray(ids), dtype=self.torch.long))
        return out.logits.to(self.torch.float64).numpy()

    def greedy(self, ids: np.ndarray, n: int) -> np.ndarray:
        """n greedy tokens [B, n] after the prompt ids [B, T] (full forward per step)."""
        seq = np.asarray(ids)
        new = []
        for _ in range(n):
            tok = np.argmax(self.logits(seq)[:, -1], axis=-1)
            new.append(tok)
            seq = np.concatenate([seq, tok[:, None]], axis=1)
        return np.stack(new, axis=1)
