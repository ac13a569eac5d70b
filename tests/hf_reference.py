"""Test support for tests/test_models.py: tiny ModelOpt NVFP4 exports made by ModelOpt itself,
and HF transformers running such an export with its dequantized weights.

``make_checkpoint(kind, path)``: a random Qwen3-MoE ("moe") or Llama ("dense") from a
transformers config, ``mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)`` with a short
calibration, ``export_hf_checkpoint`` (all on the CPU); ``successor=True`` adds, before
quantization, a circuit that decides every greedy token by a wide logit margin
(:func:`imprint_successor`, :func:`successor_rule`).

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


def make_checkpoint(kind: str, path: str, seed: int = 0, init: float = 0.02,
                    successor: bool = False, kv_cache: str | None = None) -> str:
    """Export a tiny random ``kind`` ("moe" | "dense") model with ModelOpt NVFP4 into ``path``
    (weights ~ N(0, init^2), norms ones). ``successor``: with the successor circuit of
    :func:`imprint_successor` added before quantization, calibrated on SUCCESSOR_TOKENS.
    ``kv_cache="fp8"``: ModelOpt's ``FP8_KV_CFG`` too (an FP8 KV cache, its scales exported)."""
    import torch
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
    if successor:
        imprint_successor(model, cfg)
        calib = torch.as_tensor(SUCCESSOR_TOKENS)[calib % len(SUCCESSOR_TOKENS)]
    return export_nvfp4(model, calib, path, kv_cache=kv_cache)


def export_nvfp4(model, calib, path: str, kv_cache: str | None = None) -> str:
    """Quantize the torch ``model`` with ModelOpt's ``NVFP4_DEFAULT_CFG`` (and, with
    ``kv_cache="fp8"``, ``FP8_KV_CFG``'s KV-cache quantizers), calibrated on the token ids
    ``calib``, and export it as an HF checkpoint into ``path``."""
    import copy

    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    def forward_loop(m):
        with torch.no_grad():
            m(calib)

    qcfg = mtq.NVFP4_DEFAULT_CFG
    if kv_cache is not None:
        if kv_cache != "fp8":
            raise ValueError(f"kv_cache: expected None or 'fp8', got {kv_cache!r}")
        qcfg = copy.deepcopy(qcfg)
        qcfg["quant_cfg"] = list(qcfg["quant_cfg"]) + list(mtq.FP8_KV_CFG["quant_cfg"])
    model = mtq.quantize(model, qcfg, forward_loop)
    with torch.no_grad():
        export_hf_checkpoint(model, export_dir=path)
    return path


#: the tokens of the successor circuit (token SUCCESSOR_TOKENS[j] owns hidden dimension j)
SUCCESSOR_TOKENS = tuple(range(7, 256, 15))[:16]


def successor_rule(seq) -> int:
    """The token the successor circuit puts after ``seq`` (SUCCESSOR_TOKENS ids, len >= 2): the
    successor (index + 3 mod 16) of the token *before* the last one."""
    s = SUCCESSOR_TOKENS
    return s[(s.index(int(seq[-2])) + 3) % len(s)]


def imprint_successor(model, cfg) -> None:
    """Add, on top of the random weights, a circuit whose greedy output is decided by a wide
    logit margin through layer 0's attention (RoPE) and MLP/experts: ``successor_rule``.

    Hidden dimensions: 0..15 token j (embedding), 16..31 "previous token j", 32 a constant
    (every embedding has 1 there). Layer 0, head 0 (kv head 0): q and k read the constant into
    RoPE pairs 0, 1, 2 (frequencies 1, 0.32, 0.1 per position) with q turned by -theta_i
    against k, so the score peaks at relative position 1 (the previous token) by a margin of
    >= 15 over every other position up to 80 back; v copies the token dimensions and o_proj
    writes them into "previous". Layer 0's other heads get q = 0: they average the values
    smoothly (with q/k RMSNorm's large weights, random q would make them attend to one
    position chosen by chance, where bf16 rounding flips the choice). The MLP (each expert
    alike) is a lookup table: neuron j (silu(g) * u with g = u = 2.2 * "previous j" ~ 14)
    writes ~4 into token dimension successor(j) through a down_proj weight of 0.0193 (its
    neurons and columns hold nothing else): small, as expert weights are, so that its E4M3
    block scale folded with weight_scale_2 (TensorRT-LLM's CUTEDSL-b12x) is a subnormal
    (multiples of 2^-9) near 0.0193/6. The LM head reads the token dimensions. Final hidden
    state ~ e_tok + e_const + 2 e_prev + 4 e_next: the next token's logit leads the runner-up
    by ~3, far above the bf16 and FP4 errors (tests/models/test_models.py asserts it at every
    step). With RoPE turned the wrong way, head 0 attends to the token itself
    and the rule becomes successor(last token).
    """
    import torch

    s = SUCCESSOR_TOKENS
    n, d, hid = len(s), cfg.head_dim, cfg.hidden_size
    if n + n + 1 > hid or n > d:
        raise ValueError(f"imprint_successor: needs hidden_size >= {2 * n + 1}, head_dim >= {n}")
    prev, const = n, 2 * n
    theta = cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"]
    freq = float(theta) ** (-np.arange(0, d, 2) / d)
    at = model.model.layers[0].self_attn
    qk_norm = hasattr(at, "q_norm")
    amp = 1.0 if qk_norm else 2.0  # with q/k RMSNorm the norm weights set the amplitude
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, const] = 1.0
        for j, t in enumerate(s):
            emb[t, j] = 1.0
        for i in range(3):
            at.q_proj.weight[i, const] = amp * np.cos(freq[i])
            at.q_proj.weight[i + d // 2, const] = -amp * np.sin(freq[i])
            at.k_proj.weight[i, const] = amp
            at.k_proj.weight[i + d // 2, const] = 0.0
            if qk_norm:
                for w in (at.q_norm.weight, at.k_norm.weight):
                    w[i] = w[i + d // 2] = 5.0
        at.q_proj.weight[d:] = 0.0  # heads 1.. attend uniformly (see above)
        for j in range(n):
            at.v_proj.weight[j, j] = 1.0
            at.o_proj.weight[prev + j, j] = 0.354  # head 0's output j -> "previous j", ~2
        mlp = model.model.layers[0].mlp
        if hasattr(mlp, "experts"):  # the table's neurons and columns hold nothing else
            inter = mlp.experts.down_proj.shape[-1]
            mlp.experts.gate_up_proj[:, :n] = mlp.experts.gate_up_proj[:, inter:inter + n] = 0.0
            mlp.experts.down_proj[:, :, :n] = 0.0
        else:
            mlp.gate_proj.weight[:n] = mlp.up_proj.weight[:n] = 0.0
            mlp.down_proj.weight[:, :n] = 0.0
        for j in range(n):
            nxt = (j + 3) % n
            if hasattr(mlp, "experts"):
                mlp.experts.gate_up_proj[:, j, prev + j] = 2.2  # HF rows [gate; up]
                mlp.experts.gate_up_proj[:, inter + j, prev + j] = 2.2
                mlp.experts.down_proj[:, nxt, j] = 0.0193
            else:
                mlp.gate_proj.weight[j, prev + j] = 2.2
                mlp.up_proj.weight[j, prev + j] = 2.2
                mlp.down_proj.weight[nxt, j] = 0.0193
        for j, t in enumerate(s):
            model.lm_head.weight[t, j] = 1.0


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
    """transformers running a ModelOpt NVFP4 export with exactly dequantized weights.

    One loader for every architecture: a subclass names what differs (class attributes and
    :meth:`source`): the checkpoint name of an HF tensor, the HF expert tensors and the
    per-expert projections each is built from, the experts module, and the experts' forward.
    """

    #: config.json keys dropped before building the plain HF architecture
    CONFIG_DROP = ("quantization_config",)
    #: HF stacked expert tensor (name suffix) -> the checkpoint projections of each expert whose
    #: dequantized weights it holds, concatenated along rows (the first entry is FC1)
    EXPERT_ROWS = {"experts.gate_up_proj": ("gate_proj", "up_proj"),
                   "experts.down_proj": ("down_proj",)}

    def source(self, name: str) -> str:
        """The checkpoint name of an HF tensor or module name."""
        return name

    def is_experts(self, mod) -> bool:
        """Whether ``mod`` is the architecture's stacked-experts module."""
        return type(mod).__name__.endswith("Experts") and hasattr(mod, "gate_up_proj")

    def __init__(self, path: str, dtype: str = "float32", w4a4: bool = True):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from nvfp4_jax import checkpoint as ckpt

        self.torch = torch
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        for key in self.CONFIG_DROP:  # build the plain architecture, fill it below
            raw.pop(key, None)
        tdtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw),
                                                      dtype=tdtype).eval()
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

        experts = tuple(self.EXPERT_ROWS)
        filled = set()  # tied tensors (one storage under two names) are filled once
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                if t.data_ptr() in filled:
                    continue
                filled.add(t.data_ptr())
                src = self.source(name)
                if src.endswith(experts):
                    base, suffix = src.rsplit(".", 2)[0], ".".join(src.rsplit(".", 2)[1:])
                    w = torch.stack([torch.cat([deq(f"{base}.experts.{e}.{p}")
                                                for p in self.EXPERT_ROWS[suffix]])
                                     for e in range(t.shape[0])])
                elif src.endswith(".weight") and f"{src[:-7]}.weight_scale_2" in names:
                    w = deq(src[:-7])
                else:
                    w = plain(src)
                if tuple(w.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != "
                                     f"{tuple(t.shape)}")
                t.copy_(w.to(t.dtype))

        def scale(name):
            return float(np.asarray(ck.get(name)).reshape(-1)[0])

        fc1_projs = self.EXPERT_ROWS[experts[0]]
        for mname, mod in self.model.named_modules():
            src = self.source(mname)
            if w4a4 and isinstance(mod, torch.nn.Linear) and f"{src}.input_scale" in names:
                s = scale(f"{src}.input_scale")
                self.hooks.append(mod.register_forward_pre_hook(
                    lambda m, args, s=s: (fake_quant(args[0], s),) + tuple(args[1:])))
            if self.is_experts(mod):
                e_n = next(mod.parameters()).shape[0]
                s1 = max(scale(f"{src}.{e}.{p}.input_scale") for e in range(e_n)
                         for p in fc1_projs)
                s2 = max(scale(f"{src}.{e}.down_proj.input_scale") for e in range(e_n))
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


def save_char_tokenizer(path: str, chat_template: str | None = None) -> None:
    """A character-level tokenizer over the tiny checkpoints' 256 ids (built offline): id i is
    the character U+0100 + i. ``chat_template``: a Jinja chat template saved with it."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(0x100 + i): i for i in range(255)}
    vocab["<unk>"] = 255
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
