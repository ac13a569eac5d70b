"""The inline-PTX decode blocks of gemm/decode.py, run on the CPU by a small emulator of the
PTX instructions they use, against the exact oracle: every E2M1 code pair and every finite
E4M3 scale byte (subnormals, zero and negatives included).

The emulator follows the PTX ISA semantics of each instruction on uint32 lanes (``prmt`` with
the default mode, ``shl``/``shr`` logical shifts, ``fma.rn.bf16x2`` as an exact product plus
addend rounded once to bf16, subnormals kept). Packing follows Triton's
``elementwise_inline_asm``: element ``i`` of a pack sits in bits ``[i*w, (i+1)*w)`` of its
register. The GPU tests (test_gemm_decode_gpu.py) check the same blocks through ptxas.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import oracle
from nvfp4_jax.gemm import decode

BF16 = ml_dtypes.bfloat16
M32 = np.uint64(0xFFFFFFFF)


def _bf16x2(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = (v & np.uint64(0xFFFF)).astype(np.uint16).view(BF16).astype(np.float64)
    hi = ((v >> np.uint64(16)) & np.uint64(0xFFFF)).astype(np.uint16).view(BF16).astype(np.float64)
    return lo, hi


def _to_bf16_bits(f: np.ndarray) -> np.ndarray:
    return f.astype(np.float32).astype(BF16).view(np.uint16).astype(np.uint64)


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    src = (a & M32) | ((b & M32) << np.uint64(32))  # bytes 0..7 of {b, a}
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        if nib & 0x8:
            raise NotImplementedError("prmt sign-replicate mode is not emulated")
        byte = (src >> np.uint64(8 * nib)) & np.uint64(0xFF)
        out |= byte << np.uint64(8 * i)
    return out


def run_ptx(asm: str, args: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the asm block on uint64 arrays holding 32-bit registers; ``args`` maps ``$i`` to the
    input registers; returns every register, ``$i`` outputs included."""
    regs = dict(args)

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        n = np.uint64(int(tok, 0) & 0xFFFFFFFF)
        return np.full_like(next(iter(args.values())), n)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        ops = [t.strip() for t in rest.split(",")]
        d, srcs = ops[0], ops[1:]
        if op in ("mov.b32", "cvt.u32.u16"):
            mask = M32 if op == "mov.b32" else np.uint64(0xFFFF)
            r = val(srcs[0]) & mask
        elif op == "prmt.b32":
            r = _prmt(val(srcs[0]), val(srcs[1]), int(srcs[2], 0))
        elif op == "shl.b32":
            r = (val(srcs[0]) << np.uint64(int(srcs[1], 0))) & M32
        elif op == "shr.b32":
            r = (val(srcs[0]) & M32) >> np.uint64(int(srcs[1], 0))
        elif op == "mul.lo.u32":
            r = (val(srcs[0]) * val(srcs[1])) & M32
        elif op == "and.b32":
            r = val(srcs[0]) & val(srcs[1])
        elif op == "or.b32":
            r = val(srcs[0]) | val(srcs[1])
        elif op == "fma.rn.bf16x2":
            (a0, a1), (b0, b1), (c0, c1) = (_bf16x2(val(s)) for s in srcs)
            with np.errstate(invalid="ignore", over="ignore"):
                r = _to_bf16_bits(a0 * b0 + c0) | (_to_bf16_bits(a1 * b1 + c1) << np.uint64(16))
        else:
            raise NotImplementedError(f"PTX op {op!r} is not emulated")
        regs[d] = r & M32
    return regs


def _expected(byte: np.ndarray, nibble: str, scale: np.ndarray) -> np.ndarray:
    code = (byte >> 4) if nibble == "hi" else (byte & 0xF)
    w = oracle.formats.e2m1_decode(code.astype(np.int64)) * oracle.formats.e4m3_decode(scale)
    return w / decode.BF16_POST_SCALE


def _scale_regs(scale: np.ndarray) -> np.ndarray:
    """bf16x2 register [S, S] with S = e4m3 * BF16_SCALE_BIAS, as decode_block builds it."""
    s = _to_bf16_bits(oracle.formats.e4m3_decode(scale) * decode.BF16_SCALE_BIAS)
    return s | (s << np.uint64(16))


def _cases():
    """(byte0, byte1, scale) uint8: all 65536 code-byte pairs under a spread of scales (zero,
    subnormal, normal, negative), then all 256 code bytes under every finite E4M3 byte."""
    pairs = np.arange(1 << 16)
    spread = np.array([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0x80, 0x81, 0xB9], np.uint8)
    finite = np.array([s for s in range(256) if s & 0x7F != 0x7F], np.uint8)
    codes = np.arange(256)
    b0 = np.concatenate([np.tile(pairs & 0xFF, spread.size), np.tile(codes, finite.size)])
    b1 = np.concatenate([np.tile(pairs >> 8, spread.size), np.tile(codes ^ 0x5A, finite.size)])
    s = np.concatenate([np.repeat(spread, pairs.size), np.repeat(finite, codes.size)])
    return b0.astype(np.uint8), b1.astype(np.uint8), s


@pytest.mark.parametrize("mode", ["asm2m"])
@pytest.mark.parametrize("nibble", ["lo", "hi"])
def test_2byte_block_is_e2m1_times_e4m3(mode, nibble):
    b0, b1, s = _cases()
    asm = decode.BF16_ASM[mode][nibble]
    codes16 = b0.astype(np.uint64) | (b1.astype(np.uint64) << np.uint64(8))
    out = run_ptx(asm, {"$1": codes16, "$2": _scale_regs(s)})["$0"]
    got0, got1 = _bf16x2(out)
    np.testing.assert_array_equal(got0, _expected(b0, nibble, s))
    np.testing.assert_array_equal(got1, _expected(b1, nibble, s))


@pytest.mark.parametrize("mode", ["asm", "asmm"])
@pytest.mark.parametrize("nibble", ["lo", "hi"])
def test_4byte_block_is_e2m1_times_e4m3(mode, nibble):
    b0, b1, s = _cases()
    b2, b3 = b1 ^ np.uint8(0xA5), b0 ^ np.uint8(0x3C)
    s2 = s[::-1].copy()
    asm = decode.BF16_ASM[mode][nibble]
    word = sum(b.astype(np.uint64) << np.uint64(8 * i) for i, b in enumerate((b0, b1, b2, b3)))
    regs = run_ptx(asm, {"$2": word, "$3": _scale_regs(s), "$4": _scale_regs(s2)})
    for reg, (x, y), sc in (("$0", (b0, b1), s), ("$1", (b2, b3), s2)):
        got0, got1 = _bf16x2(regs[reg])
        np.testing.assert_array_equal(got0, _expected(x, nibble, sc))
        np.testing.assert_array_equal(got1, _expected(y, nibble, sc))


def test_emulator_sees_a_wrong_mask():
    """The emulator is strict enough to catch a one-bit slip in a mask."""
    b0, b1, s = _cases()
    bad = decode.BF16_ASM["asm2m"]["lo"].replace("0x81C081C0", "0x81C080C0")
    codes16 = b0.astype(np.uint64) | (b1.astype(np.uint64) << np.uint64(8))
    got0, got1 = _bf16x2(run_ptx(bad, {"$1": codes16, "$2": _scale_regs(s)})["$0"])
    assert not np.array_equal(got0, _expected(b0, "lo", s))  # lane 0 lost bit 8


def test_asm_blocks_use_only_emulated_ops():
    known = {"mov.b32", "cvt.u32.u16", "prmt.b32", "shl.b32", "shr.b32", "and.b32", "or.b32",
             "mul.lo.u32", "fma.rn.bf16x2"}
    for asm in (a for pair in decode.BF16_ASM.values() for a in pair.values()):
        ops = set(re.findall(r"^\s*([a-z][\w.]+)\s", asm, re.MULTILINE)) - {".reg"}
        assert ops <= known, ops - known
