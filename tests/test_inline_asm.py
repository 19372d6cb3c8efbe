"""The kernels' inline asm, run in NumPy (tests/ptx_subset.py) over every code it converts, against
the reference's values: the GPU's fast conversions, which the interpreter does not run (it takes
the exact paths). Operands are packed as Triton packs them, the first element in the low bits.
"""
from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest
import triton.language as tl

import fp8kv.ops
from fp8kv import reference
from fp8kv.formats import E4M3, E5M2
from fp8kv.ops import codec
from fp8kv.ops import paged_attention as pa
from tests.ptx_subset import fp16_bits, run

U16 = np.uint64(0xFFFF)


def _every_byte_at_every_position() -> np.ndarray:
    """256 words whose byte k runs through all 256 codes, in another order at each k."""
    b = np.arange(256, dtype=np.uint64)
    k = [(b * np.uint64(m) + np.uint64(a)) % np.uint64(256) for m, a in ((1, 0), (7, 3),
                                                                          (13, 5), (101, 9))]
    return k[0] | (k[1] << np.uint64(8)) | (k[2] << np.uint64(16)) | (k[3] << np.uint64(24))


def _byte(word, k):
    return ((word >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)


def _halves(pair) -> list[np.ndarray]:
    return [((pair >> np.uint64(16 * k)) & U16).astype(np.uint16) for k in (0, 1)]


def _assert_same_fp16(got_bits, want_bits):
    """Equal bits, or both NaN."""
    got, want = got_bits.view(np.float16), want_bits.view(np.float16)
    same = (got_bits == want_bits) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{int((~same).sum())} differ, first {got_bits[~same][0]:#06x} " \
                       f"for {want_bits[~same][0]:#06x}"


@pytest.mark.parametrize("fmt, asm", [(E4M3, pa._E4M3X4_TO_FP16), (E5M2, pa._E5M2X4_TO_FP16)],
                         ids=["e4m3", "e5m2"])
def test_fp8_codes_become_their_fp16_values(fmt, asm):
    """Four codes per word, two fp16 per output: every code at every position gives its value
    (e5m2: the code as the fp16's high byte, inf and NaN payloads included)."""
    words = _every_byte_at_every_position()
    regs = run(asm.value, {2: words})
    got = _halves(regs["$0"]) + _halves(regs["$1"])
    for k in range(4):
        codes = _byte(words, k)
        want = reference.dequantize(codes, 1.0, fmt, "float16").view(np.uint16)
        _assert_same_fp16(got[k], want)
        if fmt is E5M2:
            np.testing.assert_array_equal(got[k], codes.astype(np.uint16) << 8)


def _nvfp4_times_2_14(codes) -> np.ndarray:
    """fp16 bits of the E2M1 values of ``codes`` (nibbles) times ``2**-14``, -0.0 kept."""
    values = reference.e2m1_values(np.asarray(codes, np.uint8)[..., None])[..., 0]
    return fp16_bits(values * 2.0 ** -14)


@pytest.mark.parametrize("high", [False, True], ids=["low_nibbles", "high_nibbles"])
def test_nvfp4_nibbles_become_their_values_times_2_to_the_minus_14(high):
    asm = pa._NVFP4_ODD_PTX if high else pa._NVFP4_EVEN_PTX
    words = _every_byte_at_every_position()
    regs = run(asm.value, {2: words})
    got = _halves(regs["$0"]) + _halves(regs["$1"])
    for k in range(4):
        nibble = _byte(words, k) >> 4 if high else _byte(words, k) & 0xF
        np.testing.assert_array_equal(got[k], _nvfp4_times_2_14(nibble))


def _scale_codes(n, offset) -> np.ndarray:
    """``n`` e4m3 block-scale codes cycling through 0 and every positive finite code."""
    return ((np.arange(n) * 5 + offset) % 0x7F).astype(np.uint8)


def _scale_fp16(codes) -> np.ndarray:
    return reference.dequantize(codes, 1.0, E4M3, "float16").view(np.uint16)


def test_nvfp4_key_pairs_are_scaled_by_their_own_block_scales():
    """K's fused asm: four bytes' low nibbles then high nibbles, each times the block scale of
    its byte (the operands ``$5``, ``$6`` hold bytes 0-1's and 2-3's scales as fp16 pairs):
    exact products."""
    words = _every_byte_at_every_position()
    scale_codes = [_scale_codes(len(words), 11 * k) for k in range(4)]
    scales = [_scale_fp16(c).astype(np.uint64) for c in scale_codes]
    regs = run(pa._NVFP4_SCALED_PTX.value, {4: words,
                                            5: scales[0] | (scales[1] << np.uint64(16)),
                                            6: scales[2] | (scales[3] << np.uint64(16))})
    even = _halves(regs["$0"]) + _halves(regs["$1"])
    odd = _halves(regs["$2"]) + _halves(regs["$3"])
    for k in range(4):
        scale = _scale_fp16(scale_codes[k]).view(np.float16).astype(np.float64)
        for got, nibble in ((even[k], _byte(words, k) & 0xF), (odd[k], _byte(words, k) >> 4)):
            value = _nvfp4_times_2_14(nibble).view(np.float16).astype(np.float64)
            np.testing.assert_array_equal(got, fp16_bits(value * scale))


def test_nvfp4_value_quads_give_each_token_its_codes_times_its_scale():
    """V's asm: two tokens' four codes (a uint16 each, the first token low) and their two scale
    bytes; output ``c``: code ``c`` of each token times that token's scale."""
    words = _every_byte_at_every_position()
    first, second = _scale_codes(len(words), 0), _scale_codes(len(words), 40)
    regs = run(pa._NVFP4_QUADS_PTX.value,
               {4: words, 5: first.astype(np.uint64) | (second.astype(np.uint64) << np.uint64(8))})
    for c in range(4):
        got = _halves(regs[f"${c}"])
        for token, codes in enumerate((first, second)):
            quad = (words >> np.uint64(16 * token)) & U16
            nibble = ((quad >> np.uint64(4 * c)) & np.uint64(0xF)).astype(np.uint8)
            value = _nvfp4_times_2_14(nibble).view(np.float16).astype(np.float64)
            scale = _scale_fp16(codes).view(np.float16).astype(np.float64)
            np.testing.assert_array_equal(got[token], fp16_bits(value * scale))


def test_nvfp4_lookup_picks_each_code_byte_of_its_table():
    """The dequantize lookup: code ``c`` of a word takes byte ``c & 3`` of table word
    ``c >> 2`` (low, high, negative low, negative high), four codes per output word."""
    rng = np.random.default_rng(0)
    n = 4096
    codes = rng.integers(0, 1 << 32, n, dtype=np.uint64)
    codes[:16] = [sum(((c + i) % 16) << (4 * i) for i in range(8)) for c in range(16)]
    tables = [rng.integers(0, 1 << 32, n, dtype=np.uint64) for _ in range(4)]
    regs = run(codec._BYTE_LOOKUP_PTX.value, {2: codes, 3: tables[0], 4: tables[1],
                                              5: tables[2], 6: tables[3]})
    for i in range(8):
        c = (codes >> np.uint64(4 * i)) & np.uint64(0xF)
        table = np.choose((c >> np.uint64(2)).astype(np.int64), tables)
        want = (table >> (np.uint64(8) * (c & np.uint64(3)))) & np.uint64(0xFF)
        got = (regs["$0" if i < 4 else "$1"] >> np.uint64(8 * (i % 4))) & np.uint64(0xFF)
        np.testing.assert_array_equal(got, want)


def test_e4m3_word_packs_four_rounded_values_first_lowest():
    """Four fp32 values to their e4m3 codes (RNE, saturating, NaN to 0x7F) in one word."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-5, 4, 4000),
                        [448.0, 464.0, 480.0, -1e9, np.inf, -np.inf, np.nan, 2.0 ** -10,
                         2.0 ** -9 * 1.5, 0.0, -0.0, 1.0625, 1.1875]]).astype(np.float32)
    x = np.resize(x, (len(x) + 3) // 4 * 4).reshape(-1, 4)
    bits = x.view(np.uint32).astype(np.uint64)
    regs = run(codec._CVT_WORD_PTX.value, {1 + k: bits[:, k] for k in range(4)})
    for k in range(4):
        np.testing.assert_array_equal(_byte(regs["$0"], k),
                                      reference.quantize(x[:, k], 1.0, E4M3))


_NO_VALUE = {"_PREFETCH_L2"}   # a hint to L2: no result to check


def test_every_asm_of_the_kernels_is_run_here():
    """A new asm block of fp8kv.ops needs a test in this file."""
    tested = {"_E4M3X4_TO_FP16", "_E5M2X4_TO_FP16", "_NVFP4_EVEN_PTX", "_NVFP4_ODD_PTX",
              "_NVFP4_SCALED_PTX", "_NVFP4_QUADS_PTX", "_BYTE_LOOKUP_PTX", "_CVT_WORD_PTX"}
    found = set()
    for info in pkgutil.iter_modules(fp8kv.ops.__path__):
        module = importlib.import_module(f"fp8kv.ops.{info.name}")
        found |= {name for name, v in vars(module).items()
                  if isinstance(v, tl.constexpr) and isinstance(v.value, str) and ";" in v.value}
    assert found - _NO_VALUE == tested
