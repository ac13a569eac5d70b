"""Sampling in ``models.generate``: temperature, then top-k, then top-p, as transformers does.

``models.filter_logits`` against transformers' own ``TopKLogitsWarper`` and
``TopPLogitsWarper`` (transformers 5.24.0, constraints.txt) on random scores at several
magnitudes with ties at the k-th value; ``models.sample`` draws only kept tokens; bad
settings are refused by name, in the library and in ``nvfp4 generate``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax import models
from nvfp4_jax.cli import main

torch = pytest.importorskip("torch")
logits_process = pytest.importorskip("transformers.generation.logits_process")


def _scores(seed: int, scale: float) -> np.ndarray:
    """fp32 [4, 256] scores; row 0 repeats its 5th largest value 3 times (ties at k = 5)."""
    rng = np.random.default_rng(seed)
    s = (rng.standard_normal((4, 256)) * scale).astype(np.float32)
    kth = np.sort(s[0])[-5]
    s[0, rng.choice(np.flatnonzero(s[0] < kth), 3, replace=False)] = kth
    return s


def _hf(scores: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    t = torch.from_numpy(scores.copy())
    if top_k:
        t = logits_process.TopKLogitsWarper(top_k)(None, t)
    if top_p < 1:
        t = logits_process.TopPLogitsWarper(top_p)(None, t)
    return t.numpy()


def _near_the_nucleus_edge(scores: np.ndarray, top_k: int, top_p: float) -> bool:
    """Whether a cumulative probability (float64, after top-k) lies within 1e-5 of 1 - top_p,
    where fp32 sums in another order could keep or drop a token differently (top_p < 1)."""
    if top_p == 1:
        return False
    s = _hf(scores, top_k, 1.0).astype(np.float64)
    srt = np.sort(s, axis=-1)
    p = np.exp(srt - srt.max(-1, keepdims=True))
    cum = np.cumsum(p / p.sum(-1, keepdims=True), axis=-1)
    return bool(np.any(np.abs(cum[:, :-1] - (1 - top_p)) < 1e-5))  # the largest is kept


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (50, 1.0), (0, 0.3), (0, 0.9),
                                         (0, 0.95), (5, 0.5), (50, 0.9), (256, 0.99),
                                         (0, 1e-9)])  # the largest alone
def test_filter_is_transformers(scale, top_k, top_p):
    scores = _scores(int(scale * 10) + top_k, scale)
    assert not _near_the_nucleus_edge(scores, top_k, top_p)
    want = np.isneginf(_hf(scores, top_k, top_p))
    got = np.asarray(jax.jit(models.filter_logits, static_argnums=(1, 2))(
        jnp.asarray(scores), top_k, top_p))
    np.testing.assert_array_equal(np.isneginf(got), want)
    np.testing.assert_array_equal(got[~want], scores[~want])  # kept scores unchanged
    assert want.any(axis=1).all() or (top_k in (0, 256) and top_p == 1)
    if (top_k, top_p) == (5, 1.0):  # the 3 ties with the 5th largest are kept: 4 + 4 in row 0
        assert (~np.isneginf(got[0])).sum() == 8


def test_sample_draws_only_kept_tokens():
    scores = _scores(1, 3.0)
    kept = ~np.isneginf(_hf(scores / 0.7, 5, 0.9))
    draws = np.stack([np.asarray(models.sample(jnp.asarray(scores), jax.random.key(i), 0.7,
                                               top_k=5, top_p=0.9)) for i in range(64)])
    assert all(kept[r, draws[:, r]].all() for r in range(4))
    assert any(len(set(draws[:, r])) > 1 for r in range(4))  # still a draw
    top1 = [np.asarray(models.sample(jnp.asarray(scores), jax.random.key(i), 2.0, top_k=1))
            for i in range(8)]
    for t in top1:
        np.testing.assert_array_equal(t, scores.argmax(-1))


@pytest.mark.parametrize("kw,needle", [
    ({"top_k": -1}, "top_k: expected an integer >= 0"), ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"), ({"top_p": 0.0}, "top_p: expected a number in (0, 1]"),
    ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"), ({"top_p": "x"}, "top_p"),
    ({"temperature": -1.0}, "temperature")])
def test_sample_refuses_bad_settings(kw, needle):
    args = {"temperature": 1.0, **kw}
    with pytest.raises(ValueError, match=f"^{needle[:6]}") as exc:
        models.sample(jnp.zeros((1, 8)), jax.random.key(0), **args)
    assert needle in str(exc.value)


@pytest.mark.parametrize("argv,needle", [(["--top-k", "-1"], "--top-k: expected an integer"),
                                         (["--top-p", "0"], "--top-p: expected a number"),
                                         (["--top-p", "1.01"], "--top-p")])
def test_cli_refuses_bad_settings_before_loading(argv, needle, tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1",
                 "--temperature", "0.7", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nvfp4 generate: ") and needle in err[0], err
