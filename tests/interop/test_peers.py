"""The oracle recipe named after each peer == the installed peer, byte for byte; and every
known disagreement between peers (cpu-peers.md sections 3/4) pinned by an assertion.

Peers that are not importable are skipped with the reason; a disagreement is always also
shown with the oracle recipes themselves (the recipe named after the peer vs another).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import nvfp4_blocks
from peer_facts import peer_fact

import oracle

MAGNITUDES = [2.0**-20, 3.7e-4, 0.02, 1.0, 7.3, 900.0, 2.0**18]


def _codes(t):
    return oracle.codes_of(t)


def _data(seed, d, rows=8, cols=128, **kw):
    return nvfp4_blocks(seed, rows * cols // 16, d, **kw).reshape(rows, cols)


def _u8(t):
    import torch

    return t.contiguous().view(torch.uint8).numpy()


def _assert_same(name, x, pq, ps, ref):
    np.testing.assert_array_equal(ps, ref.scales, err_msg=f"{name}: scale bytes")
    bad = np.argwhere(oracle.unpack_nibbles(pq) != _codes(ref))
    assert bad.size == 0, (
        f"{name}: {len(bad)} codes differ, first x={x[tuple(bad[0])]!r} peer "
        f"{oracle.unpack_nibbles(pq)[tuple(bad[0])]} oracle {_codes(ref)[tuple(bad[0])]}")


# ---------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------

def _modelopt(x, D):
    torch = pytest.importorskip("torch")
    nv = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor",
                             reason="nvidia-modelopt not installed")
    d = torch.tensor(D, dtype=torch.float32)
    q, s, _ = nv.NVFP4QTensor.quantize(torch.from_numpy(x.copy()), 16, weights_scaling_factor_2=d)
    return q._quantized_data.numpy(), _u8(s)


def _torchao(x, D):
    torch = pytest.importorskip("torch")
    t = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor",
                            reason="torchao not installed")
    s, q = t.nvfp4_quantize(torch.from_numpy(x.copy()), 16,
                            per_tensor_scale=torch.tensor(D, dtype=torch.float32))
    return q.numpy(), _u8(s)


def _torchao_tensor(x, D):
    torch = pytest.importorskip("torch")
    t = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor",
                            reason="torchao not installed")
    a = t.NVFP4Tensor.to_nvfp4(torch.from_numpy(x.copy()), block_size=16,
                               per_tensor_scale=torch.tensor(D, dtype=torch.float32),
                               is_swizzled_scales=False)
    return a.qdata.view(torch.uint8).numpy(), _u8(a.scale)


def _compressed_tensors(x, G):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    t = torch.from_numpy(x.copy())
    b = t.reshape(t.shape[0], -1, 16)
    g = torch.tensor([G], dtype=torch.float32)
    sc, _ = calculate_qparams(b.amin(-1), b.amax(-1), scheme.weights, global_scale=g)
    sd = NVFP4PackedCompressor.compress(
        {"weight": t, "weight_scale": sc, "weight_global_scale": g}, scheme)
    return sd["weight_packed"].numpy(), _u8(sd["weight_scale"])


def _jax_peer(x, D):
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize

    cfg = jax.nn.get_scaled_dot_general_config("nvfp4", global_scale=jnp.asarray([D], jnp.float32))
    q, s = quantize(jnp.asarray(x), cfg)
    codes = np.asarray(q).view(np.uint8) & 0xF
    return oracle.pack_nibbles(codes), np.asarray(s).view(np.uint8)


def _f32(v):
    return float(np.float32(v))


PEERS = {
    # name: (peer fn, oracle recipe, global-scale form the peer takes)
    "modelopt": (_modelopt, "modelopt", "decode"),
    "torchao": (_torchao, "torchao", "decode"),
    "torchao_tensor": (_torchao_tensor, "torchao", "decode"),
    "compressed_tensors": (_compressed_tensors, "compressed_tensors", "encode"),
    "jax": (_jax_peer, "jax", "decode"),
}


@pytest.mark.parametrize("peer", sorted(PEERS))
@pytest.mark.parametrize("mag", MAGNITUDES)
def test_oracle_recipe_matches_peer(peer, mag):
    """Random blocks (all kinds of conftest.nvfp4_blocks, block scales over E4M3's range)
    at global scales ~ mag: the oracle recipe named after the peer reproduces its bytes."""
    fn, recipe, form = PEERS[peer]
    for seed in range(4):
        d = _f32(mag * (1 + seed / 7))
        g = _f32(1.0 / d)
        x = _data(seed * 31 + int(np.log2(mag) + 40), d if form == "decode" else 1 / g,
                  bf16=bool(seed % 2))
        pq, ps = fn(x, d if form == "decode" else g)
        scale = d if form == "decode" else g
        ref = oracle.quantize(x.astype(np.float64), recipe, **{f"{form}_scale": scale})
        _assert_same(peer, x, pq, ps, ref)


@pytest.mark.parametrize("peer", ["modelopt", "torchao", "compressed_tensors", "jax"])
def test_oracle_recipe_matches_peer_plain_randn(peer):
    """Plain randn at several magnitudes with the peer's own amax-derived global scale."""
    fn, recipe, form = PEERS[peer]
    rng = np.random.default_rng(11)
    for mag in MAGNITUDES:
        x = (rng.standard_normal((16, 256)) * mag).astype(np.float32)
        amax = float(np.max(np.abs(x)))
        if form == "decode":
            g = oracle.decode_scale_from_amax(amax)
        else:
            g = oracle.encode_scale_from_amax(amax)
        pq, ps = fn(x, g)
        _assert_same(peer, x, pq, ps, oracle.quantize(x.astype(np.float64), recipe,
                                                      **{f"{form}_scale": g}))


# ---------------------------------------------------------------------------------------
# Casts: ml_dtypes and torch
# ---------------------------------------------------------------------------------------

OVERFLOW = np.array([449.0, 464.0, 465.0, 480.0, 1e6, np.inf, -500.0, -np.inf], np.float32)
#: float32 -> E4M3 bytes of OVERFLOW under each recorded overflow behaviour
OVERFLOW_BYTES = {"nan": [0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFF, 0xFF],
                  "saturate": [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]}


def test_oracle_overflow_policies_reproduce_nan_and_saturate():
    for policy, want in OVERFLOW_BYTES.items():
        assert oracle.e4m3_encode(OVERFLOW.astype(np.float64), policy).tolist() == want


def test_ml_dtypes_e4m3_overflow_is_the_recorded_one():
    import ml_dtypes

    want = OVERFLOW_BYTES[peer_fact("ml_dtypes", "e4m3_overflow")]
    assert OVERFLOW.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tolist() == want


def test_torch_e4m3_overflow_is_the_recorded_one():
    torch = pytest.importorskip("torch")
    want = OVERFLOW_BYTES[peer_fact("torch", "e4m3_overflow")]
    assert torch.from_numpy(OVERFLOW).to(torch.float8_e4m3fn).view(torch.uint8).tolist() == want


#: float64 values within 2^-40 of a float32-representable tie: rounding through float32 lands
#: on the tie (and rounds to even), rounding once does not
NEAR_TIES_E4M3 = np.array([2.0**-10 * (1 + 2.0**-40)])                   # once: 0x01, via f32: 0x00
NEAR_TIES_E2M1 = np.array([0.25 * (1 + 2.0**-40), 0.75 * (1 - 2.0**-40), 5 * (1 + 2.0**-40)])


def _float64_cast_reenacted(kind, v, encode):
    """A float64 cast as the peer does it: once (the oracle) or through float32 first."""
    if kind == "through_float32":
        v = v.astype(np.float32).astype(np.float64)
    return encode(v).tolist()


def test_float64_cast_reenactments_differ_near_ties():
    assert _float64_cast_reenacted("once", NEAR_TIES_E4M3, oracle.e4m3_encode) == [0x01]
    assert _float64_cast_reenacted("through_float32", NEAR_TIES_E4M3, oracle.e4m3_encode) == [0]
    assert _float64_cast_reenacted("once", NEAR_TIES_E2M1, oracle.e2m1_encode) == [1, 1, 7]
    assert _float64_cast_reenacted("through_float32", NEAR_TIES_E2M1,
                                   oracle.e2m1_encode) == [0, 2, 6]


def test_ml_dtypes_float64_cast_is_the_recorded_one():
    import ml_dtypes

    kind = peer_fact("ml_dtypes", "float64_cast")
    assert (NEAR_TIES_E4M3.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tolist()
            == _float64_cast_reenacted(kind, NEAR_TIES_E4M3, oracle.e4m3_encode))
    assert (NEAR_TIES_E2M1.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).tolist()
            == _float64_cast_reenacted(kind, NEAR_TIES_E2M1, oracle.e2m1_encode))


def test_torch_float64_cast_is_the_recorded_one():
    torch = pytest.importorskip("torch")
    kind = peer_fact("torch", "float64_cast")
    got = torch.from_numpy(NEAR_TIES_E4M3).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert got == _float64_cast_reenacted(kind, NEAR_TIES_E4M3, oracle.e4m3_encode)


def test_torch_and_ml_dtypes_agree_with_oracle_below_overflow():
    import ml_dtypes

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1 << 16) * np.exp2(rng.uniform(-14, 8.7, 1 << 16))).astype(np.float32)
    ml = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    th = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    keep = np.abs(x) <= 464
    np.testing.assert_array_equal(ml[keep], th[keep])
    np.testing.assert_array_equal(oracle.e4m3_encode(x[keep].astype(np.float64)), ml[keep])


# ---------------------------------------------------------------------------------------
# Pinned disagreements (cpu-peers.md sections 3 and 4)
# ---------------------------------------------------------------------------------------

def _block(vals, n=16):
    x = np.zeros((1, n), np.float32)
    x[0, : len(vals)] = vals
    return x


D0 = 2.0**-10  # decode scale; G = 1024 exact in every peer


# Each disagreement: one test with the oracle recipes only (never skipped), one against the
# installed peer (skipped with the reason when the peer is missing).

def _x_tiny_scale():
    # block scale 0.0007 (< 2^-10): RNE underflows to 0
    return _block([6 * 0.0007 * D0, -3 * 0.0007 * D0])


def test_modelopt_raises_tiny_scales_to_2m9():
    """Exact RNE and TRT-LLM give byte 0; ModelOpt clamps to 2^-9 (0x01) first, and its
    data become non-zero."""
    x = _x_tiny_scale()
    ex = oracle.quantize(x, "exact", decode_scale=D0)
    tr = oracle.quantize(x, "trtllm", decode_scale=D0)
    mo = oracle.quantize(x, "modelopt", decode_scale=D0)
    assert ex.scales[0, 0] == 0 and tr.scales[0, 0] == 0
    assert mo.scales[0, 0] == 0x01
    # y = x / (2^-9 * D0): 6*0.0007*512 = 2.15 -> 2 (code 4); -1.075 -> -1 (code 10)
    assert _codes(mo)[0, :2].tolist() == [4, 10]


def test_modelopt_raises_tiny_scales_to_2m9_peer():
    x = _x_tiny_scale()
    pq, ps = _modelopt(x, D0)
    assert ps[0, 0] == 0x01
    assert oracle.unpack_nibbles(pq)[0, :2].tolist() == [4, 10]


def test_modelopt_all_zero_block_scale_is_one():
    mo = oracle.quantize(_block([]), "modelopt", decode_scale=D0)
    tr = oracle.quantize(_block([]), "trtllm", decode_scale=D0)
    assert mo.scales[0, 0] == 0x38 and tr.scales[0, 0] == 0x00


def test_modelopt_all_zero_block_scale_is_one_peer():
    _, ps = _modelopt(_block([]), D0)
    assert ps[0, 0] == 0x38


def _x_subnormal_scale():
    # block scale 2^-8 (E4M3 subnormal 0x02) and an all-zero block
    return np.concatenate([_block([6 * 2.0**-8 * D0, 3 * 2.0**-8 * D0]), _block([])], axis=1)


def test_torchao_floors_scales_at_2m6():
    """torchao stores 2^-6 (0x08) for a 2^-8 block scale and requantizes (coarser codes);
    an all-zero block also gets 0x08."""
    x = _x_subnormal_scale()
    ta = oracle.quantize(x, "torchao", decode_scale=D0)
    ex = oracle.quantize(x, "exact", decode_scale=D0)
    assert ex.scales[0].tolist() == [0x02, 0x00]
    assert ta.scales[0].tolist() == [0x08, 0x08]
    # torchao: y = 6*2^-8 / 2^-6 = 1.5 (code 3), 3*2^-8 / 2^-6 = 0.75 -> tie to 1.0 (code 2)
    assert _codes(ex)[0, :2].tolist() == [7, 5] and _codes(ta)[0, :2].tolist() == [3, 2]


def test_torchao_floors_scales_at_2m6_peer():
    pq, ps = _torchao(_x_subnormal_scale(), D0)
    assert ps[0].tolist() == [0x08, 0x08]
    assert oracle.unpack_nibbles(pq)[0, :2].tolist() == [3, 2]


def _x_zero_scales():
    return np.concatenate([_block([]), _block([6 * 0.0007 * D0])], axis=1)


def test_compressed_tensors_stores_0x20_for_zero_scales():
    G = 1.0 / D0
    ct = oracle.quantize(_x_zero_scales(), "compressed_tensors", encode_scale=G)
    tr = oracle.quantize(_x_zero_scales(), "trtllm", encode_scale=G)
    assert ct.scales[0].tolist() == [0x20, 0x20] and tr.scales[0].tolist() == [0, 0]
    assert np.all(oracle.dequantize(ct) == oracle.dequantize(tr))  # harmless after dequant


def test_compressed_tensors_stores_0x20_for_zero_scales_peer():
    pq, ps = _compressed_tensors(_x_zero_scales(), 1.0 / D0)
    assert ps[0].tolist() == [0x20, 0x20]
    assert not np.any(oracle.unpack_nibbles(pq) & 7)


def _x_jax_zero_scale():
    return np.concatenate([_x_tiny_scale(), _block([])], axis=1)


def test_jax_writes_pm6_and_neg_zero_codes_in_zero_scale_blocks():
    """Scale underflow: x * (1/0) = +-inf -> clipped +-6 (codes 7/15) next to scale byte 0;
    all-zero block: 0 * inf = NaN -> code 8. TRT-LLM writes 0 codes for the zero block."""
    jx = oracle.quantize(_x_jax_zero_scale(), "jax", decode_scale=D0)
    tr = oracle.quantize(_x_jax_zero_scale(), "trtllm", decode_scale=D0)
    assert jx.scales[0].tolist() == [0, 0]
    assert _codes(jx)[0, :3].tolist() == [7, 15, 8] and np.all(_codes(jx)[0, 16:] == 8)
    assert np.all(_codes(tr)[0, 16:] == 0)
    assert np.all(oracle.dequantize(jx) == 0)


def test_jax_writes_pm6_and_neg_zero_codes_in_zero_scale_blocks_peer():
    pq, ps = _jax_peer(_x_jax_zero_scale(), D0)
    assert ps[0].tolist() == [0, 0]
    c = oracle.unpack_nibbles(pq)
    assert c[0, :3].tolist() == [7, 15, 8] and np.all(c[0, 16:] == 8)


def _x_small_negatives():
    return _block([6.0 * 448 * D0, -0.1 * 448 * D0, -0.0])


def test_b12x_stores_plus_zero_for_small_negatives():
    for recipe in ("b12x", "b12x_grouped"):
        b = oracle.quantize(_x_small_negatives(), recipe, encode_scale=1 / D0)
        assert _codes(b)[0, 1:3].tolist() == [0, 0], recipe
    t = oracle.quantize(_x_small_negatives(), "trtllm", encode_scale=1 / D0)
    assert _codes(t)[0, 1:3].tolist() == [8, 8]


def test_b12x_stores_plus_zero_for_small_negatives_peer():
    pq, _ = _b12x_grouped(_x_small_negatives(), 1 / D0)
    assert oracle.unpack_nibbles(pq)[0, 1:3].tolist() == [0, 0]


TIES = [0.75, 1.75, 3.5, 0.25, 1.25, 2.5, 5.0]


def _x_ties():
    return _block([6.0 * 448 * D0] + [t * 448 * D0 for t in TIES])


def test_flashinfer_reference_ties_toward_zero():
    fi = oracle.quantize(_x_ties(), "flashinfer_reference", encode_scale=1 / D0)
    tr = oracle.quantize(_x_ties(), "trtllm", encode_scale=1 / D0)
    assert _codes(fi)[0, 1:8].tolist() == [1, 3, 5, 0, 2, 4, 6]  # 0.5, 1.5, 3 | agree
    assert _codes(tr)[0, 1:8].tolist() == [2, 4, 6, 0, 2, 4, 6]  # 1, 2, 4 (RNE)


def test_flashinfer_reference_ties_toward_zero_peer():
    pq, _ = _flashinfer_reference(_x_ties(), 1 / D0)
    assert oracle.unpack_nibbles(pq)[0, 1:8].tolist() == [1, 3, 5, 0, 2, 4, 6]


def test_flashinfer_reference_huge_quotient_is_code_zero_peer():
    """|y| >= 2^27: torch's fp32 |y - v| are all equal and argmin returns code 0."""
    x = _block([1.0, -1.0])
    pq, ps = _flashinfer_reference(x, 2.0**40)
    ref = oracle.quantize(x, "flashinfer_reference", encode_scale=2.0**40)
    assert ps[0, 0] == ref.scales[0, 0] == 0x7E
    assert oracle.unpack_nibbles(pq)[0, :2].tolist() == _codes(ref)[0, :2].tolist() == [0, 8]


SIGNED_ZERO_CODES = {"trtllm": [8, 8], "torchao": [8, 8], "jax": [8, 8], "modelopt": [0, 8],
                     "compressed_tensors": [0, 8], "b12x": [0, 0], "b12x_grouped": [0, 0],
                     "flashinfer_reference": [0, 8]}


def _x_signed_zero():
    return _block([6.0 * 448 * D0, -0.0, -(2.0**-20) * D0])


def test_signed_zero_disagreements():
    """-0.0 input: hardware cvt / ml_dtypes / torchao keep code 8; ModelOpt,
    compressed-tensors, b12x and flashinfer's reference write 0. Tiny negatives: 8 except
    b12x (0)."""
    got = {r: _codes(oracle.quantize(_x_signed_zero(), r, decode_scale=D0))[0, 1:3].tolist()
           for r in SIGNED_ZERO_CODES}
    assert got == SIGNED_ZERO_CODES


@pytest.mark.parametrize("peer", ["modelopt", "torchao", "compressed_tensors", "jax",
                                  "b12x_grouped", "flashinfer_reference"])
def test_signed_zero_disagreements_peer(peer):
    fn, recipe, form = PEERS[peer]
    pq, _ = fn(_x_signed_zero(), D0 if form == "decode" else 1 / D0)
    assert oracle.unpack_nibbles(pq)[0, 1:3].tolist() == SIGNED_ZERO_CODES[recipe]


def test_jax_quantize_multiplies_by_reciprocals():
    """jax's quantize divides in the source (oracle recipe 'jax_div'), but XLA:CPU runs
    x * (1/s) (recipe 'jax'): find batches where the two recipes differ and check the CPU
    peer follows 'jax'. (XLA:GPU with IEEE division follows 'jax_div': FINDINGS.md.)"""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the reciprocal rewrite is XLA:CPU's; on GPU the peer divides")
    rng = np.random.default_rng(0)
    found = 0
    for trial in range(200):
        d = _f32(2.0 ** rng.uniform(-10, 10))
        x = _data(trial, d, rows=4, cols=64)
        x = np.where(np.abs(x) < 2.0**-126, np.float32(0), x).astype(np.float32)  # CPU FTZ
        ref = oracle.quantize(x.astype(np.float64), "jax", decode_scale=d)
        div = oracle.quantize(x.astype(np.float64), "jax_div", decode_scale=d)
        if np.array_equal(ref.codes, div.codes) and np.array_equal(ref.scales, div.scales):
            continue
        found += 1
        pq, ps = _jax_peer(x, d)
        np.testing.assert_array_equal(ps, ref.scales)
        np.testing.assert_array_equal(oracle.unpack_nibbles(pq), _codes(ref))
    assert found >= 10, f"only {found} batches separate division from reciprocal-multiply"


def _b12x_grouped(x, G):
    torch = pytest.importorskip("torch")
    intr = pytest.importorskip("b12x._lib.intrinsics", reason="b12x (and cutlass) not installed")
    rows, cols = x.shape
    packed, view = intr.quantize_grouped_nvfp4_torch(
        torch.from_numpy(x[None].copy()), torch.tensor([rows]),
        torch.tensor(G, dtype=torch.float32))
    codes = packed.permute(2, 0, 1).contiguous().numpy()[0]
    # the scale view is (32, 4, R/128, 4, Kp/4, groups) over 128x4 bytes: undo the permutation
    buf = view.permute(5, 2, 4, 0, 1, 3).contiguous().view(torch.uint8).reshape(1, -1).numpy()
    return codes, oracle.unswizzle(buf, rows, cols // 16, "swizzled_128x4")[0]


def _flashinfer_reference(x, G):
    torch = pytest.importorskip("torch")
    tq = pytest.importorskip("flashinfer.trace.templates.quantize",
                             reason="flashinfer-python not installed")
    packed, sf = tq._nvfp4_quantize_reference(torch.from_numpy(x.copy()),
                                              torch.tensor([G], dtype=torch.float32))
    return packed.numpy(), _u8(sf)


PEERS["b12x_grouped"] = (_b12x_grouped, "b12x_grouped", "encode")
PEERS["flashinfer_reference"] = (_flashinfer_reference, "flashinfer_reference", "encode")


@pytest.mark.parametrize("peer", ["b12x_grouped", "flashinfer_reference"])
@pytest.mark.parametrize("mag", MAGNITUDES)
def test_oracle_recipe_matches_optional_peer(peer, mag):
    """As test_oracle_recipe_matches_peer, for the optional peers (b12x, flashinfer)."""
    fn, recipe, _form = PEERS[peer]
    for seed in range(3):
        g = _f32(1.0 / (mag * (1 + seed / 7)))
        x = _data(seed * 17 + int(np.log2(mag) + 40), 1 / g, bf16=bool(seed % 2))
        pq, ps = fn(x, g)
        _assert_same(peer, x, pq, ps, oracle.quantize(x.astype(np.float64), recipe,
                                                      encode_scale=g))
