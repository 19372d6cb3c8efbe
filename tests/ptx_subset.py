"""The PTX instructions of fp8kv's inline asm, evaluated in NumPy, so that CPU tests run the asm
text the GPU runs (Triton's interpreter cannot: it takes the kernels' exact paths instead).

:func:`run` evaluates one asm block on arrays of register values, one element per invocation.
Only what fp8kv's asm uses is here; anything else raises, so a new instruction fails its test
until it is modelled. Register values are unsigned integers (fp32 and fp16 operands as their
bits); ``.b16`` registers hold 16 bits.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np

_MASK = {32: np.uint64(0xFFFFFFFF), 16: np.uint64(0xFFFF)}
_HALVES = re.compile(r"^\{\s*(\w+)\s*,\s*(\w+)\s*\}$")


def _fp16(bits):
    return (bits & _MASK[16]).astype(np.uint16).view(np.float16)


def fp16_bits(values) -> np.ndarray:
    """The bits (uint16) of ``values`` rounded to fp16 (RNE)."""
    return np.asarray(values, np.float16).view(np.uint16)


def _f16x2(lo, hi) -> np.ndarray:
    return fp16_bits(lo).astype(np.uint64) | (fp16_bits(hi).astype(np.uint64) << np.uint64(16))


def _e4m3_to_fp16(byte) -> np.ndarray:
    codes = (byte & np.uint64(0xFF)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float16)


def _fp32_to_e4m3_satfinite(bits) -> np.ndarray:
    """RNE to e4m3, finite values past 448 saturating, NaN to 0x7F (``.satfinite``)."""
    x = (bits & _MASK[32]).astype(np.uint32).view(np.float32)
    codes = np.clip(x, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), codes).astype(np.uint64)


def _prmt(a, b, selector):
    """Byte ``i`` of the result: byte ``s & 7`` of ``{b, a}`` (``s`` the selector's nibble
    ``i``), or with ``s & 8`` that byte's sign bit replicated."""
    pool = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, selector).shape, np.uint64)
    for i in range(4):
        s = (selector >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (pool >> ((s & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(s & np.uint64(8), np.where(byte & np.uint64(0x80), 0xFF, 0), byte)
        out |= byte.astype(np.uint64) << np.uint64(8 * i)
    return out


def _lop3(a, b, c, lut):
    """Each bit: bit ``4a + 2b + c`` of ``lut``."""
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint64)
    for k in range(8):
        if (int(lut) >> k) & 1:
            term = np.full(out.shape, _MASK[32])
            for x, bit in ((a, 4), (b, 2), (c, 1)):
                term &= x if k & bit else ~x & _MASK[32]
            out |= term
    return out


def _shift(x, n, left):
    n = int(n)
    if n >= 32:
        return np.zeros_like(x)
    return ((x << np.uint64(n)) & _MASK[32]) if left else (x >> np.uint64(n))


def _mul_f16x2(a, b):
    def half(x, k):
        return _fp16(x >> np.uint64(16 * k)).astype(np.float32)
    # an fp16 product is exact in fp32: one rounding, to fp16
    return _f16x2(half(a, 0) * half(b, 0), half(a, 1) * half(b, 1))


_BINARY = {
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "shl.b32": lambda a, n: _shift(a, n, True),
    "shr.b32": lambda a, n: _shift(a, n, False),
    "mul.rn.f16x2": _mul_f16x2,
}


def _statements(asm: str):
    body = asm.strip()
    if body.startswith("{") and body.endswith("}"):     # the block's scope
        body = body[1:-1]
    for line in body.split(";"):
        line = line.strip()
        if line and not line.startswith(".reg"):
            op, _, rest = line.partition(" ")
            yield op, [a.strip() for a in re.split(r",(?![^{]*\})", rest)]


def run(asm: str, operands: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate ``asm`` with ``$k`` holding ``operands[k]``; every register's final value (the
    outputs are ``"$0"``, ``"$1"``, ...)."""
    regs = {f"${k}": np.asarray(v).astype(np.uint64) for k, v in operands.items()}

    def value(arg):
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", arg):
            return np.uint64(int(arg, 0) & 0xFFFFFFFF)
        return regs[arg]

    for op, args in _statements(asm):
        dest, srcs = args[0], args[1:]
        if op == "mov.b32" and _HALVES.match(dest):          # split a word into two .b16
            lo, hi = _HALVES.match(dest).groups()
            word = value(srcs[0])
            regs[lo], regs[hi] = word & _MASK[16], (word >> np.uint64(16)) & _MASK[16]
        elif op == "mov.b32" and _HALVES.match(srcs[0]):     # join two .b16 into a word
            lo, hi = _HALVES.match(srcs[0]).groups()
            regs[dest] = (regs[lo] & _MASK[16]) | ((regs[hi] & _MASK[16]) << np.uint64(16))
        elif op in _BINARY:
            regs[dest] = _BINARY[op](value(srcs[0]), value(srcs[1]))
        elif op == "prmt.b32":
            regs[dest] = _prmt(*(value(s) for s in srcs))
        elif op == "lop3.b32":
            regs[dest] = _lop3(value(srcs[0]), value(srcs[1]), value(srcs[2]), int(srcs[3], 0))
        elif op == "cvt.rn.f16x2.e4m3x2":     # the high byte becomes the high half
            a = value(srcs[0])
            regs[dest] = _f16x2(_e4m3_to_fp16(a), _e4m3_to_fp16(a >> np.uint64(8)))
        elif op == "cvt.rn.satfinite.e4m3x2.f32":   # the first source becomes the high byte
            regs[dest] = ((_fp32_to_e4m3_satfinite(value(srcs[0])) << np.uint64(8))
                          | _fp32_to_e4m3_satfinite(value(srcs[1])))
        else:
            raise NotImplementedError(f"PTX not modelled: {op} {', '.join(args)}")
    return regs
