"""models.NemotronHModel against HF transformers' NemotronH on a tiny ModelOpt NVFP4 export.

The checkpoint: a random ``NemotronHForCausalLM`` (hidden 64, pattern "MOE*-ME" without the
O: Mamba2, MoE, attention, MLP, Mamba2, MoE; 4 relu2 experts, top-2, a shared expert,
sigmoid routing with a random ``e_score_correction_bias`` and ``routed_scaling_factor`` 2.5;
HF's chunk size 8, so the 12-token prompt spans two of HF's chunks) quantized by ModelOpt
itself on the CPU (``NVFP4_DEFAULT_CFG``, a short calibration, ``export_hf_checkpoint``).
"random": the Mamba in_proj and conv weights scaled up (:func:`strengthen_ssm`) so that the
SSM recurrence decides the Mamba outputs; "successor": HF's init with a circuit that decides
every greedy token (:func:`imprint_successor`).

Reference (:class:`NemotronHReference`): HF's model in float32 with every NVFP4 weight
dequantized exactly (``oracle.dequantize``) and, for W4A4, each quantized linear's input
quantized as TensorRT-LLM does (``hf_reference.fake_quant``); the experts always quantize
their activations with one scale per layer (the max of the experts' input_scale), as
``nvfp4_jax.moe`` does.

Bound (as tests/models/test_models.py derives it): ours computes in bf16 where HF's bf16
execution rounds too (activations, residual stream, Mamba in_proj outputs, conv outputs,
attention probabilities, logits), so ``d16 = HF_bf16 - HF_fp32`` over the B*T*V logits
measures the size of such errors on this model: ``max|ours - HF_fp32| <= c * max|d16|``
(c = 2 for W4A16, 3 for W4A4 whose code flips make the error heavier-tailed) and
``rms(ours - HF_fp32) <= 1.5 * rms(d16)``. The Mamba recurrence in fp32 runs sequentially
here and in chunks in HF: a difference at fp32 rounding, far below the bound. The random
checkpoint's W4A4 logits move by two thirds of their range between HF's bf16 and fp32
execution (its large Mamba activations flip many FP4 codes): too chaotic to bound usefully,
so it is checked W4A16, and W4A4 on the successor checkpoint (logits of range ~7).

Cache: our prefill of the first 8 tokens followed by single-token decode steps reproduces our
own full-sequence logits (W4A16, random checkpoint) within a quarter of that bound (the same computation, only XLA's
summation order for [B, T] vs [B, 1] differs); a cache that lost the Mamba conv or SSM state
or the KV cache is off by the whole logit scale.

Greedy: our 24 free-running greedy tokens equal HF's ``generate(do_sample=False)`` (float32,
dequantized weights, its own Mamba cache path), on a prompt whose every step's top-1/top-2
margin in the reference exceeds the bound (asserted: the precondition for identity to be a
fair demand).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers.models.nemotron_h")
pytest.importorskip("modelopt.torch.quantization")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_reference import HFReference, export_nvfp4, fake_quant  # noqa: E402

from nvfp4_jax import NVFP4Array, models, nn  # noqa: E402

LAYERS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]
TINY = {"vocab_size": 256, "hidden_size": 64, "layers_block_type": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "ssm_state_size": 16, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "architectures": ["NemotronHForCausalLM"]}
PROMPT = np.random.default_rng(0).integers(0, 256, (2, 12))
N_NEW = 24


#: the tokens of the successor circuit (token SUCCESSOR_TOKENS[j] owns hidden dimension j)
SUCCESSOR_TOKENS = tuple(range(7, 256, 15))[:16]


def successor_rule(seq) -> int:
    """The token the successor circuit puts after ``seq`` (len >= 2): the successor (index + 3
    mod 16) of the token *before* the last one."""
    s = SUCCESSOR_TOKENS
    return s[(s.index(int(seq[-2])) + 3) % len(s)]


def imprint_successor(model) -> None:
    """Add, on top of the random weights, a circuit that decides every greedy token by a wide
    margin through layer 0's Mamba2 conv (the previous token) and layer 3's relu2 MLP (a
    lookup table of successors): ``successor_rule``.

    Hidden dimensions: 0..15 token j (embedding), 16..31 "previous token j", 32 a constant (1
    in every embedding). Mamba layer 0: channel j < 16 of x reads token dimension j
    (in_proj), the conv passes it on one step late (taps [0, 0, 1, 0], no bias); B and C are 0
    (their in_proj rows, conv taps and bias), so the SSM state stays 0 and y = D * x; the gate
    z of channels 0..15 reads the constant, so the gated RMSNorm of group 0 makes channel
    "previous token" ~8, and out_proj writes it into "previous j" (~2). MLP layer 3: neuron j
    reads "previous j" and writes ~4 into token dimension successor(j); the LM head reads the
    token dimensions. Final hidden state ~ e_tok + e_const + 2 e_prev + 4 e_next: the next
    token's logit leads by ~5 (the test asserts the margin at every step). A conv state lost
    between decode steps turns the rule into successor(last token) or noise.
    """
    import torch

    s, n = SUCCESSOR_TOKENS, len(SUCCESSOR_TOKENS)
    prev, const = n, 2 * n
    cfg = model.config
    inner = cfg.mamba_num_heads * cfg.mamba_head_dim
    bc = slice(inner + inner, inner + inner + 2 * cfg.n_groups * cfg.ssm_state_size)
    with torch.no_grad():
        emb = model.model.embeddings.weight
        emb[:, const] = 1.0
        for j, t in enumerate(s):
            emb[t, j] = 1.0
        mx = model.model.layers[0].mixer
        mx.in_proj.weight[bc] = 0.0
        mx.conv1d.weight[inner:] = 0.0
        mx.conv1d.bias[inner:] = 0.0
        mx.in_proj.weight[:n] = 0.0
        mx.in_proj.weight[inner:inner + n] = 0.0
        mx.out_proj.weight[:, :n] = 0.0
        for j in range(n):
            mx.in_proj.weight[j, const] = 0.5           # z_j: the constant
            mx.in_proj.weight[inner + j, j] = 0.5       # x_j: token j
            mx.conv1d.weight[j, 0] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # one step late
            mx.conv1d.bias[j] = 0.0
            mx.out_proj.weight[prev + j, j] = 0.25
        mx.D[0] = 1.0
        mlp = model.model.layers[3].mixer
        mlp.up_proj.weight[:n] = 0.0
        mlp.down_proj.weight[:, :n] = 0.0
        for j in range(n):
            mlp.up_proj.weight[j, prev + j] = 0.4
            mlp.down_proj.weight[(j + 3) % n, j] = 0.6
        for j, t in enumerate(s):
            model.lm_head.weight[t, j] = 1.0


SUCCESSOR_PROMPT = np.asarray(SUCCESSOR_TOKENS)[np.random.default_rng(1).integers(0, 16, (1, 12))]


def strengthen_ssm(model) -> None:
    """Make the Mamba layers' state-space term matter: at HF's init (in_proj and conv1d
    ~ N(0, 0.02^2), dt ~ 0.001-0.1) the SSM state is ~1e-3 and its term ``state @ C`` far
    below the skip term ``D * x``, so a wrong recurrence (A, dt, the B/C groups, a lost SSM
    state) would hide in the noise. in_proj x 10, conv1d x 25 (x, B, C, z, dt of order 1)
    and dt ~ U(0.2, 1) give both terms the same order; A = -exp(A_log) stays HF's
    -1..-heads."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            mx = layer.mixer
            if type(mx).__name__ != "NemotronHMamba2Mixer":
                continue
            mx.in_proj.weight.mul_(10.0)
            mx.conv1d.weight.mul_(25.0)
            dt = 0.2 + 0.8 * torch.rand(mx.dt_bias.shape, generator=torch.Generator().manual_seed(1))
            mx.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1


def make_checkpoint(path: str, seed: int = 0, init: float = 0.02,
                    successor: bool = False) -> str:
    """A random tiny Nemotron-H exported by ModelOpt NVFP4 into ``path``; ``successor``: with
    the circuit of :func:`imprint_successor`, calibrated on SUCCESSOR_TOKENS."""
    import torch
    from transformers import AutoModelForCausalLM, NemotronHConfig

    torch.manual_seed(seed)
    cfg = NemotronHConfig(**TINY, initializer_range=init)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it select
                buf.copy_(torch.randn(buf.shape) * 0.05)
    calib = torch.randint(0, cfg.vocab_size, (4, 32),
                          generator=torch.Generator().manual_seed(seed))
    if successor:
        imprint_successor(model)
        calib = torch.as_tensor(SUCCESSOR_TOKENS)[calib % len(SUCCESSOR_TOKENS)]
    else:
        strengthen_ssm(model)
    return export_nvfp4(model, calib, path)


class NemotronHReference(HFReference):
    """HF's NemotronHForCausalLM running a ModelOpt NVFP4 export with dequantized weights
    (tensors under ``backbone.`` in the checkpoint, ``model.`` in HF; relu2 experts with
    separate up/down stacks)."""

    CONFIG_DROP = ("quantization_config",
                   "time_step_limit")  # JSON-encoded infinity; HF's mixer does not read it
    EXPERT_ROWS = {"experts.up_proj": ("up_proj",), "experts.down_proj": ("down_proj",)}

    def source(self, name: str) -> str:
        return "backbone." + name[len("model."):] if name.startswith("model.") else name

    def is_experts(self, mod) -> bool:
        return type(mod).__name__ == "NemotronHExperts"

    def _experts_forward(self, mod, s1: float, s2: float):
        """HF's relu2 expert loop with W4A4 activations (TensorRT-LLM: one scale per layer)."""
        torch = self.torch

        def forward(hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states, dtype=top_k_weights.dtype)
            xq = fake_quant(hidden_states, s1)
            for e in range(mod.up_proj.shape[0]):
                tok, pos = torch.where(top_k_index == e)
                if tok.numel() == 0:
                    continue
                h = fake_quant(mod.act_fn(torch.nn.functional.linear(xq[tok], mod.up_proj[e])),
                               s2)
                d = torch.nn.functional.linear(h, mod.down_proj[e]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, d.to(out.dtype))
            return out.to(hidden_states.dtype)

        return forward

    def generate(self, ids: np.ndarray, n: int) -> np.ndarray:
        """HF ``generate(do_sample=False)``: n new tokens [B, n] (HF's own cache path)."""
        torch = self.torch
        gc = self.model.generation_config
        gc.eos_token_id, gc.pad_token_id = None, 0
        with torch.no_grad():
            out = self.model.generate(torch.as_tensor(np.asarray(ids), dtype=torch.long),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[:, ids.shape[1]:].numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(kind="random"):
        if kind not in made:
            made[kind] = make_checkpoint(str(tmp_path_factory.mktemp(f"nemotron-h-{kind}")),
                                         successor=kind == "successor")
        return made[kind]

    return get


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints("random")


@pytest.fixture(scope="module")
def model(checkpoints):
    return _loaded(checkpoints, "random")


@pytest.fixture(scope="module")
def reference(checkpoints):
    cache = {}

    def get(w4a4, dtype="float32", kind="random"):
        if (w4a4, dtype, kind) not in cache:
            cache[w4a4, dtype, kind] = NemotronHReference(checkpoints(kind), dtype, w4a4)
        return cache[w4a4, dtype, kind]

    return get


def _bound(reference, w4a4, ids, kind="random"):
    """(HF fp32 logits, max-abs bound, rms bound) for ``ids`` (module docstring)."""
    r32 = reference(w4a4, kind=kind).logits(ids)
    d16 = reference(w4a4, "bfloat16", kind).logits(ids) - r32
    c = 3.0 if w4a4 else 2.0
    return r32, c * float(np.abs(d16).max()), 1.5 * float(np.sqrt(np.mean(d16 ** 2)))


_LOADED: dict = {}


def _loaded(checkpoints, kind):
    path = checkpoints(kind)
    if path not in _LOADED:
        _LOADED[path] = models.load_model(path)
    return _LOADED[path]


def _ours(model, ids, w4a4):
    cache = models.init_cache(model.config, ids.shape[0], ids.shape[1])
    logits, _ = models.prefill(model, jnp.asarray(ids, jnp.int32), cache, all_logits=True,
                               w4a4=w4a4)
    return np.asarray(logits, np.float64)


def test_loader_keeps_weights_nvfp4(model, checkpoint):
    from nvfp4_jax import checkpoint as ckpt

    ck = ckpt.load(checkpoint)
    cfg = model.config
    assert cfg.layer_types == ("M", "E", "*", "-", "M", "E")
    assert isinstance(model, models.NemotronHModel)
    mamba = model.layers[0]["mamba"]
    assert isinstance(mamba["in_proj"], nn.Linear) and isinstance(mamba["in_proj"].w, NVFP4Array)
    np.testing.assert_array_equal(np.asarray(mamba["in_proj"].w.codes),
                                  ck.get("backbone.layers.0.mixer.in_proj.weight"))
    moe = model.layers[1]["moe"]["routed"]
    assert moe.routing == "sigmoid_bias" and moe.activation == "relu2"
    assert moe.routed_scaling_factor == 2.5 and moe.router.dtype == jnp.float32
    assert moe.fc1.shape == (4, 32, 64) and moe.fc2.shape == (4, 64, 32)
    np.testing.assert_array_equal(np.asarray(moe.correction_bias),
                                  ck.get("backbone.layers.1.mixer.gate.e_score_correction_bias"))
    assert np.abs(np.asarray(moe.correction_bias)).max() > 0
    assert "qkv_proj" in model.layers[2]["self_attn"]  # one scale for q/k/v: fused


@pytest.mark.parametrize("kind,w4a4", [("random", False), ("successor", True),
                                        ("successor", False)])
def test_logits_match_hf_within_bound(checkpoints, reference, kind, w4a4):
    ids = PROMPT if kind == "random" else np.concatenate([SUCCESSOR_PROMPT] * 2)
    r32, bound, rms_bound = _bound(reference, w4a4, ids, kind)
    ours = _ours(_loaded(checkpoints, kind), ids, w4a4)
    err = float(np.abs(ours - r32).max())
    rms = float(np.sqrt(np.mean((ours - r32) ** 2)))
    print(f"\nNemotron-H {kind} w4a4={w4a4}: max|ours - HF fp32| {err:.3g} (bound {bound:.3g}), "
          f"rms {rms:.3g} (bound {rms_bound:.3g}), logit range {np.abs(r32).max():.3g}")
    assert 0 < bound < 0.5 * float(np.abs(r32).max())  # the bound is informative
    assert err <= bound, f"w4a4={w4a4}: max |ours - HF fp32| = {err:.4g} > {bound:.4g}"
    assert rms <= rms_bound, f"w4a4={w4a4}: rms {rms:.4g} > bound {rms_bound:.4g}"


@pytest.mark.parametrize("kernel", [False, True])
def test_prefill_then_decode_equals_full_forward(model, reference, kernel, monkeypatch):
    """kernel: each decode step's attention in ``attention.decode_attention`` (interpreted
    here; what GPUs run) instead of XLA's einsums."""
    if kernel:
        from nvfp4_jax.models import decoder

        monkeypatch.setattr(decoder, "runs_kernel", lambda *a: True)
        jax.clear_caches()  # the steps are traced anew, through the kernel
    seq = PROMPT
    t0 = 8
    full = _ours(model, seq, False)
    cache = models.init_cache(model.config, seq.shape[0], seq.shape[1])
    logits, cache = models.prefill(model, jnp.asarray(seq[:, :t0], jnp.int32), cache,
                                   all_logits=True, w4a4=False)
    steps = [np.asarray(logits, np.float64)]
    for i in range(t0, seq.shape[1]):
        step, cache = models.decode_step(model, jnp.asarray(seq[:, i], jnp.int32), cache,
                                         w4a4=False)
        steps.append(np.asarray(step, np.float64)[:, None])
    got = np.concatenate(steps, axis=1)
    assert int(cache.length) == seq.shape[1]
    _, bound, _ = _bound(reference, False, seq)
    err = float(np.abs(got - full).max())
    print(f"\nNemotron-H prefill + decode vs full forward: {err:.3g} (bound / 4 {bound / 4:.3g})")
    if kernel:
        monkeypatch.undo()
        jax.clear_caches()
    assert err <= bound / 4, f"prefill + decode vs full forward: {err:.4g} > {bound / 4:.4g}"


def test_a_step_past_the_cache_gives_nan_logits(model):
    cache = models.init_cache(model.config, 1, 3)
    _, cache = models.prefill(model, jnp.asarray([[1, 2, 3]], jnp.int32), cache)
    logits, _ = models.decode_step(model, jnp.asarray([4], jnp.int32), cache)
    assert np.isnan(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="tokens: 4 tokens do not fit the cache's 3 positions"):
        models.prefill(model, jnp.asarray([[1, 2, 3, 4]], jnp.int32), cache)


def test_steps_carry_no_effects(model):
    """The jitted prefill and decode step hold no effect, so each call takes jit's C++
    dispatch (an effect, e.g. a checkify check, sends every call through JAX's Python
    dispatch: ~5 ms of host time per Nemotron-3-Nano step on the H200 against 4 ms on the
    device)."""
    cache = models.init_cache(model.config, 1, 8)
    tok = jnp.zeros((1,), jnp.int32)
    assert jax.make_jaxpr(lambda m, t, c: models.decode_step(m, t, c))(model, tok, cache).effects == set()
    assert jax.make_jaxpr(lambda m, t, c: models.prefill(m, t, c))(
        model, jnp.zeros((1, 4), jnp.int32), cache).effects == set()


@pytest.mark.parametrize("w4a4", [True, False])
def test_greedy_identical_to_hf_generate(checkpoints, reference, w4a4):
    prompt = SUCCESSOR_PROMPT
    t = prompt.shape[1]
    ours = models.generate(_loaded(checkpoints, "successor"), prompt, N_NEW, w4a4=w4a4,
                           warmup=False).tokens
    want = reference(w4a4, kind="successor").generate(prompt, N_NEW)
    seq = np.concatenate([prompt, want], axis=1)
    r32, bound, _ = _bound(reference, w4a4, seq, "successor")
    ref = r32[0, t - 1:-1]
    assert (np.argmax(ref, axis=-1) == want[0]).all()  # HF's cache path = its full forward
    # the checkpoint is what it claims: HF follows the circuit's rule, with many distinct tokens
    assert want[0].tolist() == [successor_rule(seq[0, :i]) for i in range(t, t + N_NEW)]
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    print(f"\nNemotron-H greedy w4a4={w4a4}: min top-2 margin {margin.min():.3g}, "
          f"bound {bound:.3g}, {len(set(want[0].tolist()))} distinct tokens")
    assert 0 < bound < margin.min(), f"margin {margin.min():.4g} <= bound {bound:.4g}"
    np.testing.assert_array_equal(ours, want, err_msg=f"w4a4={w4a4}: greedy tokens")


def test_cli_generate(checkpoint, model, tmp_path, capsys):
    from nvfp4_jax.cli import main

    ids = [int(i) for i in PROMPT[0]]
    out = tmp_path / "gen.json"
    assert main(["generate", "--checkpoint", checkpoint, "--prompt-ids", ",".join(map(str, ids)),
                 "--max-new-tokens", str(N_NEW), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    want = models.generate(model, PROMPT[:1], N_NEW, warmup=False).tokens[0]
    assert res["new_ids"] == [int(t) for t in want]
    assert "loaded layer 6/6" in capsys.readouterr().err


def test_fp32_router_logits_are_fp32():
    """nn.router_logits with a float32 router (Nemotron-H's gate): fp32(x) @ router in fp32,
    not rounded to bf16 as a bf16 router's logits are."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    want = np.asarray(x, np.float64) @ w.astype(np.float64).T
    fc = NVFP4Array.from_parts(jnp.zeros((4, 16, 32), jnp.uint8),
                               jnp.ones((4, 16, 4), jnp.float8_e4m3fn), jnp.ones(4, jnp.float32))
    s = jnp.ones(4, jnp.float32)
    got = np.asarray(nn.router_logits(nn.MoE(jnp.asarray(w), fc, fc, s, s), x), np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0**-20, atol=1e-5)
    b16 = np.asarray(nn.router_logits(nn.MoE(jnp.asarray(w, jnp.bfloat16), fc, fc, s, s), x))
    assert np.abs(b16 - want).max() > 100 * np.abs(got - want).max()


def test_unsupported_configs_raise():
    base = {**TINY, "model_type": "nemotron_h"}
    with pytest.raises(ValueError, match="group-limited"):
        models.NemotronHConfig.from_hf({**base, "n_routed_experts": 8, "n_group": 4,
                                        "topk_group": 2})
    with pytest.raises(ValueError, match="moe_latent_size"):
        models.NemotronHConfig.from_hf({**base, "moe_latent_size": 32})
    with pytest.raises(ValueError, match="layers_block_type"):
        models.NemotronHConfig.from_hf({**base, "layers_block_type": ["mamba"]})
    cfg = models.NemotronHConfig.from_hf({**base, "layers_block_type": None,
                                          "hybrid_override_pattern": "M*-E"})
    assert cfg.layer_types == ("M", "*", "-", "E")
    with pytest.raises(ValueError, match="architectures"):
        models.config_from_hf({**base})


def test_stacked_layer_units_compute_the_unrolled_model(model):
    """``NemotronHModel.stacked()`` scans repeated layer units (attention, Mamba and MoE inside
    one scanned unit, single layers around it) and computes the unrolled model: prefill
    logits, a decode step's logits (which read the conv, SSM and KV state the prefill left)
    and the final caches agree within 10 % RMS, the bound test_models_gpu.py sets for the
    decoders' scanned and unrolled layers; ``unstacked()`` gives the layers back. Not bit for
    bit: XLA emits the dots inside a scan body with another summation order, and the experts'
    FP4 activation codes flip on last-bit differences (measured on the CPU, W4A16: 0.7-2.7 %;
    sharing one KV slot across the scanned attention layers gives 97 % on the caches, the
    Mamba states in the wrong order 89 % on the decode step)."""
    import dataclasses

    m0, e1, a2, d3, m4, e5 = model.layers
    pattern = "ME*ME*ME*-ME"
    layers = [m0, e1, a2, m4, e5, a2, m0, e1, a2, d3, m4, e5]
    flat = dataclasses.replace(model, layers=layers, config=dataclasses.replace(
        model.config, layer_types=tuple(pattern)))
    stacked = flat.stacked()
    assert stacked.segments == ((3, 3), (1, 1), (1, 1), (1, 1))
    ids = jnp.asarray(PROMPT, jnp.int32)
    outs = []
    for m in (flat, stacked):
        cache = models.init_cache(m.config, ids.shape[0], ids.shape[1] + 2)
        logits, cache = models.prefill(m, ids, cache, all_logits=True, w4a4=False)
        step, cache = models.decode_step(m, ids[:, 0], cache, w4a4=False)
        outs.append({"prefill": logits, "decode": step, "k": cache.k, "v": cache.v,
                     "conv": cache.conv, "ssm": cache.ssm})
    rels = {}
    for name in outs[0]:
        a, b = (np.asarray(o[name], np.float64) for o in outs)
        assert a.shape == b.shape, name
        rels[name] = float(np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2)))
    assert all(r < 0.1 for r in rels.values()), f"stacked vs unrolled, RMS: {rels}"
    back = stacked.unstacked()
    assert back.segments is None and len(back.layers) == len(layers)
    for a, b in zip(jax.tree_util.tree_leaves(back.layers), jax.tree_util.tree_leaves(layers)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_segment_layers_finds_the_repeated_units():
    from nvfp4_jax.models.nemotron_h import segment_layers

    nano = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # Nemotron-3-Nano's 52
    assert segment_layers(nano) == ((7, 5), (2, 3), (1, 1), (1, 1), (2, 4), (1, 1))
    assert segment_layers("ME*-ME") == ((1, 1),) * 6
    assert segment_layers("MMMM-") == ((1, 4), (1, 1))


def test_stacking_can_consume_the_layers(model):
    """``stacked(consume=True)`` (what ``load_model`` does) gives the same stacks as
    ``stacked()`` and deletes the stacked layers' own arrays as it goes, so loading never holds
    the model twice; an array two layers share is kept, and a pattern without repeats is the
    model itself."""
    import dataclasses

    from nvfp4_jax.models.decoder import stack_trees

    m0, e1, a2, d3, m4, e5 = model.layers

    def fresh(p):  # this layer's own copies
        return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), p)

    pattern = "MEME"
    layers = [fresh(m0), fresh(e1), fresh(m4), fresh(e5)]
    flat = dataclasses.replace(model, layers=layers, config=dataclasses.replace(
        model.config, layer_types=tuple(pattern)))
    want = flat.stacked()
    got = flat.stacked(consume=True)
    assert got.segments == want.segments == ((2, 2),)
    for a, b in zip(jax.tree_util.tree_leaves(got.layers), jax.tree_util.tree_leaves(want.layers)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(layers))
    shared = jnp.ones((4,), jnp.float32)
    out = stack_trees([{"a": shared, "b": jnp.zeros(2)}, {"a": shared, "b": jnp.ones(2)}],
                      consume=True)
    assert not shared.is_deleted() and out["a"].shape == (2, 4)
    assert model.stacked(consume=True) is model  # "ME*-ME": no unit repeats
