"""``nvfp4_jax.attention.decode_attention``: one query token against a stacked KV cache, read in
place, against float64 attention over the same bf16 q, k, v; and the decoders' XLA attention
(``attention.cache_attention``) likewise.

Bound, for both: ``oracle.decode_attention_error_bound`` (derived in ``oracle/attention.py``:
the scores' fp32 accumulation, ``exp``, bf16 probabilities, fp32 sums and combine, bf16
output).

Faults the test catches (each tried once by breaking the kernel): slots past ``lengths[b]`` hold
NaN (a kernel reading one answers NaN); every other layer of the stack holds other data (a
kernel reading the wrong layer breaks the bound by orders of magnitude); lengths cross chunk
and block edges; GQA groups of 1 to 16 query heads per kv head (a wrong head mapping).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from nvfp4_jax import attention
from nvfp4_jax.device import pallas_interpret


def _case(seed, n_layers, b, s, kvh, g, d, scale, lengths):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, kvh * g, d)) * scale
    k = rng.standard_normal((n_layers, b, s, kvh, d)) * scale
    v = rng.standard_normal((n_layers, b, s, kvh, d)) * 10.0 ** rng.uniform(-3, 3)
    for bi, n in enumerate(lengths):  # never read: NaN shows a read past the written positions
        k[:, bi, n:] = np.nan
        v[:, bi, n:] = np.nan
    return tuple(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))


def _check(got, q, k, v, layer, lengths):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "NaN/inf in the output: a read past lengths[b]"
    want, bound = oracle.decode_attention_error_bound(
        *(np.asarray(a, np.float64) for a in (q, k[layer], v[layer])), lengths)
    excess = np.abs(got - want) - bound
    assert (excess <= 0).all(), (f"max |err| - bound = {excess.max():.3g} at "
                                 f"{np.unravel_index(np.argmax(excess), excess.shape)}")


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 3), s=st.integers(1, 300),
       kvh=st.sampled_from([1, 2, 4]), g=st.sampled_from([1, 2, 4, 8, 16]),
       d=st.sampled_from([16, 64, 128]), scale=st.sampled_from([0.05, 1.0, 4.0]),
       data=st.data())
def test_decode_attention_within_bound_of_float64(seed, b, s, kvh, g, d, scale, data):
    n_layers = 3
    layer = data.draw(st.integers(0, n_layers - 1))
    edges = [1, s, min(s, 64), min(s, 65), min(s, 128)]
    lengths = [data.draw(st.one_of(st.sampled_from(edges), st.integers(1, s))) for _ in range(b)]
    q, k, v = _case(seed, n_layers, b, s, kvh, g, d, scale, lengths)
    got = attention.decode_attention(q, k, v, jnp.int32(layer), jnp.asarray(lengths, jnp.int32),
                                     interpret=pallas_interpret())
    _check(got, q, k, v, layer, lengths)


def test_decode_attention_many_chunks_and_an_empty_tail():
    """Capacity 1000 at batch 1 and one kv head: 16 chunks of 64 keys, the last 12 of them
    past lengths (empty: their maxima stay at the finite start, their weight exp(...) is 0)."""
    q, k, v = _case(7, 2, 1, 1000, 1, 4, 64, 1.0, [250])
    assert attention.chunking(1, 1, 1000) == 64
    got = attention.decode_attention(q, k, v, 1, jnp.asarray([250], jnp.int32),
                                     interpret=pallas_interpret())
    _check(got, q, k, v, 1, [250])


def test_decode_attention_combines_more_chunks_than_one_step_holds():
    """Capacity 2560 at batch 2 and one kv head: 40 chunks of 64 keys, more than a combine
    program adds in one step (COMBINE_CHUNKS): sequence 0's keys end in the second step's
    first chunk (the rest empty), sequence 1's fill both steps."""
    lengths = [2100, 2560]
    assert attention.chunking(2, 1, 2560) == 64 and 2560 // 64 > attention.COMBINE_CHUNKS
    q, k, v = _case(11, 1, 2, 2560, 1, 4, 16, 1.0, lengths)
    got = attention.decode_attention(q, k, v, 0, jnp.asarray(lengths, jnp.int32),
                                     interpret=pallas_interpret())
    _check(got, q, k, v, 0, lengths)


def test_decode_attention_chunks_of_several_blocks():
    """Batch 8 of 8 kv heads: 4 chunks of 128 keys, two blocks each (the running maximum's
    rescale of the first block's sums), lengths ending in either block or exactly at one's edge."""
    lengths = [1, 64, 65, 127, 128, 129, 200, 300]
    assert attention.chunking(8, 8, 300) == 128
    q, k, v = _case(5, 2, 8, 300, 8, 2, 16, 4.0, lengths)
    got = attention.decode_attention(q, k, v, 0, jnp.asarray(lengths, jnp.int32),
                                     interpret=pallas_interpret())
    _check(got, q, k, v, 0, lengths)


def test_decode_attention_scores_in_the_thousands():
    """q, k ~ N(0, 32^2): scores of order +-1000, whose exp overflows fp32 unless every
    exponent is taken against the maximum (the chunks' running one, then the combine's)."""
    lengths = [300, 77]
    q, k, v = _case(9, 1, 2, 300, 2, 4, 64, 32.0, lengths)
    got = attention.decode_attention(q, k, v, 0, jnp.asarray(lengths, jnp.int32),
                                     interpret=pallas_interpret())
    _check(got, q, k, v, 0, lengths)


def test_a_traced_length_past_the_cache_reads_only_its_own_slots():
    """Under jit a length cannot be checked: lengths[0] = S + 10 attends sequence 0's S = 100
    slots (its second chunk of 64 keys reaches past them into sequence 1's rows, NaN past its
    length 1: a read of one shows)."""
    q, k, v = _case(13, 2, 2, 100, 2, 4, 32, 1.0, [100, 1])
    assert attention.chunking(2, 2, 100) == 64
    got = jax.jit(functools.partial(attention.decode_attention, interpret=pallas_interpret()))(
        q, k, v, jnp.int32(1), jnp.asarray([110, 1], jnp.int32))
    _check(got, q, k, v, 1, [100, 1])


def test_traced_out_of_range_layer_and_empty_lengths_stay_inside_the_stack():
    """Traced, nothing can raise: layer 5 of 3 reads layer 2 (the nearest), never rows past
    the stack; a length 0 gives NaN for its sequence alone."""
    lengths = [40, 7]
    q, k, v = _case(17, 3, 2, 64, 2, 4, 32, 1.0, lengths)
    f = jax.jit(functools.partial(attention.decode_attention, interpret=pallas_interpret()))
    _check(f(q, k, v, jnp.int32(5), jnp.asarray(lengths, jnp.int32)), q, k, v, 2, lengths)
    got = np.asarray(f(q, k, v, jnp.int32(0), jnp.asarray([0, 7], jnp.int32)), np.float32)
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 2), t=st.integers(1, 4),
       s=st.integers(4, 200), kvh=st.sampled_from([1, 2, 4]), g=st.sampled_from([1, 2, 8]),
       d=st.sampled_from([16, 64, 128]), scale=st.sampled_from([0.05, 1.0, 4.0, 32.0]),
       data=st.data())
def test_xla_cache_attention_within_the_same_bound(seed, b, t, s, kvh, g, d, scale, data):
    """The decoders' XLA attention (prefill, and decode off the kernel), T query tokens at
    consecutive positions: each query against the oracle over its causal prefix. Keys after
    a query (its block's later tokens, then +-1e4 past the last one) break the bound if read."""
    rng = np.random.default_rng(seed)
    t = min(t, s)
    start = np.array([data.draw(st.integers(0, s - t)) for _ in range(b)])
    pos = start[:, None] + np.arange(t)[None, :]  # [B, T]
    bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
    q = bf16(rng.standard_normal((b, t, kvh * g, d)) * scale)
    k = bf16(rng.standard_normal((b, s, kvh, d)) * scale)
    v = bf16(rng.standard_normal((b, s, kvh, d)) * 10.0 ** rng.uniform(-3, 3))
    for bi in range(b):
        k[bi, pos[bi, -1] + 1:] = 1e4
        v[bi, pos[bi, -1] + 1:] = -1e4
    got = attention.cache_attention(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)),
                                    jnp.asarray(pos, jnp.int32))
    got = np.asarray(got.astype(jnp.float32), np.float64).reshape(b * t, kvh * g, d)
    want, bound = oracle.decode_attention_error_bound(
        q.reshape(b * t, kvh * g, d), np.repeat(k, t, axis=0), np.repeat(v, t, axis=0),
        pos.reshape(-1) + 1)
    excess = np.abs(got - want) - bound
    assert np.isfinite(got).all() and (excess <= 0).all(), excess.max()


def test_runs_kernel_only_off_the_xla_backend_and_on_supported_heads():
    assert attention.runs_kernel("xla", 64, 8, 2) is False
    assert attention.runs_kernel("pallas", 64, 8, 2) is True  # interpreted off the GPU
    assert attention.runs_kernel("pallas", 48, 8, 2) is False
    assert attention.runs_kernel("pallas", 8, 8, 2) is False


@pytest.mark.parametrize("args,expect", [
    ({"q": (2, 8, 64), "k": (3, 2, 40, 2, 64)}, None),
    ({"q": (2, 8, 64), "k": (3, 2, 40, 3, 64)}, "not a multiple"),
    ({"q": (2, 8, 64), "k": (3, 1, 40, 2, 64)}, "k_cache"),
    ({"q": (2, 8, 48), "k": (3, 2, 40, 2, 48)}, "power of two"),
    ({"q": (2, 8), "k": (3, 2, 40, 2, 64)}, "q: expected"),
])
def test_bad_shapes_name_the_argument(args, expect):
    q = jnp.zeros(args["q"], jnp.bfloat16)
    k = jnp.zeros(args["k"], jnp.bfloat16)
    lengths = jnp.ones((2,), jnp.int32)
    if expect is None:
        out = attention.decode_attention(q, k, k, 0, lengths, interpret=True)
        assert out.shape == q.shape and np.isfinite(np.asarray(out, np.float32)).all()
        return
    with pytest.raises(ValueError, match=expect):
        attention.decode_attention(q, k, k, 0, lengths, interpret=True)


def test_bad_lengths_and_dtypes():
    q = jnp.zeros((2, 8, 64), jnp.bfloat16)
    k = jnp.zeros((3, 2, 40, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="lengths"):
        attention.decode_attention(q, k, k, 0, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="v_cache"):
        attention.decode_attention(q, k, k[:, :, :20], 0, jnp.ones((2,), jnp.int32))
    for lengths in ([0, 1], [1, 41]):
        with pytest.raises(ValueError, match=r"lengths: expected 1 <= lengths\[b\] <= S = 40"):
            attention.decode_attention(q, k, k, 0, jnp.asarray(lengths, jnp.int32))
    for layer in (-1, 3):
        with pytest.raises(ValueError, match="layer: expected 0 <= layer < L = 3"):
            attention.decode_attention(q, k, k, layer, jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="layer: expected an integer scalar"):
        attention.decode_attention(q, k, k, 1.0, jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="q: expected bf16"):
        attention.decode_attention(q.astype(jnp.float32), k, k, 0, jnp.ones((2,), jnp.int32))


@pytest.mark.gpu
def test_gpu_decode_attention_within_bound_at_model_shapes():
    """Llama-3-8B (32 / 8 heads) and Qwen3-30B-A3B (32 / 4) heads, head_dim 128, a 2048-slot
    cache of 4 layers, batch 1 and 8, lengths from 1 to full, compiled for the GPU."""
    if pallas_interpret():
        pytest.skip("needs a GPU (compiled Pallas-Triton)")
    for kvh, b, lengths in ((8, 1, [1]), (8, 1, [1500]), (4, 8, [1, 63, 64, 65, 700, 2048,
                                                                  1024, 2000])):
        q, k, v = _case(11, 4, b, 2048, kvh, 32 // kvh, 128, 1.0, lengths)
        got = jax.jit(attention.decode_attention)(q, k, v, jnp.int32(2),
                                                  jnp.asarray(lengths, jnp.int32))
        _check(got, q, k, v, 2, lengths)
