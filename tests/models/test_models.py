"""nvfp4_jax.models against HF transformers on tiny checkpoints that ModelOpt itself exports.

Reference: ``tests/hf_reference.py`` runs the export in transformers (float32, and bfloat16 for
the noise scale below) with every NVFP4 weight dequantized exactly and, for W4A4, each
quantized linear's input quantized as TensorRT-LLM does (trtllm recipe, ``G = 1/input_scale``;
experts with one activation scale per layer).

Bound. Our model computes in bf16 (activations, q/k/v, attention probabilities, MLP
intermediates, logits stored in bf16; fp32 accumulation). Relative to the float32 reference,
its logits error is a sum of per-rounding contributions (unit roundoff 2^-8 each), plus, for
W4A4, the FP4 codes that those small differences flip at E2M1 midpoints. HF's own bf16
execution of the same model has the same rounding points (and rounds the weights as well), so
``d16 = HF_bf16 - HF_fp32`` over the B*T*V logits measures the size of such errors on this
model. With at least as many independent contributions of the same size, HF bf16's per-logit
error has at least our standard deviation; the maximum of N ~ 6000 such errors concentrates
(Gaussian: ~3.8 sigma +- 0.35), so ours stays below 2 * max|d16| unless either maximum is 3
standard deviations off; W4A4's flips make the error heavier-tailed (a few large
contributions), so there the factor is 3. The RMS over all logits fluctuates less (errors of
one position are correlated across the vocabulary, so about B*T = 24 independent samples:
+-20 %), so it gets 1.5 * rms(d16) in every case. Bound: ``max|ours - HF_fp32| <= c * max|d16|``
(c = 2 for W4A16, 3 for W4A4) and ``rms(ours - HF_fp32) <= 1.5 * rms(d16)``. Measured ratios
are 0.4 to 1.0. A second Llama checkpoint ("dense-wide") has weights ~ N(0, 0.1^2) (not
0.02) so that its attention is far from uniform: a RoPE with the wrong sense then exceeds the
W4A16 bound 40-fold. (Its W4A4 logits move by a third of their range between bf16 and fp32
execution, too chaotic to bound usefully, so W4A4 is checked on the 0.02 checkpoints.)

What the model-level W4A4 bound cannot see: on these random models the bf16 execution's code
flips are as large as the activation quantization itself (leaving the activations unquantized
stays within the bound), and SwiGLU is nearly symmetric in gate and up at their small
magnitudes. ``test_linear_w4a4_and_moe_block_match_oracle`` checks both against the oracle.

Greedy on the random checkpoints: a generated token either equals the float32 reference's
argmax, or the reference's margin between its argmax and our token is within the same bound
(a tie the bound cannot resolve; random tiny models have top-2 margins down to 1e-4, and W4A4
errors of ~0.05). Our KV-cache decode reproduces our own full-sequence argmax exactly.

Greedy identity ("-successor" checkpoints): the same random models with a circuit added
before ModelOpt quantizes them (``hf_reference.imprint_successor``): layer 0's attention
head 0 finds the previous token through RoPE, its MLP (every expert) looks up that token's
successor, the LM head reads it out. The next token is decided by the layers (the rule is
"successor of the token before the last"; a RoPE turned the wrong way makes it "successor of
the last token"), by a top-1/top-2 margin of ~3 against bounds of ~0.1-0.2. The test
asserts that HF follows the rule with many distinct tokens, that every one of the 32 steps'
margins exceeds the bound (the precondition for identity to be a fair demand), and then that
our 32 free-running greedy tokens equal HF fp32's, W4A16 and W4A4, dense and MoE.

CUTEDSL-b12x folding (``models.fold_cutedsl_b12x``): the folded block scales are checked
byte for byte against E4M3(scale * weight_scale_2) computed here from the checkpoint, and the
folded model's logits against the same bound: beyond it where the experts decide the output
(the successor checkpoint), while ours stay within it. ``pytest -s`` prints the measurements
that docs/models.md quotes.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("modelopt.torch.quantization")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_reference import (  # noqa: E402
    SUCCESSOR_TOKENS,
    HFReference,
    make_checkpoint,
    save_char_tokenizer,
    successor_rule,
)

import nvfp4_jax as nj  # noqa: E402
import oracle  # noqa: E402
from nvfp4_jax import NVFP4Array, models, nn  # noqa: E402

#: (checkpoint, W4A4): "dense-wide" is the Llama with weights ~ N(0, 0.1^2) (see above)
CASES = [("moe", True), ("moe", False), ("dense", True), ("dense-wide", False)]
PROMPT = np.random.default_rng(0).integers(0, 256, (2, 12))
N_NEW = 32
#: (checkpoint, W4A4) with the successor circuit: greedy decided by wide margins (see above)
SUCCESSOR_CASES = [("moe-successor", True), ("moe-successor", False),
                   ("dense-successor", True), ("dense-successor", False)]
SUCCESSOR_PROMPT = np.asarray(SUCCESSOR_TOKENS)[np.random.default_rng(1).integers(0, 16, (1, 12))]


def _successor_seq() -> np.ndarray:
    """SUCCESSOR_PROMPT continued by N_NEW tokens of the circuit's rule: [1, 12 + N_NEW]."""
    seq = [int(x) for x in SUCCESSOR_PROMPT[0]]
    for _ in range(N_NEW):
        seq.append(successor_rule(seq))
    return np.asarray([seq])


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = make_checkpoint(kind.split("-")[0],
                                         str(tmp_path_factory.mktemp(f"nvfp4-{kind}")),
                                         init=0.1 if kind.endswith("-wide") else 0.02,
                                         successor=kind.endswith("-successor"))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def loaded(checkpoint_dir):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = models.load_model(checkpoint_dir(kind))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def reference(checkpoint_dir):
    cache = {}

    def get(kind, w4a4, dtype="float32"):
        key = (kind, w4a4, dtype)
        if key not in cache:
            cache[key] = HFReference(checkpoint_dir(kind), dtype, w4a4)
        return cache[key]

    return get


def _bound(reference, kind, w4a4, ids):
    """(HF fp32 logits, max-abs bound, rms bound) for ``ids`` (see the module docstring)."""
    r32 = reference(kind, w4a4).logits(ids)
    d16 = reference(kind, w4a4, "bfloat16").logits(ids) - r32
    c = 3.0 if w4a4 else 2.0
    return r32, c * float(np.abs(d16).max()), 1.5 * float(np.sqrt(np.mean(d16 ** 2)))


#: nn.linear compiled once (eager calls compile every op separately, hundreds on the CPU)
_jit_linear = jax.jit(lambda p, x: nn.linear(p, x, backend="xla"))
_jit_quantize_experts = jax.jit(nj.quantize_experts, static_argnums=1)


def _ours(model, ids, w4a4):
    cache = models.init_cache(model.config, ids.shape[0], ids.shape[1])
    logits, _ = models.prefill(model, jnp.asarray(ids, jnp.int32), cache, all_logits=True,
                               w4a4=w4a4)
    return np.asarray(logits, np.float64)


@pytest.mark.parametrize("kind,w4a4", CASES)
def test_logits_match_hf_within_bound(loaded, reference, kind, w4a4):
    r32, bound, rms_bound = _bound(reference, kind, w4a4, PROMPT)
    ours = _ours(loaded(kind), PROMPT, w4a4)
    err = float(np.abs(ours - r32).max())
    rms = float(np.sqrt(np.mean((ours - r32) ** 2)))
    assert 0 < bound < 0.5 * float(np.abs(r32).max())  # the bound is informative
    assert err <= bound, f"{kind} w4a4={w4a4}: max |ours - HF fp32| = {err:.4g} > {bound:.4g}"
    assert rms <= rms_bound, f"{kind} w4a4={w4a4}: rms {rms:.4g} > bound {rms_bound:.4g}"


@pytest.mark.parametrize("kind,w4a4", CASES)
def test_greedy_32_tokens_match_hf(loaded, reference, kind, w4a4):
    model = loaded(kind)
    prompt = PROMPT[:1]
    gen = models.generate(model, prompt, N_NEW, w4a4=w4a4, warmup=False)
    assert gen.tokens.shape == (1, N_NEW)
    seq = np.concatenate([prompt, gen.tokens], axis=1)
    t = prompt.shape[1]
    # our KV-cache decode == our full-sequence forward, token for token
    assert (np.argmax(_ours(model, seq, w4a4)[0, t - 1:-1], -1) == gen.tokens[0]).all()
    r32, bound, _ = _bound(reference, kind, w4a4, seq)
    ref = r32[0, t - 1:-1]
    best = ref.max(-1)
    ours_logit = ref[np.arange(N_NEW), gen.tokens[0]]
    gap = best - ours_logit  # 0 where our token is the reference's argmax
    same = int((gap == 0).sum())
    assert (gap <= bound).all(), (f"{kind} w4a4={w4a4}: token differs from HF's argmax by a "
                                  f"margin {gap.max():.4g} > bound {bound:.4g}")
    assert same >= N_NEW // 2, f"only {same}/{N_NEW} tokens equal HF's argmax"


@pytest.mark.parametrize("kind,w4a4", SUCCESSOR_CASES)
def test_greedy_32_tokens_identical_to_hf(loaded, reference, kind, w4a4):
    """The issue's claim, literally: 32 free-running greedy tokens equal HF fp32's, on a
    checkpoint whose every step is decided by a margin above the logit bound. HF's argmax
    after each prefix of ours equal to our token at every step is, by induction, HF's own
    free-running greedy output (one HF forward instead of 32)."""
    prompt = SUCCESSOR_PROMPT
    t = prompt.shape[1]
    ours = models.generate(loaded(kind), prompt, N_NEW, w4a4=w4a4, warmup=False).tokens[0]
    seq = np.concatenate([prompt, ours[None]], axis=1)
    r32, bound, _ = _bound(reference, kind, w4a4, seq)
    ref = r32[0, t - 1:-1]
    want = np.argmax(ref, axis=-1)
    # the checkpoint is what it claims: HF follows the circuit's rule, with many distinct tokens
    assert want.tolist() == [successor_rule(seq[0, :i]) for i in range(t, t + N_NEW)]
    assert len(set(want.tolist())) >= 8
    # precondition (so identity is a fair demand): every step's top-1/top-2 margin > the bound
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    assert 0 < bound < margin.min(), f"{kind}: margin {margin.min():.4g} <= bound {bound:.4g}"
    np.testing.assert_array_equal(ours, want, err_msg=f"{kind} w4a4={w4a4}: greedy tokens")


@pytest.mark.parametrize("kind,w4a4", SUCCESSOR_CASES)
def test_greedy_identical_through_the_decode_attention_kernel(loaded, reference, kind, w4a4,
                                                              monkeypatch):
    """The same 32 free-running tokens with every decode step's attention in
    ``attention.decode_attention`` (interpreted here; what GPUs run), prefill in XLA's."""
    from nvfp4_jax.models import decoder

    calls = []

    def always(*a):
        calls.append(a)
        return True

    monkeypatch.setattr(decoder, "runs_kernel", always)
    jax.clear_caches()  # the steps are traced anew, through the kernel
    try:
        ours = models.generate(loaded(kind), SUCCESSOR_PROMPT, N_NEW, w4a4=w4a4,
                               warmup=False).tokens[0]
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert calls, "the decode step did not ask for the kernel"
    np.testing.assert_array_equal(ours, _successor_seq()[0, SUCCESSOR_PROMPT.shape[1]:],
                                  err_msg=f"{kind} w4a4={w4a4}: greedy tokens via the kernel")


def _fold_report(loaded, reference, kind, prompt):
    """(folded model, stats, {ours, cutedsl_b12x: (max, rms) vs HF fp32}, bound, rms bound)."""
    model = loaded(kind)
    folded, stats = models.fold_cutedsl_b12x(model)
    r32, bound, rms_bound = _bound(reference, kind, True, prompt)
    errs = {}
    for name, m in (("ours", model), ("cutedsl_b12x", folded)):
        d = _ours(m, prompt, True) - r32
        errs[name] = (float(np.abs(d).max()), float(np.sqrt(np.mean(d ** 2))))
    sub, flushed, blocks = (sum(getattr(s, k) for s in stats)
                            for k in ("subnormal", "flushed", "blocks"))
    worst = min(stats, key=lambda s: s.w_scale_2)
    parts = []
    for layer, fc in sorted({(s.layer, s.fc) for s in stats}):
        ss = [s for s in stats if (s.layer, s.fc) == (layer, fc)]
        parts.append(f"layer {layer} {fc}: " + ", ".join(
            f"e{s.expert} {s.subnormal}+{s.flushed}/{s.blocks}" for s in ss))
    print(f"\n{kind}, W4A4, logits - HF fp32 (bound {bound:.3g} max, {rms_bound:.3g} rms): "
          f"ours max {errs['ours'][0]:.3g} rms {errs['ours'][1]:.3g}; CUTEDSL-b12x folded max "
          f"{errs['cutedsl_b12x'][0]:.3g} rms {errs['cutedsl_b12x'][1]:.3g}; folded block "
          f"scales: {sub}/{blocks} subnormal, {flushed} flushed; smallest w_scale_2 "
          f"{worst.w_scale_2:.3g} (layer {worst.layer} {worst.fc} expert {worst.expert}: "
          f"{worst.subnormal} subnormal, {worst.flushed} flushed of {worst.blocks}); per "
          "expert, subnormal+flushed/blocks: " + "; ".join(parts))
    return folded, stats, errs, bound, rms_bound


def test_cutedsl_b12x_folding_moves_logits(loaded, reference, checkpoint_dir):
    """TensorRT-LLM's CUTEDSL-b12x folding (weight_scale_2 into the E4M3 block scales): the
    folded scales are E4M3(scale * weight_scale_2) of the checkpoint's bytes; where the experts
    decide the output (the successor circuit's lookup table), the subnormal folded scales move
    the logits beyond the bound ours keep. On the random MoE checkpoint every block folds to a
    subnormal too, but its experts add little to the logits (reported, not asserted)."""
    from nvfp4_jax import checkpoint as ckpt

    _fold_report(loaded, reference, "moe", PROMPT)
    kind = "moe-successor"
    folded, stats, errs, bound, rms_bound = _fold_report(loaded, reference, kind,
                                                         _successor_seq())
    assert len(stats) == 2 * 2 * 4  # layers x (fc1, fc2) x experts
    # layer 0, expert 3's down_proj (the lookup table), folded by hand from the checkpoint
    # (TRT-LLM's fp32 factor alpha * input_scale, ml_dtypes' round-to-nearest-even E4M3 cast)
    ck = ckpt.load(checkpoint_dir(kind))
    pre = "model.layers.0.mlp.experts"
    lin = ck.linear(f"{pre}.3.down_proj")
    g = np.float32(1) / max(np.float32(ck.linear(f"{pre}.{e}.down_proj").input_scale)
                            for e in range(4))
    ws2 = (np.float32(1) / (g * (np.float32(1) / np.float32(lin.weight_scale_2)))) * g
    raw = np.asarray(lin.weight_scale).view(jnp.float8_e4m3fn).astype(np.float32)
    want = (raw * ws2).astype(jnp.float8_e4m3fn)
    got = np.asarray(folded.groups[0]["moe"].fc2.scales[0, 3])
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert float(folded.groups[0]["moe"].fc2.decode_scale[0, 3]) == 1.0
    mine = next(s for s in stats if (s.layer, s.fc, s.expert) == (0, "fc2", 3))
    wv = want.astype(np.float32)
    assert mine.flushed == int(((raw != 0) & (wv == 0)).sum())
    assert mine.subnormal == int(((raw != 0) & (wv > 0) & (wv < 2.0**-6)).sum()) > 0
    assert errs["ours"][0] <= bound and errs["ours"][1] <= rms_bound
    assert errs["cutedsl_b12x"][0] > bound and errs["cutedsl_b12x"][1] > rms_bound


def test_loader_keeps_weights_nvfp4(loaded, checkpoint_dir):
    from nvfp4_jax import checkpoint as ckpt

    model = loaded("moe")
    ck = ckpt.load(checkpoint_dir("moe"))
    layer = model.groups[0]
    # ModelOpt's export gives q/k/v one weight_scale_2 and input_scale: loaded as one linear
    qkv = layer["self_attn"]["qkv_proj"]
    assert isinstance(qkv, nn.Linear) and isinstance(qkv.w, NVFP4Array)
    assert qkv.w.codes.dtype == jnp.uint8 and qkv.w.scales.dtype == jnp.float8_e4m3fn
    # the bytes on the device are the checkpoint's (layer 1 of the stacked group), q then k, v
    raw = [ck.get(f"model.layers.1.self_attn.{n}_proj.weight") for n in "qkv"]
    np.testing.assert_array_equal(np.asarray(qkv.w.codes[1]), np.concatenate(raw))
    scale2 = [ck.get(f"model.layers.1.self_attn.{n}_proj.weight_scale_2") for n in "qkv"]
    assert float(qkv.w.decode_scale[1]) == float(np.asarray(scale2[0]).reshape(()))
    moe = layer["moe"]
    # stacked over the group's 2 layers: [layers, E, R, H], one decode scale per layer and expert
    assert moe.fc1.shape == (2, 4, 64, 64) and moe.fc1.decode_scale.shape == (2, 4)
    up = ck.get("model.layers.0.mlp.experts.2.up_proj.weight")
    np.testing.assert_array_equal(np.asarray(moe.fc1.codes[0, 2, :32]), up)  # rows [up; gate]


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_steps_carry_no_effects(loaded, kind):
    """The jitted prefill and decode step hold no effect, so each call takes jit's C++
    dispatch (an effect, e.g. a checkify check, sends every call through JAX's Python
    dispatch, host time that a batch-1 decode step cannot hide)."""
    model = loaded(kind)
    cache = models.init_cache(model.config, 1, 8)
    tok = jnp.zeros((1,), jnp.int32)
    assert jax.make_jaxpr(lambda m, t, c: models.decode_step(m, t, c))(model, tok, cache).effects == set()
    assert jax.make_jaxpr(lambda m, t, c: models.prefill(m, t, c))(
        model, jnp.zeros((1, 4), jnp.int32), cache).effects == set()


def test_sampling(loaded):
    # wide margins, so a cold temperature samples the greedy tokens (no exact bf16 ties); N_NEW
    # tokens after a [1, 12] prompt: the shapes the greedy tests compiled already
    model, p = loaded("dense-successor"), SUCCESSOR_PROMPT
    greedy = models.generate(model, p, N_NEW, warmup=False).tokens
    cold = models.generate(model, p, N_NEW, temperature=1e-6, seed=3, warmup=False).tokens
    np.testing.assert_array_equal(cold, greedy)
    a = models.generate(model, p, N_NEW, temperature=5.0, seed=1, warmup=False).tokens
    b = models.generate(model, p, N_NEW, temperature=5.0, seed=1, warmup=False).tokens
    c = models.generate(model, p, N_NEW, temperature=5.0, seed=2, warmup=False).tokens
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    with pytest.raises(ValueError, match="prompt"):
        models.generate(model, np.array([[1, 999]]), 2)
    with pytest.raises(ValueError, match="temperature"):
        models.sample(jnp.zeros((1, 4)), None, -1.0)


def test_linear_and_quantize_experts_match_oracle():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 32, 64)).astype(np.float32)
    stack = _jit_quantize_experts(jnp.asarray(w), "modelopt")
    assert stack.shape == (3, 32, 64) and stack.decode_scale.shape == (3,)
    for e in range(3):
        want = oracle.quantize(w[e], "modelopt")
        np.testing.assert_array_equal(np.asarray(stack.codes[e]), want.codes)
        assert float(stack.decode_scale[e]) == float(np.float32(want.decode_scale))
    t = oracle.quantize(w[0], "trtllm")
    scales = jnp.asarray(t.scales).view(jnp.float8_e4m3fn)
    lin = nn.Linear(NVFP4Array.from_parts(jnp.asarray(t.codes), scales,
                                          jnp.float32(t.decode_scale)))
    x = rng.standard_normal((5, 64)).astype(jnp.bfloat16)
    got = np.asarray(_jit_linear(lin, jnp.asarray(x)), np.float64)
    want = np.asarray(x, np.float64) @ oracle.dequantize(t).T
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-6)


def test_cli_generate(checkpoint_dir, loaded, tmp_path, capsys):
    import json
    import shutil

    from nvfp4_jax.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0 and "usage: nvfp4 generate" in capsys.readouterr().out
    src = checkpoint_dir("dense")
    ids = [int(i) for i in PROMPT[0]]
    out = tmp_path / "gen.json"
    assert main(["generate", "--checkpoint", src, "--prompt-ids", ",".join(map(str, ids)),
                 "--max-new-tokens", str(N_NEW), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    want = models.generate(loaded("dense"), PROMPT[:1], N_NEW, warmup=False).tokens[0]
    assert res["new_ids"] == [int(t) for t in want] and res["text"] is None
    cap = capsys.readouterr()
    assert ",".join(map(str, want)) in cap.out
    assert "loaded layer 2/2" in cap.err and f"decode: {N_NEW} tokens" in cap.err
    assert main(["generate", "--checkpoint", src, "--prompt", "hi"]) == 2
    assert "--prompt needs a tokenizer" in capsys.readouterr().err
    # with a tokenizer: text in, text out
    ck = tmp_path / "with-tok"
    shutil.copytree(src, ck)
    save_char_tokenizer(str(ck))
    text = "".join(chr(0x100 + i) for i in ids)
    assert main(["generate", "--checkpoint", str(ck), "--prompt", text, "--max-new-tokens", str(N_NEW),
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prompt_ids"] == ids and res["new_ids"] == [int(t) for t in want]
    assert res["text"].replace(" ", "") == "".join(chr(0x100 + int(i)) for i in want)
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2


#: a chat template over the char tokenizer: U+0101 (id 1) opens a user turn, U+0102 (id 2)
#: closes it, U+0103 (id 3) opens the assistant's
CHAT = ("{% for m in messages %}\u0101{{ m['content'] }}\u0102{% endfor %}"
        "{% if add_generation_prompt %}\u0103{% endif %}")


def test_cli_generate_chat_and_end_tokens(checkpoint_dir, loaded, tmp_path, capsys):
    """``--chat`` wraps the prompt in the tokenizer's chat template (ids 1, prompt, 2, 3);
    generation ends at the first of generation_config.json's end tokens (a list) and the
    tokenizer's; ``--chat`` without a template or with ``--prompt-ids``, and a malformed
    eos_token_id, end with exit 2 and one line."""
    import json
    import shutil

    from nvfp4_jax.cli import main

    ck = tmp_path / "chat"
    shutil.copytree(checkpoint_dir("dense"), ck)
    save_char_tokenizer(str(ck), chat_template=CHAT)
    ids = [int(i) for i in PROMPT[0]]
    chat_ids = [1, *ids, 2, 3]
    want = [int(t) for t in models.generate(loaded("dense"), [chat_ids], 12,
                                            warmup=False).tokens[0]]
    stop = next(t for t in want[3:] if t not in want[:3] and t != 255)  # not <unk>
    cut = want.index(stop)
    other = next(i for i in range(4, 255) if i not in want)
    # the engine checks the end tokens every 8 steps: it stops at the first check after one
    early = models.generate(loaded("dense"), [chat_ids], 24, warmup=False, eos_id=[other, stop])
    assert early.tokens.shape[1] == 8 * (cut // 8 + 1)
    assert list(early.tokens[0][:cut + 1]) == want[:cut + 1]
    with open(ck / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [other, stop]}, f)
    out = tmp_path / "gen.json"
    text = "".join(chr(0x100 + i) for i in ids)
    assert main(["generate", "--checkpoint", str(ck), "--prompt", text, "--chat",
                 "--max-new-tokens", "12", "--json", str(out)]) == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["prompt_ids"] == chat_ids and res["chat"] is True
    assert res["eos_ids"] == [other, stop]
    assert res["new_ids"] == want[:cut + 1]
    # without --chat: the plain prompt
    assert main(["generate", "--checkpoint", str(ck), "--prompt", text, "--max-new-tokens", "2",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prompt_ids"] == ids
    capsys.readouterr()
    bad = [(["--prompt-ids", "1,2", "--chat"], "--chat: needs --prompt")]
    plain = tmp_path / "plain"
    shutil.copytree(checkpoint_dir("dense"), plain)
    save_char_tokenizer(str(plain))
    bad.append(([ "--prompt", text, "--chat"], "has no chat_template"))
    for argv, needle in bad:
        d = plain if "has no" in needle else ck
        assert main(["generate", "--checkpoint", str(d), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1] and err[-1].startswith("nvfp4 generate: "), err
    with open(ck / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": "7"}, f)
    assert main(["generate", "--checkpoint", str(ck), "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "generation_config.json: eos_token_id" in err and "'7'" in err, err


def test_linear_w4a4_and_moe_block_match_oracle():
    """nn.linear with an input_scale is W4A4 (TensorRT-LLM), and nn.moe_block routes softmax
    top-k (renormalized) and applies silu(gate) * up to fc1 rows [up; gate] - against the
    oracle, at magnitudes where SwiGLU is far from linear."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 64)) * 2).astype(jnp.bfloat16)
    xf = np.asarray(x, np.float64)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    t = oracle.quantize(w, "trtllm")
    s_in = np.float32(np.abs(xf).max() / 2688)
    lin = nn.Linear(NVFP4Array.from_parts(jnp.asarray(t.codes),
                                          jnp.asarray(t.scales).view(jnp.float8_e4m3fn),
                                          jnp.float32(t.decode_scale)), jnp.float32(s_in))
    xq = oracle.dequantize(oracle.quantize(xf, "trtllm", encode_scale=float(np.float32(1) / s_in)),
                           include_decode_scale=False) * float(s_in)
    want = xq @ oracle.dequantize(t).T
    got = np.asarray(_jit_linear(lin, jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-3 * np.abs(want).max())
    assert np.abs(got - xf @ oracle.dequantize(t).T).max() > 10 * np.abs(got - want).max()

    e, i, k = 4, 32, 2
    gate = rng.standard_normal((e, i, 64)).astype(np.float32) * 0.3
    up = rng.standard_normal((e, i, 64)).astype(np.float32) * 0.3
    down = rng.standard_normal((e, 64, i)).astype(np.float32) * 0.3
    fc1 = _jit_quantize_experts(jnp.asarray(np.concatenate([up, gate], axis=1)), "trtllm")
    fc2 = _jit_quantize_experts(jnp.asarray(down), "trtllm")
    router = rng.standard_normal((e, 64)).astype(jnp.bfloat16)
    s1 = np.full(e, np.abs(xf).max() / 2688, np.float32)
    s2 = np.full(e, 40.0 / 2688, np.float32)
    p = nn.MoE(jnp.asarray(router), fc1, fc2, jnp.asarray(s1), jnp.asarray(s2), top_k=k)
    got = np.asarray(jax.jit(nn.moe_block, static_argnames="backend")(p, jnp.asarray(x),
                                                                      backend="xla"), np.float64)
    logits = np.asarray((xf @ np.asarray(router, np.float64).T).astype(jnp.bfloat16), np.float64)
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    ids = np.argsort(-prob, axis=-1)[:, :k]
    wts = np.take_along_axis(prob, ids, -1)
    wts = (wts / wts.sum(-1, keepdims=True)).astype(np.float32)

    def stack(a):
        return oracle.NVFP4(np.asarray(a.codes), np.asarray(a.scales).view(np.uint8),
                            np.asarray(a.decode_scale, np.float64))

    want = oracle.moe(xf, ids, wts, stack(fc1), stack(fc2), s1.astype(np.float64),
                      s2.astype(np.float64), activation="swiglu", gate_up_order="up_gate")
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=2.0**-7 * np.abs(want).max())
